"""The transfer hierarchy on one day's sequence logs: domain foundation models learn from GEM, vertical
models (one per domain and objective) learn from GEM directly or from their domain's FM."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from gem_ops.data.batch_shuffling import ShufflingConfig
from gem_ops.data.loader import SequenceLogs
from gem_ops.model.config import ModelConfig
from gem_ops.tracking import RunTracker
from gem_ops.train.config import TrainConfig
from gem_ops.train.data_check import describe_labels
from gem_ops.transfer import windows
from gem_ops.transfer.config import TransferConfig, TransferWindows
from gem_ops.transfer.knowledge import TeacherPredictions, predictions_quality, score_examples
from gem_ops.transfer.student import StudentRun, Teacher, train_student
from gem_ops.transfer.user_representations import compute_user_representations


@dataclass
class DomainData:
    """A domain's fresh training examples (the vertical models'), its eval examples, and the longer window
    its foundation model learns from (which holds the fresh examples)."""

    domain: str
    train: np.ndarray
    eval: np.ndarray
    foundation: np.ndarray

    @classmethod
    def of(cls, logs: SequenceLogs, domain: str, window: TransferWindows) -> DomainData:
        return cls(domain, windows.student_examples(logs, window, domain), windows.eval_examples(logs, domain),
                   windows.domain_fm_examples(logs, window, domain))

    @property
    def all(self) -> np.ndarray:
        return np.concatenate([self.train, self.eval])

    def shortfall(self, logs: SequenceLogs, batch_size: int) -> str | None:
        """Why this domain cannot train a student, naming the counts (None when it can): a domain too small
        is skipped with this reason rather than stopping the other domains."""
        if self.train.size < batch_size:
            return (f"domain {self.domain!r}: {self.train.size} training examples in the student window are fewer "
                    f"than one batch ({batch_size})")
        if self.eval.size == 0:
            return f"domain {self.domain!r}: no eval examples"
        labelled = set(windows.labelled_tasks(logs, self.train)) & set(windows.labelled_tasks(logs, self.eval))
        if not labelled:
            return (f"domain {self.domain!r}: no objective has both positives and negatives in its {self.train.size} "
                    f"training examples ({describe_labels(logs, self.train)}) and in its {self.eval.size} eval "
                    f"examples ({describe_labels(logs, self.eval)})")
        return None


def students_examples(logs: SequenceLogs, window: TransferWindows) -> np.ndarray:
    """Every example a student (domain FM or vertical model) trains or is evaluated on: what GEM has to score."""
    # The FMs' window holds the vertical models' days (domain_fm_days >= student_days).
    return np.concatenate([windows.domain_fm_examples(logs, window), windows.eval_examples(logs)])


def train_domain_foundation_model(logs: SequenceLogs, data: DomainData, base: ModelConfig, train_config: TrainConfig,
                                  work_dir: str | os.PathLike, transfer: TransferConfig, gem: Teacher | None,
                                  shuffling: ShufflingConfig = ShufflingConfig(),
                                  tracker: RunTracker | None = None, device: str = "cpu") -> StudentRun:
    """A domain FM: every objective of one domain, on the domain's FM window, from GEM (or alone)."""
    # The adapter corrects GEM for the verticals' (today's) labels.
    return train_student(logs, data.foundation, data.eval, base, (), train_config, work_dir, transfer, gem,
                         shuffling, tracker, device, adapter_indices=data.train)


def as_teacher(run: StudentRun, data: DomainData, identity: dict[str, Any], device: str = "cpu") -> Teacher:
    """A trained FM as the teacher of its domain's vertical models: its user representations of their
    (domain, user, day)s, and its scores of their examples (computed on `device`; the teacher kept on the CPU)."""
    table = compute_user_representations(run.model, run.data, data.all, identity, device=device)
    scores = score_examples(run.model, run.data, data.all, identity, representations=table, device=device)
    return Teacher(run.model.cpu(), scores, identity, table)


@dataclass(frozen=True)
class TeacherChoice:
    """Which model teaches a domain's vertical models: its FM where the FM ranks the FM's held-out day (the newest
    of its window, which neither it nor GEM trained on) better than GEM does, else GEM itself: a student of a
    teacher worse than GEM inherits the loss."""

    teacher: str  # "domain_fm" or "gem"
    fm_auc: float  # mean over the objectives scored, on the held-out day
    gem_auc: float
    examples: int

    def to_dict(self) -> dict[str, Any]:
        def shown(auc: float) -> float | None:  # JSON metadata has no NaN (no objective with both labels)
            return round(auc, 4) if math.isfinite(auc) else None

        return {"teacher": self.teacher, "fm_auc": shown(self.fm_auc), "gem_auc": shown(self.gem_auc),
                "held_out_examples": self.examples}


def choose_domain_teacher(logs: SequenceLogs, data: DomainData, fm: TeacherPredictions,
                          gem: TeacherPredictions) -> TeacherChoice:
    """GEM or the domain FM as the teacher of the domain's verticals, by AUC on the FM's held-out day (AUC: GEM's
    and the FM's calibrations, each fitted on that day, leave it alone). The FM wins only by being ahead."""
    day = logs.column("timestamp")[data.foundation] // windows.MS_PER_DAY
    held_out = np.intersect1d(np.intersect1d(data.foundation[day == day.max()], fm.example_index), gem.example_index)
    tasks = tuple(t for t in windows.labelled_tasks(logs, held_out) if t in fm.objectives and t in gem.objectives)
    if not tasks:
        return TeacherChoice("gem", float("nan"), float("nan"), int(held_out.size))
    groups = [f"{data.domain}/{t}" for t in tasks]
    fm_auc, gem_auc = (float(np.mean([report[g]["auc"] for g in groups]))
                       for report in (predictions_quality(logs, p, held_out, tasks) for p in (fm, gem)))
    return TeacherChoice("domain_fm" if fm_auc > gem_auc else "gem", fm_auc, gem_auc, int(held_out.size))


def train_vertical_model(logs: SequenceLogs, data: DomainData, task: str, base: ModelConfig, train_config: TrainConfig,
                         work_dir: str | os.PathLike, transfer: TransferConfig, teacher: Teacher | None,
                         shuffling: ShufflingConfig = ShufflingConfig(), tracker: RunTracker | None = None,
                         device: str = "cpu") -> StudentRun:
    """A vertical model: one objective of one domain, alone or from its teacher (GEM or the domain's FM)."""
    return train_student(logs, data.train, data.eval, base, (task,), train_config, Path(work_dir), transfer, teacher,
                         shuffling, tracker, device)

