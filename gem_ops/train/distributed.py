"""GEM training as a distributed job: each rank trains on its own rows of the shuffled_batches plan for
the job's world size, embedding tables sharded by TorchRec (or FSDP2), dense layers under FSDP2,
sharded DCP checkpoints with resume, and the cross-rank step imbalance measured as it happens.

The loss of a step is the global batch's loss (per task: labelled examples' log loss summed over all
ranks over the global count of labelled examples), so a job on W ranks takes the same steps as one
process training on the union of their batches (`union_of_ranks`), up to float summation order.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import pyarrow.parquet as pq
import torch
import torch.distributed as dist
import torch.nn.functional as F

from gem_ops.data.batch_shuffling import read_rank_plan
from gem_ops.data.loader import SequenceLogs
from gem_ops.metrics.flops import batch_flops
from gem_ops.metrics.mfu import StepMFU
from gem_ops.metrics.quality import flat_metrics, quality_report
from gem_ops.model.config import FeatureSpec, ModelConfig
from gem_ops.model.features import model_input
from gem_ops.tracking import RunTracker
from gem_ops.train.acceleration import prepare_for_training
from gem_ops.train.batches import PlanSchedule, eval_batches
from gem_ops.train.checkpoint import is_sharded_checkpoint, latest_checkpoint, load_checkpoint
from gem_ops.train.config import TrainConfig
from gem_ops.train.initialization import init_output_biases
from gem_ops.train.loop import TrainResult, autocast_context, predict_logits, seeded_model
from gem_ops.train.optimizer import set_dense_lr
from gem_ops.train.process_group import Topology, job_process_group
from gem_ops.train.sharded_checkpoint import load_sharded_checkpoint, save_sharded_checkpoint
from gem_ops.train.sharding import ShardedModel, describe_plan, device_mesh, gather_full_state, shard_model
from gem_ops.train.step_balance import MEASURES, BalanceLog, ForwardComputeTimer, gather_rows

log = logging.getLogger(__name__)

MODEL_STATE_FILE = "model_state.pt"


class TrainingReporter(Protocol):
    """Where rank 0 streams progress (e.g. Dagster Pipes); see pipes_reporting.py."""

    def step(self, step: int, total: int, metrics: dict[str, float]) -> None: ...

    def message(self, text: str) -> None: ...


@dataclass
class DistributedTrainResult(TrainResult):
    world_size: int = 1
    embedding_sharding: str = ""
    sharding_plan: dict[str, str] = field(default_factory=dict)
    imbalance: dict[str, float] = field(default_factory=dict)  # measure -> sum of step max / sum of step mean
    balance: BalanceLog = field(default_factory=BalanceLog)
    model_state_path: Path | None = None  # full (unsharded) weights, written by rank 0
    step_seconds: list[float] = field(default_factory=list)  # this session's steps, slowest rank, data loading included

    def metadata(self) -> dict[str, Any]:
        """Final figures for run metadata (Dagster, logs)."""
        return {
            "steps": self.steps, "samples": self.samples, "samples_per_second": self.samples_per_second,
            "final_train_loss": self.losses[-1] if self.losses else math.nan,
            "world_size": self.world_size, "embedding_sharding": self.embedding_sharding,
            "sharding_plan": self.sharding_plan,
            "imbalance_observed": self.imbalance.get("compute_seconds", math.nan),
            **{f"imbalance_observed.{m}": v for m, v in self.imbalance.items()},
            "eval": self.final_report,
            **{k: v for k, v in flat_metrics(self.final_report).items() if k.endswith((".auc", ".ne", ".calibration"))},
            "checkpoint": str(self.checkpoint), "model_state": str(self.model_state_path),
            "resumed_from": self.resumed_from, "step_seconds": self.step_seconds,
        }


def plan_for_world_size(plans: str | os.PathLike, world_size: int) -> Path:
    """A plan file as it is, or `plans/world_size=W.parquet` from a folder of plans."""
    plans = Path(plans)
    path = plans / f"world_size={world_size}.parquet" if plans.is_dir() else plans
    if not path.is_file():
        made = sorted(p.name for p in plans.glob("world_size=*.parquet")) if plans.is_dir() else []
        raise FileNotFoundError(f"no plan for world size {world_size}: {path} is missing (plans there: {made})")
    return path


def plan_world_size(plan_path: str | os.PathLike) -> int:
    ranks = pq.read_table(plan_path, columns=["rank"]).column("rank").to_numpy()
    return int(ranks.max()) + 1


class RanksSchedule(PlanSchedule):
    """PlanSchedule over several ranks' rows at once: their batches side by side, rank order."""

    def __init__(self, plan_path: str | os.PathLike, ranks: list[int], epochs: int, seed: int):
        self.steps = np.concatenate([read_rank_plan(plan_path, r) for r in ranks], axis=1)
        if len(self.steps) == 0:
            raise ValueError(f"{plan_path}: the plan has no steps (too few training examples for its batch size)")
        self.epochs, self.seed = epochs, seed


