"""Row-wise Adagrad's update of an embedding table from a dense gradient, in place (gem_ops.train.optimizer's
dense path): the Triton kernel where it runs (kernels.triton.triton_rowwise_adagrad.supports), else the PyTorch
reference, which is also its oracle."""

from __future__ import annotations

import torch

from kernels.pytorch.pt_rowwise_adagrad import pt_rowwise_adagrad_

try:
    from kernels.triton.triton_rowwise_adagrad import supports as _triton_supports
    from kernels.triton.triton_rowwise_adagrad import triton_rowwise_adagrad_
except ImportError:  # no Triton on this machine: the reference serves alone
    triton_rowwise_adagrad_ = None


def rowwise_adagrad_(param: torch.Tensor, grad: torch.Tensor, state_sum: torch.Tensor, lr: float, eps: float) -> None:
    """param [rows, dim] -= lr * grad / (sqrt(state_sum) + eps) after state_sum [rows, 1] += mean(grad^2) per row."""
    if grad.shape != param.shape or state_sum.shape != (param.shape[0], 1):
        raise ValueError(f"rowwise_adagrad_: param {tuple(param.shape)}, grad {tuple(grad.shape)} and state_sum "
                         f"{tuple(state_sum.shape)} must be [rows, dim], [rows, dim] and [rows, 1]")
    if triton_rowwise_adagrad_ is not None and _triton_supports(param, grad, state_sum):
        triton_rowwise_adagrad_(param, grad, state_sum, lr, eps)
    else:
        pt_rowwise_adagrad_(param, grad, state_sum, lr, eps)
