"""The label rate a calibration aims at: per (domain, task), the rate of the newest k labelled days pooled, k chosen
by how well it forecast each next day over the days before (a backtest on counts only, no model), and only where
it beat the newest day clearly: in the group's own backtest, or in every group's together.

Platt scaling on the newest day alone (k = 1) puts the model at that day's rate. Where a day holds a hundred positives,
its rate moves by 10% from sampling alone, and the next day's rate is forecast better by pooling several days; where
the rate drifts, by the newest day. The backtest tells the two apart per group; the calibration keeps its slope and
moves its shift until the mean prediction on the held-out day equals the forecast rate."""

from __future__ import annotations

import numpy as np

from gem_ops.train.batches import MS_PER_DAY

RATE_POOLS = (1, 3, 7, 0)  # days pooled, newest first; 0: every day
MIN_BACKTEST_DAYS = 3  # a forecast is judged only from the 4th day on, so that every pool has days to pool


def daily_label_counts(logs, indices: np.ndarray, domains: int, objectives) -> tuple[np.ndarray, np.ndarray]:
    """(labelled examples, positives), each [days, domains, objectives], per calendar day (UTC) of `indices`, oldest
    first, for the named objectives (a model's tasks, in its order)."""
    indices = np.asarray(indices, dtype=np.int64)
    day = logs.column("timestamp")[indices] // MS_PER_DAY
    surface = logs.column("surface")[indices]
    days = np.unique(day)
    n, p = np.zeros((days.size, domains, len(objectives))), np.zeros((days.size, domains, len(objectives)))
    for i, d in enumerate(days):
        for s in range(domains):
            counts = logs.label_counts(indices[(day == d) & (surface == s)])
            for t, name in enumerate(objectives):
                n[i, s, t], p[i, s, t] = counts[name]
    return n, p


def _log_odds(n: np.ndarray, p: np.ndarray) -> np.ndarray:
    rate = (p + 0.5) / (n + 1.0)  # no day at 0 or 1
    return np.log(rate / (1 - rate))


def pooled_log_odds(n: np.ndarray, p: np.ndarray, k: int) -> np.ndarray:
    """Log-odds of the newest `k` days' pooled rate (every day when k is 0 or beyond them)."""
    take = slice(None) if k == 0 else slice(-k, None)
    return _log_odds(n[take].sum(0), p[take].sum(0))


def _backtest_errors(n: np.ndarray, p: np.ndarray, pools: tuple[int, ...]) -> np.ndarray:
    """[pools, judged days, domains, tasks] squared log-odds error of each pool's forecast of each next day, the days
    from the 4th on."""
    actual = _log_odds(n, p)
    return np.stack([np.stack([(pooled_log_odds(n[:t], p[:t], k) - actual[t]) ** 2
                               for t in range(MIN_BACKTEST_DAYS, n.shape[0])]) for k in pools])


def _in_standard_errors(gain: np.ndarray) -> np.ndarray:
    """The mean of `gain` over its first axis in standard errors of that mean (0 where it has no spread)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.nan_to_num(gain.mean(0) / (gain.std(0, ddof=1) / np.sqrt(gain.shape[0])), nan=0.0)


def _backtest(n: np.ndarray, p: np.ndarray, pools: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The backtest's squared errors [pools, judged days, domains, tasks], each pool's lead over the newest day's in
    standard errors of the paired difference [pools, domains, tasks], and the index of the pool with the least mean
    error [domains, tasks] (argmin keeps the first of equals: pools go from fewer days)."""
    errors = _backtest_errors(n, p, pools)
    leads = np.stack([_in_standard_errors(errors[0] - errors[k]) for k in range(len(pools))])
    return errors, leads, np.argmin(errors.mean(1), axis=0)


def _check_pools(pools: tuple[int, ...]) -> None:
    if pools[0] != 1:
        raise ValueError(f"pools {pools}: the first must be 1, the newest day's rate, kept without clear evidence")


def backtest_gains(n: np.ndarray, p: np.ndarray, pools: tuple[int, ...] = RATE_POOLS) -> tuple[np.ndarray, np.ndarray]:
    """[domains, tasks] the pool whose forecast of each next day had the least squared log-odds error over the days
    from the 4th on, and its lead over the newest day's (the first pool) in standard errors of the paired difference."""
    _check_pools(pools)
    if n.shape[0] < MIN_BACKTEST_DAYS + 2:
        return np.ones(n.shape[1:], dtype=np.int64), np.zeros(n.shape[1:])
    _, leads, best = _backtest(n, p, pools)
    return np.asarray(pools)[best], np.take_along_axis(leads, best[None], 0)[0]


