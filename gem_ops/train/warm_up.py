"""The inputs of a pass over every history-length bucket before the first step: the attention kernels tune their
launch configuration per bucket of a batch's mean length (powers of two from 16) and compile each candidate on a
new bucket's first call, and compiled dense blocks recompile on new shapes. Left to the steps, that work lands
whenever a batch first reaches a bucket, seconds inside a timed window on a machine whose caches are cold.

Each bucket's input holds real examples cut to that length with every label masked: its loss is zero, so every
gradient is zero, and neither the dense optimizer (not stepped) nor a table optimizer fused into the backward
moves a weight (the engine runs the passes)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import torch

from gem_ops.model.features import ModelInput, model_input

SMALLEST_BUCKET = 16  # kernels/triton/triton_jagged_attention.py: next_power_of_2(max(mean_length, 16))


def length_buckets(max_len: int) -> list[int]:
    """The mean lengths that reach each bucket up to `max_len`'s: 16, 32, ... and `max_len` itself."""
    buckets, length = [], SMALLEST_BUCKET
    while length < max_len:
        buckets.append(length)
        length *= 2
    return buckets + [max_len] if max_len >= 1 else []


def warm_up_inputs(logs, spec, model_config, batch_size: int = 64,
                   size_bucket: float = 0.0) -> Iterator[tuple[int, ModelInput]]:
    """(length, a zero-label input of `batch_size` training examples cut to it) per length bucket that some
    example's history reaches, its sizes bucketed as the training steps' are (`size_bucket`: a padded input
    compiles another graph than an exact one). The choice depends on the logs alone: every rank gets the same
    lengths, so a job's collectives match."""
    history = logs.history_lengths(model_config.sequence.max_history_len)
    train = logs.split_indices("train")
    for length in length_buckets(model_config.sequence.max_history_len):
        chosen = train[history[train] >= length][:batch_size]
        if chosen.size == 0:
            return  # no batch reaches this bucket, nor any longer one
        batch = logs.batch(chosen, length)
        batch = dataclasses.replace(batch, label_mask=torch.zeros_like(batch.label_mask))
        yield length, model_input(batch, spec, model_config, with_level_sizes=True, size_bucket=size_bucket)
