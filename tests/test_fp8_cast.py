"""kernels.fp8_cast: the Triton casts against the PyTorch reference (layouts, padding, scale, column
sums), on CPU under the Triton interpreter and on a GPU (marked gpu), and the reference's own contract.

The interpreter's float32 -> float8 conversion mishandles a rounding that carries into the exponent
(127.2 -> 64 in e4m3), so the interpreter cases use values exact in FP8 once scaled: there the cast
involves no rounding, and everything else (scale, saturation, both layouts, zero padding, sums) must
match bit for bit. The GPU cases take random values and compare every rounding too.
"""

from __future__ import annotations

import os

import pytest
import torch

from kernels.fp8_cast import cast_to_fp8
from kernels.pytorch.pt_fp8_cast import FP8_MAX, pt_cast_to_fp8

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
SHAPES = [(1, 16), (37, 50), (100, 33), (64, 128), (300, 20)]


def _exact_in_fp8(rows: int, cols: int, dtype: torch.dtype, in_dtype: torch.dtype) -> torch.Tensor:
    """Values whose scaled copies are FP8 numbers: FP8 values over a power of two, with the format's
    maximum among them, so the scale is exactly that power of two."""
    grid = torch.randn(rows, cols).mul(FP8_MAX[dtype] / 8).clamp(-FP8_MAX[dtype], FP8_MAX[dtype]).to(dtype).float()
    grid.view(-1)[torch.randint(rows * cols, ())] = -FP8_MAX[dtype]
    return (grid / 64).to(in_dtype)


def _check_against_reference(x: torch.Tensor, dtype: torch.dtype):
    got = cast_to_fp8(x, dtype, transposed=True, column_sums=True)
    want = pt_cast_to_fp8(x.cpu(), dtype, True, True)
    names = ("x8", "x8_t", "inverse scale")
    for name, a, b in zip(names, got[:3], want[:3]):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert torch.equal(a.cpu().float(), b.float()), name
    torch.testing.assert_close(got[3].cpu(), want[3], rtol=1e-5, atol=1e-4 * x.shape[0])


