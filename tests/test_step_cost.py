"""The planner's cost model fitted to measured steps, and Base Batch Shuffling balancing what steps really cost."""

import numpy as np
import pytest

from gem_ops.data.batch_shuffling import (ShufflingConfig, imbalance, max_over_mean, plan_base_batch_shuffling,
                                         plan_random, sample_cost)
from gem_ops.data.step_cost import StepCostModel, fit_step_cost, planned_against_observed

WORLD = 4
TRUE = StepCostModel(fixed=0.02, per_token=4e-6, per_pair=2e-9)  # dense layers dominate up to L ~ 2000


def _lengths(seed: int = 0, n: int = 40_000) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.minimum(rng.lognormal(4.5, 1.3, n).astype(np.int64), 4096)


def _measured_steps(noise: float, seed: int = 0):
    """Per rank and step of a random plan: tokens, pairs and seconds from TRUE with multiplicative noise."""
    lengths = _lengths(seed)
    plan = plan_random(lengths, WORLD, ShufflingConfig(sub_batch_size=64, sub_batches_per_rank=2, seed=seed))
    t = lengths[plan.examples].astype(np.float64) + 1
    tokens, pairs = t.sum(-1).ravel(), (t * t).sum(-1).ravel()
    rng = np.random.default_rng(seed + 1)
    return TRUE.seconds(tokens, pairs) * (1 + noise * rng.standard_normal(tokens.size)), tokens, pairs


def test_the_fit_recovers_the_coefficients_of_noisy_steps():
    seconds, tokens, pairs = _measured_steps(noise=0.03)
    fitted = fit_step_cost(seconds, tokens, pairs)
    assert fitted.steps == seconds.size and fitted.relative_error < 0.05
    assert fitted.per_token == pytest.approx(TRUE.per_token, rel=0.1)
    assert fitted.per_pair == pytest.approx(TRUE.per_pair, rel=0.1)
    assert fitted.tokens_per_pair == pytest.approx(2000, rel=0.2)


def test_a_term_the_steps_do_not_pay_is_dropped_not_fitted_negative():
    _, tokens, pairs = _measured_steps(noise=0.0)
    seconds = 0.01 + 3e-6 * tokens  # no attention cost at all
    seconds = seconds * (1 + 0.02 * np.random.default_rng(3).standard_normal(seconds.size))
    fitted = fit_step_cost(seconds, tokens, pairs)
    assert min(fitted.fixed, fitted.per_token, fitted.per_pair) >= 0
    assert fitted.per_token == pytest.approx(3e-6, rel=0.05)
    assert fitted.per_pair * pairs.mean() < 0.02 * seconds.mean()


def test_every_cost_model_gets_the_same_plan_and_the_fitted_one_predicts_the_true_imbalance():
    """Base Batch Shuffling deals samples by length order alone, so tokens, attention and measured costs plan alike
    (within 0.1% of perfect balance under the true cost); the fitted cost makes the plan's own figure, the planned
    imbalance, the one the true step costs give."""
    seconds, tokens, pairs = _measured_steps(noise=0.03)
    fitted = fit_step_cost(seconds, tokens, pairs)
    lengths = _lengths(seed=7)
    base = dict(sub_batch_size=64, sub_batches_per_rank=2, seed=2)
    configs = {"measured": ShufflingConfig(**base, cost="measured", tokens_per_pair=fitted.tokens_per_pair),
               "attention": ShufflingConfig(**base, cost="attention"), "tokens": ShufflingConfig(**base, cost="tokens")}
    plans = {name: plan_base_batch_shuffling(lengths, WORLD, config) for name, config in configs.items()}
    assert all(np.array_equal(plan.examples, plans["measured"].examples) for plan in plans.values())
    t = lengths[plans["measured"].examples].astype(np.float64) + 1
    step = TRUE.seconds(t.sum(-1), (t * t).sum(-1))  # [steps, ranks]: the variable part is what ranks differ in
    variable = step - TRUE.fixed
    true = float(variable.max(1).sum() / variable.mean(1).sum())
    assert true < 1.001
    assert imbalance(plans["measured"])["max_over_mean"] == pytest.approx(true, abs=2e-4)
    per_rank = plans["measured"].cost.sum(0) / plans["measured"].cost.sum() * WORLD
    assert np.allclose(per_rank, variable.sum(0) / variable.sum() * WORLD, atol=1e-3)


