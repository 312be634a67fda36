"""The job's process group: torchrun's environment when launched by it, otherwise one private rank, so
the same training code runs under torchrun, as `python -m gem_ops.train`, and as a function call."""

from __future__ import annotations

import contextlib
import datetime
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Topology:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device

    @property
    def nodes(self) -> int:
        return self.world_size // self.local_world_size


def backend_for(device: torch.device) -> str:
    # CPU tensors (object gathers, eval outputs) go through gloo even on a CUDA job.
    return "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"


def launched_by_torchrun() -> bool:
    return all(name in os.environ for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def torchrun_store(rank: int, world_size: int, timeout: datetime.timedelta) -> dist.Store:
    """torchrun's TCPStore, keys prefixed by the restart attempt. With torchrun's default shared
    rendezvous store, a group restarted by --max-restarts otherwise reads the dead attempt's gloo
    addresses and fails to connect (pytorch/pytorch#135712)."""
    agent_hosts_it = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                          is_master=not agent_hosts_it and rank == 0, timeout=timeout)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"gem_ops/{os.environ.get('TORCHELASTIC_RUN_ID', '')}/attempt_{attempt}", store)


@contextlib.contextmanager
def job_process_group(device: str | torch.device = "cpu", timeout_s: float = 1800.0) -> Iterator[Topology]:
    """Joins torchrun's group (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR/PORT), or makes
    a one-rank group; an already initialised group is used as it is. Destroys only what it created."""
    device = torch.device(device)
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be cpu or cuda, got {device}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device cuda was asked for but torch sees no CUDA device")
    created = False
    if not dist.is_initialized():
        timeout = datetime.timedelta(seconds=timeout_s)
        if launched_by_torchrun():
            if device.type == "cuda":
                device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
                torch.cuda.set_device(device)
            rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
            dist.init_process_group(backend_for(device), store=torchrun_store(rank, world_size, timeout),
                                    rank=rank, world_size=world_size, timeout=timeout)
        else:
            if device.type == "cuda":
                device = torch.device("cuda", torch.cuda.current_device())
            dist.init_process_group(backend_for(device), store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        created = True
    elif device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    world_size = dist.get_world_size()
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size)) if launched_by_torchrun() else world_size
    topology = Topology(dist.get_rank(), world_size, int(os.environ.get("LOCAL_RANK", 0)), local_world_size, device)
    try:
        yield topology
    finally:
        if created:
            dist.destroy_process_group()
