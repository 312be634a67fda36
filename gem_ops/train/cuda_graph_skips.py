"""The compiled step's graphs that Inductor ran without CUDA graphs, under TrainConfig.cuda_graphs.

Where Inductor cannot record a graph (an input mutated that the graph does not own, a CPU tensor, an op that cannot
be captured, a graph recorded again too often) it launches that graph's kernels one by one instead, says why in a
warning of its `cudagraphs` log and counts it. A run that asked for graphs reports how many of its graphs got none
and why, rather than leaving a user to wonder why the steps are no faster.
"""

from __future__ import annotations

import logging

from torch._dynamo.utils import counters


class CudaGraphSkips(logging.Handler):
    """Around the steps: the skips Inductor counted meanwhile (`count`) and the reasons it gave (`reasons`, each
    once; a graph on the CPU is counted without one)."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.reasons: list[str] = []
        self._before: int | None = None
        self._after: int | None = None
        self._log: logging.Logger | None = None

    def __enter__(self) -> CudaGraphSkips:
        from torch._inductor.cudagraph_utils import cudagraphs_log

        self._log = cudagraphs_log
        self._log.addHandler(self)
        self._before, self._after = counters["inductor"]["cudagraph_skips"], None
        return self

    def __exit__(self, *exc) -> None:
        self._after = counters["inductor"]["cudagraph_skips"]
        self._log.removeHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message not in self.reasons:
            self.reasons.append(message)

    @property
    def count(self) -> int:
        if self._before is None:
            return 0
        after = counters["inductor"]["cudagraph_skips"] if self._after is None else self._after
        return after - self._before

    def summary(self) -> str:
        if not self.count:
            return "CUDA graphs: every graph of the compiled step was recorded"
        reasons = "; ".join(self.reasons) or "no reason given (graphs on the CPU)"
        return f"CUDA graphs: {self.count} of the compiled step's graphs ran without them: {reasons}"
