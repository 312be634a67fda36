"""Triton jagged flash attention: forward and backward on values + offsets, never padded.

Work is a list of tiles (sequence, first row) built by one kernel launch on the device from the offsets,
heaviest first, so no length is read back to the host. The lists of both directions and every block
size are built in that launch and cached per offsets tensor, so the layers of a model step and
the backward share one build. Each kernel is persistent: a fixed grid of programs walks that list
round-robin over (tile, head) items, so short sequences cost neither launches nor empty programs. The
forward keeps an online softmax in fp32 and saves the base-2 logsumexp, laid out so that the dk/dv kernel
reads it through descriptors. The backward computes delta = rowsum(dO * O) in one small kernel, then
recomputes the scores in two kernels without atomics: one per key block (dk, dv), one per query block (dq)
(or, with JAGGED_ATTENTION_ATOMIC_DQ=1, the first also adds dq in fp32, one TMA reduce per block on Hopper,
and the second is skipped). The kernels write every row of their outputs, zeros in rows that no sequence
owns, so no output is zero-filled first (except the atomically summed dq). Key blocks that
causality rules out are never visited, and blocks that need no mask skip the masking arithmetic. Head dims of two
powers of two, such as 96, run as two column parts (64 + 32) rather than padded. With power-of-two head dims or
such parts the inner loops read their blocks through tensor descriptors (TMA), which keeps per-element addresses out
of the registers.
FP8 (e4m3) inputs run the forward only: QK^T in FP8, the weights times V in fp16, the per-tensor factors applied to
the scores' scale and to the output.

Contract: kernels.jagged_attention.jagged_attention. Launches need CUDA or TRITON_INTERPRET=1 set before this
module is imported. Known gap: on the descriptor path, a block past a sequence's end holds the next sequence's
rows, kept out of results by zero weights; a NaN or Inf there still reaches the sequence before it (zero times
NaN), so a non-finite input is confined to its batch, not to its sequence (finite inputs never mix;
JAGGED_ATTENTION_TMA=0, pointer loads, confines it). Zeroing those rows in registers cost 6% of the forward
and a third of the backward (benchmarks/README.md, jagged attention, tried and dropped).

This module launches the kernels (the host side, the autograd Function, the custom op's entry points). The device
code is in triton_jagged_attention_kernels, the configs and their choice by shared memory in
triton_jagged_attention_configs, the tile lists in triton_tile_table.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

from kernels.triton import triton_jagged_attention_kernels, triton_tile_table
from kernels.triton.triton_jagged_attention_configs import (AUTOTUNE, DKDV_CONFIGS, DQ_CONFIGS, FWD_CONFIGS,
                                                            INTERPRETING, KV_DESCRIPTORS, LARGE_HEAD_DIM,
                                                            MAX_HEAD_DIM, Q_DESCRIPTORS, SHORT_QUERY_CONFIGS,
                                                            SHORT_QUERY_LEN)
from kernels.triton.triton_jagged_attention_kernels import (backward_prologue_kernel, dkdv_kernel, dq_kernel,
                                                            forward_kernel)
from kernels.triton.triton_tile_table import persistent_grid, tile_cache
from kernels.triton.tuning_store import TuningStore, default_folder, kernel_identity

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn)  # FP8: forward only

# JAGGED_ATTENTION_ATOMIC_DQ=1: the dk/dv kernel also adds dS^T K into an fp32 dq with atomics
# (FlashAttention-2's split: five matmuls per block pair instead of seven, sums in a run-dependent
# order). Off by default: on the H200 the atomics cost more than the recomputation they save (the
# separate, deterministic dq kernel was 6-13% faster over the whole backward). JAGGED_ATTENTION_ATOMIC_DQ=short:
# only for calls of few queries per sequence (SHORT_QUERY_LEN), whose dq kernel reads every key and value again for
# a handful of queries: 0.98x a w0.5_L512 step's attention time on an H100 (head dim 96 padded, pointer atomics),
# 0.994x gem_gpu's (head dim 128, one TMA reduce a block): within noise, so off (benchmarks/README.md).
ATOMIC_DQ = os.environ.get("JAGGED_ATTENTION_ATOMIC_DQ") == "1"
ATOMIC_DQ_SHORT = os.environ.get("JAGGED_ATTENTION_ATOMIC_DQ") == "short"
# Tensor descriptors (TMA on Hopper and newer): the inner loops load their blocks of K, V (forward, dq) or
# Q, dO (dk/dv) through descriptors over [tokens, heads * dim] instead of per-element pointers, and the
# atomic dq is added with one bulk TMA reduce per block instead of one atomic per element. Needs head
# dims computed unpadded, powers of two or split in two (SPLIT_HEAD; a block must not spill into the next
# head's columns), and 16-byte aligned rows; otherwise, and with JAGGED_ATTENTION_TMA=0, pointer loads. The
# interpreter runs the descriptor loads but not the reduce.
TMA = os.environ.get("JAGGED_ATTENTION_TMA") != "0"
# A head or value dim that is the sum of two powers of two (96 = 64 + 32, 48, 80, 160, 192) runs as those two column
# parts, each a matmul of its own width, instead of padded to the next power of two (128, 64, ..., 256), whose
# padding is a quarter to a third of the matmuls' work (dim_parts), each part through a descriptor of its own
# (*b_desc): at head dim 96 a GEM step's attention in 0.79x the padded kernels' time (benchmarks/README.md).
# JAGGED_ATTENTION_SPLIT_HEAD=0 pads them.
SPLIT_HEAD = os.environ.get("JAGGED_ATTENTION_SPLIT_HEAD") != "0"


# ---------------------------------------------------------------------------------------------------
# Host side


class _Problem:
    """What forward and backward share: offsets on the device, dims, and the (cached) tile table."""

    def __init__(self, q, k, v, q_offsets, kv_offsets, causal: bool, silu: bool, scale: float):
        self.total_q, self.total_kv = q.shape[0], k.shape[0]
        num_seqs = q_offsets.numel() - 1
        # Autotuning is keyed on the mean sequence length (bucketed) and the mean query count: the maxima would
        # need the offsets read back to the host on every call.
        self.query_bucket = triton.next_power_of_2(max(self.total_q // max(num_seqs, 1), SHORT_QUERY_LEN))
        self.short_queries = self.query_bucket <= SHORT_QUERY_LEN
        tiles = tile_cache.get(q_offsets, kv_offsets, q.device, self.total_q, self.total_kv,
                               _parts(self.short_queries), causal)
        self.q_offsets, self.kv_offsets, self.table = tiles.q_offsets, tiles.kv_offsets, tiles.table
        self.num_seqs = num_seqs
        self.num_heads, self.head_dim, self.value_dim = q.shape[1], q.shape[2], v.shape[2]
        self.causal, self.silu, self.scale = causal, silu, scale
        fp8 = q.dtype == torch.float8_e4m3fn
        # fixed for the forward and backward
        self.parts = dim_parts(self.head_dim, smallest=32 if fp8 else 16), dim_parts(self.value_dim)
        mean_length = max(self.total_q, self.total_kv) // max(self.num_seqs, 1)
        self.length_bucket = triton.next_power_of_2(max(mean_length, 16))
        self.stats_stride = stats_stride(self.total_q, self.num_seqs)
        self.empty = self.table is None

    def tuning_key(self, tuner: triton.runtime.Autotuner, tensors: tuple, **flags) -> tuple:
        """_TunedLaunch's key for a launch of `tuner`: the values of the names its autotuner keys on (AUTOTUNE_KEY
        and the kernel's own) from this problem and the call's `flags`, and the dtypes of the call's `tensors`. A
        name neither holds is a KeyError, not a key that would reuse another problem's config."""
        named = {**self.constexprs(), "length_bucket": self.length_bucket, "query_bucket": self.query_bucket, **flags}
        return (*(named[name] for name in tuner.keys), *(x.dtype for x in tensors))

    def constexprs(self) -> dict:
        (d_pad, d_b), (dv_pad, dv_b) = self.parts
        return dict(HEAD_DIM=self.head_dim, VALUE_DIM=self.value_dim, D_PAD=d_pad, DV_PAD=dv_pad, D_B=d_b, DV_B=dv_b,
                    CAUSAL=self.causal, SILU=self.silu)


