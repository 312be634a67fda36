"""Python's garbage collector on a schedule while training runs, and a record of its pauses.

Left automatic, a full collection starts inside whichever step happens to cross the allocation threshold and walks
every tracked object (modules, compiled graphs and their guards, the loader's frames): a pause of a large fraction
of a second in the middle of a forward, where the device then waits. Training objects either live for the whole
run or die within a step, so: everything alive before the first step frozen (never walked while training runs; no
collection first, which would cost a pause of its own per training), automatic collection off, and every `every`
steps, between steps, a collection: the first a full one (the first steps' compiles leave garbage in reference
cycles), then of the young generations only, what the steps made since the last one. What survives one (compiled
graphs, caches) moves to the oldest generation, which no later collection walks. A full collection every time
walked it all again: 0.82 s every 50 steps of the `w0.5_L512` MFU run on an H100, about a tenth of the step time;
on the CPU, benchmarks/gc_pauses.py."""

from __future__ import annotations

import gc
import time


class CollectionSchedule:
    """`start()` before the first step, `after_step(step)` after each, `stop()` at the end (an exception's
    too). every=0 leaves the collector as it was (automatic). `pauses.seconds`: every collection's, in between."""

    def __init__(self, every: int):
        self.every = every
        self.pauses = CollectionPauses()
        self._was_enabled = gc.isenabled()
        self._froze = False
        self._collected = False

    def start(self) -> None:
        self.pauses.start()
        self._collected = False
        if self.every:
            self._was_enabled = gc.isenabled()
            # A caller's own frozen objects (e.g. a server that froze before forking) stay its business.
            self._froze = gc.get_freeze_count() == 0
            if self._froze:
                gc.freeze()
            gc.disable()

    def after_step(self, step: int) -> None:
        if self.every and (step + 1) % self.every == 0:
            # The first is full: the first steps' compiles leave garbage in cycles that survives a young collection.
            gc.collect(1 if self._collected else 2)
            self._collected = True

    def stop(self) -> None:
        self.pauses.stop()
        if self.every:
            if self._froze:
                gc.unfreeze()
            if self._was_enabled:
                gc.enable()


class CollectionPauses:
    """Seconds spent in garbage collection since entering (any generation, scheduled or automatic)."""

    def __init__(self):
        self.seconds = 0.0
        self._began: float | None = None

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._began = time.perf_counter()
        elif self._began is not None:
            self.seconds += time.perf_counter() - self._began
            self._began = None

    def start(self) -> None:
        gc.callbacks.append(self._callback)

    def stop(self) -> None:
        gc.callbacks.remove(self._callback)

    def __enter__(self) -> CollectionPauses:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
