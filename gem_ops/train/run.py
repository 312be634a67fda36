"""Shared by the Dagster asset and the training command line: where an earlier run's checkpoint is, and
how many eval rows make the packaged model's input example."""

from __future__ import annotations

import os
from pathlib import Path

from gem_ops.train.checkpoint import checkpoint_steps

INPUT_EXAMPLE_ROWS = 4


def previous_checkpoint(runs_dir: str | os.PathLike, before: str) -> Path | None:
    """The checkpoint folder of the latest earlier run (runs_dir/<key>/checkpoints, keys sorted, e.g. dates)."""
    runs_dir = Path(runs_dir)
    if not runs_dir.is_dir():
        return None
    for key in sorted((p.name for p in runs_dir.iterdir() if p.is_dir() and p.name < before), reverse=True):
        if checkpoint_steps(runs_dir / key / "checkpoints"):
            return runs_dir / key / "checkpoints"
    return None
