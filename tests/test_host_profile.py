"""The host's side of a profiled step: value reads named by their calling line, project functions by host time.

The GPU machine's torch 2.11 keeps no Python frames in `profile.events()` (`make test-gpu-torch` runs this file under
it): callers and functions come from the profile's event tree."""

import torch
from torch.profiler import ProfilerActivity, profile

from gem_ops.metrics.quality import binary_quality
from gem_ops.train.host_profile import ProjectFrames, host_profile, short_frame


def test_value_reads_and_functions_are_named_by_project_line():
    logits, labels = torch.linspace(-2, 2, 64), (torch.arange(64) % 3 == 0).float()
    with profile(activities=[ProfilerActivity.CPU], with_stack=True) as prof:
        for _ in range(2):
            binary_quality(logits, labels)
    host = host_profile(prof, steps=2)
    assert host["launches"] == 0.0  # no kernel on a CPU
    reads = [r for r in host["device_waits"] if r["name"] == "aten::_local_scalar_dense"]
    assert reads and all(r["caller"].startswith("gem_ops/metrics/quality.py(") for r in reads)
    assert sum(r["calls"] for r in reads) >= 5  # per step: the mean, the sum, the loss, the AUC, the calibration
    ops = host["operators"]  # by their own host time, no project frame among them
    assert any(r["name"].startswith("aten::") for r in ops) and not any(".py(" in r["name"] for r in ops)
    assert [r["ms"] for r in ops] == sorted((r["ms"] for r in ops), reverse=True)
    top = [r for r in host["functions"] if r["function"].endswith(": binary_quality")]
    assert len(top) == 1 and top[0]["calls"] == 1.0 and top[0]["ms"] > 0
    assert all(r["ms"] <= top[0]["ms"] for r in host["functions"] if "quality.py" in r["function"])


def test_frames_are_shortened_to_the_project_path():
    assert short_frame("/opt/x/site-packages/gem_ops/train/engine.py(12): run") == "gem_ops/train/engine.py(12): run"
    assert short_frame("/repo/kernels/triton/a.py(3): f") == "kernels/triton/a.py(3): f"


def test_a_profile_without_an_event_tree_names_no_caller():
    class Event:
        name, thread, cpu_parent = "aten::item", 1, None

        class time_range:
            start = 10.0

    frames = ProjectFrames(object())
    assert frames.caller(Event()) == "" and frames.host_ms() == {}


def test_the_innermost_frame_around_a_time_follows_the_nesting():
    from gem_ops.train.host_profile import _Nesting

    # outer 0-100 holds a 10-20 and a 30-90 frame, which holds 40-50; inner 0-5 starts with outer
    frames = sorted([(0, -100, "outer"), (0, -5, "first"), (10, -20, "a"), (30, -90, "b"), (40, -50, "c")])
    nesting = _Nesting(frames)
    assert [nesting.around(t) for t in (3, 15, 25, 45, 60, 95, 101)] == \
        ["first", "a", "outer", "c", "b", "outer", ""]
