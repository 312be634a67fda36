"""The dense gradients' norm each step (clipped to a maximum when one is set), and, when a step goes non-finite,
which parameters' gradients carry the NaN or inf: a diverging run names where it broke instead of only its loss."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.distributed.tensor import DTensor


def dense_gradient_norm(parameters: Sequence[nn.Parameter], max_norm: float) -> torch.Tensor:
    """The total 2-norm of the parameters' gradients (over every rank's shards), scaling them down to
    `max_norm` when it is positive and the norm exceeds it. A 0-d tensor on the gradients' device."""
    if max_norm > 0:
        norm = torch.nn.utils.clip_grad_norm_(parameters, max_norm)
    else:
        grads = [p.grad for p in parameters if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())
    return norm.full_tensor() if isinstance(norm, DTensor) else norm


def nonfinite_gradients(module: nn.Module) -> list[str]:
    """Names of the parameters whose gradient (this rank's shard of it) holds a NaN or an inf, in model order."""
    names = []
    for name, parameter in module.named_parameters():
        grad = parameter.grad
        if grad is None:
            continue
        local = _local(grad)
        if local.is_sparse:
            local = local.coalesce().values()
        if not bool(torch.isfinite(local).all()):
            names.append(name)
    return names


def nonfinite_flags(parameters: Sequence[nn.Parameter]) -> tuple[list[int], torch.Tensor | None]:
    """The indices of `parameters` that hold a gradient and, on its device, whether each (this rank's shard) holds a
    NaN or an inf: kept with a step that is read late, when the gradients themselves are the next step's."""
    held = [i for i, p in enumerate(parameters) if p.grad is not None]
    if not held:
        return held, None
    grads = [_local(parameters[i].grad) for i in held]
    largest = torch._foreach_norm(grads, float("inf"))  # max |g|: inf or NaN exactly where a gradient holds one
    return held, ~torch.isfinite(torch.stack(largest))


def _local(grad: torch.Tensor) -> torch.Tensor:
    return grad.to_local() if isinstance(grad, DTensor) else grad


def divergence_message(step: int, loss: float, grad_norm: float, names: Sequence[str], shown: int = 8) -> str:
    where = ", ".join(names[:shown]) + (f" (+{len(names) - shown} more)" if len(names) > shown else "")
    return (f"training diverged at step {step}: loss {loss}, dense gradient norm {grad_norm}; "
            + (f"non-finite gradients in {where}" if names else "no parameter's gradient is non-finite on this rank")
            + "; lower lr_dense/lr_sparse, or train in bf16 to tell a precision problem from an unstable setting")
