"""benchmarks/jagged_attention.py: kernel variants set the kernel module's switches for their runs alone; the
padded method runs with the kernels' head dims padded instead of split."""

import pytest
import torch

from benchmarks.jagged_attention import KERNEL_VARIANTS, bench_case, kernel_settings, kernel_variant


def test_a_kernel_variant_sets_the_kernels_switches_inside_only():
    from kernels.triton import triton_jagged_attention as kernel

    before = (kernel.SPLIT_HEAD, kernel.TMA, kernel.ATOMIC_DQ_SHORT)
    with kernel_variant("padded"):
        assert not kernel.SPLIT_HEAD and kernel.TMA == before[1]
    with kernel_variant("pointers"):
        assert kernel.SPLIT_HEAD == before[0] and not kernel.TMA
    with kernel_variant("default"):
        assert (kernel.SPLIT_HEAD, kernel.TMA, kernel.ATOMIC_DQ_SHORT) == before
    with pytest.raises(RuntimeError), kernel_variant("atomic_dq_short"):
        assert kernel.ATOMIC_DQ_SHORT
        raise RuntimeError("a failed case")
    assert (kernel.SPLIT_HEAD, kernel.TMA, kernel.ATOMIC_DQ_SHORT) == before
    assert all(hasattr(kernel, key) for settings in KERNEL_VARIANTS.values() for key in settings)
    atomic = kernel.ATOMIC_DQ
    with pytest.raises(RuntimeError), kernel_settings(ATOMIC_DQ=not atomic, TMA=False):
        assert kernel.ATOMIC_DQ is not atomic and not kernel.TMA
        raise RuntimeError("a failed case")
    assert (kernel.ATOMIC_DQ, kernel.TMA) == (atomic, before[1])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_padded_method_agrees_with_flex_at_head_dim_96_and_is_skipped_where_nothing_splits():
    lengths = [700, 5, 130, 64, 1, 300]
    row = bench_case(lengths, 4, 96, True, ("triton_cached", "triton_padded", "flex"))
    assert row["triton_padded"]["rel_error_vs_flex"] < 1e-2 and row["triton_padded"]["dq_rel_error_vs_flex"] < 1e-2
    assert all(0 < row[m]["fwd_ms"] < row[m]["fwd_bwd_ms"] for m in ("triton_cached", "triton_padded", "flex"))
    assert "triton_padded" not in bench_case(lengths, 4, 128, True, ("triton_cached", "triton_padded", "flex"))