def stats_stride(total_q, num_seqs):
    """A head's row of the backward's statistics: every sequence padded to start at a multiple of 4 (_stats_start),
    the row to a multiple of 16 elements, so that the kernels' stride and offset arguments are of one value class
    for every batch (BATCH_INTEGERS). (Integer arithmetic only: the compiler's symbolic sizes pass through it.)"""
    return 16 * ((total_q + 4 * num_seqs + 4 + 15) // 16)


def _parts(short_queries: bool = False) -> tuple:
    """(direction, block size) of every table the kernels may read: 0 query blocks, 1 key blocks; the short-query
    configs' blocks only for calls that may run them (a table's width, and its build, grow as its blocks shrink)."""
    return _parts_of(ATOMIC_DQ, short_queries)


@functools.lru_cache(maxsize=None)
def _parts_of(atomic_dq: bool, short_queries: bool) -> tuple:
    kernels = [(FWD_CONFIGS, "BLOCK_M", 0), (DKDV_CONFIGS, "BLOCK_N", 1)] + \
        ([] if atomic_dq else [(DQ_CONFIGS, "BLOCK_M", 0)])
    parts = {(direction, c.kwargs[block]) for configs, block, direction in kernels for c in configs
             if short_queries or not any(c is x for x in SHORT_QUERY_CONFIGS)}
    return tuple(sorted(parts))


def clear_tile_cache() -> None:
    """Forget every cached tile table (the next call builds its own, as a fresh batch would)."""
    tile_cache.clear()


def cache_tile_tables(enabled: bool) -> None:
    """Whether calls share tile tables (layers on the same offsets, a backward and its forward). Off for steps
    replayed from Inductor's CUDA graph trees, which allow no allocation to outlive a graph's run; a replay
    launches no build anyway."""
    tile_cache.clear()
    tile_cache.enabled = enabled


def padded_dim(dim: int) -> int:
    return max(16, triton.next_power_of_2(dim))  # tl.dot needs power-of-two sides of at least 16


def computed_dim(dim: int, split: bool | None = None, smallest: int = 16) -> int:
    """The width the kernels compute a head dim at, as their pruner sees it: the sum of its column parts (dim_parts;
    smallest 32 for an FP8 head dim), 128 for 96 padded."""
    return sum(dim_parts(dim, split, smallest))


def dim_parts(dim: int, split: bool | None = None, smallest: int = 16) -> tuple[int, int]:
    """The column parts the kernels compute a head (or value) dim in: (its padded width, 0), or with `split` (default
    SPLIT_HEAD) a dim of two powers of two of at least `smallest`, such as 96, as (64, 32): each part a matmul of its
    own width, nothing padded. (An FP8 head dim's parts are contractions of FP8 matmuls, which take 32 or more.)"""
    first = triton.next_power_of_2(dim) // 2
    rest = dim - first
    if (SPLIT_HEAD if split is None else split) and first >= smallest and rest >= smallest \
            and rest & (rest - 1) == 0 and rest < first:
        return first, rest
    return padded_dim(dim), 0


class _TunedLaunch:
    """Launches of an autotuned kernel. A new key runs the autotuner; later launches with that key call the
    kernel with the config it chose, directly: the autotuner's per-call bookkeeping (a key over every argument,
    the dict of all arguments its hooks take) costs tens of microseconds per launch, which short batches, whose
    kernels take little longer, pay on every step (benchmarks/jagged_attention.py --overhead, host columns)."""

    runs = 0  # autotuner runs in this process, every kernel: tuning_runs()
    # choices of earlier processes (tuning_store); none kept without autotuning (the first config is the choice)
    store = TuningStore(default_folder() if AUTOTUNE else None)

    def __init__(self, tuner, descriptors: tuple[tuple[str, str, str | None], ...]):
        self.tuner, self.descriptors = tuner, descriptors
        self.chosen: dict = {}

    def __call__(self, grid, key: tuple, descriptors: dict, *args, **constexprs):
        config = self.chosen.get(key)
        # (the configs may be swapped, e.g. by a test that runs each one)
        if config is None or not any(config is c for c in self.tuner.configs):
            config = self._new_key(grid, key, args, constexprs)
            if config is None:  # tuned: the autotuner has launched it
                return
        sizes = {**constexprs, **config.kwargs}
        for name, rows, cols in self.descriptors:  # what the config's pre-hook does
            if isinstance(descriptors.get(name), TensorDescriptor):
                descriptors[name].block_shape = [sizes[rows]] if cols is None else [sizes[rows], sizes[cols]]
        self.tuner.fn[grid](*args, **constexprs, **config.all_kwargs())

    def _new_key(self, grid, key: tuple, args: tuple, constexprs: dict) -> triton.Config | None:
        """A new key's config from the tuning store, or None once the autotuner has tuned the key and launched the
        kernel. Tuned under the store's claim on the key: a rank that meets the key meanwhile waits for this choice."""
        store = self.store
        identity = kernel_identity(self.tuner, _device_name(args[0].device)) if store.folder else ""
        config = store.get(identity, key, self.tuner.configs)
        if config is None:
            with store.claim(identity, key):
                config = store.get(identity, key, self.tuner.configs)  # chosen by another process meanwhile?
                if config is None:
                    _TunedLaunch.runs += 1
                    self.tuner[grid](*args, **constexprs)
                    self.chosen[key] = self.tuner.best_config
                    store.put(identity, key, self.tuner.best_config)
                    return None
        self.chosen[key] = config
        return config


def tuning_runs() -> int:
    """The attention kernels' autotuner runs so far in this process (a new key's first launch each, unless its
    config came from the tuning store)."""
    return _TunedLaunch.runs


def stored_tunings_used() -> int:
    """New keys whose config came from the tuning store in this process instead of an autotuner run."""
    return _TunedLaunch.store.loaded


@functools.lru_cache(maxsize=None)
def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def compiled_variants() -> int:
    """Kernel binaries the attention's Triton functions hold in this process, every device: one per
    specialisation (dtypes, constexprs, the alignment of pointers, integers equal to 1 or divisible by 16), so a
    rise outside a tuning run is a compile (or a load from Triton's disk cache) for a new specialisation."""
    functions = [f.fn if isinstance(f, triton.runtime.Autotuner) else f
                 for module in (triton_jagged_attention_kernels, triton_tile_table) for f in vars(module).values()
                 if isinstance(f, (triton.runtime.JITFunction, triton.runtime.Autotuner))]
    return sum(len(caches[0]) for f in functions
               for caches in getattr(f, "device_caches", {}).values())  # none interpreted


_launch_forward = _TunedLaunch(forward_kernel, KV_DESCRIPTORS)
_launch_dq = _TunedLaunch(dq_kernel, KV_DESCRIPTORS)
_launch_dkdv = _TunedLaunch(dkdv_kernel, Q_DESCRIPTORS)


def chosen_configs() -> dict[str, dict[str, str]]:
    """Each kernel's config per tuning key in this process: what two runs set side by side each ran."""
    return {name: {repr(key): str(config) for key, config in launch.chosen.items()}
            for name, launch in (("forward", _launch_forward), ("dq", _launch_dq), ("dkdv", _launch_dkdv))}


def _forward(p: _Problem, q, k, v, descale=None):
    """The output and (softmax) the statistics (_query_stats) with the logsumexp filled in."""
    fp8 = q.dtype == torch.float8_e4m3fn
    out_dtype = torch.bfloat16 if fp8 else v.dtype
    stats = None if p.silu else _query_stats(p, q.device)
    if p.empty:
        return q.new_zeros(p.total_q, p.num_heads, p.value_dim, dtype=out_dtype), stats
    out = q.new_empty(p.total_q, p.num_heads, p.value_dim, dtype=out_dtype)  # the kernel writes every row
    table = p.table
    stats_arg = out if stats is None else stats  # never read when SILU
    tma = _use_tma(p, k, v)
    kv = _kv_descriptors(p, k, v, tma)
    _launch_forward(
        persistent_grid(table, 0, "BLOCK_M", p.num_heads, q.device), p.tuning_key(forward_kernel, (q, k, v), TMA=tma),
        kv,
        q, k, v, *kv.values(), out, stats_arg, p.q_offsets, p.kv_offsets, table.tiles,
        table.index[0], descale if fp8 else stats_arg, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        v.stride(0), v.stride(1), out.stride(0), out.stride(1), p.stats_stride, p.total_q, p.num_seqs, p.num_heads,
        p.scale, p.length_bucket, p.query_bucket, TMA=tma, FP8=fp8, **p.constexprs(),
    )
    return out, stats


def _use_tma(p: _Problem, *tensors) -> bool:
    """Whether the kernels may read these [tokens, heads, dim] tensors through descriptors (see TMA): dims computed
    unpadded (powers of two, or split in two, dim_parts), so that no block reaches into the next head."""
    if not TMA or sum(p.parts[0]) != p.head_dim or sum(p.parts[1]) != p.value_dim:
        return False
    if max(p.num_heads * max(p.total_q, p.total_kv), 2 * p.num_heads * p.stats_stride) >= 2**31:
        return False  # descriptor coordinates are int32
    if not INTERPRETING and not (tensors[0].is_cuda and _has_tma(tensors[0].device.index or 0)):
        return False
    return all(x.shape[0] > 0 and _rows_packed(x) and (x.stride(0) * x.element_size()) % 16 == 0
               and x.data_ptr() % 16 == 0 for x in tensors)


def _rows_packed(x: torch.Tensor) -> bool:
    """Whether each token's heads lie side by side ([tokens, heads, dim] with any token stride): what the kernels
    read, through pointers or as a [tokens, heads * dim] descriptor. The q, k and v sliced from one fused
    projection are, and need no copy."""
    return x.stride(2) == 1 and (x.stride(1) == x.shape[2] or x.shape[1] == 1)


def _packed(x: torch.Tensor) -> torch.Tensor:
    """x itself where its rows are packed and it starts 16-byte aligned, else a contiguous copy: Triton compiles a
    kernel variant per alignment of its pointer arguments, and a view that starts off the line in one batch only
    would compile one inside a training step."""
    if _rows_packed(x) and x.data_ptr() % 16 == 0:
        return x
    return x.clone(memory_format=torch.contiguous_format)


def _descriptor(x: torch.Tensor, tma: bool):
    """x [tokens, heads, dim] as a [tokens, heads * dim] descriptor (block shape set per config by the pre-hooks), or
    x itself (a pointer the kernel does not read through a descriptor) without TMA."""
    if not tma:
        return x
    width = x.shape[1] * x.shape[2]
    return TensorDescriptor(x, [x.shape[0], width], [x.stride(0), 1], [16, 16])


def _kv_descriptors(p: _Problem, k: torch.Tensor, v: torch.Tensor, tma: bool) -> dict:
    """The forward's and dq's K and V arguments, in their order: a descriptor (or the tensor) for each column part,
    the tensor itself for a second part the dims do not have."""
    return {"k_desc": _descriptor(k, tma), "v_desc": _descriptor(v, tma),
            "kb_desc": _descriptor(k, tma and p.parts[0][1] > 0), "vb_desc": _descriptor(v, tma and p.parts[1][1] > 0)}


def _flat_descriptor(x: torch.Tensor, tma: bool):
    """A contiguous x as a one-dimensional descriptor (block set per config by the pre-hooks), or x itself without
    TMA. Every block read through it must start 16-byte aligned."""
    if not tma:
        return x
    return TensorDescriptor(x, [x.numel()], [1], [16])


def _query_stats(p: _Problem, device) -> torch.Tensor:
    """[2, H, stats_stride] fp32 for each query's logsumexp (written by the forward) and delta = rowsum(dO * O)
    (by the backward prologue). Each sequence starts at a multiple of 4 (_stats_start) so that the dk/dv
    kernel can read any block of them through a descriptor (FlashAttention-3 pads its varlen statistics the same
    way); the padding is never read unmasked."""
    return torch.empty(2, p.num_heads, p.stats_stride, dtype=torch.float32, device=device)


def _backward_prologue(p: _Problem, out, d_out, stats, dq, dk, dv, zero_dq: bool) -> None:
    """delta into the statistics (softmax) and zeros in the gradients' rows outside every sequence, in one small
    launch over the query tiles."""
    block = min(size for direction, size in p.table.capacity if direction == 0)
    backward_prologue_kernel[(p.table.capacity[(0, block)], p.num_heads)](
        out, d_out, stats, dq, dk, dv, p.q_offsets, p.kv_offsets, p.table.tiles, p.table.index[0], out.stride(0),
        out.stride(1), d_out.stride(0), d_out.stride(1), dq.stride(0), dk.stride(0), dv.stride(0), p.stats_stride,
        stats.stride(0), p.total_q, p.total_kv,
        p.num_seqs, HEAD_DIM=p.head_dim, VALUE_DIM=p.value_dim, DV_PAD=padded_dim(p.value_dim), SILU=p.silu,
        ZERO_DQ=zero_dq, BLOCK=block,
        num_warps=4 if padded_dim(p.value_dim) <= LARGE_HEAD_DIM else 8,  # O, dO in registers
    )


@functools.lru_cache(maxsize=None)
def _has_tma(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) >= (9, 0)


def _backward(p: _Problem, q, k, v, out, stats, d_out, grads=None):
    """dq, dk, dv; `stats` from the forward (softmax), whose delta half the prologue fills in. The kernels write
    every row of the gradients, so these need no zero fill, except dq summed atomically. `grads`: three buffers
    to write them into instead (any token stride, each token's heads side by side: e.g. views of one packed
    gradient), returned."""
    atomic = ATOMIC_DQ or (ATOMIC_DQ_SHORT and p.short_queries)
    if grads is None:
        grads = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    if p.empty:
        for x in grads:
            x.zero_()
        return grads
    # dq is summed over key blocks in fp32 when the dk/dv kernel adds into it atomically.
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device) if atomic else grads[0]
    dk, dv = grads[1:]
    d_out = _packed(d_out)
    stats = d_out if p.silu else stats  # never read when SILU
    stats_stride, delta_offset = (0, 0) if p.silu else (p.stats_stride, stats.stride(0))
    _backward_prologue(p, out, d_out, stats, dq, dk, dv, zero_dq=not atomic)
    tma = _use_tma(p, q, k, v, d_out)
    # (the interpreter has no descriptor reduce; split dims add dq's second part through pointers)
    dq_tma = atomic and tma and not INTERPRETING and not p.parts[0][1]
    table = p.table
    # dk/dv first: autotuning it zeroes dq (reset_to_zero), which the separate dq kernel then writes.
    descriptors = {"q_desc": _descriptor(q, tma), "do_desc": _descriptor(d_out, tma),
                   "qb_desc": _descriptor(q, tma and p.parts[0][1] > 0),
                   "dob_desc": _descriptor(d_out, tma and p.parts[1][1] > 0),
                   "stats_desc": _flat_descriptor(stats, tma), "dq_desc": _descriptor(dq, dq_tma)}
    _launch_dkdv(
        persistent_grid(table, 1, "BLOCK_N", p.num_heads, q.device),
        p.tuning_key(dkdv_kernel, (q, k, v, d_out), TMA=tma, ADD_DQ=atomic, DQ_TMA=dq_tma), descriptors,
        q, k, v, d_out, descriptors["q_desc"], descriptors["do_desc"], descriptors["qb_desc"],
        descriptors["dob_desc"], stats, descriptors["stats_desc"],
        dk, dv, dq, descriptors["dq_desc"], p.q_offsets, p.kv_offsets, table.tiles, table.index[1],
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), d_out.stride(0),
        d_out.stride(1), dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1), dq.stride(0), dq.stride(1),
        stats_stride, delta_offset, p.num_heads, p.scale, p.length_bucket, p.query_bucket, TMA=tma, ADD_DQ=atomic,
        DQ_TMA=dq_tma,
        **p.constexprs(),
    )
    if not atomic:
        kv = _kv_descriptors(p, k, v, tma)
        _launch_dq(
            persistent_grid(table, 0, "BLOCK_M", p.num_heads, q.device),
            p.tuning_key(dq_kernel, (q, k, v, d_out), TMA=tma), kv,
            q, k, v, *kv.values(), d_out, stats, dq, p.q_offsets, p.kv_offsets,
            table.tiles, table.index[0], q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            d_out.stride(0), d_out.stride(1), dq.stride(0), dq.stride(1), stats_stride, delta_offset, p.num_heads,
            p.scale, p.length_bucket, p.query_bucket, TMA=tma, **p.constexprs(),
        )
    if atomic:
        grads[0].copy_(dq)
    return grads


