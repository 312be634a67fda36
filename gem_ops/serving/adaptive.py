"""Adaptive compute: each request's history cap chosen from its user's history length, under a mean compute
budget per request. A long history costs more (the first pyramid level's attention grows with its square),
and only a long history can show the patterns that span months. Two policies:

- AdaptiveHistoryPolicy spends a long cap on the users who have that much history and a short cap on the
  rest, the threshold set so that the mean cost over a sample of requests stays within the budget.
- BucketedHistoryPolicy gives each band of history lengths its own cap, chosen on held-out requests: the
  caps that minimise the held-out log loss at the budget (a multiple-choice knapsack, solved by dynamic
  programming over the budget), so a band whose users gain from more history gets it.
- Retrieved history (retrieval_costs) reads each fixed cap's recent events plus the older events of the candidate's
  item a lookup finds: a request spends more only where its candidate has a past beyond the cap.
- MatchReachPolicy keys on the candidate instead of the user: a candidate whose item the user last met deeper
  in the history than a base cap reads down to that event; every other candidate reads the base cap. Which
  requests gain from a long history is told by such a far match far better than by the history's length.

No request ever costs more than its policy's longest cap.

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


def retrieval_costs(costs: np.ndarray, lengths: np.ndarray, cap: int, found: np.ndarray) -> np.ndarray:
    """Each request's cost per candidate when it reads its `cap` most recent events and the `found` older events
    of its candidate's item retrieved before them (SequenceLogs.retrieve_matches): what a request spends varies
    with what its lookup finds, never above cap + the retrieved events' bound."""
    return costs[np.minimum(np.minimum(lengths, cap) + np.asarray(found), len(costs) - 1)]


def fixed_cap_of_cost(costs: np.ndarray, lengths: np.ndarray, mean_cost: float) -> int:
    """The shortest fixed cap whose mean cost per candidate over `lengths` is at least `mean_cost`: the fixed cap
    a policy of that mean cost is judged against (given at least as much compute)."""
    means = np.array([request_costs(costs, lengths, cap).mean() for cap in range(len(costs))])
    if means[-1] < mean_cost:
        raise ValueError(f"no fixed cap up to {len(costs) - 1} costs {mean_cost:.4g} FLOPs on average "
                         f"(the longest: {means[-1]:.4g})")
    return int(np.argmax(means >= mean_cost))


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


@dataclass(frozen=True)
class BucketedHistoryPolicy:
    """Requests of users with edges[i - 1] <= history length < edges[i] read bucket_caps[i] events (bucket 0:
    below edges[0]; the last: from edges[-1] on)."""

    edges: tuple[int, ...]
    bucket_caps: tuple[int, ...]

    def __post_init__(self):
        if len(self.bucket_caps) != len(self.edges) + 1 or list(self.edges) != sorted(set(self.edges)):
            raise ValueError(f"BucketedHistoryPolicy needs increasing edges and one cap per bucket (len(edges) + 1), "
                             f"got edges={self.edges}, bucket_caps={self.bucket_caps}")

    def buckets(self, lengths: np.ndarray) -> np.ndarray:
        return np.searchsorted(np.asarray(self.edges), np.asarray(lengths), side="right")

    def caps(self, lengths: np.ndarray) -> np.ndarray:
        return np.asarray(self.bucket_caps)[self.buckets(lengths)]

    def to_dict(self) -> dict:
        return {"edges": list(self.edges), "bucket_caps": list(self.bucket_caps)}


BUDGET_UNITS = 2000  # the knapsack's resolution: costs are rounded up to 1/2000 of the budget, so it is never exceeded


