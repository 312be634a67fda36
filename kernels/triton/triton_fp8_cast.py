"""Triton tensorwise FP8 casts: one pass that reads the tensor for its absolute maximum (and, if asked,
its column sums: a bias gradient on the way), then one pass that writes the FP8 tensor in both
layouts torch._scaled_mm wants, row-major and transposed (the transpose through registers, so both
stores are coalesced; for 16-bit inputs only, see triton_cast_to_fp8), the transposed one padded with zero rows to
a multiple of 16.

Two reads and two narrow writes of the tensor, at any row count (benchmarks/mfu.py's dense-layer
stage compares it with torchao's casts under torch.compile). Contract: kernels.fp8_cast.cast_to_fp8. Launches need CUDA
or TRITON_INTERPRET=1 set before import.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels.pytorch.pt_fp8_cast import FP8_MAX, amax_scale, padded_rows

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Programs of the reduction pass per multiprocessor (at 128 columns a program): each walks a strip of
# rows of one column block, so the partial tables stay small.
PROGRAMS_PER_SM = 8

if INTERPRETING:  # one small config: tests stay fast and still span several blocks
    _CAST_CONFIGS = _REDUCE_CONFIGS = [triton.Config({"BLOCK_M": 16, "BLOCK_N": 16}, num_warps=4)]
else:
    _CAST_CONFIGS = [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w)
                     for m, n, w in ((64, 64, 4), (128, 64, 4), (64, 128, 4), (128, 128, 8), (32, 128, 4))]
    _REDUCE_CONFIGS = [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w)
                       for m, n, w in ((32, 128, 4), (64, 128, 8), (32, 256, 8), (16, 256, 4), (64, 64, 4))]


@triton.autotune(configs=_REDUCE_CONFIGS, key=["N", "SUMS"])
@triton.jit
def _column_max_sum_kernel(x_ptr, max_ptr, sum_ptr, M, N, stride,
                           SUMS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Program (r, c): over the r-th of the grid's strips of rows, in column block c, the absolute
    maximum and the sum of each column, stored at row r of the [strips, N] partial tables. The running
    maxima and sums stay elementwise over the whole tile (registers only) and are reduced over its
    rows once, at the end."""
    strip, block = tl.program_id(0), tl.program_id(1)
    strip_rows = tl.cdiv(tl.cdiv(M, tl.num_programs(0)), BLOCK_M) * BLOCK_M
    cols = block * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    running_max = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    running_sum = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for start in range(strip * strip_rows, tl.minimum((strip + 1) * strip_rows, M), BLOCK_M):
        rows = start + tl.arange(0, BLOCK_M)
        mask = (rows[:, None] < M) & col_ok[None, :]
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        running_max = tl.maximum(running_max, tl.abs(x))
        if SUMS:
            running_sum += x
    tl.store(max_ptr + strip * N + cols, tl.max(running_max, axis=0), mask=col_ok)
    if SUMS:
        tl.store(sum_ptr + strip * N + cols, tl.sum(running_sum, axis=0), mask=col_ok)


@triton.autotune(configs=_CAST_CONFIGS, key=["N", "TRANSPOSED"])
@triton.jit
def _cast_kernel(x_ptr, scale_ptr, out_ptr, out_t_ptr, M, N, M_PAD, stride,
                 FP8_LIMIT: tl.constexpr, TRANSPOSED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    inside = (rows[:, None] < M) & (cols[None, :] < N)
    x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride + cols[None, :], mask=inside, other=0.0).to(tl.float32)
    # Saturated by comparisons, so NaN stays NaN (a non-finite gradient must reach the loop's divergence check, not
    # turn into zeros). Not tl.clamp(propagate_nan=ALL): triton-lang/triton#11111 reports its NaN-propagating min/max
    # corrupting transposed FP8 stores.
    scaled = x * tl.load(scale_ptr)
    scaled = tl.where(scaled > FP8_LIMIT, FP8_LIMIT, tl.where(scaled < -FP8_LIMIT, -FP8_LIMIT, scaled))
    scaled = scaled.to(out_ptr.dtype.element_ty, fp_downcast_rounding="rtne")
    tl.store(out_ptr + rows[:, None].to(tl.int64) * N + cols[None, :], scaled, mask=inside)
    if TRANSPOSED:  # rows past M (up to M_PAD) were loaded as 0: they write the zero padding
        pad_ok = (cols[:, None] < N) & (rows[None, :] < M_PAD)
        tl.store(out_t_ptr + cols[:, None].to(tl.int64) * M_PAD + rows[None, :], tl.trans(scaled), mask=pad_ok)


def _column_max_and_sums(x: torch.Tensor, column_sums: bool) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = x.shape
    sms = 4 if INTERPRETING else torch.cuda.get_device_properties(x.device).multi_processor_count
    strips = max(1, min(triton.cdiv(rows, 64), PROGRAMS_PER_SM * sms * 128 // cols))
    partial_max = torch.empty(strips, cols, dtype=torch.float32, device=x.device)
    partial_sum = torch.empty(strips if column_sums else 0, cols, dtype=torch.float32, device=x.device)
    grid = lambda meta: (strips, triton.cdiv(cols, meta["BLOCK_N"]))  # noqa: E731
    _column_max_sum_kernel[grid](x, partial_max, partial_sum, rows, cols, x.stride(0), SUMS=column_sums)
    sums = partial_sum.sum(0) if column_sums else partial_sum.new_empty(0)
    return partial_max.amax(), sums


def triton_cast_to_fp8(x: torch.Tensor, dtype: torch.dtype, transposed: bool, column_sums: bool):
    rows, cols = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    amax, sums = _column_max_and_sums(x, column_sums)
    scale = amax_scale(amax, dtype)
    m_pad = padded_rows(rows)
    x8 = torch.empty(rows, cols, dtype=dtype, device=x.device)
    # Triton 3.6's in-register transpose of the FP8 tile loses columns on the H200 when the tile was loaded as fp32
    # (zeros where values belong, the row-major copy right; bf16 inputs were right at every tile):
    # fp32 tensors (the weights) get their transposed copy from the row-major one.
    fused = transposed and x.dtype != torch.float32
    x8_t = torch.empty(cols if fused else 0, m_pad, dtype=dtype, device=x.device)
    grid = lambda meta: (triton.cdiv(m_pad if fused else rows, meta["BLOCK_M"]),  # noqa: E731
                         triton.cdiv(cols, meta["BLOCK_N"]))
    _cast_kernel[grid](x, scale, x8, x8_t, rows, cols, m_pad, x.stride(0), FP8_LIMIT=FP8_MAX[dtype], TRANSPOSED=fused)
    if transposed and not fused:
        x8_t = x8.new_zeros(cols, m_pad)
        x8_t[:, :rows] = x8.t()
    return x8, x8_t, scale.reciprocal(), sums


def supports(x: torch.Tensor) -> bool:
    """Non-empty CUDA tensors of the supported dtypes; CPU tensors too under the Triton interpreter."""
    return (x.is_cuda or INTERPRETING) and x.dtype in SUPPORTED_DTYPES and x.numel() > 0
