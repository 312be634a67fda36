"""Checkpoints: model, optimizer and data position, written aside and renamed into place, so a job
killed mid-write leaves the previous checkpoint intact."""

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


@dataclass
class Checkpoint:
    path: Path
    step: int
    state: dict[str, Any]


def checkpoint_steps(directory: str | os.PathLike) -> list[int]:
    directory = Path(directory)
    if not directory.is_dir():
        return []
    return sorted(int(m.group(1)) for p in directory.iterdir() if (m := _NAME.match(p.name)) and (p / STATE_FILE).is_file())


def save_checkpoint(directory: str | os.PathLike, step: int, state: dict[str, Any], keep: int = 2) -> Path:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    destination = directory / f"step_{step:08d}"
    with atomic_path(destination) as tmp:
        tmp.mkdir()
        torch.save({**state, "step": step}, tmp / STATE_FILE)
    for old in checkpoint_steps(directory)[:-keep]:
        shutil.rmtree(directory / f"step_{old:08d}", ignore_errors=True)
    return destination


def latest_checkpoint(directory: str | os.PathLike) -> Path | None:
    steps = checkpoint_steps(directory)
    return Path(directory) / f"step_{steps[-1]:08d}" if steps else None


def load_checkpoint(path: str | os.PathLike) -> Checkpoint:
    """A checkpoint folder (step_NNNNNNNN) or a directory of them (the latest is taken)."""
    path = Path(path)
    if not (path / STATE_FILE).is_file():
        latest = latest_checkpoint(path)
        if latest is None:
            raise FileNotFoundError(f"no checkpoint in {path} (expected {STATE_FILE} or step_*/{STATE_FILE})")
        path = latest
    state = torch.load(path / STATE_FILE, map_location="cpu", weights_only=False)
    return Checkpoint(path, int(state["step"]), state)
