"""The Student Adapter (ExFM, arXiv 2502.17494): a teacher trained on older data is miscalibrated for
today's traffic; a small model fitted on fresh labels maps its logits (plus a few request features) to
calibrated targets before they supervise the student.

Per (domain, task) an affine map of the teacher's logit, plus a small MLP over all the teacher's logits,
the domain and the history length, and optionally a shift per value of one candidate feature (hashed into
buckets: e.g. the item's category, where a shift that the teacher's days did not show moves whole
categories); initialised to the identity, so an adapter that learns nothing passes the teacher through
unchanged. Shift only: the teacher's logit keeps its scale and the MLP is left out, so within a domain (and a
feature value) the targets rank as the teacher does, however few labels the fit saw."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from gem_ops.data.loader import SequenceLogs
from gem_ops.model.heads import masked_bce_loss
from gem_ops.train.engine import fit_full_batch
from gem_ops.transfer.knowledge import TeacherPredictions


# The prior sd of a category's logit shift: about what a category's log-odds moves by over a few days.
FEATURE_SHIFT_PRIOR_SD = 0.5


class StudentAdapter(nn.Module):
    def __init__(self, domains: int, tasks: int, hidden: int = 16, feature: str = "", feature_buckets: int = 64,
                 shift_only: bool = False):
        super().__init__()
        self.domains, self.tasks, self.feature, self.feature_buckets = domains, tasks, feature, feature_buckets
        self.feature_shift = nn.Parameter(torch.zeros(feature_buckets, tasks)) if feature else None
        self.scale = nn.Parameter(torch.ones(domains, tasks), requires_grad=not shift_only)
        self.shift = nn.Parameter(torch.zeros(domains, tasks))
        self.mlp = None
        if not shift_only:
            self.mlp = nn.Sequential(nn.Linear(tasks + domains + 1, hidden), nn.GELU(), nn.Linear(hidden, tasks))
            nn.init.zeros_(self.mlp[-1].weight)
            nn.init.zeros_(self.mlp[-1].bias)

    def forward(self, logits: torch.Tensor, domain: torch.Tensor, history_length: torch.Tensor,
                feature: torch.Tensor | None = None) -> torch.Tensor:
        """Teacher logits [N, T], domain [N], history length [N], the candidate feature's ids [N] (with a
        feature) -> adapted logits [N, T]."""
        adapted = self.scale[domain] * logits + self.shift[domain]
        if self.mlp is not None:
            adapted = adapted + self.mlp(torch.cat([logits.clamp(-15, 15), F.one_hot(domain, self.domains).float(),
                                                    torch.log1p(history_length.float()).unsqueeze(1) / 5], dim=1))
        if self.feature_shift is not None:
            adapted = adapted + self.feature_shift[feature.clamp(min=0) % self.feature_buckets]
        return adapted

    def departure(self) -> torch.Tensor:
        """[T] per task, the squared distance of the affine map and the MLP's output layer from the identity."""
        affine = (self.scale - 1).pow(2).sum(0) + self.shift.pow(2).sum(0)
        if self.mlp is None:
            return affine
        return affine + self.mlp[-1].weight.pow(2).sum(1) + self.mlp[-1].bias.pow(2)


def adapter_inputs(logs: SequenceLogs, predictions: TeacherPredictions, feature: str = "") -> tuple[torch.Tensor, ...]:
    """The adapter's inputs for every example the teacher scored; `feature`: a candidate column of the logs."""
    idx = predictions.example_index
    inputs = (torch.from_numpy(predictions.logits), torch.from_numpy(logs.column("surface")[idx].astype(np.int64)),
              torch.from_numpy(logs.history_lengths()[idx].astype(np.int64)))
    if not feature:
        return inputs
    if feature not in logs.sparse_features:
        raise ValueError(f"TransferConfig.adapter_feature {feature!r} is not a sparse feature of the logs "
                         f"{logs.sparse_features}")
    return (*inputs, torch.from_numpy(logs.column(feature)[idx].astype(np.int64)))


def fit_adapter(logs: SequenceLogs, predictions: TeacherPredictions, indices: np.ndarray, hidden: int = 16,
                steps: int = 300, lr: float = 0.02, seed: int = 0, feature: str = "",
                feature_buckets: int = 64, shrink: bool = False, shift_only: bool = False) -> StudentAdapter:
    """Fits an adapter on the fresh labels of `indices` (examples the teacher scored); with `feature`, a shift
    per value of that candidate feature (hashed into `feature_buckets`) too. `shrink`: the same prior as the
    feature's shifts on the rest of the adapter's departure from the identity (a task with few labels keeps
    the teacher's scores). `shift_only`: shifts alone (StudentAdapter)."""
    torch.manual_seed(seed)
    all_inputs = adapter_inputs(logs, predictions, feature)
    position = np.full(len(logs), -1, dtype=np.int64)
    position[predictions.example_index] = np.arange(len(predictions))
    rows = position[np.asarray(indices, dtype=np.int64)]
    if rows.size == 0 or (rows < 0).any():
        raise ValueError("the Student Adapter needs teacher scores for every fresh example it learns from")
    batch = logs.batch(indices, max_history_len=0)
    labels, mask = batch.labels, batch.label_mask
    rows_t = torch.from_numpy(rows)
    adapter = StudentAdapter(len(logs.surfaces), all_inputs[0].shape[1], hidden, feature, feature_buckets, shift_only)
    inputs = tuple(x[rows_t] for x in all_inputs)
    # The feature's shifts have a Gaussian prior (sd FEATURE_SHIFT_PRIOR_SD), on each task's mean-loss scale: a
    # category with few labels keeps the teacher's score (conversions: tens of positives a category).
    prior_weight = 1.0 / (2 * FEATURE_SHIFT_PRIOR_SD**2 * mask.sum(0).clamp(min=1))

    def loss() -> torch.Tensor:
        fit = masked_bce_loss(adapter(*inputs), labels, mask)[0]
        if adapter.feature_shift is not None:
            fit = fit + (adapter.feature_shift.pow(2).sum(0) * prior_weight).sum()
        if shrink:
            fit = fit + (adapter.departure() * prior_weight).sum()
        return fit

    return fit_full_batch(adapter, loss, steps, lr, weight_decay=1e-4)


@torch.no_grad()
def adapt(adapter: StudentAdapter, logs: SequenceLogs, predictions: TeacherPredictions) -> TeacherPredictions:
    """The predictions with the adapter's logits in place of the teacher's."""
    return predictions.with_logits(adapter(*adapter_inputs(logs, predictions, adapter.feature)).numpy())
