"""Baselines that share GEM's inputs, training loop and metrics."""

from __future__ import annotations

import torch
from torch import nn

from gem_ops.model import features as F
from gem_ops.model.config import FeatureSpec, ModelConfig
from gem_ops.model.features import ModelInput
from gem_ops.model.heads import LossSums, loss_from_sums, masked_bce_sums


class LogisticRegression(nn.Module):
    """Per task: bias + per-domain bias + one learned weight per (hashed) id of every sparse feature and
    of the candidate item, + a linear term on the dense features. No history, no interactions."""

    def __init__(self, spec: FeatureSpec, config: ModelConfig, device: torch.device | None = None):
        super().__init__()
        self.spec, self.config = spec, config
        self.objectives = config.objectives(spec)
        tasks, emb = len(self.objectives), config.embedding
        rows = {F.USER_ID: emb.user_buckets, F.SURFACE: len(spec.surfaces), F.CANDIDATE_ITEM: emb.item_buckets}
        rows.update({name: emb.sparse_buckets for name in spec.sparse_features})
        self.weights = nn.ModuleDict({key: nn.Embedding(n, tasks, device=device) for key, n in rows.items()})
        for table in self.weights.values():
            nn.init.zeros_(table.weight)
        self.dense = nn.Linear(len(spec.dense_features), tasks, device=device) if spec.dense_features else None
        self.bias = nn.Parameter(torch.zeros(tasks, device=device))

    def forward(self, x: ModelInput) -> torch.Tensor:
        ids = x.pooled.to_dict()
        logits = self.bias + self.weights[F.CANDIDATE_ITEM](x.sequence[F.CANDIDATE_ITEM].values())
        for key in F.pooled_keys(self.spec):
            logits = logits + self.weights[key](ids[key].values())
        return logits if self.dense is None else logits + self.dense(x.dense)

    def loss_sums(self, x: ModelInput) -> LossSums:
        logits = self(x)
        sums, counts = masked_bce_sums(logits, x.labels, x.label_mask)
        return LossSums(sums, sums.detach(), counts, logits)

    def loss(self, x: ModelInput) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return loss_from_sums(self.loss_sums(x))
