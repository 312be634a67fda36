"""Exposed communication from a device timeline: collectives' time that no compute kernel ran beside."""

import time
from types import SimpleNamespace

import pytest
import torch

from gem_ops.metrics.overlap import communication_overlap, device_kernels, intersection_length, merged
from gem_ops.train.mfu_window import top_device_operators


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


class _Event:
    def __init__(self, name, start, end, annotation=False, device="CUDA"):
        self.name, self.is_user_annotation = name, annotation
        self.device_type = getattr(torch.autograd.DeviceType, device)
        self.time_range = SimpleNamespace(start=start, end=end)


def test_scopes_mirrored_on_the_device_timeline_are_not_kernels():
    """A record_function scope shows on the GPU timeline as an annotation spanning its kernels and the idle time
    between them: counted as a kernel it made the device look busier than the step was long."""
    events = [_Event("forward", 0, 1000, annotation=True), _Event("gemm", 0, 100), _Event("gemm", 900, 1000),
              _Event("## forward ##", 0, 50, device="CPU"), _Event("Command Buffer Full", 100, 900)]
    prof = SimpleNamespace(events=lambda: events)
    kernels = device_kernels(prof, skip={"Command Buffer Full"})
    assert [name for name, *_ in kernels] == ["gemm", "gemm"]
    assert communication_overlap(kernels, steps=1).busy_seconds == pytest.approx(200e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_device_busy_time_of_a_real_profile_leaves_out_idle_time_inside_scopes():
    x = torch.randn(256, 256, device="cuda")
    x @ x
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        with torch.profiler.record_function("step"):
            x @ x
            torch.cuda.synchronize()
            time.sleep(0.05)  # idle device inside the scope
            x @ x
            torch.cuda.synchronize()
    busy = communication_overlap(device_kernels(prof), steps=1).busy_seconds
    assert 0 < busy < 0.01
    top = top_device_operators(prof.key_averages(), steps=1)
    assert top and "step" not in {row["name"] for row in top} and sum(row["ms"] for row in top) < 10
    assert not any(row["name"].startswith("aten::") for row in top)  # kernels, not the ops that launched them


def test_device_time_by_kind_sorts_a_profile_s_kernels_and_covers_all_of_their_time():
    from gem_ops.metrics.kernels import kind_of, time_by_kind

    rows = [{"name": "nvjet_sm90_tst_128x256_64x4_2x1_v_bz_coopB_TNN", "ms": 60.0, "calls": 10},
            {"name": "dkdv_kernel", "ms": 20.0, "calls": 4}, {"name": "forward_kernel", "ms": 5.0, "calls": 4},
            {"name": "triton_per_fused__to_copy_add_native_layer_norm_native_layer_norm_backward_130", "ms": 4.0,
             "calls": 1},
            {"name": "triton_poi_fused_gelu_gelu_backward_7", "ms": 3.0, "calls": 1},
            {"name": "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>", "ms": 2.0,
             "calls": 3},
            {"name": "void at::native::(anonymous namespace)::compute_grad_weight<float>", "ms": 1.0, "calls": 2},
            {"name": "void at::native::elementwise_kernel<128, 4, direct_copy_kernel_cuda", "ms": 1.0, "calls": 2},
            {"name": "_rowwise_adagrad_kernel", "ms": 1.0, "calls": 16},
            {"name": "some_new_kernel", "ms": 4.0, "calls": 1}]
    kinds = time_by_kind(rows)
    assert [kind_of(r["name"]) for r in rows] == ["gemm", "attention_backward", "attention_forward", "compiled_norm",
                                                 "compiled_activation", "eager_elementwise", "embedding",
                                                 "copy_and_fill", "optimizer", "other"]
    assert list(kinds)[:2] == ["gemm", "attention_backward"]  # largest first
    assert sum(v["ms"] for v in kinds.values()) == sum(r["ms"] for r in rows)
    assert sum(v["share"] for v in kinds.values()) == pytest.approx(1.0)
    assert kinds["gemm"]["share"] == pytest.approx(60 / 101)
