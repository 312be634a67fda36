"""The training loop: one rank's steps of a shuffled_batches plan, periodic evaluation, checkpoints,
resume and warm start, metrics to MLflow through a RunTracker (a no-op off rank 0)."""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.autograd.profiler import record_function

from gem_ops.data.loader import SequenceLogs
from gem_ops.metrics.flops import batch_flops
from gem_ops.metrics.mfu import StepMFU
from gem_ops.metrics.quality import flat_metrics, quality_report
from gem_ops.model import build_model
from gem_ops.model.config import FeatureSpec, ModelConfig
from gem_ops.model.features import model_input
from gem_ops.model.gem import GEMModel
from gem_ops.tracking import RunTracker
from gem_ops.train.acceleration import prepare_for_training
from gem_ops.train.batches import PlanSchedule, eval_batches
from gem_ops.train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from gem_ops.train.config import TrainConfig
from gem_ops.train.initialization import init_output_biases
from gem_ops.train.optimizer import build_optimizer, set_dense_lr, sparse_table_gradients, split_parameters
from gem_ops.train.prefetch import prefetched

log = logging.getLogger(__name__)


@dataclass
class TrainResult:
    steps: int
    samples: int
    seconds: float
    losses: list[float]  # per step, the whole run (resumed runs included)
    eval_steps: list[int] = field(default_factory=list)
    eval_reports: list[dict[str, dict[str, float]]] = field(default_factory=list)
    checkpoint: Path | None = None
    resumed_from: int | None = None
    step_seconds: list[float] = field(default_factory=list)  # this session's steps, wall time, data included
    step_flops: list[float] = field(default_factory=list)  # their model FLOPs (forward + backward, all ranks)

    @property
    def final_report(self) -> dict[str, dict[str, float]]:
        return self.eval_reports[-1] if self.eval_reports else {}

    @property
    def samples_per_second(self) -> float:
        return self.samples / self.seconds if self.seconds else math.nan


def autocast_context(device: torch.device, precision: str):
    use_bf16 = precision in ("bf16", "fp8") or (precision == "auto" and device.type == "cuda")
    return torch.autocast(device.type, dtype=torch.bfloat16) if use_bf16 else contextlib.nullcontext()


def seeded_model(spec: FeatureSpec, config: ModelConfig, device: torch.device | str = "cpu", seed: int = 0) -> GEMModel:
    torch.manual_seed(seed)
    return build_model(spec, config, device)


def model_state(model: GEMModel) -> dict[str, Any]:
    """Everything needed to rebuild the model without the data: spec, config and weights."""
    return {"spec": asdict(model.spec), "model_config": model.config.to_dict(), "model": model.state_dict()}


def model_from_state(state: dict[str, Any], device: torch.device | str = "cpu") -> GEMModel:
    spec = FeatureSpec(**{k: tuple(v) for k, v in state["spec"].items()})
    model = build_model(spec, ModelConfig.from_dict(state["model_config"]), device)
    model.load_state_dict(state["model"])
    return model


@torch.no_grad()
def predict_logits(model: GEMModel, logs: SequenceLogs, indices: list[np.ndarray] | Any, device: torch.device,
                   precision: str = "auto") -> dict[str, torch.Tensor]:
    """Logits, labels, masks and domains of the given batches of example indices, in batch order."""
    was_training = model.training
    model.eval()
    parts: dict[str, list[torch.Tensor]] = {"logits": [], "labels": [], "label_mask": [], "surface": [], "example_index": []}
    max_len = model.config.sequence.max_history_len
    for batch_indices in indices:
        batch = logs.batch(batch_indices, max_len)
        x = model_input(batch, model.spec, model.config)
        with autocast_context(device, precision):
            logits = model(x.to(device))
        parts["logits"].append(logits.float().cpu())
        parts["labels"].append(x.labels)
        parts["label_mask"].append(x.label_mask)
        parts["surface"].append(batch.surface)
        parts["example_index"].append(batch.example_index)
    model.train(was_training)
    return {k: torch.cat(v) if v else torch.empty(0) for k, v in parts.items()}


def evaluate(model: GEMModel, logs: SequenceLogs, config: TrainConfig, device: torch.device,
             indices: np.ndarray | None = None) -> dict[str, dict[str, float]]:
    """Quality on the eval split (or the given eval examples), per domain and task."""
    batches = eval_batches(logs, config.eval_max_examples, config.eval_batch_size,
                           model.config.sequence.max_history_len, config.seed, indices)
    out = predict_logits(model, logs, batches, device, config.precision)
    return quality_report(out["logits"], out["labels"], out["label_mask"], out["surface"],
                          model.spec.surfaces, model.objectives)


