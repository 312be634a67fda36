"""The Student Adapter (ExFM, arXiv 2502.17494): a teacher trained on older data is miscalibrated for
today's traffic; a small model fitted on fresh labels maps its logits (plus a few request features) to
calibrated targets before they supervise the student.

Per (domain, task) an affine map of the teacher's logit, plus a small MLP over all the teacher's logits,
the domain and the history length; initialised to the identity, so an adapter that learns nothing
passes the teacher through unchanged."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from gem_ops.data.loader import SequenceLogs
from gem_ops.model.heads import masked_bce_loss
from gem_ops.train.engine import fit_full_batch
from gem_ops.transfer.knowledge import TeacherPredictions


class StudentAdapter(nn.Module):
    def __init__(self, domains: int, tasks: int, hidden: int = 16):
        super().__init__()
        self.domains, self.tasks = domains, tasks
        self.scale = nn.Parameter(torch.ones(domains, tasks))
        self.shift = nn.Parameter(torch.zeros(domains, tasks))
        self.mlp = nn.Sequential(nn.Linear(tasks + domains + 1, hidden), nn.GELU(), nn.Linear(hidden, tasks))
        nn.init.zeros_(self.mlp[-1].weight)
        nn.init.zeros_(self.mlp[-1].bias)

    def forward(self, logits: torch.Tensor, domain: torch.Tensor, history_length: torch.Tensor) -> torch.Tensor:
        """Teacher logits [N, T], domain [N], history length [N] -> adapted logits [N, T]."""
        features = torch.cat([logits.clamp(-15, 15), F.one_hot(domain, self.domains).float(),
                              torch.log1p(history_length.float()).unsqueeze(1) / 5], dim=1)
        return self.scale[domain] * logits + self.shift[domain] + self.mlp(features)


def adapter_inputs(logs: SequenceLogs, predictions: TeacherPredictions) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    idx = predictions.example_index
    return (torch.from_numpy(predictions.logits), torch.from_numpy(logs.column("surface")[idx].astype(np.int64)),
            torch.from_numpy(logs.history_lengths()[idx].astype(np.int64)))


def fit_adapter(logs: SequenceLogs, predictions: TeacherPredictions, indices: np.ndarray, hidden: int = 16,
                steps: int = 300, lr: float = 0.02, seed: int = 0) -> StudentAdapter:
    """Fits an adapter on the fresh labels of `indices` (examples the teacher scored)."""
    torch.manual_seed(seed)
    logits, domain, lengths = adapter_inputs(logs, predictions)
    position = np.full(len(logs), -1, dtype=np.int64)
    position[predictions.example_index] = np.arange(len(predictions))
    rows = position[np.asarray(indices, dtype=np.int64)]
    if rows.size == 0 or (rows < 0).any():
        raise ValueError("the Student Adapter needs teacher scores for every fresh example it learns from")
    batch = logs.batch(indices, max_history_len=0)
    labels, mask = batch.labels, batch.label_mask
    rows_t = torch.from_numpy(rows)
    adapter = StudentAdapter(len(logs.surfaces), logits.shape[1], hidden)
    inputs = (logits[rows_t], domain[rows_t], lengths[rows_t])
    return fit_full_batch(adapter, lambda: masked_bce_loss(adapter(*inputs), labels, mask)[0], steps, lr,
                          weight_decay=1e-4)


@torch.no_grad()
def adapt(adapter: StudentAdapter, logs: SequenceLogs, predictions: TeacherPredictions) -> TeacherPredictions:
    """The predictions with the adapter's logits in place of the teacher's."""
    return predictions.with_logits(adapter(*adapter_inputs(logs, predictions)).numpy())
