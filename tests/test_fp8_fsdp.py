"""The tensorwise_triton FP8 layer under FSDP2: two gloo ranks, each layer fully sharded, give the
gradients of the same layers run on each rank's half of the batch in one process, averaged (each rank
scales its own activations and gradients, so that average is the exact expectation)."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from gem_ops.train.fp8_linear import convert_to_float8_linear

WORLD = 2


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 16))
    convert_to_float8_linear(model, lambda m, name: True)
    return model


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(2 * 37, 32, generator=generator), torch.randn(2 * 37, 16, generator=generator)


def _loss(model: nn.Module, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x)
    return (out.float() - target).square().mean()


def _rank(rank: int, port: int, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        model = _model()
        mesh = init_device_mesh("cpu", (WORLD,))
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        x, target = (t.chunk(WORLD)[rank] for t in _batch())
        _loss(model, x, target).backward()
        grads = {name: p.grad.full_tensor() for name, p in model.named_parameters()}
        if rank == 0:
            torch.save(grads, out)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(not dist.is_gloo_available(), reason="needs gloo")
def test_fsdp2_sharded_fp8_layers_average_the_ranks_gradients(tmp_path):
    out = str(tmp_path / "grads.pt")
    mp.start_processes(_rank, args=(_free_port(), out), nprocs=WORLD, start_method="spawn", join=True)
    sharded = torch.load(out)

    model = _model()
    for x, target in zip(*(t.chunk(WORLD) for t in _batch())):
        (_loss(model, x, target) / WORLD).backward()
    for name, param in model.named_parameters():
        torch.testing.assert_close(sharded[name], param.grad, rtol=1e-4, atol=1e-6, msg=name)
