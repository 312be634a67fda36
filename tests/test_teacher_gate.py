"""The teacher gate of the hierarchy: a domain's verticals learn from its FM only where the FM ranks the FM's
held-out day (the newest of its window) better than GEM does."""

import dataclasses

import numpy as np
import pytest

from gem_ops.data.synthetic import STRONG_SIGNAL
from gem_ops.transfer.hierarchy import DomainData, choose_domain_teacher
from gem_ops.transfer.knowledge import TeacherPredictions
from gem_ops.transfer.windows import MS_PER_DAY
from tests.training_data import learnable_data


@pytest.fixture(scope="module")
def domain(tmp_path_factory):
    small = dataclasses.replace(STRONG_SIGNAL, n_users=300)
    logs = learnable_data(tmp_path_factory.mktemp("gate"), small, days=4, eval_days=1, max_history_len=16,
                          sub_batch_size=16).open()
    train = logs.split_indices("train")
    examples = train[logs.column("surface")[train] == 0]
    return logs, DomainData(logs.surfaces[0], examples, logs.split_indices("eval"), examples)


def _predictions(logs, examples, good: bool, seed: int = 0) -> TeacherPredictions:
    """Logits that rank the examples' labels right (good) or at random."""
    batch = logs.batch(examples, max_history_len=0)
    noise = np.random.default_rng(seed).normal(size=batch.labels.shape).astype(np.float32)
    logits = (4 * batch.labels.numpy().astype(np.float32) - 2 + noise) if good else noise
    return TeacherPredictions(examples, logits, np.zeros((examples.size, 0), np.float16), tuple(logs.objectives))


def test_the_fm_teaches_only_where_it_ranks_the_held_out_day_better_than_gem(domain):
    logs, data = domain
    good, bad = _predictions(logs, data.foundation, True), _predictions(logs, data.foundation, False)
    choice = choose_domain_teacher(logs, data, fm=good, gem=bad)
    assert choice.teacher == "domain_fm" and choice.fm_auc > 0.9 and choice.gem_auc < 0.75
    choice = choose_domain_teacher(logs, data, fm=bad, gem=good)
    assert choice.teacher == "gem" and choice.gem_auc > choice.fm_auc
    assert choose_domain_teacher(logs, data, fm=good, gem=good).teacher == "gem"  # a tie keeps GEM


def test_only_the_newest_day_of_the_fm_window_is_judged(domain):
    logs, data = domain
    day = logs.column("timestamp")[data.foundation] // MS_PER_DAY
    newest = data.foundation[day == day.max()]
    # Right everywhere but on the newest day, where it ranks at random: the FM loses.
    fm = _predictions(logs, data.foundation, True)
    on_newest = np.isin(fm.example_index, newest)
    fm.logits[on_newest] = _predictions(logs, newest, False, seed=1).logits
    choice = choose_domain_teacher(logs, data, fm=fm, gem=_predictions(logs, data.foundation, True, seed=2))
    assert choice.teacher == "gem" and choice.examples == newest.size


def _figures(auc: float) -> dict:
    return {"auc": auc, "ne": 1 - auc / 2, "calibration": 1.0}


def test_the_transfer_benchmark_scores_the_gated_hierarchy_as_the_gate_chose():
    from benchmarks.transfer import GATE, summarize

    def seed(fm_teaches: bool, hierarchical: float) -> dict:
        row = {"gem": _figures(0.80), "alone": _figures(0.70), "direct_serving": _figures(0.78),
               "hierarchical_serving": _figures(hierarchical),
               GATE: {"fm_auc": 0.7, "gem_auc": 0.72, "fm_teaches": float(fm_teaches)}}
        return {"verticals": {"feed/click": row}}

    summary = summarize([seed(False, 0.60), seed(True, 0.62), seed(False, 0.61)])["feed/click"]
    gated = summary["figures"]["hierarchical_serving_gated"]["auc"]
    assert gated["mean"] == pytest.approx((0.78 + 0.62 + 0.78) / 3)  # GEM's direct student where GEM kept teaching
    assert summary["figures"][GATE]["fm_teaches"]["mean"] == pytest.approx(1 / 3)
    assert GATE not in summary["gap_closed_auc"]  # a record of the gate, not a model
    assert summary["hierarchical_not_worse_than_alone"]["hierarchical_serving_gated"]
    assert not summary["hierarchical_not_worse_than_alone"]["hierarchical_serving"]
