"""Baselines that share GEM's inputs, training engine and metrics: a logistic regression, and TorchRec's
own DLRM and DLRM with DCN-v2's low-rank cross network (torchrec.models.dlrm) on the non-sequence inputs."""

from __future__ import annotations

import torch
from torch import nn

from gem_ops.model import features as F
from gem_ops.model.config import FeatureSpec, ModelConfig
from gem_ops.model.features import ModelInput
from gem_ops.model.heads import LossSums, OutputCalibration, loss_from_sums, masked_bce_sums


class _LabelLoss(nn.Module):
    """The engine's loss interface for a model whose forward returns [B, tasks] logits."""

    def loss_sums(self, x: ModelInput) -> LossSums:
        logits = self(x)
        sums, counts = masked_bce_sums(logits, x.labels, x.label_mask)
        return LossSums(sums, sums.detach(), counts, logits)

    def loss(self, x: ModelInput) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return loss_from_sums(self.loss_sums(x))


class LogisticRegression(_LabelLoss):
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
        self.output_calibration = OutputCalibration(len(spec.surfaces), tasks).to(device)

    @torch.no_grad()
    def init_output_bias(self, logits: torch.Tensor) -> None:
        """logits [domains, tasks]: the surface's weights start at them (the other terms at 0)."""
        self.weights[F.SURFACE].weight.copy_(logits.to(self.weights[F.SURFACE].weight))
    def forward(self, x: ModelInput) -> torch.Tensor:
        ids = x.pooled.to_dict()
        logits = self.bias + self.weights[F.CANDIDATE_ITEM](x.sequence[F.CANDIDATE_ITEM].values())
        for key in F.pooled_keys(self.spec):
            logits = logits + self.weights[key](ids[key].values())
        if self.dense is not None:
            logits = logits + self.dense(x.dense)
        return self.output_calibration(logits, x.surface)


class TorchRecDLRM(_LabelLoss):
    """torchrec.models.dlrm.DLRM (architecture "dlrm") or DLRM_DCN (architecture "dcn": DCN-v2's low-rank
    cross network as the interaction) over GEM's non-sequence inputs: the pooled ids (user, sparse
    features, surface) and the candidate item as one more pooled id, one embedding_dim table each, and
    the dense features (a zero column when there are none). The over-arch ends in one logit per
    (domain, task); each example reads its own domain's, as GEM's towers do. No history."""

    def __init__(self, spec: FeatureSpec, config: ModelConfig, device: torch.device | None = None):
        super().__init__()
        from torchrec.models.dlrm import DLRM, DLRM_DCN
        from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
        from torchrec.modules.embedding_modules import EmbeddingBagCollection

        self.spec, self.config = spec, config
        self.objectives = config.objectives(spec)
        emb, mlp = config.embedding, config.wukong.mlp_hidden
        rows = {F.USER_ID: emb.user_buckets, F.SURFACE: len(spec.surfaces), F.CANDIDATE_ITEM: emb.item_buckets}
        rows.update({name: emb.sparse_buckets for name in spec.sparse_features})
        self.keys = (*F.pooled_keys(spec), F.CANDIDATE_ITEM)
        tables = [EmbeddingBagConfig(name=key, embedding_dim=emb.dim, num_embeddings=rows[key], feature_names=[key],
                                     pooling=PoolingType.SUM) for key in self.keys]
        ebc = EmbeddingBagCollection(tables=tables, device=device)
        self.domains, self.tasks = len(spec.surfaces), len(self.objectives)
        shape = {"embedding_bag_collection": ebc, "dense_in_features": max(1, len(spec.dense_features)),
                 "dense_arch_layer_sizes": [mlp, emb.dim],
                 "over_arch_layer_sizes": [mlp, mlp, self.domains * self.tasks],
                 "dense_device": device}
        if config.architecture == "dcn":
            self.dlrm = DLRM_DCN(**shape, dcn_num_layers=config.blocks, dcn_low_rank_dim=config.wukong.fm_rank)
        else:
            self.dlrm = DLRM(**shape)
        self.output_calibration = OutputCalibration(self.domains, self.tasks)
        if device is not None:  # TorchRec 1.6's DCN cross layers are built on the CPU whatever dense_device says
            self.to(device)

    @torch.no_grad()
    def init_output_bias(self, logits: torch.Tensor) -> None:
        """logits [domains, tasks]: the over arch's last bias starts at them."""
        last = self.dlrm.over_arch.model[-1]
        last.bias.copy_(logits.reshape(-1).to(last.bias))
    def forward(self, x: ModelInput) -> torch.Tensor:
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

        candidate = x.sequence[F.CANDIDATE_ITEM].values()
        ids = KeyedJaggedTensor.from_lengths_sync(
            keys=list(self.keys), values=torch.cat([x.pooled.values(), candidate]),
            lengths=torch.cat([x.pooled.lengths(), torch.ones_like(candidate, dtype=x.pooled.lengths().dtype)]))
        dense = x.dense if x.dense.shape[1] else x.dense.new_zeros(x.dense.shape[0], 1)
        logits = self.dlrm(dense, ids).view(-1, self.domains, self.tasks)
        return self.output_calibration(logits[torch.arange(logits.shape[0], device=logits.device), x.surface],
                                       x.surface)
