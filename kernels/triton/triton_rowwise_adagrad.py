"""Row-wise Adagrad's update of a dense table gradient in one pass: each program holds whole rows in registers,
so the gradient is read once and the table read and written once (eager PyTorch reads the gradient three times
and writes its square once: pow, mean, addcdiv); a row whose gradient is all zeros (one no batch looked up) is
neither read nor written where the update would leave it as it is. Contract: kernels.rowwise_adagrad.rowwise_adagrad_.
Launches need CUDA or TRITON_INTERPRET=1 set before import."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
MAX_DIM = 8192  # whole rows in registers: wider tables take the reference
ROWS_PER_PROGRAM = 4 if INTERPRETING else 8


@triton.jit
def _rowwise_adagrad_kernel(param_ptr, grad_ptr, sum_ptr, rows, dim, param_stride, grad_stride, lr, eps,
                            ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    col = tl.arange(0, BLOCK_D)
    row_ok = row < rows
    mask = row_ok[:, None] & (col[None, :] < dim)
    g = tl.load(grad_ptr + row[:, None] * grad_stride + col[None, :], mask=mask, other=0.0).to(tl.float32)
    squares = tl.sum(g * g, 1)
    old_sum = tl.load(sum_ptr + row, mask=row_ok, other=0.0)
    # A row of zero gradient (one no batch looked up) comes out of the update as it went in wherever 0 / (its old
    # denominator) is 0, a finite non-zero denominator: its table row is then neither read nor written. A NaN's
    # square is not 0; x * 0 is 0 only for a finite x.
    old_denominator = tl.sqrt_rn(old_sum) + eps
    unchanged = (squares == 0.0) & (old_denominator != 0.0) & (old_denominator * 0.0 == 0.0)
    row_ok = row_ok & ~unchanged
    mask = mask & row_ok[:, None]
    total = old_sum + squares / dim
    tl.store(sum_ptr + row, total, mask=row_ok)
    denominator = tl.sqrt_rn(total) + eps  # IEEE square root and division, as PyTorch's addcdiv rounds
    p_ptrs = param_ptr + row[:, None] * param_stride + col[None, :]
    p = tl.load(p_ptrs, mask=mask, other=0.0)
    tl.store(p_ptrs, p - lr * tl.div_rn(g, denominator[:, None]), mask=mask)


def supports(param: torch.Tensor, grad: torch.Tensor, state_sum: torch.Tensor) -> bool:
    """fp32 tables on CUDA (CPU too under the interpreter), plain tensors (a DTensor shard takes the reference),
    unit column strides, rows of at most MAX_DIM, and a contiguous [rows, 1] accumulator."""
    plain = all(type(t) in (torch.Tensor, torch.nn.Parameter) for t in (param, grad, state_sum))
    return (plain and (param.is_cuda or INTERPRETING) and param.dtype == grad.dtype == state_sum.dtype == torch.float32
            and param.dim() == 2 and grad.shape == param.shape and 0 < param.shape[1] <= MAX_DIM
            and param.stride(1) == grad.stride(1) == 1 and state_sum.shape == (param.shape[0], 1)
            and state_sum.is_contiguous())


def triton_rowwise_adagrad_(param: torch.Tensor, grad: torch.Tensor, state_sum: torch.Tensor, lr: float,
                            eps: float) -> None:
    rows, dim = param.shape
    block_d = triton.next_power_of_2(dim)
    rows_per_program = max(1, min(ROWS_PER_PROGRAM, 4096 // block_d))  # 16 fp32 per thread at 8 warps
    _rowwise_adagrad_kernel[(triton.cdiv(rows, rows_per_program),)](
        param, grad, state_sum, rows, dim, param.stride(0), grad.stride(0), float(lr), float(eps),
        ROWS=rows_per_program, BLOCK_D=block_d, num_warps=8 if block_d >= 1024 else 4)
