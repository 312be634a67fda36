"""The training engine: one step loop for every model and every world size.

GEM under torchrun on 1..N GPUs, the domain foundation models and the verticals in one process, and
the MFU window all train here. A job joins torchrun's process group, or makes a private one-rank group
when called as a function. Each rank trains on its rows of a shuffled_batches plan (balanced for the
model's history length): batches are built and pinned by a background thread while the step before
runs; the loss is the global batch's (gem_ops.train.loss); the model is spread over the ranks by
gem_ops.train.sharding (on one rank it stays whole); FP8, compilation and activation checkpointing come
from the TrainConfig; distillation and representation inputs come with the batches of a
TeacherJoinedLogs. Every step logs its loss, model TFLOP/s and MFU, and the cross-rank imbalance; eval
and DCP checkpoints run every so many steps, and a job started again resumes from its last checkpoint.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn
from torch.autograd.profiler import record_function

from gem_ops.data.batch_shuffling import read_plan
from gem_ops.data.loader import SequenceLogs
from gem_ops.metrics.flops import batch_flops
from gem_ops.metrics.mfu import StepMFU
from gem_ops.metrics.quality import flat_metrics, quality_report
from gem_ops.model.config import FeatureSpec, ModelConfig
from gem_ops.model.features import model_input
from gem_ops.model.gem import GEMModel
from gem_ops.tracking import RunTracker
from gem_ops.train.acceleration import autocast_context, prepare_for_training
from gem_ops.train.batches import newest_days, rank_schedule
from gem_ops.train.calibration import fit_calibration, output_calibration, reset_calibration
from gem_ops.train.calibration_rate import retarget_shifts
from gem_ops.train.calibration_trend import find_trends, step_trends, trend_examples
from gem_ops.train.checkpoint import latest_checkpoint, load_checkpoint, load_into, read_progress, save_checkpoint
from gem_ops.train.config import TrainConfig
from gem_ops.train.cuda_graph_skips import CudaGraphSkips
from gem_ops.train.data_check import training_data_problem, unscored_objectives
from gem_ops.train.evaluation import evaluate, gathered_predictions
from gem_ops.train.gc_schedule import CollectionSchedule
from gem_ops.train.gradients import clip_dense_gradients, divergence_message, nonfinite_gradients
from gem_ops.train.history_cuts import history_caps
from gem_ops.train.initialization import init_output_biases
from gem_ops.train.loss import global_batch_loss
from gem_ops.train.model_state import export_full_model_state, seeded_model
from gem_ops.train.optimizer import set_dense_lr, split_parameters
from gem_ops.train.pipes_reporting import LogReporter
from gem_ops.train.prefetch import prefetched
from gem_ops.train.process_group import Topology, job_process_group
from gem_ops.train.sharding import ShardedModel, describe_plan, shard_model
from gem_ops.train.step_balance import MEASURES, BalanceLog, ForwardComputeTimer, gather_rows, host_group
from gem_ops.train.step_readout import (QueuedStep, host_phase_seconds, queue_step, read_at_once, read_figures,
                                       reads_late)
from gem_ops.train.unit_prefetch import UnitPrefetch
from gem_ops.train.warm_up import warm_up_inputs
from gem_ops.train.weight_average import CHECKPOINT_KEY as AVERAGE_KEY
from gem_ops.train.weight_average import WeightAverage
from gem_ops.train.warm_start import resume_conflict, warm_start_conflict

log = logging.getLogger(__name__)

MODEL_STATE_FILE = "model_state.pt"
StepHook = Callable[[int, float], None]  # (step, loss) after every step, on every rank


class TrainingReporter(Protocol):
    """Where rank 0 streams progress (the log, or Dagster Pipes; see pipes_reporting.py)."""

    def step(self, step: int, total: int, metrics: dict[str, float]) -> None: ...

    def message(self, text: str) -> None: ...


@dataclass
class TrainResult:
    steps: int
    samples: int  # this session's, all ranks
    seconds: float  # this session's steps, wall time
    losses: list[float]  # per step, the whole run (resumed runs included)
    eval_steps: list[int] = field(default_factory=list)
    eval_reports: list[dict[str, dict[str, float]]] = field(default_factory=list)  # rank 0's
    checkpoint: Path | None = None
    resumed_from: int | None = None
    world_size: int = 1
    embedding_sharding: str = ""
    sharding_plan: dict[str, str] = field(default_factory=dict)
    balance: BalanceLog = field(default_factory=BalanceLog)
    imbalance: dict[str, float] = field(default_factory=dict)  # measure -> sum of step max / sum of step mean
    model_state_path: Path | None = None  # full (unsharded) weights, written by rank 0
    # This session's steps: wall time of the slowest rank (data included; with steps read late, from the previous
    # step's read to this one's), model FLOPs over all ranks, the time each step was read (time.perf_counter, this
    # rank), and this rank's forward FLOPs by module.
    step_seconds: list[float] = field(default_factory=list)
    step_flops: list[float] = field(default_factory=list)
    step_ends: list[float] = field(default_factory=list)
    step_module_flops: list[dict[str, float]] = field(default_factory=list)
    step_samples: list[int] = field(default_factory=list)
    # This rank's host seconds per step blocked on reading the step back: with steps read late, how far the device
    # ran behind the host once the next step was queued. Near zero through a window, the device had finished first
    # (a host that bounds the step, or one held up inside launches by a full launch queue).
    step_read_waits: list[float] = field(default_factory=list)
    # This rank's host seconds per step in each phase of queuing it (data, forward, backward, optimizer), no sync
    # added: on a GPU, how long the host took to issue each phase's work (or sat in a wait inside it), the host's
    # side of a step that no profiler or tracer changes (steps profiled under CUDA graphs were seen recording anew).
    step_host_seconds: list[dict[str, float]] = field(default_factory=list)
    # This session's seconds in garbage collection while its steps ran, this rank: the scheduled collections'
    # share of the run's time, which a timed window of a few steps may hold none of.
    gc_seconds: float = 0.0
    # Under TrainConfig.cuda_graphs: the compiled step's graphs Inductor ran without them, and the reasons it gave
    cuda_graph_skips: int = 0
    cuda_graph_skip_reasons: list[str] = field(default_factory=list)
    started: float = 0.0  # time.perf_counter when this session's first step began
    # With validation days: the reports on them (rank 0's), the step whose weights were kept, and the
    # calibration fitted on them ({"scale", "shift"}: [domains][tasks]).
    validation_steps: list[int] = field(default_factory=list)
    validation_reports: list[dict[str, dict[str, float]]] = field(default_factory=list)
    best_step: int | None = None
    stopped_early: bool = False
    calibration: dict[str, list[list[float]]] = field(default_factory=dict)

    @property
    def final_report(self) -> dict[str, dict[str, float]]:
        return self.eval_reports[-1] if self.eval_reports else {}

    @property
    def samples_per_second(self) -> float:
        """This session's throughput; NaN where it trained nothing (a job restarted after its last step's
        checkpoint), which measures none rather than a rate of zero."""
        return self.samples / self.seconds if self.samples and self.seconds else math.nan

    def to_dict(self) -> dict[str, Any]:
        """Every field as plain data (JSON), for the record of a finished run."""
        return {**asdict(self), "balance": self.balance.to_dict(),
                "checkpoint": None if self.checkpoint is None else str(self.checkpoint),
                "model_state_path": None if self.model_state_path is None else str(self.model_state_path)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainResult:
        paths = {k: None if data[k] is None else Path(data[k]) for k in ("checkpoint", "model_state_path")}
        return cls(**{**data, **paths, "balance": BalanceLog.from_dict(data["balance"])})

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
            "best_step": self.best_step, "stopped_early": self.stopped_early, "gc_seconds": self.gc_seconds,
            "cuda_graph_skips": self.cuda_graph_skips, "cuda_graph_skip_reasons": self.cuda_graph_skip_reasons,
        }


def train(
    logs: SequenceLogs,
    plan_path: str | os.PathLike,
    model_config: ModelConfig,
    config: TrainConfig,
    *,
    device: torch.device | str = "cpu",
    checkpoint_dir: str | os.PathLike | None = None,
    warm_start: str | os.PathLike | None = None,
    tracker: RunTracker | None = None,
    model: GEMModel | None = None,
    eval_indices: np.ndarray | None = None,
    embedding_sharding: str = "auto",
    union_of_ranks: bool = False,
    reporter: TrainingReporter | None = None,
    step_hooks: Sequence[StepHook] = (),
    export_model_state: bool = False,
) -> tuple[nn.Module, TrainResult]:
    """Trains this rank's part of the job; returns the trained model (sharded in a job of several ranks)
    and the run's figures (the eval reports on rank 0).

    A complete checkpoint in checkpoint_dir is resumed (same step count at the end as an uninterrupted
    run); otherwise `warm_start` (a checkpoint, or a folder of them, of an earlier run) gives the weights.
    `model`: one already built for model_config (e.g. with tables shared from a teacher); `eval_indices`:
    the eval examples (default: the eval split); `union_of_ranks`: one process trains on every rank's
    rows of the plan (the global batches of a job of that many ranks). `export_model_state` writes the
    full weights to checkpoint_dir/model_state.pt at the end."""
    with job_process_group(device) as topology:
        trainer = Trainer(logs, plan_path, model_config, config, topology, model=model, eval_indices=eval_indices,
                          embedding_sharding=embedding_sharding, union_of_ranks=union_of_ranks,
                          checkpoint_dir=checkpoint_dir, tracker=tracker or RunTracker.disabled(), reporter=reporter)
        try:
            trainer.restore(warm_start)
            result = trainer.fit(step_hooks)
            if export_model_state and checkpoint_dir is not None:
                result.model_state_path = export_full_model_state(trainer.module, trainer.spec, model_config,
                                                                  Path(checkpoint_dir) / MODEL_STATE_FILE)
        finally:
            trainer.close()
        return trainer.module, result


@dataclass
class _StepLoop:
    """What reading a step needs of the loop that queued it (Trainer.fit, Trainer._read_step)."""

    timer: ForwardComputeTimer
    step_mfu: StepMFU
    hosts: Any  # step_balance.host_group()
    step_hooks: Sequence[StepHook]
    collection: CollectionSchedule
    dense_names: list[str]  # the names of the sharded model's dense parameters, in its order
    pending: dict[int, dict[str, float]] = field(default_factory=dict)  # metrics not yet sent to the tracker
    last_read: float = 0.0  # time.perf_counter when the last step was read


class Trainer:
    """The engine's state for one job: the model as sharded, its optimizer, the schedule and the result."""

    def __init__(self, logs: SequenceLogs, plan_path: str | os.PathLike, model_config: ModelConfig,
                 config: TrainConfig, topology: Topology, *, model: GEMModel | None, eval_indices: np.ndarray | None,
                 embedding_sharding: str, union_of_ranks: bool, checkpoint_dir: str | os.PathLike | None,
                 tracker: RunTracker, reporter: TrainingReporter | None):
        self.logs, self.plan_path, self.model_config, self.config = logs, plan_path, model_config, config
        self.topology, self.device = topology, topology.device
        self.eval_indices, self.tracker = eval_indices, tracker
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir is not None else None
        self.reporter = reporter if reporter is not None else LogReporter(config.log_every)
        self.spec = FeatureSpec.from_logs(logs)
        problem = training_data_problem(logs, plan_path, config, eval_indices)
        if problem is not None:  # before anything is built: thin data named with its counts
            raise ValueError(problem)
        # Held-out validation examples: the newest days of the plan's, out of the training steps.
        self.validation = newest_days(logs, plan_path, config.validation_days) if config.validation_days else None
        self.schedule = rank_schedule(logs, plan_path, topology.rank, topology.world_size, config.epochs, config.seed,
                                      model_config.sequence.max_history_len, union_of_ranks, self.validation)
        self.total = min(self.schedule.total_steps, config.max_steps or self.schedule.total_steps)
        self.model = (seeded_model(self.spec, model_config, self.device, config.seed) if model is None
                      else model.to(self.device))
        self.latest = latest_checkpoint(self.checkpoint_dir) if self.checkpoint_dir else None
        self.union_of_ranks = union_of_ranks
        self.embedding_sharding = embedding_sharding
        self.sharded: ShardedModel | None = None
        self.result = TrainResult(steps=0, samples=0, seconds=0.0, losses=[], world_size=topology.world_size)
        self.start = 0
        self.best_score, self.evals_since_best = math.inf, 0
        self.average: WeightAverage | None = None
        self.best_dir = self.checkpoint_dir / "best" if self.checkpoint_dir is not None else None
        self.temporary_best = False

    @property
    def module(self) -> nn.Module:
        return self.sharded.module if self.sharded is not None else self.model

    def say(self, text: str) -> None:
        if self.topology.rank == 0:
            self.reporter.message(text)

    def restore(self, warm_start: str | os.PathLike | None) -> None:
        """Weights before sharding (a warm start's, or the label rates as output biases), then the model
        sharded, then a checkpoint of this run resumed into the shards."""
        if self.latest is not None:
            conflict = resume_conflict(self.latest, self.model_config, self.spec)
            if conflict is not None:
                raise ValueError(conflict)
        elif warm_start is not None:
            conflict = warm_start_conflict(warm_start, self.model_config)
            if conflict is not None:
                raise ValueError(conflict)
            ckpt = load_checkpoint(warm_start)  # full weights, loaded before sharding: any world size
            missing, unexpected = self.model.load_state_dict(ckpt.state["model"], strict=False)
            self.say(f"warm start from {ckpt.path} (step {ckpt.step}): weights only, step 0; missing {missing}, "
                     f"unexpected {unexpected}")
            self.tracker.set_tags({"gem.warm_start": str(ckpt.path)})
            reset_calibration(self.model)  # refitted after this training
        else:
            # From the whole plan (but the validation examples): the same on every rank.
            init_output_biases(self.model, self.logs, self.plan_path, self.validation)
        parameters = {kind: sum(p.numel() for p in group.values())
                      for kind, group in zip(("embedding", "dense"), split_parameters(self.model))}
        accelerated = prepare_for_training(self.model, self.config, self.device)  # FP8, compile, checkpointing
        self.sharded = sharded = shard_model(self.model, self.config, self.embedding_sharding, self.device,
                                             self.topology.local_world_size)
        self.result.embedding_sharding, self.result.sharding_plan = sharded.embedding_sharding, describe_plan(sharded)
        if self.config.weight_average_decay:
            self.average = WeightAverage(sharded.module, self.config.weight_average_decay)
        mesh = f"FSDP2 over mesh {tuple(sharded.mesh.shape)}" if sharded.mesh is not None else "unsharded"
        self.say(f"{self.topology.world_size} rank(s) on {self.topology.nodes} node(s), {self.device.type}; embedding "
                 f"tables: {sharded.embedding_sharding}; dense: {mesh}; {self.total} steps")
        if self.eval_indices is None:
            for objective, counts in unscored_objectives(self.logs).items():
                self.say(f"eval: {objective} cannot be scored ({counts}); its metrics are left out")
        if self.latest is not None:
            progress = self._load_training_state(self.latest)
            self.start, self.result.resumed_from = progress["step"], progress["step"]
            self.result.losses = list(progress["losses"])
            self.result.steps = self.start  # what the model has trained, also when nothing is left to train
            self.result.balance = BalanceLog.from_dict(progress["balance"])
            validation = progress.get("validation", {})
            self.result.best_step = validation.get("best_step")
            self.best_score = validation.get("best_score", math.inf)
            self.evals_since_best = validation.get("evals_since_best", 0)
            self.result.stopped_early = progress.get("stopped_early", False)
            stopped = " (stopped early)" if self.result.stopped_early else ""
            self.say(f"resumed from {self.latest} at step {self.start}{stopped}")
        self.tracker.log_params({
            "model": self.model_config.to_dict(), "train": self.config.to_dict(), "steps": self.total,
            **{f"parameters.{kind}": n for kind, n in parameters.items()},
            "acceleration": {k: len(v) for k, v in accelerated.items()},
            "distributed": {"world_size": self.topology.world_size, "nodes": self.topology.nodes,
                            "device": self.device.type, "embedding_sharding": sharded.embedding_sharding,
                            "union_of_ranks": self.union_of_ranks}})
        self.tracker.log_dict(self.result.sharding_plan, "sharding_plan.json")

    def fit(self, step_hooks: Sequence[StepHook] = ()) -> TrainResult:
        """Steps from where the run stands to the end, then the final eval and checkpoint."""
        sharded, config, result, device = self.sharded, self.config, self.result, self.device
        world = self.topology.world_size
        units = sharded.fsdp_units
        end = self.start if result.stopped_early else self.total  # a run that stopped early does not train again
        late = reads_late(config.step_readout, device)
        if late and self.start < end:
            self.say("steps read late: each step's loss is read once the next step is queued (step_readout)")
        named = {id(p): name for name, p in self.module.named_parameters()}
        loop = _StepLoop(timer=ForwardComputeTimer(units, device),  # on one rank: the whole forward (timer.span)
                         step_mfu=StepMFU(device, world), hosts=host_group(), step_hooks=step_hooks,
                         collection=CollectionSchedule(config.gc_every),
                         dense_names=[named.get(id(p), f"dense parameter {i}")
                                      for i, p in enumerate(sharded.dense_parameters)])
        timer, collection = loop.timer, loop.collection
        inputs = prefetched(self._load, range(self.start, end), config.prefetch_batches)
        unit_prefetch = UnitPrefetch(units) if config.unit_prefetch and units else None
        self.module.train()
        # Under cuda_graphs: which of the compiled step's graphs Inductor ran without them, and why
        graph_skips = CudaGraphSkips() if config.cuda_graphs else None
        with graph_skips if graph_skips is not None else contextlib.nullcontext():
            if config.warm_up_lengths and self.start < end:
                self.say(f"warmed up at history lengths {self.warm_up_lengths()}")
            collection.start()
            result.started = loop.last_read = time.perf_counter()

            queued: QueuedStep | None = None  # read late: the step before the one being queued
            try:
                for step in range(self.start, end):
                    began = time.perf_counter()
                    # Dropout's masks as a function of the step: a run resumed from a checkpoint draws what an
                    # unbroken one did.
                    torch.manual_seed(config.seed * 1_000_003 + step)
                    self._mark_step_begin()
                    lr = set_dense_lr(sharded.optimizer, config, step, self.total)
                    with record_function("data"):  # waiting for the prefetched batch, and the copy to the device
                        _, (size, x, costs) = next(inputs)
                        x = x.to(device, non_blocking=True)
                    phases = [time.perf_counter()]
                    with autocast_context(device, config.precision), record_function("forward"), \
                            (timer.span() if not units else contextlib.nullcontext()):
                        sums = self.module.loss_sums(x)
                    loss, share, labelled = global_batch_loss(sums, world)
                    sharded.optimizer.zero_grad(set_to_none=True)
                    phases.append(time.perf_counter())
                    with record_function("backward"):
                        loss.backward()
                    phases.append(time.perf_counter())
                    with record_function("optimizer"):
                        grad_norm, flags = clip_dense_gradients(sharded.dense_parameters, config.clip_grad_norm)
                        sharded.optimizer.step()
                        if self.average is not None:
                            self.average.update()
                    phases.append(time.perf_counter())
                    if unit_prefetch is not None:  # the first step has shown the units' order
                        self.say(f"FSDP2 prefetch set over {len(unit_prefetch.arm())} units, in the first step's order")
                        unit_prefetch = None
                    current = queue_step(step, size, lr, costs, began, timer.cut(), share, labelled, grad_norm, flags)
                    current.host_seconds = host_phase_seconds(began, phases)
                    previous, queued = queued, None
                    if previous is not None and self._read_step(previous, loop, another_queued=True):
                        break
                    if late and not read_at_once(step, end, config.eval_every, config.checkpoint_every):
                        queued = current
                    elif self._read_step(current, loop, another_queued=False):
                        break
            finally:
                collection.stop()
                result.gc_seconds = collection.pauses.seconds
                inputs.close()  # an early stop leaves no loads running
                timer.remove()
        self.tracker.log_metrics_by_step(loop.pending)  # an early stop's last steps
        if graph_skips is not None:
            result.cuda_graph_skips, result.cuda_graph_skip_reasons = graph_skips.count, list(graph_skips.reasons)
            self.tracker.log_metrics({"train.cuda_graph_skips": result.cuda_graph_skips}, step=result.steps)
            self.say(graph_skips.summary())
        result.seconds = time.perf_counter() - result.started
        result.imbalance = result.balance.observed()
        if result.samples and result.seconds:
            self.tracker.log_metrics({"train.samples_per_second": result.samples_per_second,
                                      "train.gc_seconds": result.gc_seconds,
                                      "train.imbalance_observed": result.imbalance["compute_seconds"],
                                      **{f"train.imbalance_observed.{m}": v for m, v in result.imbalance.items()}},
                                     step=result.steps)
        if self.validation is not None:
            if not result.validation_steps or result.validation_steps[-1] != result.steps:
                self.validate(result.steps)
            self.restore_best()
            if config.calibrate:
                self.calibrate()
        elif self.average is not None:
            self.average.keep()
            self.say(f"kept the average of the weights (decay {config.weight_average_decay})")
        self.evaluate(result.steps, averaged=False)  # the average is the model's weights by now
        self.save(result.steps)
        if not result.samples:
            self.say(f"nothing trained this session: resumed at step {result.steps}, with no step left")
            return result
        self.say(f"trained {result.steps} steps ({result.samples} samples this session) at "
                 f"{result.samples_per_second:.0f} samples/s; observed imbalance "
                 f"{result.imbalance['compute_seconds']:.3f} (compute), {result.imbalance['tokens']:.3f} (tokens)")
        return result

    def _read_step(self, queued: QueuedStep, loop: _StepLoop, another_queued: bool) -> bool:
        """A step's figures into the result, the metrics and the hooks, then its evaluation or checkpoint; True: stop
        early. `another_queued`: the next step is on the device already (steps read late)."""
        config, result, world = self.config, self.result, self.topology.world_size
        step, costs, objectives = queued.step, queued.costs, self.model.objectives
        reading = time.perf_counter()
        figures, flagged = read_figures(queued)
        waited = time.perf_counter() - reading
        # Since the previous step was read: with steps read late, the time the device took for this one.
        wall = time.perf_counter() - max(queued.began, loop.last_read)
        local = [loop.timer.seconds(queued.forward_spans), costs["tokens"], costs["attention_cost"], wall,
                 costs["flops"], *figures]
        rows = gather_rows(local, loop.hosts)
        n, tasks = len(MEASURES), len(objectives)
        ratios = result.balance.add(step, rows[:, :n])
        value = float(rows[:, n + 2 : n + 2 + tasks].sum())
        norm = float(rows[:, -1].max())
        if not (math.isfinite(value) and math.isfinite(norm)):
            if not another_queued:  # the dense gradients flagged before clipping spread a NaN; the tables' as they are
                dense = set(loop.dense_names)
                names = [loop.dense_names[i] for i in flagged]
                names += [name for name in nonfinite_gradients(self.module) if name not in dense]
                later = ""
            elif flagged:  # flagged when the step was queued: the gradients now are the next step's
                names, later = [loop.dense_names[i] for i in flagged], "; dense gradients checked (steps read late)"
            else:  # none of the dense ones: where else, the next step's gradients may tell
                names = nonfinite_gradients(self.module)
                later = (f"; no dense gradient of this step was; the gradients named are step {step + 1}'s, "
                         "queued before this step was read (step_readout='each_step' names this step's own)")
            raise FloatingPointError(divergence_message(step, value, norm, names) + later)
        loop.last_read = time.perf_counter()
        result.losses.append(value)
        result.samples += queued.size * world
        result.step_samples.append(queued.size * world)
        result.step_read_waits.append(waited)
        result.step_host_seconds.append(queued.host_seconds)
        result.steps = step + 1
        result.step_seconds.append(float(rows[:, n].max()))
        result.step_flops.append(float(rows[:, n + 1].sum()))
        result.step_module_flops.append(costs["forward_by_module"])
        result.step_ends.append(loop.last_read)
        metrics = {"train.loss": value, "train.lr_dense": queued.lr, "train.grad_norm": norm,
                   "train.step_seconds": result.step_seconds[-1],
                   **loop.step_mfu.metrics(result.step_flops[-1], result.step_seconds[-1]),
                   **{f"train.loss.{t}": float(v)
                      for t, v in zip(objectives, rows[:, n + 2 + tasks : n + 2 + 2 * tasks].sum(0))},
                   **{f"train.imbalance.{m}": r for m, r in ratios.items()}}
        loop.pending[step] = metrics
        if self.topology.rank == 0:
            self.reporter.step(step, self.total, metrics)
        for hook in loop.step_hooks:
            hook(step, value)
        loop.collection.after_step(step)
        if len(loop.pending) >= config.log_every or step + 1 == self.total:
            self.tracker.log_metrics_by_step(loop.pending)
            loop.pending.clear()
        if config.eval_every and (step + 1) % config.eval_every == 0 and step + 1 < self.total:
            if self.validation is None:
                self.evaluate(step + 1)
            elif self.validate(step + 1):
                result.stopped_early = True
                self.say(f"early stop at step {step + 1}: no better validation NE in "
                         f"{self.evals_since_best} evaluations; keeping step {result.best_step}")
                return True
        if config.checkpoint_every and (step + 1) % config.checkpoint_every == 0 and step + 1 < self.total:
            self.tracker.log_metrics_by_step(loop.pending)  # a resume starts after them: never lost
            loop.pending.clear()
            self.save(step + 1)
        return False

    def warm_up_lengths(self) -> list[int]:
        """One zero-loss forward and backward per history-length bucket (gem_ops.train.warm_up); no weight moves."""
        ran = []
        with record_function("warm_up"):
            for length, x in warm_up_inputs(self.logs, self.spec, self.model_config,
                                            size_bucket=self.config.size_bucket):
                self._mark_step_begin()
                with autocast_context(self.device, self.config.precision):
                    sums = self.module.loss_sums(x.to(self.device))
                # Each pass's gradients its own, as a step's are: under CUDA graphs one accumulated onto the pass
                # before's would read memory that pass's graphs own and the next pass has overwritten.
                self.sharded.optimizer.zero_grad(set_to_none=True)
                global_batch_loss(sums, self.topology.world_size)[0].backward()
                ran.append(length)
        self.sharded.optimizer.zero_grad(set_to_none=True)
        return ran

    def _mark_step_begin(self) -> None:
        """Before each forward and backward pair under TrainConfig.cuda_graphs: the graphs' outputs of the pass
        before may be overwritten from here (unmarked, a second pass's replay overwrites what the first one's backward
        still reads)."""
        if self.config.cuda_graphs:
            torch.compiler.cudagraph_mark_step_begin()

    def _load(self, step: int) -> tuple[int, Any, dict[str, Any]]:
        """A step's input, built (and pinned, for a GPU) in the prefetch thread, with what it costs."""
        with record_function("data.load"):
            return step_input(self.logs, self.schedule.examples(step), step, self.spec, self.model_config,
                              self.config, pin=self.device.type == "cuda")

    def validate(self, step: int) -> bool:
        """Evaluates on the validation examples, keeps the weights if their NE is the best yet, and says
        whether training should stop (patience exhausted). Collective."""
        with self.averaged():
            report = evaluate(self.module, self.logs, self.config, self.device, self.validation)
            self.result.validation_steps.append(step)
            self.result.validation_reports.append(report)
            self.tracker.log_metrics(flat_metrics(report, "validation"), step=step)
            score = broadcast(validation_ne(report, self.model.objectives) if self.topology.rank == 0 else None)
            if score < self.best_score:
                self.best_score, self.evals_since_best, self.result.best_step = score, 0, step
                save_checkpoint(self.best_folder(), step, {"model": self.module.state_dict()}, {"score": score}, keep=1)
            else:
                self.evals_since_best += 1
        patience = self.config.early_stopping_patience
        return bool(patience) and self.evals_since_best >= patience and step >= self.config.early_stopping_min_steps

    def restore_best(self) -> None:
        """The best validated weights back in the model (when training went on past them, or they were the
        average's). Collective."""
        if self.result.best_step is None or (self.result.best_step == self.result.steps and self.average is None):
            return
        state = {"model": self.module.state_dict()}
        load_into(latest_checkpoint(self.best_folder()), state)
        self.module.load_state_dict(state["model"])
        self.say(f"kept the weights of step {self.result.best_step} (validation NE {self.best_score:.4f})")

    def calibrate(self) -> None:
        """Platt scaling per (domain, task) fitted on the validation examples, set in the model's output. Collective."""
        head = output_calibration(self.module)
        if head is None:
            return
        reset_calibration(self.module)
        out = gathered_predictions(self.module, self.logs, self.config, self.device, self.validation)
        recent = None
        if self.config.calibration_trend:  # the days before the held-out one, for the residual's trend
            before = trend_examples(self.logs, read_plan(self.plan_path).reshape(-1), self.validation, self.config.seed)
            if before.size:
                recent = gathered_predictions(self.module, self.logs, self.config, self.device, before)
        fitted, targets = None, {}
        if out is not None:
            fitted = fit_calibration(out["logits"], out["labels"], out["label_mask"], out["surface"], head.domains)
            trends = None if recent is None else find_trends(*fitted, out, recent, self.logs, head.domains)
            if self.config.calibration_rate == "backtested":
                targets = retarget_shifts(*fitted, out, self.logs, self.validation, self.model.objectives,
                                          trending=None if trends is None else trends["trend_taken"])
            if trends is not None:
                targets |= trends | {"shift_before_trend": fitted[1].tolist()}
                step_trends(*fitted, out, trends)
        scale, shift = broadcast(fitted)
        head.set_calibration(scale, shift)
        self.result.calibration = {"scale": scale.tolist(), "shift": shift.tolist(), **broadcast(targets)}
        if out is not None:
            calibrated = out["logits"] * scale[out["surface"]] + shift[out["surface"]]
            report = quality_report(calibrated, out["labels"], out["label_mask"], out["surface"],
                                    self.spec.surfaces, self.model.objectives)
            self.tracker.log_metrics(flat_metrics(report, "validation.calibrated"), step=self.result.steps)
            self.tracker.log_dict(self.result.calibration, "calibration.json")

    def best_folder(self) -> Path:
        """Where the best validated weights are kept: under the run's checkpoint folder, else in a
        temporary folder of the run's (the same on every rank; removed by `close`)."""
        if self.best_dir is None:
            made = tempfile.mkdtemp(prefix="gem-best-") if self.topology.rank == 0 else None
            self.best_dir = Path(broadcast(made))
            self.temporary_best = True
        return self.best_dir

    def close(self) -> None:
        if self.temporary_best and self.topology.rank == 0:
            shutil.rmtree(self.best_dir, ignore_errors=True)

    def averaged(self) -> contextlib.AbstractContextManager:
        """The weight average in the model for the block, when training keeps one."""
        return self.average.swapped_in() if self.average is not None else contextlib.nullcontext()

    def evaluate(self, step: int, averaged: bool = True) -> None:
        with self.averaged() if averaged else contextlib.nullcontext():
            report = evaluate(self.module, self.logs, self.config, self.device, self.eval_indices)
        self.result.eval_steps.append(step)
        self.result.eval_reports.append(report)
        self.tracker.log_metrics(flat_metrics(report), step=step)

    def save(self, step: int) -> None:
        if self.checkpoint_dir is None:
            return
        progress = {"losses": self.result.losses, "balance": self.result.balance.to_dict(), "spec": asdict(self.spec),
                    "model_config": self.model_config.to_dict(), "train_config": self.config.to_dict(),
                    "world_size": self.topology.world_size, "embedding_sharding": self.sharded.embedding_sharding,
                    "stopped_early": self.result.stopped_early, "weight_average": self.average is not None,
                    "validation": {"best_step": self.result.best_step, "best_score": self.best_score,
                                   "evals_since_best": self.evals_since_best}}
        self.result.checkpoint = save_checkpoint(self.checkpoint_dir, step, self._training_state(), progress,
                                                 self.config.keep_checkpoints)

    def _training_state(self, with_average: bool = True) -> dict[str, Any]:
        state = {"model": self.sharded.module.state_dict(), "optimizer": self.sharded.optimizer.state_dict()}
        if self.average is not None and with_average:
            state[AVERAGE_KEY] = self.average.state_dict(self.topology.rank)
        return state

    def _load_training_state(self, path: Path) -> dict[str, Any]:
        sharded = self.sharded
        for name, optimizer in sharded.optimizer.optimizers:
            if not (name == "sparse" and sharded.dmp is not None):  # the fused table optimizer has its state
                # Keyed optimizers load only into initialised state; the dummy step that initialises it
                # moves the weights (weight decay), which are loaded after it.
                optimizer.init_state()
        # The average is per rank's shards: it resumes at the world size that saved it, else restarts here.
        saved = read_progress(path)
        state = self._training_state(with_average=saved.get("weight_average", False)
                                     and saved.get("world_size") == self.topology.world_size)
        progress = load_into(path, state)
        sharded.module.load_state_dict(state["model"])
        sharded.optimizer.load_state_dict(state["optimizer"])
        if self.average is not None and AVERAGE_KEY in state:
            self.average.load_state_dict(state[AVERAGE_KEY], self.topology.rank)
        elif self.average is not None:
            self.average = WeightAverage(sharded.module, self.config.weight_average_decay)
            self.say("weight average started from the resumed weights (the checkpoint has none for this world size)")
        return progress


