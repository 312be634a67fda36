"""Loads the next steps' inputs in a background thread while the current step runs on the device.

Batch building is numpy/pyarrow and torch CPU work, so on a GPU it overlaps the step's kernels instead of adding to
every step. Its Python still holds the interpreter lock part of the time: beside a thread loading without pause, a
stand-in for a step's kernel launches took longer on a 2-core machine (benchmarks/loader_contention.py); on the
16-core GPU host hardly (1.04x), and a GPU step did not gain from every batch loaded before it (0.99x)."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")


def prefetched(load: Callable[[int], T], steps: Iterable[int], depth: int = 1) -> Iterator[tuple[int, T]]:
    """(step, load(step)) in order, with up to `depth` steps loaded ahead; depth 0 loads in place."""
    if depth <= 0:
        for step in steps:
            yield step, load(step)
        return
    steps = iter(steps)
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="gem-prefetch") as pool:
        ahead: deque = deque()
        try:
            for step in steps:
                ahead.append((step, pool.submit(load, step)))
                if len(ahead) > depth:
                    done, future = ahead.popleft()
                    yield done, future.result()
            while ahead:
                done, future = ahead.popleft()
                yield done, future.result()
        finally:
            for _, future in ahead:  # an early stop (error, break) leaves no loads running
                future.cancel()
