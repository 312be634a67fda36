"""Triton jagged attention against the PyTorch reference: outputs and dq, dk, dv on random jagged batches.

One test body, two places it runs: on CPU under the Triton interpreter in fp32 with small shapes (the
interpreter must be switched on before Triton is imported, so the default run starts those cases in a
subprocess), and on a GPU in bf16 with larger shapes (marked gpu).
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass

import pytest
import torch

from kernels.jagged_attention import available_backends, jagged_attention, quantize_fp8
from tests.triton_interpreter import run_interpreter_cases

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"


@dataclass(frozen=True)
class Case:
    q_lengths: tuple[int, ...]
    kv_lengths: tuple[int, ...] | None  # None: self attention
    causal: bool
    activation: str
    heads: int = 2
    head_dim: int = 8
    value_dim: int | None = None  # None: same as head_dim
    outside: tuple[int, int] = (0, 0)  # rows that no sequence owns, before the first one and after the last


def _cases(mixes: dict[str, tuple], cross: tuple, heads: int, head_dim: int, cross_dims: tuple[int, int]):
    cases = []
    for name, lengths in mixes.items():
        for causal in (False, True):
            for activation in ("softmax", "silu"):
                case = Case(lengths, None, causal, activation, heads, head_dim)
                cases.append(pytest.param(case, id=f"self-{name}-{'causal' if causal else 'full'}-{activation}"))
    q_lengths, kv_lengths = cross
    for causal in (False, True):
        for activation in ("softmax", "silu"):
            case = Case(q_lengths, kv_lengths, causal, activation, heads, *cross_dims)
            cases.append(pytest.param(case, id=f"cross-{'causal' if causal else 'full'}-{activation}"))
    return cases


def _long_tail(seed: int, count: int, typical: int, longest: int) -> tuple[int, ...]:
    """Mostly short sequences, some empty, one of `longest` tokens."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, typical, (count,), generator=g)
    lengths[torch.randint(0, count, (1,), generator=g)] = longest
    return tuple(lengths.tolist())


def _lognormal(seed: int, count: int, longest: int) -> tuple[int, ...]:
    """History lengths exp(N(5, 1.2)) (median ~150), one of `longest` tokens, none longer."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.exp(5 + 1.2 * torch.randn(count, generator=g)).long().clamp(max=longest)
    lengths[0] = longest
    return tuple(lengths.tolist())


# Interpreter tiles are 16 and 32 rows: lengths cross several blocks and stop mid-block.
CPU_CASES = _cases(
    {"mixed": (0, 1, 5, 17, 33, 2, 70, 0, 9), "long_tail": _long_tail(0, 8, 6, 90)},
    cross=((2, 1, 4, 3, 2, 1), (0, 1, 7, 40, 3, 50)),
    heads=2, head_dim=8, cross_dims=(12, 20),
) + [
    pytest.param(Case((0, 0, 0), None, False, "softmax"), id="self-all-empty"),
    pytest.param(Case((1,), None, True, "softmax"), id="self-single-token"),
] + [
    # Power-of-two head dims: the kernels read blocks through tensor descriptors, whose rows past a sequence
    # hold the next sequence's tokens instead of zeros.
    pytest.param(Case((0, 1, 5, 17, 33, 2, 70, 0, 9), None, causal, activation, 2, 16),
                 id=f"self-mixed-d16-{'causal' if causal else 'full'}-{activation}")
    for causal in (False, True) for activation in ("softmax", "silu")
] + [
    pytest.param(Case((2, 1, 4, 3, 2, 1), (0, 1, 7, 40, 3, 50), True, activation, 2, 16, 32),
                 id=f"cross-d16-causal-{activation}")
    for activation in ("softmax", "silu")
] + [
    # Offsets that start past row 0 and end before the last row: the contract gives those rows zeros.
    pytest.param(Case((3, 0, 17, 40), None, True, "softmax", 2, 16, outside=(5, 7)), id="self-outside-d16-causal"),
    pytest.param(Case((3, 0, 17, 40), None, False, "silu", 2, 8, outside=(1, 33)), id="self-outside-full-silu"),
    pytest.param(Case((2, 1, 4), (7, 0, 40), True, "softmax", 2, 16, 32, outside=(3, 2)), id="cross-outside-d16"),
] + [
    # Head dims above 128 (the large-head configs on the GPU) and dims that are not powers of two (padded, pointer
    # loads): self attention, and cross attention of one query per sample with other value dims.
    pytest.param(Case((0, 1, 5, 17, 33, 2, 40), None, causal, activation, 1, dim),
                 id=f"self-d{dim}-{'causal' if causal else 'full'}-{activation}")
    for dim in (96, 192, 256) for causal, activation in ((True, "softmax"), (False, "silu"))
] + [
    pytest.param(Case((1, 1, 1, 1, 1), (0, 7, 40, 3, 1), causal, activation, 1, dim, value_dim),
                 id=f"cross-d{dim}-dv{value_dim}-{'causal' if causal else 'full'}-{activation}")
    for dim, value_dim in ((96, 192), (192, 64), (256, 256)) for causal, activation in ((False, "softmax"),
                                                                                      (True, "silu"))
]

# The interpreter's default run: one case of each kind (self and cross, both masks and activations, small,
# padded and large head dims, rows outside the sequences). The rest run under `slow` (test_every_interpreter_case).
DEFAULT_INTERPRETER_CASES = {
    "self-mixed-causal-softmax", "self-long_tail-full-silu", "cross-causal-softmax", "cross-full-silu",
    "self-all-empty", "self-single-token", "self-mixed-d16-causal-silu", "self-mixed-d16-causal-softmax",
    "cross-d16-causal-silu", "self-outside-full-silu", "cross-outside-d16", "self-d96-full-silu",
    "self-d256-causal-softmax", "cross-d192-dv64-causal-silu", "cross-d256-dv256-full-softmax",
}
CPU_CASES = [p if p.id in DEFAULT_INTERPRETER_CASES else pytest.param(*p.values, id=p.id, marks=pytest.mark.slow)
             for p in CPU_CASES]


def _default_count(params) -> int:
    return sum(not any(m.name == "slow" for m in getattr(p, "marks", ())) for p in params)


GPU_CASES = _cases(
    {"mixed": (0, 1, 5, 17, 130, 2, 700, 0, 93, 257), "long_tail": _long_tail(1, 64, 60, 3000)},
    cross=((1, 4, 2, 3) * 8, _long_tail(2, 32, 300, 2000)),
    heads=4, head_dim=64, cross_dims=(64, 96),
) + [
    pytest.param(Case(_long_tail(3, 16, 200, 1500), None, True, "softmax", 2, 128), id="self-long_tail-d128"),
    pytest.param(Case((300, 0, 17, 1000), None, True, "softmax", 2, 128, outside=(70, 5000)), id="self-outside-d128"),
    pytest.param(Case((2, 1, 4), (700, 0, 40), False, "silu", 4, 64, 96, outside=(3, 129)), id="cross-outside-silu"),
    pytest.param(Case((1,), None, True, "softmax", 1, 64), id="self-single-token-one-head"),
    # short-query configs (query blocks of 16) over sequences of up to 21 queries, as a gem_gpu step's engaged branch
    pytest.param(Case((0, 3, 21, 8, 1, 17, 12, 5) * 16, None, False, "softmax", 16, 128), id="self-short-d128"),
    pytest.param(Case((0, 3, 21, 8, 1, 17, 12, 5) * 16, None, False, "softmax", 11, 96), id="self-short-d96"),
] + [
    # Issue 23: one query per sample over a lognormal history of up to 2048 keys at head dim 256, and self attention
    # at head dim 192 (two column parts, 128 + 64, through descriptors).
    pytest.param(Case((1,) * 48, _lognormal(5, 48, 2048), False, activation, 2, 256),
                 id=f"cross-d256-lognormal-{activation}") for activation in ("softmax", "silu")
] + [
    pytest.param(Case(_long_tail(6, 16, 200, 1500), None, causal, activation, 2, 192),
                 id=f"self-long_tail-d192-{'causal' if causal else 'full'}-{activation}")
    for causal, activation in ((True, "softmax"), (False, "silu"))
]


def check_against_reference(case: Case, device: str, dtype: torch.dtype, tolerance: float) -> None:
    """Kernel in `dtype` against the reference in higher precision on the same inputs: ‖got − want‖ / ‖want‖.
    Rows outside every sequence (case.outside) must come out exactly 0 whatever their memory held before: the
    kernel's outputs are allocated over freed NaNs."""
    torch.manual_seed(0)
    before, after = case.outside
    q_offsets = before + _offsets(case.q_lengths, device)
    kv_offsets = q_offsets if case.kv_lengths is None else before + _offsets(case.kv_lengths, device)
    H, D = case.heads, case.head_dim
    Dv = case.value_dim or D
    q = torch.randn(int(q_offsets[-1]) + after, H, D, device=device)
    k = torch.randn(int(kv_offsets[-1]) + after, H, D, device=device)
    v = torch.randn(int(kv_offsets[-1]) + after, H, Dv, device=device)
    d_out = torch.randn(q.shape[0], H, Dv, device=device)
    precise = torch.float64 if device == "cpu" else torch.float32  # float64 on many CPU cores is slow

    def run(backend, compute_dtype):
        inputs = [x.to(compute_dtype).requires_grad_() for x in (q, k, v)]
        _free_nans(compute_dtype, device, q.shape, (q.shape[0], H, Dv))  # where the output will be allocated
        out = jagged_attention(*inputs, q_offsets, kv_offsets, causal=case.causal, activation=case.activation,
                               backend=backend)
        _free_nans(compute_dtype, device, q.shape, k.shape, v.shape)  # where the gradients will be
        grads = torch.autograd.grad(out, inputs, d_out.to(compute_dtype), allow_unused=True)
        return [out, *grads]

    got = run("triton", dtype)
    # The reference runs on the CPU: it is the oracle, not what is being tested on the GPU.
    q, k, v, d_out = (x.cpu() for x in (q, k, v, d_out))
    q_offsets, kv_offsets = q_offsets.cpu(), kv_offsets.cpu()
    want = [None if x is None else x.to(device) for x in run("pytorch", precise)]
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        b = torch.zeros_like(a) if b is None else b  # the reference gives no gradient to an empty batch
        assert a.dtype == dtype and a.shape == b.shape, f"{name}: {a.dtype} {tuple(a.shape)}"
        assert torch.isfinite(a).all(), f"{name}: non-finite values"
        # Relative to the reference's norm, with a floor for gradients that are zero in exact arithmetic.
        error = (a.detach().to(precise) - b).norm() / (b.norm() + math.sqrt(b.numel()) + 1e-12)
        assert error < tolerance, f"{name}: relative error {error:.2e} over {tolerance:.0e}"
    q_outside = _outside_rows(q.shape[0], q_offsets)
    kv_outside = _outside_rows(k.shape[0], kv_offsets)
    for name, x, outside in zip(("out", "dq", "dk", "dv"), got, (q_outside, q_outside, kv_outside, kv_outside)):
        assert torch.all(x[outside.to(device)] == 0), f"{name}: rows outside every sequence are not 0"
    if case.kv_lengths is not None:  # queries whose history is empty attend to nothing
        no_history = torch.repeat_interleave(torch.tensor(case.kv_lengths) == 0, torch.tensor(case.q_lengths))
        inside = got[0][before:before + sum(case.q_lengths)]
        assert torch.all(inside[no_history.to(device)] == 0)


