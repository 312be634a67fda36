"""Calibration fitted after training: per (domain, task), Platt scaling of the serving logits,
sigmoid(a * logit + b), on held-out examples (the newest training day), folded into the towers.

A model trained with early stopping on a small or drifting day under- or over-predicts by a margin the
loss alone does not remove; two numbers per (domain, task) do. They are fitted by Newton's method on the
log loss with a Gaussian prior pulling (a, b) toward the identity (1, 0), so a (domain, task) with few
labels moves little: a group with no positive or no negative keeps its slope and moves its shift only
as far as the prior allows.
"""

from __future__ import annotations

import numpy as np
import torch

PRIOR_STRENGTH = 1.0  # pull toward a = 1, b = 0, in units of the log loss's curvature (a few examples' worth)
NEWTON_STEPS = 25


def platt_scaling(logits: np.ndarray, labels: np.ndarray, prior: float = PRIOR_STRENGTH) -> tuple[float, float]:
    """(a, b) minimising the log loss of sigmoid(a * logit + b) plus prior/2 * ((a - 1)^2 + b^2): Newton
    steps, each halved until the objective falls (a full step can overshoot on separable groups)."""
    z = np.clip(np.asarray(logits, np.float64), -30, 30)
    y = np.asarray(labels, np.float64)
    if z.size == 0:
        return 1.0, 0.0
    features = np.stack([z, np.ones_like(z)], 1)  # [N, 2]
    target = np.array([1.0, 0.0])

    def objective(theta: np.ndarray) -> float:
        t = features @ theta
        return float(np.sum(np.logaddexp(0.0, t) - y * t) + prior / 2 * np.sum((theta - target) ** 2))

    theta = target.copy()
    current = objective(theta)
    for _ in range(NEWTON_STEPS):
        p = 0.5 * (1.0 + np.tanh(0.5 * (features @ theta)))  # the sigmoid, without overflow
        gradient = features.T @ (p - y) + prior * (theta - target)
        hessian = (features * (p * (1 - p))[:, None]).T @ features + prior * np.eye(2)
        step = np.linalg.solve(hessian, gradient)
        for _ in range(30):
            candidate = objective(theta - step)
            if candidate <= current:
                break
            step = step / 2
        else:
            break
        theta, improvement, current = theta - step, current - candidate, candidate
        if improvement < 1e-10 * max(1.0, abs(current)):
            break
    return float(theta[0]), float(theta[1])


def fit_calibration(logits: torch.Tensor, labels: torch.Tensor, label_mask: torch.Tensor, domain: torch.Tensor,
                    domains: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, shift), each [domains, tasks]: Platt scaling of every (domain, task) with labels."""
    tasks = logits.shape[1]
    scale, shift = torch.ones(domains, tasks), torch.zeros(domains, tasks)
    for d in range(domains):
        for t in range(tasks):
            rows = (label_mask[:, t] & (domain == d)).numpy()
            if rows.any():
                a, b = platt_scaling(logits[rows, t].numpy(), labels[rows, t].numpy())
                scale[d, t], shift[d, t] = a, b
    return scale, shift


def output_calibration(model: torch.nn.Module):
    """The model's OutputCalibration (None for a model without one)."""
    return getattr(model, "output_calibration", None)


def reset_calibration(model: torch.nn.Module) -> None:
    head = output_calibration(model)
    if head is not None:
        head.set_calibration(torch.ones(head.domains, head.tasks), torch.zeros(head.domains, head.tasks))
