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


def measure_latency(score: Callable[[dict], object], request_of: Callable[[int, int], dict[str, torch.Tensor]],
                    settings: LatencySettings = LatencySettings()) -> dict[int, dict[str, float]]:
    """{candidates: {p50_ms, p99_ms, mean_ms, requests_per_s}}; request_of(candidates, seed) makes a request
    (each timed call gets its own, prepared beforehand: only scoring is timed)."""
    threads = torch.get_num_threads()
    if settings.threads:
        torch.set_num_threads(settings.threads)
    try:
        return {n: _timed(score, [request_of(n, seed) for seed in range(settings.warmup + settings.requests)],
                          settings.warmup) for n in settings.candidate_counts}
    finally:
        torch.set_num_threads(threads)


def warm_up_latency(score: Callable[[dict], object], request_of: Callable[[int, int], dict[str, torch.Tensor]],
                    history_lengths: list[int], candidate_counts: tuple[int, ...] = CANDIDATE_COUNTS) -> None:
    """Scores one request per (history length, candidate count), untimed: request_of(candidates, length)."""
    with torch.no_grad():
        for length in history_lengths:
            for n in candidate_counts:
                score(request_of(n, length))


def _timed(score, requests: list[dict], warmup: int) -> dict[str, float]:
    with torch.no_grad():
        for request in requests[:warmup]:
            score(request)
        seconds = []
        for request in requests[warmup:]:
            start = time.perf_counter()
            score(request)
            seconds.append(time.perf_counter() - start)
    ms = np.array(seconds) * 1e3
    return {"p50_ms": float(np.percentile(ms, 50)), "p99_ms": float(np.percentile(ms, 99)),
            "mean_ms": float(ms.mean()), "requests_per_s": float(1e3 / ms.mean()), "requests": len(ms)}
