"""A model as data: built from a seed, saved as (spec, config, weights), rebuilt without the training data."""

from __future__ import annotations

import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from gem_ops.data.atomic import atomic_path
from gem_ops.model import build_model
from gem_ops.model.config import FeatureSpec, ModelConfig
from gem_ops.model.gem import GEMModel


def seeded_model(spec: FeatureSpec, config: ModelConfig, device: torch.device | str = "cpu", seed: int = 0) -> GEMModel:
    torch.manual_seed(seed)
    return build_model(spec, config, device)


def model_state(model: GEMModel, weights: dict[str, torch.Tensor] | None = None) -> dict[str, Any]:
    """Everything needed to rebuild the model without the data: spec, config and weights (the model's
    own, or full weights gathered from a sharded copy of it)."""
    return {"spec": asdict(model.spec), "model_config": model.config.to_dict(),
            "model": model.state_dict() if weights is None else weights}


def model_from_state(state: dict[str, Any], device: torch.device | str = "cpu") -> GEMModel:
    spec = FeatureSpec(**{k: tuple(v) for k, v in state["spec"].items()})
    model = build_model(spec, ModelConfig.from_dict(state["model_config"]), device)
    model.load_state_dict(state["model"])
    return model


def save_model_state(state: dict[str, Any], destination: str | os.PathLike) -> Path:
    with atomic_path(destination) as tmp:
        torch.save(state, tmp)
    return Path(destination)


def load_model_state(path: str | os.PathLike) -> dict[str, Any]:
    return torch.load(path, map_location="cpu", weights_only=True)  # plain data and tensors only


def export_full_model_state(module: torch.nn.Module, spec: FeatureSpec, model_config: ModelConfig,
                            destination: str | os.PathLike) -> Path | None:
    """Collective in a job of several ranks: gathers the full weights of a (possibly sharded) model;
    rank 0 writes them in model_state's format and returns the path, other ranks None."""
    import torch.distributed as dist

    from gem_ops.train.sharding import gather_full_state

    full = gather_full_state(module) if dist.is_initialized() else module.state_dict()
    if full is None:
        return None
    state = {"spec": asdict(spec), "model_config": model_config.to_dict(),
             "model": {k: v.detach().cpu() for k, v in full.items()}}
    return save_model_state(state, destination)