def test_measured_cost_lies_between_tokens_and_attention():
    lengths = np.array([0, 9, 99])
    assert sample_cost(lengths, "measured", 0.0).tolist() == sample_cost(lengths, "attention").tolist()
    assert sample_cost(lengths, "measured", 10.0).tolist() == [1 + 10, 100 + 100, 10_000 + 1000]
    assert sample_cost(lengths, "tokens").tolist() == [1, 10, 100]


def test_bad_settings_and_measurements_are_refused_naming_them():
    with pytest.raises(ValueError, match="tokens_per_pair must be finite"):
        ShufflingConfig(cost="measured", tokens_per_pair=float("inf"))
    with pytest.raises(ValueError, match="cost 'measured' only; cost is 'attention'"):
        ShufflingConfig(cost="attention", tokens_per_pair=5.0)
    with pytest.raises(ValueError, match="at least 3 steps"):
        fit_step_cost([0.1, 0.2], [10, 20], [100, 400])
    with pytest.raises(ValueError, match="one length"):
        fit_step_cost([0.1, 0.2, 0.3], [10, 20], [100, 400, 900])
    with pytest.raises(ValueError, match="positive, finite seconds"):
        fit_step_cost([0.1, float("nan"), 0.3], [10, 20, 30], [100, 400, 900])


def test_each_rank_is_planned_from_its_own_tokens_and_pairs_and_set_against_what_it_took():
    """A balanced plan of 4 ranks timed under TRUE, rank 2 slower by 10% in every step (what no batch explains): the
    fit over every (step, rank) plans each rank from its own figures; observed and planned imbalance part by what
    rank 2 adds."""
    lengths = _lengths(seed=4, n=8_000)
    plan = plan_base_batch_shuffling(lengths, WORLD, ShufflingConfig(sub_batch_size=64, sub_batches_per_rank=2,
                                                                     seed=4))
    t = lengths[plan.examples].astype(np.float64) + 1
    tokens, pairs = t.sum(-1), (t * t).sum(-1)  # [steps, ranks]
    seconds = TRUE.seconds(tokens, pairs) * np.where(np.arange(WORLD) == 2, 1.1, 1.0)
    report = planned_against_observed(seconds.tolist(), tokens.tolist(), pairs.tolist())
    assert report["steps"] == tokens.shape[0] and report["cost_model"]["steps"] == tokens.size
    cost = StepCostModel(**{k: report["cost_model"][k] for k in ("fixed", "per_token", "per_pair")})
    ranks = report["per_rank"]
    assert [r["rank"] for r in ranks] == list(range(WORLD))
    for r, figures in enumerate(ranks):
        assert figures["observed_seconds"] == pytest.approx(seconds[:, r].sum())
        assert figures["planned_seconds"] == pytest.approx(cost.seconds(tokens[:, r], pairs[:, r]).sum())
        assert figures["tokens"] == tokens[:, r].sum() and figures["pairs"] == pairs[:, r].sum()
    observed = ranks[2]["observed_seconds"] / ranks[2]["planned_seconds"]
    others = [r["observed_seconds"] / r["planned_seconds"] for i, r in enumerate(ranks) if i != 2]
    assert observed > 1.05 > max(others)  # the slow rank stands out against its own plan
    planned_true = TRUE.seconds(tokens, pairs)
    assert report["imbalance"]["planned"] == pytest.approx(max_over_mean(planned_true), rel=0.02)
    assert report["imbalance"]["observed"] == pytest.approx(max_over_mean(seconds))
    assert report["imbalance"]["planned"] < 1.01 and report["imbalance"]["observed"] > 1.05
    assert report["imbalance"]["tokens"] == pytest.approx(max_over_mean(tokens))


def test_planned_against_observed_skips_steps_without_ranks_and_names_bad_shapes():
    seconds, tokens, pairs = [[], [0.1, 0.2], [0.3, 0.3], [0.2, 0.1]], [[], [1, 2], [3, 3], [2, 1]], \
        [[], [1, 4], [9, 9], [4, 1]]
    assert planned_against_observed(seconds, tokens, pairs)["steps"] == 3
    with pytest.raises(ValueError, match=r"\[steps, ranks\] of one shape"):
        planned_against_observed([[0.1, 0.2], [0.3, 0.3]], [[1, 2], [3, 3]], [[1], [9]])
    assert max_over_mean(np.array([[1.0, 3.0], [2.0, 2.0]])) == pytest.approx(5 / 4)
