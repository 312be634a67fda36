"""Which rate a calibration should aim at, judged where the answer is known: each rule's forecast of the eval days'
label rate per (surface, objective), from the training days' counts alone (no model).

- Synthetic logs (`--configs`, `--seeds`): the generator's own probabilities give each eval day's true rate, so the
  error is the rule's alone, free of the eval labels' noise; every seed is a new population and a new draw.
- Prepared logs (`--sequence-logs`, e.g. MovieLens): no true rate, so each day from the 7th on is forecast from the
  days before it (a rolling origin) and judged against its realised rate, on groups with at least
  --min-positives positives every day (where the realised rate is near the true one).

Rules: the newest day (Platt scaling alone), the engine's backtested pool (calibration_rate.backtested_pools: a
group's own backtest where it is clear by one standard error, else the pool the other groups' backtests clearly
favour together), each group's own backtest alone (the engine's rule before the groups were judged together), the
backtest's best pool however slight its lead, and fixed pools of 3, 7 and every day. Figures: the root mean square
log-odds error over the groups (and eval days) per seed or log, and each rule's difference from the engine's, paired
by seed.

    python benchmarks/calibration_targets.py --seeds 0 1 2 3 4 5 6 7 8 9 10 11 \
        --sequence-logs .gpu_data/transfer/movielens/sequence_logs
"""

from __future__ import annotations

import argparse
import sys
from datetime import date, timedelta
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from benchmarks.common import save  # noqa: E402

ENGINE_RULE = "backtested"
FIRST_ROLLING_DAY = 6  # the 7th day: the backtest needs MIN_BACKTEST_DAYS + 2 days before it
LAST_DAY = date(2026, 11, 14)
DAYS = 14
EVAL_DAYS = {"strong_signal": 1, "recurring": 2, "transfer": 2}  # default_run, adaptive_compute, transfer


def rule_pools(n: np.ndarray, p: np.ndarray) -> dict[str, np.ndarray]:
    """Each rule's pool of newest days (0: every day) per group, from the groups' daily counts [days, groups], oldest
    first: the engine's judges the groups together, as it does a model's (domain, task) groups."""
    from gem_ops.train.calibration_rate import backtest_gains, backtested_pools

    groups = n.shape[1]
    full = lambda k: np.full(groups, k)  # noqa: E731
    return {"newest_day": full(1), ENGINE_RULE: backtested_pools(n[:, None], p[:, None])[0],
            "own_backtest": np.array([backtested_pools(n[:, None, [g]], p[:, None, [g]])[0, 0] for g in range(groups)]),
            "best_backtest": backtest_gains(n[:, None], p[:, None])[0][0],
            "pool_3": full(3), "pool_7": full(7), "every_day": full(0)}


def forecast_errors(n: np.ndarray, p: np.ndarray, truth: np.ndarray) -> dict[str, np.ndarray]:
    """Each rule's log-odds error [days forecast, groups] against `truth` (the log-odds of the days forecast, [days,
    groups]) from the counts [days, groups] before them."""
    return {rule: forecasts(n, p, pools)[None, :] - truth for rule, pools in rule_pools(n, p).items()}


def forecasts(n: np.ndarray, p: np.ndarray, pools: np.ndarray) -> np.ndarray:
    """[groups] the log-odds of each group's pooled rate, its pool of newest days from `pools`."""
    from gem_ops.train.calibration_rate import pooled_log_odds

    return np.array([pooled_log_odds(n[:, g], p[:, g], int(k)) for g, k in enumerate(pools)])


def synthetic_daily_counts(config) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """group -> (labelled impressions, positives, true rate), each per day of the DAYS days to LAST_DAY, oldest first:
    the generator's ad impressions, as a prepared log's examples are."""
    import polars as pl

    from gem_ops.data.synthetic import generate_day

    frames = []
    for i in range(DAYS):
        day = LAST_DAY - timedelta(days=DAYS - 1 - i)
        events = generate_day(config, day, label_probabilities=True).filter(pl.col("event_type") == "ad_impression")
        for task in ("click", "conversion"):
            frames.append(events.filter(pl.col(f"label_{task}").is_not_null()).group_by("surface").agg(
                pl.len().alias("n"), pl.col(f"label_{task}").sum().alias("p"), pl.col(f"p_{task}").mean().alias("true"))
                .with_columns(group=pl.col("surface") + f"/{task}", day=pl.lit(i)))
    daily = pl.concat(frames).sort("day")
    out = {}
    for (group,), rows in daily.group_by("group", maintain_order=True):
        if rows.height == DAYS:  # a group missing a day (no impression) has no rate to forecast there
            out[group] = tuple(rows[c].to_numpy().astype(np.float64) for c in ("n", "p", "true"))
    return out


