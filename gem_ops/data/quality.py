"""Data-quality measurements behind the asset checks: null rates, leakage, history lengths."""

from __future__ import annotations

import numpy as np
import polars as pl

from gem_ops.data.loader import SequenceLogs


def null_rates(frame: pl.DataFrame) -> dict[str, float]:
    if frame.height == 0:
        return {c: 0.0 for c in frame.columns}
    return {c: frame[c].null_count() / frame.height for c in frame.columns}


def leakage_violations(logs: SequenceLogs) -> dict[str, int]:
    """Counts examples whose history breaks the time rule, checking the stored pointers directly.

    leaked: the last history event is at or after the request time.
    missed: the event right after the history is strictly earlier than the request (history cut short).
    unsorted: timeline events out of time order.
    """
    ts = logs.timeline_column("timestamp")
    offsets = logs.timeline_offsets
    start = offsets[logs.column("user_row")]
    end = start + logs.column("history_end")
    request = logs.column("timestamp")
    has_history = logs.column("history_end") > 0
    leaked = int(np.count_nonzero(has_history & (ts[np.maximum(end - 1, 0)] >= request)))
    user_end = offsets[logs.column("user_row") + 1]
    has_next = end < user_end
    missed = int(np.count_nonzero(has_next & (ts[np.minimum(end, len(ts) - 1)] < request)))
    same_user = np.ones(len(ts), dtype=bool)
    same_user[offsets[1:-1]] = False  # the first event of each timeline has no predecessor in it
    unsorted = int(np.count_nonzero(same_user[1:] & (np.diff(ts) < 0)))
    return {"leaked": leaked, "missed": missed, "unsorted": unsorted}


def length_distribution(lengths: np.ndarray) -> dict[str, float]:
    lengths = np.asarray(lengths)
    if lengths.size == 0:
        return {"count": 0}
    return {
        "count": int(lengths.size),
        "mean": float(lengths.mean()),
        "p50": float(np.quantile(lengths, 0.5)),
        "p90": float(np.quantile(lengths, 0.9)),
        "p99": float(np.quantile(lengths, 0.99)),
        "max": float(lengths.max()),
        "empty_share": float(np.mean(lengths == 0)),
    }
