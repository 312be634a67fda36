"""kernels.table_gradient: the Triton table gradient against the PyTorch reference (and PyTorch's own embedding
backward on a GPU), on CPU under the Triton interpreter and on a GPU (marked gpu): runs of one id that cross many
chunks, two parts, bf16 gradients, int32 ids, strided rows, no ids; the same bits from run to run; which tensors
take the kernel; bad shapes named."""

from __future__ import annotations

import os

import pytest
import torch

from kernels.pytorch.pt_table_gradient import pt_table_gradient
from kernels.table_gradient import table_gradient
from tests.triton_interpreter import run_interpreter_cases

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
# (part sizes, rows, width, skew): skew > 0 draws ids from a Zipf-like law, so one row holds most of them
CASES = [((50,), 7, 5, 0.0), ((100, 13), 30, 130, 0.0), ((64,), 3, 8, 0.0), ((1,), 1, 1, 0.0),
         ((33, 7), 1000, 16, 0.0), ((200, 3), 4, 3, 2.0), ((0,), 5, 4, 0.0), ((90,), 400, 260, 1.5)]
# The widest case under the interpreter runs with the slow tests (test_every_interpreter_case): the others take every
# path already (column blocks past the first, skewed runs across many chunks, two parts, many rows).
SLOW_INTERPRETER_CASES = [((90,), 400, 260, 1.5)]
INTERPRETER_CASES = [pytest.param(case, marks=pytest.mark.slow) if case in SLOW_INTERPRETER_CASES else case
                     for case in CASES]


def _case(sizes, rows, dim, skew, device="cpu", dtype=torch.float32, id_dtype=torch.int64, seed=0):
    generator = torch.Generator().manual_seed(seed)
    grads, ids = [], []
    for n in sizes:
        if skew:
            weights = torch.arange(1, rows + 1, dtype=torch.float64) ** -skew
            index = torch.multinomial(weights, n, replacement=True, generator=generator) if n else torch.zeros(0)
        else:
            index = torch.randint(0, rows, (n,), generator=generator)
        ids.append(index.to(device=device, dtype=id_dtype))
        grads.append(torch.randn(n, dim, generator=generator).to(device=device, dtype=dtype))
    return grads, ids


def _check(sizes, rows, dim, skew, device, dtype=torch.float32, id_dtype=torch.int64):
    grads, ids = _case(sizes, rows, dim, skew, device, dtype, id_dtype)
    got = table_gradient(grads, ids, rows)
    want = pt_table_gradient([g.cpu().double() for g in grads], [i.cpu().long() for i in ids], rows)
    assert got.dtype == torch.float32 and got.shape == (rows, dim)
    tolerance = 1e-5 * max(1, max(sizes)) ** 0.5
    torch.testing.assert_close(got.cpu(), want.float(), rtol=tolerance, atol=tolerance)
    assert torch.equal(table_gradient(grads, ids, rows), got)  # the same sums, in the same order


@pytest.mark.skipif(not INTERPRETING, reason="runs inside the interpreter subprocess of test_interpreter_cases")
@pytest.mark.parametrize("case", INTERPRETER_CASES if INTERPRETING else [])
def test_kernel_matches_reference_on_cpu_interpreter(case):
    from kernels.triton.triton_table_gradient import supports

    assert supports(*_case(*case))  # the kernel, not the reference, ran
    _check(*case, "cpu")


@pytest.mark.skipif(not INTERPRETING, reason="runs inside the interpreter subprocess of test_interpreter_cases")
def test_bf16_gradients_int32_ids_and_strided_rows_on_cpu_interpreter():
    _check((40, 9), 6, 12, 1.0, "cpu", dtype=torch.bfloat16, id_dtype=torch.int32)
    grads, ids = _case((30,), 5, 24, 1.0)
    strided = [grads[0][:, :20]]  # rows 24 apart, 20 wide
    torch.testing.assert_close(table_gradient(strided, ids, 5), pt_table_gradient(strided, ids, 5),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not INTERPRETING, reason="runs inside the interpreter subprocess of test_interpreter_cases")
