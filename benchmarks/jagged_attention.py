"""Jagged attention on the GPU: our Triton kernel against FlexAttention, padded SDPA and the reference.

FLOPs are counted on real tokens only: a sequence with Lq queries and Lk keys has P visible
(query, key) pairs, P = Lq * Lk, or the exact causal count (about half). Forward = 2 * P * H * (D + Dv)
(QK^T and PV); backward = 2.5 x forward, as FlashAttention counts it; forward + backward = 3.5 x forward.
Every method is charged the same real-token FLOPs whatever it computes on padding or masked blocks.

Methods, all bf16, self attention over one jagged batch of `--tokens` tokens (with --sweep also cross attention,
one query per sample over `--cross-tokens` keys):
  triton      kernels.triton (values + offsets), tile lists built inside the timed step (cache cleared
              first; the forward builds them once and the backward reuses them), as a model step with a
              new batch must; the counterpart of 'flex+mask'
  triton_cached
              the same with the lists built beforehand (the cache kept), as every layer after the first
              in a step sees them; the counterpart of 'flex'
  triton_padded
              with --sweep: triton_cached with head dims such as 96 padded to the next power of two
              (JAGGED_ATTENTION_SPLIT_HEAD=0) instead of computed in two column parts, at the head dims that have them
  triton_fp8  the forward on float8_e4m3fn q, k, v (per-tensor amax / 448 factors, quantized beforehand),
              lists cached; forward only (no backward in FP8), with its output's relative error against
              the bf16 kernel's on the same batch
  flex        torch.compile'd flex_attention over the concatenated batch, document mask (plus causal);
              'flex' reuses a block mask built beforehand, 'flex+mask' builds it inside the timed call,
              as training must when batches change every step
  sdpa_padded F.scaled_dot_product_attention on a [B, H, Lmax, D] batch padded beforehand (padding and
              unpadding not timed); causal uses is_causal (padded keys come after real ones), full
              attention a key-padding mask
Layout changes (padding, [T, H, D] -> [1, H, T, D]) happen before timing; gradients are taken with
respect to each method's own input layout.
  reference   kernels.pytorch (the oracle), only with --with-reference

Run on a GPU: python -m benchmarks.jagged_attention [--quick]. Writes benchmarks/results/jagged_attention.json.

--sweep (issue 23): head dims 32, 64, 96, 128, 192, 256 (H = 1024 // D); causal self attention at max length 4096
over long-tail, Zipf and uniform lengths, and cross attention of one query per sample over lognormal histories of up
to 2048 keys; ours (lists built, cached) against flex (mask prebuilt, built per call), with each ratio in the rows.
Each head dim's compiles run first in --warm-processes processes side by side (into the on-disk caches). Writes
benchmarks/results/jagged_attention_head_dims.json.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import math
import os
import time

import torch
import torch.nn.functional as F

from benchmarks.common import save
from kernels.jagged_attention import jagged_attention, quantize_fp8

METHODS = ("triton", "triton_cached", "triton_fp8", "flex", "flex+mask", "sdpa_padded")
REFERENCE = "reference"  # opt-in (--with-reference): the oracle, slow at long lengths


def long_tail_lengths(tokens: int, max_len: int, seed: int) -> list[int]:
    """One sequence of max_len, then many short ones and a few long (L = max_len * u^3), `tokens` in all."""
    g = torch.Generator().manual_seed(seed)
    return _fill([max_len], tokens, lambda: max(1, int(max_len * float(torch.rand(1, generator=g)) ** 3)))


def uniform_lengths(tokens: int, max_len: int) -> list[int]:
    return [max_len] * (tokens // max_len)


ZIPF_EXPONENT = 1.2


def zipf_lengths(tokens: int, max_len: int, seed: int) -> list[int]:
    """One sequence of max_len, then lengths L in 1..max_len with P(L) ~ L^-ZIPF_EXPONENT, `tokens` in all: most
    sequences a few tokens long, a heavy tail up to max_len."""
    g = torch.Generator().manual_seed(seed)
    weights = torch.arange(1, max_len + 1, dtype=torch.float64) ** -ZIPF_EXPONENT
    return _fill([max_len], tokens, lambda: int(torch.multinomial(weights, 1, generator=g)) + 1)


def lognormal_lengths(tokens: int, max_len: int, seed: int) -> list[int]:
    """One sequence of max_len, then exp(N(5, 1)) (median ~150, as tests/test_batch_shuffling.py's histories) capped
    at max_len, `tokens` in all."""
    g = torch.Generator().manual_seed(seed)
    return _fill([max_len], tokens, lambda: max(1, min(max_len, int(math.exp(5 + float(torch.randn(1, generator=g)))))))


def _fill(lengths: list[int], tokens: int, draw) -> list[int]:
    while sum(lengths) < tokens:
        lengths.append(min(draw(), tokens - sum(lengths)))
    return lengths


LENGTHS = {"long_tail": long_tail_lengths, "zipf": zipf_lengths, "lognormal": lognormal_lengths,
           "uniform": lambda tokens, max_len, seed: uniform_lengths(tokens, max_len)}


def visible_pairs(lengths: list[int], causal: bool, q_lengths: list[int] | None = None) -> int:
    """(query, key) pairs that attend: Lq * Lk per sequence, or with causality (aligned to the end) the keys each
    query sees. q_lengths None: self attention (Lq = Lk)."""
    if q_lengths is None:
        return sum(n * (n + 1) // 2 if causal else n * n for n in lengths)
    if not causal:
        return sum(m * n for m, n in zip(q_lengths, lengths))
    return sum(min(n, max(0, i + n - m + 1)) for m, n in zip(q_lengths, lengths) for i in range(m))


def timed(fn) -> float:
    from triton.testing import do_bench

    fn()  # compile and autotune outside the timing
    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def bench_case(lengths: list[int], heads: int, dim: int, causal: bool, methods: tuple[str, ...],
               q_lengths: list[int] | None = None, warm_only: bool = False) -> dict:
    """Median ms of forward (no grad) and forward + backward for each method on one jagged batch: self attention
    over `lengths`, or (q_lengths given) cross attention of q_lengths[b] queries over lengths[b] keys. warm_only:
    each method's forward and backward once, for their compiles, and nothing timed."""
    kv_offsets = _offsets(lengths)
    offsets = kv_offsets if q_lengths is None else _offsets(q_lengths)
    q = torch.randn(int(offsets[-1]), heads, dim, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(int(kv_offsets[-1]), heads, dim, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    runners = {
        "triton": _jagged(offsets, kv_offsets, causal, "triton", fresh_lists=True),
        "triton_cached": _jagged(offsets, kv_offsets, causal, "triton"),
        "reference": _jagged(offsets, kv_offsets, causal, "pytorch"),
        **({"sdpa_padded": _padded_sdpa(offsets, causal)} if q_lengths is None else {}),
        **_flex(q_lengths or lengths, lengths, offsets, kv_offsets, causal),
    }
    from kernels.triton.triton_jagged_attention import dim_parts

    runners["triton_padded"] = runners["triton_cached"]  # run with the head dims padded (_variant_of)
    methods = tuple(m for m in methods if m != "triton_padded" or dim_parts(dim, split=True)[1])
    if warm_only:
        for method in (m for m in methods if m != "triton_fp8"):
            prepare, call = runners[method]
            inputs = [x.requires_grad_() for x in prepare(q, k, v)]
            with kernel_variant(_variant_of(method)):
                out = call(*inputs)
                torch.autograd.grad(out, inputs, torch.randn_like(out))
        return {}
    row = {}
    for ours in (m for m in ("triton", "triton_padded") if m in methods or m == "triton"):
        try:
            with kernel_variant(_variant_of(ours)):
                row[ours] = _disagreement(runners, q, k, v)
        except Exception as e:  # flex cannot run this shape: its own rows say why
            failure = f"{type(e).__name__}: {str(e)[:300]}"
            row[ours] = {"rel_error_vs_flex": float("nan"), "check_error_vs_flex": failure}
    if "triton_fp8" in methods:
        row["triton_fp8"] = _fp8_forward(offsets, kv_offsets, causal, q, k, v)
    for method in (m for m in methods if m != "triton_fp8"):
        prepare, call = runners[method]
        inputs = [x.requires_grad_() for x in prepare(q, k, v)]  # layout changes are not timed
        try:
            with kernel_variant(_variant_of(method)):
                d_out = torch.randn_like(call(*inputs))
                with torch.no_grad():
                    forward_ms = timed(lambda: call(*inputs))
                both_ms = timed(lambda: torch.autograd.grad(call(*inputs), inputs, d_out))
            failure = {}
        except Exception as e:  # out of memory, or a method that cannot run this shape: recorded, the others go on
            forward_ms = both_ms = float("nan")
            failure = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        row.setdefault(method, {}).update(fwd_ms=forward_ms, fwd_bwd_ms=both_ms, **failure)
        inputs = d_out = None  # freed before the next method's inputs
        torch.cuda.empty_cache()
    return row


# Kernel settings timed side by side (the kernel module's switches, read at each call): the sweep's
# triton_padded rows, attention_calls.py --variants.
KERNEL_VARIANTS = {
    "default": {},
    "padded": {"SPLIT_HEAD": False},  # JAGGED_ATTENTION_SPLIT_HEAD=0
    "pointers": {"TMA": False},  # JAGGED_ATTENTION_TMA=0
    "atomic_dq_short": {"ATOMIC_DQ_SHORT": True},  # JAGGED_ATTENTION_ATOMIC_DQ=short
}


def kernel_variant(name: str):
    """The kernel module's switches set as KERNEL_VARIANTS[name] says, restored after."""
    return kernel_settings(**KERNEL_VARIANTS[name])


@contextlib.contextmanager
def kernel_settings(**settings):
    """The kernel module's switches (TMA=False, ...) set inside the block, restored after, also on an error."""
    from kernels.triton import triton_jagged_attention as kernel

    before = {key: getattr(kernel, key) for key in settings}
    for key, value in settings.items():
        setattr(kernel, key, value)
    try:
        yield
    finally:
        for key, value in before.items():
            setattr(kernel, key, value)


def _variant_of(method: str) -> str:
    return "padded" if method == "triton_padded" else "default"


def _offsets(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device="cuda")


def _disagreement(runners, q, k, v) -> dict:
    """‖triton − flex‖ / ‖flex‖ of the output and dq, dk, dv: a check of the tuned kernels at benchmark sizes."""
    d_out = torch.randn_like(q)
    ours_in = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    ours = runners["triton"][1](*ours_in)
    ours = [ours, *torch.autograd.grad(ours, ours_in, d_out)]
    prepare, call = runners["flex"]
    theirs_in = [x.requires_grad_() for x in prepare(q, k, v)]
    theirs = call(*theirs_in)
    theirs = [theirs, *torch.autograd.grad(theirs, theirs_in, d_out.transpose(0, 1)[None])]
    errors = {}
    for name, a, b in zip(("rel_error_vs_flex", "dq_rel_error_vs_flex", "dk_rel_error_vs_flex",
                           "dv_rel_error_vs_flex"), ours, theirs):
        b = b[0].transpose(0, 1).float()
        errors[name] = float((a.detach().float() - b.detach()).norm() / b.detach().norm())
    return errors


def _fp8_forward(offsets, kv_offsets, causal, q, k, v) -> dict:
    quantized, descale = quantize_fp8(q, k, v)
    with torch.no_grad():
        def call():
            return jagged_attention(*quantized, offsets, kv_offsets, causal=causal, descale=descale, backend="triton")

        forward_ms = timed(call)
        got = call().float()
        want = jagged_attention(q, k, v, offsets, kv_offsets, causal=causal, backend="triton").float()
    return {"fwd_ms": forward_ms, "fwd_bwd_ms": float("nan"),
            "fp8_rel_error_vs_bf16": float((got - want).norm() / want.norm())}


def _jagged(offsets, kv_offsets, causal, backend, fresh_lists=False):
    from kernels.triton.triton_jagged_attention import clear_tile_cache

    def prepare(q, k, v):
        return [x.detach().clone() for x in (q, k, v)]

    def call(q, k, v):
        if fresh_lists:
            clear_tile_cache()
        return jagged_attention(q, k, v, offsets, kv_offsets, causal=causal, backend=backend)

    return prepare, call


def _padded_sdpa(offsets, causal):
    """[B, H, Lmax, D] padded beforehand; causal uses is_causal (padded keys come after every real one)."""
    lengths = offsets.diff()
    longest = int(lengths.max())
    position = torch.arange(longest, device=offsets.device)
    valid = position[None, :] < lengths[:, None]
    index = (offsets[:-1, None] + position[None, :]).clamp(max=int(offsets[-1]) - 1)
    key_mask = None if causal else valid[:, None, None, :]

    def prepare(q, k, v):
        return [(x[index] * valid[..., None, None]).transpose(1, 2).contiguous() for x in (q, k, v)]

    def call(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask, is_causal=causal)

    return prepare, call


def _flex(q_lengths, kv_lengths, offsets, kv_offsets, causal):
    """flex_attention over the whole batch as one [1, H, T, D] sequence with a document mask (queries and keys of
    the same sequence; with causality, keys up to the query's position aligned to the sequence's end)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    total_q, total_kv = int(offsets[-1]), int(kv_offsets[-1])
    documents = torch.arange(len(q_lengths), device=offsets.device)
    q_document = torch.repeat_interleave(documents, offsets.diff())
    kv_document = torch.repeat_interleave(documents, kv_offsets.diff())
    # a query at position i of its sequence sees keys up to i + (Lk - Lq): in batch rows, kv_idx <= q_idx + shift
    shift = None if kv_offsets is offsets else (kv_offsets[1:] - offsets[1:])[q_document]

    def mask_mod(b, h, q_idx, kv_idx):
        same = q_document[q_idx] == kv_document[kv_idx]
        if not causal:
            return same
        return same & (q_idx >= kv_idx if shift is None else kv_idx <= q_idx + shift[q_idx])

    def build_mask():
        return create_block_mask(mask_mod, 1, None, total_q, total_kv, device=offsets.device, _compile=True)

    flex = _compiled_flex(flex_attention)
    prebuilt = build_mask()

    def prepare(q, k, v):
        return [x.detach().transpose(0, 1)[None].contiguous() for x in (q, k, v)]

    return {
        "flex": (prepare, lambda q, k, v: flex(q, k, v, block_mask=prebuilt)),
        "flex+mask": (prepare, lambda q, k, v: flex(q, k, v, block_mask=build_mask())),
    }


_FLEX = None


def _compiled_flex(flex_attention):
    global _FLEX
    if _FLEX is None:
        torch._dynamo.config.cache_size_limit = 64  # one compile per shape; many shapes here
        _FLEX = torch.compile(flex_attention, dynamic=False)
    return _FLEX


def tflops(flops: float, ms: float) -> float:
    return flops / (ms * 1e-3) / 1e12 if ms == ms else float("nan")


def kernel_times(fn, reps: int = 5) -> dict[str, float]:
    """Device milliseconds per call of each kernel `fn` launches, from the profiler (after one warm call). A kernel
    launched twice in a call is listed per launch ("name #2"), when every call launches the same kernels."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    launches = sorted((e for e in prof.events() if e.device_type == DeviceType.CUDA), key=lambda e: e.time_range.start)
    per_call = len(launches) // reps
    calls = [launches[i * per_call:(i + 1) * per_call] for i in range(reps)]
    if not per_call or len(launches) % reps or any([e.name for e in c] != [e.name for e in calls[0]] for c in calls):
        return {e.key: e.device_time_total / reps / 1e3 for e in prof.key_averages() if e.device_time_total > 0}
    times: dict[str, float] = {}
    for call in calls:
        seen: collections.Counter = collections.Counter()
        for e in call:
            seen[e.name] += 1
            name = e.name if seen[e.name] == 1 else f"{e.name} #{seen[e.name]}"
            times[name] = times.get(name, 0.0) + e.time_range.elapsed_us() / reps / 1e3
    return times


def _flex_kernel_times(lengths, offsets, causal, q, k, v, d_out) -> dict[str, float]:
    """FlexAttention's kernels on the same batch (block mask prebuilt), forward and backward, for the
    comparison kernel by kernel."""
    prepare, call = _flex(lengths, lengths, offsets, offsets, causal)["flex"]
    inputs = [x.requires_grad_() for x in prepare(q, k, v)]
    grad = d_out.transpose(0, 1)[None].contiguous()
    return kernel_times(lambda: call(*inputs).backward(grad))


def overhead(tokens: int, max_lens: list[int] | None) -> None:
    """Where a call's time goes: one tile-list build vs the kernels alone (lists built beforehand); each
    kernel's share (profiled) beside FlexAttention's kernels on the same batch; the host's time per call
    against the device's (_host_times); the kernels with
    pointer loads instead of tensor descriptors (JAGGED_ATTENTION_TMA=0); and the backward with dq added
    by the dk/dv kernel (JAGGED_ATTENTION_ATOMIC_DQ=1, one TMA reduce per block) instead of a separate dq kernel."""
    from kernels.triton import triton_jagged_attention as kernel
    from kernels.triton import triton_jagged_attention_kernels as device_code
    from kernels.triton import triton_tile_table as tile_lists

    results = []
    cases = [case for case in [("uniform", 512, 128, True), ("long_tail", 512, 128, True),
                               ("long_tail", 512, 64, True), ("long_tail", 2048, 128, True),
                               ("long_tail", 8192, 128, True), ("long_tail", 8192, 64, True),
                               ("uniform", 8192, 128, False)] if not max_lens or case[1] in max_lens]
    results_name = "jagged_attention_overhead" + "".join(f"_L{n}" for n in max_lens or ())
    for mix, max_len, dim, causal in cases:
        lengths = long_tail_lengths(tokens, max_len, seed=max_len) if mix == "long_tail" else \
            uniform_lengths(tokens, max_len)
        offsets = _offsets(lengths)
        heads = 1024 // dim
        q, k, v = (torch.randn(tokens, heads, dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        d_out = torch.randn_like(q)
        scale = 1 / math.sqrt(dim)
        row = {"mix": mix, "max_len": max_len, "head_dim": dim, "causal": causal}
        for suffix, atomic, tma in [("", False, True), ("_pointer", False, False), ("_atomic_dq", True, True)]:
            with kernel_settings(ATOMIC_DQ=atomic, TMA=tma):
                kernel.clear_tile_cache()
                built = kernel._Problem(q, k, v, offsets, offsets, causal, False, scale)  # lists for this dq mode
                out, lse = kernel._forward(built, q, k, v)
                if not suffix:
                    row["tables_ms"] = timed(lambda: tile_lists._Tiles(offsets, offsets, q.device, tokens, tokens,
                                                                       kernel._parts(), causal))
                if not atomic:
                    row[f"kernel_fwd{suffix}_ms"] = timed(lambda: kernel._forward(built, q, k, v))
                row[f"kernels_bwd{suffix}_ms"] = timed(lambda: kernel._backward(built, q, k, v, out, lse, d_out))
                if not suffix:  # each kernel's share (backward prologue, dk/dv, dq), every config's time
                    row["fwd_kernel_ms"] = kernel_times(lambda: kernel._forward(built, q, k, v))
                    row["bwd_kernel_ms"] = kernel_times(lambda: kernel._backward(built, q, k, v, out, lse, d_out))
                    row["config_ms"] = {tuner.base_fn.__name__: _config_timings(tuner) for tuner in
                                        (device_code.forward_kernel, device_code.dkdv_kernel, device_code.dq_kernel)}
        row["flex_fwd_bwd_kernel_ms"] = _flex_kernel_times(lengths, offsets, causal, q, k, v, d_out)
        row["host"] = _host_times(offsets, causal, q, k, v, d_out)
        print(row, flush=True)
        results.append(row)
        # Saved after every case, so that a run cut short keeps what it measured.
        save(results_name, {"tokens": tokens, "max_lens": max_lens, "source_commit": _source_commit(),
                            "complete": len(results) == len(cases)}, results)


def _host_times(offsets, causal, q, k, v, d_out, calls: int = 20) -> dict[str, float]:
    """Host ms per call of the public API (lists cached), forward alone and forward + backward, against the
    device's ms per call back to back: where the host takes longer, short batches wait on Python, not kernels."""
    inputs = [x.detach().clone().requires_grad_() for x in (q, k, v)]

    def forward():
        with torch.no_grad():
            return jagged_attention(*inputs, offsets, causal=causal, backend="triton")

    def both():
        return torch.autograd.grad(jagged_attention(*inputs, offsets, causal=causal, backend="triton"), inputs, d_out)

    times = {}
    for name, fn in (("fwd", forward), ("fwd_bwd", both)):
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):  # the queue holds far more than this, so the host never waits on the device
            fn()
        times[f"{name}_host_ms"] = (time.perf_counter() - start) / calls * 1e3
        torch.cuda.synchronize()
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        for _ in range(calls):
            fn()
        end.record()
        torch.cuda.synchronize()
        times[f"{name}_stream_ms"] = begin.elapsed_time(end) / calls
    return times


def _config_timings(tuner) -> dict[str, float]:
    """Median ms of every config the autotuner last benchmarked (this case's key: each case is a new key)."""
    timings = getattr(tuner, "configs_timings", None) or {}
    return {_config_name(c): (t[0] if isinstance(t, (list, tuple)) else t) for c, t in timings.items()}


def _config_name(config) -> str:
    sizes = ", ".join(f"{k}={v}" for k, v in config.kwargs.items())
    return f"{sizes}, warps={config.num_warps}, stages={config.num_stages}"


def _source_commit() -> str:
    """The commit the caller says this tree is (the machine that runs it may hold no checkout)."""
    return os.environ.get("GEM_SOURCE_COMMIT") or os.environ.get("SOURCE_COMMIT", "")


SWEEP_HEAD_DIMS = (32, 64, 96, 128, 192, 256)
SWEEP_METHODS = ("triton", "triton_cached", "triton_padded", "flex", "flex+mask")


def sweep_cases(head_dims) -> list[tuple]:
    """Issue 23's cases per head dim: causal self attention at max length 4096 over long-tail, Zipf and uniform
    lengths, and cross attention of one query per sample over a lognormal history of up to 2048 keys."""
    cases = []
    for dim in head_dims:
        cases += [("self", mix, 4096, dim, True) for mix in ("long_tail", "zipf", "uniform")]
        cases.append(("cross", "lognormal", 2048, dim, False))
    return cases


def run_case(case: tuple, tokens: int, cross_tokens: int, methods: tuple[str, ...], warm_only: bool = False):
    """Result rows of one (attention, mix, max_len, head_dim, causal) case, a row per method: self attention over
    `tokens` tokens, or cross attention of one query per sample over `cross_tokens` keys; H = 1024 // D heads."""
    attention, mix, max_len, dim, causal = case
    cross = attention == "cross"
    lengths = LENGTHS[mix](cross_tokens if cross else tokens, max_len, max_len)
    q_lengths = [1] * len(lengths) if cross else None
    heads = 1024 // dim
    row = bench_case(lengths, heads, dim, causal, methods, q_lengths, warm_only)
    pairs = visible_pairs(lengths, causal, q_lengths)
    forward_flops = 2 * pairs * heads * (dim + dim)
    rows = []
    for method, t in row.items():
        rows.append({
            "attention": attention, "mix": mix, "max_len": max_len, "head_dim": dim, "heads": heads,
            "causal": causal, "sequences": len(lengths), "tokens": sum(lengths),
            "queries": sum(q_lengths or lengths), "visible_pairs": pairs, "method": method,
            "fwd_ms": t["fwd_ms"], "fwd_tflops": tflops(forward_flops, t["fwd_ms"]),
            "fwd_bwd_ms": t["fwd_bwd_ms"], "fwd_bwd_tflops": tflops(3.5 * forward_flops, t["fwd_bwd_ms"]),
            **{name: value for name, value in t.items() if name.endswith(("_vs_flex", "_vs_bf16")) or name == "error"},
            **_speedups(method, row),
        })
    return rows


def _speedups(method: str, row: dict) -> dict:
    """Our time against FlexAttention's (theirs / ours) for our bf16 methods: with its block mask prebuilt ('flex')
    and built in the call ('flex+mask')."""
    if method not in ("triton", "triton_cached", "triton_padded"):
        return {}
    out = {}
    for flex, name in (("flex", "vs_flex"), ("flex+mask", "vs_flex_mask")):
        if flex in row:
            for phase in ("fwd", "fwd_bwd"):
                out[f"{phase}_speedup_{name}"] = row[flex][f"{phase}_ms"] / row[method][f"{phase}_ms"]
    return out


def _warm(case: tuple, tokens: int, cross_tokens: int, methods: tuple[str, ...]) -> None:
    """One case's compiles and autotuning, into the on-disk caches (Triton's, Inductor's) that the timed run reads."""
    run_case(case, tokens, cross_tokens, methods, warm_only=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--quick", action="store_true", help="two cases, to check before a full run")
    parser.add_argument("--with-reference", action="store_true", help="also time the PyTorch reference")
    parser.add_argument("--overhead", action="store_true", help="split call time into tile tables and kernels")
    parser.add_argument("--max-len", type=int, action="append", dest="max_lens",
                        help="only the cases of this maximum length (repeatable); the results file is named after them")
    parser.add_argument("--sweep", action="store_true",
                        help="head dims 32-256, self and cross attention, long-tail / Zipf / uniform / lognormal "
                             "lengths, against FlexAttention with its mask prebuilt and built per call "
                             "(jagged_attention_head_dims.json)")
    parser.add_argument("--head-dims", type=int, nargs="+", help="with --sweep: only these head dims")
    parser.add_argument("--cross-tokens", type=int, default=131072,
                        help="with --sweep: keys of a cross-attention batch (one query per sample)")
    parser.add_argument("--warm-processes", type=int, default=8,
                        help="with --sweep: first compile and autotune each head dim, this many processes side by side")
    args = parser.parse_args()
    if args.overhead:
        return overhead(args.tokens, args.max_lens)

    if args.sweep:
        cases = sweep_cases(args.head_dims or SWEEP_HEAD_DIMS)
        methods = SWEEP_METHODS
        results_name = "jagged_attention_head_dims" + "".join(f"_D{d}" for d in args.head_dims or ())
        if args.warm_processes > 0:
            _warm_caches(cases, args, methods)
    else:
        # (attention, mix, max_len, head_dim, causal); the cases of the two targets first, as results are saved as
        # they come.
        cases = [("self", "long_tail", max_len, dim, True) for dim in (128, 64) for max_len in (512, 2048, 8192)]
        cases += [("self", "uniform", 8192, dim, causal) for dim in (128, 64) for causal in (False, True)]
        cases += [("self", "uniform", max_len, dim, True) for max_len in (512, 2048) for dim in (128, 64)]
        if args.quick:
            cases = [("self", "long_tail", 2048, 128, True), ("self", "uniform", 8192, 128, False)]
        if args.max_lens:
            cases = [case for case in cases if case[2] in args.max_lens]
        methods = METHODS + ((REFERENCE,) if args.with_reference else ())
        results_name = "jagged_attention" + "".join(f"_L{n}" for n in args.max_lens or ())
    settings = _settings(args, methods)
    results = []
    for case in cases:
        rows = run_case(case, args.tokens, args.cross_tokens, methods)
        results += rows
        print_rows(rows)
        save(results_name, settings | {"complete": False}, results)  # kept if a later case dies

    save(results_name, settings | {"complete": True}, results)
    print_summary(results)


def _warm_caches(cases: list[tuple], args, methods) -> None:
    """The first case of each (attention, head dim, causal), run once, `args.warm_processes` processes at a time: their
    compiles (ours and FlexAttention's, most of a new head dim's time) run side by side into the on-disk caches, which
    the timed run, one case at a time, then reads."""
    from benchmarks.common import in_processes

    firsts: dict[tuple, tuple] = {}
    for case in cases:
        firsts.setdefault((case[0], case[3], case[4]), case)
    calls = {case: (case, args.tokens, args.cross_tokens, methods) for case in firsts.values()}
    start = time.perf_counter()
    for case, _ in in_processes(_warm, calls, args.warm_processes):
        print(f"warmed {case} in {time.perf_counter() - start:.0f} s", flush=True)


def _settings(args, methods) -> dict:
    return {"tokens": args.tokens, "dtype": "bfloat16", "heads_times_dim": 1024, "quick": args.quick,
            "max_lens": args.max_lens, "sweep": args.sweep, "head_dims": args.head_dims,
            "cross_tokens": args.cross_tokens if args.sweep else None, "zipf_exponent": ZIPF_EXPONENT,
            "methods": list(methods),
            "flop_convention": "forward 4*P*H*D (P = visible real pairs, causal exact), backward 2.5x forward",
            "torch": torch.__version__, "triton": __import__("triton").__version__,
            "gpu": torch.cuda.get_device_name(), "source_commit": _source_commit()}


def print_rows(rows: list[dict]) -> None:
    for r in rows:
        print(f"{_case_name(r)} {r['method']:>13}: fwd {r['fwd_ms']:8.3f} ms {r['fwd_tflops']:6.1f} TF/s | "
              f"fwd+bwd {r['fwd_bwd_ms']:8.3f} ms {r['fwd_bwd_tflops']:6.1f} TF/s", flush=True)


def _case_name(r: dict) -> str:
    return (f"{r.get('attention', 'self'):>5} {r['mix']:>9} L<={r['max_len']:<5} D={r['head_dim']:<3} "
            f"{'causal' if r['causal'] else 'full':<6}")


# (ours, FlexAttention's) forward + backward time ratios in the summary: lists and block mask both built in the call,
# ours built against a mask prebuilt, both prebuilt.
SUMMARY_RATIOS = (("triton", "flex+mask"), ("triton", "flex"), ("triton_cached", "flex"), ("triton_padded", "flex"))


def print_summary(results: list[dict]) -> None:
    """TFLOP/s per case and method, then our forward + backward speed-up over FlexAttention (SUMMARY_RATIOS)."""
    by_case: dict[str, dict] = {}
    for r in results:
        by_case.setdefault(_case_name(r), {})[r["method"]] = r
    print("\nTFLOP/s on real tokens, forward / forward+backward; fwd+bwd speed-up over flex")
    methods = [m for m in (*METHODS, "triton_padded", REFERENCE) if any(m in row for row in by_case.values())]
    ratios = [(ours, theirs) for ours, theirs in SUMMARY_RATIOS
              if any(ours in row and theirs in row for row in by_case.values())]
    print(f"{'case':<41}" + "".join(f"{m:>16}" for m in methods)
          + "".join(f"{ours.replace('triton', 'ours') + '/' + theirs:>20}" for ours, theirs in ratios))
    for name, row in by_case.items():
        cells = "".join(f"{row[m]['fwd_tflops']:>8.0f} /{row[m]['fwd_bwd_tflops']:>5.0f} " if m in row else f"{'':>16}"
                        for m in methods)
        speedups = "".join(f"{row[theirs]['fwd_bwd_ms'] / row[ours]['fwd_bwd_ms']:>19.2f}x"
                           if ours in row and theirs in row else f"{'':>20}" for ours, theirs in ratios)
        print(f"{name}{cells}{speedups}")


if __name__ == "__main__":
    main()
