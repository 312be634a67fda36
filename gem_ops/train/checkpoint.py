"""Training checkpoints with torch.distributed.checkpoint (DCP), one format for every world size.

Every rank writes its own shards of the model and optimizer (TorchRec-sharded tables, FSDP2 dense
layers, or, on one rank, whole tensors) into a hidden `.step_NNNNNNNN.partial` folder; rank 0 adds the
progress (step, losses, ...) and renames the folder into place once every rank is done, so a job killed
mid-write leaves the previous checkpoint as the latest complete one.

A folder step_NNNNNNNN holds DCP's `.metadata` and shard files plus `progress.pt`. It loads back into
any sharding and world size (DCP reshards by global offsets), and as one full state on one process
without a process group (`load_checkpoint`: warm starts and exports).

Nothing in a checkpoint runs code when loaded: the progress and the converted state load with
`weights_only=True`, and DCP's `.metadata` (a pickle that DCP reads with plain `pickle.load`) is first
read by an unpickler that admits DCP's own metadata classes, torch dtypes and sizes, and nothing else.
"""

from __future__ import annotations

import io
import os
import pickle
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

_NAME = re.compile(r"^step_(\d{8})$")
DCP_METADATA = ".metadata"
PROGRESS_FILE = "progress.pt"


@dataclass
class Checkpoint:
    path: Path
    step: int
    state: dict[str, Any]  # "model", "optimizer" as full tensors, and the progress entries


def step_folder(directory: str | os.PathLike, step: int) -> Path:
    return Path(directory) / f"step_{step:08d}"


def is_complete_checkpoint(path: str | os.PathLike) -> bool:
    return (Path(path) / DCP_METADATA).is_file() and (Path(path) / PROGRESS_FILE).is_file()


def checkpoint_steps(directory: str | os.PathLike) -> list[int]:
    """Steps of the complete checkpoints in `directory`, in order."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    return sorted(int(m.group(1)) for p in directory.iterdir()
                  if (m := _NAME.match(p.name)) and is_complete_checkpoint(p))


def latest_checkpoint(directory: str | os.PathLike) -> Path | None:
    steps = checkpoint_steps(directory)
    return step_folder(directory, steps[-1]) if steps else None


def checkpoint_folder(path: str | os.PathLike) -> Path:
    """A checkpoint folder as it is, or the latest complete one in a folder of them."""
    path = Path(path)
    if is_complete_checkpoint(path):
        return path
    latest = latest_checkpoint(path)
    if latest is None:
        raise FileNotFoundError(f"no checkpoint in {path} (expected {DCP_METADATA} and {PROGRESS_FILE}, directly or "
                                "in step_* folders)")
    return latest


def save_checkpoint(directory: str | os.PathLike, step: int, app_state: dict[str, Any], progress: dict[str, Any],
                    keep: int = 2) -> Path:
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
        replaced = destination.with_name(f".{destination.name}.replaced")
        if destination.exists():  # a re-run of the same step after a restart: set aside, never missing
            shutil.rmtree(replaced, ignore_errors=True)
            os.replace(destination, replaced)
        os.replace(partial, destination)
        shutil.rmtree(replaced, ignore_errors=True)
        for old in checkpoint_steps(directory)[:-keep]:
            shutil.rmtree(step_folder(directory, old), ignore_errors=True)
    dist.barrier()  # nobody goes on (or gets killed) believing a checkpoint exists before it does
    return destination


class _MetadataUnpickler(pickle.Unpickler):
    """Admits what DCP writes into `.metadata` and refuses every other global (no code runs)."""

    ALLOWED = {"torch.distributed.checkpoint.metadata": None,  # any of its classes
               "torch.distributed.checkpoint.filesystem": {"_StorageInfo", "_StoragePrefix"},
               "torch.serialization": {"_get_layout"}, "torch": {"Size"},
               "pathlib": {"PosixPath", "PurePosixPath"}, "collections": {"OrderedDict"}}

    def find_class(self, module: str, name: str):
        names = self.ALLOWED.get(module, set())
        dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if names is None or name in names or dtype:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name}")


def check_metadata(path: str | os.PathLike) -> None:
    """Refuses a checkpoint whose DCP `.metadata` holds anything but checkpoint metadata."""
    file = Path(path) / DCP_METADATA
    try:
        _MetadataUnpickler(io.BytesIO(file.read_bytes())).load()
    except pickle.UnpicklingError as error:
        raise pickle.UnpicklingError(f"{file} is not a safe checkpoint: it refers to {error}, which a checkpoint "
                                     "never holds; not loaded") from None


def load_into(path: str | os.PathLike, app_state: dict[str, Any]) -> dict[str, Any]:
    """Collective: loads the checkpoint in place into `app_state` (this rank's shards) and returns its
    progress. Keys of app_state absent from the checkpoint are an error; extra checkpoint keys are not."""
    path = Path(path)
    if not is_complete_checkpoint(path):
        raise FileNotFoundError(f"{path} is not a checkpoint (expected {DCP_METADATA} and {PROGRESS_FILE})")
    check_metadata(path)
    dcp.load(app_state, checkpoint_id=path)
    return read_progress(path)


def read_progress(path: str | os.PathLike) -> dict[str, Any]:
    return torch.load(Path(path) / PROGRESS_FILE, map_location="cpu", weights_only=True)


def load_checkpoint(path: str | os.PathLike) -> Checkpoint:
    """One process, no process group: a checkpoint folder (or the latest in a folder of them) as full
    tensors, plus its progress."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    path = checkpoint_folder(path)
    check_metadata(path)
    with tempfile.TemporaryDirectory(prefix="gem-dcp-") as tmp:
        dcp_to_torch_save(path, Path(tmp) / "state.pt")
        state = torch.load(Path(tmp) / "state.pt", map_location="cpu", weights_only=True)
    progress = read_progress(path)
    return Checkpoint(path, int(progress["step"]), {**state, **progress})


def previous_checkpoint(runs_dir: str | os.PathLike, before: str) -> Path | None:
    """The checkpoint folder of the latest earlier partition: runs_dir/<key>/runs/<run>/checkpoints (the
    newest run of the newest key below `before`, keys sorted, e.g. dates), or runs_dir/<key>/checkpoints."""
    runs_dir = Path(runs_dir)
    if not runs_dir.is_dir():
        return None
    for key in sorted((p.name for p in runs_dir.iterdir() if p.is_dir() and p.name < before), reverse=True):
        folders = [f for f in (*(runs_dir / key / "runs").glob("*/checkpoints"), runs_dir / key / "checkpoints")
                   if checkpoint_steps(f)]
        if folders:
            return max(folders, key=lambda f: latest_checkpoint(f).stat().st_mtime)
    return None
