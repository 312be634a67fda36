"""What a rank trains and evaluates on: its rows of a shuffled_batches plan, and length-sorted eval batches."""

from __future__ import annotations

import os
from collections.abc import Iterator

import numpy as np

from gem_ops.data.batch_shuffling import read_rank_plan
from gem_ops.data.loader import SequenceLogs


class PlanSchedule:
    """Global step -> this rank's example indices. Epoch e visits the plan's steps in an order seeded by
    (seed, e), so any step can be found again from its number alone (a resumed job needs no other state)."""

    def __init__(self, plan_path: str | os.PathLike, rank: int, epochs: int, seed: int):
        self.steps = read_rank_plan(plan_path, rank)  # [plan_steps, rank_batch_size]
        if len(self.steps) == 0:
            raise ValueError(f"{plan_path}: the plan has no steps (too few training examples for its batch size)")
        self.epochs, self.seed = epochs, seed

    @property
    def plan_steps(self) -> int:
        return int(self.steps.shape[0])

    @property
    def total_steps(self) -> int:
        return self.plan_steps * self.epochs

    def examples(self, step: int) -> np.ndarray:
        epoch, position = divmod(step, self.plan_steps)
        order = np.random.default_rng((self.seed, epoch)).permutation(self.plan_steps) if epoch else None
        return self.steps[position if order is None else order[position]]


def eval_batches(logs: SequenceLogs, max_examples: int, batch_size: int, max_history_len: int, seed: int = 0,
                 indices: np.ndarray | None = None) -> Iterator[np.ndarray]:
    """A fixed random subset of the eval split (or of `indices`), cut into batches of similar history
    length (little padding)."""
    indices = logs.split_indices("eval") if indices is None else np.asarray(indices)
    if indices.size > max_examples:
        indices = np.sort(np.random.default_rng(seed).choice(indices, max_examples, replace=False))
    lengths = logs.history_lengths(max_history_len)[indices]
    ordered = indices[np.argsort(lengths, kind="stable")]
    for start in range(0, ordered.size, batch_size):
        yield ordered[start : start + batch_size]
