"""Figures logged with training runs."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")  # no display on servers
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def loss_curves(losses: list[float], eval_steps: list[int], eval_reports: list[dict[str, dict[str, float]]],
                smooth: int = 20) -> plt.Figure:
    """Training loss (raw and moving average) beside eval NE per task over steps."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    steps = np.arange(len(losses))
    left.plot(steps, losses, alpha=0.3, linewidth=0.8, label="train loss")
    if len(losses) >= smooth:
        left.plot(steps[smooth - 1 :], np.convolve(losses, np.ones(smooth) / smooth, mode="valid"),
                  linewidth=1.5, label=f"moving average ({smooth})")
    left.set_xlabel("step")
    left.set_ylabel("loss (sum over tasks)")
    left.legend()
    groups = sorted(k for k in (eval_reports[-1] if eval_reports else {}) if k.startswith("all/"))
    for group in groups:
        right.plot(eval_steps, [r.get(group, {}).get("ne", np.nan) for r in eval_reports], marker="o", label=group[4:])
    right.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
    right.set_xlabel("step")
    right.set_ylabel("eval normalized entropy (lower is better)")
    right.legend()
    fig.tight_layout()
    return fig
