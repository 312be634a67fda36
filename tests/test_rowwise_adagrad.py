"""kernels.rowwise_adagrad: the one-pass Triton update against the PyTorch reference (TorchRec's row-wise Adagrad),
on CPU under the Triton interpreter and on a GPU (marked gpu); which tensors take the kernel; and the optimizer's
dense path equal to TorchRec's own optimizer."""

from __future__ import annotations

import os

import pytest
import torch
from torchrec.optim import RowWiseAdagrad

from kernels.pytorch.pt_rowwise_adagrad import pt_rowwise_adagrad_
from kernels.rowwise_adagrad import rowwise_adagrad_

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
SHAPES = [(1, 1), (37, 50), (9, 64), (5, 1056), (70, 3)]  # rows past a program's, widths off a power of two


def _case(rows: int, dim: int, device: str = "cpu", seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    param = torch.randn(rows, dim, generator=generator)
    grad = torch.randn(rows, dim, generator=generator) * torch.rand(rows, 1, generator=generator)
    grad[rows // 2] = 0.0  # a row no batch looked up keeps its weights and its sum
    state = torch.rand(rows, 1, generator=generator)
    return param.to(device), grad.to(device), state.to(device)


def _check_against_reference(rows: int, dim: int, device: str):
    param, grad, state = _case(rows, dim, device)
    want_param, want_state = param.cpu().clone(), state.cpu().clone()
    for step in range(3):  # the sums carry over from step to step
        rowwise_adagrad_(param, grad, state, lr=0.05, eps=1e-8)
        pt_rowwise_adagrad_(want_param, grad.cpu(), want_state, lr=0.05, eps=1e-8)
        torch.testing.assert_close(state.cpu(), want_state, rtol=1e-6, atol=1e-7, msg=f"step {step}: sum")
        torch.testing.assert_close(param.cpu(), want_param, rtol=1e-6, atol=1e-6, msg=f"step {step}: param")
    untouched = rows // 2
    assert torch.equal(param[untouched].cpu(), _case(rows, dim)[0][untouched])


@pytest.mark.skipif(not INTERPRETING, reason="runs inside the interpreter subprocess of test_interpreter_cases")
@pytest.mark.parametrize("shape", SHAPES if INTERPRETING else [])
def test_kernel_matches_reference_on_cpu_interpreter(shape):
    from kernels.triton.triton_rowwise_adagrad import supports

    assert supports(*_case(*shape))  # the kernel, not the reference, ran
    _check_against_reference(*shape, "cpu")


@pytest.mark.skipif(not INTERPRETING, reason="runs inside the interpreter subprocess of test_interpreter_cases")
def test_rows_of_zero_gradient_come_out_as_the_reference_leaves_them_on_cpu_interpreter():
    """Rows of zero gradient are skipped only where the update leaves them as they are: a zero sum with eps 0
    (0 / 0), a NaN or infinite sum, and a NaN in the gradient all give the reference's NaNs."""
    param, grad, state = _case(6, 8)
    grad[1:5] = 0.0
    grad[5, 3] = float("nan")
    state[1], state[2], state[3] = 0.0, float("nan"), float("inf")
    for eps in (1e-8, 0.0):
        got_param, got_state = param.clone(), state.clone()
        want_param, want_state = param.clone(), state.clone()
        rowwise_adagrad_(got_param, grad, got_state, lr=0.05, eps=eps)
        pt_rowwise_adagrad_(want_param, grad, want_state, lr=0.05, eps=eps)
        torch.testing.assert_close(got_state, want_state, equal_nan=True, msg=f"eps {eps}: sum")
        torch.testing.assert_close(got_param, want_param, equal_nan=True, msg=f"eps {eps}: param")
        assert torch.equal(got_param[4], param[4])  # a finite sum, zero gradient: left as it was


@pytest.mark.skipif(INTERPRETING, reason="this is the interpreter run itself")
def test_interpreter_cases(interpreter_runs):
    interpreter_runs.check(__file__, expected_passed=len(SHAPES) + 2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("shape", [*SHAPES, (262_144, 1056), (4099, 8192)])
def test_kernel_matches_reference_on_gpu(shape):
    from kernels.triton.triton_rowwise_adagrad import supports

    assert supports(*_case(*shape, "cuda"))
    _check_against_reference(*shape, "cuda")


@pytest.mark.skipif(not INTERPRETING, reason="runs inside the interpreter subprocess of test_interpreter_cases")
def test_which_tensors_the_kernel_takes_on_cpu_interpreter():
    from kernels.triton.triton_rowwise_adagrad import supports

    param, grad, state = _case(4, 8)
    assert supports(param, grad, state)
    for bad in (dict(param=param.double()), dict(grad=grad[:, :4]), dict(state=state.view(-1)),
                dict(state=torch.rand(4, 2)[:, :1]), dict(param=torch.empty(4, 8192 + 1)),
                dict(grad=grad.t().contiguous().t())):
        args = {"param": param, "grad": grad, "state": state, **bad}
        assert not supports(args["param"], args["grad"], args["state"]), list(bad)


@pytest.mark.skipif(INTERPRETING, reason="outside the interpreter")
def test_cpu_tensors_take_the_reference_outside_the_interpreter():
    from kernels.triton.triton_rowwise_adagrad import supports

    assert not supports(*_case(4, 8))
    _check_against_reference(4, 8, "cpu")


def test_bad_shapes_are_named():
    param, grad, state = _case(4, 8)
    with pytest.raises(ValueError, match=r"param \(4, 8\), grad \(4, 7\) and state_sum \(4, 1\)"):
        rowwise_adagrad_(param, grad[:, :7], state, 0.1, 1e-8)


def test_the_optimizers_dense_path_equals_torchrecs():
    from gem_ops.train.optimizer import SparseRowWiseAdagrad

    torch.manual_seed(0)
    tables = [torch.nn.Parameter(torch.randn(30, 12)) for _ in range(2)]
    theirs = RowWiseAdagrad([tables[0]], lr=0.1, lr_decay=0.01, eps=1e-8)
    ours = SparseRowWiseAdagrad([tables[1]], lr=0.1, lr_decay=0.01, eps=1e-8)
    tables[1].data.copy_(tables[0].data)
    for step in range(3):
        grad = torch.randn(30, 12)
        for table, optimizer in zip(tables, (theirs, ours)):
            table.grad = grad.clone()
            optimizer.step()
        torch.testing.assert_close(tables[1], tables[0], msg=f"step {step}")
        torch.testing.assert_close(ours.state[tables[1]]["sum"], theirs.state[tables[0]]["sum"])
