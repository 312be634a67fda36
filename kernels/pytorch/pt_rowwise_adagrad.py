"""Row-wise Adagrad's update of a dense table gradient, in PyTorch: the oracle of the Triton kernel and the path
everywhere it does not run. One accumulator per row: sum += mean(g^2) over the row; param -= lr * g / (sqrt(sum) +
eps) (TorchRec's RowWiseAdagrad)."""

from __future__ import annotations

import torch


def pt_rowwise_adagrad_(param: torch.Tensor, grad: torch.Tensor, state_sum: torch.Tensor, lr: float,
                        eps: float) -> None:
    """In place: param [rows, dim], grad [rows, dim], state_sum [rows, 1]."""
    state_sum += grad.pow(2).mean(1, keepdim=True)
    param.addcdiv_(grad, state_sum.sqrt().add_(eps), value=-lr)
