"""Output biases set from the training data's label rates before the first step (every model: GEM's
towers, the baselines' output layers).

A tower starts at p = 0.5; a rare task (a conversion rate of 0.3%) would spend hundreds of steps
moving its bias to logit -6 at a dense learning rate of 1e-3, and a short training would end far from
calibrated. Starting each (domain, task) tower at its label rate removes that climb."""

from __future__ import annotations

import os

import numpy as np
import pyarrow.parquet as pq
import torch

from gem_ops.data.loader import SequenceLogs
from gem_ops.model.config import FeatureSpec


def plan_examples(plan_path: str | os.PathLike) -> np.ndarray:
    """Every example of a shuffled_batches plan, all ranks (so every rank computes the same thing)."""
    examples = pq.read_table(plan_path, columns=["examples"]).column("examples").combine_chunks()
    return np.unique(examples.flatten().to_numpy())


def label_rate_logits(logs: SequenceLogs, indices: np.ndarray, columns: list[int], domains: int,
                      prior_weight: float = 100.0) -> torch.Tensor:
    """[domains, tasks] logits of the label rates, each shrunk toward its task's overall rate by
    prior_weight pseudo-examples (a domain with few labels keeps close to the overall rate)."""
    batch = logs.batch(indices, max_history_len=0)
    labels, mask = batch.labels[:, columns].double(), batch.label_mask[:, columns].double()
    surface = torch.nn.functional.one_hot(batch.surface, domains).double()  # [N, domains]
    overall = (labels * mask).sum(0) / mask.sum(0).clamp(min=1)  # [tasks]
    positives, counts = surface.T @ (labels * mask), surface.T @ mask  # [domains, tasks]
    rate = (positives + prior_weight * overall) / (counts + prior_weight)
    rate = rate.clamp(1e-4, 1 - 1e-4)
    return torch.log(rate / (1 - rate)).float()


@torch.no_grad()
def init_output_biases(model: torch.nn.Module, logs: SequenceLogs, plan_path: str | os.PathLike,
                       held_out: np.ndarray | None = None) -> bool:
    """Sets the model's output biases (its `init_output_bias`) from the label rates of the plan's examples
    (but the held-out ones); False for a model without one."""
    if not hasattr(model, "init_output_bias"):
        return False
    spec = FeatureSpec.from_logs(logs)
    examples = plan_examples(plan_path)
    if held_out is not None and held_out.size:
        examples = np.setdiff1d(examples, held_out)
    model.init_output_bias(label_rate_logits(logs, examples, model.config.task_columns(spec), len(spec.surfaces)))
    return True
