"""benchmarks/calibration_targets.py: each calibration-target rule's forecast of the eval days' rate, judged against
the synthetic generator's true rates and, on a prepared log, by a rolling origin."""

import numpy as np
import pytest

from benchmarks.calibration_targets import (ENGINE_RULE, forecast_errors, paired_summary, rolling_run, rule_pools,
                                            synthetic_daily_counts, synthetic_run)
from benchmarks.oracle_quality import synthetic_config
from tests.training_data import learnable_data


def test_on_a_steady_rate_pooling_every_day_forecasts_better_than_the_newest_day():
    rng = np.random.default_rng(0)
    truth = np.full(2, np.log(0.1 / 0.9))
    # 50 groups whose rate only scatters: the newest day carries its draw's noise, the pool a 12th of it
    p = rng.binomial(1500, 0.1, (12, 50)).astype(np.float64)
    errors = forecast_errors(np.full((12, 50), 1500.0), p, np.full((2, 50), truth[0]))
    rms = {rule: np.sqrt(np.mean(np.square(e))) for rule, e in errors.items()}
    assert set(rms) == {"newest_day", ENGINE_RULE, "own_backtest", "best_backtest", "pool_3", "pool_7", "every_day"}
    assert rms["every_day"] < 0.5 * rms["newest_day"]
    assert rms["every_day"] <= rms["best_backtest"] <= rms["newest_day"]
    assert rms[ENGINE_RULE] < 0.8 * rms["own_backtest"]  # judged together the groups pool where alone some would not


def test_on_a_shifted_rate_the_backtest_keeps_the_newest_day():
    n = np.full((12, 1), 5000.0)
    p = np.where(np.arange(12) < 6, 250.0, 750.0)[:, None]  # 5% then 15%, each day's count exact: no noise to pool
    pools = rule_pools(n, p)
    assert pools[ENGINE_RULE][0] == 1 and pools["best_backtest"][0] == 1


def test_the_synthetic_counts_hold_every_day_of_each_group_and_their_true_rates():
    counts = synthetic_daily_counts(synthetic_config("strong_signal", 0))
    assert {"feed/click", "feed/conversion", "search/click"} <= set(counts)
    n, p, true = counts["feed/click"]
    assert n.shape == p.shape == true.shape == (14,)
    assert np.all((0 < true) & (true < 1)) and np.all(p <= n)
    # the true rate is what the labels were drawn with: summed over the days, the realised count within 4 sd of it
    assert abs(p.sum() - (true * n).sum()) < 4 * np.sqrt((true * (1 - true) * n).sum())
    run = synthetic_run("strong_signal", 0)
    assert set(run) == set(rule_pools(n[:, None], p[:, None])) and all(np.isfinite(v) and v > 0 for v in run.values())
    summary = paired_summary([run, synthetic_run("strong_signal", 1)])
    assert summary[ENGINE_RULE]["minus_engine_rule"] == 0.0


def test_a_rolling_origin_needs_groups_with_enough_positives(tmp_path):
    logs = learnable_data(tmp_path, days=8, eval_days=1).sequence_logs
    run = rolling_run(logs, min_positives=1)
    assert run["forecasts"] > 0 and set(run["root_mean_square"]) >= {"newest_day", ENGINE_RULE}
    with pytest.raises(ValueError, match="--min-positives"):
        rolling_run(logs, min_positives=10**9)
