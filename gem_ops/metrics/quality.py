"""Offline quality of binary predictions: AUC, normalized entropy, calibration, per domain and task.

NE (He et al., "Practical Lessons from Predicting Clicks on Ads at Facebook") is the mean log loss
divided by the entropy of the labels' base rate: 1.0 is no better than always predicting the base
rate; lower is better. Calibration is mean prediction over mean label: 1.0 is calibrated.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torchmetrics.functional.classification import binary_auroc

METRICS = ("auc", "ne", "calibration", "log_loss", "count", "positive_rate")


def binary_quality(logits: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
    """Metrics of one set of (logit, 0/1 label) pairs; AUC and NE are NaN where they are undefined."""
    logits, labels = logits.double().flatten(), labels.double().flatten()
    n = labels.numel()
    if n == 0:
        return {name: (0.0 if name == "count" else math.nan) for name in METRICS}
    p = labels.mean().item()
    log_loss = F.binary_cross_entropy_with_logits(logits, labels).item()
    base_entropy = -(p * math.log(p) + (1 - p) * math.log(1 - p)) if 0 < p < 1 else math.nan
    both_classes = 0 < p < 1
    return {
        "auc": binary_auroc(torch.sigmoid(logits), labels.long()).item() if both_classes else math.nan,
        "ne": log_loss / base_entropy if both_classes else math.nan,
        "calibration": torch.sigmoid(logits).mean().item() / p if p > 0 else math.nan,
        "log_loss": log_loss,
        "count": float(n),
        "positive_rate": p,
    }


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
