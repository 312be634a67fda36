"""benchmarks/oracle_quality.py: the generator's probabilities joined to a prepared log's examples, and the
figures of the perfect model they make."""

from dataclasses import replace

import numpy as np
import pytest

from benchmarks.oracle_quality import calibration_targets, daily_rates, example_probabilities, group_quality
from gem_ops.data.synthetic import STRONG_SIGNAL
from tests.training_data import learnable_data

SMALL = replace(STRONG_SIGNAL, n_users=600)


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    return learnable_data(tmp_path_factory.mktemp("oracle"), SMALL, days=4, eval_days=1).open()


def test_every_example_finds_the_probabilities_its_labels_were_drawn_with(logs):
    frame, _ = example_probabilities(logs, SMALL)
    assert frame.height == len(logs)
    click = frame["label_click"].to_numpy()
    assert np.array_equal(np.isnan(click), frame["p_click"].is_null().to_numpy())
    labelled = ~np.isnan(click)
    p = frame["p_click"].to_numpy()[labelled]
    assert abs(click[labelled].sum() - p.sum()) < 4 * np.sqrt((p * (1 - p)).sum())


def test_a_log_of_another_config_is_refused(logs):
    with pytest.raises(ValueError, match="no raw ad impression.*--log"):
        example_probabilities(logs, replace(SMALL, seed=1))


def test_the_perfect_model_ranks_well_and_is_calibrated_within_label_noise(logs):
    frame, _ = example_probabilities(logs, SMALL)
    quality = group_quality(frame.filter(frame["split"] == 1), logs.surfaces, logs.objectives)
    assert {"all/click", "feed/click", "all/conversion"} <= set(quality)
    for group in ("all/click", "all/conversion"):
        q = quality[group]
        assert q["auc"] > 0.8 and q["ne"] < 0.85, (group, q)
        assert abs(q["calibration"] - 1) < 4 * q["calibration_stderr"], (group, q)
        assert q["true_rate"] == pytest.approx(q["calibration"] * q["realised_rate"])
    days = daily_rates(frame, logs.objectives)["feed/click"]
    assert len(days["day"]) == 4 and days["eval"] == [False, False, False, True]


def test_calibration_targets_are_judged_against_the_eval_days_true_rates(logs):
    frame, _ = example_probabilities(logs, SMALL)
    daily = daily_rates(frame, logs.objectives)
    targets = calibration_targets(daily)
    feed = targets["feed/click"]
    assert feed["backtested_pool"] == 1  # three training days: too few to backtest, so the newest day's rate
    errors = feed["log_odds_error_against_true_rate"]
    assert errors["newest_day"] == errors["backtested"]
    n = daily["feed/click"]["examples"][2]
    # half a positive added, as calibration does
    newest = (daily["feed/click"]["positives"][2] + 0.5) / (n + 1)
    true = daily["feed/click"]["true_rate"][3]
    assert errors["newest_day"][0] == pytest.approx(np.log(newest / (1 - newest)) - np.log(true / (1 - true)), rel=1e-9)
    assert set(targets["root_mean_square"]) == {"newest_day", "backtested"}
