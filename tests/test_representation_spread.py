"""The representation-spread benchmark's measure: 0 for a layer that hands every example the same vector, about 1
for examples as different as the output is large, and one figure per watched layer after a forward."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks.representation_spread import layer_hooks, spread, trunk_course
from gem_ops.model.config import model_config
from gem_ops.model.features import model_input
from gem_ops.train.model_state import seeded_model
from tests.model_inputs import SPEC, random_batch


def test_the_same_vector_for_every_example_has_no_spread():
    relative, rms = spread(torch.tensor([[3.0, -1.0, 2.0]]).repeat(64, 1))
    assert relative == 0.0 and rms == pytest.approx((14 / 3) ** 0.5)


def test_independent_examples_spread_as_far_as_their_size_and_a_shared_offset_shrinks_it():
    noise = torch.randn(4096, 32, generator=torch.Generator().manual_seed(0))
    assert spread(noise)[0] == pytest.approx(1.0, abs=0.03)
    shifted, rms = spread(noise + 9.0)  # every example moved by the same vector: rms ~ 9.06, std unchanged
    assert shifted == pytest.approx(1 / rms, rel=0.03) and rms == pytest.approx(82**0.5, rel=0.01)


def test_every_watched_layer_reports_after_a_forward():
    config = model_config("gem", width=0.5, blocks=2, **{"sequence.first_level_tokens": 8,
                                                         "sequence.min_level_tokens": 2})
    model = seeded_model(SPEC, config, seed=0)
    latest = {}
    layer_hooks(model, latest)
    model(model_input(random_batch([0, 1, 5, 12, 3, 30]), SPEC, config))
    assert set(latest) == {"embeddings.pooled", "embeddings.candidate", "embeddings.history", "branch.all",
                           "branch.engaged", "interaction.0", "interaction.1", "trunk"}
    assert all(0.0 < relative < 2.0 and rms > 0 for relative, rms in latest.values())


def test_the_trunks_course_names_when_it_collapsed_and_when_it_came_back():
    def steps(spreads):
        return [{"step": 5 * i, "layers": {"trunk": (s, 1.0)}} for i, s in enumerate(spreads)]

    course = trunk_course(steps([0.3, 0.05, 0.01, 0.005, 0.04, 0.12, 0.2]))
    assert (course["collapsed_at"], course["recovered_at"], course["steps_collapsed"]) == (10, 25, 15)
    assert course["min"] == 0.005 and course["last"] == 0.2 and course["last_step"] == 30
    stuck = trunk_course(steps([0.3, 0.01, 0.008]))  # never back within the trace: counted to its end
    assert (stuck["recovered_at"], stuck["steps_collapsed"]) == (None, 6)
    assert trunk_course(steps([0.3, 0.2]))["collapsed_at"] is None


def test_a_variant_that_sets_what_the_trace_fixes_is_refused_by_name():
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "representation_spread.py"
    done = subprocess.run([sys.executable, str(script), "--variants", "fast:train.eval_every=10"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "--variants fast: train.eval_every cannot be set here" in done.stderr
