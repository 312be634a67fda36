"""Per-domain per-task towers on a shared trunk, and the label-masked loss."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


class DomainTaskTowers(nn.Module):
    """One small MLP per (domain, task), run for all towers at once as batched matmuls;
    each example keeps its own domain's row: cross-domain knowledge lives in the trunk.

    A calibration fitted after training (gem_ops.train.calibration) maps each tower's logit to
    scale * logit + shift; it is a buffer, identity until set, and reset before training again."""

    def __init__(self, in_dim: int, domains: int, tasks: int, hidden: int, layers: int):
        super().__init__()
        self.domains, self.tasks = domains, tasks
        towers = domains * tasks
        dims = [in_dim] + [hidden] * layers + [1]
        self.weights = nn.ParameterList(
            nn.Parameter(torch.randn(towers, a, b) / a**0.5) for a, b in zip(dims[:-1], dims[1:])
        )
        self.biases = nn.ParameterList(nn.Parameter(torch.zeros(towers, b)) for b in dims[1:])
        self.output = OutputCalibration(domains, tasks)

    @torch.no_grad()
    def init_output_bias(self, logits: torch.Tensor) -> None:
        """logits [domains, tasks]: what every tower outputs before it has learnt anything."""
        self.biases[-1].copy_(logits.reshape(-1, 1).to(self.biases[-1]))

    def forward(self, trunk: torch.Tensor, domain: torch.Tensor) -> torch.Tensor:
        """trunk [B, in_dim], domain [B] -> logits [B, tasks]."""
        B, towers = trunk.shape[0], self.domains * self.tasks
        last = len(self.weights) - 1
        h = trunk
        for i, (w, b) in enumerate(zip(self.weights, self.biases)):
            # Matmuls with the batch leading, never a bmm over towers: a bmm puts the batch in the middle of
            # what it saves for the backward, whose batch-sized stride a compiled step then fixes to one
            # batch size (torch 2.11-2.13). Every tower reads the same trunk: one matmul for the first
            # layer; each tower's own input after it: a block-diagonal matmul (towers x the FLOPs of
            # layers that are tiny beside the trunk).
            weight = w.transpose(0, 1).flatten(1) if i == 0 else torch.block_diag(*w.unbind(0))
            h = (h @ weight).view(B, towers, -1) + b
            if i < last:
                h = F.gelu(h)
            h = h.flatten(1)
        logits = h.view(-1, self.domains, self.tasks)
        return self.output(logits[torch.arange(logits.shape[0], device=domain.device), domain], domain)


class OutputCalibration(nn.Module):
    """A calibration of a model's output fitted after training (gem_ops.train.calibration): each
    (domain, task) logit becomes scale * logit + shift. A buffer, identity until set, reset before training
    again; states saved without it load as uncalibrated."""

    def __init__(self, domains: int, tasks: int):
        super().__init__()
        self.domains, self.tasks = domains, tasks
        self.register_buffer("calibration", identity_calibration(domains, tasks))
        self._register_load_state_dict_pre_hook(_uncalibrated_if_missing, with_module=True)

    def set_calibration(self, scale: torch.Tensor, shift: torch.Tensor) -> None:
        """scale, shift [domains, tasks] (identity: ones and zeros)."""
        self.calibration.copy_(torch.stack([scale, shift]).to(self.calibration))

    def forward(self, logits: torch.Tensor, domain: torch.Tensor) -> torch.Tensor:
        """logits [B, tasks] of examples of these domains [B]."""
        return logits * self.calibration[0, domain] + self.calibration[1, domain]


def identity_calibration(domains: int, tasks: int) -> torch.Tensor:
    return torch.stack([torch.ones(domains, tasks), torch.zeros(domains, tasks)])


def _uncalibrated_if_missing(module, state_dict, prefix, *args) -> None:
    state_dict.setdefault(prefix + "calibration", identity_calibration(module.domains, module.tasks))


@dataclass
class LossSums:
    """A batch's training loss as sums, so that a job of several ranks can normalise by global counts."""

    total: torch.Tensor  # [T] training loss summed over labelled examples (distillation included)
    labelled: torch.Tensor  # [T] the true labels' log loss alone, detached
    counts: torch.Tensor  # [T] labelled examples
    logits: torch.Tensor  # [B, T] serving logits


def loss_from_sums(sums: LossSums) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(the batch's loss: the sum over tasks of each task's mean, per-task losses on the true labels, logits)."""
    counts = sums.counts.clamp(min=1)
    return (sums.total / counts).sum(), sums.labelled / counts, sums.logits


def masked_bce_sums(logits: torch.Tensor, targets: torch.Tensor,
                    mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per task: the log loss summed over labelled examples, and their count (both [T], fp32)."""
    per_example = F.binary_cross_entropy_with_logits(logits.float(), targets.float(), reduction="none") * mask
    return per_example.sum(0), mask.sum(0).to(torch.float32)


def masked_bce_loss(logits: torch.Tensor, labels: torch.Tensor,
                    mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum over tasks of each task's mean log loss over its labelled examples; also the per-task losses.

    A task with no label in the batch adds nothing (its mean is taken over max(1, count))."""
    sums, counts = masked_bce_sums(logits, labels, mask)
    per_task = sums / counts.clamp(min=1)
    return per_task.sum(), per_task.detach()
