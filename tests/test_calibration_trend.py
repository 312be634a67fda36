"""A trend in the model's residual carried one day forward into its calibration: found where the rate trends, left
alone where it only scatters, and applied to the held-out day's mean prediction."""

import dataclasses

import numpy as np
import pytest
import torch

from gem_ops.data.synthetic import STRONG_SIGNAL, SurfaceSpec
from gem_ops.train.batches import MS_PER_DAY
from gem_ops.train.calibration_trend import (MAX_DAILY_TREND, TREND_DAYS, TREND_EXAMPLES_PER_DAY, residual_trends,
                                             trend_examples)
from gem_ops.train.config import TrainConfig
from tests.training_data import learnable_data


def _days_of_predictions(daily_ratio: np.ndarray, examples: int = 4000, rate: float = 0.1, seed: int = 0):
    """One domain, one task: every day's examples predicted at `rate`, labelled at rate * that day's ratio."""
    rng = np.random.default_rng(seed)
    days = np.repeat(np.arange(daily_ratio.size), examples)
    labels = (rng.random(days.size) < rate * daily_ratio[days]).astype(np.float64)[:, None]
    ones = np.ones_like(labels, dtype=bool)
    return days, np.full_like(labels, rate), labels, ones, np.zeros(days.size, dtype=np.int64)


def test_a_trending_residual_is_found_and_a_scattering_one_is_not():
    slope, error = residual_trends(*_days_of_predictions(np.exp(0.08 * np.arange(7))), domains=1)
    assert slope[0, 0] == pytest.approx(0.08, abs=0.03) and abs(slope[0, 0]) / error[0, 0] > 2
    flat = np.exp(np.random.default_rng(1).normal(0, 0.03, 7))  # a few percent a day, no direction
    slope, error = residual_trends(*_days_of_predictions(flat, seed=2), domains=1)
    assert abs(slope[0, 0]) / error[0, 0] < 2
    # Too few days: no slope at all.
    slope, error = residual_trends(*_days_of_predictions(np.ones(3)), domains=1)
    assert np.isnan(slope).all() and np.isnan(error).all()


def test_the_error_widens_where_days_scatter_beyond_their_labels_noise():
    days, p, y, mask, surface = _days_of_predictions(np.exp(np.array([0.0, 0.3, -0.3, 0.3, -0.3, 0.3, -0.3])))
    _, wide = residual_trends(days, p, y, mask, surface, domains=1)
    _, binomial = residual_trends(*_days_of_predictions(np.ones(7)), domains=1)
    assert wide[0, 0] > 3 * binomial[0, 0]


@pytest.fixture(scope="module")
def trending_log(tmp_path_factory):
    """Feed clicks 15% up a day, reels flat."""
    surfaces = (SurfaceSpec("feed", 0.6, 0.06, 0.4, ctr_drift=0.15), SurfaceSpec("reels", 0.4, 0.12, 0.35))
    config = dataclasses.replace(STRONG_SIGNAL, n_users=600, surfaces=surfaces)
    return learnable_data(tmp_path_factory.mktemp("trend"), config, days=10, eval_days=1, max_history_len=16,
                          sub_batch_size=16)


