"""Exposed communication from a device timeline: collectives' time that no compute kernel ran beside."""

import pytest

from gem_ops.metrics.overlap import communication_overlap, intersection_length, merged


def test_merged_intervals_cover_the_same_points_once():
    assert merged([(5, 7), (0, 2), (1, 3), (3, 4), (6, 6)]).tolist() == [[0, 4], [5, 7]]
    assert merged([]).shape == (0, 2)
    assert intersection_length(merged([(0, 4), (6, 10)]), merged([(2, 7), (9, 12)])) == 2 + 1 + 1


def test_exposed_communication_is_what_compute_does_not_cover():
    kernels = [  # two steps, microseconds
        ("ampere_bf16_gemm", 0, 100), ("ncclDevKernel_AllGather_RING_LL", 50, 130),  # 30 exposed
        ("triton_jagged_attention_fwd", 130, 200), ("ncclKernel_ReduceScatter", 210, 260),  # 50 exposed
        ("ncclDevKernel_AllGather_RING_LL", 220, 240),  # overlaps the reduce-scatter: counted once
        ("Memcpy DtoD", 250, 300), ("ncclDevKernel_AllGather_RING_LL", 260, 280),  # under the copy: hidden
    ]
    overlap = communication_overlap(kernels, steps=2)
    assert overlap.communication_seconds == pytest.approx((80 + 50 + 20) * 1e-6 / 2)
    assert overlap.exposed_communication_seconds == pytest.approx((30 + 40) * 1e-6 / 2)
    assert overlap.compute_seconds == pytest.approx((100 + 70 + 50) * 1e-6 / 2)
    assert overlap.hidden_share == pytest.approx(1 - 70 / 150)


def test_no_communication_is_all_hidden_and_steps_must_be_counted():
    only_compute = communication_overlap([("gemm", 0, 10)], steps=1)
    assert only_compute.communication_seconds == only_compute.exposed_communication_seconds == 0
    assert only_compute.hidden_share == 1.0
    with pytest.raises(ValueError, match="steps"):
        communication_overlap([], steps=0)
