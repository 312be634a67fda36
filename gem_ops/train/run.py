"""One training run end to end: train, evaluate, log curves and metrics, package and register the model.
Shared by the Dagster asset and the command line."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from gem_ops.data.loader import SequenceLogs
from gem_ops.model.config import ModelConfig
from gem_ops.model.gem import GEMModel
from gem_ops.tracking import RunTracker
from gem_ops.train.checkpoint import checkpoint_steps
from gem_ops.train.config import TrainConfig
from gem_ops.train.loop import TrainResult, train
from gem_ops.train.mlflow_model import batch_to_frame, log_model
from gem_ops.train.plots import loss_curves

INPUT_EXAMPLE_ROWS = 4


@dataclass
class TrainingOutcome:
    model: GEMModel
    result: TrainResult
    model_version: str | None


def previous_checkpoint(runs_dir: str | os.PathLike, before: str) -> Path | None:
    """The checkpoint folder of the latest earlier run (runs_dir/<key>/checkpoints, keys sorted, e.g. dates)."""
    runs_dir = Path(runs_dir)
    if not runs_dir.is_dir():
        return None
    for key in sorted((p.name for p in runs_dir.iterdir() if p.is_dir() and p.name < before), reverse=True):
        if checkpoint_steps(runs_dir / key / "checkpoints"):
            return runs_dir / key / "checkpoints"
    return None


def run_training(
    logs: SequenceLogs,
    plan_path: str | os.PathLike,
    model_config: ModelConfig,
    train_config: TrainConfig,
    *,
    checkpoint_dir: str | os.PathLike | None,
    warm_start: str | os.PathLike | None = None,
    tracker: RunTracker | None = None,
    registered_name: str | None = None,
    device: torch.device | str = "cpu",
    on_step: Callable[[int, float], None] | None = None,
) -> TrainingOutcome:
    tracker = tracker or RunTracker.disabled()
    model, result = train(logs, plan_path, model_config, train_config, checkpoint_dir=checkpoint_dir,
                          warm_start=warm_start, tracker=tracker, device=device, on_step=on_step)
    tracker.log_figure(loss_curves(result.losses, result.eval_steps, result.eval_reports), "loss_curves.png")
    tracker.log_dict(result.final_report, "eval_metrics.json")
    version = None
    if tracker.enabled:
        example = logs.batch(logs.split_indices("eval")[:INPUT_EXAMPLE_ROWS] if len(logs.split_indices("eval"))
                             else np.arange(min(INPUT_EXAMPLE_ROWS, len(logs))), model_config.sequence.max_history_len)
        version = log_model(tracker.client, tracker.run_id, model.cpu(), batch_to_frame(example, model.spec),
                            registered_name)
        model.to(device)
    return TrainingOutcome(model, result, version)
