"""A few FP8 training steps of the small GPU preset, compiled (argv: dense or model), in a process of its own;
prints one JSON line: the losses and whether every gradient stayed finite. tests/test_training_acceleration.py runs it
twice against one Inductor cache folder (the second process finds the first one's compiled graphs)."""

import json
import sys

import numpy as np
import torch

from gem_ops.model.config import model_config
from gem_ops.model.features import model_input
from gem_ops.train.acceleration import autocast_context, prepare_for_training
from gem_ops.train.config import TrainConfig
from gem_ops.train.model_state import seeded_model
from tests.model_inputs import SPEC, random_batch

GPU_SMALL = model_config("gem_gpu", width=0.25, **{"embedding.item_buckets": 1024, "embedding.user_buckets": 1024})


def main(compile_setting: str = "dense", steps: int = 3) -> None:
    device = torch.device("cuda")
    model = seeded_model(SPEC, GPU_SMALL).to(device)
    prepare_for_training(model, TrainConfig(precision="fp8", compile=compile_setting), device)
    rng = np.random.default_rng(0)
    losses, finite = [], True
    for step in range(steps):
        lengths = rng.integers(1, GPU_SMALL.sequence.max_history_len, 64).tolist()
        x = model_input(random_batch(lengths, seed=step), SPEC, GPU_SMALL, with_level_sizes=True).to(device)
        with autocast_context(device, "fp8"):
            loss = model.loss(x)[0]
        model.zero_grad(set_to_none=True)
        loss.backward()
        losses.append(float(loss.detach()))
        finite &= all(bool(torch.isfinite(p.grad).all()) for p in model.parameters() if p.grad is not None)
    print(json.dumps({"losses": losses, "finite": finite}))


if __name__ == "__main__":
    main(*sys.argv[1:2], *map(int, sys.argv[2:]))
