"""benchmarks/jagged_attention.py: the split-head method runs with the kernels' head dims split and leaves the
setting as it found it."""

import pytest
import torch

from benchmarks.jagged_attention import _split_heads, bench_case


def test_split_heads_turns_the_setting_on_inside_only():
    from kernels.triton import triton_jagged_attention as kernel

    assert not kernel.SPLIT_HEAD
    with _split_heads(True):
        assert kernel.SPLIT_HEAD
    with _split_heads(False):
        assert not kernel.SPLIT_HEAD
    with pytest.raises(RuntimeError), _split_heads(True):
        raise RuntimeError("a failed case")
    assert not kernel.SPLIT_HEAD


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_split_method_agrees_with_flex_at_head_dim_96_and_is_skipped_where_nothing_splits():
    lengths = [700, 5, 130, 64, 1, 300]
    row = bench_case(lengths, 4, 96, True, ("triton_cached", "triton_split", "flex"))
    assert row["triton_split"]["rel_error_vs_flex"] < 1e-2 and row["triton_split"]["dq_rel_error_vs_flex"] < 1e-2
    assert all(0 < row[m]["fwd_ms"] < row[m]["fwd_bwd_ms"] for m in ("triton_cached", "triton_split", "flex"))
    assert "triton_split" not in bench_case(lengths, 4, 128, True, ("triton_cached", "triton_split", "flex"))
