"""An embedding table's dense gradient from the gradients of its lookups (one or more id tensors into one table),
as the backward of gem_ops.model.embeddings' table lookups. One entry point, `table_gradient`, a torch.library op
so that a compiled step keeps it whole. The Triton kernel (deterministic, no host sync) runs on CUDA and under
TRITON_INTERPRET=1; the PyTorch reference runs elsewhere and is the oracle the kernel is tested against.
`GEM_TABLE_GRADIENT=aten` takes PyTorch's embedding backward on CUDA instead, for comparison."""

from __future__ import annotations

import os

import torch

from kernels.pytorch.pt_table_gradient import pt_table_gradient

try:
    from kernels.triton.triton_table_gradient import supports as _triton_supports
    from kernels.triton.triton_table_gradient import triton_table_gradient
except ImportError:  # no Triton on this machine: the reference serves alone
    triton_table_gradient = None


def _aten_table_gradient(grads: list[torch.Tensor], ids: list[torch.Tensor], rows: int) -> torch.Tensor:
    """PyTorch's embedding backward for the largest part, the others' rows added into its buffer."""
    parts = sorted(range(len(grads)), key=lambda k: grads[k].shape[0])
    largest = parts[-1]
    out = torch.ops.aten.embedding_dense_backward(grads[largest].to(torch.float32), ids[largest], rows, -1, False)
    for k in parts[:-1]:
        out.index_put_((ids[k],), grads[k].to(torch.float32), accumulate=True)
    return out


def _chosen_kernel() -> str:
    chosen = os.environ.get("GEM_TABLE_GRADIENT", "triton")
    if chosen not in ("triton", "aten"):
        raise ValueError(f"GEM_TABLE_GRADIENT={chosen!r}: must be 'triton' (the default) or 'aten'")
    return chosen


@torch.library.custom_op("gem::table_gradient", mutates_args=())
def _table_gradient_op(grads: list[torch.Tensor], ids: list[torch.Tensor], rows: int) -> torch.Tensor:
    if triton_table_gradient is not None and _triton_supports(grads, ids):
        if _chosen_kernel() == "triton":
            return triton_table_gradient(grads, ids, rows)
        return _aten_table_gradient(grads, ids, rows)
    return pt_table_gradient(grads, ids, rows)


@_table_gradient_op.register_fake
def _(grads, ids, rows):
    return grads[0].new_empty(rows, grads[0].shape[1], dtype=torch.float32)


def table_gradient(grads: list[torch.Tensor], ids: list[torch.Tensor], rows: int) -> torch.Tensor:
    """[rows, dim] fp32: row r holds the sum of every grads[k][i] whose ids[k][i] is r (zeros where none is).
    grads: [n_k, dim] floats; ids: [n_k] integers in [0, rows)."""
    if not grads or len(grads) != len(ids):
        raise ValueError(f"table_gradient: one id tensor per gradient, got {len(grads)} gradients and {len(ids)} "
                         f"id tensors")
    for k, (grad, index) in enumerate(zip(grads, ids)):
        if grad.dim() != 2 or grad.shape[1] != grads[0].shape[1] or index.shape != grad.shape[:1]:
            raise ValueError(f"table_gradient: part {k}: gradient {tuple(grad.shape)} and ids {tuple(index.shape)} "
                             f"must be [n, {grads[0].shape[1]}] and [n]")
    return _table_gradient_op(list(grads), list(ids), rows)
