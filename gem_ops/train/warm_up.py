"""A pass over every history-length bucket before the first step: the attention kernels tune their launch
configuration per bucket of a batch's mean length (powers of two from 16) and compile each candidate on a new
bucket's first call, and compiled dense blocks recompile on new shapes. Left to the steps, that work lands
whenever a batch first reaches a bucket, seconds inside a timed window on a machine whose caches are cold.

Each bucket runs one forward and backward on real examples cut to that length with every label masked: the
loss is zero, so every gradient is zero, and neither the dense optimizer (not stepped) nor a table optimizer
fused into the backward moves a weight."""

from __future__ import annotations

import dataclasses

import torch

from gem_ops.model.features import model_input
from gem_ops.train.acceleration import autocast_context
from gem_ops.train.loss import global_batch_loss

SMALLEST_BUCKET = 16  # kernels/triton/triton_jagged_attention.py: next_power_of_2(max(mean_length, 16))


def length_buckets(max_len: int) -> list[int]:
    """The mean lengths that reach each bucket up to `max_len`'s: 16, 32, ... and `max_len` itself."""
    buckets, length = [], SMALLEST_BUCKET
    while length < max_len:
        buckets.append(length)
        length *= 2
    return buckets + [max_len] if max_len >= 1 else []


def warm_up_lengths(module, logs, spec, model_config, precision: str, device: torch.device, world_size: int,
                    batch_size: int = 64) -> list[int]:
    """Runs a zero-loss forward and backward per length bucket on `batch_size` training examples whose history
    reaches it (the same on every rank: the choice depends on the logs alone, so collectives match). Returns the
    lengths run. The caller clears the gradients."""
    history = logs.history_lengths(model_config.sequence.max_history_len)
    train = logs.split_indices("train")
    ran = []
    for length in length_buckets(model_config.sequence.max_history_len):
        chosen = train[history[train] >= length][:batch_size]
        if chosen.size == 0:
            break  # no batch reaches this bucket, nor any longer one
        batch = logs.batch(chosen, length)
        batch = dataclasses.replace(batch, label_mask=torch.zeros_like(batch.label_mask))
        x = model_input(batch, spec, model_config, with_level_sizes=True).to(device)
        with autocast_context(device, precision):
            sums = module.loss_sums(x)
        loss, _, _ = global_batch_loss(sums, world_size)
        loss.backward()
        ran.append(length)
    return ran

