"""Whether a checkpoint can warm-start a model (the weights' shapes compared on the meta device, nothing
allocated) or resume its training (the same model settings and features), and the settings at fault named."""

from __future__ import annotations

import os
from dataclasses import asdict
from pathlib import Path

import torch

from gem_ops.model import build_model
from gem_ops.model.config import FeatureSpec, ModelConfig
from gem_ops.train.checkpoint import checkpoint_folder, read_progress


def warm_start_conflict(checkpoint: str | os.PathLike, config: ModelConfig) -> str | None:
    """None when `checkpoint` (a checkpoint folder or a folder of them) fits a model of `config`; otherwise
    what differs: the mismatched weights and the settings behind them."""
    path = checkpoint_folder(checkpoint)
    spec, theirs = _saved_model(read_progress(path))
    shapes = [{k: tuple(v.shape) for k, v in build_model(spec, c, torch.device("meta")).state_dict().items()}
              for c in (theirs, config)]
    mismatched = [k for k in shapes[1] if k in shapes[0] and shapes[0][k] != shapes[1][k]]
    absent, extra = sorted(set(shapes[1]) - set(shapes[0])), sorted(set(shapes[0]) - set(shapes[1]))
    if not (mismatched or absent or extra):
        return None
    # A weight on one side only would be left at its initialisation (or dropped) without a word.
    found = [f"{len(mismatched)} weights differ in shape (e.g. {mismatched[0]} {shapes[0][mismatched[0]]} there, "
             f"{shapes[1][mismatched[0]]} here)"] if mismatched else []
    found += [f"{len(absent)} weights are not in it (e.g. {absent[0]})"] if absent else []
    found += [f"{len(extra)} of its weights have no place here (e.g. {extra[0]})"] if extra else []
    settings = [f"{k}: {a} there, {b} here" for k, (a, b) in _differences(theirs.to_dict(), config.to_dict()).items()]
    return (f"cannot warm-start from {Path(path)}: " + "; ".join(found) + ", since the model settings differ ("
            + "; ".join(settings) + "). Train with the checkpoint's settings, or turn warm_start off.")


def resume_conflict(checkpoint: str | os.PathLike, config: ModelConfig, spec: FeatureSpec) -> str | None:
    """None when the training saved at `checkpoint` is of a model with `config` and `spec`; otherwise what
    differs. Resuming restores the optimizer and the step too, so any other model is a different training."""
    path = checkpoint_folder(checkpoint)
    theirs_spec, theirs_config = _saved_model(read_progress(path))  # settings added since read at their defaults
    differences = _differences({"model": theirs_config.to_dict(), "features": asdict(theirs_spec)},
                               {"model": config.to_dict(), "features": asdict(spec)})
    if not differences:
        return None
    settings = "; ".join(f"{k}: {a} there, {b} here" for k, (a, b) in differences.items())
    return (f"cannot resume from {Path(path)}: it trained another model ({settings}). Give this training a new "
            f"checkpoint directory, or resume with the checkpoint's settings.")


def _saved_model(progress: dict) -> tuple[FeatureSpec, ModelConfig]:
    return (FeatureSpec(**{k: tuple(v) for k, v in progress["spec"].items()}),
            ModelConfig.from_dict(progress["model_config"]))


def _differences(a: dict, b: dict, prefix: str = "") -> dict[str, tuple]:
    out = {}
    for key in sorted(set(a) | set(b)):
        x, y = a.get(key), b.get(key)
        if isinstance(x, dict) and isinstance(y, dict):
            out |= _differences(x, y, f"{prefix}{key}.")
        elif x != y:
            out[f"{prefix}{key}"] = (x, y)
    return out
