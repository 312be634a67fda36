"""Reading a training step's figures on the host without stopping the device.

A step's loss per task and its gradient norm live on the device. Read right after the step is queued (`.item()`,
`.tolist()`), they make the host wait for the whole step, and the device then waits for the host to queue the next
one: the data copy, the compiled graph's guards and every launch until the first kernels run, each step, and any
pause of the host process lands inside a step. Read one step late, the host queues step n + 1 and only then waits
for step n's figures, which are copied into pinned host memory behind step n's own kernels (a copy issued after
step n + 1 was queued would wait for step n + 1 too). By then the gradients are step n + 1's: which dense gradients
held a NaN or an inf in step n is flagged on the device as it is queued and copied with its figures.

Steps after which the host acts on the model (an evaluation, a checkpoint, the last step) are read at once, so the
weights it sees are those of the step it names. On several ranks every rank's figures are gathered between the hosts
(step_balance.gather_rows, a gloo group): a collective on the GPU would queue behind the next step. A step hook runs
when its step is read, which may be after the next step was queued: `step_readout="each_step"` for a hook that reads
the model itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch


@dataclass
class QueuedStep:
    """A step on the device, with what the host knows of it until its figures are read."""

    step: int
    size: int  # examples on this rank
    lr: float
    costs: dict[str, Any]
    began: float  # time.perf_counter when the host began to queue it
    forward_spans: list  # ForwardComputeTimer.cut() of this step
    # [share per task, labelled share per task, gradient norm, then a flag per held gradient], on the host once `ready`
    figures: torch.Tensor
    ready: torch.cuda.Event | None
    held: list[int]  # the indices of the dense parameters with a gradient, flagged non-finite or not in `figures`
    host_seconds: dict[str, float] = field(default_factory=dict)  # the host's time queuing each phase


def queue_step(step: int, size: int, lr: float, costs: dict[str, Any], began: float, forward_spans: list,
               share: torch.Tensor, labelled: torch.Tensor, grad_norm: torch.Tensor,
               nonfinite: tuple[list[int], torch.Tensor | None] = ([], None)) -> QueuedStep:
    """The step's figures (and `nonfinite`, gradients.clip_dense_gradients' flags) gathered into one tensor and,
    on a GPU, copied to pinned memory behind its kernels."""
    held, flags = nonfinite
    device = share.device
    parts = [share.detach().reshape(-1), labelled.detach().reshape(-1), grad_norm.detach().reshape(1).to(device)]
    figures = torch.cat([p.double() for p in parts + ([flags.to(device)] if flags is not None else [])])
    ready = None
    if figures.is_cuda:
        host = torch.empty(figures.shape, dtype=figures.dtype, pin_memory=True)
        host.copy_(figures, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        figures = host
    return QueuedStep(step, size, lr, costs, began, forward_spans, figures, ready, held if flags is not None else [])


HOST_PHASES = ("data", "forward", "backward", "optimizer")


def host_phase_seconds(began: float, marks: list[float]) -> dict[str, float]:
    """The host's seconds in each of HOST_PHASES of one step, from when it began and the time.perf_counter marks
    at the end of data (the batch on its way to the device), the forward (with the loss), the backward and the
    optimizer."""
    if len(marks) != len(HOST_PHASES):
        raise ValueError(f"host_phase_seconds: {len(HOST_PHASES)} marks expected ({HOST_PHASES}), got {len(marks)}")
    ends = [began, *marks]
    return {phase: ends[i + 1] - ends[i] for i, phase in enumerate(HOST_PHASES)}


def read_figures(queued: QueuedStep) -> tuple[np.ndarray, list[int]]:
    """The step's figures, and the indices of the dense parameters flagged non-finite in it; waits for the step
    itself, not for what was queued after it."""
    if queued.ready is not None:
        queued.ready.synchronize()
    values = queued.figures.numpy()
    count = len(queued.held)
    flags = values[len(values) - count:] if count else values[:0]
    return values[: len(values) - count], [i for i, flag in zip(queued.held, flags) if flag]


def reads_late(setting: str, device: torch.device) -> bool:
    """Whether steps are read one step late (TrainConfig.step_readout)."""
    return setting == "next_step" or (setting == "auto" and device.type == "cuda")


def read_at_once(step: int, end: int, eval_every: int, checkpoint_every: int) -> bool:
    """A step after which the host evaluates, checkpoints or stops: its figures and weights are read before the
    next step is queued."""
    after = step + 1
    return (after == end or (eval_every > 0 and after % eval_every == 0)
            or (checkpoint_every > 0 and after % checkpoint_every == 0))
