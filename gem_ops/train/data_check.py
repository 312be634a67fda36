"""Whether a day's data is enough for a training job: checked before the job starts (and again by the
engine), so thin data fails with its counts named instead of deep inside training."""

from __future__ import annotations

import os
from datetime import date, timedelta

import numpy as np

from gem_ops.data.batch_shuffling import plan_info, read_plan
from gem_ops.data.loader import SequenceLogs
from gem_ops.train.batches import MS_PER_DAY
from gem_ops.train.config import TrainConfig


def training_data_problem(logs: SequenceLogs, plan_path: str | os.PathLike, config: TrainConfig,
                          eval_indices: np.ndarray | None = None) -> str | None:
    """What keeps this plan and these logs from training and evaluating a model (on `eval_indices`, default
    the eval split), naming the counts and the setting to change (None when nothing does)."""
    examples = np.sort(read_plan(plan_path).reshape(-1))
    info = plan_info(plan_path)
    where = str(logs.path)
    if examples.size == 0:
        train = logs.split_indices("train")
        return (f"{where}: the plan {plan_path} has no step: {train.size} training examples "
                f"({describe_labels(logs, train)}) are fewer than one step of the plan")
    if not any(labelled for labelled, _ in logs.label_counts(examples).values()):
        return (f"{where}: none of the plan's {examples.size} training examples carries a label "
                f"({', '.join(logs.objectives)})")
    if config.validation_days:  # held out as batches.newest_days does: the newest `validation_days` calendar days
        day = logs.column("timestamp")[examples] // MS_PER_DAY
        kept = examples[day <= day.max() - config.validation_days]
        if kept.size == 0:
            return (f"{where}: the training examples span the days {_days(np.unique(day))}, so validation_days="
                    f"{config.validation_days} would leave none to train on: set validation_days to 0 or give "
                    f"sequence_logs more labelled days (lookback_days)")
        per_step = _examples_per_step(info)
        if per_step and kept.size < per_step:
            return (f"{where}: {kept.size} training examples outside the {config.validation_days} validation day(s) "
                    f"are fewer than one step of the plan ({per_step})")
    evaluated = logs.split_indices("eval") if eval_indices is None else np.asarray(eval_indices)
    counts = logs.label_counts(evaluated)
    if not any(0 < positives < labelled for labelled, positives in counts.values()):
        return (f"{where}: the eval examples cannot be scored: {evaluated.size} of them "
                f"({describe_labels(logs, evaluated)}); no objective has both positives and negatives there")
    return None


def unscored_objectives(logs: SequenceLogs) -> dict[str, str]:
    """Objectives the eval split cannot score (one class or none), each with its counts: their metrics
    are left out, and the reason logged."""
    return {name: f"{labelled} labelled eval examples, {positives} positive"
            for name, (labelled, positives) in logs.label_counts(logs.split_indices("eval")).items()
            if not 0 < positives < labelled}


def describe_labels(logs: SequenceLogs, indices: np.ndarray) -> str:
    """Per objective, how many of the examples are labelled and how many positive."""
    return "; ".join(f"{name}: {labelled} labelled, {positives} positive"
                     for name, (labelled, positives) in logs.label_counts(indices).items())


def _examples_per_step(info: dict) -> int:
    shuffling, world_size = info.get("shuffling"), info.get("world_size")
    if not shuffling or not world_size:
        return 0
    return int(shuffling["sub_batch_size"]) * int(shuffling["sub_batches_per_rank"]) * int(world_size)


def _days(days: np.ndarray) -> str:
    return ", ".join((date(1970, 1, 1) + timedelta(days=int(d))).isoformat() for d in days)
