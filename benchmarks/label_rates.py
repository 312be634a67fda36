"""How far the eval days' label rate moves from the newest training day's, per (domain, objective): what bounds
the calibration any model fitted on past days can reach on the eval days. Beside it, a forecast of the eval
days' rate from a linear trend in log-odds over the newest `--trend-days` training days and from the rate pooled
over the newest k training days (`--pool-days`: a stationary rate's estimate with less sampling noise than one
day's), and every forecast (trend, pooled, and the newest day's rate held) backtested on the training days.

    python benchmarks/label_rates.py --data .gpu_data/transfer     # prepared by transfer.py --prepare-to
    python benchmarks/label_rates.py --sequence-logs LAKE/sequence_logs/2026-11-14 --output-name label_rates_default_run
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from benchmarks.common import save  # noqa: E402
from gem_ops.train.calibration_rate import backtest_gains, backtested_pools, pooled_log_odds  # noqa: E402

MS_PER_DAY = 86_400_000


def daily_rates(logs, indices: np.ndarray, task: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(day, examples, positives) per day of `indices`, for `task`."""
    days = logs.column("timestamp")[indices] // MS_PER_DAY
    rows = [(day, *logs.label_counts(indices[days == day])[task]) for day in np.unique(days)]
    return tuple(np.array(column, dtype=np.float64) for column in zip(*rows)) if rows else (np.array([]),) * 3


def logit(rate: np.ndarray) -> np.ndarray:
    return np.log(rate / (1 - rate))


def trend_forecast(days: np.ndarray, log_odds: np.ndarray, at: np.ndarray) -> np.ndarray:
    slope, intercept = np.polyfit(days, log_odds, 1)
    return slope * at + intercept


def group_figures(train: tuple, held: tuple, trend_days: int, pool_days: list[int]) -> dict:
    (days, n, p), (eval_days, n_eval, p_eval) = train, held
    z, z_eval = logit(p / n), logit(p_eval / n_eval)
    trend = trend_forecast(days[-trend_days:], z[-trend_days:], eval_days)
    start = max(trend_days, *pool_days)  # every forecast backtested on the same days
    backtest = [(trend_forecast(days[t - trend_days:t], z[t - trend_days:t], days[t:t + 1])[0] - z[t], z[t - 1] - z[t])
                for t in range(start, len(z))]
    errors = np.array(backtest)
    pooled = {k: {"log_odds_error": np.abs(pooled_log_odds(n, p, k) - z_eval).tolist(),
                  "backtest_mse": float(np.mean([(pooled_log_odds(n[:t], p[:t], k) - z[t]) ** 2
                                                 for t in range(start, len(z))]))} for k in pool_days}
    pool, in_errors = backtest_gains(n[:, None, None], p[:, None, None])  # the group's own backtest
    return {"positives_per_day": float(p.mean()), "daily_rate": (p / n).tolist(),
            "pooled": pooled, "calibration_pool": int(pool[0, 0]), "calibration_pool_gain_standard_errors":
            float(in_errors[0, 0]),
            "calibration_pooled": bool(backtested_pools(n[:, None, None], p[:, None, None])[0, 0] != 1),
            "eval_rate_over_newest_training_day": (p_eval / n_eval / (p[-1] / n[-1])).tolist(),
            "log_odds_error_held": np.abs(z[-1] - z_eval).tolist(),
            "log_odds_error_trend": np.abs(trend - z_eval).tolist(),
            "backtest_mse_held": float(np.mean(errors[:, 1] ** 2)),
            "backtest_mse_trend": float(np.mean(errors[:, 0] ** 2))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, help="a folder of prepared datasets (<name>/sequence_logs)")
    parser.add_argument("--sequence-logs", type=Path, help="instead: one sequence_logs folder (e.g. a lake's "
                        "sequence_logs/<day>, as the default run leaves it), named `logs` in the results")
    parser.add_argument("--output-name", default="label_rates")
    parser.add_argument("--datasets", nargs="+", default=["synthetic", "movielens"])
    parser.add_argument("--trend-days", type=int, default=5)
    parser.add_argument("--pool-days", type=int, nargs="+", default=[2, 3, 5, 7])
    parser.add_argument("--min-positives", type=int, default=30, help="per day, on every day")
    args = parser.parse_args()

    from gem_ops.data.loader import SequenceLogs, TrainingData

    if (args.data is None) == (args.sequence_logs is None):
        parser.error("give --data or --sequence-logs")
    opened = ({"logs": SequenceLogs(args.sequence_logs)} if args.sequence_logs else
              {name: TrainingData.at(args.data / name).open() for name in args.datasets})
    results = {}
    for name, logs in opened.items():
        surface = logs.column("surface")
        train, held = logs.split_indices("train"), logs.split_indices("eval")
        results[name] = {}
        for d, domain in enumerate(logs.surfaces):
            for task in logs.objectives:
                figures = [daily_rates(logs, split[surface[split] == d], task) for split in (train, held)]
                if any(f[0].size == 0 or (f[2] < args.min_positives).any() for f in figures):
                    continue
                results[name][f"{domain}/{task}"] = row = group_figures(*figures, args.trend_days, args.pool_days)
                print(f"{name} {domain}/{task}: {row['positives_per_day']:.0f} positives a day, eval rate / newest "
                      f"training day's {np.round(row['eval_rate_over_newest_training_day'], 3).tolist()}, "
                      f"log-odds error held {np.round(row['log_odds_error_held'], 3).tolist()} "
                      f"trend {np.round(row['log_odds_error_trend'], 3).tolist()}, pooled "
                      + ", ".join(f"{k} days {np.round(v['log_odds_error'], 3).tolist()}"
                                  for k, v in row["pooled"].items())
                      + f"; backtest MSE held {row['backtest_mse_held']:.4f} "
                      f"trend {row['backtest_mse_trend']:.4f} pooled "
                      + ", ".join(f"{k} {v['backtest_mse']:.4f}" for k, v in row["pooled"].items())
                      + f"; calibration's pool {row['calibration_pool']} (0: all), its lead "
                      f"{row['calibration_pool_gain_standard_errors']:.2f} standard errors, taken: "
                      f"{row['calibration_pooled']}")
    save(args.output_name, vars(args), results)


if __name__ == "__main__":
    main()
