"""sequence_logs' part files written in background threads, the length quantiles of what was written, and the
stage timer that says where a build spends its time."""

from __future__ import annotations

import contextlib
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import polars as pl

from gem_ops.data.sequence_layout import EXAMPLES, TIMELINES


class StageTimer:
    """Wall time per named stage, summed over buckets: where preparation spends its time."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start


class SequenceLogsWriter:
    """Numbered part files: timelines per range of users, examples per input file (and bucket).
    The loader reads parts in name order, so example indices are row numbers in that order.

    Files are written in two background threads (Parquet encoding releases the GIL, so it overlaps
    the numpy work of the next range or part, and the last files finish side by side), at most
    `max_pending` at a time so memory stays bounded."""

    def __init__(self, folder: Path, max_history_len: int, timer: StageTimer, max_pending: int = 3):
        self.folder, self.max_history_len, self.timer, self.max_pending = folder, max_history_len, timer, max_pending
        (folder / TIMELINES).mkdir(parents=True)
        (folder / EXAMPLES).mkdir()
        self.n_users = self.n_timeline_events = self.n_examples = self.n_eval = 0
        self._timeline_files = self._example_files = self.n_timeline_parts = 0
        self._timeline_lengths: list[np.ndarray] = []
        self._history_lengths: list[np.ndarray] = []
        self._pool = ThreadPoolExecutor(max_workers=2)
        self._pending: list[Future] = []

    def write_timelines(self, timelines: pl.DataFrame, timeline_lengths: np.ndarray) -> None:
        path = self.folder / TIMELINES / f"part-{self._timeline_files:05d}.parquet"
        self._submit(timelines, path)
        self._timeline_files += 1
        self.n_timeline_parts = self._timeline_files
        self.n_users += timelines.height
        self.n_timeline_events += int(timeline_lengths.sum())
        self._timeline_lengths.append(timeline_lengths)

    def write_examples(self, examples: pl.DataFrame) -> None:
        path = self.folder / EXAMPLES / f"part-{self._example_files:05d}.parquet"
        self._submit(examples, path)
        self._example_files += 1
        self.n_examples += examples.height
        self.n_eval += int(examples["split"].sum())
        self._history_lengths.append(np.minimum(examples["history_end"].to_numpy(), self.max_history_len))

    def _submit(self, frame: pl.DataFrame, path: Path) -> None:
        # Uncompressed: lz4 made timelines 2.3x smaller on disk but doubled the CPU time of writing
        # them, the largest single item in a build's profile on 2 cores; examples compress little
        # anyway. No statistics: loaders read whole files, so statistics buy nothing.
        with self.timer("write"):
            while len(self._pending) >= self.max_pending:
                self._pending.pop(0).result()  # re-raises a failed write
        self._pending.append(self._pool.submit(frame.write_parquet, path, compression="uncompressed", statistics=False))

    def close(self) -> None:
        with self.timer("write"):
            try:
                while self._pending:
                    self._pending.pop(0).result()
            finally:
                for future in self._pending:
                    future.cancel()
                self._pool.shutdown()

    def timeline_quantiles(self) -> dict[str, float]:
        return _quantiles(np.concatenate(self._timeline_lengths)) if self._timeline_lengths else {}

    def history_quantiles(self) -> dict[str, float]:
        return _quantiles(np.concatenate(self._history_lengths)) if self._history_lengths else {}


def _quantiles(values: np.ndarray) -> dict[str, float]:
    """Quantiles of non-negative integer lengths from their histogram: one pass, no sort."""
    if values.size == 0:
        return {}
    cumulative = np.cumsum(np.bincount(values))
    qs = {"p50": 0.5, "p90": 0.9, "p99": 0.99}
    out = {k: float(np.searchsorted(cumulative, q * values.size)) for k, q in qs.items()}
    return out | {"max": float(values.max()), "mean": float(values.mean())}
