"""Latency of a scoring function on requests of a few candidate counts: p50 / p99 and requests per second."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

CANDIDATE_COUNTS = (1, 100, 1000)


@dataclass(frozen=True)
class LatencySettings:
    candidate_counts: tuple[int, ...] = CANDIDATE_COUNTS
    requests: int = 50  # timed requests per candidate count (p99 of fewer is their maximum)
    warmup: int = 3
    threads: int = 0  # torch intra-op threads while timing; 0: as set

    def __post_init__(self):
        if not self.candidate_counts or min(self.candidate_counts) < 1:
            raise ValueError(f"latency candidate_counts must be positive, got {self.candidate_counts}")
        if self.requests < 1 or self.warmup < 0 or self.threads < 0:
            raise ValueError(f"latency requests must be >= 1, warmup and threads >= 0, got requests={self.requests}, "
                             f"warmup={self.warmup}, threads={self.threads}")


Scorer = Callable[[dict], object]
RequestMaker = Callable[[int, int], dict[str, torch.Tensor]]


def measure_latency(score: Scorer, request_of: RequestMaker,
                    settings: LatencySettings = LatencySettings()) -> dict[int, dict[str, float]]:
    """{candidates: {p50_ms, p99_ms, mean_ms, requests_per_s}}; request_of(candidates, seed) makes a request
    (each timed call gets its own, prepared beforehand: only scoring is timed)."""
    return measure_side_by_side({"": (score, request_of)}, settings)[""]


def measure_side_by_side(scorers: dict[str, tuple[Scorer, RequestMaker]],
                         settings: LatencySettings = LatencySettings()) -> dict[str, dict[int, dict[str, float]]]:
    """measure_latency of each named (score, request_of), the scorers taking turns request by request (who goes
    first rotating): a machine's load, which moves latency by tens of percent between runs, moves all of them alike,
    so their ratios are measured side by side."""
    threads = torch.get_num_threads()
    if settings.threads:
        torch.set_num_threads(settings.threads)
    try:
        out: dict[str, dict[int, dict[str, float]]] = {name: {} for name in scorers}
        for n in settings.candidate_counts:
            requests = {name: [request_of(n, seed) for seed in range(settings.warmup + settings.requests)]
                        for name, (_, request_of) in scorers.items()}
            for name, seconds in _timed_in_turn(scorers, requests, settings.warmup).items():
                out[name][n] = _figures(seconds)
        return out
    finally:
        torch.set_num_threads(threads)


def warm_up_latency(score: Scorer, request_of: RequestMaker, history_lengths: list[int],
                    candidate_counts: tuple[int, ...] = CANDIDATE_COUNTS) -> None:
    """Scores one request per (history length, candidate count), untimed: request_of(candidates, length)."""
    with torch.no_grad():
        for length in history_lengths:
            for n in candidate_counts:
                score(request_of(n, length))


def _timed_in_turn(scorers: dict, requests: dict[str, list[dict]], warmup: int) -> dict[str, list[float]]:
    names = list(scorers)
    seconds: dict[str, list[float]] = {name: [] for name in names}
    with torch.no_grad():
        for name in names:
            for request in requests[name][:warmup]:
                scorers[name][0](request)
        for i in range(len(requests[names[0]]) - warmup):
            for name in names[i % len(names):] + names[:i % len(names)]:
                start = time.perf_counter()
                scorers[name][0](requests[name][warmup + i])
                seconds[name].append(time.perf_counter() - start)
    return seconds


def _figures(seconds: list[float]) -> dict[str, float]:
    ms = np.array(seconds) * 1e3
    return {"p50_ms": float(np.percentile(ms, 50)), "p99_ms": float(np.percentile(ms, 99)),
            "mean_ms": float(ms.mean()), "requests_per_s": float(1e3 / ms.mean()), "requests": len(ms)}
