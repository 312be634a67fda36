"""Training on cut histories: per-example caps in the loader, the step's draw, and the engine reading them."""

import dataclasses

import numpy as np
import pytest

from gem_ops.train.history_cuts import history_caps
from tests.test_training import CONFIG, TINY, data  # noqa: F401  (the module's data fixture)


def test_per_example_caps_keep_each_history_s_most_recent_events(data):  # noqa: F811
    logs = data.open()
    indices = np.flatnonzero(logs.history_lengths(32) >= 5)[:40]
    whole = logs.batch(indices, 32)
    caps = np.resize(np.array([1, 3, 100, 0]), indices.size)
    cut = logs.batch(indices, 32, history_caps=caps)
    lengths, cut_lengths = whole.history_lengths.numpy(), cut.history_lengths.numpy()
    assert (cut_lengths == np.minimum(lengths, caps)).all()
    offsets, cut_offsets = whole.history_offsets.numpy(), cut.history_offsets.numpy()
    for b in range(indices.size):
        kept = slice(offsets[b + 1] - cut_lengths[b], offsets[b + 1])  # the newest events are last
        new = slice(cut_offsets[b], cut_offsets[b + 1])
        assert (cut.history_item_id[new] == whole.history_item_id[kept]).all()
        assert (cut.history_age_seconds[new] == whole.history_age_seconds[kept]).all()
    with pytest.raises(ValueError, match="history_caps"):
        logs.batch(indices, 32, history_caps=caps[:3])


def test_the_cuts_are_a_share_log_uniform_and_the_same_for_the_same_step():
    caps = history_caps(20_000, 1024, 0.5, seed=3, step=7)
    assert np.array_equal(caps, history_caps(20_000, 1024, 0.5, seed=3, step=7))
    assert not np.array_equal(caps, history_caps(20_000, 1024, 0.5, seed=3, step=8))
    cut = caps[caps < 1024]
    assert 0.48 < (caps < 1024).mean() < 0.52 and cut.min() >= 1
    # Log-uniform: about as many cuts in [1, 32) as in [32, 1024)
    assert 0.4 < (cut < 32).mean() < 0.6
    assert history_caps(10, 1024, 0.0, seed=3, step=7) is None
    with pytest.raises(ValueError, match="history_cut_share"):
        dataclasses.replace(CONFIG, history_cut_share=1.5)


def test_training_reads_the_cut_histories(data):  # noqa: F811
    from gem_ops.train.engine import train

    logs, plan = data.open(), data.plans[1]
    _, whole = train(logs, plan, TINY, dataclasses.replace(CONFIG, max_steps=3))
    _, cut = train(logs, plan, TINY, dataclasses.replace(CONFIG, max_steps=3, history_cut_share=1.0))
    _, again = train(logs, plan, TINY, dataclasses.replace(CONFIG, max_steps=3, history_cut_share=1.0))
    assert sum(cut.step_flops) < sum(whole.step_flops)  # fewer history tokens in every step
    assert cut.losses == pytest.approx(again.losses, rel=1e-5) and cut.losses != pytest.approx(whole.losses, rel=1e-5)


def test_training_and_its_evaluation_read_the_retrieved_events(data, monkeypatch):  # noqa: F811
    """With retrieved_events the engine's steps and its evaluation ask the loader for the candidate's older
    events beyond the cut histories: more history tokens in the steps than the cuts alone leave."""
    from gem_ops.data.loader import SequenceLogs
    from gem_ops.train.engine import train

    logs, plan = data.open(), data.plans[1]
    asked, real_batch = [], SequenceLogs.batch
    monkeypatch.setattr(SequenceLogs, "batch", lambda self, *args, retrieved_events=0, **kwargs: asked.append(
        retrieved_events) or real_batch(self, *args, retrieved_events=retrieved_events, **kwargs))
    _, cut = train(logs, plan, TINY, dataclasses.replace(CONFIG, max_steps=3, history_cut_share=1.0))
    assert set(asked) == {0}
    asked.clear()  # (the label-rate and warm-up batches read no retrieval: no history, or shapes only)
    retrieving = dataclasses.replace(TINY, sequence=dataclasses.replace(TINY.sequence, retrieved_events=4))
    model, found = train(logs, plan, retrieving, dataclasses.replace(CONFIG, max_steps=3, history_cut_share=1.0))
    assert asked.count(4) >= 3 + 1  # the 3 steps and the evaluation's batches
    assert sum(found.step_flops) > sum(cut.step_flops)
    assert model.config.sequence.retrieved_events == 4  # a part of the model: served with them too
    for wrong in (-1, TINY.sequence.max_history_len + 1):
        with pytest.raises(ValueError, match="sequence.retrieved_events"):
            dataclasses.replace(TINY, sequence=dataclasses.replace(TINY.sequence, retrieved_events=wrong))
