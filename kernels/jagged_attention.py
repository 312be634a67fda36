"""Jagged attention: attention over sequences stored back to back (values + offsets), never padded.

One entry point; the implementation is picked by `backend` ("auto", "pytorch", or a kernel once one
is registered). The PyTorch reference is the default on CPU and the oracle every kernel is tested
against.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from kernels.fp8_cast import cast_to_fp8
from kernels.jagged_attention_op import (OpBackend, has_op_backend, jagged_attention_op, jagged_attention_packed_op,
                                         register_op_backend, split_packed)
from kernels.pytorch.pt_jagged_attention import pt_jagged_attention

ACTIVATIONS = ("softmax", "silu")
FP8 = torch.float8_e4m3fn

# name -> (implementation, whether it can run these tensors)
_BACKENDS: dict[str, tuple[Callable[..., torch.Tensor], Callable[[torch.Tensor], bool]]] = {
    "pytorch": (pt_jagged_attention, lambda q: True),
}


def register_backend(name: str, fn: Callable[..., torch.Tensor], supports: Callable[[torch.Tensor], bool]) -> None:
    """Kernels add themselves here; "auto" prefers the most recently registered one that supports the input."""
    _BACKENDS[name] = (fn, supports)


def available_backends() -> list[str]:
    return list(_BACKENDS)


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
    descale: tuple | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Attention of each sequence's queries over the same sequence's keys and values.

    q: [total_q, heads, d]; k: [total_kv, heads, d]; v: [total_kv, heads, dv]. Sequence b owns
    q[q_offsets[b]:q_offsets[b+1]] and k, v[kv_offsets[b]:kv_offsets[b+1]]. Self attention passes
    kv_offsets=None (the same offsets); cross attention passes its own, e.g. one query per sample
    over a jagged history. Returns [total_q, heads, dv]. Offsets are non-decreasing (not checked:
    that would read device values back to the host); rows no sequence owns, before the first
    offset or from the last one on, come out 0 and get zero gradients. Finite values never mix across
    sequences; a NaN or Inf can reach the sequence before its own where the Triton kernel loads
    through tensor descriptors (power-of-two head dims; JAGGED_ATTENTION_TMA=0 confines it;
    kernels/triton/triton_jagged_attention.py).

    causal: query i sees keys j <= i + (Lk - Lq) (aligned to the end; plain causal when Lq == Lk).
    activation: "softmax", or "silu": weights silu(s) / Lk, a pointwise Generalized Dot-Product
    Attention as in HSTU, normalised by the sequence's key count. A query with no visible key
    returns zeros. scale defaults to 1/sqrt(d).

    FP8 (float8_e4m3fn q, k, v, forward only, as FlashAttention-3's FP8 path): the real values are
    q * descale[0], k * descale[1], v * descale[2] (floats or one-element fp32 tensors, e.g. each
    tensor's amax / 448 from its quantization, as quantize_fp8 returns them; default 1). QK^T runs
    in FP8 with fp32 accumulation; the weights and V meet in fp16 (every e4m3 value is exact
    there), since weights far below 1 would flush to zero in FP8. Returns bf16.
    """
    kv_offsets = q_offsets if kv_offsets is None else kv_offsets
    _check(q, k, v, q_offsets, kv_offsets, activation)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if torch.compiler.is_compiling() and q.dtype != FP8 and has_op_backend(name := _pick_name(backend, q)):
        # Traced by torch.compile: one custom op node (and one for its backward), no graph break.
        return jagged_attention_op(q, k, v, q_offsets, kv_offsets, causal, activation, scale, name)[0]
    return _eager(q, k, v, q_offsets, kv_offsets, causal, activation, scale, descale, backend)


