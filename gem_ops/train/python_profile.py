"""The host's Python time per training step, by function: cProfile over a few steps of the engine's loop.

torch.profiler's records of a step whose host bounds it name operators, not the Python around them (on some builds
not even with stacks), and recording stacks and shapes slows the host several fold. cProfile counts every Python
function's own and inclusive time at a smaller cost. The backward runs on the calling thread (before Python 3.12
cProfile does not look into autograd's device threads, where the compiled backward's Python runs), and for the whole
run, not just the profiled steps, so that those run as the timed ones did. From Python 3.12 cProfile counts every
thread's calls on one stack: the MFU window has every batch loaded before the profiled steps
(`MFUWindow.train_config`).
"""

from __future__ import annotations

import contextlib
import cProfile
import pstats

import torch

from gem_ops.train.host_profile import short_frame

STEP_FUNCTION = ("step_readout.py", "queue_step")  # called once per step queued: the steps counted


def _name(function: tuple[str, int, str]) -> str:
    """`path:line(function)`, the path from its package's root (`gem_ops/...`, `torch/...`) where there is one."""
    path, line, name = function
    at = path.rfind("site-packages/")
    path = path[at + len("site-packages/") :] if at >= 0 else short_frame(path)
    return f"{path}:{line}({name})" if line else name


class PythonStepProfile:
    """cProfile between `start` and `stop`; `summary` per step. Run the whole run inside `backward_on_this_thread`."""

    def __init__(self):
        self.profile = cProfile.Profile()
        self.active = False

    @staticmethod
    def backward_on_this_thread() -> contextlib.AbstractContextManager:
        """Autograd runs the backward on the thread that calls it, from here until the context exits."""
        return torch.autograd.set_multithreading_enabled(False)

    def start(self) -> None:
        self.profile.enable()
        self.active = True

    def stop(self) -> None:
        if self.active:
            self.profile.disable()
            self.active = False

    def summary(self, limit: int = 40) -> dict:
        """Steps queued while it counted, and per step the functions with the most own time (`own_ms`, outside the
        functions they call) and the most inclusive time (`ms`), with their calls."""
        self.profile.create_stats()
        # (path, line, name) -> (primitive calls, calls, own, inclusive, callers); pstats refuses an empty profile
        stats = pstats.Stats(self.profile).stats if self.profile.stats else {}
        steps = sum(calls for (path, _, name), (_, calls, *_rest) in stats.items()
                    if path.endswith(STEP_FUNCTION[0]) and name == STEP_FUNCTION[1])
        per = 1 / max(1, steps)
        rows = [{"function": _name(f), "own_ms": own * 1e3 * per, "ms": inclusive * 1e3 * per, "calls": calls * per}
                for f, (_, calls, own, inclusive, _callers) in stats.items()]
        return {"steps": steps, "own": sorted(rows, key=lambda r: r["own_ms"], reverse=True)[:limit],
                "inclusive": sorted(rows, key=lambda r: r["ms"], reverse=True)[:limit]}
