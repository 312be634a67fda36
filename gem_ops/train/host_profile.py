"""Where a profiled step's host time goes: the waits on the device, the kernel launches and the project functions
that spend it.

A step whose host queues work slower than the device runs it leaves the GPU idle whatever its kernels cost; the
device-side figures (phase and module seconds, top kernels) cannot show that. This reads the same torch.profiler
record (taken with stacks) from the host's side.
"""

from __future__ import annotations

import bisect
from collections import defaultdict

import torch
from torch._C._profiler import _EventType

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


class ProjectFrames:
    """The project's Python frames of a profile taken with stacks, per thread, from the profile's event tree: the
    calling line of any of its events, and the host time inside each frame. The tree is read rather than
    `profile.events()`, which holds no Python frames and empty stacks on torch 2.11 (the GPU machine's); the tree
    holds them on every version."""

    def __init__(self, profile):
        found: dict[int, list[tuple[int, int, str]]] = defaultdict(list)  # thread -> (start, -end, frame)
        result = getattr(getattr(profile, "profiler", None), "kineto_results", None)
        self.trace_start_ns = result.trace_start_ns() if result is not None else 0
        nodes = list(result.experimental_event_tree()) if result is not None else []
        while nodes:
            node = nodes.pop()
            nodes.extend(node.children)
            if node.tag == _EventType.PyCall and project_frame(node.name):
                found[node.start_tid].append((node.start_time_ns, -node.end_time_ns, short_frame(node.name)))
        self.threads = {thread: _Nesting(sorted(frames)) for thread, frames in found.items()}

    def caller(self, event) -> str:
        """The project line that ran the event: the innermost project frame around it; in the backward
        (autograd's thread, no Python frames) the autograd node that ran it."""
        nesting = self.threads.get(event.thread)
        frame = nesting.around(self.trace_start_ns + round(event.time_range.start * 1000)) if nesting else ""
        while not frame and event is not None:
            if event.name.startswith("autograd::engine::evaluate_function"):
                return event.name.split(": ", 1)[-1]
            event = event.cpu_parent
        return frame

    def host_ms(self) -> dict[str, dict]:
        """Each project frame's host milliseconds (nested frames inside their callers' too) and calls."""
        rows: dict[str, dict] = defaultdict(lambda: {"ms": 0.0, "calls": 0.0})
        for nesting in self.threads.values():
            for start, end, frame in zip(nesting.starts, nesting.ends, nesting.names):
                rows[frame]["ms"] += (end - start) / 1e6
                rows[frame]["calls"] += 1
        return rows


class _Nesting:
    """One thread's frames by start (an outer frame before an inner one of the same start), each with the index
    of the frame it runs in: the innermost frame around a time in O(log n + depth)."""

    def __init__(self, frames: list[tuple[int, int, str]]):
        self.starts = [start for start, _, _ in frames]
        self.ends = [-negative_end for _, negative_end, _ in frames]
        self.names = [name for _, _, name in frames]
        self.parents, open_frames = [], []
        for i, start in enumerate(self.starts):
            while open_frames and self.ends[open_frames[-1]] < start:
                open_frames.pop()
            self.parents.append(open_frames[-1] if open_frames else -1)
            open_frames.append(i)

    def around(self, at_ns: int) -> str:
        i = bisect.bisect_right(self.starts, at_ns) - 1  # the last frame started by then, else one it runs in
        while i >= 0 and self.ends[i] < at_ns:
            i = self.parents[i]
        return self.names[i] if i >= 0 else ""


def _python_frame(name: str) -> bool:
    """The Python tracer's events (any module's frames, built-in calls): inside the operators they call."""
    return ".py(" in name or name.startswith(("<built-in", "<frozen"))


def _host_ms(event) -> float:
    return event.time_range.elapsed_us() / 1e3


def host_profile(profile, steps: int, limit: int = 30, frames: ProjectFrames | None = None) -> dict:
    """Per profiled step: kernel launches; each device wait and value read with its calling line (host
    milliseconds, calls); the operators and runtime calls by their own host time (less their children's); the
    project functions by the host time spent inside them (nested ones inside their callers' too). `frames`: the
    profile's, where the caller has read them already."""
    per = 1 / max(1, steps)
    frames = frames if frames is not None else ProjectFrames(profile)
    launches = 0.0
    waits: dict[tuple[str, str], dict] = {}
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
            key = (name, frames.caller(event))
            row = waits.setdefault(key, {"name": name, "caller": key[1], "ms": 0.0, "calls": 0.0})
            row["ms"] += _host_ms(event) * per
            row["calls"] += per
    functions = {frame: {"ms": row["ms"] * per, "calls": row["calls"] * per} for frame, row in frames.host_ms().items()}
    return {"launches": launches,
            "device_waits": sorted(waits.values(), key=lambda r: r["ms"], reverse=True)[:limit],
            "operators": _ranked(operators, "name", limit), "functions": _ranked(functions, "function", limit)}


def _ranked(rows: dict[str, dict], key: str, limit: int) -> list[dict]:
    return sorted(({key: k, **v} for k, v in rows.items()), key=lambda r: r["ms"], reverse=True)[:limit]
