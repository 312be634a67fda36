"""The GEM model: TorchRec embeddings, a Wukong interaction arm, a pyramid sequence arm, InterFormer
interleaving and per-domain per-task heads. GEM, domain FMs and vertical models are sizes of this code."""

from __future__ import annotations

import torch
from torch import nn

from gem_ops.model.config import FeatureSpec, ModelConfig


def build_model(spec: FeatureSpec, config: ModelConfig, device: torch.device | str | None = None) -> nn.Module:
    """The model a config names: GEM (any preset) or a baseline."""
    from gem_ops.model.baselines import LogisticRegression, TorchRecDLRM
    from gem_ops.model.gem import GEMModel

    device = torch.device(device) if device is not None else None
    if config.architecture == "logistic_regression":
        return LogisticRegression(spec, config, device=device)
    if config.architecture in ("dlrm", "dcn"):
        return TorchRecDLRM(spec, config, device=device)
    if config.architecture == "gem":
        return GEMModel(spec, config, device=device)
    raise ValueError(f"unknown model architecture {config.architecture!r}; use gem, logistic_regression, dlrm or dcn")