def rank_schedule(plan_path: str | os.PathLike, topology: Topology, config: TrainConfig, union_of_ranks: bool) -> PlanSchedule:
    ranks_in_plan = plan_world_size(plan_path)
    if union_of_ranks:
        if topology.world_size != 1:
            raise ValueError(f"union_of_ranks trains one process on every rank's rows; this job has "
                             f"{topology.world_size} ranks")
        return RanksSchedule(plan_path, list(range(ranks_in_plan)), config.epochs, config.seed)
    if ranks_in_plan != topology.world_size:
        raise ValueError(f"{plan_path} was made for world size {ranks_in_plan}, the job has {topology.world_size} "
                         "ranks: pass the plan for the job's world size (plans/world_size=W.parquet)")
    return PlanSchedule(plan_path, topology.rank, config.epochs, config.seed)


def global_batch_loss(logits: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor, world_size: int,
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """(what this rank backpropagates, its per-task share of the global loss).

    Per task: this rank's summed log loss over labelled examples / the global labelled count. The
    shares add up over ranks to the global batch's loss; gradients are averaged over ranks (FSDP2,
    TorchRec), so the rank backpropagates world_size x its share."""
    mask = mask.to(logits.device)
    counts = mask.sum(0).to(torch.float32)
    dist.all_reduce(counts)
    per_example = F.binary_cross_entropy_with_logits(logits.float(), labels.to(logits.device), reduction="none") * mask
    share = per_example.sum(0) / counts.clamp(min=1)
    return share.sum() * world_size, share.detach()


def evaluate_distributed(sharded: ShardedModel, logs: SequenceLogs, config: TrainConfig, topology: Topology) -> dict:
    """Each rank scores its slice of every eval batch (every rank runs the same number of batches, as the
    sharded lookups are collective); rank 0 gathers the outputs and returns the report, others {}."""
    model = sharded.module
    batches = list(eval_batches(logs, config.eval_max_examples, config.eval_batch_size,
                                model.config.sequence.max_history_len, config.seed))
    if len(batches) > 1 and len(batches[-1]) < topology.world_size:
        batches[-2:] = [np.concatenate(batches[-2:])]  # a slice for every rank
    mine = [np.array_split(b, topology.world_size)[topology.rank] for b in batches if len(b) >= topology.world_size]
    out = predict_logits(model, logs, mine, topology.device, config.precision)
    gathered = [None] * topology.world_size if topology.rank == 0 else None
    dist.gather_object(out, gathered, dst=0)
    if topology.rank != 0:
        return {}
    joined = {k: torch.cat([g[k] for g in gathered]) for k in out}
    return quality_report(joined["logits"], joined["labels"], joined["label_mask"], joined["surface"],
                          model.spec.surfaces, model.objectives)


def train_distributed(
    logs: SequenceLogs,
    plan_path: str | os.PathLike,
    model_config: ModelConfig,
    config: TrainConfig,
    *,
    embedding_sharding: str = "auto",
    checkpoint_dir: str | os.PathLike | None = None,
    warm_start: str | os.PathLike | None = None,
    tracker: RunTracker | None = None,
    device: torch.device | str = "cpu",
    union_of_ranks: bool = False,
    reporter: TrainingReporter | None = None,
    on_step: Callable[[int, float], None] | None = None,
    export_model_state: bool = True,
) -> DistributedTrainResult:
    """Trains this rank's part of the job (torchrun's group, or one private rank when not launched by it).

    A complete checkpoint in checkpoint_dir is resumed (same step count at the end as an uninterrupted
    run); otherwise `warm_start` (a checkpoint of an earlier run, either format) gives the weights.
    The result on rank 0 carries the eval report; `model_state.pt` (full weights, loadable with
    loop.model_from_state) is written to checkpoint_dir at the end when export_model_state is set."""
    with job_process_group(device) as topology:
        return _train(logs, plan_path, model_config, config, topology, embedding_sharding=embedding_sharding,
                      checkpoint_dir=checkpoint_dir, warm_start=warm_start, tracker=tracker or RunTracker.disabled(),
                      union_of_ranks=union_of_ranks, reporter=reporter, on_step=on_step,
                      export_model_state=export_model_state)


def _train(logs, plan_path, model_config, config, topology: Topology, *, embedding_sharding, checkpoint_dir,
           warm_start, tracker: RunTracker, union_of_ranks, reporter, on_step, export_model_state) -> DistributedTrainResult:
    rank, world, device = topology.rank, topology.world_size, topology.device
    def say(text: str) -> None:
        if rank == 0:
            reporter.message(text) if reporter is not None else log.info(text)

    spec = FeatureSpec.from_logs(logs)
    schedule = rank_schedule(plan_path, topology, config, union_of_ranks)
    total = min(schedule.total_steps, config.max_steps or schedule.total_steps)

    latest = latest_checkpoint(checkpoint_dir) if checkpoint_dir else None
    model = seeded_model(spec, model_config, device, config.seed)
    if latest is None and warm_start is not None and not is_sharded_checkpoint(_checkpoint_folder(warm_start)):
        ckpt = load_checkpoint(warm_start)  # one process's checkpoint: loaded before sharding
        missing, unexpected = model.load_state_dict(ckpt.state["model"], strict=False)
        say(f"warm start from {ckpt.path} (step {ckpt.step}); missing {missing}, unexpected {unexpected}")
        tracker.set_tags({"gem.warm_start": str(ckpt.path)})
    elif latest is None and warm_start is None:
        init_output_biases(model, logs, plan_path)  # from the whole plan: the same on every rank
    prepare_for_training(model, config, device)  # FP8, checkpointing, compile: before sharding
    mesh = device_mesh(device.type, world, topology.local_world_size)
    sharded = shard_model(model, config, embedding_sharding, mesh, device, topology.local_world_size)
    plan = describe_plan(sharded)
    say(f"{world} rank(s) on {topology.nodes} node(s), {device.type}; embedding tables: {sharded.embedding_sharding}; "
        f"dense: FSDP2 over mesh {tuple(mesh.shape)}; {total} steps")

    result = DistributedTrainResult(steps=0, samples=0, seconds=0.0, losses=[], world_size=world,
                                    embedding_sharding=sharded.embedding_sharding, sharding_plan=plan)
    start = 0
    if latest is not None:
        progress = _load_training_state(latest, sharded)
        start, result.losses, result.resumed_from = progress["step"], list(progress["losses"]), progress["step"]
        result.balance = BalanceLog.from_dict(progress["balance"])
        say(f"resumed from {latest} at step {start}")
    elif warm_start is not None and is_sharded_checkpoint(_checkpoint_folder(warm_start)):
        folder = _checkpoint_folder(warm_start)
        state = {"model": sharded.module.state_dict()}
        progress = load_sharded_checkpoint(folder, state)
        sharded.module.load_state_dict(state["model"])
        say(f"warm start from {folder} (step {progress['step']}): weights only, step 0")
        tracker.set_tags({"gem.warm_start": str(folder)})

    tracker.log_params({"model": model_config.to_dict(), "train": config.to_dict(), "steps": total,
                        "distributed": {"world_size": world, "nodes": topology.nodes, "device": device.type,
                                        "embedding_sharding": sharded.embedding_sharding,
                                        "union_of_ranks": union_of_ranks}})
    tracker.log_dict(plan, "sharding_plan.json")

    def checkpoint(step: int) -> None:
        if checkpoint_dir is None:
            return
        progress = {"losses": result.losses, "balance": result.balance.to_dict(),
                    "spec": asdict(spec), "model_config": model_config.to_dict(), "train_config": config.to_dict(),
                    "world_size": world, "embedding_sharding": sharded.embedding_sharding}
        result.checkpoint = save_sharded_checkpoint(checkpoint_dir, step, _training_state(sharded), progress,
                                                    config.keep_checkpoints)

    def run_eval(step: int) -> None:
        report = evaluate_distributed(sharded, logs, config, topology)
        result.eval_steps.append(step)
        result.eval_reports.append(report)
        tracker.log_metrics(flat_metrics(report), step=step)

    timer = ForwardComputeTimer(sharded.fsdp_units, device)
    module, pending = sharded.module, {}
    step_mfu = StepMFU(device, world)
    module.train()
    began = time.perf_counter()
    for step in range(start, total):
        stepped = time.perf_counter()
        lr = set_dense_lr(sharded.optimizer, config, step)
        batch = logs.batch(schedule.examples(step), model_config.sequence.max_history_len)
        x = model_input(batch, spec, model_config).to(device, non_blocking=True)
        lengths = batch.history_lengths.double() + 1.0  # the candidate is a token too
        with autocast_context(device, config.precision):
            logits = module(x)
        loss, share = global_batch_loss(logits, x.labels, x.label_mask, world)
        sharded.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if config.clip_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(sharded.dense_parameters, config.clip_grad_norm)
        sharded.optimizer.step()
        local = [timer.take(), float(lengths.sum()), float((lengths * lengths).sum())]
        flops = batch_flops(batch, spec, model_config).training
        rows = gather_rows([*local, time.perf_counter() - stepped, flops, *share.tolist()], device)
        ratios = result.balance.add(step, rows[:, : len(MEASURES)])
        per_task = rows[:, len(MEASURES) + 2 :].sum(0)
        value = float(per_task.sum())
        if not math.isfinite(value):
            raise FloatingPointError(f"training loss is {value} at step {step}; lower lr_dense/lr_sparse")
        result.losses.append(value)
        result.samples += batch.size * world
        result.steps = step + 1
        result.step_seconds.append(float(rows[:, len(MEASURES)].max()))
        result.step_flops.append(float(rows[:, len(MEASURES) + 1].sum()))
        metrics = {"train.loss": value, "train.lr_dense": lr, "train.step_seconds": float(rows[:, len(MEASURES)].max()),
                   **step_mfu.metrics(result.step_flops[-1], result.step_seconds[-1]),
                   **{f"train.loss.{t}": float(v) for t, v in zip(model.objectives, per_task)},
                   **{f"train.imbalance.{m}": r for m, r in ratios.items()}}
        pending[step] = metrics
        if reporter is not None and rank == 0:
            reporter.step(step, total, metrics)
        if on_step is not None:
            on_step(step, value)
        if len(pending) >= config.log_every or step + 1 == total:
            tracker.log_metrics_by_step(pending)
            pending.clear()
        if config.eval_every and (step + 1) % config.eval_every == 0 and step + 1 < total:
            run_eval(step + 1)
        if config.checkpoint_every and (step + 1) % config.checkpoint_every == 0 and step + 1 < total:
            checkpoint(step + 1)
    result.seconds = time.perf_counter() - began
    timer.remove()
    result.imbalance = result.balance.observed()
    if result.samples and result.seconds:
        tracker.log_metrics({"train.samples_per_second": result.samples_per_second,
                             "train.imbalance_observed": result.imbalance["compute_seconds"],
                             **{f"train.imbalance_observed.{m}": v for m, v in result.imbalance.items()}},
                            step=result.steps)
    run_eval(result.steps)
    checkpoint(result.steps)
    if export_model_state and checkpoint_dir is not None:
        result.model_state_path = export_full_model_state(sharded, spec, model_config, Path(checkpoint_dir) / MODEL_STATE_FILE)
    say(f"trained {result.steps} steps ({result.samples} samples this session) at {result.samples_per_second:.0f} "
        f"samples/s; observed imbalance {result.imbalance['compute_seconds']:.3f} (compute), "
        f"{result.imbalance['tokens']:.3f} (tokens)")
    return result


def _checkpoint_folder(path: str | os.PathLike) -> Path:
    """A checkpoint folder, or the latest complete one in a folder of them."""
    path = Path(path)
    if is_sharded_checkpoint(path) or (path / "state.pt").is_file():
        return path
    latest = latest_checkpoint(path)
    if latest is None:
        raise FileNotFoundError(f"no checkpoint in {path}")
    return latest


def _training_state(sharded: ShardedModel) -> dict[str, Any]:
    return {"model": sharded.module.state_dict(), "optimizer": sharded.optimizer.state_dict()}


def _load_training_state(path: Path, sharded: ShardedModel) -> dict[str, Any]:
    if not is_sharded_checkpoint(path):
        raise ValueError(f"{path} is a single-process checkpoint; a distributed job resumes only from its own "
                         "sharded checkpoints (use it as warm_start, or another checkpoint_dir)")
    for name, optimizer in sharded.optimizer.optimizers:
        if not (name == "sparse" and sharded.dmp is not None):  # the fused table optimizer has its state
            optimizer.init_state()  # keyed optimizers load only into initialised state
    state = _training_state(sharded)
    progress = load_sharded_checkpoint(path, state)
    sharded.module.load_state_dict(state["model"])
    sharded.optimizer.load_state_dict(state["optimizer"])
    return progress


def export_full_model_state(sharded: ShardedModel, spec: FeatureSpec, model_config: ModelConfig,
                            destination: Path) -> Path | None:
    """Collective: gathers the full weights; rank 0 writes them in loop.model_state's format."""
    from gem_ops.data.atomic import atomic_path

    full = gather_full_state(sharded.module)
    if dist.get_rank() != 0:
        return None
    with atomic_path(destination) as tmp:
        torch.save({"spec": asdict(spec), "model_config": model_config.to_dict(), "model": full}, tmp)
    return destination
