"""Training a student (domain foundation model or vertical model) alone or from a teacher."""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from gem_ops.data.atomic import atomic_path
from gem_ops.data.batch_shuffling import ShufflingConfig, plan_base_batch_shuffling, write_plan
from gem_ops.data.loader import SequenceLogs
from gem_ops.model.config import FeatureSpec, ModelConfig
from gem_ops.model.gem import GEMModel
from gem_ops.tracking import RunTracker
from gem_ops.train.config import TrainConfig
from gem_ops.train.engine import TrainResult, train
from gem_ops.train.model_state import seeded_model
from gem_ops.transfer.adapter import adapt, fit_adapter
from gem_ops.transfer.config import TransferConfig
from gem_ops.transfer.knowledge import TeacherJoinedLogs, TeacherPredictions, predictions_quality
from gem_ops.transfer.sharing import fold_projections, share_tables, sharing_config
from gem_ops.transfer.user_representations import UserRepresentations


@dataclass
class Teacher:
    """What a student learns from: the teacher's model (for its tables) and its scores of the student's
    training and eval examples (for distillation and representation transfer)."""

    model: GEMModel
    predictions: TeacherPredictions
    identity: dict[str, Any] = field(default_factory=dict)  # model name, version, kind, representations path, ...
    representations: UserRepresentations | None = None  # its user representations (predictions hold each example's)


@dataclass
class StudentRun:
    model: GEMModel
    result: TrainResult
    data: SequenceLogs | TeacherJoinedLogs  # what the student reads (teacher columns joined in)
    adapter_report: dict[str, dict[str, dict[str, float]]] = field(default_factory=dict)  # {"teacher"|"adapted": eval report}


def student_config(base: ModelConfig, tasks: tuple[str, ...], transfer: TransferConfig,
                   teacher: Teacher | None) -> ModelConfig:
    """The student's architecture: `base` predicting `tasks`, shaped for the transfer mechanisms in use."""
    config = replace(base, tasks=tuple(tasks))
    if teacher is None:
        return config
    if transfer.shared_tables:
        config = sharing_config(config, teacher.model.config, transfer.shared_tables)
    return replace(config, distillation_weight=transfer.distillation_weight,
                   distillation_head=transfer.distillation_head,
                   teacher_representation_dim=teacher.predictions.representation_dim if transfer.representation else 0)


def write_student_plan(logs: SequenceLogs, indices: np.ndarray, destination: str | os.PathLike,
                       shuffling: ShufflingConfig, max_history_len: int) -> Path:
    """A one-rank Base Batch Shuffling plan over the student's examples."""
    lengths = logs.history_lengths(max_history_len)[indices]
    if indices.size < shuffling.rank_batch_size:
        raise ValueError(f"{indices.size} training examples are fewer than one batch ({shuffling.rank_batch_size}); "
                         "widen the student window (student_days) or lower the batch size")
    plan = plan_base_batch_shuffling(lengths, 1, shuffling, indices)
    return write_plan(plan, destination, min(max_history_len, logs.max_history_len))


def train_student(
    logs: SequenceLogs,
    train_indices: np.ndarray,
    eval_indices: np.ndarray,
    base: ModelConfig,
    tasks: tuple[str, ...],
    train_config: TrainConfig,
    work_dir: str | os.PathLike,
    transfer: TransferConfig = TransferConfig(),
    teacher: Teacher | None = None,
    shuffling: ShufflingConfig = ShufflingConfig(),
    tracker: RunTracker | None = None,
    device: str = "cpu",
    adapter_indices: np.ndarray | None = None,
) -> StudentRun:
    """Trains a student on `train_indices` and evaluates it on `eval_indices`, alone (teacher None) or with
    the transfer mechanisms `transfer` turns on; its Student Adapter fits the fresh labels of `adapter_indices`
    (default: `train_indices`). The model comes back on `device`."""
    config = student_config(base, tasks, transfer, teacher)
    plan = write_student_plan(logs, train_indices, Path(work_dir) / "plan.parquet", shuffling,
                              config.sequence.max_history_len)
    data: SequenceLogs | TeacherJoinedLogs = logs
    adapter_report = {}
    if teacher is not None and (config.distillation_weight > 0 or config.teacher_representation_dim):
        predictions = teacher.predictions
        if config.distillation_weight > 0 and transfer.student_adapter:
            fresh = train_indices if adapter_indices is None else adapter_indices
            adapter = fit_adapter(logs, predictions, fresh, transfer.adapter_hidden, transfer.adapter_steps,
                                  transfer.adapter_lr, train_config.seed)
            adapted = adapt(adapter, logs, predictions)
            adapter_report = {"teacher": prediction_report(logs, predictions, eval_indices, config),
                              "adapted": prediction_report(logs, adapted, eval_indices, config)}
            predictions = adapted
        data = TeacherJoinedLogs(logs, predictions, teacher.representations)
    model = seeded_model(FeatureSpec.from_logs(logs), config, "cpu", train_config.seed)
    if teacher is not None and transfer.shared_tables:
        share_tables(model, teacher.model, transfer.shared_tables, transfer.freeze_shared)
    training = {"model": config.to_dict(), "train": train_config.to_dict(), "transfer": asdict(transfer),
                "shuffling": asdict(shuffling), "teacher": teacher.identity if teacher else None,
                "train_examples": int(len(train_indices)), "eval_examples": int(len(eval_indices))}
    checkpoints = resumable_checkpoints(work_dir, training)
    model, result = train(data, plan, config, train_config, model=model, eval_indices=eval_indices, tracker=tracker,
                          checkpoint_dir=checkpoints, device=device)  # one process: the model comes back whole
    shutil.rmtree(checkpoints, ignore_errors=True)  # only a killed run resumes: a finished one is registered
    return StudentRun(fold_projections(model), result, data, adapter_report)  # served at the student's own size


def resumable_checkpoints(work_dir: str | os.PathLike, training: dict[str, Any]) -> Path:
    """The student's checkpoint folder: a killed run of the same training (same settings, teacher and
    example counts) resumes from what it holds; checkpoints of any other training are cleared first."""
    folder = Path(work_dir) / "checkpoints"
    stamp, text = folder / "training.json", json.dumps(training, sort_keys=True, default=str)
    if folder.exists() and not (stamp.exists() and stamp.read_text() == text):
        shutil.rmtree(folder)
    if not stamp.exists():
        with atomic_path(stamp) as tmp:
            tmp.write_text(text)
    return folder


def prediction_report(logs: SequenceLogs, predictions: TeacherPredictions, indices: np.ndarray,
                      config: ModelConfig) -> dict[str, dict[str, float]]:
    """Quality of stored predictions on `indices`, for the tasks of `config`."""
    return predictions_quality(logs, predictions, indices, config.objectives(FeatureSpec.from_logs(logs)))