def test_the_trend_examples_are_the_days_before_the_held_out_one(trending_log):
    from gem_ops.data.batch_shuffling import read_plan
    from gem_ops.train.batches import newest_days

    logs = trending_log.open()
    held = newest_days(logs, trending_log.plans[1], 1)
    picked = trend_examples(logs, read_plan(trending_log.plans[1]).reshape(-1), held, seed=0)
    days = logs.column("timestamp")[picked] // MS_PER_DAY
    held_day = (logs.column("timestamp")[held] // MS_PER_DAY).max()
    assert np.array_equal(np.unique(days), np.arange(held_day - TREND_DAYS + 1, held_day))
    assert np.bincount(days - days.min()).max() <= TREND_EXAMPLES_PER_DAY and not np.isin(picked, held).any()


def test_training_carries_the_feed_trend_into_its_calibration(trending_log, monkeypatch):
    from gem_ops.model.config import model_config
    from gem_ops.train import calibration_rate
    from gem_ops.train.batches import newest_days
    from gem_ops.train.engine import train
    from gem_ops.train.evaluation import gathered_predictions

    # Every group's rate pooled over 3 days unless marked trending: the engine must mark the feed clicks, whose
    # calibration then steps from the held-out day's own level.
    pooled = lambda n, p, trending=None: np.where(np.asarray(trending), 1, 3)  # noqa: E731
    monkeypatch.setattr(calibration_rate, "backtested_pools", pooled)
    logs = trending_log.open()
    config = TrainConfig(max_steps=30, eval_max_examples=100_000, validation_days=1, eval_every=10, warmup_steps=2,
                         lr_dense=3e-3)
    model, result = train(logs, trending_log.plans[1], model_config("vertical", width=0.5, **{
        "sequence.max_history_len": 16}), config)
    record = result.calibration
    feed, reels = logs.surfaces.index("feed"), logs.surfaces.index("reels")
    click = model.objectives.index("click")
    slope, taken = np.array(record["trend_slope"]), np.array(record["trend_taken"])
    assert taken[feed, click] and 0.05 < slope[feed, click] <= MAX_DAILY_TREND
    assert not taken[reels, click]
    assert record["rate_days"][feed][click] == 1 and record["rate_days"][reels][click] == 3
    # The held-out day's mean feed prediction rose by the slope's day over the shift before the trend.
    held = newest_days(logs, trending_log.plans[1], 1)
    out = gathered_predictions(model, logs, config, torch.device("cpu"), held)
    rows = out["label_mask"][:, click] & (out["surface"] == feed)
    after = torch.sigmoid(out["logits"][rows, click]).mean().item()
    scale = np.array(record["scale"])[feed, click]
    raw = (out["logits"][rows, click] - record["shift"][feed][click]) / scale
    before = torch.sigmoid(raw * scale + record["shift_before_trend"][feed][click]).mean().item()
    assert after == pytest.approx(before * np.exp(slope[feed, click]), rel=1e-3)
    assert record["shift"][reels][click] == record["shift_before_trend"][reels][click]


def test_without_the_trend_nothing_is_recorded(trending_log):
    from gem_ops.model.config import model_config
    from gem_ops.train.engine import train

    logs = trending_log.open()
    config = TrainConfig(max_steps=4, eval_max_examples=100_000, validation_days=1, eval_every=2, warmup_steps=1,
                         calibration_trend=False)
    _, result = train(logs, trending_log.plans[1], model_config("vertical", width=0.5, **{
        "sequence.max_history_len": 16}), config)
    assert "trend_slope" not in result.calibration and "shift_before_trend" not in result.calibration


def test_a_taken_trend_moves_the_held_out_days_mean_prediction_by_its_slope_and_no_other():
    from gem_ops.train.calibration_trend import step_trends

    logits = torch.tensor(np.random.default_rng(0).normal(-2, 1, (3000, 1)))
    held = {"logits": logits, "label_mask": torch.ones_like(logits, dtype=torch.bool),
            "surface": torch.tensor(np.arange(3000) % 2)}
    scale, shift = torch.tensor([[0.8], [0.8]]), torch.tensor([[0.3], [0.3]])

    def mean(d: int) -> float:
        return torch.sigmoid(scale[d, 0] * logits[held["surface"] == d, 0] + shift[d, 0]).mean().item()

    before = [mean(0), mean(1)]
    step_trends(scale, shift, held, {"trend_slope": [[0.1], [1.0]], "trend_taken": [[True], [False]]})
    assert mean(0) == pytest.approx(before[0] * np.exp(0.1), rel=1e-4) and mean(1) == before[1]
    step_trends(scale, shift, held, {"trend_slope": [[0.0], [-1.0]], "trend_taken": [[False], [True]]})
    assert mean(1) == pytest.approx(before[1] * np.exp(-MAX_DAILY_TREND), rel=1e-4)  # clipped
