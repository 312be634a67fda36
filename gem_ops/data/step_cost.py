"""What a training step really costs, fitted to measured steps: seconds = fixed + per_token x tokens + per_pair x
pairs, where a sample of history length L brings L + 1 tokens (the candidate is one) and (L + 1)^2 attention pairs.

The dense layers cost per token and the self attention per pair; which one dominates depends on the model's width
and the history lengths, so neither Base Batch Shuffling's "tokens" nor its "attention" cost is right in general.
Fitted on the steps of a run (an MFU report's `step_measures`: each step's compute seconds, tokens and pairs), the
ratio of the two terms is what the planner counts a step's cost in (ShufflingConfig(cost="measured",
tokens_per_pair=...)), so that its planned per-rank costs and imbalance predict the observed ones. Base Batch
Shuffling deals samples by length order, so the plan itself is the same under every cost that grows with length;
the fixed term is the same on every rank and moves neither.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from gem_ops.data.batch_shuffling import max_over_mean

TERMS = ("fixed", "per_token", "per_pair")


@dataclass(frozen=True)
class StepCostModel:
    fixed: float  # seconds per step whatever its batch
    per_token: float  # seconds per history token
    per_pair: float  # seconds per attention pair
    steps: int = 0  # the measured steps it was fitted to
    relative_error: float = float("nan")  # root mean square of (predicted - measured) / mean measured

    def seconds(self, tokens, pairs) -> np.ndarray:
        return (self.fixed + self.per_token * np.asarray(tokens, np.float64)
                + self.per_pair * np.asarray(pairs, np.float64))

    @property
    def tokens_per_pair(self) -> float:
        """How many pairs one token costs as much as: the planner's weight of L + 1 against (L + 1)^2."""
        return self.per_token / self.per_pair if self.per_pair > 0 else float("inf")

    def to_dict(self) -> dict:
        return asdict(self) | {"tokens_per_pair": self.tokens_per_pair}


def fit_step_cost(seconds, tokens, pairs) -> StepCostModel:
    """Least squares with every coefficient >= 0: a term whose fitted coefficient is negative (noise, or a term the
    steps do not vary enough to tell apart) is dropped and the rest fitted again."""
    seconds, tokens, pairs = (np.asarray(x, np.float64) for x in (seconds, tokens, pairs))
    if not (seconds.shape == tokens.shape == pairs.shape) or seconds.ndim != 1:
        raise ValueError(f"seconds, tokens and pairs must be 1-d of one length, got {seconds.shape}, {tokens.shape}, "
                         f"{pairs.shape}")
    if seconds.size < len(TERMS) or not np.isfinite(seconds).all() or (seconds <= 0).any():
        raise ValueError(f"fitting a step cost needs at least {len(TERMS)} steps of positive, finite seconds; "
                         f"got {seconds.size} steps")
    columns = np.stack([np.ones_like(seconds), tokens, pairs], 1)
    scale = np.abs(columns).max(0)  # tokens and pairs differ by orders of magnitude
    scale[scale == 0] = 1.0
    active = [0, 1, 2]
    while True:
        solution, *_ = np.linalg.lstsq(columns[:, active] / scale[active], seconds, rcond=None)
        if (solution >= 0).all() or len(active) == 1:
            break
        active.pop(int(np.argmin(solution)))
    coefficients = np.zeros(len(TERMS))
    coefficients[active] = np.maximum(solution, 0.0) / scale[active]
    predicted = StepCostModel(*coefficients).seconds(tokens, pairs)
    error = (predicted - seconds) / seconds.mean()
    return StepCostModel(*coefficients, steps=int(seconds.size), relative_error=float(np.sqrt(np.mean(error**2))))


def planned_against_observed(seconds, tokens, pairs) -> dict:
    """Per rank: the forward seconds observed against those a step cost fitted to every (step, rank) plans from the
    rank's own tokens and pairs, and both sides' imbalance. Arguments are [steps, ranks]; steps with a rank's figure
    missing (an empty row, from a run resumed across versions) are left out."""
    rows = [i for i, row in enumerate(seconds) if len(row)]
    seconds, tokens, pairs = (np.asarray([x[i] for i in rows], np.float64) for x in (seconds, tokens, pairs))
    if seconds.ndim != 2 or not (seconds.shape == tokens.shape == pairs.shape):
        raise ValueError(f"seconds, tokens and pairs must be [steps, ranks] of one shape, got {seconds.shape}, "
                         f"{tokens.shape}, {pairs.shape}")
    cost = fit_step_cost(seconds.ravel(), tokens.ravel(), pairs.ravel())
    planned = cost.seconds(tokens, pairs)
    return {
        "steps": int(seconds.shape[0]), "cost_model": cost.to_dict(),
        "imbalance": {"observed": max_over_mean(seconds), "planned": max_over_mean(planned),
                      "tokens": max_over_mean(tokens), "pairs": max_over_mean(pairs)},
        "per_rank": [{"rank": r, "observed_seconds": float(seconds[:, r].sum()),
                      "planned_seconds": float(planned[:, r].sum()), "tokens": float(tokens[:, r].sum()),
                      "pairs": float(pairs[:, r].sum())} for r in range(seconds.shape[1])],
    }
