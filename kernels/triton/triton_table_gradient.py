"""An embedding table's dense gradient from its lookups' gradients, deterministically and without a host sync.

The ids are sorted (one radix sort); the sorted positions are cut into chunks of CHUNK. The first kernel reads a
chunk's gradient rows in sorted order and sums each run of equal ids with a segmented scan: a run that begins in
the chunk writes its sum to its row, a run that began in an earlier chunk leaves its part here in `carry`. The
second kernel adds, for each run that goes on past its first chunk, the following chunks' carries into its row.
Every sum has a fixed order, so a step's table gradient is the same from run to run (float atomics would not be).

PyTorch's embedding backward sums a run's partial sums one after another in one thread per column: on a small
table that every history token looks up (an item category's), one row holds thousands of tokens and those
threads serialise the step; here a run's chunks are summed in blocks of CARRY_BLOCK.

Contract: kernels.table_gradient.table_gradient. Launches need CUDA or TRITON_INTERPRET=1 set before import."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
CHUNK = 8 if INTERPRETING else 64  # sorted positions a program sums (small under the interpreter: runs cross chunks)
# 64 positions x 64 columns on 2 warps: the fastest of chunks 16-64, columns 64-256, 2-8 warps on an H100 at the
# w0.5_L512 tables (benchmarks/README.md)
BLOCK_D = 64
WARPS = 2
CARRY_BLOCK = 4 if INTERPRETING else 16  # following chunks' carries read at a time
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _restarting_sum(start_a, sum_a, start_b, sum_b):
    # A segmented sum: b's run restarts the total where b begins a run.
    return start_a | start_b, tl.where(start_b != 0, sum_b, sum_a + sum_b)


# A batch's sizes are not specialised on (Triton compiles a variant per size % 16 otherwise: a stall of a
# compile in some later step).
@triton.jit(do_not_specialize=["first_len", "n"])
def _chunk_sums_kernel(sorted_ptr, order_ptr, first_ptr, second_ptr, first_len, first_stride, second_stride,
                       out_ptr, carry_ptr, n, dim, out_stride, CHUNK: tl.constexpr, BLOCK_D: tl.constexpr):
    chunk = tl.program_id(0).to(tl.int64)
    col = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    col_ok = col < dim
    local = tl.arange(0, CHUNK)
    pos = chunk * CHUNK + local
    ok = pos < n
    row = tl.load(sorted_ptr + pos, mask=ok, other=-1)
    before = tl.load(sorted_ptr + pos - 1, mask=ok & (pos > 0), other=-1)
    after = tl.load(sorted_ptr + pos + 1, mask=pos + 1 < n, other=-1)
    # Where each sorted position's gradient lies: the first part's rows, then the second's.
    source = tl.load(order_ptr + pos, mask=ok, other=0)
    in_first = source < first_len
    grad = tl.load(first_ptr + source[:, None] * first_stride + col[None, :],
                   mask=(ok & in_first)[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
    grad += tl.load(second_ptr + (source - first_len)[:, None] * second_stride + col[None, :],
                    mask=(ok & ~in_first)[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
    starts = tl.broadcast_to(((row != before) | (local == 0)).to(tl.int32)[:, None], (CHUNK, BLOCK_D))
    _, sums = tl.associative_scan((starts, grad), 0, _restarting_sum)
    ends = ok & ((row != after) | (local == CHUNK - 1))
    previous_last = tl.load(sorted_ptr + chunk * CHUNK - 1, mask=chunk > 0, other=-1)
    continued = row == previous_last  # the chunk's first run, begun in an earlier chunk
    tl.store(out_ptr + row[:, None] * out_stride + col[None, :], sums,
             mask=(ends & ~continued)[:, None] & col_ok[None, :])
    carry = tl.sum(tl.where((ends & continued)[:, None], sums, 0.0), 0)
    tl.store(carry_ptr + chunk * dim + col, carry, mask=col_ok)


@triton.jit(do_not_specialize=["n", "chunks"])
def _carries_kernel(sorted_ptr, out_ptr, carry_ptr, n, dim, out_stride, chunks, CHUNK: tl.constexpr,
                    BLOCK_D: tl.constexpr, CARRY_BLOCK: tl.constexpr):
    chunk = tl.program_id(0).to(tl.int64)
    col = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    col_ok = col < dim
    row = tl.load(sorted_ptr + tl.minimum(chunk * CHUNK + CHUNK, n) - 1)  # the chunk's last run
    first = tl.load(sorted_ptr + chunk * CHUNK)
    previous_last = tl.load(sorted_ptr + chunk * CHUNK - 1, mask=chunk > 0, other=-1)
    next_first = tl.load(sorted_ptr + chunk * CHUNK + CHUNK, mask=chunk + 1 < chunks, other=-1)
    # Only the chunk where a run begins adds the run's later parts, and only where it goes on past the chunk.
    if ((first != row) | (previous_last != row)) & (next_first == row):
        total = tl.zeros([BLOCK_D], tl.float32)
        following = chunk + 1 + tl.arange(0, CARRY_BLOCK)
        going_on = next_first == row
        while going_on:
            # Chunks begin with non-decreasing ids: those beginning with this row follow one another.
            same = tl.load(sorted_ptr + following * CHUNK, mask=following < chunks, other=-1) == row
            total += tl.sum(tl.load(carry_ptr + following[:, None] * dim + col[None, :],
                                    mask=same[:, None] & col_ok[None, :], other=0.0), 0)
            going_on = tl.sum(same.to(tl.int32), 0) == CARRY_BLOCK
            following += CARRY_BLOCK
        at_row = out_ptr + row * out_stride + col
        tl.store(at_row, tl.load(at_row, mask=col_ok) + total, mask=col_ok)


def supports(grads: list[torch.Tensor], ids: list[torch.Tensor]) -> bool:
    """One or two parts of one width on CUDA (CPU too under the interpreter), float gradients with unit column
    strides, integer ids of one dimension, a row of gradient per id."""
    if not 1 <= len(grads) <= 2 or len(ids) != len(grads):
        return False
    device = grads[0].device
    return all(
        (g.is_cuda or INTERPRETING) and g.device == device == i.device and g.dim() == 2 and g.dtype in FLOAT_DTYPES
        and g.shape[1] == grads[0].shape[1] and g.stride(1) == 1 and i.dim() == 1 and i.shape[0] == g.shape[0]
        and i.dtype in (torch.int64, torch.int32) for g, i in zip(grads, ids))


def triton_table_gradient(grads: list[torch.Tensor], ids: list[torch.Tensor], rows: int, *, chunk: int = CHUNK,
                          block_d: int = BLOCK_D, warps: int = WARPS) -> torch.Tensor:
    """chunk, block_d, warps: the first kernel's launch (benchmarks/table_gradient.py --configs times others)."""
    first, second = grads[0], grads[-1]
    dim = first.shape[1]
    out = torch.zeros(rows, dim, dtype=torch.float32, device=first.device)
    flat = (ids[0] if len(ids) == 1 else torch.cat(ids)).to(torch.int64)
    n = flat.shape[0]
    if n == 0 or dim == 0:
        return out
    sorted_ids, order = torch.sort(flat, stable=True)
    chunks = triton.cdiv(n, chunk)
    carry = torch.empty(chunks, dim, dtype=torch.float32, device=first.device)
    grid = (chunks, triton.cdiv(dim, block_d))
    first_len = first.shape[0] if len(grads) == 2 else n
    _chunk_sums_kernel[grid](sorted_ids, order, first, second, first_len, first.stride(0), second.stride(0),
                             out, carry, n, dim, out.stride(0), CHUNK=chunk, BLOCK_D=block_d, num_warps=warps)
    _carries_kernel[grid](sorted_ids, out, carry, n, dim, out.stride(0), chunks, CHUNK=chunk, BLOCK_D=block_d,
                          CARRY_BLOCK=CARRY_BLOCK, num_warps=4)
    return out
