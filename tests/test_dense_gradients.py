"""gem_ops.train.gradients.clip_dense_gradients: the norm and the clipped gradients of torch's clip_grad_norm_ to the
bit, and each parameter's non-finite flag read before the clipping spreads a NaN to all of them."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gem_ops.train.gradients import clip_dense_gradients


def _model_with_gradients(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 5), nn.GELU(), nn.Linear(5, 3), nn.LayerNorm(3), nn.Linear(3, 1))
    model[2].bias.requires_grad_(False)  # a parameter without a gradient is left out of the flags
    model(torch.randn(16, 6)).square().mean().backward()
    return model


@pytest.mark.parametrize("max_norm", [0.0, 1e-3, 1e3])
def test_the_norm_and_the_clipped_gradients_are_torchs_to_the_bit(max_norm):
    ours, theirs = _model_with_gradients(), _model_with_gradients()
    parameters = list(ours.parameters())
    norm, (held, flags) = clip_dense_gradients(parameters, max_norm)
    want = (torch.nn.utils.clip_grad_norm_(theirs.parameters(), max_norm) if max_norm > 0
            else torch.nn.utils.get_total_norm([p.grad for p in theirs.parameters() if p.grad is not None]))
    assert torch.equal(norm, want)
    for mine, other in zip(parameters, theirs.parameters()):
        assert (mine.grad is None and other.grad is None) or torch.equal(mine.grad, other.grad)
    assert held == [i for i, p in enumerate(parameters) if p.grad is not None] and len(held) == len(parameters) - 1
    assert not flags.any()


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_the_parameter_that_broke_is_flagged_alone(bad):
    model = _model_with_gradients()
    parameters = list(model.parameters())
    parameters[2].grad[1, 1] = bad
    norm, (held, flags) = clip_dense_gradients(parameters, 1.0)
    assert not torch.isfinite(norm)
    assert [i for i, flag in zip(held, flags.tolist()) if flag] == [2]
    if bad != bad:  # a NaN norm: clipping has made every gradient NaN, so only flags read before it tell
        assert all(torch.isnan(p.grad).all() for p in parameters if p.grad is not None)


def test_no_gradient_gives_a_zero_norm_and_no_flags():
    model = nn.Linear(3, 2)
    norm, (held, flags) = clip_dense_gradients(list(model.parameters()), 1.0)
    assert float(norm) == 0.0 and held == [] and flags is None
