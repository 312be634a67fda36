"""benchmarks/attention_calls.py: every attention call of GEM's forward is recorded under the name of its place
(block, branch, self or cross), and the tile counts are those of tiles covering each sequence."""

import numpy as np
import pytest
import torch

from benchmarks.attention_calls import (call_names, computed_dim, naming_the_call, padded_dim, recorded_calls,
                                        save_calls, tile_work, time_calls)
from gem_ops.model.config import model_config
from tests.model_inputs import SPEC, random_batch


def test_each_call_is_named_by_its_place_in_the_forward():
    config = model_config("gem", width=0.5, blocks=2, **{"embedding.item_buckets": 1024,
                                                         "embedding.user_buckets": 1024})
    lengths = [3, 0, 40, 9, 70]
    calls = recorded_calls(SPEC, config, random_batch(lengths))
    names = call_names(config)
    assert len(calls) == len(names) == 2 * len(config.sequence.branches) * 2
    for name, (q, kv, causal) in zip(names, calls):
        assert q.size == kv.size == len(lengths) and not causal
        if name.endswith("self"):
            np.testing.assert_array_equal(q, kv)
        else:  # the candidate's queries, one set per example, over the history the self attention saw
            assert len(set(q.tolist())) == 1
    first_all_self = calls[names.index("block 0 all self")]
    summary = config.sequence.summary_tokens
    np.testing.assert_array_equal(first_all_self[0], np.minimum(lengths, config.sequence.max_history_len) + summary)


def _saved_calls(path):
    config = model_config("gem", width=0.5, blocks=2, **{"embedding.item_buckets": 1024,
                                                         "embedding.user_buckets": 1024})
    recorded = [recorded_calls(SPEC, config, random_batch(lengths)) for lengths in ([3, 0, 40, 9, 70], [5, 17])]
    save_calls(path, recorded, call_names(config), heads=2, head_dim=48)
    return recorded, call_names(config)


def test_saved_calls_keep_each_steps_lengths_and_the_shape(tmp_path):
    recorded, names = _saved_calls(tmp_path / "calls.npz")
    saved = np.load(tmp_path / "calls.npz")
    assert (int(saved["heads"]), int(saved["head_dim"])) == (2, 48)
    for step, calls in enumerate(recorded):
        for name, (q, kv, causal) in zip(names, calls):
            np.testing.assert_array_equal(saved[f"{step}|{name}|q"], q)
            np.testing.assert_array_equal(saved[f"{step}|{name}|kv"], kv)
            assert bool(saved[f"{step}|{name}|causal"]) == causal
    assert not list(tmp_path.glob("*.tmp*"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_timed_calls_report_each_call_and_the_step(tmp_path):
    _, names = _saved_calls(tmp_path / "calls.npz")
    results = time_calls(tmp_path / "calls.npz", ("default", "padded"))
    assert set(results["per_call"]) == set(names) and results["steps"] == 2
    assert set(results["variants"]) == {"default", "padded"}
    assert results["variants"]["default"]["fwd_bwd_over_first"] == 1.0
    assert results["per_step"] == results["variants"]["default"]["per_step"]
    assert all(0 < row["fwd_ms"] < row["fwd_bwd_ms"] for row in results["per_call"].values())
    rows = results["per_call"].values()
    assert results["per_step"]["fwd_bwd_ms"] == pytest.approx(sum(row["fwd_bwd_ms"] for row in rows))
    assert results["self_share_of_fwd_bwd"] + results["cross_share_of_fwd_bwd"] == pytest.approx(1.0)


def test_tiles_cover_each_sequence_and_head_dims_are_computed_split_or_padded(monkeypatch):
    from kernels.triton import triton_jagged_attention as kernel

    q, kv = np.array([1, 64, 65]), np.array([1, 64, 65])
    assert tile_work(q, kv, 64, 64) == 64 * 64 + 64 * 64 + 128 * 128
    assert tile_work(np.array([2]), np.array([130]), 128, 64) == 128 * 192
    assert [padded_dim(d) for d in (8, 16, 24, 96, 128, 192)] == [16, 16, 32, 128, 128, 256]
    assert [computed_dim(d) for d in (8, 24, 48, 96, 128, 192)] == [16, 32, 48, 96, 128, 192]  # split by default
    monkeypatch.setattr(kernel, "SPLIT_HEAD", False)  # JAGGED_ATTENTION_SPLIT_HEAD=0
    assert [computed_dim(d) for d in (48, 96, 192)] == [64, 128, 256]


def test_an_error_while_timing_names_the_call_and_variant():
    with pytest.raises(RuntimeError, match="misaligned") as raised, naming_the_call("step 0, call 'block 0 all self'"):
        raise RuntimeError("CUDA error: misaligned address")
    assert raised.value.__notes__ == ["while timing step 0, call 'block 0 all self'"]
