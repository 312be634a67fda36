"""Launch configurations of the Triton jagged attention kernels, and how one is chosen before a launch.

Each kernel has its lists of (tile block, inner block, warps, stages): a tuned list per head-dim range, one for calls
of few queries per sequence, and a smallest-footprint fallback. Before autotuning, the configs whose shared memory
(shared_memory_bytes, an upper bound of what the compiler allots on Hopper) does not fit the device are cut, so a
head dim the tuned lists cannot hold still runs, and one that nothing fits gets a clear error instead of Triton's
OutOfResources. The autotuners key on AUTOTUNE_KEY.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.testing
from triton.tools.tensor_descriptor import TensorDescriptor

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"


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


# (the *b_desc ones read a head dim's second column part, triton_jagged_attention.dim_parts)
KV_DESCRIPTORS = (("k_desc", "BLOCK_N", "D_PAD"), ("v_desc", "BLOCK_N", "DV_PAD"), ("kb_desc", "BLOCK_N", "D_B"),
                  ("vb_desc", "BLOCK_N", "DV_B"))
Q_DESCRIPTORS = (("q_desc", "BLOCK_M", "D_PAD"), ("do_desc", "BLOCK_M", "DV_PAD"), ("qb_desc", "BLOCK_M", "D_B"),
                 ("dob_desc", "BLOCK_M", "DV_B"), ("dq_desc", "BLOCK_M", "D_PAD"),
                 ("stats_desc", "BLOCK_M", None))
_KV_BLOCKS = _block_shapes(*KV_DESCRIPTORS)
_Q_BLOCKS = _block_shapes(*Q_DESCRIPTORS)


# (tile block, inner block, warps, stages). Under the interpreter one small config keeps tests fast and
# still spreads a sequence over several blocks.
if INTERPRETING:
    FWD_CONFIGS = _configs([(16, 32, 4, 1)], "BLOCK_M", "BLOCK_N", _KV_BLOCKS)
    DQ_CONFIGS = _configs([(32, 16, 4, 1)], "BLOCK_M", "BLOCK_N", _KV_BLOCKS)
    DKDV_CONFIGS = _configs([(16, 32, 4, 1)], "BLOCK_N", "BLOCK_M", _Q_BLOCKS)
    SMALL_HEAD_CONFIGS: list[triton.Config] = []
    LARGE_HEAD_CONFIGS: list[triton.Config] = []
    FALLBACK_CONFIGS: list[triton.Config] = []
    SHORT_QUERY_CONFIGS: list[triton.Config] = []
else:  # JAGGED_ATTENTION_AUTOTUNE=0 keeps the first config that choose_configs allows: fewer compiles, e.g. in tests
    # The *_SMALL_HEAD configs run only for head dims up to SMALL_HEAD_DIM (choose_configs): there one
    # warpgroup per program, two programs per multiprocessor, lets one program's softmax overlap the other's
    # matmuls. At D=128 the same shapes spill or need two programs' worth of shared memory, and lost
    # (benchmarks/results/jagged_attention_overhead_L8192.json, source commit 539d58a).
    FWD_SMALL_HEAD = _configs([(128, 32, 4, 3)], "BLOCK_M", "BLOCK_N", _KV_BLOCKS)
    DQ_SMALL_HEAD = _configs([(64, 32, 4, 3), (128, 32, 4, 5), (128, 64, 4, 4)], "BLOCK_M", "BLOCK_N", _KV_BLOCKS)
    DKDV_SMALL_HEAD = _configs([(64, 64, 4, 5), (128, 64, 4, 4)], "BLOCK_N", "BLOCK_M", _Q_BLOCKS)
    # The *_LARGE_HEAD configs alone run for head dims above LARGE_HEAD_DIM (padded to 256): there the shapes
    # above need up to 396 KB of shared memory (the H200 has 227 KB), so these take two stages, or a smaller
    # inner block, and 8 warps where the dk/dv accumulators need them (4 spill kilobytes). Their tile blocks
    # (64, 128) are those of the lists above, so the tile lists need no other block size.
    FWD_LARGE_HEAD = _configs([(128, 64, 8, 2), (64, 64, 4, 2)], "BLOCK_M", "BLOCK_N", _KV_BLOCKS)
    DQ_LARGE_HEAD = _configs([(128, 32, 8, 2), (64, 64, 8, 2)], "BLOCK_M", "BLOCK_N", _KV_BLOCKS)
    DKDV_LARGE_HEAD = _configs([(64, 64, 8, 2), (64, 32, 8, 3)], "BLOCK_N", "BLOCK_M", _Q_BLOCKS)
    # The smallest footprint, for when no config of a head dim's own list fits (fp32 inputs at large head dims,
    # GPUs with less shared memory than Hopper's).
    FWD_FALLBACK = _configs([(64, 32, 4, 2)], "BLOCK_M", "BLOCK_N", _KV_BLOCKS)
    DQ_FALLBACK = _configs([(64, 16, 8, 2)], "BLOCK_M", "BLOCK_N", _KV_BLOCKS)
    DKDV_FALLBACK = _configs([(64, 16, 8, 2)], "BLOCK_N", "BLOCK_M", _Q_BLOCKS)
    # The *_SHORT_QUERY configs alone run for calls whose sequences hold SHORT_QUERY_LEN queries or fewer on average
    # (a candidate's cross attention over its history, short branches): query blocks of 16 rows, where 64 or 128
    # were 1-3% real rows. Their tiles of 16 queries are built only for such calls (triton_jagged_attention._parts_of).
    FWD_SHORT_QUERY = _configs([(16, 32, 4, 3), (16, 64, 4, 3), (16, 64, 4, 2), (16, 128, 4, 2)], "BLOCK_M",
                               "BLOCK_N", _KV_BLOCKS)
    DQ_SHORT_QUERY = _configs([(16, 32, 4, 3), (16, 64, 4, 3), (16, 64, 4, 2), (16, 128, 4, 2)], "BLOCK_M",
                              "BLOCK_N", _KV_BLOCKS)
    DKDV_SHORT_QUERY = _configs([(64, 16, 4, 3), (64, 16, 4, 2), (64, 16, 8, 3), (128, 16, 8, 3)], "BLOCK_N",
                                "BLOCK_M", _Q_BLOCKS)
    FWD_CONFIGS = _configs([(128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (64, 64, 4, 3)], "BLOCK_M", "BLOCK_N",
                           _KV_BLOCKS) + FWD_SMALL_HEAD + FWD_LARGE_HEAD + FWD_FALLBACK + FWD_SHORT_QUERY
    DQ_CONFIGS = _configs([(128, 64, 8, 3), (64, 64, 4, 3), (128, 32, 4, 4), (128, 128, 8, 2), (64, 128, 4, 2)],
                          "BLOCK_M", "BLOCK_N", _KV_BLOCKS) + DQ_SMALL_HEAD + DQ_LARGE_HEAD + DQ_FALLBACK \
        + DQ_SHORT_QUERY
    DKDV_CONFIGS = _configs([(128, 64, 8, 3), (64, 64, 8, 3), (64, 64, 4, 3), (128, 64, 8, 2), (128, 128, 8, 2),
                             (128, 64, 8, 4), (64, 64, 4, 4)], "BLOCK_N", "BLOCK_M", _Q_BLOCKS) + DKDV_SMALL_HEAD \
        + DKDV_LARGE_HEAD + DKDV_FALLBACK + DKDV_SHORT_QUERY
    SMALL_HEAD_CONFIGS = FWD_SMALL_HEAD + DQ_SMALL_HEAD + DKDV_SMALL_HEAD
    LARGE_HEAD_CONFIGS = FWD_LARGE_HEAD + DQ_LARGE_HEAD + DKDV_LARGE_HEAD
    FALLBACK_CONFIGS = FWD_FALLBACK + DQ_FALLBACK + DKDV_FALLBACK
    SHORT_QUERY_CONFIGS = FWD_SHORT_QUERY + DQ_SHORT_QUERY + DKDV_SHORT_QUERY

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


def choose_configs(kernel: str, configs: list[triton.Config], d_pad: int, dv_pad: int, dtype: torch.dtype,
                   shared_limit: int, atomic_dq: bool = False, short_queries: bool = False) -> list[triton.Config]:
    """The configs worth timing for these padded dims, among those whose shared memory fits `shared_limit`: the
    head dim's own list (small, tuned or large heads; short-query ones for calls of few queries per sequence,
    except in FP8); if none of it fits, the fitting config with the least shared memory; a list holding none of
    the head dim's own (as a test sets one config at a time) is taken whole. ValueError when nothing fits.
    Without autotuning, the first one."""
    dim = max(d_pad, dv_pad)
    short = short_queries and dtype != torch.float8_e4m3fn

    def own(c: triton.Config) -> bool:
        if any(c is x for x in FALLBACK_CONFIGS):
            return False
        if any(c is x for x in SHORT_QUERY_CONFIGS):
            # Above 128, dk and dv fit registers only in key tiles of 64 over 8 warps (4 warps spill kilobytes).
            wide = kernel == "dkdv" and dim > LARGE_HEAD_DIM
            return short and (not wide or (c.kwargs["BLOCK_N"] <= 64 and c.num_warps == 8))
        if short:
            return False
        if dim > LARGE_HEAD_DIM:
            return any(c is x for x in LARGE_HEAD_CONFIGS)
        return not any(c is x for x in LARGE_HEAD_CONFIGS) and (
            dim <= SMALL_HEAD_DIM or not any(c is x for x in SMALL_HEAD_CONFIGS))

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


def pruner(kernel: str):
    """The autotuner's config filter for `kernel`: choose_configs against the shared memory of q's device."""

    def prune(configs: list[triton.Config], nargs: dict, **kwargs) -> list[triton.Config]:
        q = nargs["q_ptr"]
        widths = kwargs["D_PAD"] + kwargs["D_B"], kwargs["DV_PAD"] + kwargs["DV_B"]  # both parts (dim_parts)
        return choose_configs(kernel, configs, *widths, q.dtype, shared_memory_limit(q.device.index or 0),
                              kwargs.get("ADD_DQ", False), nargs["query_bucket"] <= SHORT_QUERY_LEN)

    return prune


@functools.lru_cache(maxsize=None)
def shared_memory_limit(device_index: int) -> int:
    """Bytes of shared memory one program may take (opt-in maximum): what Triton checks before a launch."""
    return triton.runtime.driver.active.utils.get_device_properties(device_index)["max_shared_mem"]


AUTOTUNE_KEY = ["HEAD_DIM", "VALUE_DIM", "D_B", "DV_B", "length_bucket", "query_bucket", "CAUSAL", "SILU", "TMA"]



def short_bench(kernel_call, quantiles):
    # Each config runs for tens of ms, not the default 100: enough to rank them, cheaper per new key.
    return triton.testing.do_bench(kernel_call, warmup=5, rep=25, quantiles=quantiles)



# Integer arguments that change with the batch: Triton would compile a variant of a kernel per value class of each
# (equal to 1, divisible by 16), and a batch that met a new class inside a training step stalled it for a compile.
# The statistics' stride and offset stay specialised: always multiples of 16 (triton_jagged_attention.stats_stride),
# one class, and the kernels keep the alignment they tell.
BATCH_INTEGERS = ("num_seqs", "total_q", "total_kv")


def _batch_integers(fn) -> list[str]:
    return [name for name in BATCH_INTEGERS if name in fn.__code__.co_varnames[:fn.__code__.co_argcount]]


def jit_unspecialised(fn):
    """triton.jit with no specialisation on the batch's integers (BATCH_INTEGERS)."""
    return triton.jit(fn, do_not_specialize=_batch_integers(fn))
