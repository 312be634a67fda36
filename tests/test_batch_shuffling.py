"""Base Batch Shuffling: balanced per-rank cost, every example once, length-homogeneous sub-batches."""

import numpy as np
import pytest

from gem_ops.data.batch_shuffling import (
    ShufflingConfig,
    imbalance,
    plan_base_batch_shuffling,
    plan_random,
    read_rank_plan,
    write_plan,
)

WORLD = 8
N = 200_000
MAX_LEN = 2048


def pareto_lengths(seed: int = 0) -> np.ndarray:
    """Heavy tail (Pareto, alpha 1.2): median ~16, ~0.4% at the 2048 cap."""
    rng = np.random.default_rng(seed)
    return np.minimum(rng.pareto(1.2, N) * 20, MAX_LEN).astype(np.int64)


def wide_lognormal_lengths(seed: int = 0) -> np.ndarray:
    """Very skewed (lognormal, sigma 1.5): median ~20, a long thin tail to the cap, where neighbouring
    lengths differ a lot and (L + 1)^2 costs vary by orders of magnitude."""
    rng = np.random.default_rng(seed)
    return np.minimum(rng.lognormal(3.0, 1.5, N), MAX_LEN).astype(np.int64)


def lognormal_lengths(seed: int = 0) -> np.ndarray:
    """Skewed (lognormal, sigma 1): median ~150, p99 ~1500."""
    rng = np.random.default_rng(seed)
    return np.minimum(rng.lognormal(5.0, 1.0, N), MAX_LEN).astype(np.int64)


@pytest.fixture(scope="module")
def lengths() -> np.ndarray:
    return pareto_lengths()


@pytest.fixture(scope="module")
def plan(lengths):
    return plan_base_batch_shuffling(lengths, WORLD, ShufflingConfig(sub_batches_per_rank=8, seed=5))


@pytest.mark.parametrize(
    "make_lengths, sub_batches_per_rank, cost",
    [
        (pareto_lengths, 8, "attention"),
        (pareto_lengths, 8, "tokens"),
        (lognormal_lengths, 4, "attention"),
        (lognormal_lengths, 1, "tokens"),
        (wide_lognormal_lengths, 4, "attention"),
        (wide_lognormal_lengths, 1, "attention"),
    ],
)
def test_bbs_balances_ranks_where_random_does_not(make_lengths, sub_batches_per_rank, cost):
    lengths = make_lengths()
    config = ShufflingConfig(sub_batch_size=128, sub_batches_per_rank=sub_batches_per_rank, cost=cost, seed=1)
    balanced = imbalance(plan_base_batch_shuffling(lengths, WORLD, config))["max_over_mean"]
    baseline = imbalance(plan_random(lengths, WORLD, config))["max_over_mean"]
    assert balanced <= 1.02
    assert baseline > 1.05
    assert baseline > balanced


def test_every_kept_example_appears_exactly_once(lengths, plan):
    ids = plan.examples.reshape(-1)
    assert np.unique(ids).size == ids.size
    assert ids.size + plan.dropped == lengths.size
    assert ids.min() >= 0 and ids.max() < lengths.size


def test_every_rank_step_holds_a_full_batch(plan):
    config = ShufflingConfig(sub_batches_per_rank=8)
    assert plan.examples.shape == (plan.steps, WORLD, config.rank_batch_size)
    assert plan.dropped < WORLD * config.rank_batch_size


def test_example_ids_are_passed_through(lengths):
    ids = np.arange(lengths.size, dtype=np.int64) * 3 + 1000
    config = ShufflingConfig(sub_batches_per_rank=8, seed=5)
    plain = plan_base_batch_shuffling(lengths, WORLD, config)
    mapped = plan_base_batch_shuffling(lengths, WORLD, config, example_ids=ids)
    np.testing.assert_array_equal(mapped.examples, ids[plain.examples])


def test_recorded_cost_matches_lengths(lengths, plan):
    expected = ((lengths[plan.examples] + 1.0) ** 2).sum(-1)  # attention cost: (L + 1)^2 per sample
    np.testing.assert_allclose(plan.cost, expected)


def test_sub_batches_cover_neighbouring_lengths(lengths, plan):
    subs = lengths[plan.examples].reshape(-1, 128)  # each rank batch is 8 sub-batches of 128
    lo, hi = subs.min(1), subs.max(1)
    # A sub-batch is drawn from one group of WORLD x 128 length-sorted neighbours: fewer samples than
    # that lie strictly between its shortest and longest.
    kept = np.sort(lengths[plan.examples.reshape(-1)])
    between = np.searchsorted(kept, hi, side="left") - np.searchsorted(kept, lo, side="right")
    assert between.max() < WORLD * 128
    spread = lengths.max() - lengths.min()
    assert np.mean(hi - lo <= 0.01 * spread) > 0.9


def test_plan_is_deterministic_under_a_seed(lengths):
    config = ShufflingConfig(seed=11)
    first = plan_base_batch_shuffling(lengths, WORLD, config)
    again = plan_base_batch_shuffling(lengths, WORLD, ShufflingConfig(seed=11))
    other = plan_base_batch_shuffling(lengths, WORLD, ShufflingConfig(seed=12))
    np.testing.assert_array_equal(first.examples, again.examples)
    assert not np.array_equal(first.examples, other.examples)
    assert not np.array_equal(
        plan_random(lengths, WORLD, config).examples, plan_random(lengths, WORLD, ShufflingConfig(seed=12)).examples
    )


def test_cost_models_differ(lengths):
    by_tokens = plan_base_batch_shuffling(lengths, WORLD, ShufflingConfig(cost="tokens"))
    by_attention = plan_base_batch_shuffling(lengths, WORLD, ShufflingConfig(cost="attention"))
    np.testing.assert_allclose(by_tokens.cost, (lengths[by_tokens.examples] + 1.0).sum(-1))
    assert by_attention.cost.sum() > by_tokens.cost.sum()


def test_write_and_read_each_rank_round_trip(tmp_path, plan):
    path = write_plan(plan, tmp_path / "plan.parquet")
    for rank in range(WORLD):
        np.testing.assert_array_equal(read_rank_plan(path, rank), plan.rank_examples(rank))


def test_reading_a_rank_beyond_the_world_size_raises(tmp_path, plan):
    path = write_plan(plan, tmp_path / "plan.parquet")
    with pytest.raises(ValueError, match=f"rank {WORLD}.*smaller world size"):
        read_rank_plan(path, WORLD)


@pytest.mark.parametrize(
    "setting, kwargs",
    [("sub_batch_size", {"sub_batch_size": 0}), ("sub_batches_per_rank", {"sub_batches_per_rank": 0}),
     ("cost", {"cost": "foo"})],
)
def test_invalid_config_names_the_setting(setting, kwargs):
    with pytest.raises(ValueError, match=setting):
        ShufflingConfig(**kwargs)


@pytest.mark.parametrize("planner", [plan_base_batch_shuffling, plan_random])
def test_world_size_zero_is_rejected(planner, lengths):
    with pytest.raises(ValueError, match="world_size"):
        planner(lengths[:1000], 0, ShufflingConfig())
