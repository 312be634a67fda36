"""The transfer hierarchy on one day's sequence logs: domain foundation models learn from GEM, vertical
models (one per domain and objective) learn from GEM directly or from their domain's FM."""

from __future__ import annotations

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
from gem_ops.transfer.knowledge import score_examples
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


def train_vertical_model(logs: SequenceLogs, data: DomainData, task: str, base: ModelConfig, train_config: TrainConfig,
                         work_dir: str | os.PathLike, transfer: TransferConfig, teacher: Teacher | None,
                         shuffling: ShufflingConfig = ShufflingConfig(), tracker: RunTracker | None = None,
                         device: str = "cpu") -> StudentRun:
    """A vertical model: one objective of one domain, alone or from its teacher (GEM or the domain's FM)."""
    return train_student(logs, data.train, data.eval, base, (task,), train_config, Path(work_dir), transfer, teacher,
                         shuffling, tracker, device)

