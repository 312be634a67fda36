"""The MFU window's Python profiler: the host's Python time per step by function, the steps counted by the engine's
own per-step call, the backward on the calling thread for the whole run."""

import pytest
import torch

from gem_ops.metrics.quality import binary_quality
from gem_ops.train.config import TrainConfig
from gem_ops.train.mfu_window import MFUWindow
from gem_ops.train.python_profile import PythonStepProfile, _name
from gem_ops.train.step_readout import queue_step


def _step(step: int, threads: list[bool]) -> None:
    """A stand-in for the engine's step: Python work, a backward, and the step queued."""
    logits = torch.linspace(-2, 2, 64, requires_grad=True)
    binary_quality(logits.detach(), (torch.arange(64) % 3 == 0).float())
    (logits * logits).sum().backward()
    threads.append(torch.autograd.is_multithreading_enabled())
    zero = torch.zeros(1)
    queue_step(step, 64, 0.1, {}, 0.0, [], zero, zero, zero)


def test_the_window_profiles_the_steps_after_it_with_cprofile():
    window = MFUWindow(steps=2, warmup_steps=1, profile_steps=3, profiler="python")
    threads: list[bool] = []
    with window.observe(torch.device("cpu")) as observer:
        assert observer.prof is None and observer.python is not None  # no torch.profiler beside it
        for step in range(window.total_steps):  # steps read at once, as on a CPU: the hook after each step
            _step(step, threads)
            observer(step, 0.0)
        summary = observer.python.summary()
    # started after step 3's hook (one step after the window), stopped after the last's: steps 4, 5 and 6
    assert window.total_steps == 7 and summary["steps"] == 3
    # The backward on the calling thread in every step, not from the profiled ones on: the steps it times and the
    # steps it profiles run alike.
    assert threads == [False] * 7
    assert torch.autograd.is_multithreading_enabled()
    quality = [r for r in summary["inclusive"] if r["function"].startswith("gem_ops/metrics/quality.py:")
               and r["function"].endswith("(binary_quality)")]
    assert len(quality) == 1 and quality[0]["calls"] == 1.0 and quality[0]["ms"] > 0
    own = [r["own_ms"] for r in summary["own"]]
    assert own == sorted(own, reverse=True) and all(r["own_ms"] <= r["ms"] + 1e-9 for r in summary["own"])


def test_under_the_python_profiler_every_batch_is_loaded_before_the_profiled_steps():
    # From Python 3.12 cProfile counts every thread on one stack: the loading thread is done by then.
    config = TrainConfig(prefetch_batches=1)
    window = MFUWindow(steps=20, warmup_steps=10, profile_steps=4, profiler="python")
    assert window.train_config(config, plan_steps=81).prefetch_batches == window.total_steps == 35
    assert MFUWindow(steps=20, profiler="torch").train_config(config, plan_steps=81).prefetch_batches == 1


def test_functions_are_named_from_their_packages_root():
    assert _name(("/x/.venv/lib/python3.12/site-packages/torch/nn/modules/module.py", 12, "f")) == \
        "torch/nn/modules/module.py:12(f)"
    assert _name(("/work/main/gem_ops/train/engine.py", 3, "fit")) == "gem_ops/train/engine.py:3(fit)"
    assert _name(("~", 0, "<built-in method builtins.isinstance>")) == "<built-in method builtins.isinstance>"


def test_a_stop_without_a_start_does_nothing_and_an_unknown_profiler_is_named():
    profile = PythonStepProfile()
    profile.stop()
    assert profile.summary()["steps"] == 0
    with pytest.raises(ValueError, match="profiler must be one of"):
        MFUWindow(profiler="nsight")
