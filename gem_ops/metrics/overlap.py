"""Communication against compute on a profile's device timeline: per step, how long the collectives' kernels
ran, and how much of that no compute kernel ran beside (exposed: what overlap with compute has not hidden, and
what a step pays for communication on top of its compute)."""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import asdict, dataclass

import numpy as np
import torch

# NCCL's kernels (ncclDevKernel_AllGather_RING_LL, ncclKernel_ReduceScatter_..., ...) and the all-to-all of
# sharded embeddings; everything else on the device timeline is compute (copies included).
COMMUNICATION_KERNEL = re.compile(r"nccl", re.IGNORECASE)


@dataclass(frozen=True)
class CommunicationOverlap:
    """Seconds per step on one device's timeline."""

    communication_seconds: float  # the collectives' kernels, their overlaps with each other counted once
    exposed_communication_seconds: float  # of which no compute kernel ran at the same time
    compute_seconds: float  # every other kernel, overlaps counted once

    @property
    def hidden_share(self) -> float:
        """The share of the communication time that ran under compute (1 when there is none)."""
        if self.communication_seconds <= 0:
            return 1.0
        return 1.0 - self.exposed_communication_seconds / self.communication_seconds

    @property
    def busy_seconds(self) -> float:
        """The time any kernel ran: compute, and the communication no compute ran beside."""
        return self.compute_seconds + self.exposed_communication_seconds

    def to_dict(self) -> dict[str, float]:
        return {**asdict(self), "hidden_share": self.hidden_share, "busy_seconds": self.busy_seconds}


def merged(intervals: Iterable[tuple[float, float]]) -> np.ndarray:
    """[k, 2] disjoint, sorted intervals covering the same points as `intervals` ((start, end) pairs)."""
    spans = sorted((float(a), float(b)) for a, b in intervals if b > a)
    out: list[list[float]] = []
    for start, end in spans:
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return np.asarray(out, dtype=np.float64).reshape(-1, 2)


def intersection_length(a: np.ndarray, b: np.ndarray) -> float:
    """The length of the points in both unions of disjoint sorted intervals (as merged() returns)."""
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        low, high = max(a[i, 0], b[j, 0]), min(a[i, 1], b[j, 1])
        if high > low:
            total += high - low
        if a[i, 1] < b[j, 1]:
            i += 1
        else:
            j += 1
    return total


def communication_overlap(kernels: Iterable[tuple[str, float, float]], steps: int,
                          time_unit: float = 1e-6) -> CommunicationOverlap:
    """From (name, start, end) kernels of `steps` steps (times in `time_unit` seconds, microseconds by default):
    communication, exposed communication and compute seconds per step."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    kernels = list(kernels)
    comm = merged((s, e) for name, s, e in kernels if COMMUNICATION_KERNEL.search(name))
    compute = merged((s, e) for name, s, e in kernels if not COMMUNICATION_KERNEL.search(name))
    comm_total = float((comm[:, 1] - comm[:, 0]).sum())
    compute_total = float((compute[:, 1] - compute[:, 0]).sum())
    exposed = comm_total - intersection_length(comm, compute)
    scale = time_unit / steps
    return CommunicationOverlap(comm_total * scale, exposed * scale, compute_total * scale)


def device_kernels(prof: torch.profiler.profile, skip: Iterable[str] = ()) -> list[tuple[str, float, float]]:
    """(name, start µs, end µs) of the kernels and copies on the GPU timeline of a finished profile, without the
    named ones. The mirrors of record_function scopes (user annotations: the engine's phases, autograd's and
    Inductor's regions) are left out: they span kernels and the idle time between them rather than run."""
    skip = frozenset(skip)
    return [(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
            if e.device_type == torch.autograd.DeviceType.CUDA and e.name not in skip
            and not getattr(e, "is_user_annotation", False)]