def fit_bucketed_policy(held_out_lengths: np.ndarray, held_out_losses: dict[int, np.ndarray], lengths: np.ndarray,
                        costs: np.ndarray, mean_budget: float, edges: tuple[int, ...], prior_requests: float = 200.0,
                        monotone: bool = True) -> BucketedHistoryPolicy:
    """The cap per bucket of history length, from the caps of `held_out_losses` (cap -> each held-out request's
    log loss when its history is cut to that cap), that minimises the expected log loss over `lengths` (the
    requests to serve: each bucket weighted by its share of them) while their mean cost per candidate stays
    within `mean_budget`. A bucket's loss curve is its held-out requests' mean pulled toward a flat curve (its
    loss at the shortest cap) as if `prior_requests` such requests were among them: a thin bucket's noise buys
    no history. With `monotone` a longer history never gets a shorter cap."""
    menu = sorted(held_out_losses)
    if not menu or menu[0] < 1 or menu[-1] >= len(costs):
        raise ValueError(f"caps must lie in 1..{len(costs) - 1} (the costed lengths), got {menu}")
    lengths, held_out_lengths = np.asarray(lengths), np.asarray(held_out_lengths)
    probe = BucketedHistoryPolicy(tuple(edges), (menu[0],) * (len(edges) + 1))
    served, held = probe.buckets(lengths), probe.buckets(held_out_lengths)
    n_buckets = len(edges) + 1
    loss = np.empty((n_buckets, len(menu)))
    spend = np.empty((n_buckets, len(menu)))
    shortest = np.asarray(held_out_losses[menu[0]], dtype=np.float64)
    for b in range(n_buckets):
        mine, theirs = held == b, served == b
        flat = shortest[mine].mean() if mine.any() else shortest.mean()
        for j, cap in enumerate(menu):
            pooled = (np.asarray(held_out_losses[cap], dtype=np.float64)[mine].sum() + prior_requests * flat) \
                / (np.count_nonzero(mine) + prior_requests)
            loss[b, j] = pooled * np.count_nonzero(theirs)
            spend[b, j] = request_costs(costs, lengths[theirs], cap).sum()
    floor = spend[:, 0].sum() / lengths.size
    if floor > mean_budget:
        raise ValueError(f"mean_budget {mean_budget:.4g} FLOPs is below the mean cost of the shortest cap alone "
                         f"({floor:.4g} at cap {menu[0]})")
    units = np.ceil(spend / (mean_budget * lengths.size) * BUDGET_UNITS).astype(np.int64)
    choice = _knapsack(loss, units, BUDGET_UNITS, monotone)
    return BucketedHistoryPolicy(tuple(edges), tuple(menu[j] for j in choice))


def _knapsack(loss: np.ndarray, units: np.ndarray, capacity: int, monotone: bool) -> list[int]:
    """One option per row minimising the summed loss with summed units <= capacity (dynamic programming over
    (units spent, the previous row's option)); with `monotone`, each row's option at least the previous row's."""
    rows, options = loss.shape
    best = np.full((capacity + 1, options), np.inf)
    best[0, 0] = 0.0
    back = []
    for b in range(rows):
        reach, came = np.empty_like(best), np.zeros(best.shape, dtype=np.int64)
        low, low_at = np.full(capacity + 1, np.inf), np.zeros(capacity + 1, dtype=np.int64)
        for j in range(options):  # the best way in to option j: from any option (or, monotone, any <= j)
            better = best[:, j] < low
            low[better], low_at[better] = best[better, j], j
            reach[:, j], came[:, j] = low, low_at
        if not monotone:
            reach[:], came[:] = low[:, None], low_at[:, None]
        nxt, source = np.full_like(best, np.inf), np.full(best.shape, -1, dtype=np.int64)
        for j in range(options):
            u = units[b, j]
            if u <= capacity:
                nxt[u:, j] = reach[: capacity + 1 - u, j] + loss[b, j]
                source[u:, j] = came[: capacity + 1 - u, j]
        best = nxt
        back.append(source)
    if not np.isfinite(best).any():  # the rounding up left no room: the cheapest option everywhere
        return [int(np.argmin(units[b])) for b in range(rows)]
    spent, j = (int(k) for k in np.unravel_index(np.argmin(best), best.shape))
    choice = []
    for b in reversed(range(rows)):
        choice.append(j)
        spent, j = spent - int(units[b, j]), int(back[b][spent, j])
    return choice[::-1]


