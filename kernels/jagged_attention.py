"""Jagged attention: attention over sequences stored back to back (values + offsets), never padded.

One entry point; the implementation is picked by `backend` ("auto", "pytorch", or a kernel once one
is registered). The PyTorch reference is the default on CPU and the oracle every kernel is tested
against.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from kernels.pytorch.pt_jagged_attention import pt_jagged_attention

ACTIVATIONS = ("softmax", "silu")

# name -> (implementation, whether it can run these tensors)
_BACKENDS: dict[str, tuple[Callable[..., torch.Tensor], Callable[[torch.Tensor], bool]]] = {
    "pytorch": (pt_jagged_attention, lambda q: True),
}


def register_backend(name: str, fn: Callable[..., torch.Tensor], supports: Callable[[torch.Tensor], bool]) -> None:
    """Kernels add themselves here; "auto" prefers the most recently registered one that supports the input."""
    _BACKENDS[name] = (fn, supports)


def available_backends() -> list[str]:
    return list(_BACKENDS)


# Opaque to torch.compile: a compiled caller breaks its graph here. The kernels' tile tables are
# cached per offsets tensor on the host, and their sizes depend on the batch's lengths.
@torch.compiler.disable
def jagged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_offsets: torch.Tensor,
    kv_offsets: torch.Tensor | None = None,
    *,
    causal: bool = False,
    activation: str = "softmax",
    scale: float | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Attention of each sequence's queries over the same sequence's keys and values.

    q: [total_q, heads, d]; k: [total_kv, heads, d]; v: [total_kv, heads, dv]. Sequence b owns
    q[q_offsets[b]:q_offsets[b+1]] and k, v[kv_offsets[b]:kv_offsets[b+1]]. Self attention passes
    kv_offsets=None (the same offsets); cross attention passes its own, e.g. one query per sample
    over a jagged history. Returns [total_q, heads, dv].

    causal: query i sees keys j <= i + (Lk - Lq) (aligned to the end; plain causal when Lq == Lk).
    activation: "softmax", or "silu": weights silu(s) / Lk, a pointwise Generalized Dot-Product
    Attention as in HSTU, normalised by the sequence's key count. A query with no visible key
    returns zeros. scale defaults to 1/sqrt(d).
    """
    kv_offsets = q_offsets if kv_offsets is None else kv_offsets
    _check(q, k, v, q_offsets, kv_offsets, activation)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    fn = _pick(backend, q)
    return fn(q, k, v, q_offsets, kv_offsets, causal, activation, scale)


def _pick(backend: str, q: torch.Tensor) -> Callable[..., torch.Tensor]:
    if backend == "auto":
        for fn, supports in reversed(list(_BACKENDS.values())):
            if supports(q):
                return fn
    if backend not in _BACKENDS:
        raise ValueError(f"jagged_attention backend {backend!r} unknown; available: {available_backends()}")
    fn, supports = _BACKENDS[backend]
    if not supports(q):
        raise ValueError(f"jagged_attention backend {backend!r} cannot run {q.dtype} tensors on {q.device}")
    return fn


def _check(q, k, v, q_offsets, kv_offsets, activation):
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"q, k, v must be [tokens, heads, dim]; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[1] != k.shape[1] or k.shape[1] != v.shape[1] or q.shape[2] != k.shape[2] or k.shape[0] != v.shape[0]:
        raise ValueError(f"shape mismatch: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if q_offsets.shape != kv_offsets.shape or q_offsets.dim() != 1:
        raise ValueError(f"q_offsets {tuple(q_offsets.shape)} and kv_offsets {tuple(kv_offsets.shape)} must be [B + 1]")


def _register_kernels() -> None:
    try:
        from kernels.triton.triton_jagged_attention import supports, triton_jagged_attention
    except ImportError:  # no Triton on this machine: the reference serves alone
        return
    register_backend("triton", triton_jagged_attention, supports)


_register_kernels()
