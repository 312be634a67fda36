"""An embedding table's dense gradient from its lookups' gradients, in PyTorch: the oracle of the Triton kernel and
the path everywhere it does not run."""

from __future__ import annotations

import torch


def pt_table_gradient(grads: list[torch.Tensor], ids: list[torch.Tensor], rows: int) -> torch.Tensor:
    """[rows, dim] fp32: Σ over parts k and positions i of grads[k][i] added into row ids[k][i]."""
    out = torch.zeros(rows, grads[0].shape[1], dtype=torch.float32, device=grads[0].device)
    for grad, index in zip(grads, ids):
        out.index_add_(0, index, grad.to(torch.float32))
    return out
