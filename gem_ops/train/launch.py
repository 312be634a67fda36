"""The command line of a training job of the engine under torchrun: what the gem_foundation_model and
mfu_report assets launch through Dagster Pipes, and what benchmarks/mfu.py launches, alike."""

from __future__ import annotations

import json
import os
import sys
import uuid
from typing import Any


def setting_flags(settings: dict[str, Any]) -> list[str]:
    """`python -m gem_ops.train` flags of settings named as its options (TrainConfig's fields, ...)."""
    args = []
    for name, value in settings.items():
        flag = name.replace("_", "-")
        if isinstance(value, bool):
            args.append(f"--{flag}" if value else f"--no-{flag}")
        elif value is not None:
            args += [f"--{flag}", str(value)]
    return args


LOOPBACK = "127.0.0.1"


def torchrun_prefix(nproc_per_node: int = 1, max_restarts: int = 0, host: str = LOOPBACK) -> list[str]:
    """torchrun on one node whose agent and ranks listen on `host` alone (the loopback address unless set),
    not on every interface as plain `torchrun --standalone` does (gem_ops.train.local_torchrun)."""
    return [sys.executable, "-m", "gem_ops.train.local_torchrun", "--nnodes", "1", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"{host}:0", "--rdzv-id", uuid.uuid4().hex, "--local-addr", host,
            "--nproc-per-node", str(nproc_per_node), "--max-restarts", str(max_restarts)]


def torchrun_command(sequence_logs: str | os.PathLike, plans: str | os.PathLike, *, preset: str, depth: float = 1.0,
                     width: float = 1.0, model_overrides: dict[str, Any] | None = None,
                     train_settings: dict[str, Any] | None = None, nproc_per_node: int = 1, max_restarts: int = 0,
                     extra: list[str] | None = None) -> list[str]:
    """torchrun on one node, running `python -m gem_ops.train` on each of its processes."""
    return [
        *torchrun_prefix(nproc_per_node, max_restarts), "-m", "gem_ops.train",
        "--sequence-logs", str(sequence_logs), "--plans", str(plans),
        "--preset", preset, "--depth", str(depth), "--width", str(width),
        "--model-override", json.dumps(model_overrides or {}), *setting_flags(train_settings or {}), *(extra or []),
    ]
