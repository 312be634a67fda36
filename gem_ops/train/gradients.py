"""The dense gradients' norm each step (clipped to a maximum when one is set), and, when a step goes non-finite,
which parameters' gradients carry the NaN or inf: a diverging run names where it broke instead of only its loss."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.distributed.tensor import DTensor


def clip_dense_gradients(parameters: Sequence[nn.Parameter], max_norm: float
                         ) -> tuple[torch.Tensor, tuple[list[int], torch.Tensor | None]]:
    """The total 2-norm of the parameters' gradients (over every rank's shards), scaling them down to `max_norm`
    when it is positive and the norm exceeds it; and, read before that scaling, the indices of the parameters that
    hold a gradient with, on its device, whether each (this rank's shard) holds a NaN or an inf. Read after it, one
    NaN would have made every gradient NaN (the scale is max_norm / a NaN norm).

    The flags come from the per-parameter norms the total is made of: one pass over the gradients, not two (a
    gradient whose squares overflow fp32, |g| above ~1e19, is flagged as well). A 0-d norm on the gradients' device."""
    held = [i for i, p in enumerate(parameters) if p.grad is not None]
    if not held:
        return torch.zeros(()), (held, None)
    grads = [parameters[i].grad for i in held]
    if any(isinstance(g, DTensor) for g in grads):  # sharded: torch's clipping sums the norms over the ranks
        flags = ~torch.isfinite(torch.stack(torch._foreach_norm([_local(g) for g in grads], float("inf"))))
        norm = (torch.nn.utils.clip_grad_norm_([parameters[i] for i in held], max_norm) if max_norm > 0
                else torch.nn.utils.get_total_norm(grads))
        return (norm.full_tensor() if isinstance(norm, DTensor) else norm), (held, flags)
    # As torch.nn.utils.get_total_norm makes it for gradients of one device and dtype: the same total to the bit.
    norms = torch.stack(torch._foreach_norm(grads, 2.0))
    total = torch.linalg.vector_norm(norms, 2.0)
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_([parameters[i] for i in held], max_norm, total)
    return total, (held, ~torch.isfinite(norms))


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


def _local(grad: torch.Tensor) -> torch.Tensor:
    return grad.to_local() if isinstance(grad, DTensor) else grad


def divergence_message(step: int, loss: float, grad_norm: float, names: Sequence[str], shown: int = 8) -> str:
    where = ", ".join(names[:shown]) + (f" (+{len(names) - shown} more)" if len(names) > shown else "")
    return (f"training diverged at step {step}: loss {loss}, dense gradient norm {grad_norm}; "
            + (f"non-finite gradients in {where}" if names else "no parameter's gradient is non-finite on this rank")
            + "; lower lr_dense/lr_sparse, or train in bf16 to tell a precision problem from an unstable setting")
