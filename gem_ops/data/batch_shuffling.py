"""Base Batch Shuffling: length-sorted sub-batches assigned so every rank's step costs about the same.

Samples are sorted by history length and cut into groups of `world_size` sub-batches of
`sub_batch_size`; each group's samples are dealt to its sub-batches in serpentine order, so a
sub-batch holds similar lengths (little padding, a predictable cost) and the sub-batches of a group
cost about the same, even in a heavy tail where neighbouring lengths differ a lot. A step takes
`sub_batches_per_rank` groups, pairing the heaviest remaining group with the lightest, and rank r
takes sub-batch r of the heavier groups and sub-batch world_size-1-r of the lighter ones. Each rank then reads only
its own rows of the plan: no communication at train time.
Step order is shuffled so training does not see all long histories first.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from gem_ops.data.atomic import atomic_path

CostModel = Literal["tokens", "attention", "measured"]


@dataclass(frozen=True)
class ShufflingConfig:
    sub_batch_size: int = 128
    sub_batches_per_rank: int = 4
    """A rank's batch per step is sub_batches_per_rank x sub_batch_size samples."""
    cost: CostModel = "attention"
    """tokens: L + 1 per sample; attention: (L + 1)^2, what self attention over the history costs; measured:
    (L + 1)^2 + tokens_per_pair x (L + 1), the two terms weighted as measured steps cost (step_cost.fit_step_cost).
    Samples are dealt by length order, so every cost gives the same plan: the cost is what the plan's per-rank costs
    and planned imbalance are counted in."""
    seed: int = 0
    tokens_per_pair: float = 0.0
    """cost "measured": how many attention pairs one token costs as much as (StepCostModel.tokens_per_pair)."""

    def __post_init__(self):
        for name in ("sub_batch_size", "sub_batches_per_rank"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.cost not in ("tokens", "attention", "measured"):
            raise ValueError(f"cost must be 'tokens', 'attention' or 'measured', got {self.cost!r}")
        if not (self.tokens_per_pair >= 0 and np.isfinite(self.tokens_per_pair)):
            raise ValueError(f"tokens_per_pair must be finite and >= 0, got {self.tokens_per_pair}")
        if self.tokens_per_pair and self.cost != "measured":
            raise ValueError(f"tokens_per_pair={self.tokens_per_pair} weighs the tokens of cost 'measured' only; "
                             f"cost is {self.cost!r}")

    @property
    def rank_batch_size(self) -> int:
        return self.sub_batch_size * self.sub_batches_per_rank


@dataclass
class BatchPlan:
    """examples[step, rank] lists the example indices rank `rank` trains on at step `step`."""

    world_size: int
    examples: np.ndarray  # [steps, world_size, rank_batch_size] int64
    cost: np.ndarray  # [steps, world_size] float64
    dropped: int  # samples left out because they did not fill a whole step
    config: ShufflingConfig | None = None  # how a Base Batch Shuffling plan was made (None: another planner)

    @property
    def steps(self) -> int:
        return int(self.examples.shape[0])

    def rank_examples(self, rank: int) -> np.ndarray:
        return self.examples[:, rank]

    def to_table(self) -> pa.Table:
        steps, world, per_rank = self.examples.shape
        examples = pa.FixedSizeListArray.from_arrays(pa.array(self.examples.reshape(-1)), per_rank)
        return pa.table({
            "step": np.repeat(np.arange(steps, dtype=np.int32), world),
            "rank": np.tile(np.arange(world, dtype=np.int32), steps),
            "cost": self.cost.reshape(-1),
            "examples": examples,
        })


def sample_cost(history_lengths: np.ndarray, cost: CostModel, tokens_per_pair: float = 0.0) -> np.ndarray:
    tokens = history_lengths.astype(np.float64) + 1.0  # the candidate is a token too
    if cost == "tokens":
        return tokens
    return tokens * tokens + (tokens_per_pair * tokens if cost == "measured" else 0.0)


def plan_base_batch_shuffling(
    history_lengths: np.ndarray, world_size: int, config: ShufflingConfig, example_ids: np.ndarray | None = None
) -> BatchPlan:
    """Balanced plan: every rank's per-step cost is close to the step mean."""
    _check_world_size(world_size)
    rng = np.random.default_rng(config.seed)
    ids, costs = _ids_and_costs(history_lengths, example_ids, config)
    n_sub, dropped_ids = _usable_sub_batches(ids.size, world_size, config)
    keep = np.sort(rng.permutation(ids.size)[: n_sub * config.sub_batch_size])  # random survivors
    ids, costs, lengths = ids[keep], costs[keep], history_lengths[keep]

    # Groups of world_size sub-batches cover neighbouring lengths: sort by length (random among ties),
    # and deal each group's samples to its sub-batches in serpentine order, so the sub-batches of a
    # group hold similar lengths and near-equal cost even in the heavy tail.
    order = np.lexsort((rng.random(ids.size), lengths))[::-1]
    dealt = order.reshape(-1, config.sub_batch_size, world_size).copy()  # [groups, rounds, world]
    dealt[:, 1::2, :] = dealt[:, 1::2, ::-1]
    group_subs = dealt.transpose(0, 2, 1)  # [groups, world, sub_batch_size], heaviest group first

    # A step takes k groups, the heaviest remaining with the lightest; rank r gets sub-batch r of
    # the heavier groups and sub-batch world-1-r of the lighter ones, evening out what dealing left.
    k, n_groups = config.sub_batches_per_rank, group_subs.shape[0]
    fold = np.empty(n_groups, dtype=np.int64)
    fold[0::2] = np.arange((n_groups + 1) // 2)
    fold[1::2] = n_groups - 1 - np.arange(n_groups // 2)
    steps = group_subs[fold].reshape(n_groups // k, k, world_size, config.sub_batch_size).copy()
    steps[:, 1::2] = steps[:, 1::2, ::-1]
    steps = steps[rng.permutation(steps.shape[0])].transpose(0, 2, 1, 3)  # [steps, world, k, sub_batch]
    examples = ids[steps].reshape(steps.shape[0], world_size, config.rank_batch_size)
    return BatchPlan(world_size, examples, costs[steps].sum((-1, -2)), dropped_ids, config)


def plan_random(
    history_lengths: np.ndarray, world_size: int, config: ShufflingConfig, example_ids: np.ndarray | None = None
) -> BatchPlan:
    """The baseline: a plain random shuffle cut into per-rank batches of the same size."""
    _check_world_size(world_size)
    rng = np.random.default_rng(config.seed)
    ids, costs = _ids_and_costs(history_lengths, example_ids, config)
    n_sub, dropped = _usable_sub_batches(ids.size, world_size, config)
    order = rng.permutation(ids.size)[: n_sub * config.sub_batch_size]
    shape = (-1, world_size, config.rank_batch_size)
    return BatchPlan(world_size, ids[order].reshape(shape), costs[order].reshape(shape).sum(-1), dropped)


def max_over_mean(cost: np.ndarray) -> float:
    """cost [steps, ranks] -> the sum over steps of the slowest rank's cost over the sum of the mean rank's: how
    much slower the steps run than with perfect balance (1.0), every rank waiting for the slowest."""
    mean = cost.mean(1).sum()
    return float(cost.max(1).sum() / mean) if mean > 0 else float("nan")


def imbalance(plan: BatchPlan) -> dict[str, float]:
    """How much slower steps run than with perfect balance (every rank waits for the slowest).

    max_over_mean: sum over steps of the slowest rank's cost / sum of the mean rank cost; 1.0 is perfect.
    """
    if plan.steps == 0:
        return {"max_over_mean": float("nan"), "worst_step": float("nan"), "steps": 0}
    step_max, step_mean = plan.cost.max(1), plan.cost.mean(1)
    ratio = np.divide(step_max, step_mean, out=np.ones_like(step_max), where=step_mean > 0)
    return {
        "max_over_mean": max_over_mean(plan.cost),
        "worst_step": float(ratio.max()),
        "p99_step": float(np.quantile(ratio, 0.99)),
        "steps": plan.steps,
    }


PLAN_METADATA_KEY = b"gem.plan"


def write_plan(plan: BatchPlan, destination: str | os.PathLike, max_history_len: int | None = None) -> Path:
    """The plan as Parquet, with what it was balanced for in the file's metadata: the history length
    the costs were computed at (None: as the sequence logs store them) and the shuffling settings."""
    info = {"world_size": plan.world_size, "max_history_len": max_history_len,
            "shuffling": asdict(plan.config) if plan.config is not None else None}
    table = plan.to_table().replace_schema_metadata({PLAN_METADATA_KEY: json.dumps(info).encode()})
    with atomic_path(destination) as tmp:  # pyarrow alone: plans are also written where polars is absent
        pq.write_table(table, tmp, compression="lz4", write_statistics=True)
    return Path(destination)


def plan_info(path: str | os.PathLike) -> dict:
    """What write_plan recorded ({} for a plan written without it)."""
    metadata = pq.read_metadata(path).metadata or {}
    return json.loads(metadata[PLAN_METADATA_KEY]) if PLAN_METADATA_KEY in metadata else {}


def read_plan(path: str | os.PathLike) -> np.ndarray:
    """Every rank's rows: [steps, world_size, rank_batch_size] example indices."""
    table = pq.read_table(path, columns=["step", "rank", "examples"])
    if table.num_rows == 0:  # fewer examples than one step
        return np.zeros((0, int(plan_info(path).get("world_size") or 1), 0), dtype=np.int64)
    steps = table.column("step").to_numpy()
    ranks = table.column("rank").to_numpy()
    examples = table.column("examples").combine_chunks().flatten().to_numpy().reshape(table.num_rows, -1)
    out = np.empty((int(steps.max()) + 1, int(ranks.max()) + 1, examples.shape[1]), dtype=examples.dtype)
    out[steps, ranks] = examples
    return out


def read_rank_plan(path: str | os.PathLike, rank: int) -> np.ndarray:
    """One rank's [steps, rank_batch_size] example indices, read with a predicate on `rank` alone."""
    table = pq.read_table(path, columns=["step", "examples"], filters=[("rank", "=", rank)])
    if table.num_rows == 0:
        raise ValueError(f"{path}: no rows for rank {rank}; the plan was made for a smaller world size")
    order = np.argsort(table.column("step").to_numpy(), kind="stable")
    examples = table.column("examples").combine_chunks()
    return examples.flatten().to_numpy().reshape(table.num_rows, -1)[order]


def _ids_and_costs(history_lengths, example_ids, config: ShufflingConfig):
    history_lengths = np.asarray(history_lengths)
    ids = np.arange(history_lengths.size, dtype=np.int64) if example_ids is None else np.asarray(example_ids)
    if ids.shape != history_lengths.shape:
        raise ValueError(f"example_ids {ids.shape} and history_lengths {history_lengths.shape} differ in shape")
    return ids, sample_cost(history_lengths, config.cost, config.tokens_per_pair)


def _usable_sub_batches(n: int, world_size: int, config: ShufflingConfig) -> tuple[int, int]:
    per_step = world_size * config.sub_batches_per_rank
    n_sub = (n // config.sub_batch_size) // per_step * per_step
    return n_sub, n - n_sub * config.sub_batch_size


def _check_world_size(world_size: int):
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
