"""What a rank trains and evaluates on: its rows of a shuffled_batches plan, balanced for the history
length the model trains on, and length-sorted eval batches."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np

from gem_ops.data.batch_shuffling import ShufflingConfig, plan_base_batch_shuffling, plan_info, read_plan, read_rank_plan
from gem_ops.data.loader import SequenceLogs

log = logging.getLogger(__name__)


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
                  max_history_len: int, union_of_ranks: bool = False) -> PlanSchedule:
    """This rank's schedule (or, with union_of_ranks on one process, every rank's rows side by side).

    A Base Batch Shuffling plan balanced at another history length than the model's (e.g. stored
    histories of 1024 events, a model that reads 128) is balanced again over the same examples for the
    model's lengths, the same way on every rank, so the steps cost what the model will spend."""
    info = plan_info(plan_path)
    plan_world = int(info.get("world_size") or _plan_world_size(plan_path))
    if union_of_ranks and world_size != 1:
        raise ValueError(f"union_of_ranks trains one process on every rank's rows; this job has {world_size} ranks")
    if not union_of_ranks and plan_world != world_size:
        raise ValueError(f"{plan_path} was made for world size {plan_world}, the job has {world_size} ranks: pass the "
                         "plan for the job's world size (plans/world_size=W.parquet)")
    model_cap = min(max_history_len, logs.max_history_len)
    plan_cap = min(info.get("max_history_len") or logs.max_history_len, logs.max_history_len)
    if info.get("shuffling") and plan_cap != model_cap:
        steps = rebalanced(logs, plan_path, ShufflingConfig(**info["shuffling"]), plan_world, model_cap)
        log.info("%s: balanced for histories of %d events, the model reads %d: balanced again for %d",
                 plan_path, plan_cap, model_cap, model_cap)
    elif union_of_ranks:
        steps = read_plan(plan_path)
    else:
        return PlanSchedule(read_rank_plan(plan_path, rank), epochs, seed, plan_path)
    rows = steps.reshape(steps.shape[0], -1) if union_of_ranks else steps[:, rank]
    return PlanSchedule(rows, epochs, seed, plan_path)


def rebalanced(logs: SequenceLogs, plan_path: str | os.PathLike, shuffling: ShufflingConfig, world_size: int,
               max_history_len: int) -> np.ndarray:
    """[steps, world_size, rank_batch_size]: the plan's examples balanced again at max_history_len."""
    examples = np.sort(read_plan(plan_path).reshape(-1))
    lengths = logs.history_lengths(max_history_len)[examples]
    return plan_base_batch_shuffling(lengths, world_size, shuffling, examples).examples


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
