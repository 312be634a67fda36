"""Checkpoints of a distributed job with torch.distributed.checkpoint (DCP): every rank writes its own
shards of the model (TorchRec-sharded tables, FSDP2 dense layers) and optimizer into one folder; rank 0
adds the progress (step, losses, ...) and renames the folder into place once every rank is done, so a
job killed mid-write leaves the previous checkpoint as the latest complete one.

A folder step_NNNNNNNN holds DCP's `.metadata` and shard files plus `progress.pt`. It loads back into
any sharding and world size (DCP reshards by global offsets), and as one full state on one process
(`load_full_state`, for warm starts of the single-process loop and for exporting the model).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from gem_ops.train.checkpoint import PROGRESS_FILE, checkpoint_steps, is_sharded_checkpoint, step_folder



def save_sharded_checkpoint(directory: str | os.PathLike, step: int, app_state: dict[str, Any],
                            progress: dict[str, Any], keep: int = 2) -> Path:
    """Collective: every rank calls it with its own shards; rank 0 writes the progress and publishes."""
    directory = Path(directory)
    destination = step_folder(directory, step)
    partial = directory / f".{destination.name}.partial"
    rank = dist.get_rank()
    if rank == 0:
        directory.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(partial, ignore_errors=True)  # left by a job killed mid-write
        partial.mkdir()
    dist.barrier()
    dcp.save(app_state, checkpoint_id=partial)
    dist.barrier()  # every rank's shard files are written (rank 0 wrote .metadata last, inside save)
    if rank == 0:
        torch.save({**progress, "step": step}, partial / PROGRESS_FILE)
        if destination.exists():  # a re-run of the same step after a restart
            shutil.rmtree(destination)
        os.replace(partial, destination)
        for old in checkpoint_steps(directory)[:-keep]:
            shutil.rmtree(step_folder(directory, old), ignore_errors=True)
    dist.barrier()  # nobody goes on (or gets killed) believing a checkpoint exists before it does
    return destination


def load_sharded_checkpoint(path: str | os.PathLike, app_state: dict[str, Any]) -> dict[str, Any]:
    """Collective: loads the checkpoint in place into `app_state` (this rank's shards) and returns its
    progress. Keys of app_state absent from the checkpoint are an error; extra checkpoint keys are not."""
    path = Path(path)
    if not is_sharded_checkpoint(path):
        raise FileNotFoundError(f"{path} is not a sharded checkpoint (expected .metadata and {PROGRESS_FILE})")
    dcp.load(app_state, checkpoint_id=path)
    return torch.load(path / PROGRESS_FILE, map_location="cpu", weights_only=False)


def load_full_state(path: str | os.PathLike) -> dict[str, Any]:
    """One process, no process group: the whole checkpoint as full tensors, plus its progress."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    path = Path(path)
    with tempfile.TemporaryDirectory(prefix="gem-dcp-") as tmp:
        dcp_to_torch_save(path, Path(tmp) / "state.pt")
        state = torch.load(Path(tmp) / "state.pt", map_location="cpu", weights_only=False)
    return {**state, **torch.load(path / PROGRESS_FILE, map_location="cpu", weights_only=False)}
