"""Where a profiled step's host time goes: the waits on the device, the kernel launches and the project functions
that spend it.

A step whose host queues work slower than the device runs it leaves the GPU idle whatever its kernels cost; the
device-side figures (phase and module seconds, top kernels) cannot show that. This reads the same torch.profiler
record (taken with stacks) from the host's side.
"""

from __future__ import annotations

from collections import defaultdict

import torch

# Runtime calls that block the host until the device has caught up, and ATen ops that read a device value back
# (each one's runtime copy then waits for the stream).
DEVICE_WAITS = frozenset({"cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
                          "cuStreamSynchronize", "cuCtxSynchronize"})
VALUE_READS = frozenset({"aten::_local_scalar_dense", "aten::nonzero", "aten::item", "aten::unique",
                         "aten::_unique2", "aten::repeat_interleave"})
LAUNCHES = frozenset({"cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx",
                      "cudaGraphLaunch"})


def project_frame(name: str) -> bool:
    return ".py(" in name and ("gem_ops/" in name or "kernels/" in name)


def short_frame(name: str) -> str:
    """`.../site/gem_ops/x.py(12): f` as `gem_ops/x.py(12): f`."""
    for root in ("gem_ops/", "kernels/"):
        at = name.rfind(root)
        if at >= 0:
            return name[at:]
    return name


def caller(event) -> str:
    """The first project frame on the stack of the op or of its nearest recorded parent; in the backward
    (autograd's thread, no Python stack) the autograd node that ran it."""
    while event is not None:  # Python frames are events of their own, named "path(line): function"
        frame = next((f for f in [event.name, *(event.stack or ())] if project_frame(f)), None)
        if frame:
            return short_frame(frame)
        if event.name.startswith("autograd::engine::evaluate_function"):
            return event.name.split(": ", 1)[-1]
        event = event.cpu_parent
    return ""


def _python_frame(name: str) -> bool:
    """The Python tracer's events (any module's frames, built-in calls): inside the operators they call."""
    return ".py(" in name or name.startswith(("<built-in", "<frozen"))


def _host_ms(event) -> float:
    return event.time_range.elapsed_us() / 1e3


def host_profile(profile, steps: int, limit: int = 30) -> dict:
    """Per profiled step: kernel launches; each device wait and value read with its calling line (host
    milliseconds, calls); the operators and runtime calls by their own host time (less their children's); the
    project functions by the host time spent inside them (nested ones inside their callers' too)."""
    per = 1 / max(1, steps)
    launches = 0.0
    waits: dict[tuple[str, str], dict] = {}
    functions: dict[str, dict] = defaultdict(lambda: {"ms": 0.0, "calls": 0.0})
    operators: dict[str, dict] = defaultdict(lambda: {"ms": 0.0, "calls": 0.0})
    for event in profile.events():
        if event.device_type != torch.autograd.DeviceType.CPU:
            continue
        name = event.name
        if not _python_frame(name):
            row = operators[name[:120]]
            row["ms"] += event.self_cpu_time_total / 1e3 * per
            row["calls"] += per
        if name in LAUNCHES:
            launches += per
        elif name in DEVICE_WAITS or name in VALUE_READS:
            key = (name, caller(event))
            row = waits.setdefault(key, {"name": name, "caller": key[1], "ms": 0.0, "calls": 0.0})
            row["ms"] += _host_ms(event) * per
            row["calls"] += per
        elif project_frame(name):
            row = functions[short_frame(name)]
            row["ms"] += _host_ms(event) * per
            row["calls"] += per
    return {"launches": launches,
            "device_waits": sorted(waits.values(), key=lambda r: r["ms"], reverse=True)[:limit],
            "operators": _ranked(operators, "name", limit), "functions": _ranked(functions, "function", limit)}


def _ranked(rows: dict[str, dict], key: str, limit: int) -> list[dict]:
    return sorted(({key: k, **v} for k, v in rows.items()), key=lambda r: r["ms"], reverse=True)[:limit]
