"""benchmarks/size_sets.py: distinct sets of sizes a compiled step meets, exact and bucketed, and the padding's cost."""

from benchmarks.size_sets import count_sets
from gem_ops.model.config import model_config
from gem_ops.model.features import model_input
from tests.model_inputs import SPEC, random_batch


def test_buckets_merge_nearby_sizes_into_one_set_at_the_cost_of_padding():
    config = model_config("gem", width=0.25, blocks=2)
    batches = [random_batch(lengths, seed=seed) for lengths, seed in
               (([30, 2, 9], 0), ([31, 2, 9], 1), ([30, 3, 9], 2), ([30, 2, 9], 0))]  # the last: the first again

    def model_input_of(batch, ratio):
        return model_input(batch, SPEC, config, with_level_sizes=True, size_bucket=ratio)

    results = count_sets(batches, [0.0, 2.0], model_input_of)
    exact, bucketed = results["0.0"], results["2.0"]
    assert exact["sets"] == 3 and exact["first_steps"] == [0, 1, 2] and exact["padded_over_real_tokens"] == 1.0
    assert bucketed["sets"] == 1 and bucketed["padded_over_real_tokens"] > 1.0
