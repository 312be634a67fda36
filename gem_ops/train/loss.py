"""The loss of a step is the global batch's loss: per task, the labelled examples' log loss summed over
all ranks over the global count of labelled examples. A job on W ranks then takes the same steps as one
process training on the union of their batches, up to float summation order."""

from __future__ import annotations

import torch
import torch.distributed as dist

from gem_ops.model.heads import LossSums


def global_batch_loss(sums: LossSums, world_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(what this rank backpropagates, its share of the global loss per task, of which the true labels').

    The shares add up over ranks to the global batch's loss. Gradients are averaged over ranks (FSDP2,
    TorchRec), so a rank backpropagates world_size x its share."""
    counts = sums.counts
    if world_size > 1:
        counts = counts.clone()
        dist.all_reduce(counts)
    counts = counts.clamp(min=1)
    share = sums.total / counts
    return share.sum() * world_size, share.detach(), sums.labelled / counts
