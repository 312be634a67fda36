"""Offline quality of binary predictions: AUC, normalized entropy, calibration, per domain and task.

NE (He et al., "Practical Lessons from Predicting Clicks on Ads at Facebook") is the mean log loss
divided by the entropy of the labels' base rate: 1.0 is no better than always predicting the base
rate; lower is better. Calibration is mean prediction over mean label: 1.0 is calibrated. The AUC's
standard error (DeLong et al., Biometrics 1988) and the count of positives say how far a figure can be
trusted: an AUC from a handful of positives is mostly noise. So does calibration's: a day's labels are
draws, and with 100 positives their sum alone moves by about 10% around what a calibrated model predicts.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torchmetrics.functional.classification import binary_auroc

# Fewer examples of either class than this: no standard error (DeLong's rests on the spread of each class's
# placements, which a handful of examples cannot estimate); the count of positives tells the story there.
MIN_CLASS_FOR_STDERR = 10
METRICS = ("auc", "auc_stderr", "ne", "calibration", "calibration_stderr", "log_loss", "count", "positives",
           "positive_rate")


def binary_quality(logits: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
    """Metrics of one set of (logit, 0/1 label) pairs; AUC and NE are NaN where they are undefined."""
    logits, labels = logits.double().flatten(), labels.double().flatten()
    n = labels.numel()
    if n == 0:
        return {name: (0.0 if name in ("count", "positives") else math.nan) for name in METRICS}
    p = labels.mean().item()
    positives = labels.sum().item()
    log_loss = F.binary_cross_entropy_with_logits(logits, labels).item()
    base_entropy = base_rate_entropy(p)
    both_classes = 0 < p < 1
    return {
        "auc": binary_auroc(torch.sigmoid(logits), labels.long()).item() if both_classes else math.nan,
        "auc_stderr": auc_stderr(logits, labels) if both_classes else math.nan,
        "ne": log_loss / base_entropy if both_classes else math.nan,
        "calibration": torch.sigmoid(logits).mean().item() / p if p > 0 else math.nan,
        "calibration_stderr": calibration_stderr(logits, positives),
        "log_loss": log_loss,
        "count": float(n),
        "positives": positives,
        "positive_rate": p,
    }


def calibration_stderr(logits: torch.Tensor, positives: float) -> float:
    """Standard error of calibration (sum of predictions over positives) from the labels' draw: were the
    predictions q exact, the positives would vary by sum q(1 - q); the delta method carries that to the
    ratio. NaN without positives."""
    if positives <= 0:
        return math.nan
    q = torch.sigmoid(logits)
    return (q.sum() / positives * (q * (1 - q)).sum().sqrt() / positives).item()


def base_rate_entropy(p: float) -> float:
    """Log loss of always predicting the base rate p: NE's denominator (NaN unless 0 < p < 1)."""
    return -(p * math.log(p) + (1 - p) * math.log(1 - p)) if 0 < p < 1 else math.nan


def auc_stderr(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """DeLong's standard error of the AUC: from each positive's share of negatives ranked below it and each
    negative's share of positives ranked above it, ties counting half. NaN with too few of either class."""
    scores, positive = scores.double().cpu().numpy(), labels.cpu().numpy() > 0.5
    n_pos, n_neg = int(positive.sum()), int((~positive).sum())
    if min(n_pos, n_neg) < MIN_CLASS_FOR_STDERR:
        return math.nan
    overall = _midranks(scores)
    below = (overall[positive] - _midranks(scores[positive])) / n_neg  # per positive
    above = 1.0 - (overall[~positive] - _midranks(scores[~positive])) / n_pos  # per negative
    return math.sqrt(below.var(ddof=1) / n_pos + above.var(ddof=1) / n_neg)


def _midranks(x: np.ndarray) -> np.ndarray:
    """1-based ranks, tied values sharing the mean of their ranks."""
    _, inverse, counts = np.unique(x, return_inverse=True, return_counts=True)
    return (np.cumsum(counts) - (counts - 1) / 2.0)[inverse]


def quality_report(
    logits: torch.Tensor,
    labels: torch.Tensor,
    label_mask: torch.Tensor,
    domain: torch.Tensor,
    domains: Sequence[str],
    tasks: Sequence[str],
) -> dict[str, dict[str, float]]:
    """{"<domain>/<task>": metrics} for every domain and task with labels, plus "all/<task>"."""
    report = {}
    for t, task in enumerate(tasks):
        labelled = label_mask[:, t]
        report[f"all/{task}"] = binary_quality(logits[labelled, t], labels[labelled, t])
        for d, name in enumerate(domains):
            rows = labelled & (domain == d)
            if rows.any():
                report[f"{name}/{task}"] = binary_quality(logits[rows, t], labels[rows, t])
    return report


def flat_metrics(report: dict[str, dict[str, float]], prefix: str = "eval") -> dict[str, float]:
    """MLflow-ready keys, e.g. eval.feed.click.auc; NaNs dropped (MLflow plots them as gaps anyway)."""
    flat = {}
    for group, metrics in report.items():
        for name, value in metrics.items():
            if not math.isnan(value):
                flat[f"{prefix}.{group.replace('/', '.')}.{name}"] = value
    return flat
