"""Offline quality of a model during and after training: every rank scores its slice of the eval
batches, rank 0 gathers them into one report per domain and task."""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from gem_ops.data.loader import SequenceLogs
from gem_ops.metrics.quality import quality_report
from gem_ops.model.features import model_input
from gem_ops.model.gem import GEMModel
from gem_ops.train.acceleration import autocast_context
from gem_ops.train.batches import eval_batches
from gem_ops.train.config import TrainConfig


@torch.no_grad()
def predict_logits(model: GEMModel, logs: SequenceLogs, indices: list[np.ndarray], device: torch.device,
                   precision: str = "auto", retrieved_events: int | None = None) -> dict[str, torch.Tensor]:
    """Logits, labels, masks and domains of the given batches of example indices, in batch order (histories
    with up to `retrieved_events` older events matching the candidate; default: as the model trained)."""
    was_training = model.training
    model.eval()
    parts: dict[str, list[torch.Tensor]] = {"logits": [], "labels": [], "label_mask": [], "surface": [],
                                            "example_index": []}
    max_len = model.config.sequence.max_history_len
    if retrieved_events is None:
        retrieved_events = model.config.sequence.retrieved_events
    for batch_indices in indices:
        batch = logs.batch(batch_indices, max_len, retrieved_events=retrieved_events,
                           retrieval_key=model.config.sequence.retrieval_key)
        x = model_input(batch, model.spec, model.config, with_level_sizes=True)
        with autocast_context(device, precision):
            logits = model(x.to(device))
        parts["logits"].append(logits.float().cpu())
        parts["labels"].append(x.labels)
        parts["label_mask"].append(x.label_mask)
        parts["surface"].append(batch.surface)
        parts["example_index"].append(batch.example_index)
    model.train(was_training)
    return {k: torch.cat(v) if v else torch.empty(0) for k, v in parts.items()}


def evaluate(model: GEMModel, logs: SequenceLogs, config: TrainConfig, device: torch.device,
             indices: np.ndarray | None = None) -> dict[str, dict[str, float]]:
    """Quality on the eval split (or the given examples), per domain and task: rank 0's report, {} on
    other ranks (collective in a job of several ranks)."""
    out = gathered_predictions(model, logs, config, device, indices)
    if out is None:
        return {}
    return quality_report(out["logits"], out["labels"], out["label_mask"], out["surface"],
                          model.spec.surfaces, model.objectives)


def gathered_predictions(model: GEMModel, logs: SequenceLogs, config: TrainConfig, device: torch.device,
                         indices: np.ndarray | None = None) -> dict[str, torch.Tensor] | None:
    """predict_logits over the eval split (or the given examples, at most config.eval_max_examples of them),
    on rank 0; None on other ranks. Collective in a job of several ranks (the sharded lookups are): each
    rank scores its slice of every batch, and every rank runs the same number of batches."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    batches = eval_batches(logs, config.eval_max_examples, config.eval_batch_size,
                           model.config.sequence.max_history_len, config.seed, indices)
    if len(batches) > 1 and len(batches[-1]) < world:
        batches[-2:] = [np.concatenate(batches[-2:])]  # a slice for every rank
    mine = [np.array_split(b, world)[rank] for b in batches if len(b) >= world]
    out = predict_logits(model, logs, mine, device, config.precision)
    if world > 1:
        gathered = [None] * world if rank == 0 else None
        dist.gather_object(out, gathered, dst=0)
        if rank != 0:
            return None
        out = {k: torch.cat([g[k] for g in gathered]) for k in out}
    return out