@pytest.mark.skipif(not INTERPRETING, reason="runs inside the interpreter subprocess of test_interpreter_cases")
@pytest.mark.parametrize("shape", SHAPES if INTERPRETING else [])
@pytest.mark.parametrize("dtype", [E4M3, E5M2])
@pytest.mark.parametrize("in_dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_reference_on_cpu_interpreter(shape, dtype, in_dtype):
    from kernels.triton.triton_fp8_cast import supports

    torch.manual_seed(hash((shape, str(dtype), str(in_dtype))) % 2**31)
    x = _exact_in_fp8(*shape, dtype, in_dtype)
    assert supports(x)
    _check_against_reference(x, dtype)


@pytest.mark.skipif(not INTERPRETING, reason="runs inside the interpreter subprocess of test_interpreter_cases")
@pytest.mark.parametrize("bad", [float("nan"), float("inf")] if INTERPRETING else [])
def test_non_finite_values_come_out_nan_on_cpu_interpreter(bad):
    _non_finite_comes_out_nan(bad)


def _non_finite_comes_out_nan(bad: float, device: str = "cpu"):
    """A gradient that overflowed must reach the training loop's divergence check as NaN, not as zeros."""
    x = torch.randn(20, 16, device=device)
    x[3, 5] = bad
    for x8, x8_t, _, _ in (cast_to_fp8(x, E5M2), pt_cast_to_fp8(x, E5M2, True, False)):
        assert x8.float()[3, 5].isnan() and x8_t.float()[5, 3].isnan()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_values_come_out_nan_on_gpu(bad):
    _non_finite_comes_out_nan(bad, "cuda")


def test_reference_turns_non_finite_values_into_nan():
    for bad in (float("nan"), float("inf"), -float("inf")):
        _non_finite_comes_out_nan(bad)


@pytest.mark.skipif(INTERPRETING, reason="this is the interpreter run itself")
def test_interpreter_cases(interpreter_runs):
    interpreter_runs.check(__file__, expected_passed=len(SHAPES) * 4 + 2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("shape", SHAPES + [(4099, 2048), (65536, 384)])
@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_kernel_matches_reference_on_gpu(shape, dtype):
    torch.manual_seed(0)
    x = (torch.randn(*shape, device="cuda") * 3).to(torch.bfloat16)
    _check_against_reference(x, dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("in_dtype", [torch.float32, torch.bfloat16])
def test_every_kernel_config_matches_reference_on_gpu(monkeypatch, in_dtype):
    """Each tile config of both kernels in turn (autotuning keeps one per width, so the other configs are never
    checked by the cases above), at a narrow model's widths and fp32 input as well as bf16: the transposed copy
    goes through an FP8 transpose in registers, whose layout depends on the tile."""
    import triton

    import kernels.triton.triton_fp8_cast as triton_cast

    for reduce_config in triton_cast._REDUCE_CONFIGS:
        for cast_config in triton_cast._CAST_CONFIGS:
            for name, kernel, config in (("_column_max_sum_kernel", triton_cast._column_max_sum_kernel, reduce_config),
                                         ("_cast_kernel", triton_cast._cast_kernel, cast_config)):
                monkeypatch.setattr(triton_cast, name, triton.autotune(configs=[config], key=kernel.keys)(kernel.fn))
            for shape in ((74, 32), (96, 64), (37, 32), (64, 96), (300, 256)):
                torch.manual_seed(shape[0])
                x = (torch.randn(*shape, device="cuda") * 3).to(in_dtype)
                for dtype in (E4M3, E5M2):
                    try:
                        _check_against_reference(x, dtype)
                    except AssertionError as error:
                        raise AssertionError(f"{reduce_config} / {cast_config}, {shape} {in_dtype} -> {dtype}: "
                                             f"{error}") from error


@pytest.mark.skipif(INTERPRETING, reason="compiles for Hopper on the host; no interpreter involved")
@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_cast_kernel_compiles_without_nan_propagating_min_max(dtype):
    """The cast kernel as ptxas would get it for an H200 (compiled on the host) saturates without min.NaN / max.NaN,
    which triton-lang/triton#11111 reports corrupting transposed FP8 stores."""
    import re

    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    import kernels.triton.triton_fp8_cast as triton_cast

    out = {E4M3: "*fp8e4nv", E5M2: "*fp8e5"}[dtype]
    signature = {"x_ptr": "*fp32", "scale_ptr": "*fp32", "out_ptr": out, "out_t_ptr": out, "M": "i32", "N": "i32",
                 "M_PAD": "i32", "stride": "i32", "FP8_LIMIT": "constexpr", "TRANSPOSED": "constexpr",
                 "BLOCK_M": "constexpr", "BLOCK_N": "constexpr"}
    for config in triton_cast._CAST_CONFIGS:
        constexprs = {"FP8_LIMIT": FP8_MAX[dtype], "TRANSPOSED": True, **config.kwargs}
        compiled = triton.compile(ASTSource(fn=triton_cast._cast_kernel.fn, signature=signature, constexprs=constexprs),
                                  target=GPUTarget("cuda", 90, 32), options={"num_warps": config.num_warps})
        ptx = compiled.asm["ptx"]
        assert re.search(r"cvt\.rn\.satfinite\.e[45]m[23]x2", ptx), "no FP8 conversion found: not the cast kernel?"
        assert not re.search(r"(?:min|max)\.NaN", ptx), f"{config}: NaN-propagating min/max in the cast kernel"


def test_reference_scales_to_the_format_maximum_and_pads_with_zeros():
    x = torch.tensor([[1.0, -2.0], [0.5, 0.25], [4.0, 0.0]])
    x8, x8_t, inverse, sums = pt_cast_to_fp8(x, E4M3, True, True)
    assert x8.float().abs().max() == 448.0  # the absolute maximum lands on e4m3's largest value
    assert inverse.item() == pytest.approx(4.0 / 448.0)
    assert x8_t.shape == (2, 16) and torch.equal(x8_t[:, :3].float(), x8.t().float())
    assert not x8_t[:, 3:].float().any()
    torch.testing.assert_close(sums, torch.tensor([5.5, -1.75]))
    torch.testing.assert_close(x8.float() * inverse, x, rtol=0.07, atol=0)  # e4m3 keeps 3 mantissa bits


def test_all_zero_and_empty_tensors_get_finite_scales():
    x8, _, inverse, _ = cast_to_fp8(torch.zeros(4, 16))
    assert torch.isfinite(inverse) and not x8.float().any()
    x8, x8_t, inverse, sums = cast_to_fp8(torch.zeros(0, 16), column_sums=True)
    assert x8.shape == (0, 16) and x8_t.shape == (16, 0) and torch.isfinite(inverse) and not sums.any()


def test_flat_transposed_copy_holds_the_2d_copys_elements():
    """flat=True (what the FP8 linear layers save for their backward) hands the transposed copy over in one
    dimension: the same bytes as the [columns, padded rows] copy, whose strides would depend on the batch."""
    x = torch.randn(37, 48)
    _, x8_t, _, _ = cast_to_fp8(x)
    _, flat, _, _ = cast_to_fp8(x, flat=True)
    assert x8_t.shape == (48, 48) and flat.shape == (48 * 48,)
    assert torch.equal(flat.view(torch.uint8), x8_t.reshape(-1).view(torch.uint8))
    assert cast_to_fp8(x, transposed=False, flat=True)[1].numel() == 0


def test_bad_input_names_what_is_wrong():
    with pytest.raises(ValueError, match="2-D"):
        cast_to_fp8(torch.zeros(2, 3, 4))
    with pytest.raises(ValueError, match="dtype must be one of"):
        cast_to_fp8(torch.zeros(2, 16), torch.bfloat16)