def train(
    logs: SequenceLogs,
    plan_path: str | os.PathLike,
    model_config: ModelConfig,
    config: TrainConfig,
    *,
    checkpoint_dir: str | os.PathLike | None = None,
    warm_start: str | os.PathLike | None = None,
    tracker: RunTracker | None = None,
    device: torch.device | str = "cpu",
    rank: int = 0,
    on_step: Callable[[int, float], None] | None = None,
    model: GEMModel | None = None,
    eval_indices: np.ndarray | None = None,
) -> tuple[GEMModel, TrainResult]:
    """Trains on this rank's rows of the plan. A checkpoint already in checkpoint_dir is resumed (same
    step count at the end as an uninterrupted run); otherwise `warm_start` (a checkpoint of an earlier
    run) initialises the weights. `model`: one already built for model_config (e.g. with tables shared
    from a teacher); `eval_indices`: the eval examples (default: the whole eval split)."""
    device = torch.device(device)
    tracker = tracker or RunTracker.disabled()
    spec = FeatureSpec.from_logs(logs)
    model = seeded_model(spec, model_config, device, config.seed) if model is None else model.to(device)
    accelerated = prepare_for_training(model, config, device)
    if config.sparse_table_gradients:
        sparse_table_gradients(model)  # the optimizer then touches only the rows each batch looked up
    optimizer = build_optimizer(model, config)
    schedule = PlanSchedule(plan_path, rank, config.epochs, config.seed)
    total = min(schedule.total_steps, config.max_steps or schedule.total_steps)

    start, losses, resumed_from = 0, [], None
    latest = latest_checkpoint(checkpoint_dir) if checkpoint_dir else None
    if latest is not None:
        ckpt = load_checkpoint(latest)
        # TorchRec's keyed optimizers load only into initialised state; the dummy step that initialises
        # it moves the weights (weight decay), so the weights are loaded after it.
        optimizer.init_state()
        model.load_state_dict(ckpt.state["model"])
        optimizer.load_state_dict(ckpt.state["optimizer"])
        start, losses, resumed_from = ckpt.step, list(ckpt.state["losses"]), ckpt.step
        log.info("resumed from %s at step %d", latest, start)
    elif warm_start is not None:
        ckpt = load_checkpoint(warm_start)
        missing, unexpected = model.load_state_dict(ckpt.state["model"], strict=False)
        log.info("warm start from %s (step %d); missing %s, unexpected %s", ckpt.path, ckpt.step, missing, unexpected)
        tracker.set_tags({"gem.warm_start": str(ckpt.path)})
    else:
        init_output_biases(model, logs, plan_path)

    tables, dense = split_parameters(model)
    tracker.log_params({"model": model_config.to_dict(), "train": config.to_dict(), "steps": total,
                        "parameters.dense": sum(p.numel() for p in dense.values()),
                        "parameters.embedding": sum(p.numel() for p in tables.values()),
                        "acceleration": {k: len(v) for k, v in accelerated.items()}})
    result = TrainResult(steps=start, samples=0, seconds=0.0, losses=losses, resumed_from=resumed_from)
    pending: dict[int, dict[str, float]] = {}

    def checkpoint(step: int) -> None:
        if checkpoint_dir is not None and rank == 0:
            state = {**model_state(model), "optimizer": optimizer.state_dict(), "losses": result.losses,
                     "train_config": config.to_dict()}
            result.checkpoint = save_checkpoint(checkpoint_dir, step, state, config.keep_checkpoints)

    def run_eval(step: int) -> None:
        report = evaluate(model, logs, config, device, eval_indices)
        result.eval_steps.append(step)
        result.eval_reports.append(report)
        tracker.log_metrics(flat_metrics(report), step=step)

    def load(step: int):
        with record_function("data.load"):
            batch = logs.batch(schedule.examples(step), model_config.sequence.max_history_len)
            return batch, model_input(batch, spec, model_config), batch_flops(batch, spec, model_config).training

    model.train()
    dense_params = list(dense.values())
    step_mfu = StepMFU(device)
    inputs = prefetched(load, range(start, total), config.prefetch_batches)
    began = time.perf_counter()
    for step in range(start, total):
        stepped = time.perf_counter()
        lr = set_dense_lr(optimizer, config, step)
        with record_function("data"):  # waiting for the prefetched batch, and the copy to the device
            _, (batch, x, flops) = next(inputs)
            x = x.to(device, non_blocking=True)
        with autocast_context(device, config.precision), record_function("forward"):
            loss, per_task, _ = model.loss(x)
        optimizer.zero_grad(set_to_none=True)
        with record_function("backward"):
            loss.backward()
        with record_function("optimizer"):
            if config.clip_grad_norm > 0:
                torch.nn.utils.clip_grad_norm_(dense_params, config.clip_grad_norm)
            optimizer.step()

        value = float(loss.detach())
        if not math.isfinite(value):
            raise FloatingPointError(f"training loss is {value} at step {step}; lower lr_dense/lr_sparse")
        result.losses.append(value)
        result.samples += batch.size
        result.steps = step + 1
        result.step_seconds.append(time.perf_counter() - stepped)
        result.step_flops.append(flops)
        pending[step] = {"train.loss": value, "train.lr_dense": lr, "train.step_seconds": result.step_seconds[-1],
                         **step_mfu.metrics(flops, result.step_seconds[-1]),
                         **{f"train.loss.{t}": float(v) for t, v in zip(model.objectives, per_task)}}
        if on_step is not None:
            on_step(step, value)
        if len(pending) >= config.log_every or step + 1 == total:
            _flush(tracker, pending)
        if config.eval_every and (step + 1) % config.eval_every == 0 and step + 1 < total:
            run_eval(step + 1)
        if config.checkpoint_every and (step + 1) % config.checkpoint_every == 0 and step + 1 < total:
            checkpoint(step + 1)
    result.seconds = time.perf_counter() - began
    if result.samples:
        tracker.log_metrics({"train.samples_per_second": result.samples_per_second}, step=result.steps)
    run_eval(result.steps)
    checkpoint(result.steps)
    return model, result


def _flush(tracker: RunTracker, pending: dict[int, dict[str, float]]) -> None:
    tracker.log_metrics_by_step(pending)
    pending.clear()
