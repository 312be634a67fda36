"""Example indices of the teacher's window, a student's window and a domain's eval examples."""

from __future__ import annotations

import numpy as np

from gem_ops.data.loader import SequenceLogs
from gem_ops.transfer.config import TransferWindows

MS_PER_DAY = 86_400_000


def _train_end_day_ms(logs: SequenceLogs) -> int:
    """Midnight (UTC) after the newest training request."""
    train = logs.split_indices("train")
    if train.size == 0:
        raise ValueError(f"{logs.path}: the sequence logs have no training examples")
    return (int(logs.column("timestamp")[train].max()) // MS_PER_DAY + 1) * MS_PER_DAY


def domain_index(logs: SequenceLogs, domain: str) -> int:
    if domain not in logs.surfaces:
        raise ValueError(f"unknown domain {domain!r}; the data's surfaces are {list(logs.surfaces)}")
    return list(logs.surfaces).index(domain)


def _in_domain(logs: SequenceLogs, indices: np.ndarray, domain: str | None) -> np.ndarray:
    if domain is None:
        return indices
    return indices[logs.column("surface")[indices] == domain_index(logs, domain)]


def teacher_examples(logs: SequenceLogs, windows: TransferWindows) -> np.ndarray:
    """Training examples before the teacher's cut-off (staleness_days before the end of training data)."""
    train = logs.split_indices("train")
    cutoff = _train_end_day_ms(logs) - windows.staleness_days * MS_PER_DAY
    picked = train[logs.column("timestamp")[train] < cutoff]
    if picked.size == 0:
        raise ValueError(f"no training examples older than the teacher's cut-off ({windows.staleness_days} "
                         "stale days): lower staleness_days or prepare more days")
    return picked


def _newest_days(logs: SequenceLogs, days: int | None, domain: str | None) -> np.ndarray:
    train = logs.split_indices("train")
    if days is not None:
        train = train[logs.column("timestamp")[train] >= _train_end_day_ms(logs) - days * MS_PER_DAY]
    return _in_domain(logs, train, domain)


def student_examples(logs: SequenceLogs, windows: TransferWindows, domain: str | None = None) -> np.ndarray:
    """Training examples of the newest student_days days (of one domain, if given)."""
    return _newest_days(logs, windows.student_days, domain)


def domain_fm_examples(logs: SequenceLogs, windows: TransferWindows, domain: str | None = None) -> np.ndarray:
    """Training examples a domain FM learns from: the newest domain_fm_days days (all when None)."""
    return _newest_days(logs, windows.domain_fm_days, domain)


def eval_examples(logs: SequenceLogs, domain: str | None = None) -> np.ndarray:
    return _in_domain(logs, logs.split_indices("eval"), domain)


def labelled_tasks(logs: SequenceLogs, indices: np.ndarray) -> list[str]:
    """Objectives with at least one label (and both classes) among the examples."""
    if indices.size == 0:
        return []
    batch = logs.batch(indices[:200_000], max_history_len=0)
    tasks = []
    for t, name in enumerate(logs.objectives):
        labels = batch.labels[batch.label_mask[:, t], t]
        if labels.numel() and 0 < float(labels.mean()) < 1:
            tasks.append(name)
    return tasks