def synthetic_run(log: str, seed: int) -> dict[str, float]:
    """Root mean square error per rule over the groups and eval days of one synthetic log."""
    from benchmarks.oracle_quality import synthetic_config

    eval_days = EVAL_DAYS[log]
    n, p, true = (np.stack(c, 1) for c in zip(*synthetic_daily_counts(synthetic_config(log, seed)).values()))
    truth = np.log(true[-eval_days:] / (1 - true[-eval_days:]))
    return {rule: float(np.sqrt(np.mean(np.square(e))))
            for rule, e in forecast_errors(n[:-eval_days], p[:-eval_days], truth).items()}


def rolling_run(path: Path, min_positives: int) -> dict:
    """Each day from FIRST_ROLLING_DAY on forecast from the days before, the groups with enough positives every day
    judged together: root mean square error per rule, overall and per group."""
    from gem_ops.data.loader import SequenceLogs
    from gem_ops.train.calibration_rate import daily_label_counts, pooled_log_odds

    logs = SequenceLogs(path)
    n, p = daily_label_counts(logs, np.arange(len(logs)), len(logs.surfaces), logs.objectives)
    names = [f"{surface}/{task}" for surface in logs.surfaces for task in logs.objectives]
    n, p = n.reshape(n.shape[0], -1), p.reshape(p.shape[0], -1)  # [days, groups], the names' order
    kept = (p >= min_positives).all(0)
    if not kept.any():
        raise ValueError(f"{path}: no (surface, objective) with at least {min_positives} positives on every day "
                         f"(--min-positives)")
    n, p, names = n[:, kept], p[:, kept], [g for g, k in zip(names, kept) if k]
    errors = {}
    for day in range(FIRST_ROLLING_DAY, n.shape[0]):
        realised = pooled_log_odds(n[day : day + 1], p[day : day + 1], 1)[None]  # the day's own rate, [1, groups]
        for rule, e in forecast_errors(n[:day], p[:day], realised).items():
            errors.setdefault(rule, []).append(e[0])
    errors = {rule: np.stack(e) for rule, e in errors.items()}  # [forecast days, groups]
    rms = lambda e: float(np.sqrt(np.mean(np.square(e))))  # noqa: E731
    return {"forecasts": int(errors[ENGINE_RULE].size),
            "root_mean_square": {r: rms(e) for r, e in errors.items()},
            "per_group": {g: {r: rms(e[:, i]) for r, e in errors.items()} for i, g in enumerate(names)}}


def paired_summary(runs: list[dict[str, float]]) -> dict:
    """Mean ± standard error over seeds of each rule's error, and its difference from the engine rule's per seed."""
    def se(x: np.ndarray) -> float:
        return float(np.std(x, ddof=1) / np.sqrt(x.size)) if x.size > 1 else 0.0

    out = {}
    for rule in runs[0]:
        values = np.array([r[rule] for r in runs])
        diff = values - np.array([r[ENGINE_RULE] for r in runs])
        out[rule] = {"mean": float(values.mean()), "standard_error": se(values),
                     "minus_engine_rule": float(diff.mean()), "minus_engine_rule_standard_error": se(diff),
                     "seeds_better_than_engine_rule": int((diff < 0).sum())}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", nargs="+", choices=sorted(EVAL_DAYS), default=sorted(EVAL_DAYS))
    parser.add_argument("--seeds", type=int, nargs="+", default=list(range(12)))
    parser.add_argument("--sequence-logs", type=Path, nargs="*", default=[],
                        help="prepared logs judged by a rolling origin against their realised rates")
    parser.add_argument("--min-positives", type=int, default=50)
    parser.add_argument("--output-name", default="calibration_targets")
    args = parser.parse_args()

    results = {"synthetic": {}, "rolling": {}}
    for log in args.configs:
        runs = [synthetic_run(log, seed) for seed in args.seeds]
        results["synthetic"][log] = {"per_seed": runs, "summary": paired_summary(runs)}
        print(log, " ".join(f"{r} {v['mean']:.4f} ({v['minus_engine_rule']:+.4f} ± "
                            f"{v['minus_engine_rule_standard_error']:.4f})"
                            for r, v in results["synthetic"][log]["summary"].items()), flush=True)
    for path in args.sequence_logs:
        results["rolling"][str(path)] = run = rolling_run(path, args.min_positives)
        print(path, run["forecasts"], "forecasts:",
              " ".join(f"{r} {v:.4f}" for r, v in run["root_mean_square"].items()), flush=True)
    save(args.output_name, {**vars(args), "last_day": LAST_DAY, "days": DAYS, "eval_days": EVAL_DAYS,
                            "first_rolling_day": FIRST_ROLLING_DAY + 1}, results)


if __name__ == "__main__":
    main()
