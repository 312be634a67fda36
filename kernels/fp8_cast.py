"""Tensorwise FP8 casting for training: a tensor's absolute maximum sets its scale, and the FP8 copy
comes in the layouts torch._scaled_mm takes (row-major for the left operand, transposed for a
gradient product's right one).

One entry point, `cast_to_fp8`, a torch.library op so that torch.compile keeps it whole inside a
compiled layer. The Triton kernel runs on CUDA (and under TRITON_INTERPRET=1); the PyTorch reference
runs elsewhere and is the oracle the kernel is tested against.
"""

from __future__ import annotations

import torch

from kernels.pytorch.pt_fp8_cast import FP8_MAX, padded_rows, pt_cast_to_fp8

FP8_DTYPES = tuple(FP8_MAX)

try:
    from kernels.triton.triton_fp8_cast import supports as _triton_supports
    from kernels.triton.triton_fp8_cast import triton_cast_to_fp8
except ImportError:  # no Triton on this machine: the reference serves alone
    triton_cast_to_fp8 = None


@torch.library.custom_op("gem::cast_to_fp8", mutates_args=())
def _cast_to_fp8_op(x: torch.Tensor, dtype: torch.dtype, transposed: bool, column_sums: bool
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    cast = triton_cast_to_fp8 if triton_cast_to_fp8 is not None and _triton_supports(x) else pt_cast_to_fp8
    x8, x8_t, inverse, sums = cast(x, dtype, transposed, column_sums)
    # The transposed copy leaves the op flat: inside a compiled step with dynamic sizes, a saved tensor whose
    # strides depend on the batch is fixed to the first batch's strides (gem_ops/train/fp8_linear.py).
    return x8, x8_t.reshape(-1), inverse, sums


@_cast_to_fp8_op.register_fake
def _(x, dtype, transposed, column_sums):
    rows, cols = x.shape
    return (x.new_empty(rows, cols, dtype=dtype),
            x.new_empty(cols * padded_rows(rows) if transposed else 0, dtype=dtype),
            x.new_empty((), dtype=torch.float32),
            x.new_empty(cols if column_sums else 0, dtype=torch.float32))


def cast_to_fp8(x: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn, *, transposed: bool = True,
                column_sums: bool = False, flat: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, N] (fp32, fp16 or bf16) -> (x8 [M, N], x8_t [N, M rounded up to 16] with zeros past M (or
    empty when not `transposed`; with `flat`, its N * padded M elements in one dimension), the inverse scale
    as a 0-d fp32 tensor, and x's column sums in fp32 [N] (or empty when not `column_sums`)).
    x8 = saturate(x * 448 / amax(|x|)) for e4m3 (57344 for e5m2)."""
    if dtype not in FP8_DTYPES:
        raise ValueError(f"cast_to_fp8: dtype must be one of {FP8_DTYPES}, got {dtype}")
    if x.dim() != 2:
        raise ValueError(f"cast_to_fp8: x must be 2-D [rows, columns], got shape {tuple(x.shape)}")
    x8, x8_t, inverse, sums = _cast_to_fp8_op(x, dtype, transposed, column_sums)
    if transposed and not flat:
        x8_t = x8_t.view(x.shape[1], padded_rows(x.shape[0]))
    return x8, x8_t, inverse, sums
