"""The rate calibration aims at: pooled over many days where a group's daily rate only scatters, the newest day's
where it drifts, and the calibrated model's mean prediction on the held-out day at that rate."""

import dataclasses

import numpy as np
import pytest
import torch

from gem_ops.data.synthetic import STRONG_SIGNAL
from gem_ops.train.calibration_rate import (backtested_pools, daily_label_counts, forecast_rates, shift_for_rate)
from gem_ops.train.config import TrainConfig
from tests.training_data import learnable_data


def _counts(rates: np.ndarray, examples: int = 4000, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """[days, 1 domain, groups] counts drawn at the given [days, groups] daily rates."""
    n = np.full((rates.shape[0], 1, rates.shape[1]), float(examples))
    p = np.random.default_rng(seed).binomial(examples, rates)[:, None, :].astype(float)
    return n, p


def test_a_scattering_rate_pools_every_day_and_a_drifting_one_keeps_the_newest():
    days = 13
    n, p = _counts(np.stack([np.full(days, 0.1), np.linspace(0.05, 0.15, days)], 1))
    pools = backtested_pools(n, p)
    assert pools.tolist() == [[0, 1]]
    rates = forecast_rates(n, p, pools)
    assert rates[0, 0] == pytest.approx(p[:, 0, 0].sum() / n[:, 0, 0].sum(), rel=1e-3)  # every day's rate
    assert rates[0, 1] == pytest.approx(p[-1, 0, 1] / n[-1, 0, 1], rel=1e-3)  # the newest day's
    assert abs(rates[0, 0] - 0.1) < abs(p[-1, 0, 0] / n[-1, 0, 0] - 0.1) + 1e-9


def test_too_few_days_or_an_unlabelled_day_keep_the_newest_days_rate():
    n, p = _counts(np.full((3, 2), 0.1))
    assert (backtested_pools(n, p) == 1).all()  # nothing to backtest on
    n, p = _counts(np.full((10, 2), 0.1))
    n[4, 0, 1] = p[4, 0, 1] = 0  # a day without labels for one group
    assert backtested_pools(n, p)[0, 1] == 1


def _scattering_groups(groups: int = 8, examples: int = 400, seed: int = 16) -> tuple[np.ndarray, np.ndarray]:
    """[13 days, 1 domain, groups] counts of groups whose rate only scatters around 10%, forty positives a day."""
    return _counts(np.full((13, groups), 0.1), examples, seed)


def test_groups_that_scatter_alike_pool_together_where_each_alone_is_unclear():
    n, p = _scattering_groups()
    alone = np.array([backtested_pools(n[:, :, [g]], p[:, :, [g]])[0, 0] for g in range(n.shape[2])])
    assert (alone == 1).sum() >= 3  # a dozen days judge one group's pools noisily
    assert (backtested_pools(n, p) != 1).all()  # every group's days together are clear


def test_a_drifting_group_keeps_the_newest_day_while_the_others_pool():
    n, p = _scattering_groups()
    drift_n, drift_p = _counts(np.linspace(0.05, 0.15, 13)[:, None], examples=4000, seed=1)
    pools = backtested_pools(np.concatenate([n, drift_n], 2), np.concatenate([p, drift_p], 2))
    assert (pools[0, :-1] != 1).all() and pools[0, -1] == 1


def test_a_trending_group_keeps_the_newest_day_and_does_not_vote():
    n, p = _scattering_groups()
    alone = np.array([backtested_pools(n[:, :, [g]], p[:, :, [g]])[0, 0] for g in range(n.shape[2])])
    unclear = int(np.flatnonzero(alone == 1)[0])
    trending = np.zeros(n.shape[1:], dtype=bool)
    trending[0, :3] = True
    pools = backtested_pools(n, p, trending=trending)
    assert (pools[0, :3] == 1).all() and (pools[0, 3:] != 1).all()
    # With every other group trending, no vote is left to pool the unclear group.
    others = np.ones(n.shape[1:], dtype=bool)
    others[0, unclear] = False
    assert backtested_pools(n, p, trending=others)[0, unclear] == 1
    assert backtested_pools(n, p)[0, unclear] != 1


def test_the_shift_puts_the_mean_prediction_at_the_rate():
    logits = np.random.default_rng(1).normal(size=2000)
    for scale, rate in ((1.0, 0.1), (0.5, 0.7)):
        b = shift_for_rate(logits, scale, rate)
        assert np.mean(1 / (1 + np.exp(-(scale * logits + b)))) == pytest.approx(rate, rel=1e-6)


@pytest.fixture(scope="module")
def long_log(tmp_path_factory):
    small = dataclasses.replace(STRONG_SIGNAL, n_users=300)
    return learnable_data(tmp_path_factory.mktemp("rate"), small, days=8, eval_days=1, max_history_len=16,
                          sub_batch_size=16)


@pytest.mark.parametrize("rate, tasks", [("backtested", ()), ("backtested", ("conversion",)), ("newest_day", ())])
def test_training_calibrates_to_the_forecast_rate_on_the_held_out_day(long_log, rate, tasks):
    """Every objective of the data, or one of them (a vertical's model): its rates are its own objective's."""
    from gem_ops.model.config import model_config
    from gem_ops.train.batches import MS_PER_DAY, newest_days
    from gem_ops.train.engine import train
    from gem_ops.train.evaluation import gathered_predictions

    logs = long_log.open()
    config = TrainConfig(max_steps=6, eval_max_examples=100_000, validation_days=1, eval_every=3, warmup_steps=2,
                         calibration_rate=rate)
    model_settings = model_config("vertical", width=0.5, **{"sequence.max_history_len": 16}, tasks=tasks)
    model, result = train(logs, long_log.plans[1], model_settings, config)
    assert model.objectives == (tasks or tuple(logs.objectives))
    held_out = newest_days(logs, long_log.plans[1], 1)
    out = gathered_predictions(model, logs, config, torch.device("cpu"), held_out)
    surface = out["surface"].numpy()
    if rate == "newest_day":
        assert "rate_days" not in result.calibration
        return
    pools, targets = np.array(result.calibration["rate_days"]), np.array(result.calibration["target_rate"])
    kept = pools == 1  # Platt scaling's own shift stays where the newest day's rate forecasts best
    pooled = np.array(result.calibration["shift_before_trend"])  # the residual's trend moves the shift after the pool
    assert np.array_equal(pooled[kept], np.array(result.calibration["newest_day_shift"])[kept])
    assert pools.shape == (len(logs.surfaces), len(model.objectives)) and (pools != 1).any()
    train_split = logs.split_indices("train")
    n, p = daily_label_counts(logs, train_split, len(logs.surfaces), model.objectives)
    assert n.shape[0] == 7 and (logs.column("timestamp")[held_out] // MS_PER_DAY).max() == (
        logs.column("timestamp")[train_split] // MS_PER_DAY).max()
    for d, t in zip(*np.nonzero(pools != 1)):
        rows = out["label_mask"][:, t].numpy() & (surface == d)
        if not rows.any():
            continue
        days = slice(None) if pools[d, t] == 0 else slice(-pools[d, t], None)
        # the pooled days' rate (half a positive added, so that no rate is 0 or 1)
        assert targets[d, t] == pytest.approx((p[days, d, t].sum() + 0.5) / (n[days, d, t].sum() + 1), rel=1e-6)
        shift = np.array(result.calibration["shift"])[d, t]
        mean_p = float(torch.sigmoid(out["logits"][rows, t] - shift + pooled[d, t]).mean())
        assert mean_p == pytest.approx(targets[d, t], rel=1e-3)


def test_pools_must_start_with_the_newest_day():
    n, p = _counts(np.full((10, 1), 0.1))
    with pytest.raises(ValueError, match="newest day"):
        backtested_pools(n, p, pools=(3, 1))
    with pytest.raises(ValueError, match="calibration_rate"):
        TrainConfig(calibration_rate="pooled")