def _offsets(lengths, device) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths, dtype=torch.int64).cumsum(0).tolist()], device=device)


def _outside_rows(total: int, offsets: torch.Tensor) -> torch.Tensor:
    rows = torch.arange(total)
    return (rows < int(offsets[0])) | (rows >= int(offsets[-1]))


def _free_nans(dtype, device, *shapes) -> None:
    """NaN-filled tensors of these shapes, freed at once: the allocator hands their memory to the next tensors of
    the same sizes, so a kernel that leaves rows unwritten shows NaNs there."""
    nans = [torch.full(shape, float("nan"), dtype=dtype, device=device) for shape in shapes]
    del nans


@pytest.mark.skipif(not INTERPRETING, reason="runs inside the interpreter subprocess of test_interpreter_cases")
@pytest.mark.parametrize("case", CPU_CASES if INTERPRETING else [])
def test_kernel_matches_reference_on_cpu_interpreter(case):
    check_against_reference(case, "cpu", torch.float32, tolerance=1e-5)


# A few of the CPU cases, for the backward with dq added atomically by the dk/dv kernel and for the kernels on
# counted tile lists.
SAMPLE_CASES = [p for p in CPU_CASES if p.id in ("self-mixed-causal-softmax", "self-long_tail-full-silu",
                                                   "cross-causal-softmax", "self-mixed-d16-causal-silu",
                                                   "self-outside-full-silu")]


def _samples(default_ids: set[str]) -> list:
    return [p if p.id in default_ids else pytest.param(*p.values, id=p.id, marks=pytest.mark.slow)
            for p in SAMPLE_CASES]


# In the default run, dq added atomically: through pointers and descriptors (d16), both masks and activations, cross
# attention, rows outside the sequences; the rest under `slow`.
ATOMIC_DQ_CASES = _samples({"self-long_tail-full-silu", "cross-causal-softmax", "self-mixed-d16-causal-silu",
                            "self-outside-full-silu"})


@pytest.mark.skipif(not INTERPRETING, reason="runs inside the interpreter subprocess of test_interpreter_cases")
@pytest.mark.parametrize("case", ATOMIC_DQ_CASES if INTERPRETING else [])
def test_atomic_dq_backward_matches_reference_on_cpu_interpreter(case, monkeypatch):
    from kernels.triton import triton_jagged_attention as kernel

    monkeypatch.setattr(kernel, "ATOMIC_DQ", True)
    check_against_reference(case, "cpu", torch.float32, tolerance=1e-5)


# Head and value dims of two powers of two, computed in two column parts (the default; JAGGED_ATTENTION_SPLIT_HEAD=0
# pads them).
SPLIT_DEFAULT = {"self-d96-full-silu", "cross-d192-dv64-causal-silu", "self-d48-causal-softmax",
                 "cross-d80-dv48-full-silu"}
SPLIT_CASES = [p for p in CPU_CASES if "-d96-" in p.id or "-d192-" in p.id] + [
    pytest.param(Case((0, 1, 5, 17, 33, 2, 40), None, True, "softmax", 2, 48), id="self-d48-causal-softmax"),
    pytest.param(Case((1, 3, 1, 2, 1), (0, 7, 40, 3, 1), False, "silu", 1, 80, 48), id="cross-d80-dv48-full-silu"),
]
SPLIT_CASES = [pytest.param(*p.values, id=p.id, marks=() if p.id in SPLIT_DEFAULT else pytest.mark.slow)
               for p in SPLIT_CASES]


@pytest.mark.skipif(not INTERPRETING, reason="runs inside the interpreter subprocess of test_interpreter_cases")
@pytest.mark.parametrize("case", SPLIT_CASES if INTERPRETING else [])
def test_split_head_dims_match_reference_on_cpu_interpreter(case, monkeypatch):
    from kernels.triton import triton_jagged_attention as kernel

    monkeypatch.setattr(kernel, "SPLIT_HEAD", True)
    assert kernel.dim_parts(case.head_dim)[1] or kernel.dim_parts(case.value_dim or case.head_dim)[1]
    check_against_reference(case, "cpu", torch.float32, tolerance=1e-5)


@pytest.mark.skipif(not INTERPRETING, reason="runs inside the interpreter subprocess of test_interpreter_cases")
def test_split_head_dims_fp8_forward_matches_reference_on_cpu_interpreter(monkeypatch):
    from kernels.triton import triton_jagged_attention as kernel

    monkeypatch.setattr(kernel, "SPLIT_HEAD", True)
    for dim in (96, 48):  # split in two; padded (FP8 parts of 16 would not compile on the GPU)
        check_fp8_forward(Case((0, 1, 5, 17, 33, 2, 40), None, True, "softmax", 2, dim), "cpu", tolerance=1e-2)