def backtested_pools(n: np.ndarray, p: np.ndarray, pools: tuple[int, ...] = RATE_POOLS,
                     trending: np.ndarray | None = None) -> np.ndarray:
    """[domains, tasks] the pool each group's rate is forecast with. A dozen days judge one group's pools noisily, so
    a group's own backtest decides only where it is clear (the one-standard-error rule): its best pool where that
    beats the newest day's by more than one standard error, the newest day where every pool is that far behind it (a
    drifting rate). Elsewhere the groups are judged together, the drifting ones left out: the pool that beats the
    newest day by more than one standard error over all their judged days, where the group's own backtest does not put
    it that far behind. The newest day's (1) where nothing is clear, where there are too few days, for a group with a
    day without labels, and for the groups marked `trending` ([domains, tasks] booleans: a rate found to trend is
    where its newest day put it; they do not vote either).

    On the synthetic logs, whose rates scatter, this forecasts the eval days' true rates better than each group's own
    backtest alone; on MovieLens, whose rates move, it keeps the newest day (benchmarks/calibration_targets.py)."""
    _check_pools(pools)
    ones = np.ones(n.shape[1:], dtype=np.int64)
    if n.shape[0] < MIN_BACKTEST_DAYS + 2:
        return ones
    eligible = (n > 0).all(0)
    if trending is not None:
        eligible &= ~np.asarray(trending, dtype=bool)
    errors, leads, best = _backtest(n, p, pools)
    own = np.where(eligible & (np.take_along_axis(leads, best[None], 0)[0] > 1), np.asarray(pools)[best], 1)
    voters = eligible & ~(leads[1:] < -1).all(0)  # every group but those clearly drifting
    if not voters.any():
        return own
    together = errors[:, :, voters].reshape(len(pools), -1)  # [pools, the voting groups' judged days]
    shared = int(np.argmin(together.mean(1)))
    if shared == 0 or _in_standard_errors(together[0] - together[shared]) <= 1:
        return own
    return np.where((own == 1) & voters & (leads[shared] >= -1), pools[shared], own)


def forecast_rates(n: np.ndarray, p: np.ndarray, pools: np.ndarray) -> np.ndarray:
    """[domains, tasks] the rate of each group's chosen pool of newest days."""
    out = np.zeros(n.shape[1:])
    for k in np.unique(pools):
        z = pooled_log_odds(n, p, int(k))
        out = np.where(pools == k, 1 / (1 + np.exp(-z)), out)
    return out


def shift_for_rate(logits: np.ndarray, scale: float, rate: float, iterations: int = 60) -> float:
    """The shift b with mean(sigmoid(scale * logit + b)) = rate over `logits` (bisection: the mean rises with b)."""
    z = scale * np.clip(np.asarray(logits, np.float64), -30, 30)
    low, high = -30.0, 30.0
    for _ in range(iterations):
        mid = (low + high) / 2
        if np.mean(0.5 * (1.0 + np.tanh(0.5 * (z + mid)))) < rate:
            low = mid
        else:
            high = mid
    return (low + high) / 2


def retarget_shifts(scale, shift, out: dict, logs, validation: np.ndarray, objectives, trending=None) -> dict:
    """Moves `shift` ([domains, objectives], in place) so that each group's mean calibrated prediction on the held-out
    examples (`out`: their logits, label mask and surface) equals its backtested rate forecast, counted on the logs'
    training split up to the held-out day; the `trending` groups keep the newest day (backtested_pools). Returns the
    pools, the rates and Platt scaling's own shifts (the held-out day's alone), for the record."""
    newest = (logs.column("timestamp")[validation] // MS_PER_DAY).max()
    train = logs.split_indices("train")
    n, p = daily_label_counts(logs, train[logs.column("timestamp")[train] // MS_PER_DAY <= newest], scale.shape[0],
                              objectives)
    pools = backtested_pools(n, p, trending=trending)
    rates = forecast_rates(n, p, pools)
    logits, mask, surface = out["logits"].numpy(), out["label_mask"].numpy(), out["surface"].numpy()
    newest_day_shift = shift.tolist()
    for d, t in zip(*np.nonzero(pools != 1)):
        rows = mask[:, t] & (surface == d)
        if rows.any():
            shift[d, t] = shift_for_rate(logits[rows, t], float(scale[d, t]), float(rates[d, t]))
    return {"rate_days": pools.tolist(), "target_rate": rates.tolist(), "newest_day_shift": newest_day_shift}
