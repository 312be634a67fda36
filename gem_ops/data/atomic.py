"""Atomic outputs: everything is written beside its destination, then renamed into place."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import polars as pl


@contextlib.contextmanager
def atomic_path(destination: str | os.PathLike) -> Iterator[Path]:
    """Yields a temporary path (file or folder) beside `destination`; renames it there on success.

    On failure the temporary is removed and any previous `destination` is left untouched.
    """
    destination = Path(destination)
    destination.parent.mkdir(parents=True, exist_ok=True)
    remove_abandoned(destination)
    tmp = Path(tempfile.mkdtemp(prefix=f".{destination.name}.{os.getpid()}.",
                                dir=destination.parent)) / destination.name
    try:
        yield tmp
        if destination.is_dir() and not destination.is_symlink():
            # A folder cannot be replaced in one rename: move the old one aside first.
            old = tmp.parent / (destination.name + ".old")
            os.replace(destination, old)
            os.replace(tmp, destination)
        else:
            os.replace(tmp, destination)
    finally:
        shutil.rmtree(tmp.parent, ignore_errors=True)


def remove_abandoned(destination: Path) -> list[Path]:
    """Removes the temporary folders beside `destination` that a killed writer left: each is named after its
    writer's pid, and one whose process is gone is abandoned (a live writer's is left alone)."""
    removed = []
    for folder in destination.parent.glob(f".{destination.name}.*"):
        pid = folder.name[len(destination.name) + 2:].split(".", 1)[0]
        if folder.is_dir() and pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def write_parquet_atomic(frame: pl.DataFrame, destination: str | os.PathLike, **kwargs) -> Path:
    kwargs.setdefault("compression", "lz4")
    with atomic_path(destination) as tmp:
        frame.write_parquet(tmp, **kwargs)
    return Path(destination)