class JaggedAttentionFunction(torch.autograd.Function):
    """Forward saves q, k, v, the output and (softmax) the statistics holding the base-2 logsumexp; backward
    recomputes scores."""

    @staticmethod
    def forward(ctx, q, k, v, q_offsets, kv_offsets, causal, activation, scale, descale=None):
        q, k, v = _packed(q), _packed(k), _packed(v)
        problem = _Problem(q, k, v, q_offsets, kv_offsets, causal, activation == "silu", scale)
        out, stats = _forward(problem, q, k, v, descale)
        ctx.save_for_backward(q, k, v, out, stats)
        ctx.problem = problem
        return out

    @staticmethod
    def backward(ctx, d_out):
        q, k, v, out, stats = ctx.saved_tensors
        dq, dk, dv = _backward(ctx.problem, q, k, v, out, stats, d_out)
        return dq, dk, dv, None, None, None, None, None, None


def triton_jagged_attention(q, k, v, q_offsets, kv_offsets, causal, activation, scale, descale=None):
    """See kernels.jagged_attention.jagged_attention for the contract (descale: [3] fp32 with FP8 inputs)."""
    _check_dims(q, v)
    return JaggedAttentionFunction.apply(q, k, v, q_offsets, kv_offsets, causal, activation, scale, descale)


