"""Jagged attention as PyTorch custom ops, for callers under torch.compile: the compiler sees one opaque node
whose output shape it knows (no graph break, so a whole model step compiles into one graph), and the backward
as a second node. Eager callers never come here (kernels.jagged_attention calls the kernels directly).

Each backend supplies a forward that returns (output, what its backward needs: e.g. the softmax statistics,
or an empty tensor), that tensor's shape from the inputs' shapes alone (for the compiler's fake tensors), and
a backward from it that writes the gradients into buffers it is given.

The packed op takes q, k and v as one fused projection's output ([tokens, 3 x heads, dim], or k and v packed
beside a separate q) and returns that tensor's gradient whole: with three inputs, autograd would join the three
gradients into the projection's gradient with a copy of all of them (a concatenation kernel a layer).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from kernels.pytorch.pt_jagged_attention import pt_jagged_attention


@dataclass(frozen=True)
class OpBackend:
    # (q, k, v, q_offsets, kv_offsets, causal, activation, scale) -> (out, saved fp32)
    forward: Callable[..., tuple[Tensor, Tensor]]
    # (q, k, v, out, saved, d_out, q_offsets, kv_offsets, causal, activation, scale, (dq, dk, dv)) -> None:
    # writes the gradients into the three buffers (views of one tensor, or tensors of their own)
    backward: Callable[..., None]
    # (total_q, heads, sequences, activation) -> the shape of `saved`: 1-D, so that its strides never depend
    # on a batch's sizes (a compiled step's saved activations get the first batch's strides fixed)
    saved_shape: Callable[..., tuple]


def _pt_forward(q, k, v, q_offsets, kv_offsets, causal, activation, scale):
    return (pt_jagged_attention(q, k, v, q_offsets, kv_offsets, causal, activation, scale),
            q.new_empty(0, dtype=torch.float32))


def _pt_backward(q, k, v, out, saved, d_out, q_offsets, kv_offsets, causal, activation, scale, grads):
    # A custom op's body runs below autograd: torch.func differentiates the reference there.
    _, vjp = torch.func.vjp(
        lambda q, k, v: pt_jagged_attention(q, k, v, q_offsets, kv_offsets, causal, activation, scale), q, k, v)
    for buffer, grad in zip(grads, vjp(d_out.to(out.dtype))):
        buffer.copy_(grad)


_OP_BACKENDS: dict[str, OpBackend] = {
    "pytorch": OpBackend(_pt_forward, _pt_backward, lambda total_q, heads, sequences, activation: (0,)),
}


def register_op_backend(name: str, backend: OpBackend) -> None:
    _OP_BACKENDS[name] = backend


def has_op_backend(name: str) -> bool:
    return name in _OP_BACKENDS


@torch.library.custom_op("gem_kernels::jagged_attention", mutates_args=())
def jagged_attention_op(q: Tensor, k: Tensor, v: Tensor, q_offsets: Tensor, kv_offsets: Tensor, causal: bool,
                        activation: str, scale: float, backend: str) -> tuple[Tensor, Tensor]:
    """(output [total_q, heads, dv], what the backward needs); contract: kernels.jagged_attention.jagged_attention."""
    out, saved = _OP_BACKENDS[backend].forward(q, k, v, q_offsets, kv_offsets, causal, activation, scale)
    return out, saved


@jagged_attention_op.register_fake
def _(q, k, v, q_offsets, kv_offsets, causal, activation, scale, backend):
    shape = _OP_BACKENDS[backend].saved_shape(q.shape[0], q.shape[1], q_offsets.shape[0] - 1, activation)
    return q.new_empty(q.shape[0], q.shape[1], v.shape[2]), q.new_empty(shape, dtype=torch.float32)


@torch.library.custom_op("gem_kernels::jagged_attention_backward", mutates_args=())
def jagged_attention_backward_op(q: Tensor, k: Tensor, v: Tensor, out: Tensor, saved: Tensor, d_out: Tensor,
                                 q_offsets: Tensor, kv_offsets: Tensor, causal: bool, activation: str, scale: float,
                                 backend: str) -> tuple[Tensor, Tensor, Tensor]:
    grads = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    _OP_BACKENDS[backend].backward(q, k, v, out, saved, d_out, q_offsets, kv_offsets, causal, activation, scale, grads)
    return grads


@jagged_attention_backward_op.register_fake
def _(q, k, v, out, saved, d_out, q_offsets, kv_offsets, causal, activation, scale, backend):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, q_offsets, kv_offsets, causal, activation, scale, backend = inputs
    out, saved = output
    ctx.save_for_backward(q, k, v, out, saved, q_offsets, kv_offsets)
    ctx.settings = (causal, activation, scale, backend)
    ctx.mark_non_differentiable(saved)


def _backward(ctx, d_out, _d_saved):
    q, k, v, out, saved, q_offsets, kv_offsets = ctx.saved_tensors
    dq, dk, dv = jagged_attention_backward_op(q, k, v, out, saved, d_out.contiguous(), q_offsets, kv_offsets,
                                              *ctx.settings)
    return dq, dk, dv, None, None, None, None, None, None


jagged_attention_op.register_autograd(_backward, setup_context=_setup_context)


def split_packed(packed: Tensor, q: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """q, k, v as views of `packed` ([tokens, 3 x heads, dim]: q, k, v; or [tokens, 2 x heads, dim]: k, v beside
    the separate `q`)."""
    # split, not slices: eager autograd joins split's gradients in one cat (slices: a zero-filled tensor each).
    parts = packed.split(packed.shape[1] // (3 if q is None else 2), dim=1)
    return parts if q is None else (q, *parts)


@torch.library.custom_op("gem_kernels::jagged_attention_packed", mutates_args=())
def jagged_attention_packed_op(packed: Tensor, q: Tensor | None, q_offsets: Tensor, kv_offsets: Tensor, causal: bool,
                               activation: str, scale: float, backend: str) -> tuple[Tensor, Tensor]:
    """jagged_attention_op over q, k, v packed in one tensor (split_packed)."""
    q, k, v = split_packed(packed, q)
    return _OP_BACKENDS[backend].forward(q, k, v, q_offsets, kv_offsets, causal, activation, scale)


@jagged_attention_packed_op.register_fake
def _(packed, q, q_offsets, kv_offsets, causal, activation, scale, backend):
    q, _, v = split_packed(packed, q)
    shape = _OP_BACKENDS[backend].saved_shape(q.shape[0], q.shape[1], q_offsets.shape[0] - 1, activation)
    return q.new_empty(q.shape[0], q.shape[1], v.shape[2]), q.new_empty(shape, dtype=torch.float32)


def _gradient_buffer(packed: Tensor) -> Tensor:
    # No zero fill: the backends write every row, zeros in rows that no sequence owns.
    return torch.empty(packed.shape, dtype=packed.dtype, device=packed.device)


@torch.library.custom_op("gem_kernels::jagged_attention_packed_backward", mutates_args=())
def jagged_attention_packed_backward_op(packed: Tensor, q: Tensor | None, out: Tensor, saved: Tensor, d_out: Tensor,
                                        q_offsets: Tensor, kv_offsets: Tensor, causal: bool, activation: str,
                                        scale: float, backend: str) -> tuple[Tensor, Tensor]:
    """(packed's gradient, q's: an empty tensor when q is packed too): the kernels write into views of one buffer."""
    d_packed = _gradient_buffer(packed)
    dq, dk, dv = split_packed(d_packed, None if q is None else torch.empty_like(q))
    _OP_BACKENDS[backend].backward(*split_packed(packed, q), out, saved, d_out, q_offsets, kv_offsets, causal,
                                   activation, scale, (dq, dk, dv))
    return d_packed, (d_packed.new_empty(0) if q is None else dq)


@jagged_attention_packed_backward_op.register_fake
def _(packed, q, out, saved, d_out, q_offsets, kv_offsets, causal, activation, scale, backend):
    return packed.new_empty(packed.shape), (packed.new_empty(0) if q is None else torch.empty_like(q))


def _setup_packed_context(ctx, inputs, output) -> None:
    packed, q, q_offsets, kv_offsets, causal, activation, scale, backend = inputs
    out, saved = output
    ctx.save_for_backward(packed, q, out, saved, q_offsets, kv_offsets)  # q None where packed holds it
    ctx.settings = (causal, activation, scale, backend)
    ctx.mark_non_differentiable(saved)


def _packed_backward(ctx, d_out, _d_saved):
    packed, q, out, saved, q_offsets, kv_offsets = ctx.saved_tensors
    d_packed, dq = jagged_attention_packed_backward_op(packed, q, out, saved, d_out.contiguous(), q_offsets,
                                                       kv_offsets, *ctx.settings)
    return d_packed, (None if q is None else dq), None, None, None, None, None, None


jagged_attention_packed_op.register_autograd(_packed_backward, setup_context=_setup_packed_context)
