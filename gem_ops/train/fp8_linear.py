"""FP8 linear layers with this project's casts (the "tensorwise_triton" recipe of acceleration.py).

Y = X W^T + b with X and W cast to float8_e4m3 and the output gradient to float8_e5m2, one scale per
tensor from its absolute maximum, all three products on the FP8 tensor cores (torch._scaled_mm) in
fast accumulation. Against torchao's tensorwise recipe (same scaling, same products), what changes is
the memory traffic around the products, which decided FP8's backward on the H200:
- kernels.fp8_cast writes both layouts a product needs in one pass, after one reduction pass;
- the input is kept for the backward as its transposed FP8 copy (a quarter of fp32's bytes, half of
  bf16's), so the backward neither re-reads nor re-scales it;
- the bias gradient is the column sums that the output gradient's reduction pass computes anyway.
"""

from __future__ import annotations

import torch
from torch import nn

from kernels.fp8_cast import cast_to_fp8

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


@torch.library.custom_op("gem::fp8_weight_gradient", mutates_args=())
def _weight_gradient(g8_t: torch.Tensor, x8_t_flat: torch.Tensor, g_inverse: torch.Tensor, x_inverse: torch.Tensor
                     ) -> torch.Tensor:
    """grad_out^T x in fp32: g8_t [out, padded rows] times the input's transposed FP8 copy, which arrives flat
    (the padded token columns are zeros in both operands). The copy is saved flat and viewed only in here, out
    of the compiled graph's sight: a compiled step with dynamic sizes fixes a saved tensor's batch-dependent
    strides to the first batch's (a stride check fails at the next), and would save the 2-D view were it made
    in the graph."""
    x8_t = x8_t_flat.view(-1, g8_t.shape[1])
    return torch._scaled_mm(g8_t, x8_t.t(), scale_a=g_inverse, scale_b=x_inverse, out_dtype=torch.float32,
                            use_fast_accum=True)


@_weight_gradient.register_fake
def _(g8_t, x8_t_flat, g_inverse, x_inverse):
    return g8_t.new_empty(g8_t.shape[0], x8_t_flat.shape[0] // g8_t.shape[1], dtype=torch.float32)


class _Float8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype
                ) -> torch.Tensor:
        need_x_grad, need_w_grad = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        x8, x8_t_flat, x_inverse, _ = cast_to_fp8(x, E4M3, transposed=need_w_grad, flat=True)
        w8, w8_t, w_inverse, _ = cast_to_fp8(weight, E4M3, transposed=need_x_grad)
        fused_bias = bias is not None and out_dtype == torch.bfloat16  # the product adds a bf16 bias only
        out = torch._scaled_mm(x8, w8.t(), scale_a=x_inverse, scale_b=w_inverse,
                               bias=bias.to(out_dtype) if fused_bias else None, out_dtype=out_dtype,
                               use_fast_accum=True)
        if bias is not None and not fused_bias:
            out = out + bias.to(out_dtype)
        ctx.save_for_backward(x8_t_flat, w8_t, x_inverse, w_inverse)
        ctx.weight_dtype = weight.dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x8_t_flat, w8_t, x_inverse, w_inverse = ctx.saved_tensors
        need_x_grad, need_w_grad, need_b_grad = ctx.needs_input_grad[:3]
        g8, g8_t, g_inverse, g_sums = cast_to_fp8(grad_out.contiguous(), E5M2, transposed=need_w_grad,
                                                  column_sums=need_b_grad)
        grad_x = grad_w = grad_b = None
        if need_x_grad:
            grad_x = torch._scaled_mm(g8, w8_t.t(), scale_a=g_inverse, scale_b=w_inverse,
                                      out_dtype=torch.bfloat16, use_fast_accum=True)
        if need_w_grad:
            grad_w = _weight_gradient(g8_t, x8_t_flat, g_inverse, x_inverse).to(ctx.weight_dtype)
        if need_b_grad:
            grad_b = g_sums.to(ctx.bias_dtype)
        return grad_x, grad_w, grad_b, None


class Float8TrainingLinear(nn.Linear):
    """nn.Linear whose forward and backward products run in FP8 (same parameters and state_dict).
    The output has autocast's dtype under autocast (bf16 in training), else the input's."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        device = x.device.type
        out_dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
        if x.numel() == 0:  # no rows to scale: an empty output, and zero gradients
            return nn.functional.linear(x.to(out_dtype), self.weight.to(out_dtype),
                                        None if self.bias is None else self.bias.to(out_dtype))
        rows = x.reshape(-1, x.shape[-1])
        if torch.is_autocast_enabled(device) and rows.dtype == torch.float32:
            # As autocast does for nn.Linear (e.g. after a LayerNorm, which autocast runs in fp32): the FP8 cast then
            # reads half the bytes, and its fused transposed copy serves 16-bit tiles only
            # (kernels/triton/triton_fp8_cast.py).
            rows = rows.to(out_dtype)
        out = _Float8Linear.apply(rows, self.weight, self.bias, out_dtype)
        return out.reshape(*x.shape[:-1], self.out_features)


def convert_to_float8_linear(model: nn.Module, module_filter) -> list[str]:
    """Turns every nn.Linear that module_filter(module, name) accepts into a Float8TrainingLinear in
    place (its class only: parameters, hooks and state_dict keys stay). Returns their names."""
    names = []
    for name, module in model.named_modules():
        if type(module) is nn.Linear and module_filter(module, name):
            module.__class__ = Float8TrainingLinear
            names.append(name)
    return names