def jagged_attention_packed(
    packed: torch.Tensor,
    q_offsets: torch.Tensor,
    kv_offsets: torch.Tensor | None = None,
    *,
    q: torch.Tensor | None = None,
    causal: bool = False,
    activation: str = "softmax",
    scale: float | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """jagged_attention over q, k, v packed as one fused projection's output: `packed` [tokens, 3 x heads, d]
    holds q, k, v side by side per token (self attention), or [tokens, 2 x heads, d] holds k, v beside a separate
    `q` [total_q, heads, d] (cross attention). The same result; under torch.compile the backward writes the
    three gradients into one tensor, packed's gradient, where three separate inputs would have autograd copy
    them into it (not FP8: train in bf16)."""
    parts = 3 if q is None else 2
    if packed.dim() != 3 or packed.shape[1] % parts:
        raise ValueError(f"packed must be [tokens, {parts} x heads, dim] ({'q, k, v' if q is None else 'k, v'}); "
                         f"got {tuple(packed.shape)}")
    q_, k, v = split_packed(packed, q)
    kv_offsets = q_offsets if kv_offsets is None else kv_offsets
    _check(q_, k, v, q_offsets, kv_offsets, activation)
    scale = 1.0 / math.sqrt(k.shape[-1]) if scale is None else scale
    if torch.compiler.is_compiling() and packed.dtype != FP8 and has_op_backend(name := _pick_name(backend, k)):
        return jagged_attention_packed_op(packed, q, q_offsets, kv_offsets, causal, activation, scale, name)[0]
    return _eager(q_, k, v, q_offsets, kv_offsets, causal, activation, scale, None, backend)


# Opaque to torch.compile (FP8 inference): the kernels' tile tables are cached per offsets tensor on the host.
@torch.compiler.disable
def _eager(q, k, v, q_offsets, kv_offsets, causal, activation, scale, descale, backend):
    fn = _pick(backend, q)
    if q.dtype == FP8:
        return fn(q, k, v, q_offsets, kv_offsets, causal, activation, scale, descale=_descales(descale, q.device))
    if descale is not None:
        raise ValueError(f"descale applies to float8_e4m3fn inputs only; q, k, v are {q.dtype}")
    return fn(q, k, v, q_offsets, kv_offsets, causal, activation, scale)


def quantize_fp8(*tensors: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """Inputs for the FP8 path: each [tokens, heads, dim] tensor as float8_e4m3fn scaled by its own absolute
    maximum (kernels.fp8_cast), and the factors to pass as `descale`."""
    quantized, factors = [], []
    for x in tensors:
        x8, _, inverse, _ = cast_to_fp8(x.reshape(-1, x.shape[-1]), FP8, transposed=False)
        quantized.append(x8.view(x.shape))
        factors.append(inverse)
    return tuple(quantized), tuple(factors)


def _descales(descale: tuple | None, device: torch.device) -> torch.Tensor:
    """[3] fp32 on the inputs' device: the factors of q, k, v (no host read of tensor factors)."""
    if descale is None:
        return torch.ones(3, dtype=torch.float32, device=device)
    if len(descale) != 3:
        raise ValueError(f"descale must hold three factors (q, k, v), got {len(descale)}")
    factors = []
    for name, d in zip("qkv", descale):
        d = torch.as_tensor(d, dtype=torch.float32, device=device)
        if d.numel() != 1:
            raise ValueError(f"descale of {name} must be one number, got a tensor of shape {tuple(d.shape)}")
        factors.append(d.reshape(()))
    return torch.stack(factors)


def _pick(backend: str, q: torch.Tensor) -> Callable[..., torch.Tensor]:
    return _BACKENDS[_pick_name(backend, q)][0]


def _pick_name(backend: str, q: torch.Tensor) -> str:
    if backend == "auto":
        for name, (_, supports) in reversed(list(_BACKENDS.items())):
            if supports(q):
                return name
    if backend not in _BACKENDS:
        raise ValueError(f"jagged_attention backend {backend!r} unknown; available: {available_backends()}")
    if not _BACKENDS[backend][1](q):
        raise ValueError(f"jagged_attention backend {backend!r} cannot run {q.dtype} tensors on {q.device}")
    return backend


def _check(q, k, v, q_offsets, kv_offsets, activation):
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"q, k, v must be [tokens, heads, dim]; got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    if q.shape[1] != k.shape[1] or k.shape[1] != v.shape[1] or q.shape[2] != k.shape[2] or k.shape[0] != v.shape[0]:
        raise ValueError(f"shape mismatch: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if q_offsets.shape != kv_offsets.shape or q_offsets.dim() != 1:
        raise ValueError(f"q_offsets {tuple(q_offsets.shape)} and kv_offsets {tuple(kv_offsets.shape)} must be [B + 1]")
    if FP8 in (q.dtype, k.dtype, v.dtype):
        if not q.dtype == k.dtype == v.dtype:
            raise ValueError(f"FP8 attention needs q, k, v all float8_e4m3fn; got {q.dtype}, {k.dtype}, {v.dtype}")
        if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
            raise ValueError("FP8 jagged attention is forward only: run it under torch.no_grad() (inference), "
                             "or pass bf16 q, k, v to train")


_triton_kernels = None  # the Triton module, once registered


def tuning_runs() -> int:
    """How often a kernel has tuned its launch (compiling its candidates) in this process: 0 without Triton."""
    return _triton_kernels.tuning_runs() if _triton_kernels is not None else 0


def stored_tunings_used() -> int:
    """How often a kernel took its config for a new key from the tuning store instead of tuning: 0 without Triton."""
    return _triton_kernels.stored_tunings_used() if _triton_kernels is not None else 0


def compiled_variants() -> int:
    """Kernel binaries (specialisations) the attention's Triton kernels hold in this process: 0 without Triton."""
    return _triton_kernels.compiled_variants() if _triton_kernels is not None else 0


def chosen_configs() -> dict[str, dict[str, str]]:
    """The Triton kernels' configs per tuning key chosen in this process ({} without Triton)."""
    return _triton_kernels.chosen_configs() if _triton_kernels is not None else {}


def _register_kernels() -> None:
    global _triton_kernels
    try:
        from kernels.triton import triton_jagged_attention as triton_kernels
    except ImportError:  # no Triton on this machine: the reference serves alone
        return
    _triton_kernels = triton_kernels
    register_backend("triton", triton_kernels.triton_jagged_attention, triton_kernels.supports)
    register_op_backend("triton", OpBackend(triton_kernels.op_forward, triton_kernels.op_backward,
                                            triton_kernels.op_stats_shape))


_register_kernels()