@pytest.mark.skipif(not INTERPRETING, reason="runs inside the interpreter subprocess of test_interpreter_cases")
def test_split_head_dims_with_atomic_dq_match_reference_on_cpu_interpreter(monkeypatch):
    from kernels.triton import triton_jagged_attention as kernel

    monkeypatch.setattr(kernel, "SPLIT_HEAD", True)
    monkeypatch.setattr(kernel, "ATOMIC_DQ", True)
    check_against_reference(Case((0, 1, 5, 17, 33, 2, 40), None, True, "softmax", 2, 48), "cpu", torch.float32,
                            tolerance=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("case", [
    pytest.param(Case(_long_tail(3, 16, 200, 1500), None, True, "softmax", 2, 96), id="self-long_tail-d96"),
    pytest.param(Case(_long_tail(6, 16, 200, 1500), None, False, "silu", 2, 192), id="self-long_tail-d192-silu"),
    pytest.param(Case((1, 4, 2, 3) * 8, _long_tail(2, 32, 300, 2000), False, "softmax", 4, 96, 48),
                 id="cross-d96-dv48")])
def test_split_head_dims_match_reference_on_gpu(case, monkeypatch):
    from kernels.triton import triton_jagged_attention as kernel

    monkeypatch.setattr(kernel, "SPLIT_HEAD", True)
    check_against_reference(case, "cuda", torch.bfloat16, tolerance=2e-2)


@pytest.mark.skipif(INTERPRETING, reason="needs no interpreter")
def test_tile_table_parts_travel_as_one_integer():
    """The build kernel's parts, packed in an argument (no device tensor a CUDA graph tree's run could come to own):
    each part's direction and block size's log2 in 5 bits; a part that does not fit is refused by name."""
    from kernels.triton.triton_tile_table import part_codes

    assert part_codes(((0, 64), (1, 16), (0, 128))) == 6 | (16 + 4) << 5 | 7 << 10
    for bad in (((0, 48),), ((2, 64),), ((0, 64),) * 13):
        with pytest.raises(ValueError, match="tile-table part"):
            part_codes(bad)


@pytest.mark.skipif(INTERPRETING, reason="needs no interpreter")
def test_a_launch_key_holds_a_value_for_every_name_its_autotuner_keys_on(monkeypatch):
    """_TunedLaunch reuses a chosen config for an equal key, so the key is read off the autotuner's own names: one
    value per name and a dtype per tensor, a changed flag a new key, a flag left out a KeyError (not a key that
    would serve another call's config)."""
    from kernels.triton import triton_jagged_attention as kernel
    from kernels.triton import triton_tile_table as tile_lists
    from kernels.triton.triton_jagged_attention_kernels import dkdv_kernel, dq_kernel, forward_kernel

    monkeypatch.setattr(tile_lists, "MAX_COUNTED_PAIRS", 0)  # the PyTorch tile build: no GPU here
    offsets = torch.tensor([0, 300, 340, 900])
    q = torch.zeros(900, 2, 64, dtype=torch.bfloat16)
    problem = kernel._Problem(q, q, q, offsets, offsets, True, False, 0.1)
    dkdv_flags = {"TMA": True, "ADD_DQ": False, "DQ_TMA": False}
    for tuner, flags in ((forward_kernel, {"TMA": True}), (dq_kernel, {"TMA": True}), (dkdv_kernel, dkdv_flags)):
        key = problem.tuning_key(tuner, (q, q), **flags)
        assert len(key) == len(tuner.keys) + 2 and key[-2:] == (torch.bfloat16, torch.bfloat16)
        assert problem.tuning_key(tuner, (q, q), **{**flags, "TMA": False}) != key
    with pytest.raises(KeyError, match="ADD_DQ"):
        problem.tuning_key(dkdv_kernel, (q,), TMA=True)
    kernel.clear_tile_cache()


@pytest.mark.skipif(INTERPRETING, reason="the interpreter has no short-query configs")
def test_a_call_of_few_queries_per_sequence_gets_16_row_tiles_and_its_own_tuning(monkeypatch):
    """The mean query count picks the short-query configs (the pruner reads query_bucket) and their 16-row tiles; a
    self attention over the same history keeps the tuned ones and another autotuning key; FP8 head dims of 48 stay
    padded even when head dims split."""
    from kernels.triton import triton_jagged_attention as kernel
    from kernels.triton import triton_tile_table as tile_lists
    from kernels.triton.triton_jagged_attention_kernels import forward_kernel

    monkeypatch.setattr(tile_lists, "MAX_COUNTED_PAIRS", 0)  # the PyTorch tile build: no GPU here
    kernel.clear_tile_cache()
    history = torch.tensor([0, 300, 340, 900])
    candidates = torch.tensor([0, 2, 4, 6])

    def problem(q_offsets, kv_offsets, dim=96, dtype=torch.bfloat16):
        q = torch.zeros(int(q_offsets[-1]), 2, dim).to(dtype)
        k = torch.zeros(int(kv_offsets[-1]), 2, dim).to(dtype)
        return kernel._Problem(q, k, k, q_offsets, kv_offsets, False, False, 0.1)

    cross, self_ = problem(candidates, history), problem(history, history)
    assert (cross.query_bucket, cross.short_queries) == (16, True) and not self_.short_queries
    assert (0, 16) in cross.table.capacity and (0, 16) not in self_.table.capacity
    assert cross.tuning_key(forward_kernel, (), TMA=True) != self_.tuning_key(forward_kernel, (), TMA=True)
    assert kernel._parts(True) == tuple(sorted({*kernel._parts(False), (0, 16)}))
    monkeypatch.setattr(kernel, "SPLIT_HEAD", True)
    assert problem(history, history).parts == ((64, 32), (64, 32))
    assert problem(history, history, 48, torch.float8_e4m3fn).parts == ((64, 0), (32, 16))
    kernel.clear_tile_cache()


def test_dims_of_two_powers_of_two_split_into_their_parts():
    from kernels.triton.triton_jagged_attention import dim_parts

    split = {dim: dim_parts(dim, split=True) for dim in (8, 24, 48, 64, 80, 96, 112, 160, 192, 256)}
    assert split == {8: (16, 0), 24: (32, 0), 48: (32, 16), 64: (64, 0), 80: (64, 16), 96: (64, 32), 112: (128, 0),
                     160: (128, 32), 192: (128, 64), 256: (256, 0)}
    assert [dim_parts(dim, split=False) for dim in (48, 96, 192)] == [(64, 0), (128, 0), (256, 0)]
    # FP8 contractions take 32 or more: 48 and 80 stay padded there
    assert [dim_parts(dim, split=True, smallest=32) for dim in (48, 80, 96)] == [(64, 0), (128, 0), (64, 32)]


@pytest.mark.skipif(not INTERPRETING, reason="runs inside the interpreter subprocess of test_interpreter_cases")
def test_atomic_dq_for_short_queries_skips_their_dq_kernel_only_on_cpu_interpreter(monkeypatch):
    """JAGGED_ATTENTION_ATOMIC_DQ=short: a call of a few queries per sequence adds dq in the dk/dv kernel; one of
    longer sequences keeps the dq kernel. Both match the reference."""
    from kernels.triton import triton_jagged_attention as kernel

    monkeypatch.setattr(kernel, "ATOMIC_DQ_SHORT", True)
    launches = []
    launch_dq = kernel._launch_dq
    monkeypatch.setattr(kernel, "_launch_dq", lambda *a, **k: launches.append(1) or launch_dq(*a, **k))
    check_against_reference(Case((2, 1, 4, 3, 2, 1), (0, 1, 7, 40, 3, 50), False, "softmax"), "cpu",
                            torch.float32, tolerance=1e-5)
    assert not launches
    check_against_reference(Case((0, 40, 17, 33, 70), None, True, "softmax"), "cpu", torch.float32, tolerance=1e-5)
    assert launches


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("q_lengths,kv_lengths,heads,dim,value_dim", [
    ((1, 4, 2, 3) * 8, _long_tail(2, 32, 300, 2000), 4, 128, 128),  # dq added by one TMA reduce a block
    ((1, 4, 2, 3) * 8, _long_tail(2, 32, 300, 2000), 4, 64, 96),  # by atomics
    # as a gem_gpu step's engaged branch: 2 queries over a few keys, many histories empty; self attention over up
    # to 21 events (two query blocks of 16 in some sequences)
    ((2,) * 128, (0, 3, 17, 0, 1, 0, 9, 12) * 16, 16, 128, 128),
    ((0, 3, 21, 8, 1, 17, 12, 5) * 16, None, 16, 128, 128),
], ids=["tma-reduce", "atomics", "engaged-cross-d128", "engaged-self-d128"])
def test_atomic_dq_for_short_queries_matches_reference_on_gpu(q_lengths, kv_lengths, heads, dim, value_dim,
                                                              monkeypatch):
    from kernels.triton import triton_jagged_attention as kernel

    monkeypatch.setattr(kernel, "ATOMIC_DQ_SHORT", True)
    case = Case(q_lengths, kv_lengths, False, "softmax", heads, dim, value_dim)
    check_against_reference(case, "cuda", torch.bfloat16, tolerance=2e-2)


def check_fp8_forward(case: Case, device: str, tolerance: float) -> None:
    """FP8 inputs (each tensor scaled by its amax / 448) through the kernel against the reference on the very same
    FP8 values and factors: what differs is only the kernel's fp16 weights and its summation order."""
    torch.manual_seed(0)
    q_offsets = _offsets(case.q_lengths, device)
    kv_offsets = q_offsets if case.kv_lengths is None else _offsets(case.kv_lengths, device)
    shapes = [(int(q_offsets[-1]), case.heads, case.head_dim), (int(kv_offsets[-1]), case.heads, case.head_dim),
              (int(kv_offsets[-1]), case.heads, case.value_dim or case.head_dim)]
    quantized, descale = quantize_fp8(*(torch.randn(shape, device=device) * 3 for shape in shapes))
    with torch.no_grad():
        got, want = (jagged_attention(*quantized, q_offsets, kv_offsets, causal=case.causal, activation=case.activation,
                                      descale=descale, backend=backend) for backend in ("triton", "pytorch"))
    assert got.dtype == want.dtype == torch.bfloat16 and got.shape == want.shape
    error = (got.float() - want.float()).norm() / (want.float().norm() + math.sqrt(want.numel()) * 1e-3)
    assert error < tolerance, f"relative error {error:.2e} over {tolerance:.0e}"


FP8_CASES = [p for p in CPU_CASES if p.id in ("self-mixed-causal-softmax", "self-long_tail-full-silu",
                                                "cross-causal-softmax", "self-mixed-d16-causal-softmax",
                                                "cross-d16-causal-silu")]


@pytest.mark.skipif(not INTERPRETING, reason="runs inside the interpreter subprocess of test_interpreter_cases")
@pytest.mark.parametrize("case", FP8_CASES if INTERPRETING else [])
def test_fp8_forward_matches_reference_on_cpu_interpreter(case):
    check_fp8_forward(case, "cpu", tolerance=1e-2)


@pytest.mark.skipif(not INTERPRETING, reason="runs inside the interpreter subprocess of test_interpreter_cases")
def test_q_k_v_sliced_from_one_projection_reach_the_kernels_without_a_copy_on_cpu_interpreter(monkeypatch):
    """A fused projection's q, k and v ([tokens, heads, dim] views with a token stride of 3 x heads x dim) are read in
    place, through pointers and descriptors, forward and backward, with the results of contiguous copies."""
    from kernels.jagged_attention_op import jagged_attention_op
    from kernels.triton import triton_jagged_attention as kernel

    torch.manual_seed(0)
    offsets = _offsets([5, 0, 23, 9], "cpu")
    fused = torch.randn(int(offsets[-1]), 3 * 2 * 16)
    q, k, v = fused.view(-1, 3, 2, 16).unbind(1)
    assert not q.is_contiguous() and all(kernel._rows_packed(x) for x in (q, k, v))
    pointers = []
    forward = kernel._forward
    monkeypatch.setattr(kernel, "_forward", lambda p, *qkv, **kw: pointers.append([x.data_ptr() for x in qkv[:3]]) or
                        forward(p, *qkv, **kw))
    d_out = torch.randn(q.shape[0], 2, 16)
    for activation in ("softmax", "silu"):
        views = [x.detach().requires_grad_() for x in (q, k, v)]
        copies = [x.detach().contiguous().requires_grad_() for x in (q, k, v)]
        got = jagged_attention(*views, offsets, offsets, causal=True, activation=activation, backend="triton")
        want = jagged_attention(*copies, offsets, offsets, causal=True, activation=activation, backend="triton")
        assert pointers[0] == [x.data_ptr() for x in views]
        for a, b in zip([got, *torch.autograd.grad(got, views, d_out)],
                        [want, *torch.autograd.grad(want, copies, d_out)]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        out, _ = jagged_attention_op(q, k, v, offsets, offsets, True, activation, 0.25, "triton")
        assert pointers[2] == [x.data_ptr() for x in (q, k, v)]
        torch.testing.assert_close(out, jagged_attention_op(*(x.contiguous() for x in (q, k, v)), offsets, offsets,
                                                            True, activation, 0.25, "triton")[0], rtol=1e-5, atol=1e-5)
        pointers.clear()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_views_off_the_16_byte_line_compile_no_new_kernel_variant_on_gpu():
    """q, k, v sliced from one projection run in place; one that starts off Triton's 16-byte alignment is copied,
    so a batch whose view lands there costs no compile of a new specialisation inside a step."""
    from kernels.jagged_attention import compiled_variants

    torch.manual_seed(0)
    offsets = _offsets([50, 0, 230, 90], "cuda")
    fused = torch.randn(int(offsets[-1]) * 3 * 4 * 64 + 1, device="cuda", dtype=torch.bfloat16)

    def run(start: int) -> torch.Tensor:
        q, k, v = fused[start:start + int(offsets[-1]) * 3 * 256].view(-1, 3, 4, 64).unbind(1)
        out = jagged_attention(q, k, v, offsets, offsets, causal=True, activation="softmax", backend="triton")
        torch.cuda.synchronize()
        return out

    aligned = run(0)
    variants = compiled_variants()
    shifted = run(1)  # every view 2 bytes past the line
    assert compiled_variants() == variants
    assert torch.isfinite(shifted).all() and not torch.equal(shifted, aligned)


@pytest.mark.skipif(not INTERPRETING, reason="runs inside the interpreter subprocess of test_interpreter_cases")
def test_the_configs_chosen_per_key_are_reported_on_cpu_interpreter():
    """What an MFU report records (`attention_configs`): each kernel's config for every key it tuned."""
    from kernels.jagged_attention import chosen_configs

    offsets = _offsets([5, 0, 17], "cpu")
    q, k, v = (torch.randn(int(offsets[-1]), 2, 16, requires_grad=True) for _ in range(3))
    jagged_attention(q, k, v, offsets, offsets, causal=True, activation="softmax", backend="triton").sum().backward()
    configs = chosen_configs()
    assert set(configs) == {"forward", "dq", "dkdv"}
    for name, chosen in configs.items():  # at least this call's key (an earlier case may have tuned it first)
        assert chosen and all("BLOCK_M" in c and "num_warps" in c for c in chosen.values()), (name, chosen)


@pytest.mark.skipif(not INTERPRETING, reason="runs inside the interpreter subprocess of test_interpreter_cases")
def test_tile_cache_is_never_stale_on_cpu_interpreter():
    """Cached tile lists serve the same unmodified offsets tensor only: not one edited in place, nor another."""
    from kernels.triton import triton_jagged_attention as kernel
    from kernels.triton import triton_tile_table as tile_lists

    kernel.clear_tile_cache()
    torch.manual_seed(0)
    q, k, v = (torch.randn(40, 2, 8) for _ in range(3))

    def check(offsets):
        for causal in (False, True):
            got = jagged_attention(q, k, v, offsets, causal=causal, backend="triton")
            want = jagged_attention(q, k, v, offsets.clone(), causal=causal, backend="pytorch")
            assert (got - want).abs().max() < 1e-5

    def cached(offsets):
        return tile_lists.tile_cache.get(offsets, offsets, q.device, 40, 40, kernel._parts(), True)

    offsets = torch.tensor([0, 3, 35, 40])
    check(offsets)
    first = cached(offsets)
    assert cached(offsets) is first  # the layers of one step share one build
    offsets[1:3] = torch.tensor([30, 33])  # same tensor, same shape, edited in place
    check(offsets)
    assert cached(offsets) is not first
    other = torch.tensor([0, 17, 18, 40])  # another tensor of the same shape
    check(other)
    assert cached(other) is not cached(offsets)
    del offsets, other
    check(torch.tensor([0, 1, 2, 40]))  # a new tensor, perhaps where a freed one lived

    kernel.cache_tile_tables(False)  # steps replayed from CUDA graph trees: no table may outlive a call
    try:
        offsets = torch.tensor([0, 3, 35, 40])
        check(offsets)
        assert cached(offsets) is not cached(offsets) and not tile_lists.tile_cache._entries
    finally:
        kernel.cache_tile_tables(True)
    assert cached(offsets) is cached(offsets)


def check_tile_table(q_lengths, kv_lengths, causal: bool, parts: tuple, device: str) -> None:
    """The one-launch tile build against its PyTorch reference: every part's tiles, in order, and the index."""
    from kernels.pytorch.pt_tile_table import pt_tile_table
    from kernels.triton import triton_tile_table as tile_lists

    q_offsets = _offsets(q_lengths, device)
    kv_offsets = q_offsets if kv_lengths is None else _offsets(kv_lengths, device)
    table = tile_lists.TileTable(q_offsets, kv_offsets, int(q_offsets[-1]), int(kv_offsets[-1]), parts, causal)
    assert table.tiles.shape[1] * len(q_lengths) <= tile_lists.MAX_COUNTED_PAIRS  # built by counting, not the sort
    tiles, index = pt_tile_table(q_offsets, kv_offsets, table.tiles.shape[1], parts, causal)
    assert torch.equal(table.index, index)
    for p, (direction, size) in enumerate(parts):
        count = int(index[direction, size // 16, 1])
        assert count == sum(-(-n // size) for n in (q_lengths if direction == 0 or kv_lengths is None
                                                    else kv_lengths))
        assert torch.equal(table.tiles[p, :count], tiles[p, :count]), (p, direction, size)


# Lengths that give ties, empty sequences, sequences shorter than a block, and more queries than keys and fewer.
TILE_TABLE_CASES = [
    pytest.param(lengths, kv_lengths, causal, id=f"{name}-{'causal' if causal else 'full'}")
    for name, lengths, kv_lengths in [("self", (0, 1, 5, 16, 17, 33, 64, 64, 100, 0, 257), None),
                                      ("cross", (2, 40, 0, 3, 50, 17), (30, 3, 9, 0, 50, 64))]
    for causal in (False, True)
]


@pytest.mark.skipif(not INTERPRETING, reason="runs inside the interpreter subprocess of test_interpreter_cases")
@pytest.mark.parametrize("q_lengths,kv_lengths,causal", TILE_TABLE_CASES if INTERPRETING else [])
def test_tile_table_matches_reference_on_cpu_interpreter(q_lengths, kv_lengths, causal, monkeypatch):
    from kernels.triton import triton_tile_table as tile_lists

    monkeypatch.setattr(tile_lists, "MAX_COUNTED_PAIRS", 1 << 24)  # the counting kernel, not the sort
    check_tile_table(q_lengths, kv_lengths, causal, ((0, 16), (0, 32), (1, 16), (1, 64)), "cpu")


# In the default run, the kernels on counted tile lists of self attention under a full mask, cross attention under a
# causal one and offsets that start past row 0 (the lists themselves are checked above, for every mask and kind);
# the rest under `slow`.
COUNTED_TILE_CASES = _samples({"self-long_tail-full-silu", "cross-causal-softmax", "self-outside-full-silu"})


@pytest.mark.skipif(not INTERPRETING, reason="runs inside the interpreter subprocess of test_interpreter_cases")
@pytest.mark.parametrize("case", COUNTED_TILE_CASES if INTERPRETING else [])
def test_kernels_run_on_counted_tile_lists_on_cpu_interpreter(case, monkeypatch):
    """The interpreter's other cases take sorted tile lists (MAX_COUNTED_PAIRS, for speed); these take the
    counting kernel's, as the GPU does."""
    from kernels.triton import triton_jagged_attention as kernel
    from kernels.triton import triton_tile_table as tile_lists

    monkeypatch.setattr(tile_lists, "MAX_COUNTED_PAIRS", 1 << 24)
    kernel.clear_tile_cache()
    check_against_reference(case, "cpu", torch.float32, tolerance=1e-5)
    kernel.clear_tile_cache()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("causal", [False, True])
def test_tile_table_matches_reference_on_gpu(causal):
    from kernels.triton.triton_jagged_attention import _parts

    generator = torch.Generator().manual_seed(1)
    q_lengths = (torch.rand(300, generator=generator) ** 3 * 3000).long().tolist()
    kv_lengths = (torch.rand(300, generator=generator) ** 3 * 3000).long().tolist()
    for kv in (None, kv_lengths):
        for short_queries in (False, True):
            check_tile_table(q_lengths, kv, causal, _parts(short_queries), "cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("case", GPU_CASES)
def test_kernel_matches_reference_on_gpu(case):
    check_against_reference(case, "cuda", torch.bfloat16, tolerance=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("case", [p for p in GPU_CASES if "long_tail" in p.id or "cross" in p.id])
def test_fp8_forward_matches_reference_on_gpu(case):
    check_fp8_forward(case, "cuda", tolerance=1e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("head_dim,activation,short_queries,split", [
    (64, "softmax", False, False), (128, "softmax", False, False), (64, "silu", False, False),
    (256, "softmax", False, False), (192, "silu", False, False), (96, "softmax", True, False),
    (128, "silu", True, False), (256, "softmax", True, False), (96, "softmax", False, True),
    (192, "silu", False, True)])
def test_every_chosen_config_matches_reference_on_gpu(head_dim, activation, short_queries, split, monkeypatch):
    """Autotuning runs one config per shape, so each config the kernels may choose at this head dim on this GPU (and
    the small-footprint fallbacks) is run here, one per kernel at a time, not only the winners: none may fail to
    launch for want of shared memory. With short queries, cross attention of 1-3 queries (some 17-21, two query
    blocks) over a long tail of keys on the short-query configs; with split, the head dim in its two column parts
    (SPLIT_HEAD)."""
    from kernels.triton import triton_jagged_attention as kernel
    from kernels.triton import triton_jagged_attention_configs as launch_configs
    from kernels.triton import triton_jagged_attention_kernels as device_code

    monkeypatch.setattr(kernel, "SPLIT_HEAD", split)

    names = ("forward", "dq", "dkdv")
    tuners = (device_code.forward_kernel, device_code.dq_kernel, device_code.dkdv_kernel)
    limit = launch_configs.shared_memory_limit(torch.cuda.current_device())
    # chosen at the widths the pruner sees (a split dim's parts' sum), where more configs fit than padded
    configs = [_chosen(name, head_dim, head_dim, limit=limit, short_queries=short_queries, split=split)
               + [c for c in tuner.configs if any(c is x for x in launch_configs.FALLBACK_CONFIGS)]
               for name, tuner in zip(names, tuners)]
    if short_queries:
        assert all(any(c is x for x in launch_configs.SHORT_QUERY_CONFIGS)
                   for options in configs for c in options[:-1])
        kv_lengths = _long_tail(4, 24, 200, 1500)
        # a few queries per sequence, some of two query blocks: a pipelined loop then fills its second buffers
        q_lengths = tuple((1, 2, 3, 21, 17)[i % 5] for i in range(len(kv_lengths)))
        case = Case(q_lengths, kv_lengths, False, activation, 2, head_dim)
    else:
        case = Case(_long_tail(4, 16, 200, 1500), None, True, activation, 2, head_dim)
    for round_ in range(max(map(len, configs))):
        for tuner, options in zip(tuners, configs):
            monkeypatch.setattr(tuner, "configs", [options[round_ % len(options)]])
            monkeypatch.setattr(tuner, "cache", {})
        check_against_reference(case, "cuda", torch.bfloat16, tolerance=2e-2)


NAN_CASES = [(causal, activation) for causal in (False, True) for activation in ("softmax", "silu")]
NAN_INTERPRETER_CASES = [pytest.param(*case, marks=() if case in ((True, "softmax"), (False, "silu"))
                                                   else pytest.mark.slow)
                         for case in NAN_CASES]


@pytest.mark.skipif(not INTERPRETING, reason="runs inside the interpreter subprocess of test_interpreter_cases")
@pytest.mark.parametrize("causal,activation", NAN_INTERPRETER_CASES)
def test_a_nan_stays_in_its_sequence_on_cpu_interpreter(causal, activation):
    from tests.test_jagged_attention import nan_stays_in_its_sequence

    nan_stays_in_its_sequence("triton", "cpu", causal, activation)


@pytest.mark.skipif(not INTERPRETING, reason="runs inside the interpreter subprocess of test_interpreter_cases")
@pytest.mark.xfail(strict=True, reason="known: through tensor descriptors a block past a sequence's end holds the next "
                   "sequence's rows, and a zero weight times their NaN is NaN (the kernel module's docstring)")
def test_a_nan_stays_in_its_sequence_through_descriptors_on_cpu_interpreter():
    from tests.test_jagged_attention import nan_stays_in_its_sequence

    nan_stays_in_its_sequence("triton", "cpu", False, "softmax", dim=16)  # a power of two: descriptor loads


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("causal,activation", NAN_CASES)
def test_a_nan_stays_in_its_sequence_on_gpu(causal, activation):
    from tests.test_jagged_attention import nan_stays_in_its_sequence

    nan_stays_in_its_sequence("triton", "cuda", causal, activation)


@pytest.mark.skipif(INTERPRETING, reason="needs no interpreter")
def test_tile_tables_are_built_afresh_and_left_uncached_while_a_cuda_graph_is_captured(monkeypatch):
    """A table cached before a capture would be replayed stale on the next batch's offsets; one cached during it
    would outlive its graph. So during a capture every call builds (and so records) its own."""
    from kernels.triton import triton_jagged_attention as kernel
    from kernels.triton import triton_tile_table as tile_lists

    built = []
    monkeypatch.setattr(tile_lists, "_Tiles", lambda *args: built.append(args) or object())
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)  # a CPU build of torch has none
    cache, offsets = tile_lists.TileCache(), torch.tensor([0, 3, 7])
    args = (offsets, offsets, "cuda", 7, 7, kernel._parts(), True)
    eager = cache.get(*args)
    assert cache.get(*args) is eager and len(built) == 1  # eager calls share one build
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    first, second = cache.get(*args), cache.get(*args)
    assert len({id(eager), id(first), id(second)}) == 3 and len(built) == 3
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert cache.get(*args) is eager and len(built) == 3  # the capture left the cache as it was


def _capture_batch(lengths, kv_lengths, capacity: int, heads: int, dim: int, seed: int) -> dict:
    """One batch of a fixed-capacity buffer: `capacity` rows, the sequences' tokens first, the rest outside."""
    g = torch.Generator().manual_seed(seed)
    q_offsets = _offsets(lengths, "cuda")
    kv_offsets = q_offsets if kv_lengths is None else _offsets(kv_lengths, "cuda")
    rows = {"q": capacity, "k": capacity if kv_lengths is None else 4 * capacity}
    return {"q_offsets": q_offsets, "kv_offsets": kv_offsets,
            **{name: torch.randn(rows["q" if name in ("q", "d_out") else "k"], heads, dim, generator=g).cuda()
               .to(torch.bfloat16) for name in ("q", "k", "v", "d_out")}}


def _attention_and_grads(batch: dict, causal: bool, activation: str) -> list[torch.Tensor]:
    q, k, v = batch["q"], batch["k"], batch["v"]
    out = jagged_attention(q, k, v, batch["q_offsets"], batch["kv_offsets"], causal=causal, activation=activation,
                           backend="triton")
    return [out, *torch.autograd.grad(out, (q, k, v), batch["d_out"])]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("cross,causal,activation", [(False, True, "softmax"), (False, False, "silu"),
                                                     (True, False, "softmax")])
def test_forward_and_backward_replay_from_a_cuda_graph_on_new_batches(cross, causal, activation):
    """Captured once on one batch, replayed on others copied into the same buffers (other lengths, other token
    counts within the buffers' capacity): the same outputs and gradients as eager calls on those batches. The tile
    tables are built on the device from the offsets, so a replay needs no host work."""
    capacity, heads, dim = 4096, 4, 64
    batches = [
        (_long_tail(7, 32, 60, 1500), None if not cross else _long_tail(8, 32, 400, 3000)),
        (_long_tail(9, 32, 90, 2000), None if not cross else _long_tail(10, 32, 300, 4000)),
        ((0, 5, 1) + (0,) * 29, None if not cross else (40, 0, 3) + (0,) * 29),  # nearly every row outside
    ]
    if cross:  # one query per sample over its history
        batches = [((1,) * len(kv), kv) for _, kv in batches]
    static = _capture_batch(*batches[0], capacity, heads, dim, seed=0)
    for name in ("q", "k", "v"):
        static[name].requires_grad_()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # autotuning, tile table shapes and the allocator's warm-up, before capture
        for _ in range(2):
            _attention_and_grads(static, causal, activation)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = _attention_and_grads(static, causal, activation)
    for seed, (lengths, kv_lengths) in enumerate(batches[1:], start=1):
        batch = _capture_batch(lengths, kv_lengths, capacity, heads, dim, seed)
        assert int(batch["q_offsets"][-1]) <= capacity and int(batch["kv_offsets"][-1]) <= batch["k"].shape[0]
        with torch.no_grad():
            for name, value in batch.items():
                static[name].copy_(value)
        graph.replay()
        for name in ("q", "k", "v"):
            batch[name].requires_grad_()
        want = _attention_and_grads(batch, causal, activation)
        for name, got, expected in zip(("out", "dq", "dk", "dv"), captured, want):
            # equal up to the order of the backward's atomic additions
            error = (got.float() - expected.float()).norm() / (expected.float().norm() + 1e-6)
            assert error < 2e-3, f"{name}: relative error {error:.1e} after replay on batch {seed}"


def check_packed_op(device: str, monkeypatch, tolerance: float) -> None:
    """q, k, v as one fused projection's output (self attention), or k, v packed beside their own q (cross): the
    packed op's output is the separate op's, and its backward writes the three gradients into one tensor, every
    row of it (the buffer starts as NaN; rows no sequence owns at both ends must come out 0), with and without dq
    summed atomically."""
    from kernels import jagged_attention_op as ops
    from kernels.triton import triton_jagged_attention as kernel

    monkeypatch.setattr(ops, "_gradient_buffer", lambda packed: torch.full_like(packed, math.nan))
    kv_offsets = torch.tensor([3, 8, 8, 30], device=device)  # 34 rows: 3 before the first sequence, 4 after
    cross_offsets = torch.tensor([0, 2, 4, 6], device=device)
    torch.manual_seed(0)
    for atomic in (False, True):
        monkeypatch.setattr(kernel, "ATOMIC_DQ", atomic)
        for cross, causal, activation in ((False, True, "softmax"), (False, False, "silu"), (True, False, "softmax")):
            q_offsets = cross_offsets if cross else kv_offsets
            packed = torch.randn(34, (2 if cross else 3) * 2, 16, device=device)
            q = torch.randn(6, 2, 16, device=device) if cross else None
            d_out = torch.randn(6 if cross else 34, 2, 16, device=device)
            inputs = [packed.clone().requires_grad_()] + ([q.clone().requires_grad_()] if cross else [])
            out = ops.jagged_attention_packed_op(inputs[0], inputs[1] if cross else None, q_offsets, kv_offsets,
                                                 causal, activation, 0.25, "triton")[0]
            got = [out, *torch.autograd.grad(out, inputs, d_out)]
            separate = [x.detach().contiguous().requires_grad_() for x in ops.split_packed(packed, q)]
            want_out = ops.jagged_attention_op(*separate, q_offsets, kv_offsets, causal, activation, 0.25, "triton")[0]
            dq, dk, dv = torch.autograd.grad(want_out, separate, d_out)
            want = [want_out, torch.cat([dk, dv] if cross else [dq, dk, dv], 1)] + ([dq] if cross else [])
            for name, a, b in zip(("out", "d_packed", "dq"), got, want):
                torch.testing.assert_close(a, b, rtol=tolerance, atol=tolerance, msg=f"{name} {cross} {atomic}")
            assert (got[1][_outside_rows(34, kv_offsets).to(device)] == 0).all()


@pytest.mark.skipif(not INTERPRETING, reason="runs inside the interpreter subprocess of test_interpreter_cases")
def test_packed_op_writes_one_gradient_on_cpu_interpreter(monkeypatch):
    check_packed_op("cpu", monkeypatch, 1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_packed_op_writes_one_gradient_on_gpu(monkeypatch):
    check_packed_op("cuda", monkeypatch, 2e-3)


def check_compiled_caller(device: str, compiler: str) -> None:
    """A caller compiled whole (fullgraph: a graph break would raise) runs the kernels through the custom op, on
    batches of new lengths, with the eager kernels' outputs and gradients."""
    import torch._dynamo.testing

    def layer(x, w, offsets, causal, activation):
        q, k, v = (x @ w).view(x.shape[0], 3, 2, 16).unbind(1)
        out = jagged_attention(q, k, v, offsets, causal=causal, activation=activation, backend="triton")
        return (out.flatten(1) * x).sum()

    for causal, activation in ((True, "softmax"), (False, "silu")):
        counter = torch._dynamo.testing.CompileCounterWithBackend(compiler)
        compiled = torch.compile(layer, backend=counter, fullgraph=True)
        torch.manual_seed(0)
        w = torch.randn(32, 96, device=device) / 8
        for lengths in ((3, 0, 17, 5, 40), (9, 1, 2, 33), (70, 4)):
            offsets = _offsets(lengths, device)
            x = torch.randn(int(offsets[-1]), 32, device=device)
            results = []
            for fn in (layer, compiled):
                xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
                loss = fn(xs, ws, offsets, causal, activation)
                results.append((loss, *torch.autograd.grad(loss, (xs, ws))))
            for name, want, got in zip(("loss", "dx", "dw"), *results):
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, msg=name)
        assert counter.frame_count <= 2, counter.frame_count

    # The op's fake shapes are its real ones (a compiled step trusts them); its saved statistics flat.
    from kernels.jagged_attention_op import _OP_BACKENDS, jagged_attention_op

    offsets = _offsets((3, 0, 17), device)
    q, k, v = (torch.randn(int(offsets[-1]), 2, 16, device=device) for _ in range(3))
    for activation in ("softmax", "silu"):
        out, saved = jagged_attention_op(q, k, v, offsets, offsets, True, activation, 0.25, "triton")
        assert out.shape == q.shape and saved.is_contiguous()
        assert saved.shape == _OP_BACKENDS["triton"].saved_shape(q.shape[0], 2, 3, activation) and saved.dim() == 1


@pytest.mark.skipif(not INTERPRETING, reason="runs inside the interpreter subprocess of test_interpreter_cases")
def test_compiled_caller_runs_the_kernels_on_cpu_interpreter():
    check_compiled_caller("cpu", "aot_eager")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_caller_runs_the_kernels_on_gpu():
    check_compiled_caller("cuda", "inductor")


@pytest.mark.skipif(INTERPRETING, reason="this is the interpreter run itself")
def test_interpreter_cases(interpreter_runs):
    interpreter_runs.check(__file__, expected_passed=_default_count(CPU_CASES) + _default_count(ATOMIC_DQ_CASES)
                           + _default_count(COUNTED_TILE_CASES) + len(FP8_CASES) + len(TILE_TABLE_CASES) + 3
                           + _default_count(NAN_INTERPRETER_CASES) + _default_count(SPLIT_CASES) + 5)


@pytest.mark.slow
@pytest.mark.skipif(INTERPRETING, reason="this is the interpreter run itself")
def test_every_interpreter_case():
    run_interpreter_cases(__file__, expected_passed=len(CPU_CASES) + 2 * len(SAMPLE_CASES) + len(FP8_CASES)
                          + len(TILE_TABLE_CASES) + 3 + len(NAN_CASES) + len(SPLIT_CASES) + 5, markers="")


H200_SHARED_BYTES = 232448  # the opt-in maximum of one program's shared memory on Hopper
KERNEL_NAMES = ("forward", "dq", "dkdv")
COMPILE_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float8_e4m3fn: "fp8e4nv"}


def _tuners():
    from kernels.triton import triton_jagged_attention_kernels as device_code

    return dict(zip(KERNEL_NAMES, (device_code.forward_kernel, device_code.dq_kernel, device_code.dkdv_kernel)))


def _computed_dims(dim: int, value_dim: int, dtype, split: bool) -> tuple[int, int]:
    """The widths the kernels compute a head and value dim at (FP8 head dims split only into parts of 32 or more)."""
    from kernels.triton.triton_jagged_attention import computed_dim

    return computed_dim(dim, split, smallest=32 if dtype == torch.float8_e4m3fn else 16), computed_dim(value_dim, split)


def _chosen(name: str, dim: int, value_dim: int, dtype=torch.bfloat16, limit: int = H200_SHARED_BYTES,
            atomic_dq: bool = False, short_queries: bool = False, split: bool = False):
    from kernels.triton import triton_jagged_attention_configs as launch_configs

    return launch_configs.choose_configs(name, _tuners()[name].configs, *_computed_dims(dim, value_dim, dtype, split),
                                         dtype, limit, atomic_dq, short_queries)


@pytest.mark.skipif(INTERPRETING, reason="the interpreter has one config per kernel")
def test_configs_are_chosen_by_head_dim_and_shared_memory():
    """Each kernel's configs for a head dim: the tuned lists unchanged up to 128 (the one-warpgroup ones up to 64),
    the large-head ones above, the short-query ones alone for calls of few queries per sequence (except in FP8);
    every one within the H200's shared memory by its estimate, for every head and value dim up to 256 and every
    input dtype; the smallest fitting one where a head dim's own do not fit; a ValueError naming the dims where
    nothing fits."""
    from kernels.triton import triton_jagged_attention as kernel
    from kernels.triton import triton_jagged_attention_configs as launch_configs

    assert all(t.early_config_prune.__qualname__.startswith("pruner.") for t in _tuners().values())
    own_lists = {"forward": launch_configs.FWD_LARGE_HEAD, "dq": launch_configs.DQ_LARGE_HEAD,
                 "dkdv": launch_configs.DKDV_LARGE_HEAD}
    for name, tuner in _tuners().items():
        configs = tuner.configs
        short = [c for c in configs if any(c is x for x in launch_configs.SHORT_QUERY_CONFIGS)]
        extra = [c for c in configs
                 if any(c is x for x in launch_configs.LARGE_HEAD_CONFIGS + launch_configs.FALLBACK_CONFIGS)]
        tuned = [c for c in configs if not any(c is x for x in extra + short)]
        small = [c for c in tuned if any(c is x for x in launch_configs.SMALL_HEAD_CONFIGS)]
        assert small and extra and short and configs[:len(tuned)] == tuned
        assert _chosen(name, 96, 96, short_queries=True) == _chosen(name, 32, 16, short_queries=True) == short
        wide_short = [c for c in short if name != "dkdv" or (c.kwargs["BLOCK_N"], c.num_warps) == (64, 8)]
        assert _chosen(name, 256, 256, short_queries=True) == [
            c for c in wide_short
            if launch_configs.shared_memory_bytes(name, c, 256, 256, torch.bfloat16) <= H200_SHARED_BYTES]
        if name == "forward":  # FP8 keeps the tuned lists
            assert _chosen(name, 128, 128, torch.float8_e4m3fn, short_queries=True) == \
                _chosen(name, 128, 128, torch.float8_e4m3fn)
        assert _chosen(name, 64, 64) == tuned and _chosen(name, 16, 8) == tuned
        assert _chosen(name, 128, 128) == _chosen(name, 96, 64) == [c for c in tuned if not any(c is x for x in small)]
        assert _chosen(name, 256, 256) == _chosen(name, 192, 16) == own_lists[name]
        # tile blocks of the tuned lists only: the tile lists are built for those
        tile = "BLOCK_N" if name == "dkdv" else "BLOCK_M"
        assert {c.kwargs[tile] for c in extra} <= {c.kwargs[tile] for c in tuned}
        for dtype in COMPILE_DTYPES:
            for dim in range(1, 257):
                for value_dim in {dim, 64, 256}:
                    if dtype == torch.float8_e4m3fn and name != "forward":
                        continue  # FP8 runs the forward only
                    for c in _chosen(name, dim, value_dim, dtype) + _chosen(name, dim, value_dim, dtype,
                                                                            short_queries=True):
                        need = launch_configs.shared_memory_bytes(name, c, kernel.padded_dim(dim),
                                                                  kernel.padded_dim(value_dim), dtype)
                        assert need <= H200_SHARED_BYTES, (name, dim, value_dim, dtype, c)
        # fp32 at 256: none of the large-head configs fits, the fallback does
        assert _chosen(name, 256, 256, torch.float32) == [c for c in configs if any(c is x for x in
                                                                                    launch_configs.FALLBACK_CONFIGS)]
        # the dk/dv kernel adding dq (JAGGED_ATTENTION_ATOMIC_DQ=1) holds more: its smallest config serves 256
        assert _chosen(name, 256, 256, atomic_dq=True)
        # an A100's 163 KB still serves bf16 at 256
        assert _chosen(name, 256, 256, limit=166912)
        with pytest.raises(ValueError, match="head dim 256, value dim 256"):
            _chosen(name, 256, 256, limit=64 * 1024)
        # a list without the head dim's own configs (a test running one config at a time) is taken whole
        assert launch_configs.choose_configs(name, small[:1], 128, 128, torch.bfloat16,
                                             H200_SHARED_BYTES) == small[:1]


def test_head_dims_above_256_are_refused_with_the_supported_range():
    from kernels.triton.triton_jagged_attention import triton_jagged_attention

    offsets = torch.tensor([0, 2, 5])
    for d, dv in ((257, 64), (64, 512)):
        q, k, v = torch.randn(5, 1, d), torch.randn(5, 1, d), torch.randn(5, 1, dv)
        with pytest.raises(ValueError, match=rf"up to 256 .*head dim {d}, value dim {dv}"):
            triton_jagged_attention(q, k, v, offsets, offsets, False, "softmax", 0.1)


TTGIR_BYTES = {"bf16": 2, "f16": 2, "f32": 4, "i32": 4, "i64": 8}


def _tma_copy_destinations(ttgir: str) -> list[int]:
    """Bytes of each tensor-descriptor copy's shared-memory destination block in a compiled kernel's TTGIR."""
    blocks = re.findall(r"async_tma_copy_global_to_local .*-> !ttg\.memdesc<((?:\d+x)+)(\w+)", ttgir)
    return [math.prod(int(n) for n in shape.split("x") if n) * TTGIR_BYTES.get(kind, 1) for shape, kind in blocks]


def _check_compiled_shared_memory(dims, first_only: bool) -> list[dict]:
    """Every chosen config (or the first) of each kernel at each (head dim, value dim, dtype, options), compiled for
    sm_90a on the host: the compiler's shared memory within the estimate, the estimate within the H200's; and every
    tensor-descriptor copy lands in a block of a multiple of 128 bytes, the alignment a bulk copy's destination
    needs (a pipelined ring of 64-byte blocks faulted on the GPU with a misaligned address)."""
    from benchmarks.kernel_registers import compile_for_hopper
    from kernels.triton import triton_jagged_attention_configs as launch_configs

    rows = []
    for name, tuner in _tuners().items():
        for dim, value_dim, dtype, options in dims:
            if dtype == torch.float8_e4m3fn and name != "forward":
                continue
            compile_options = {k: v for k, v in options.items() if k != "short_queries"}
            split = options.get("split", False)
            for c in _chosen(name, dim, value_dim, dtype, atomic_dq=options.get("atomic_dq", False),
                             short_queries=options.get("short_queries", False),
                             split=split)[:1 if first_only else None]:
                compiled = compile_for_hopper(tuner.fn, c, dim, value_dim, dtype=COMPILE_DTYPES[dtype],
                                              **compile_options)
                # at the widths the pruner estimates: for split dims the sum of their parts, not the padded dims
                need = launch_configs.shared_memory_bytes(name, c, *_computed_dims(dim, value_dim, dtype, split),
                                                          dtype, options.get("atomic_dq", False))
                row = dict(kernel=name, dim=dim, value_dim=value_dim, dtype=str(dtype), **options, **c.kwargs,
                           warps=c.num_warps, stages=c.num_stages, shared=compiled.metadata.shared, estimate=need)
                assert compiled.metadata.shared <= need <= H200_SHARED_BYTES, row
                copies = _tma_copy_destinations(compiled.asm["ttgir"])
                assert all(size % 128 == 0 for size in copies), (row, copies)
                rows.append(dict(row, tma_copies=len(copies)))
    assert any(row["tma_copies"] for row in rows), "no descriptor copy found in the TTGIR: has its syntax changed?"
    return rows


@pytest.mark.skipif(INTERPRETING, reason="compiles for Hopper instead")
def test_first_chosen_configs_fit_hopper_shared_memory_at_head_dim_256_and_short_queries():
    _check_compiled_shared_memory([(256, 256, torch.bfloat16, {}),
                                   (128, 128, torch.bfloat16, {"short_queries": True, "causal": False})],
                                  first_only=True)


@pytest.mark.slow
@pytest.mark.skipif(INTERPRETING, reason="compiles for Hopper instead")
def test_every_chosen_config_fits_hopper_shared_memory():
    """About 250 host compiles (a few minutes): head dims 16 to 256 in bf16; cross dims, SiLU, full attention, fp32,
    the FP8 forward and the dk/dv kernel adding dq (JAGGED_ATTENTION_ATOMIC_DQ=1) at the large dims; the short-query
    configs of a candidate's cross attention (full, softmax and SiLU); dims in two column parts
    (the default), beside the padded ones."""
    dims = [(d, d, torch.bfloat16, {}) for d in (16, 32, 64, 96, 128, 192, 256)]
    dims += [(256, 64, torch.bfloat16, {"silu": True, "causal": False}), (64, 256, torch.bfloat16, {}),
             (256, 256, torch.float32, {}), (128, 128, torch.float32, {}), (256, 256, torch.float8_e4m3fn, {}),
             (128, 128, torch.bfloat16, {"atomic_dq": True}), (256, 256, torch.bfloat16, {"atomic_dq": True})]
    dims += [(d, d, torch.bfloat16, {"short_queries": True, "causal": False, "silu": silu})
             for d, silu in ((32, False), (96, False), (128, True), (256, False))]
    dims += [(48, 48, torch.bfloat16, {"split": True}), (96, 96, torch.bfloat16, {"split": True}),
             (48, 48, torch.float8_e4m3fn, {"split": True}), (96, 96, torch.float8_e4m3fn, {"split": True}),
             (96, 96, torch.bfloat16, {"split": True, "short_queries": True, "causal": False}),
             (192, 64, torch.bfloat16, {"split": True, "silu": True, "causal": False}),
             (96, 96, torch.bfloat16, {"split": True, "atomic_dq": True})]
    _check_compiled_shared_memory(dims, first_only=False)


@pytest.mark.skipif(INTERPRETING, reason="compiles for Hopper instead")
def test_kernels_compile_when_integer_arguments_are_one():
    """Triton passes an integer argument equal to 1 as a constexpr (one token, one sequence, one head), which some
    operations do not take: each kernel compiled for sm_90a on the host with those arguments set to 1."""
    import triton
    from triton.compiler import ASTSource

    from benchmarks.kernel_registers import TARGET, signature
    from kernels.triton import triton_jagged_attention_kernels as device_code

    ones = ("total_q", "total_kv", "num_seqs", "num_heads", "stats_stride", "delta_offset")
    for tuner in (device_code.forward_kernel, device_code.dq_kernel, device_code.dkdv_kernel):
        config = tuner.configs[0]
        types, constexprs = signature(tuner.fn, config, 64)
        constexprs.update({name: 1 for name in ones if name in types})
        types.update({name: "constexpr" for name in ones if name in types})
        triton.compile(ASTSource(fn=tuner.fn, signature=types, constexprs=constexprs), target=TARGET,
                       options={"num_warps": config.num_warps, "num_stages": config.num_stages})
    prologue = device_code.backward_prologue_kernel
    pointers = {"stats_ptr": "*fp32", "q_offsets_ptr": "*i64", "kv_offsets_ptr": "*i64", "tiles_ptr": "*i32",
                "tile_index_ptr": "*i32"}
    types = {n: pointers.get(n, "*bf16") if n.endswith("_ptr") else "constexpr" for n in prologue.arg_names}
    constexprs = {n: 1 for n in prologue.arg_names if types[n] == "constexpr"}
    constexprs.update(HEAD_DIM=64, VALUE_DIM=64, DV_PAD=64, SILU=False, ZERO_DQ=True, BLOCK=64)
    triton.compile(ASTSource(fn=prologue, signature=types, constexprs=constexprs), target=TARGET,
                   options={"num_warps": 4})


@pytest.mark.skipif(INTERPRETING, reason="compiles for Hopper instead")
def test_the_tile_table_kernel_compiles_for_hopper_with_its_parts_as_one_integer():
    """tile_table_kernel decodes its parts from one 64-bit integer (triton_tile_table.part_codes, the globals it
    reads constexprs): compiled for sm_90a on the host, causal and not."""
    import triton
    from triton.compiler import ASTSource

    from benchmarks.kernel_registers import TARGET
    from kernels.triton.triton_tile_table import tile_table_kernel

    pointers = {"q_offsets_ptr": "*i64", "kv_offsets_ptr": "*i64", "tiles_ptr": "*i32", "index_ptr": "*i32"}
    types = {p.name: pointers.get(p.name, "constexpr" if p.is_constexpr else "i64" if p.name == "part_codes"
                                  else "i32") for p in tile_table_kernel.params}
    for causal in (True, False):
        triton.compile(ASTSource(fn=tile_table_kernel, signature=types,
                                 constexprs={"CAUSAL": causal, "TILES": 16, "SEQS": 128}), target=TARGET,
                       options={"num_warps": 4})


@pytest.mark.skipif(INTERPRETING, reason="needs no interpreter")
@pytest.mark.skipif(INTERPRETING, reason="the interpreter does not specialise")
def test_kernels_compile_no_variant_per_batch_size():
    """Every integer argument that a batch's sizes set is left unspecialised (Triton would otherwise compile a variant
    per class: equal to 1, divisible by 16), so no new batch compiles a kernel inside a step; the statistics' stride
    and offset are multiples of 16 for every batch, one class, and stay specialised."""
    import triton

    from kernels.triton import triton_jagged_attention as kernel
    from kernels.triton import triton_jagged_attention_kernels as device_code
    from kernels.triton.triton_tile_table import tile_table_kernel

    functions = {"tile_table_kernel": tile_table_kernel, **{
        name: getattr(device_code, name) for name in ("forward_kernel", "backward_prologue_kernel", "dq_kernel",
                                                      "dkdv_kernel")}}
    for name, function in functions.items():
        jit = function.fn if isinstance(function, triton.runtime.Autotuner) else function  # it wraps the JIT function
        arguments = [p.name for p in jit.params]
        unspecialised = {p.name for p in jit.params if p.do_not_specialize}
        batch = {"num_seqs", "total_q", "total_kv"} & set(arguments)
        assert unspecialised == batch, (name, unspecialised, batch)
        assert name in ("dq_kernel", "dkdv_kernel") or batch, name  # these take no count of the batch
    for total_q in (0, 1, 5, 16, 17, 1023, 530_001):
        for num_seqs in (1, 3, 16, 1024):
            stride = kernel.stats_stride(total_q, num_seqs)
            assert stride % 16 == 0 and stride >= ((total_q + 3) // 4) * 4 + 4 * num_seqs + 4


def test_tuned_launch_tunes_once_per_key_then_calls_the_chosen_config(monkeypatch):
    """The autotuner runs on a new key (or when its configs are swapped); later launches with that key call the
    kernel with the chosen config directly, with the descriptors' blocks set as the config's pre-hook sets them.
    (No tuning store: tests/test_tuning_store.py.)"""
    import triton
    from triton.tools.tensor_descriptor import TensorDescriptor

    from kernels.triton import triton_jagged_attention as kernel
    from kernels.triton import triton_jagged_attention_configs as launch_configs
    from kernels.triton.tuning_store import TuningStore

    monkeypatch.setattr(kernel._TunedLaunch, "store", TuningStore(None))

    class Recorder:
        def __init__(self, log, what):
            self.log, self.what = log, what

        def __getitem__(self, grid):
            return lambda *args, **kwargs: self.log.append((self.what, args, kwargs))

    class Tuner(Recorder):
        def __init__(self, log, configs):
            super().__init__(log, "tuned")
            self.configs, self.fn = configs, Recorder(log, "direct")

        def __getitem__(self, grid):
            self.best_config = self.configs[-1]
            return super().__getitem__(grid)

    log: list = []
    configs = [triton.Config({"BLOCK_N": n}, num_warps=4, num_stages=2) for n in (32, 64)]
    launch = kernel._TunedLaunch(Tuner(log, configs), launch_configs.KV_DESCRIPTORS)
    k = torch.zeros(40, 2, 16)
    k_desc = TensorDescriptor(k, [40, 32], [32, 1], [16, 16])
    for _ in range(2):
        launch(None, ("key",), {"k_desc": k_desc, "v_desc": k}, k_desc, 7, D_PAD=16, DV_PAD=16)
    launch(None, ("other key",), {"k_desc": k_desc, "v_desc": k}, k_desc, 7, D_PAD=16, DV_PAD=16)
    assert [what for what, _, _ in log] == ["tuned", "direct", "tuned"]
    _, args, kwargs = log[1]
    assert args == (k_desc, 7) and kwargs == {"D_PAD": 16, "DV_PAD": 16, **configs[-1].all_kwargs()}
    assert k_desc.block_shape == [64, 16]
    launch.tuner.configs = configs[:1]  # swapped, as a test running each config does: tuned again
    launch(None, ("key",), {"k_desc": k_desc, "v_desc": k}, k_desc, 7, D_PAD=16, DV_PAD=16)
    assert log[-1][0] == "tuned"


def test_quantize_fp8_gives_the_factors_that_restore_the_inputs():
    x = torch.randn(40, 3, 16) * 5
    (x8,), (factor,) = quantize_fp8(x)
    assert x8.dtype == torch.float8_e4m3fn and x8.shape == x.shape
    assert x8.float().abs().max() == 448.0  # the absolute maximum lands on e4m3's largest value
    assert ((x8.float() * factor - x).norm() / x.norm()).item() < 0.05  # e4m3 keeps 3 mantissa bits


def test_fp8_inputs_are_checked_before_any_kernel_runs():
    q = torch.randn(5, 1, 8)
    offsets = torch.tensor([0, 2, 5])
    with pytest.raises(ValueError, match="descale applies to float8_e4m3fn inputs only"):
        jagged_attention(q, q, q, offsets, descale=(1.0, 1.0, 1.0))
    q8 = q.to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="all float8_e4m3fn"):
        jagged_attention(q8, q8, q, offsets)
    with pytest.raises(ValueError, match="forward only"):
        jagged_attention(q8.requires_grad_(), q8, q8, offsets)
    with torch.no_grad(), pytest.raises(ValueError, match="descale of k must be one number"):
        jagged_attention(q8, q8, q8, offsets, descale=(1.0, torch.ones(2), 1.0))


@pytest.mark.skipif(INTERPRETING, reason="the interpreter lets the kernel take CPU tensors")
def test_kernel_is_registered_and_leaves_cpu_tensors_to_the_reference():
    assert "triton" in available_backends()
    q = torch.randn(5, 1, 8)
    offsets = torch.tensor([0, 2, 5])
    with pytest.raises(ValueError, match="backend 'triton' cannot run"):
        jagged_attention(q, q, q, offsets, backend="triton")
