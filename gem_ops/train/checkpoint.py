"""Checkpoints: model, optimizer and data position, written aside and renamed into place, so a job
killed mid-write leaves the previous checkpoint intact.

Two formats share the step_NNNNNNNN folders: one process's `state.pt`, and a distributed job's
sharded DCP checkpoint (see sharded_checkpoint.py), which `load_checkpoint` reads back as one full state."""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from gem_ops.data.atomic import atomic_path

_NAME = re.compile(r"^step_(\d{8})$")
STATE_FILE = "state.pt"
DCP_METADATA = ".metadata"
PROGRESS_FILE = "progress.pt"


@dataclass
class Checkpoint:
    path: Path
    step: int
    state: dict[str, Any]


def step_folder(directory: str | os.PathLike, step: int) -> Path:
    return Path(directory) / f"step_{step:08d}"


def is_sharded_checkpoint(path: str | os.PathLike) -> bool:
    return (Path(path) / DCP_METADATA).is_file() and (Path(path) / PROGRESS_FILE).is_file()


def is_complete_checkpoint(path: Path) -> bool:
    return (path / STATE_FILE).is_file() or is_sharded_checkpoint(path)


def checkpoint_steps(directory: str | os.PathLike) -> list[int]:
    """Steps of the complete checkpoints (either format) in `directory`, in order."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    return sorted(int(m.group(1)) for p in directory.iterdir() if (m := _NAME.match(p.name)) and is_complete_checkpoint(p))


def save_checkpoint(directory: str | os.PathLike, step: int, state: dict[str, Any], keep: int = 2) -> Path:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    destination = step_folder(directory, step)
    with atomic_path(destination) as tmp:
        tmp.mkdir()
        torch.save({**state, "step": step}, tmp / STATE_FILE)
    for old in checkpoint_steps(directory)[:-keep]:
        shutil.rmtree(step_folder(directory, old), ignore_errors=True)
    return destination


def latest_checkpoint(directory: str | os.PathLike) -> Path | None:
    steps = checkpoint_steps(directory)
    return step_folder(directory, steps[-1]) if steps else None


def load_checkpoint(path: str | os.PathLike) -> Checkpoint:
    """A checkpoint folder (step_NNNNNNNN) or a directory of them (the latest is taken), in either format."""
    path = Path(path)
    if not is_complete_checkpoint(path):
        latest = latest_checkpoint(path)
        if latest is None:
            raise FileNotFoundError(f"no checkpoint in {path} (expected {STATE_FILE}, or a sharded checkpoint, "
                                    "directly or in step_* folders)")
        path = latest
    if is_sharded_checkpoint(path):
        from gem_ops.train.sharded_checkpoint import load_full_state

        state = load_full_state(path)
        return Checkpoint(path, int(state["step"]), state)
    state = torch.load(path / STATE_FILE, map_location="cpu", weights_only=False)
    return Checkpoint(path, int(state["step"]), state)


def previous_checkpoint(runs_dir: str | os.PathLike, before: str) -> Path | None:
    """The checkpoint folder of the latest earlier run (runs_dir/<key>/checkpoints, keys sorted, e.g. dates)."""
    runs_dir = Path(runs_dir)
    if not runs_dir.is_dir():
        return None
    for key in sorted((p.name for p in runs_dir.iterdir() if p.is_dir() and p.name < before), reverse=True):
        if checkpoint_steps(runs_dir / key / "checkpoints"):
            return runs_dir / key / "checkpoints"
    return None
