"""Reference for kernels.fp8_cast: tensorwise FP8 scaling of a 2-D tensor, in plain PyTorch."""

from __future__ import annotations

import torch

FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
# torchao's floor on the absolute maximum: an all-zero tensor gets a finite scale.
AMAX_FLOOR = 1e-12
# torch._scaled_mm needs the inner dimension of a product in multiples of 16.
ROW_MULTIPLE = 16


def padded_rows(rows: int) -> int:
    return -(-rows // ROW_MULTIPLE) * ROW_MULTIPLE


def amax_scale(amax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The factor that maps the tensor's absolute maximum onto the format's largest finite value."""
    return FP8_MAX[dtype] / amax.float().clamp(min=AMAX_FLOOR)


def pt_cast_to_fp8(x: torch.Tensor, dtype: torch.dtype, transposed: bool, column_sums: bool):
    """x [M, N] -> (x8 [M, N], x8_t [N, padded M] (zeros past M) or empty, inverse scale (a 0-d fp32
    tensor, what torch._scaled_mm multiplies by), x's column sums in fp32 [N] or empty)."""
    limit = FP8_MAX[dtype]
    xf = x.float()
    scale = amax_scale(xf.abs().amax() if x.numel() else xf.new_zeros(()), dtype)
    x8 = (xf * scale).clamp(-limit, limit).to(dtype)
    x8_t = x8.new_empty(0)
    if transposed:
        x8_t = torch.zeros(x.shape[1], padded_rows(x.shape[0]), dtype=dtype, device=x.device)
        x8_t[:, : x.shape[0]] = x8.t()
    sums = xf.sum(0) if column_sums else xf.new_empty(0)
    return x8, x8_t, scale.reciprocal(), sums
