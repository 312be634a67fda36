"""Figures logged with data assets: history-length histograms and batch-balance comparisons."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")  # no display on servers
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def length_histogram(lengths: dict[str, np.ndarray], title: str) -> plt.Figure:
    """Histogram of sequence lengths on log-spaced bins, one series per entry."""
    fig, ax = plt.subplots(figsize=(7, 4))
    top = max((int(v.max()) for v in lengths.values() if v.size), default=1)
    bins = np.unique(np.concatenate([[0, 1], np.geomspace(1, max(top, 2) + 1, 40).astype(int)]))
    for name, values in lengths.items():
        ax.hist(values, bins=bins, histtype="step", linewidth=1.5, label=f"{name} (n={values.size:,})")
    ax.set_xscale("symlog", linthresh=1)
    ax.set_yscale("log")
    ax.set_xlabel("length (events)")
    ax.set_ylabel("count")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    return fig


def balance_chart(figures: dict[int, dict[str, float]]) -> plt.Figure:
    """Bars of max/mean step cost per world size, random assignment beside Base Batch Shuffling."""
    world_sizes = sorted(figures)
    x = np.arange(len(world_sizes))
    fig, ax = plt.subplots(figsize=(7, 4))
    for offset, key, label in ((-0.2, "random", "random assignment"), (0.2, "bbs", "Base Batch Shuffling")):
        values = [figures[w][key] for w in world_sizes]
        bars = ax.bar(x + offset, values, width=0.4, label=label)
        ax.bar_label(bars, fmt="%.3f", fontsize=8)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(x, [f"{w} ranks" for w in world_sizes])
    ax.set_ylabel("max / mean step cost across ranks")
    ax.set_title("Per-step load imbalance")
    ax.legend()
    fig.tight_layout()
    return fig