@dataclass(frozen=True)
class MatchReachPolicy:
    """Candidates whose item the user last met deeper than `base_cap` events back, at most `reach_depth` deep,
    read the shortest of `reach_caps` that reaches that event; every other candidate reads `base_cap` events.
    A candidate's depth comes from SequenceLogs.candidate_depths (0: never met)."""

    base_cap: int
    reach_caps: tuple[int, ...]
    reach_depth: int

    def __post_init__(self):
        if list(self.reach_caps) != sorted(set(self.reach_caps)) or not self.reach_caps \
                or not self.base_cap <= self.reach_depth <= self.reach_caps[-1]:
            raise ValueError(f"MatchReachPolicy needs increasing reach_caps and base_cap <= reach_depth <= the longest "
                             f"reach cap, got base_cap={self.base_cap}, reach_caps={self.reach_caps}, "
                             f"reach_depth={self.reach_depth}")

    def caps(self, lengths: np.ndarray, depths: np.ndarray) -> np.ndarray:
        del lengths  # the depth alone decides; a cap past the history's length costs no more than its length
        depths = np.asarray(depths)
        reach = np.asarray(self.reach_caps)[np.minimum(np.searchsorted(self.reach_caps, depths),
                                                       len(self.reach_caps) - 1)]
        far = (depths > self.base_cap) & (depths <= self.reach_depth)
        return np.where(far, np.maximum(reach, self.base_cap), self.base_cap)

    def to_dict(self) -> dict:
        return {"base_cap": self.base_cap, "reach_caps": list(self.reach_caps), "reach_depth": self.reach_depth}


def fit_match_policy(held_out_depths: np.ndarray, held_out_losses: dict[int, np.ndarray], lengths: np.ndarray,
                     depths: np.ndarray, costs: np.ndarray, mean_budget: float) -> MatchReachPolicy:
    """The MatchReachPolicy over the caps of `held_out_losses` (cap -> each held-out request's log loss with
    its history cut to that cap) whose expected held-out loss is the lowest among those whose mean cost per
    candidate over the requests to serve (`lengths`, `depths`) is within `mean_budget`. For each base cap, the
    deepest matches are reached first to go when the budget is short (they cost the most)."""
    menu = tuple(sorted(held_out_losses))
    if not menu or menu[0] < 1 or menu[-1] >= len(costs):
        raise ValueError(f"caps must lie in 1..{len(costs) - 1} (the costed lengths), got {list(menu)}")
    lengths, depths, held_out_depths = np.asarray(lengths), np.asarray(depths), np.asarray(held_out_depths)
    table = np.stack([np.asarray(held_out_losses[cap], dtype=np.float64) for cap in menu])  # [cap, request]
    best, best_loss = None, np.inf
    for base in menu:
        if request_costs(costs, lengths, base).mean() > mean_budget:
            break
        reach_depth = _deepest_reach(lengths, depths, costs, mean_budget, base, menu)
        policy = MatchReachPolicy(base, menu, reach_depth)
        held_caps = policy.caps(None, held_out_depths)
        loss = table[np.searchsorted(menu, held_caps), np.arange(held_caps.size)].mean()
        if loss < best_loss:
            best, best_loss = policy, loss
    if best is None:
        raise ValueError(f"mean_budget {mean_budget:.4g} FLOPs is below the mean cost of the shortest cap alone "
                         f"({request_costs(costs, lengths, menu[0]).mean():.4g} at cap {menu[0]})")
    return best


def _deepest_reach(lengths: np.ndarray, depths: np.ndarray, costs: np.ndarray, mean_budget: float, base: int,
                   menu: tuple[int, ...]) -> int:
    """The largest reach depth (base .. the longest cap) at which the policy's mean cost stays within budget:
    the candidate depths past `base` are the only places the cost steps up."""
    options = np.unique(np.concatenate([[base], depths[(depths > base) & (depths <= menu[-1])]]))
    spend = lambda d: request_costs(costs, lengths,  # noqa: E731
                                    MatchReachPolicy(base, menu, int(d)).caps(lengths, depths)).mean()
    low, high = 0, len(options) - 1  # options[0] (no reach) is within budget; the mean cost grows with the depth
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if spend(options[middle]) <= mean_budget else (low, middle - 1)
    return int(options[low])
