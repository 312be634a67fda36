"""The per-step cost imbalance a job actually sees across its ranks.

Every rank times the forward compute of its layers (from each FSDP unit's pre-forward hook, after its
parameters are gathered, to its post-forward hook, so time spent waiting in collectives is left out:
a rank that waits for a slower one would otherwise look as slow as it) and counts its tokens; one small
all_gather per step gives every rank all ranks' figures. The run's imbalance is the sum over steps of
the slowest rank's figure over the sum of the mean rank's (1.0: perfect balance), the measure the
shuffled_batches asset predicts from history lengths.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

MEASURES = ("compute_seconds", "tokens", "attention_cost")


class ForwardComputeTimer:
    """Seconds spent inside the forward of the given modules, per step (`cut`, then `seconds`); CUDA events on GPU."""

    def __init__(self, modules: Sequence[nn.Module], device: torch.device):
        self.cuda = device.type == "cuda"
        self._open: dict[int, object] = {}
        self._spans: list[tuple[object, object]] = []
        self._handles = []
        for module in modules:
            self._handles.append(module.register_forward_pre_hook(self._start))
            self._handles.append(module.register_forward_hook(self._stop))

    def _now(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def _start(self, module, args):
        self._open[id(module)] = self._now()

    @contextlib.contextmanager
    def span(self) -> Iterator[None]:
        """Times a region instead of modules (a job of one rank, where no collective waits inside it)."""
        self._start(self, ())
        try:
            yield
        finally:
            self._stop(self, (), None)

    def _stop(self, module, args, output):
        start = self._open.pop(id(module), None)
        if start is not None:
            self._spans.append((start, self._now()))

    def cut(self) -> list[tuple[object, object]]:
        """The spans since the last cut (the step just queued): timed later by `seconds`, without a wait now."""
        spans, self._spans = self._spans, []
        return spans

    def seconds(self, spans: list[tuple[object, object]]) -> float:
        """The spans' total; on GPU waits for their last event (not for work queued after it)."""
        if not spans:
            return 0.0
        if self.cuda:
            spans[-1][1].synchronize()
            return float(sum(a.elapsed_time(b) for a, b in spans) / 1000.0)
        return float(sum(b - a for a, b in spans))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def host_group() -> dist.ProcessGroup | None:
    """A gloo group of every rank, for figures the hosts hold (the default group where it is gloo already; None on
    one rank). Made by every rank at once."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    return None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")


def gather_rows(values: Sequence[float], group: dist.ProcessGroup | None = None) -> np.ndarray:
    """[world_size, len(values)]: every rank's values, on every rank, through host memory (one all_gather of `group`,
    a host_group(): none on one rank). No device collective: it waits for no kernel queued on the GPU."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return np.asarray([list(values)], dtype=np.float64)
    local = torch.tensor(list(values), dtype=torch.float64)
    rows = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, local, group=group)
    return torch.stack(rows).numpy()


@dataclass
class BalanceLog:
    """Per step, each measure's max and mean over ranks, and every rank's own figure."""

    steps: list[int] = field(default_factory=list)
    max: dict[str, list[float]] = field(default_factory=lambda: {m: [] for m in MEASURES})
    mean: dict[str, list[float]] = field(default_factory=lambda: {m: [] for m in MEASURES})
    ranks: dict[str, list[list[float]]] = field(default_factory=lambda: {m: [] for m in MEASURES})

    def add(self, step: int, per_rank: np.ndarray) -> dict[str, float]:
        """per_rank [world_size, len(MEASURES)] -> this step's max/mean per measure."""
        self.steps.append(step)
        ratios = {}
        for i, measure in enumerate(MEASURES):
            hi, mean = float(per_rank[:, i].max()), float(per_rank[:, i].mean())
            self.max[measure].append(hi)
            self.mean[measure].append(mean)
            self.ranks[measure].append([float(v) for v in per_rank[:, i]])
            ratios[measure] = hi / mean if mean > 0 else 1.0
        return ratios

    def observed(self) -> dict[str, float]:
        """The run's sum of per-step max / sum of per-step mean, per measure."""
        return {m: (sum(self.max[m]) / sum(self.mean[m]) if sum(self.mean[m]) > 0 else float("nan")) for m in MEASURES}

    def to_dict(self) -> dict:
        return {"steps": self.steps, "max": self.max, "mean": self.mean, "ranks": self.ranks}

    @classmethod
    def from_dict(cls, data: dict) -> BalanceLog:
        # a checkpoint written before per-rank figures were kept resumes without its earlier steps' ranks
        ranks = data.get("ranks") or {m: [[] for _ in data["steps"]] for m in MEASURES}
        return cls(list(data["steps"]), {m: list(v) for m, v in data["max"].items()},
                   {m: list(v) for m, v in data["mean"].items()}, {m: [list(r) for r in v] for m, v in ranks.items()})
