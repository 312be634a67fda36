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
causality rules out are never visited, and blocks that need no mask skip the masking arithmetic. With
power-of-two head dims (or, with JAGGED_ATTENTION_SPLIT_HEAD=1, dims such as 96 computed as 64 + 32) the inner
loops read their blocks through tensor descriptors (TMA), which keeps per-element addresses out of the registers.
FP8 (e4m3) inputs run the forward only: QK^T in FP8, the weights times V in fp16, the per-tensor factors applied to
the scores' scale and to the output.

Contract: kernels.jagged_attention.jagged_attention. Launches need CUDA or TRITON_INTERPRET=1 set before this
module is imported. Known gap: on the descriptor path, a block past a sequence's end holds the next sequence's
rows, kept out of results by zero weights; a NaN or Inf there still reaches the sequence before it (zero times
NaN), so a non-finite input is confined to its batch, not to its sequence (finite inputs never mix;
JAGGED_ATTENTION_TMA=0, pointer loads, confines it). Zeroing those rows in registers cost 6% of the forward
and a third of the backward (benchmarks/README.md, jagged attention, tried and dropped).
"""

from __future__ import annotations

import collections
import functools
import os

import torch
import triton
import triton.language as tl
import triton.testing
from triton.tools.tensor_descriptor import TensorDescriptor

from kernels.pytorch.pt_tile_table import pt_tile_table

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn)  # FP8: forward only
LOG2E = 1.4426950408889634
# Scores of invalid positions get this added: exp2 of it is exactly 0, and it stays finite.
NEG_LARGE = -1.0e30
# The logsumexp stored for a query that sees no key: every recomputed probability of it is 0.
EMPTY_ROW_LSE = 1.0e30
# Persistent programs launched per multiprocessor: those that do not fit resident wait for a slot, and
# as each walks an equal share of the heaviest-first item list, more programs only even out the tail.
PROGRAMS_PER_SM = 4
# Tile slots times sequences up to which the tile lists are built by counting (one launch) rather than sorting.
# The interpreter runs the counting kernel one program at a time (seconds per build), so there the sort builds
# them unless a test asks for the count.
MAX_COUNTED_PAIRS = 0 if INTERPRETING else 1 << 24


def _configs(shapes: list[tuple], tile_name: str, inner_name: str, pre_hook=None) -> list[triton.Config]:
    """Configs from (tile block, inner block, warps, stages[, extra constexprs])."""
    return [triton.Config({tile_name: t, inner_name: i, **(extra[0] if extra else {})}, num_warps=w, num_stages=s,
                          pre_hook=pre_hook) for t, i, w, s, *extra in shapes]


def _block_shapes(*descriptors: tuple[str, str, str]):
    """A config pre-hook: each descriptor argument's block is (its config block size, its head dim), or its config
    block size alone for the one-dimensional query statistics (head dim None)."""

    def hook(nargs: dict) -> None:
        for name, rows, cols in descriptors:
            if isinstance(nargs[name], TensorDescriptor):
                nargs[name].block_shape = [nargs[rows]] if cols is None else [nargs[rows], nargs[cols]]

    return hook


# (the *b_desc ones read a head dim's second column part, _dim_parts)
_KV_DESCRIPTORS = (("k_desc", "BLOCK_N", "D_PAD"), ("v_desc", "BLOCK_N", "DV_PAD"), ("kb_desc", "BLOCK_N", "D_B"),
                   ("vb_desc", "BLOCK_N", "DV_B"))
_Q_DESCRIPTORS = (("q_desc", "BLOCK_M", "D_PAD"), ("do_desc", "BLOCK_M", "DV_PAD"), ("qb_desc", "BLOCK_M", "D_B"),
                  ("dob_desc", "BLOCK_M", "DV_B"), ("dq_desc", "BLOCK_M", "D_PAD"),
                  ("stats_desc", "BLOCK_M", None))
_KV_BLOCKS = _block_shapes(*_KV_DESCRIPTORS)
_Q_BLOCKS = _block_shapes(*_Q_DESCRIPTORS)


# (tile block, inner block, warps, stages). Under the interpreter one small config keeps tests fast and
# still spreads a sequence over several blocks.
if INTERPRETING:
    _FWD_CONFIGS = _configs([(16, 32, 4, 1)], "BLOCK_M", "BLOCK_N", _KV_BLOCKS)
    _DQ_CONFIGS = _configs([(32, 16, 4, 1)], "BLOCK_M", "BLOCK_N", _KV_BLOCKS)
    _DKDV_CONFIGS = _configs([(16, 32, 4, 1)], "BLOCK_N", "BLOCK_M", _Q_BLOCKS)
    _SMALL_HEAD_CONFIGS: list[triton.Config] = []
    _LARGE_HEAD_CONFIGS: list[triton.Config] = []
    _FALLBACK_CONFIGS: list[triton.Config] = []
    _SHORT_QUERY_CONFIGS: list[triton.Config] = []
else:  # JAGGED_ATTENTION_AUTOTUNE=0 keeps the first config that _choose_configs allows: fewer compiles, e.g. in tests
    # The *_SMALL_HEAD configs run only for head dims up to SMALL_HEAD_DIM (_choose_configs): there one
    # warpgroup per program, two programs per multiprocessor, lets one program's softmax overlap the other's
    # matmuls. At D=128 the same shapes spill or need two programs' worth of shared memory, and lost
    # (benchmarks/results/jagged_attention_overhead_L8192.json, source commit 539d58a).
    _FWD_SMALL_HEAD = _configs([(128, 32, 4, 3)], "BLOCK_M", "BLOCK_N", _KV_BLOCKS)
    _DQ_SMALL_HEAD = _configs([(64, 32, 4, 3), (128, 32, 4, 5), (128, 64, 4, 4)], "BLOCK_M", "BLOCK_N", _KV_BLOCKS)
    _DKDV_SMALL_HEAD = _configs([(64, 64, 4, 5), (128, 64, 4, 4)], "BLOCK_N", "BLOCK_M", _Q_BLOCKS)
    # The *_LARGE_HEAD configs alone run for head dims above LARGE_HEAD_DIM (padded to 256): there the shapes
    # above need up to 396 KB of shared memory (the H200 has 227 KB), so these take two stages, or a smaller
    # inner block, and 8 warps where the dk/dv accumulators need them (4 spill kilobytes). Their tile blocks
    # (64, 128) are those of the lists above, so the tile lists need no other block size.
    _FWD_LARGE_HEAD = _configs([(128, 64, 8, 2), (64, 64, 4, 2)], "BLOCK_M", "BLOCK_N", _KV_BLOCKS)
    _DQ_LARGE_HEAD = _configs([(128, 32, 8, 2), (64, 64, 8, 2)], "BLOCK_M", "BLOCK_N", _KV_BLOCKS)
    _DKDV_LARGE_HEAD = _configs([(64, 64, 8, 2), (64, 32, 8, 3)], "BLOCK_N", "BLOCK_M", _Q_BLOCKS)
    # The smallest footprint, for when no config of a head dim's own list fits (fp32 inputs at large head dims,
    # GPUs with less shared memory than Hopper's).
    _FWD_FALLBACK = _configs([(64, 32, 4, 2)], "BLOCK_M", "BLOCK_N", _KV_BLOCKS)
    _DQ_FALLBACK = _configs([(64, 16, 8, 2)], "BLOCK_M", "BLOCK_N", _KV_BLOCKS)
    _DKDV_FALLBACK = _configs([(64, 16, 8, 2)], "BLOCK_N", "BLOCK_M", _Q_BLOCKS)
    # The *_SHORT_QUERY configs alone run for calls whose sequences hold SHORT_QUERY_LEN queries or fewer on average
    # (a candidate's cross attention over its history, short branches): query blocks of 16 rows, where 64 or 128
    # were 1-3% real rows. Their tiles of 16 queries are built only for such calls (_parts_of).
    _FWD_SHORT_QUERY = _configs([(16, 32, 4, 3), (16, 64, 4, 3), (16, 64, 4, 2), (16, 128, 4, 2)], "BLOCK_M",
                                "BLOCK_N", _KV_BLOCKS)
    _DQ_SHORT_QUERY = _configs([(16, 32, 4, 3), (16, 64, 4, 3), (16, 64, 4, 2), (16, 128, 4, 2)], "BLOCK_M",
                               "BLOCK_N", _KV_BLOCKS)
    _DKDV_SHORT_QUERY = _configs([(64, 16, 4, 3), (64, 16, 4, 2), (64, 16, 8, 3), (128, 16, 8, 3)], "BLOCK_N",
                                 "BLOCK_M", _Q_BLOCKS)
    _FWD_CONFIGS = _configs([(128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (64, 64, 4, 3)], "BLOCK_M", "BLOCK_N",
                            _KV_BLOCKS) + _FWD_SMALL_HEAD + _FWD_LARGE_HEAD + _FWD_FALLBACK + _FWD_SHORT_QUERY
    _DQ_CONFIGS = _configs([(128, 64, 8, 3), (64, 64, 4, 3), (128, 32, 4, 4), (128, 128, 8, 2), (64, 128, 4, 2)],
                           "BLOCK_M", "BLOCK_N", _KV_BLOCKS) + _DQ_SMALL_HEAD + _DQ_LARGE_HEAD + _DQ_FALLBACK \
        + _DQ_SHORT_QUERY
    _DKDV_CONFIGS = _configs([(128, 64, 8, 3), (64, 64, 8, 3), (64, 64, 4, 3), (128, 64, 8, 2), (128, 128, 8, 2),
                              (128, 64, 8, 4), (64, 64, 4, 4)], "BLOCK_N", "BLOCK_M", _Q_BLOCKS) + _DKDV_SMALL_HEAD \
        + _DKDV_LARGE_HEAD + _DKDV_FALLBACK + _DKDV_SHORT_QUERY
    _SMALL_HEAD_CONFIGS = _FWD_SMALL_HEAD + _DQ_SMALL_HEAD + _DKDV_SMALL_HEAD
    _LARGE_HEAD_CONFIGS = _FWD_LARGE_HEAD + _DQ_LARGE_HEAD + _DKDV_LARGE_HEAD
    _FALLBACK_CONFIGS = _FWD_FALLBACK + _DQ_FALLBACK + _DKDV_FALLBACK
    _SHORT_QUERY_CONFIGS = _FWD_SHORT_QUERY + _DQ_SHORT_QUERY + _DKDV_SHORT_QUERY

AUTOTUNE = os.environ.get("JAGGED_ATTENTION_AUTOTUNE") != "0"
SMALL_HEAD_DIM = 64
LARGE_HEAD_DIM = 128  # padded head dims above this take the *_LARGE_HEAD configs
MAX_HEAD_DIM = 256  # head and value dims the kernels serve (those below 16 padded to 16)
SHORT_QUERY_LEN = 16  # calls with at most this many queries per sequence on average take the *_SHORT_QUERY configs


def shared_memory_bytes(kernel: str, config: triton.Config, d_pad: int, dv_pad: int, dtype: torch.dtype,
                        atomic_dq: bool = False) -> int:
    """Shared memory one program of `kernel` ("forward", "dq", "dkdv") needs with `config` on Hopper: `num_stages`
    buffers of each block its inner loop loads (K and V; Q and dO for dk/dv), the blocks it holds across the loop
    (Q; Q and dO for dq; K and V for dk/dv), dk/dv's per-stage statistics, the FP8 forward's V in fp16, dk/dv's
    fp32 dq block, dS^T and a layout change's scratch when it adds dq (atomic_dq), and 1 KB of barriers. An upper
    bound of what the compiler allots with tensor descriptors (tests compile every chosen config for sm_90a and
    compare); pointer loads (head dims that are not powers of two) take less."""
    tile, inner = (config.kwargs["BLOCK_N"], config.kwargs["BLOCK_M"]) if kernel == "dkdv" else \
        (config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"])
    element = dtype.itemsize
    loop = config.num_stages * inner * (d_pad + dv_pad) * element
    held = tile * (d_pad if kernel == "forward" else d_pad + dv_pad) * element
    stats = config.num_stages * inner * 8 if kernel == "dkdv" else 0
    fp16_v = inner * dv_pad * 2 if dtype == torch.float8_e4m3fn else 0
    add_dq = inner * d_pad * 4 + tile * inner * 2 + 128 * d_pad if atomic_dq and kernel == "dkdv" else 0
    return loop + held + stats + fp16_v + add_dq + 1024


def _choose_configs(kernel: str, configs: list[triton.Config], d_pad: int, dv_pad: int, dtype: torch.dtype,
                    shared_limit: int, atomic_dq: bool = False, short_queries: bool = False) -> list[triton.Config]:
    """The configs worth timing for these padded dims, among those whose shared memory fits `shared_limit`: the
    head dim's own list (small, tuned or large heads; short-query ones for calls of few queries per sequence,
    except in FP8); if none of it fits, the fitting config with the least shared memory; a list holding none of
    the head dim's own (as a test sets one config at a time) is taken whole. ValueError when nothing fits.
    Without autotuning, the first one."""
    dim = max(d_pad, dv_pad)
    short = short_queries and dtype != torch.float8_e4m3fn

    def own(c: triton.Config) -> bool:
        if any(c is x for x in _FALLBACK_CONFIGS):
            return False
        if any(c is x for x in _SHORT_QUERY_CONFIGS):
            # Above 128, dk and dv fit registers only in key tiles of 64 over 8 warps (4 warps spill kilobytes).
            wide = kernel == "dkdv" and dim > LARGE_HEAD_DIM
            return short and (not wide or (c.kwargs["BLOCK_N"] <= 64 and c.num_warps == 8))
        if short:
            return False
        if dim > LARGE_HEAD_DIM:
            return any(c is x for x in _LARGE_HEAD_CONFIGS)
        return not any(c is x for x in _LARGE_HEAD_CONFIGS) and (
            dim <= SMALL_HEAD_DIM or not any(c is x for x in _SMALL_HEAD_CONFIGS))

    needs = {id(c): shared_memory_bytes(kernel, c, d_pad, dv_pad, dtype, atomic_dq) for c in configs}
    fitting = [c for c in configs if needs[id(c)] <= shared_limit]
    chosen = [c for c in fitting if own(c)]
    if not chosen and any(own(c) for c in configs):
        chosen = sorted(fitting, key=lambda c: needs[id(c)])[:1]
    elif not chosen:
        chosen = fitting
    if not chosen:
        raise ValueError(
            f"jagged attention: no {kernel} kernel config fits this GPU's {shared_limit} bytes of shared memory at "
            f"head dim {d_pad}, value dim {dv_pad} (padded) in {dtype}; the least needs "
            f"{min(needs.values())} bytes. Use smaller heads or backend='pytorch'")
    return chosen if AUTOTUNE else chosen[:1]


def _pruner(kernel: str):
    """The autotuner's config filter for `kernel`: _choose_configs against the shared memory of q's device."""

    def prune(configs: list[triton.Config], nargs: dict, **kwargs) -> list[triton.Config]:
        q = nargs["q_ptr"]
        widths = kwargs["D_PAD"] + kwargs["D_B"], kwargs["DV_PAD"] + kwargs["DV_B"]  # both parts (_dim_parts)
        return _choose_configs(kernel, configs, *widths, q.dtype, _shared_memory_limit(q.device.index or 0),
                               kwargs.get("ADD_DQ", False), nargs["query_bucket"] <= SHORT_QUERY_LEN)

    return prune


@functools.lru_cache(maxsize=None)
def _shared_memory_limit(device_index: int) -> int:
    """Bytes of shared memory one program may take (opt-in maximum): what Triton checks before a launch."""
    return triton.runtime.driver.active.utils.get_device_properties(device_index)["max_shared_mem"]


_AUTOTUNE_KEY = ["HEAD_DIM", "VALUE_DIM", "D_B", "DV_B", "length_bucket", "query_bucket", "CAUSAL", "SILU", "TMA"]


# JAGGED_ATTENTION_ATOMIC_DQ=1: the dk/dv kernel also adds dS^T K into an fp32 dq with atomics
# (FlashAttention-2's split: five matmuls per block pair instead of seven, sums in a run-dependent
# order). Off by default: on the H200 the atomics cost more than the recomputation they save (the
# separate, deterministic dq kernel was 6-13% faster over the whole backward). JAGGED_ATTENTION_ATOMIC_DQ=short:
# only for calls of few queries per sequence (SHORT_QUERY_LEN), whose dq kernel reads every key and value again for
# a handful of queries; not yet timed.
ATOMIC_DQ = os.environ.get("JAGGED_ATTENTION_ATOMIC_DQ") == "1"
ATOMIC_DQ_SHORT = os.environ.get("JAGGED_ATTENTION_ATOMIC_DQ") == "short"
# Tensor descriptors (TMA on Hopper and newer): the inner loops load their blocks of K, V (forward, dq) or
# Q, dO (dk/dv) through descriptors over [tokens, heads * dim] instead of per-element pointers, and the
# atomic dq is added with one bulk TMA reduce per block instead of one atomic per element. Needs head
# dims computed unpadded, powers of two or split in two (SPLIT_HEAD; a block must not spill into the next
# head's columns), and 16-byte aligned rows; otherwise, and with JAGGED_ATTENTION_TMA=0, pointer loads. The
# interpreter runs the descriptor loads but not the reduce.
TMA = os.environ.get("JAGGED_ATTENTION_TMA") != "0"
# JAGGED_ATTENTION_SPLIT_HEAD=1: a head or value dim that is the sum of two powers of two (96 = 64 + 32, 48, 80, 160,
# 192) runs as those two column parts, each a matmul of its own width, instead of padded to the next power of two
# (128, 64, ..., 256), whose padding is a quarter to a third of the matmuls' work (_dim_parts), each part through
# a descriptor of its own (*b_desc). Off until measured.
SPLIT_HEAD = os.environ.get("JAGGED_ATTENTION_SPLIT_HEAD") == "1"


def _short_bench(kernel_call, quantiles):
    # Each config runs for tens of ms, not the default 100: enough to rank them, cheaper per new key.
    return triton.testing.do_bench(kernel_call, warmup=5, rep=25, quantiles=quantiles)


# Constants the kernels read (globals inside @triton.jit must be constexpr).
_LOG2E = tl.constexpr(LOG2E)
_NEG_LARGE = tl.constexpr(NEG_LARGE)
# The running max starts above NEG_LARGE, so an invalid score's exp2(s - m) is 0 even while a row
# has seen no valid key yet: masking needs only the subtraction.
_RUNNING_MAX_START = tl.constexpr(NEG_LARGE / 2)
_EMPTY_ROW_LSE = tl.constexpr(EMPTY_ROW_LSE)


# ---------------------------------------------------------------------------------------------------
# Tile lists


class TileTable:
    """Tiles (sequence, first row) of both directions and every block size, packed in one int32 tensor.

    `tiles` [parts, width, 2]: one row of `width` slots per (direction, block size), heaviest tile first (ties
    by sequence, then row), unused slots last. `index` [2, 9, 2] holds (first tile, tile count) of direction d
    (0: query blocks, 1: key blocks) and block size b at [d, b // 16]: each kernel reads the row of its own
    autotuned block size. Built by one kernel launch (_tile_table_kernel) from the offsets: counts stay on the
    device, and capacities (upper bounds, sum(ceil(L / b)) <= total / b + B) come from shapes, so building
    needs no device-to-host copy. The kernel counts every tile against every sequence, so past
    MAX_COUNTED_PAIRS (many short sequences) the PyTorch build, a sort in a few dozen small launches, takes
    over; it is also the kernel's oracle (kernels.pytorch.pt_tile_table).
    """

    def __init__(self, q_offsets, kv_offsets, total_q: int, total_kv: int, parts: tuple, causal: bool):
        device, num_seqs = q_offsets.device, q_offsets.numel() - 1
        self.capacity = {part: (total_q if part[0] == 0 else total_kv) // part[1] + num_seqs for part in parts}
        width = max(self.capacity.values())
        if width * num_seqs > MAX_COUNTED_PAIRS:
            self.tiles, self.index = pt_tile_table(q_offsets, kv_offsets, width, parts, causal)
            return
        self.tiles = torch.empty(len(parts), width, 2, dtype=torch.int32, device=device)
        self.index = torch.empty(2, 9, 2, dtype=torch.int32, device=device)
        _tile_table_kernel[(num_seqs, len(parts))](
            q_offsets, kv_offsets, _part_info(parts, device), self.tiles, self.index, num_seqs, len(parts), width,
            CAUSAL=causal, TILES=16, SEQS=128,
        )


@functools.lru_cache(maxsize=None)
def _part_info(parts: tuple, device: torch.device) -> torch.Tensor:
    """[parts, 3] int32 (direction, block size, its log2), copied to the device once per device."""
    rows = [(direction, size, size.bit_length() - 1) for direction, size in parts]
    return torch.tensor(rows, dtype=torch.int32, device=device).reshape(len(parts), 3)


@triton.jit
def _work_of_tiles(own, other, first_row, block, queries_major, CAUSAL: tl.constexpr):
    """Rows of the other side a tile visits (own, other: the lengths along its direction and across)."""
    if CAUSAL:
        # query rows [first_row, last) see keys < last + (Lk - Lq)
        last = tl.minimum(own, first_row + block)
        queries = tl.minimum(tl.maximum(last + other - own, 0), other)
        # key rows from first_row are seen by query rows >= first_row - (Lk - Lq)
        keys = tl.maximum(other - tl.maximum(first_row - (own - other), 0), 0)
        return tl.where(queries_major, queries, keys)
    else:
        return other + 0 * first_row


@triton.jit
def _tiles_above(own, other, count, block, shift, work, queries_major, CAUSAL: tl.constexpr):
    """How many of a sequence's `count` tiles visit more than `work` rows: along query blocks a causal tile's
    work grows with its row, along key blocks it shrinks, so the count has a closed form (block = 1 << shift:
    int32 shifts, not divisions, in the kernel's inner loop)."""
    if CAUSAL:
        past = work - other + own  # query tiles visit more than `work` rows once their last row passes this
        along_queries = tl.where(past < 0, count, tl.maximum(count - (past >> shift), 0))
        along_keys = tl.where(own > work, tl.minimum(count, (own - work + block - 1) >> shift), 0)
        above = tl.where(queries_major, along_queries, along_keys)
        return tl.where(work < 0, count, tl.where(work >= other, 0, above))
    else:
        return tl.where(other > work, count, 0)


@triton.jit
def _lengths(q_offsets_ptr, kv_offsets_ptr, seqs, num_seqs, queries):
    """Query (or key) lengths of sequences `seqs` as int32 (as the attention kernels take them), 0 past the last."""
    ok = seqs < num_seqs
    q_lens = tl.load(q_offsets_ptr + seqs + 1, mask=ok, other=0) - tl.load(q_offsets_ptr + seqs, mask=ok, other=0)
    kv_lens = tl.load(kv_offsets_ptr + seqs + 1, mask=ok, other=0) - tl.load(kv_offsets_ptr + seqs, mask=ok, other=0)
    return tl.where(queries, q_lens, kv_lens).to(tl.int32)


# Integer arguments that change with the batch: Triton would compile a variant of a kernel per value class of each
# (equal to 1, divisible by 16), and a batch that met a new class inside a training step stalled it for a compile.
# The statistics' stride and offset stay specialised: always multiples of 16 (stats_stride), one class, and the
# kernels keep the alignment they tell.
_BATCH_INTEGERS = ("num_seqs", "total_q", "total_kv")


def _batch_integers(fn) -> list[str]:
    return [name for name in _BATCH_INTEGERS if name in fn.__code__.co_varnames[:fn.__code__.co_argcount]]


def _jit(fn):
    """triton.jit with no specialisation on the batch's integers (_BATCH_INTEGERS)."""
    return triton.jit(fn, do_not_specialize=_batch_integers(fn))


@_jit
def _tile_table_kernel(q_offsets_ptr, kv_offsets_ptr, part_info_ptr, tiles_ptr, index_ptr, num_seqs, num_parts, width,
                       CAUSAL: tl.constexpr, TILES: tl.constexpr, SEQS: tl.constexpr):
    """One sequence's tiles of one part, each written straight to its slot in the heaviest-first order: its rank
    is the number of tiles (of every sequence) with more work, plus those with equal work earlier in (sequence,
    row) order, counted in closed form per sequence. No sort, no host copy. Program (0, 0) also writes `index`."""
    seq = tl.program_id(0)
    part = tl.program_id(1)
    direction = tl.load(part_info_ptr + 3 * part)
    block = tl.load(part_info_ptr + 3 * part + 1)
    shift = tl.load(part_info_ptr + 3 * part + 2)
    queries_major = direction == 0
    own = _lengths(q_offsets_ptr, kv_offsets_ptr, seq, num_seqs, queries_major)
    other = _lengths(q_offsets_ptr, kv_offsets_ptr, seq, num_seqs, not queries_major)
    count = (own + block - 1) >> shift
    for j0 in range(0, count, TILES):
        j = j0 + tl.arange(0, TILES)
        work = _work_of_tiles(own, other, j * block, block, queries_major, CAUSAL)
        rank = tl.zeros([TILES], dtype=tl.int32)
        for s0 in range(0, num_seqs, SEQS):
            seqs = s0 + tl.arange(0, SEQS)
            owns = _lengths(q_offsets_ptr, kv_offsets_ptr, seqs, num_seqs, queries_major)[None, :]
            others = _lengths(q_offsets_ptr, kv_offsets_ptr, seqs, num_seqs, not queries_major)[None, :]
            counts = (owns + block - 1) >> shift
            above = _tiles_above(owns, others, counts, block, shift, work[:, None], queries_major, CAUSAL)
            at_least = _tiles_above(owns, others, counts, block, shift, work[:, None] - 1, queries_major, CAUSAL)
            earlier = seqs[None, :] < seq
            rank += tl.sum(above + tl.where(earlier, at_least - above, 0), 1)
        # this sequence's own tiles of equal work before tile j: they form one run of consecutive tiles
        if CAUSAL:
            run_start = tl.where(queries_major,
                                 count - _tiles_above(own, other, count, block, shift, work - 1, queries_major,
                                                      CAUSAL),
                                 _tiles_above(own, other, count, block, shift, work, queries_major, CAUSAL))
        else:
            run_start = tl.zeros([TILES], dtype=tl.int32)
        rank += j - run_start
        slot = tiles_ptr + 2 * (part * width + rank)
        ok = j < count
        tl.store(slot, seq + tl.zeros([TILES], dtype=tl.int32), mask=ok)
        tl.store(slot + 1, j * block, mask=ok)
    if seq == 0 and part == 0:
        rows = tl.arange(0, 32)  # index rows: 9 * direction + block // 16, 18 of them
        firsts = tl.zeros([32], dtype=tl.int32)
        totals = tl.zeros([32], dtype=tl.int32)
        for p in range(0, num_parts):
            p_block = tl.load(part_info_ptr + 3 * p + 1)
            p_queries = tl.load(part_info_ptr + 3 * p) == 0
            blocks = tl.zeros([SEQS], dtype=tl.int32)
            for s0 in range(0, num_seqs, SEQS):
                seqs = s0 + tl.arange(0, SEQS)
                lengths = _lengths(q_offsets_ptr, kv_offsets_ptr, seqs, num_seqs, p_queries)
                blocks += (lengths + p_block - 1) >> tl.load(part_info_ptr + 3 * p + 2)
            row = tl.where(p_queries, 0, 9) + p_block // 16
            firsts = tl.where(rows == row, p * width, firsts)
            totals = tl.where(rows == row, tl.sum(blocks), totals)
        tl.store(index_ptr + 2 * rows, firsts, mask=rows < 18)
        tl.store(index_ptr + 2 * rows + 1, totals, mask=rows < 18)


class _Tiles:
    """Device offsets and tile table of one (q_offsets, kv_offsets) pair."""

    def __init__(self, q_offsets, kv_offsets, device, total_q: int, total_kv: int, parts: tuple, causal: bool):
        self.q_offsets = q_offsets.to(device=device, dtype=torch.int64).contiguous()
        self.kv_offsets = self.q_offsets if kv_offsets is q_offsets else kv_offsets.to(
            device=device, dtype=torch.int64).contiguous()
        empty = self.q_offsets.numel() <= 1 or total_q == 0
        self.table = None if empty else TileTable(self.q_offsets, self.kv_offsets, total_q, total_kv, parts, causal)


class TileCache:
    """Tile tables per offsets tensor, so that the layers of a model step and the backward share one build.

    An entry holds its offsets tensors, so their memory cannot be reused by another tensor while it is
    cached; it is valid while the caller passes those same tensor objects, unmodified (same `_version`
    and storage). Inference tensors carry no version counter and are never cached. Least recently used
    entries go first. Nothing is cached, or served from the cache, while a CUDA graph is being captured.
    """

    def __init__(self, size: int = 16):
        self.size = size
        self._entries: collections.OrderedDict = collections.OrderedDict()

    def get(self, q_offsets, kv_offsets, device, total_q, total_kv, parts, causal) -> _Tiles:
        # Inside a CUDA graph capture the build must be recorded: a replay on other offsets copied into the same
        # tensors builds their tiles on the device. A table built before the capture would be replayed stale.
        capturing = torch.device(device).type == "cuda" and torch.cuda.is_current_stream_capturing()
        if capturing or q_offsets.is_inference() or kv_offsets.is_inference():
            return _Tiles(q_offsets, kv_offsets, device, total_q, total_kv, parts, causal)
        key = (id(q_offsets), id(kv_offsets), str(device), total_q, total_kv, parts, causal)
        stamp = tuple((x._version, x.data_ptr(), x.shape, x.device, x.dtype) for x in (q_offsets, kv_offsets))
        entry = self._entries.get(key)
        if entry is not None and entry[0] is q_offsets and entry[1] is kv_offsets and entry[2] == stamp:
            self._entries.move_to_end(key)
            return entry[3]
        tiles = _Tiles(q_offsets, kv_offsets, device, total_q, total_kv, parts, causal)
        self._entries[key] = (q_offsets, kv_offsets, stamp, tiles)
        self._entries.move_to_end(key)
        while len(self._entries) > self.size:
            self._entries.popitem(last=False)
        return tiles

    def clear(self) -> None:
        self._entries.clear()


tile_cache = TileCache()


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _persistent_grid(table: TileTable, direction: int, block_name: str, num_heads: int, device: torch.device):
    """Enough programs to fill the GPU, never more than there can be (tile, head) items."""

    def grid(meta):
        items = table.capacity[(direction, meta[block_name])] * num_heads
        programs = 4 if INTERPRETING else _num_sms(device.index or 0) * PROGRAMS_PER_SM
        return (max(1, min(items, programs)),)

    return grid


# ---------------------------------------------------------------------------------------------------
# Shared device helpers


@triton.jit
def _work_item(item, num_heads, tiles_ptr, first_tile, q_offsets_ptr, kv_offsets_ptr):
    """The (tile, head) item's head, first row, its sequence's starts and lengths, and where the sequence starts
    in the backward's statistics."""
    tile = first_tile + item // num_heads
    head = item % num_heads
    seq = tl.load(tiles_ptr + 2 * tile)
    first_row = tl.load(tiles_ptr + 2 * tile + 1)
    q_start = tl.load(q_offsets_ptr + seq)
    q_len = (tl.load(q_offsets_ptr + seq + 1) - q_start).to(tl.int32)
    kv_start = tl.load(kv_offsets_ptr + seq)
    kv_len = (tl.load(kv_offsets_ptr + seq + 1) - kv_start).to(tl.int32)
    return head, first_row, q_start, q_len, kv_start, kv_len, _stats_start(q_start, seq)


@triton.jit
def _stats_start(q_start, seq):
    """Where sequence `seq`'s queries start in a head's row of the backward's statistics (see _query_stats): a
    multiple of 4, so that every block starts 16-byte aligned, as descriptor loads need."""
    return (((q_start + 3) // 4) * 4 + 4 * seq).to(tl.int32)


@triton.jit
def _load_rows(base, rows, stride, row_ok, DIM: tl.constexpr, DIM_PAD: tl.constexpr, CHECK_ROWS: tl.constexpr):
    """[rows, DIM_PAD] from a [tokens, DIM] slice; zeros past DIM and, if checked, past valid rows."""
    cols = tl.arange(0, DIM_PAD)
    ptrs = base + rows[:, None] * stride + cols[None, :]
    if CHECK_ROWS:
        if DIM == DIM_PAD:
            x = tl.load(ptrs, mask=row_ok[:, None], other=0.0)
        else:
            x = tl.load(ptrs, mask=row_ok[:, None] & (cols[None, :] < DIM), other=0.0)
    else:
        if DIM == DIM_PAD:
            x = tl.load(ptrs)
        else:
            x = tl.load(ptrs, mask=cols[None, :] < DIM, other=0.0)
    return x


@triton.jit
def _load_block(desc, base, first, row0, col0, stride, limit, DIM: tl.constexpr, DIM_PAD: tl.constexpr,
                BLOCK: tl.constexpr, CHECK_ROWS: tl.constexpr, TMA: tl.constexpr):
    """Rows [first, first + BLOCK) of one head's slice of a sequence.

    TMA: through the descriptor, at (row0 + first, col0) of [tokens, heads * dim]; rows past the sequence
    then hold the tokens that follow it (zeros past the tensor), which callers must keep out of results.
    Otherwise through pointers from `base`: zeros past DIM and, if checked, from row `limit` on.
    """
    if TMA:
        x = desc.load([row0 + first, col0])
    else:
        rows = first + tl.arange(0, BLOCK)
        x = _load_rows(base, rows, stride, rows < limit, DIM, DIM_PAD, CHECK_ROWS)
    return x


@triton.jit
def _row_stats(stats_desc, stats_ptr, stats_row, delta_offset, first, rows, row_ok, TMA: tl.constexpr):
    """Logsumexp and delta of query rows `rows` (from `first`, at stats_row + first of the flat statistics): rows
    past the sequence get an empty-row logsumexp and delta 0, so their probabilities, and what they add to dk and
    dv, are exactly 0.

    TMA: one bulk copy each; the statistics' layout keeps every block 16-byte aligned for it. Pointer loads of these
    small vectors, which Triton pipelines through cp.async and a block-wide barrier, made the dk/dv kernel 40-50%
    slower on the H200 (benchmarks/jagged_attention.py --overhead, before and after).
    """
    if TMA:
        lse = tl.where(row_ok, stats_desc.load([stats_row + first]), _EMPTY_ROW_LSE)
        delta = tl.where(row_ok, stats_desc.load([stats_row + delta_offset + first]), 0.0)
    else:
        lse = tl.load(stats_ptr + stats_row + rows, mask=row_ok, other=_EMPTY_ROW_LSE)
        delta = tl.load(stats_ptr + stats_row + delta_offset + rows, mask=row_ok, other=0.0)
    return lse, delta


@triton.jit
def _store_rows(base, x, rows, stride, row_ok, DIM: tl.constexpr, DIM_PAD: tl.constexpr):
    cols = tl.arange(0, DIM_PAD)
    tl.store(base + rows[:, None] * stride + cols[None, :], x, mask=row_ok[:, None] & (cols[None, :] < DIM))


@triton.jit
def _zero_outside(x_ptr, offsets_ptr, num_seqs, total_rows, row_width, program, programs,
                  BLOCK: tl.constexpr = 1024):
    """Zeros in the rows of a contiguous [tokens, heads, dim] output that no sequence owns (before the first
    offset, from the last on): the kernels write every other row, so outputs need no zero fill first. The
    calling kernel's `programs` programs share the rows, usually none."""
    first = tl.load(offsets_ptr).to(tl.int64) * row_width
    last = tl.load(offsets_ptr + num_seqs).to(tl.int64) * row_width
    # tl.cast, not .to: an integer argument equal to 1 arrives as a constexpr
    outside = first + (tl.cast(total_rows, tl.int64) * row_width - last)
    for start in range(program * BLOCK, outside, programs * BLOCK):
        i = start + tl.arange(0, BLOCK)
        where = tl.where(i < first, i, i - first + last)
        tl.store(x_ptr + where, tl.zeros([BLOCK], dtype=x_ptr.dtype.element_ty), mask=i < outside)


@triton.jit
def _visible_keys(m0, q_len, kv_len, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    """Key range of query block [m0, m0 + BLOCK_M): [0, unmasked) needs no mask, [unmasked, hi) does."""
    if CAUSAL:
        shift = kv_len - q_len  # query i sees keys j <= i + shift
        hi = tl.minimum(tl.maximum(tl.minimum(m0 + BLOCK_M, q_len) + shift, 0), kv_len)
        every_row_sees = tl.minimum(tl.maximum(m0 + 1 + shift, 0), kv_len)
    else:
        hi = kv_len
        every_row_sees = kv_len
    return (every_row_sees // BLOCK_N) * BLOCK_N, hi


@triton.jit
def _seeing_queries(n0, q_len, kv_len, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    """Query range of key block [n0, n0 + BLOCK_N): [lo, unmasked) needs the causal mask, [unmasked, q_len) not."""
    if CAUSAL:
        shift = kv_len - q_len
        lo = (tl.minimum(tl.maximum(n0 - shift, 0), q_len) // BLOCK_M) * BLOCK_M
        every_key_seen_from = tl.minimum(tl.maximum(n0 + BLOCK_N - 1 - shift, lo), q_len)
        unmasked = lo + tl.cdiv(every_key_seen_from - lo, BLOCK_M) * BLOCK_M
    else:
        lo = 0
        unmasked = 0
    return lo, unmasked


@triton.jit
def _visible(col_ok, cols, rows, shift, CAUSAL: tl.constexpr):
    """[rows, cols]: key inside the sequence and, when causal, not after the query."""
    if CAUSAL:
        visible = col_ok[None, :] & (cols[None, :] <= rows[:, None] + shift)
    else:
        visible = col_ok[None, :] & (rows[:, None] >= 0)
    return visible


@triton.jit
def _block_parts(a_desc, a_rest_desc, b_desc, b_rest_desc, a_base, b_base, first, row0, a_col, b_col, stride_a,
                 stride_b, limit, A_DIM: tl.constexpr, B_DIM: tl.constexpr, A_PAD: tl.constexpr,
                 B_PAD: tl.constexpr, A_REST: tl.constexpr, B_REST: tl.constexpr, BLOCK: tl.constexpr,
                 CHECK_ROWS: tl.constexpr, TMA: tl.constexpr):
    """Rows [first, first + BLOCK) of two tensors (K and V, or Q and dO), each in its column parts (_dim_parts): the
    padded first part and, where the dim has one (A_REST, B_REST > 0), the second; without it the first again."""
    a = _load_block(a_desc, a_base, first, row0, a_col, stride_a, limit, A_DIM - A_REST, A_PAD, BLOCK, CHECK_ROWS, TMA)
    b = _load_block(b_desc, b_base, first, row0, b_col, stride_b, limit, B_DIM - B_REST, B_PAD, BLOCK, CHECK_ROWS, TMA)
    a_rest, b_rest = a, b
    if A_REST > 0:
        a_rest = _load_block(a_rest_desc, a_base + A_PAD, first, row0, a_col + A_PAD, stride_a, limit, A_REST,
                             A_REST, BLOCK, CHECK_ROWS, TMA)
    if B_REST > 0:
        b_rest = _load_block(b_rest_desc, b_base + B_PAD, first, row0, b_col + B_PAD, stride_b, limit, B_REST,
                             B_REST, BLOCK, CHECK_ROWS, TMA)
    return a, a_rest, b, b_rest


@triton.jit
def _dot_t(a, a_rest, b, b_rest, SPLIT: tl.constexpr):
    """a b^T over both column parts of the shared dim."""
    out = tl.dot(a, tl.trans(b))
    if SPLIT:
        out = tl.dot(a_rest, tl.trans(b_rest), out)
    return out


# ---------------------------------------------------------------------------------------------------
# Forward


@triton.jit
def _forward_blocks(acc, acc_b, m_i, l_i, q, q_b, k_desc, v_desc, kb_desc, vb_desc, kv_row, k_col, v_col, k_base,
                    v_base, stride_kt, stride_vt, rows, lo, hi, shift, scale, inv_len, HEAD_DIM: tl.constexpr,
                    VALUE_DIM: tl.constexpr, D_PAD: tl.constexpr, DV_PAD: tl.constexpr, D_B: tl.constexpr,
                    DV_B: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
                    SILU: tl.constexpr, TMA: tl.constexpr, FP8: tl.constexpr):
    # Only the masked range can reach past the keys (hi): its mask drops the keys TMA loads from there.
    for n0 in range(lo, hi, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        col_ok = cols < hi
        k, k_b, v, v_b = _block_parts(k_desc, kb_desc, v_desc, vb_desc, k_base, v_base, n0, kv_row, k_col, v_col,
                                      stride_kt, stride_vt, hi, HEAD_DIM, VALUE_DIM, D_PAD, DV_PAD, D_B, DV_B, BLOCK_N,
                                      MASKED, TMA)
        if FP8:  # the weights meet V in fp16 (exact for e4m3 values): in FP8, weights far below 1 would flush to zero
            v = v.to(tl.float16)
            v_b = v_b.to(tl.float16)
        s = _dot_t(q, q_b, k, k_b, D_B > 0)
        if MASKED:
            visible = _visible(col_ok, cols, rows, shift, CAUSAL)
        if SILU:
            x = s * scale
            w = x * tl.sigmoid(x) * inv_len
            if MASKED:
                w = w * visible.to(tl.float32)
            acc = tl.dot(w.to(v.dtype), v, acc)
            if DV_B > 0:
                acc_b = tl.dot(w.to(v_b.dtype), v_b, acc_b)
        else:
            s = s * (scale * _LOG2E)
            if MASKED:
                s = s + tl.where(visible, 0.0, _NEG_LARGE)
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
            if DV_B > 0:
                acc_b = tl.dot(p.to(v_b.dtype), v_b, acc_b * alpha[:, None])
            m_i = m_new
    return acc, acc_b, m_i, l_i


@triton.autotune(configs=_FWD_CONFIGS, key=_AUTOTUNE_KEY, do_bench=_short_bench,
                 prune_configs_by={"early_config_prune": _pruner("forward")})
@_jit
def _forward_kernel(
    q_ptr, k_ptr, v_ptr, k_desc, v_desc, kb_desc, vb_desc, out_ptr, stats_ptr, q_offsets_ptr, kv_offsets_ptr, tiles_ptr,
    tile_index_ptr, descale_ptr, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot,
    stride_oh, stats_stride, total_q, num_seqs, num_heads, scale, length_bucket, query_bucket,
    HEAD_DIM: tl.constexpr, VALUE_DIM: tl.constexpr, D_PAD: tl.constexpr, DV_PAD: tl.constexpr, D_B: tl.constexpr,
    DV_B: tl.constexpr, CAUSAL: tl.constexpr, SILU: tl.constexpr, TMA: tl.constexpr, FP8: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    if FP8:  # real values are q * descale[0], k * descale[1], v * descale[2]
        scale = scale * tl.load(descale_ptr) * tl.load(descale_ptr + 1)
        v_descale = tl.load(descale_ptr + 2)
    first_tile = tl.load(tile_index_ptr + 2 * (BLOCK_M // 16))
    items = tl.load(tile_index_ptr + 2 * (BLOCK_M // 16) + 1) * num_heads
    for item in range(tl.program_id(0), items, tl.num_programs(0)):
        head, m0, q_start, q_len, kv_start, kv_len, stats_start = _work_item(
            item, num_heads, tiles_ptr, first_tile, q_offsets_ptr, kv_offsets_ptr)
        rows = m0 + tl.arange(0, BLOCK_M)
        row_ok = rows < q_len
        q_base = q_ptr + q_start * stride_qt + head * stride_qh
        q = _load_rows(q_base, rows, stride_qt, row_ok, HEAD_DIM - D_B, D_PAD, True)
        q_b = q
        if D_B > 0:
            q_b = _load_rows(q_base + D_PAD, rows, stride_qt, row_ok, D_B, D_B, True)
        kv_row = kv_start.to(tl.int32)
        k_base = k_ptr + kv_start * stride_kt + head * stride_kh
        v_base = v_ptr + kv_start * stride_vt + head * stride_vh
        shift = kv_len - q_len
        inv_len = 1.0 / tl.maximum(kv_len, 1).to(tl.float32)
        unmasked, hi = _visible_keys(m0, q_len, kv_len, BLOCK_M, BLOCK_N, CAUSAL)

        acc = tl.zeros([BLOCK_M, DV_PAD], dtype=tl.float32)
        acc_b = acc
        if DV_B > 0:
            acc_b = tl.zeros([BLOCK_M, DV_B], dtype=tl.float32)
        m_i = tl.full([BLOCK_M], _RUNNING_MAX_START, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc, acc_b, m_i, l_i = _forward_blocks(
            acc, acc_b, m_i, l_i, q, q_b, k_desc, v_desc, kb_desc, vb_desc, kv_row, head * HEAD_DIM, head * VALUE_DIM,
            k_base, v_base, stride_kt, stride_vt, rows, 0, unmasked, shift, scale, inv_len, HEAD_DIM, VALUE_DIM,
            D_PAD, DV_PAD, D_B, DV_B, BLOCK_N, False, CAUSAL, SILU, TMA, FP8)
        acc, acc_b, m_i, l_i = _forward_blocks(
            acc, acc_b, m_i, l_i, q, q_b, k_desc, v_desc, kb_desc, vb_desc, kv_row, head * HEAD_DIM, head * VALUE_DIM,
            k_base, v_base, stride_kt, stride_vt, rows, unmasked, hi, shift, scale, inv_len, HEAD_DIM, VALUE_DIM,
            D_PAD, DV_PAD, D_B, DV_B, BLOCK_N, True, CAUSAL, SILU, TMA, FP8)
        if not SILU:
            has_key = l_i > 0.0
            l_safe = tl.where(has_key, l_i, 1.0)
            acc = acc / l_safe[:, None]
            if DV_B > 0:
                acc_b = acc_b / l_safe[:, None]
            lse = tl.where(has_key, m_i + tl.log2(l_safe), _EMPTY_ROW_LSE)
            tl.store(stats_ptr + head * stats_stride + stats_start + rows, lse, mask=row_ok)
        if FP8:
            acc = acc * v_descale
            if DV_B > 0:
                acc_b = acc_b * v_descale
        out_base = out_ptr + q_start * stride_ot + head * stride_oh
        _store_rows(out_base, acc.to(out_ptr.dtype.element_ty), rows, stride_ot, row_ok, VALUE_DIM - DV_B, DV_PAD)
        if DV_B > 0:
            _store_rows(out_base + DV_PAD, acc_b.to(out_ptr.dtype.element_ty), rows, stride_ot, row_ok, DV_B, DV_B)
    _zero_outside(out_ptr, q_offsets_ptr, num_seqs, total_q, num_heads * VALUE_DIM, tl.program_id(0),
                  tl.num_programs(0))


# ---------------------------------------------------------------------------------------------------
# Backward: the per-query statistics both backward kernels read


@_jit
def _backward_prologue_kernel(out_ptr, do_ptr, stats_ptr, dq_ptr, dk_ptr, dv_ptr, q_offsets_ptr, kv_offsets_ptr,
                              tiles_ptr, tile_index_ptr, stride_ot, stride_oh, stride_dot, stride_doh, stats_stride,
                              delta_offset, total_q, total_kv, num_seqs, HEAD_DIM: tl.constexpr,
                              VALUE_DIM: tl.constexpr, DV_PAD: tl.constexpr, SILU: tl.constexpr,
                              ZERO_DQ: tl.constexpr, BLOCK: tl.constexpr):
    """What the backward's kernels need first. Softmax: delta = rowsum(dO * O) in fp32 of one query tile of one
    head, beside its logsumexp in the statistics (_query_stats). And zeros in the gradients' rows that no
    sequence owns (_zero_outside), so that the two kernels after it write only their own rows."""
    tile = tl.program_id(0)
    num_heads = tl.num_programs(1)
    first_tile = tl.load(tile_index_ptr + 2 * (BLOCK // 16))
    if not SILU and tile < tl.load(tile_index_ptr + 2 * (BLOCK // 16) + 1):
        head, m0, q_start, q_len, _, _, stats_start = _work_item(
            tile * num_heads + tl.program_id(1), num_heads, tiles_ptr, first_tile, q_offsets_ptr, q_offsets_ptr)
        rows = m0 + tl.arange(0, BLOCK)
        row_ok = rows < q_len
        o = _load_rows(out_ptr + q_start * stride_ot + head * stride_oh, rows, stride_ot, row_ok, VALUE_DIM, DV_PAD,
                       True)
        do = _load_rows(do_ptr + q_start * stride_dot + head * stride_doh, rows, stride_dot, row_ok, VALUE_DIM,
                        DV_PAD, True)
        delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
        tl.store(stats_ptr + head * stats_stride + stats_start + rows + delta_offset, delta, mask=row_ok)
    program = tile * num_heads + tl.program_id(1)
    programs = tl.num_programs(0) * num_heads
    if ZERO_DQ:
        _zero_outside(dq_ptr, q_offsets_ptr, num_seqs, total_q, num_heads * HEAD_DIM, program, programs)
    _zero_outside(dk_ptr, kv_offsets_ptr, num_seqs, total_kv, num_heads * HEAD_DIM, program, programs)
    _zero_outside(dv_ptr, kv_offsets_ptr, num_seqs, total_kv, num_heads * VALUE_DIM, program, programs)


# ---------------------------------------------------------------------------------------------------
# Backward: dq per query block


@triton.jit
def _dq_blocks(dq, dq_b, q, q_b, do, do_b, lse, delta, k_desc, v_desc, kb_desc, vb_desc, kv_row, k_col, v_col, k_base,
               v_base, stride_kt, stride_vt, rows, lo, hi, shift, scale, inv_len, HEAD_DIM: tl.constexpr,
               VALUE_DIM: tl.constexpr, D_PAD: tl.constexpr, DV_PAD: tl.constexpr, D_B: tl.constexpr,
               DV_B: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
               SILU: tl.constexpr, TMA: tl.constexpr):
    for n0 in range(lo, hi, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        col_ok = cols < hi
        k, k_b, v, v_b = _block_parts(k_desc, kb_desc, v_desc, vb_desc, k_base, v_base, n0, kv_row, k_col, v_col,
                                      stride_kt, stride_vt, hi, HEAD_DIM, VALUE_DIM, D_PAD, DV_PAD, D_B, DV_B, BLOCK_N,
                                      MASKED, TMA)
        s = _dot_t(q, q_b, k, k_b, D_B > 0)
        dp = _dot_t(do, do_b, v, v_b, DV_B > 0)
        if MASKED:
            visible = _visible(col_ok, cols, rows, shift, CAUSAL)
        if SILU:
            x = s * scale
            sig = tl.sigmoid(x)
            ds = dp * sig * (1.0 + x * (1.0 - sig)) * inv_len
            if MASKED:
                ds = ds * visible.to(tl.float32)
        else:
            s = s * (scale * _LOG2E)
            if MASKED:
                s = s + tl.where(visible, 0.0, _NEG_LARGE)
            p = tl.exp2(s - lse[:, None])
            ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq)
        if D_B > 0:
            dq_b = tl.dot(ds.to(k_b.dtype), k_b, dq_b)
    return dq, dq_b


@triton.autotune(configs=_DQ_CONFIGS, key=_AUTOTUNE_KEY, do_bench=_short_bench,
                 prune_configs_by={"early_config_prune": _pruner("dq")})
@_jit
def _dq_kernel(
    q_ptr, k_ptr, v_ptr, k_desc, v_desc, kb_desc, vb_desc, do_ptr, stats_ptr, dq_ptr, q_offsets_ptr, kv_offsets_ptr,
    tiles_ptr, tile_index_ptr, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
    stride_dqt, stride_dqh, stats_stride, delta_offset, num_heads, scale, length_bucket, query_bucket,
    HEAD_DIM: tl.constexpr, VALUE_DIM: tl.constexpr, D_PAD: tl.constexpr, DV_PAD: tl.constexpr, D_B: tl.constexpr,
    DV_B: tl.constexpr, CAUSAL: tl.constexpr, SILU: tl.constexpr, TMA: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    first_tile = tl.load(tile_index_ptr + 2 * (BLOCK_M // 16))
    items = tl.load(tile_index_ptr + 2 * (BLOCK_M // 16) + 1) * num_heads
    for item in range(tl.program_id(0), items, tl.num_programs(0)):
        head, m0, q_start, q_len, kv_start, kv_len, stats_start = _work_item(
            item, num_heads, tiles_ptr, first_tile, q_offsets_ptr, kv_offsets_ptr)
        rows = m0 + tl.arange(0, BLOCK_M)
        row_ok = rows < q_len
        q_base = q_ptr + q_start * stride_qt + head * stride_qh
        q = _load_rows(q_base, rows, stride_qt, row_ok, HEAD_DIM - D_B, D_PAD, True)
        q_b = q
        if D_B > 0:
            q_b = _load_rows(q_base + D_PAD, rows, stride_qt, row_ok, D_B, D_B, True)
        kv_row = kv_start.to(tl.int32)
        do_base = do_ptr + q_start * stride_dot + head * stride_doh
        do = _load_rows(do_base, rows, stride_dot, row_ok, VALUE_DIM - DV_B, DV_PAD, True)
        do_b = do
        if DV_B > 0:
            do_b = _load_rows(do_base + DV_PAD, rows, stride_dot, row_ok, DV_B, DV_B, True)
        if SILU:
            lse = tl.zeros([BLOCK_M], dtype=tl.float32)
            delta = lse
        else:
            stats = stats_ptr + head * stats_stride + stats_start + rows
            lse = tl.load(stats, mask=row_ok, other=_EMPTY_ROW_LSE)
            delta = tl.load(stats + delta_offset, mask=row_ok, other=0.0)
        k_base = k_ptr + kv_start * stride_kt + head * stride_kh
        v_base = v_ptr + kv_start * stride_vt + head * stride_vh
        shift = kv_len - q_len
        inv_len = 1.0 / tl.maximum(kv_len, 1).to(tl.float32)
        unmasked, hi = _visible_keys(m0, q_len, kv_len, BLOCK_M, BLOCK_N, CAUSAL)

        dq = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
        dq_b = dq
        if D_B > 0:
            dq_b = tl.zeros([BLOCK_M, D_B], dtype=tl.float32)
        dq, dq_b = _dq_blocks(dq, dq_b, q, q_b, do, do_b, lse, delta, k_desc, v_desc, kb_desc, vb_desc, kv_row,
                              head * HEAD_DIM, head * VALUE_DIM, k_base, v_base, stride_kt, stride_vt, rows, 0,
                              unmasked, shift, scale, inv_len, HEAD_DIM, VALUE_DIM, D_PAD, DV_PAD, D_B, DV_B, BLOCK_N,
                              False, CAUSAL, SILU, TMA)
        dq, dq_b = _dq_blocks(dq, dq_b, q, q_b, do, do_b, lse, delta, k_desc, v_desc, kb_desc, vb_desc, kv_row,
                              head * HEAD_DIM, head * VALUE_DIM, k_base, v_base, stride_kt, stride_vt, rows, unmasked,
                              hi, shift, scale, inv_len, HEAD_DIM, VALUE_DIM, D_PAD, DV_PAD, D_B, DV_B, BLOCK_N, True,
                              CAUSAL, SILU, TMA)
        dq_base = dq_ptr + q_start * stride_dqt + head * stride_dqh
        _store_rows(dq_base, (dq * scale).to(dq_ptr.dtype.element_ty), rows, stride_dqt, row_ok, HEAD_DIM - D_B,
                    D_PAD)
        if D_B > 0:
            _store_rows(dq_base + D_PAD, (dq_b * scale).to(dq_ptr.dtype.element_ty), rows, stride_dqt, row_ok, D_B,
                        D_B)


# ---------------------------------------------------------------------------------------------------
# Backward: dk, dv per key block


@triton.jit
def _dkdv_blocks(dk, dk_b, dv, dv_b, k, k_b, v, v_b, q_desc, do_desc, qb_desc, dob_desc, dq_desc, stats_desc, q_row,
                 q_col, do_col, stats_row, delta_offset, q_base, do_base, stats_ptr, dq_base, stride_qt, stride_dot,
                 stride_dqt, cols, lo, hi, q_len, shift, scale, inv_len,
                 HEAD_DIM: tl.constexpr, VALUE_DIM: tl.constexpr, D_PAD: tl.constexpr, DV_PAD: tl.constexpr,
                 D_B: tl.constexpr, DV_B: tl.constexpr, BLOCK_M: tl.constexpr, MASKED: tl.constexpr,
                 SILU: tl.constexpr, ADD_DQ: tl.constexpr, TMA: tl.constexpr, DQ_TMA: tl.constexpr):
    # Rows past q_len get an empty-row logsumexp, so (softmax) their probabilities are 0 without a mask. Through
    # pointers they also load as zeros; through TMA they hold the next sequence's queries, which SiLU must mask.
    for m0 in range(lo, hi, BLOCK_M):
        rows = m0 + tl.arange(0, BLOCK_M)
        row_ok = rows < q_len
        q, q_b, do, do_b = _block_parts(q_desc, qb_desc, do_desc, dob_desc, q_base, do_base, m0, q_row, q_col, do_col,
                                        stride_qt, stride_dot, q_len, HEAD_DIM, VALUE_DIM, D_PAD, DV_PAD, D_B, DV_B,
                                        BLOCK_M, True, TMA)
        s_t = _dot_t(k, k_b, q, q_b, D_B > 0)  # [BLOCK_N, BLOCK_M]
        dp_t = _dot_t(v, v_b, do, do_b, DV_B > 0)
        if MASKED:
            visible = cols[:, None] <= rows[None, :] + shift
        if SILU:
            x = s_t * scale
            sig = tl.sigmoid(x)
            w_t = x * sig * inv_len
            ds_t = dp_t * sig * (1.0 + x * (1.0 - sig)) * inv_len
            if MASKED or TMA:
                keep = row_ok[None, :]
                if MASKED:
                    keep = keep & visible
                keep = keep.to(tl.float32)
                w_t = w_t * keep
                ds_t = ds_t * keep
            dv = tl.dot(w_t.to(do.dtype), do, dv)
            if DV_B > 0:
                dv_b = tl.dot(w_t.to(do_b.dtype), do_b, dv_b)
        else:
            lse, delta = _row_stats(stats_desc, stats_ptr, stats_row, delta_offset, m0, rows, row_ok, TMA)
            s_t = s_t * (scale * _LOG2E)
            if MASKED:
                s_t = s_t + tl.where(visible, 0.0, _NEG_LARGE)
            p_t = tl.exp2(s_t - lse[None, :])
            dv = tl.dot(p_t.to(do.dtype), do, dv)
            if DV_B > 0:
                dv_b = tl.dot(p_t.to(do_b.dtype), do_b, dv_b)
            ds_t = p_t * (dp_t - delta[None, :])
        ds_t = ds_t.to(q.dtype)
        dk = tl.dot(ds_t, q, dk)
        if D_B > 0:
            dk_b = tl.dot(ds_t, q_b, dk_b)
        if ADD_DQ:
            # dS^T K of this key block, added to the query rows' fp32 sums: five matmuls per block pair
            # instead of seven with a separate dq pass that recomputes S and dP.
            dq = tl.dot(tl.trans(ds_t), k) * scale
            if DQ_TMA:
                # One bulk add of the whole block. Its rows past q_len belong to the next sequence (or lie past
                # the tensor, where TMA drops them); their dS is exactly 0, so they add nothing. Key rows past
                # kv_len are zeros (pointer loads of k), so garbage dS there adds nothing either.
                dq_desc.atomic_add([q_row + m0, q_col], dq)
            else:
                dcols = tl.arange(0, D_PAD)
                tl.atomic_add(dq_base + rows[:, None] * stride_dqt + dcols[None, :], dq,
                              mask=row_ok[:, None] & (dcols[None, :] < HEAD_DIM - D_B), sem="relaxed")
                if D_B > 0:
                    dq_b = tl.dot(tl.trans(ds_t), k_b) * scale
                    dcols_b = tl.arange(0, D_B)
                    tl.atomic_add(dq_base + D_PAD + rows[:, None] * stride_dqt + dcols_b[None, :], dq_b,
                                  mask=row_ok[:, None], sem="relaxed")
    return dk, dk_b, dv, dv_b


@triton.autotune(configs=_DKDV_CONFIGS, key=[*_AUTOTUNE_KEY, "ADD_DQ", "DQ_TMA"], do_bench=_short_bench,
                 reset_to_zero=["dq_ptr"], prune_configs_by={"early_config_prune": _pruner("dkdv")})
@_jit
def _dkdv_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, q_desc, do_desc, qb_desc, dob_desc, stats_ptr, stats_desc, dk_ptr, dv_ptr, dq_ptr,
    dq_desc, q_offsets_ptr, kv_offsets_ptr, tiles_ptr, tile_index_ptr, stride_qt, stride_qh, stride_kt, stride_kh,
    stride_vt, stride_vh, stride_dot, stride_doh, stride_dkt, stride_dkh, stride_dvt, stride_dvh, stride_dqt,
    stride_dqh, stats_stride, delta_offset, num_heads, scale, length_bucket, query_bucket, HEAD_DIM: tl.constexpr,
    VALUE_DIM: tl.constexpr, D_PAD: tl.constexpr, DV_PAD: tl.constexpr, D_B: tl.constexpr, DV_B: tl.constexpr,
    CAUSAL: tl.constexpr, SILU: tl.constexpr, TMA: tl.constexpr, ADD_DQ: tl.constexpr, DQ_TMA: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    first_tile = tl.load(tile_index_ptr + 2 * (BLOCK_N // 16))
    items = tl.load(tile_index_ptr + 2 * (BLOCK_N // 16) + 1) * num_heads
    for item in range(tl.program_id(0), items, tl.num_programs(0)):
        head, n0, q_start, q_len, kv_start, kv_len, stats_start = _work_item(
            item, num_heads, tiles_ptr, first_tile, q_offsets_ptr, kv_offsets_ptr)
        cols = n0 + tl.arange(0, BLOCK_N)
        col_ok = cols < kv_len
        k_base = k_ptr + kv_start * stride_kt + head * stride_kh
        k = _load_rows(k_base, cols, stride_kt, col_ok, HEAD_DIM - D_B, D_PAD, True)
        v_base = v_ptr + kv_start * stride_vt + head * stride_vh
        v = _load_rows(v_base, cols, stride_vt, col_ok, VALUE_DIM - DV_B, DV_PAD, True)
        k_b, v_b = k, v
        if D_B > 0:  # the head dim's second part (see _dim_parts)
            k_b = _load_rows(k_base + D_PAD, cols, stride_kt, col_ok, D_B, D_B, True)
        if DV_B > 0:
            v_b = _load_rows(v_base + DV_PAD, cols, stride_vt, col_ok, DV_B, DV_B, True)
        q_base = q_ptr + q_start * stride_qt + head * stride_qh
        do_base = do_ptr + q_start * stride_dot + head * stride_doh
        dq_base = dq_ptr + q_start * stride_dqt + head * stride_dqh
        shift = kv_len - q_len
        inv_len = 1.0 / tl.maximum(kv_len, 1).to(tl.float32)
        lo, unmasked = _seeing_queries(n0, q_len, kv_len, BLOCK_M, BLOCK_N, CAUSAL)

        dk = tl.zeros([BLOCK_N, D_PAD], dtype=tl.float32)
        dv = tl.zeros([BLOCK_N, DV_PAD], dtype=tl.float32)
        dk_b, dv_b = dk, dv
        if D_B > 0:
            dk_b = tl.zeros([BLOCK_N, D_B], dtype=tl.float32)
        if DV_B > 0:
            dv_b = tl.zeros([BLOCK_N, DV_B], dtype=tl.float32)
        q_row = q_start.to(tl.int32)  # the descriptors' row of this sequence's first query
        stats_row = head * stats_stride + stats_start  # and of its first query's logsumexp in the statistics
        dk, dk_b, dv, dv_b = _dkdv_blocks(
            dk, dk_b, dv, dv_b, k, k_b, v, v_b, q_desc, do_desc, qb_desc, dob_desc, dq_desc, stats_desc, q_row,
            head * HEAD_DIM, head * VALUE_DIM, stats_row, delta_offset, q_base, do_base, stats_ptr, dq_base,
            stride_qt, stride_dot, stride_dqt, cols, lo, unmasked, q_len, shift, scale, inv_len, HEAD_DIM, VALUE_DIM,
            D_PAD, DV_PAD, D_B, DV_B, BLOCK_M, True, SILU, ADD_DQ, TMA, DQ_TMA)
        dk, dk_b, dv, dv_b = _dkdv_blocks(
            dk, dk_b, dv, dv_b, k, k_b, v, v_b, q_desc, do_desc, qb_desc, dob_desc, dq_desc, stats_desc, q_row,
            head * HEAD_DIM, head * VALUE_DIM, stats_row, delta_offset, q_base, do_base, stats_ptr, dq_base,
            stride_qt, stride_dot, stride_dqt, cols, unmasked, q_len, q_len, shift, scale, inv_len, HEAD_DIM,
            VALUE_DIM, D_PAD, DV_PAD, D_B, DV_B, BLOCK_M, False, SILU, ADD_DQ, TMA, DQ_TMA)
        dk_base = dk_ptr + kv_start * stride_dkt + head * stride_dkh
        _store_rows(dk_base, (dk * scale).to(dk_ptr.dtype.element_ty), cols, stride_dkt, col_ok, HEAD_DIM - D_B, D_PAD)
        dv_base = dv_ptr + kv_start * stride_dvt + head * stride_dvh
        _store_rows(dv_base, dv.to(dv_ptr.dtype.element_ty), cols, stride_dvt, col_ok, VALUE_DIM - DV_B, DV_PAD)
        if D_B > 0:
            _store_rows(dk_base + D_PAD, (dk_b * scale).to(dk_ptr.dtype.element_ty), cols, stride_dkt, col_ok, D_B,
                        D_B)
        if DV_B > 0:
            _store_rows(dv_base + DV_PAD, dv_b.to(dv_ptr.dtype.element_ty), cols, stride_dvt, col_ok, DV_B, DV_B)


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
        self.parts = _dim_parts(self.head_dim, smallest=32 if fp8 else 16), _dim_parts(self.value_dim)
        mean_length = max(self.total_q, self.total_kv) // max(self.num_seqs, 1)
        self.length_bucket = triton.next_power_of_2(max(mean_length, 16))
        self.stats_stride = stats_stride(self.total_q, self.num_seqs)
        self.empty = self.table is None

    def tuning_key(self, *extra) -> tuple:
        """What the autotuners key on (_AUTOTUNE_KEY and the tensors' dtypes), for _TunedLaunch: this problem's
        dims and their column parts, buckets and flags, and `extra` (the call's TMA and other flags, its tensors'
        dtypes)."""
        return (self.head_dim, self.value_dim, self.parts[0][1], self.parts[1][1], self.length_bucket,
                self.query_bucket, self.causal, self.silu,
                *(x.dtype if isinstance(x, torch.Tensor) else x for x in extra))

    def constexprs(self) -> dict:
        (d_pad, d_b), (dv_pad, dv_b) = self.parts
        return dict(HEAD_DIM=self.head_dim, VALUE_DIM=self.value_dim, D_PAD=d_pad, DV_PAD=dv_pad, D_B=d_b, DV_B=dv_b,
                    CAUSAL=self.causal, SILU=self.silu)


def stats_stride(total_q, num_seqs):
    """A head's row of the backward's statistics: every sequence padded to start at a multiple of 4 (_stats_start),
    the row to a multiple of 16 elements, so that the kernels' stride and offset arguments are of one value class
    for every batch (_BATCH_INTEGERS). (Integer arithmetic only: the compiler's symbolic sizes pass through it.)"""
    return 16 * ((total_q + 4 * num_seqs + 4 + 15) // 16)


def _parts(short_queries: bool = False) -> tuple:
    """(direction, block size) of every table the kernels may read: 0 query blocks, 1 key blocks; the short-query
    configs' blocks only for calls that may run them (a table's width, and its build, grow as its blocks shrink)."""
    return _parts_of(ATOMIC_DQ, short_queries)


@functools.lru_cache(maxsize=None)
def _parts_of(atomic_dq: bool, short_queries: bool) -> tuple:
    kernels = [(_FWD_CONFIGS, "BLOCK_M", 0), (_DKDV_CONFIGS, "BLOCK_N", 1)] + \
        ([] if atomic_dq else [(_DQ_CONFIGS, "BLOCK_M", 0)])
    parts = {(direction, c.kwargs[block]) for configs, block, direction in kernels for c in configs
             if short_queries or not any(c is x for x in _SHORT_QUERY_CONFIGS)}
    return tuple(sorted(parts))


def clear_tile_cache() -> None:
    """Forget every cached tile table (the next call builds its own, as a fresh batch would)."""
    tile_cache.clear()


def _pad(dim: int) -> int:
    return max(16, triton.next_power_of_2(dim))  # tl.dot needs power-of-two sides of at least 16


def _dim_parts(dim: int, split: bool | None = None, smallest: int = 16) -> tuple[int, int]:
    """The column parts the kernels compute a head (or value) dim in: (its padded width, 0), or with `split` (default
    SPLIT_HEAD) a dim of two powers of two of at least `smallest`, such as 96, as (64, 32): each part a matmul of its
    own width, nothing padded. (An FP8 head dim's parts are contractions of FP8 matmuls, which take 32 or more.)"""
    first = triton.next_power_of_2(dim) // 2
    rest = dim - first
    if (SPLIT_HEAD if split is None else split) and first >= smallest and rest >= smallest \
            and rest & (rest - 1) == 0 and rest < first:
        return first, rest
    return _pad(dim), 0


class _TunedLaunch:
    """Launches of an autotuned kernel. A new key runs the autotuner; later launches with that key call the
    kernel with the config it chose, directly: the autotuner's per-call bookkeeping (a key over every argument,
    the dict of all arguments its hooks take) costs tens of microseconds per launch, which short batches, whose
    kernels take little longer, pay on every step (benchmarks/jagged_attention.py --overhead, host columns)."""

    runs = 0  # autotuner runs in this process, every kernel: tuning_runs()

    def __init__(self, tuner, descriptors: tuple[tuple[str, str, str | None], ...]):
        self.tuner, self.descriptors = tuner, descriptors
        self.chosen: dict = {}

    def __call__(self, grid, key: tuple, descriptors: dict, *args, **constexprs):
        config = self.chosen.get(key)
        # (the configs may be swapped, e.g. by a test that runs each one)
        if config is None or not any(config is c for c in self.tuner.configs):
            _TunedLaunch.runs += 1
            self.tuner[grid](*args, **constexprs)
            self.chosen[key] = self.tuner.best_config
            return
        sizes = {**constexprs, **config.kwargs}
        for name, rows, cols in self.descriptors:  # what the config's pre-hook does
            if isinstance(descriptors.get(name), TensorDescriptor):
                descriptors[name].block_shape = [sizes[rows]] if cols is None else [sizes[rows], sizes[cols]]
        self.tuner.fn[grid](*args, **constexprs, **config.all_kwargs())


def tuning_runs() -> int:
    """The attention kernels' autotuner runs so far in this process (a new key's first launch each)."""
    return _TunedLaunch.runs


def compiled_variants() -> int:
    """Kernel binaries the attention's Triton functions hold in this process, every device: one per
    specialisation (dtypes, constexprs, the alignment of pointers, integers equal to 1 or divisible by 16), so a
    rise outside a tuning run is a compile (or a load from Triton's disk cache) for a new specialisation."""
    functions = [f.fn if isinstance(f, triton.runtime.Autotuner) else f for f in globals().values()
                 if isinstance(f, (triton.runtime.JITFunction, triton.runtime.Autotuner))]
    return sum(len(caches[0]) for f in functions
               for caches in getattr(f, "device_caches", {}).values())  # none interpreted


_launch_forward = _TunedLaunch(_forward_kernel, _KV_DESCRIPTORS)
_launch_dq = _TunedLaunch(_dq_kernel, _KV_DESCRIPTORS)
_launch_dkdv = _TunedLaunch(_dkdv_kernel, _Q_DESCRIPTORS)


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
        _persistent_grid(table, 0, "BLOCK_M", p.num_heads, q.device), p.tuning_key(tma, q, k, v, fp8), kv,
        q, k, v, *kv.values(), out, stats_arg, p.q_offsets, p.kv_offsets, table.tiles,
        table.index[0], descale if fp8 else stats_arg, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        v.stride(0), v.stride(1), out.stride(0), out.stride(1), p.stats_stride, p.total_q, p.num_seqs, p.num_heads,
        p.scale, p.length_bucket, p.query_bucket, TMA=tma, FP8=fp8, **p.constexprs(),
    )
    return out, stats


def _use_tma(p: _Problem, *tensors) -> bool:
    """Whether the kernels may read these [tokens, heads, dim] tensors through descriptors (see TMA): dims computed
    unpadded (powers of two, or split in two, _dim_parts), so that no block reaches into the next head."""
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
    _backward_prologue_kernel[(p.table.capacity[(0, block)], p.num_heads)](
        out, d_out, stats, dq, dk, dv, p.q_offsets, p.kv_offsets, p.table.tiles, p.table.index[0], out.stride(0),
        out.stride(1), d_out.stride(0), d_out.stride(1), p.stats_stride, stats.stride(0), p.total_q, p.total_kv,
        p.num_seqs, HEAD_DIM=p.head_dim, VALUE_DIM=p.value_dim, DV_PAD=_pad(p.value_dim), SILU=p.silu,
        ZERO_DQ=zero_dq, BLOCK=block, num_warps=4 if _pad(p.value_dim) <= LARGE_HEAD_DIM else 8,  # O, dO in registers
    )


@functools.lru_cache(maxsize=None)
def _has_tma(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) >= (9, 0)


def _backward(p: _Problem, q, k, v, out, stats, d_out):
    """dq, dk, dv; `stats` from the forward (softmax), whose delta half the prologue fills in. The kernels write
    every row of the gradients, so these need no zero fill, except dq summed atomically."""
    atomic = ATOMIC_DQ or (ATOMIC_DQ_SHORT and p.short_queries)
    if p.empty:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    # dq is summed over key blocks in fp32 when the dk/dv kernel adds into it atomically.
    dq = torch.zeros_like(q, dtype=torch.float32) if atomic else torch.empty_like(q)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
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
        _persistent_grid(table, 1, "BLOCK_N", p.num_heads, q.device), p.tuning_key(tma, q, k, v, d_out, atomic, dq_tma),
        descriptors, q, k, v, d_out, descriptors["q_desc"], descriptors["do_desc"], descriptors["qb_desc"],
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
            _persistent_grid(table, 0, "BLOCK_M", p.num_heads, q.device), p.tuning_key(tma, q, k, v, d_out), kv,
            q, k, v, *kv.values(), d_out, stats, dq, p.q_offsets, p.kv_offsets,
            table.tiles, table.index[0], q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            d_out.stride(0), d_out.stride(1), dq.stride(0), dq.stride(1), stats_stride, delta_offset, p.num_heads,
            p.scale, p.length_bucket, p.query_bucket, TMA=tma, **p.constexprs(),
        )
    return dq.to(q.dtype), dk, dv


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


def op_backward(q, k, v, out, stats, d_out, q_offsets, kv_offsets, causal, activation, scale):
    problem = _Problem(q, k, v, q_offsets, kv_offsets, causal, activation == "silu", scale)
    stats = None if problem.silu else stats.view(2, problem.num_heads, problem.stats_stride)
    return _backward(problem, q, k, v, out, stats, d_out)


def op_stats_shape(total_q, num_heads, num_seqs, activation) -> tuple:
    return (0,) if activation == "silu" else (2 * num_heads * stats_stride(total_q, num_seqs),)


def supports(q: torch.Tensor) -> bool:
    """CUDA tensors of the supported dtypes; CPU tensors too when running under the Triton interpreter."""
    return (q.is_cuda or INTERPRETING) and q.dtype in SUPPORTED_DTYPES
