"""The host's side of a profiled step: value reads named by their calling line, project functions by host time."""

import torch
from torch.profiler import ProfilerActivity, profile

from gem_ops.metrics.quality import binary_quality
from gem_ops.train.host_profile import caller, host_profile, short_frame


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
    assert caller(None) == ""
