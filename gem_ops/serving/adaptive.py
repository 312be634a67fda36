"""Adaptive compute: each request's history cap chosen from its user's history length, under a mean compute
budget per request. A long history costs more (the first pyramid level's attention grows with its square),
and only a long history can show the patterns that span months; so the policy spends the long cap on the
users who have that much history and a short cap on the rest, with the threshold set so that the mean cost
over a sample of requests stays within the budget. No request ever costs more than the long cap's cost.

Cost: the model's forward FLOPs per candidate at a given history length (gem_ops.metrics.flops), every
branch reading the whole capped history (an upper bound for the branches that select events)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from gem_ops.metrics.flops import gem_flops
from gem_ops.model.config import FeatureSpec, ModelConfig


def history_costs(config: ModelConfig, spec: FeatureSpec, max_len: int | None = None) -> np.ndarray:
    """[max_len + 1] forward FLOPs per candidate at history lengths 0 .. max_len (default: the model's maximum)."""
    max_len = config.sequence.max_history_len if max_len is None else max_len
    branches = config.sequence.branches if config.use_sequence else ()
    return np.array([gem_flops(config, spec, {b: np.array([n]) for b in branches}, 1, n).forward
                     for n in range(max_len + 1)])


def request_costs(costs: np.ndarray, lengths: np.ndarray, caps: np.ndarray | int) -> np.ndarray:
    """Each request's cost per candidate: its history cut to its cap."""
    return costs[np.minimum(np.minimum(lengths, caps), len(costs) - 1)]


@dataclass(frozen=True)
class AdaptiveHistoryPolicy:
    """Requests of users with at least `threshold` history events read `long_cap` of them, the others
    `short_cap`."""

    short_cap: int
    long_cap: int
    threshold: int

    def caps(self, lengths: np.ndarray) -> np.ndarray:
        return np.where(np.asarray(lengths) >= self.threshold, self.long_cap, self.short_cap)

    def to_dict(self) -> dict:
        return asdict(self)


def fit_policy(lengths: np.ndarray, costs: np.ndarray, mean_budget: float, short_cap: int,
               long_caps: int | tuple[int, ...]) -> AdaptiveHistoryPolicy:
    """The policy with the largest of `long_caps` that some requests can get, at the lowest threshold (the most
    requests on it) whose mean cost per candidate over `lengths` (a sample of requests' history lengths) is
    within `mean_budget` FLOPs."""
    long_caps = sorted((long_caps,) if isinstance(long_caps, int) else long_caps, reverse=True)
    if not long_caps or not 0 < short_cap <= min(long_caps) <= max(long_caps) < len(costs):
        raise ValueError(f"caps must satisfy 0 < short_cap <= long caps <= {len(costs) - 1} (the costed lengths), "
                         f"got short_cap={short_cap}, long_caps={long_caps}")
    lengths = np.asarray(lengths)
    floor = request_costs(costs, lengths, short_cap).mean()
    if floor > mean_budget:
        raise ValueError(f"mean_budget {mean_budget:.4g} FLOPs is below the mean cost of the short cap alone "
                         f"({floor:.4g} at short_cap={short_cap})")
    for long_cap in long_caps:
        threshold = _lowest_threshold(lengths, costs, mean_budget, short_cap, long_cap)
        if threshold <= lengths.max():
            break
    return AdaptiveHistoryPolicy(short_cap, long_cap, threshold)


def _lowest_threshold(lengths: np.ndarray, costs: np.ndarray, mean_budget: float, short_cap: int, long_cap: int) -> int:
    short, long = request_costs(costs, lengths, short_cap), request_costs(costs, lengths, long_cap)
    # Raising the threshold past a length moves that length's requests from the long to the short cap.
    order = np.argsort(lengths, kind="stable")
    sorted_lengths = lengths[order]
    saving = np.cumsum((long - short)[order])  # saved by putting the i+1 shortest on the short cap
    total_long = long.sum()
    # Thresholds worth trying: each distinct length (everyone shorter stays short), and past the longest.
    candidates = np.unique(sorted_lengths)
    shorter = np.searchsorted(sorted_lengths, candidates, side="left")  # requests below each threshold
    means = (total_long - np.where(shorter > 0, saving[np.maximum(shorter - 1, 0)], 0.0)) / lengths.size
    within = np.flatnonzero(means <= mean_budget)
    return int(candidates[within[0]]) if within.size else int(sorted_lengths[-1]) + 1