def test_which_tensors_the_kernel_takes_on_cpu_interpreter():
    from kernels.triton.triton_table_gradient import supports

    grads, ids = _case((6, 4), 5, 8, 0.0)
    assert supports(grads, ids)
    three = _case((3, 3, 3), 5, 8, 0.0)
    for bad_grads, bad_ids in ((three[0], three[1]), ([grads[0].double()], ids[:1]), ([grads[0].t()], ids[:1]),
                               (grads[:1], [ids[0].float()]), (grads[:1], [ids[0][:, None]])):
        assert not supports(bad_grads, bad_ids)
    _check((3, 3, 3), 5, 8, 0.0, "cpu")  # three parts take the reference


@pytest.mark.skipif(not INTERPRETING, reason="runs inside the interpreter subprocess of test_interpreter_cases")
def test_an_unknown_kernel_setting_is_named_on_cpu_interpreter(monkeypatch):
    monkeypatch.setenv("GEM_TABLE_GRADIENT", "fast")
    with pytest.raises(ValueError, match="GEM_TABLE_GRADIENT='fast': must be 'triton'"):
        table_gradient(*_case((4,), 3, 2, 0.0), 3)


@pytest.mark.skipif(INTERPRETING, reason="this is the interpreter run itself")
def test_interpreter_cases(interpreter_runs):
    interpreter_runs.check(__file__, expected_passed=len(CASES) - len(SLOW_INTERPRETER_CASES) + 3)


@pytest.mark.slow
@pytest.mark.skipif(INTERPRETING, reason="this is the interpreter run itself")
def test_every_interpreter_case():
    run_interpreter_cases(__file__, expected_passed=len(CASES) + 3, markers="")


@pytest.mark.skipif(INTERPRETING, reason="outside the interpreter")
def test_cpu_tensors_take_the_reference_outside_the_interpreter():
    from kernels.triton.triton_table_gradient import supports

    assert not supports(*_case((5,), 3, 4, 0.0))
    _check((5, 2), 3, 4, 0.0, "cpu")


def test_bad_shapes_are_named():
    grads, ids = _case((4, 3), 5, 8, 0.0)
    with pytest.raises(ValueError, match=r"part 1: gradient \(3, 7\) and ids \(3,\) must be \[n, 8\] and \[n\]"):
        table_gradient([grads[0], grads[1][:, :7]], ids, 5)
    with pytest.raises(ValueError, match="one id tensor per gradient, got 2 gradients and 1 id tensors"):
        table_gradient(grads, ids[:1], 5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("case", [*CASES, ((254_772, 4096), 262_144, 1024, 1.1), ((254_772,), 4096, 1024, 3.0)])
def test_kernel_matches_reference_on_gpu(case):
    _check(*case, "cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_kernel_matches_pytorchs_embedding_backward_on_gpu(monkeypatch):
    grads, ids = _case((20_000, 512), 3000, 256, 1.2, "cuda", dtype=torch.bfloat16)
    got = table_gradient(grads, ids, 3000)
    monkeypatch.setenv("GEM_TABLE_GRADIENT", "aten")
    torch.testing.assert_close(got, table_gradient(grads, ids, 3000), rtol=1e-4, atol=1e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_batches_of_other_sizes_compile_no_new_variant_on_gpu():
    """A batch's sizes (ids, chunks, the first part's length) are not specialised on: a size of another class
    (1, a multiple of 16, neither) met in a later step costs no compile."""
    from kernels.triton import triton_table_gradient as kernels

    def variants() -> int:
        return sum(len(caches[0]) for f in (kernels._chunk_sums_kernel, kernels._carries_kernel)
                   for caches in f.device_caches.values())

    table_gradient(*_case((37, 5), 50, 64, 1.0, "cuda"), 50)
    before = variants()
    for sizes in ((1, 1), (64, 16), (1000, 3), (17,)):
        _check(sizes, 50, 64, 1.0, "cuda")
    assert variants() == before