def _check_dims(q, v) -> None:
    if max(q.shape[-1], v.shape[-1]) > MAX_HEAD_DIM:
        raise ValueError(f"the Triton jagged attention kernel serves head and value dims up to {MAX_HEAD_DIM} (16 to "
                         f"{MAX_HEAD_DIM}; smaller ones are padded to 16), got head dim {q.shape[-1]}, value dim "
                         f"{v.shape[-1]}: use backend='pytorch' for wider heads")


# The custom op's entry points (kernels.jagged_attention_op): the same kernels, the statistics handed over
# explicitly (an empty tensor for silu, which keeps none) and flat: a compiled step saves them for its backward,
# and a saved tensor whose strides depend on the batch's sizes ([2, H, stats_stride]) gets them fixed to the first
# batch's (torch 2.11-2.13 restride saved activations to the forward's concrete strides).
def op_forward(q, k, v, q_offsets, kv_offsets, causal, activation, scale):
    _check_dims(q, v)
    q, k, v = _packed(q), _packed(k), _packed(v)
    out, stats = _forward(_Problem(q, k, v, q_offsets, kv_offsets, causal, activation == "silu", scale), q, k, v)
    return out, q.new_empty(0, dtype=torch.float32) if stats is None else stats.view(-1)


def op_backward(q, k, v, out, stats, d_out, q_offsets, kv_offsets, causal, activation, scale, grads):
    problem = _Problem(q, k, v, q_offsets, kv_offsets, causal, activation == "silu", scale)
    stats = None if problem.silu else stats.view(2, problem.num_heads, problem.stats_stride)
    _backward(problem, q, k, v, out, stats, d_out, grads)


def op_stats_shape(total_q, num_heads, num_seqs, activation) -> tuple:
    return (0,) if activation == "silu" else (2 * num_heads * stats_stride(total_q, num_seqs),)


def supports(q: torch.Tensor) -> bool:
    """CUDA tensors of the supported dtypes; CPU tensors too when running under the Triton interpreter."""
    return (q.is_cuda or INTERPRETING) and q.dtype in SUPPORTED_DTYPES
