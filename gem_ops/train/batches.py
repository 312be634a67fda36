"""What a rank trains and evaluates on: its rows of a shuffled_batches plan, balanced for the history
length the model trains on, and length-sorted eval batches."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np

from gem_ops.data.batch_shuffling import (ShufflingConfig, plan_base_batch_shuffling, plan_info, read_plan,
                                         read_rank_plan)
from gem_ops.data.loader import SequenceLogs

log = logging.getLogger(__name__)

MS_PER_DAY = 86_400_000


class PlanSchedule:
    """Global step -> this rank's example indices. Epoch e visits the plan's steps in an order seeded by
    (seed, e), so any step can be found again from its number alone (a resumed job needs no other state)."""

    def __init__(self, steps: np.ndarray, epochs: int, seed: int, source: str | os.PathLike = "the plan"):
        if len(steps) == 0:
            raise ValueError(f"{source}: the plan has no steps (too few training examples for its batch size)")
        self.steps = steps  # [plan_steps, rank_batch_size]
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


def plan_for_world_size(plans: str | os.PathLike, world_size: int) -> Path:
    """A plan file as it is, or `plans/world_size=W.parquet` from a folder of plans."""
    plans = Path(plans)
    path = plans / f"world_size={world_size}.parquet" if plans.is_dir() else plans
    if not path.is_file():
        made = sorted(p.name for p in plans.glob("world_size=*.parquet")) if plans.is_dir() else []
        raise FileNotFoundError(f"no plan for world size {world_size}: {path} is missing (plans there: {made})")
    return path


def rank_schedule(logs: SequenceLogs, plan_path: str | os.PathLike, rank: int, world_size: int, epochs: int, seed: int,
                  max_history_len: int, union_of_ranks: bool = False,
                  held_out: np.ndarray | None = None) -> PlanSchedule:
    """This rank's schedule (or, with union_of_ranks on one process, every rank's rows side by side).

    A Base Batch Shuffling plan balanced at another history length than the model's (e.g. stored
    histories of 1024 events, a model that reads 128) is balanced again over the same examples for the
    model's lengths, the same way on every rank, so the steps cost what the model will spend; so is a
    plan some of whose examples are `held_out` (a validation day), over the others."""
    info = plan_info(plan_path)
    plan_world = int(info.get("world_size") or _plan_world_size(plan_path))
    if union_of_ranks and world_size != 1:
        raise ValueError(f"union_of_ranks trains one process on every rank's rows; this job has {world_size} ranks")
    if not union_of_ranks and plan_world != world_size:
        raise ValueError(f"{plan_path} was made for world size {plan_world}, the job has {world_size} ranks: pass the "
                         "plan for the job's world size (plans/world_size=W.parquet)")
    model_cap = min(max_history_len, logs.max_history_len)
    plan_cap = min(info.get("max_history_len") or logs.max_history_len, logs.max_history_len)
    held_out = np.zeros(0, np.int64) if held_out is None else np.asarray(held_out)
    if held_out.size and not info.get("shuffling"):
        raise ValueError(f"{plan_path} records no shuffling settings, so it cannot be balanced again without the "
                         "held-out examples: write it again with shuffled_batches")
    if info.get("shuffling") and (plan_cap != model_cap or held_out.size):
        steps = rebalanced(logs, plan_path, ShufflingConfig(**info["shuffling"]), plan_world, model_cap, held_out)
        log.info("%s: balanced for histories of %d events, the model reads %d: balanced again for %d%s", plan_path,
                 plan_cap, model_cap, model_cap, f" without {held_out.size} held-out examples" if held_out.size else "")
    elif union_of_ranks:
        steps = read_plan(plan_path)
    else:
        return PlanSchedule(read_rank_plan(plan_path, rank), epochs, seed, plan_path)
    rows = steps.reshape(steps.shape[0], -1) if union_of_ranks else steps[:, rank]
    return PlanSchedule(rows, epochs, seed, plan_path)


def rebalanced(logs: SequenceLogs, plan_path: str | os.PathLike, shuffling: ShufflingConfig, world_size: int,
               max_history_len: int, held_out: np.ndarray | None = None) -> np.ndarray:
    """[steps, world_size, rank_batch_size]: the plan's examples (but the held-out ones) balanced again
    at max_history_len."""
    examples = np.sort(read_plan(plan_path).reshape(-1))
    if held_out is not None and held_out.size:
        examples = np.setdiff1d(examples, held_out, assume_unique=True)
    lengths = logs.history_lengths(max_history_len)[examples]
    return plan_base_batch_shuffling(lengths, world_size, shuffling, examples).examples


def examples_of_newest_days(logs: SequenceLogs, examples: np.ndarray, days: int) -> np.ndarray:
    """The examples (in their order) of their newest `days` calendar days (UTC)."""
    examples = np.asarray(examples, dtype=np.int64)
    day = logs.column("timestamp")[examples] // MS_PER_DAY
    return examples[day > day.max() - days]


def newest_days(logs: SequenceLogs, plan_path: str | os.PathLike, days: int) -> np.ndarray:
    """The plan's examples of its newest `days` days (UTC), sorted: a held-out validation set."""
    examples = np.sort(read_plan(plan_path).reshape(-1))
    picked = examples_of_newest_days(logs, examples, days)
    if picked.size == examples.size:
        raise ValueError(f"{plan_path}: its examples span {days} day(s) or fewer, none would be left to train on "
                         f"after holding out {days} validation day(s)")
    return picked


def _plan_world_size(plan_path: str | os.PathLike) -> int:
    import pyarrow.parquet as pq

    return int(pq.read_table(plan_path, columns=["rank"]).column("rank").to_numpy().max()) + 1


def eval_batches(logs: SequenceLogs, max_examples: int, batch_size: int, max_history_len: int, seed: int = 0,
                 indices: np.ndarray | None = None) -> list[np.ndarray]:
    """A fixed random subset of the eval split (or of `indices`), cut into batches of similar history
    length (little padding)."""
    indices = logs.split_indices("eval") if indices is None else np.asarray(indices)
    if indices.size > max_examples:
        indices = np.sort(np.random.default_rng(seed).choice(indices, max_examples, replace=False))
    lengths = logs.history_lengths(max_history_len)[indices]
    ordered = indices[np.argsort(lengths, kind="stable")]
    return [ordered[start : start + batch_size] for start in range(0, ordered.size, batch_size)]