def step_input(logs: SequenceLogs, examples: np.ndarray, step: int, spec: FeatureSpec, model_config: ModelConfig,
               config: TrainConfig, pin: bool = False) -> tuple[int, Any, dict[str, Any]]:
    """(the batch's size, the model's input, what it costs: tokens, attention cost, FLOPs) of one step's `examples`;
    `pin`: in page-locked memory, for an asynchronous copy to a GPU."""
    max_len, sequence = model_config.sequence.max_history_len, model_config.sequence
    caps = history_caps(len(examples), max_len, config.history_cut_share, config.seed, step)
    batch = logs.batch(examples, max_len, caps, retrieved_events=sequence.retrieved_events,
                       retrieval_key=sequence.retrieval_key)
    x = model_input(batch, spec, model_config, with_level_sizes=True, size_bucket=config.size_bucket)
    if pin:
        x = x.pin_memory()
    tokens = batch.history_lengths.double() + 1.0  # the candidate is a token too
    flops = batch_flops(batch, spec, model_config)
    costs = {"tokens": float(tokens.sum()), "attention_cost": float((tokens * tokens).sum()),
             "flops": flops.training, "forward_by_module": flops.forward_by_module}
    return batch.size, x, costs


def validation_ne(report: dict[str, dict[str, float]], objectives: Sequence[str]) -> float:
    """The early-stopping criterion: the NE of all objectives pooled over the validation days, the
    examples' log loss summed over objectives over their base-rate entropy summed likewise, so a rare
    objective with a handful of labels weighs what its labels carry (objectives without both classes are
    left out; inf if none has them)."""
    loss = entropy = 0.0
    for task in objectives:
        group = report.get(f"all/{task}", {})
        if math.isfinite(group.get("ne", math.nan)):
            loss += group["log_loss"] * group["count"]
            entropy += group["log_loss"] / group["ne"] * group["count"]
    return loss / entropy if entropy > 0 else math.inf


def broadcast(value: Any) -> Any:
    """Rank 0's value on every rank (as it is on one rank)."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def fit_full_batch(module: nn.Module, loss_of: Callable[[], torch.Tensor], steps: int, lr: float,
                   weight_decay: float = 0.0) -> nn.Module:
    """A small model fitted on all its examples at once (the Student Adapter): `steps` Adam steps on the
    loss `loss_of()` computes. Returns the module, in eval mode."""
    optimizer = torch.optim.Adam(module.parameters(), lr=lr, weight_decay=weight_decay)
    module.train()
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        loss_of().backward()
        optimizer.step()
    return module.eval()
