"""Training a student (domain foundation model or vertical model) alone or from a teacher."""

from __future__ import annotations

import contextlib
import json
import math
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
from gem_ops.metrics.quality import flat_metrics
from gem_ops.model.gem import GEMModel
from gem_ops.tracking import RunTracker
from gem_ops.train.batches import examples_of_newest_days
from gem_ops.train.config import TrainConfig
from gem_ops.train.engine import TrainResult, train, validation_ne
from gem_ops.train.model_state import (load_model_state, model_from_state, model_state, save_model_state,
                                      seeded_model)
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
    # {"teacher"|"adapted": eval report}
    adapter_report: dict[str, dict[str, dict[str, float]]] = field(default_factory=dict)
    # With shared tables: which were kept ("fixed": the teacher's, or "trained") and each candidate's validation NE
    shared_tables: dict[str, Any] = field(default_factory=dict)


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
            if transfer.adapter_fit == "held_out":
                if not train_config.validation_days:
                    raise ValueError("TransferConfig.adapter_fit 'held_out' fits the Student Adapter on the validation "
                                     "days: set TrainConfig.validation_days (run config validation_days) >= 1")
                fresh = examples_of_newest_days(logs, fresh, train_config.validation_days)  # as the engine holds out
            adapter = fit_adapter(logs, predictions, fresh, transfer.adapter_hidden, transfer.adapter_steps,
                                  transfer.adapter_lr, train_config.seed, transfer.adapter_feature,
                                  transfer.adapter_feature_buckets, transfer.adapter_shrinkage,
                                  transfer.adapter_shift_only)
            adapted = adapt(adapter, logs, predictions)
            adapter_report = {"teacher": prediction_report(logs, predictions, eval_indices, config),
                              "adapted": prediction_report(logs, adapted, eval_indices, config)}
            predictions = adapted
        data = TeacherJoinedLogs(logs, predictions, teacher.representations)
    choices = shared_table_choices(transfer, teacher is not None, train_config.validation_days > 0)
    tracker = tracker or RunTracker.disabled()
    runs, folders, settings = [], [], {}
    for i, fixed in enumerate(choices):
        training = {"model": config.to_dict(), "train": train_config.to_dict(),
                    "transfer": {**asdict(transfer), "freeze_shared": fixed}, "shuffling": asdict(shuffling),
                    "teacher": teacher.identity if teacher else None,
                    "train_examples": int(len(train_indices)), "eval_examples": int(len(eval_indices))}
        label = "fixed" if fixed else "trained"
        settings[label] = training
        folder = Path(work_dir) / f"{label}_tables" if len(choices) > 1 else work_dir
        checkpoints = resumable_checkpoints(folder, training)
        folders.append(checkpoints)
        finished = finished_candidate(checkpoints, device)  # a job killed during a later candidate keeps this one
        if finished is not None:
            model, result = finished
        else:
            model = seeded_model(FeatureSpec.from_logs(logs), config, "cpu", train_config.seed)
            if fixed is not None:
                share_tables(model, teacher.model, transfer.shared_tables, fixed)
            # With two candidates each trains in a run of its own under the student's.
            with (tracker.child(f"{label} shared tables") if len(choices) > 1
                  else contextlib.nullcontext(tracker)) as run:
                model, result = train(data, plan, config, train_config, model=model, eval_indices=eval_indices,
                                      tracker=run, checkpoint_dir=checkpoints,
                                      device=device)  # one process: whole model
            if i + 1 < len(choices):
                record_finished_candidate(checkpoints, model, result)
        runs.append((kept_validation_ne(result, model.objectives), label, model, result))
    for checkpoints in folders:  # only a killed job resumes: a finished student is registered
        shutil.rmtree(checkpoints, ignore_errors=True)
    scores = {who: score for score, who, _, _ in runs}
    _, label, model, result = next(run for run in runs if run[1] == kept_tables(scores))
    shared = {}
    if choices != (None,):
        shared = {"kept": label, "validation_ne": scores}
        # With two candidates the settings sit on their runs; the student's own run (the registered version's) gets
        # the kept one's too, so that it compares with any other model's run.
        tracker.log_params({"shared_tables": label} | (settings[label] if len(runs) > 1 else {}))
    if len(runs) > 1:
        tracker.log_metrics({f"shared_tables.validation_ne.{who}": score
                             for who, score in shared["validation_ne"].items()}
                            | flat_metrics(result.final_report), step=result.steps)
    return StudentRun(fold_projections(model), result, data, adapter_report, shared)  # at the student's own size


def shared_table_choices(transfer: TransferConfig, has_teacher: bool, validated: bool) -> tuple[bool | None, ...]:
    """The students to train: with shared tables, fixed (True) and/or trained (False); (None,) without. "auto"
    trains both where validation days can tell them apart, else keeps the tables fixed."""
    if not (has_teacher and transfer.shared_tables):
        return (None,)
    if transfer.freeze_shared == "auto":
        return (True, False) if validated else (True,)
    return (transfer.freeze_shared,)


def kept_tables(validation_ne: dict[str, float]) -> str:
    """Which shared-tables candidate a student keeps ("fixed" or "trained"): the lower validation NE, a tie
    keeping the teacher's tables fixed."""
    return min(validation_ne, key=lambda who: (validation_ne[who], who != "fixed"))


def kept_validation_ne(result: TrainResult, objectives) -> float:
    """The validation NE of the weights training kept (its best evaluation); inf without validation days."""
    return min((validation_ne(report, objectives) for report in result.validation_reports), default=math.inf)


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


FINISHED_MODEL, FINISHED_RESULT = "finished_model.pt", "finished_result.json"


def record_finished_candidate(checkpoints: Path, model: GEMModel, result: TrainResult) -> None:
    """A trained candidate's weights and result beside its checkpoints (the result last: it marks the record whole)."""
    save_model_state(model_state(model), checkpoints / FINISHED_MODEL)
    with atomic_path(checkpoints / FINISHED_RESULT) as tmp:
        tmp.write_text(json.dumps(result.to_dict()))


def finished_candidate(checkpoints: Path, device: str) -> tuple[GEMModel, TrainResult] | None:
    """The candidate a killed job had finished in this folder (resumable_checkpoints cleared any other
    training's), else None."""
    if not (checkpoints / FINISHED_RESULT).exists():
        return None
    result = TrainResult.from_dict(json.loads((checkpoints / FINISHED_RESULT).read_text()))
    return model_from_state(load_model_state(checkpoints / FINISHED_MODEL), device), result


def prediction_report(logs: SequenceLogs, predictions: TeacherPredictions, indices: np.ndarray,
                      config: ModelConfig) -> dict[str, dict[str, float]]:
    """Quality of stored predictions on `indices`, for the tasks of `config`."""
    return predictions_quality(logs, predictions, indices, config.objectives(FeatureSpec.from_logs(logs)))
