"""What a scheduled garbage collection costs in a training run after a compiled step, and what the schedule's
collections keep alive: a small GEM trained through the engine (CPU, `compile: model`) with the engine's own
collections off, and every --every steps, from a step hook, either a full collection (`full`: the schedule before
7b3d0df) or `gc_schedule.CollectionSchedule.after_step` (`schedule`: a first full one, then the young generations),
timed; after each, the objects and tensors in the oldest generation. Each run in a fresh process, its caches as cold
as the other's.

    python -m benchmarks.gc_pauses [--steps 200 --every 10]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import save
from benchmarks.soak import prepare


POLICIES = ("full", "schedule")


def collections(data, policy: str, steps: int, every: int, compile: str) -> dict:
    """One run's collections: seconds each, and the oldest generation's objects and tensors after each."""
    import torch

    from gem_ops.model.config import model_config
    from gem_ops.train.config import TrainConfig
    from gem_ops.train.engine import train
    from gem_ops.train.gc_schedule import CollectionSchedule

    seconds, objects, tensors = [], [], []
    schedule = CollectionSchedule(every)  # its after_step alone: the engine's schedule has turned the collector off

    def collect(step, loss):
        if (step + 1) % every == 0:
            began = time.perf_counter()
            if policy == "full":
                gc.collect()
            else:
                schedule.after_step(step)
            seconds.append(time.perf_counter() - began)
            oldest = gc.get_objects(generation=2)
            objects.append(len(oldest))
            tensors.append(sum(issubclass(type(o), torch.Tensor) for o in oldest))  # a dead proxy may be there

    config = TrainConfig(max_steps=steps, epochs=100, eval_max_examples=64, log_every=10 * steps, warmup_steps=2,
                         compile=compile, gc_every=10 * steps)  # the schedule: collector off, no collection of its own
    train(data.open(), data.plans[1], model_config("gem", width=0.25, **{"sequence.max_history_len": 16}), config,
          step_hooks=[collect])
    return {"seconds": seconds, "mean_seconds": statistics.mean(seconds), "oldest_generation_objects": objects,
            "oldest_generation_tensors": tensors}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--compile", default="model", choices=("none", "dense", "model"))
    parser.add_argument("--output-name", default="gc_pauses")
    parser.add_argument("--run", nargs=3, metavar=("POLICY", "DATA", "RESULT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run:  # one run, in this fresh process
        policy, root, result = args.run
        from gem_ops.data.loader import TrainingData

        run = collections(TrainingData.at(root), policy, args.steps, args.every, args.compile)
        Path(result).write_text(json.dumps(run))
        return
    results = {}
    with tempfile.TemporaryDirectory() as root:
        prepare(Path(root), world_sizes=(1,))
        for policy in POLICIES:
            out = Path(root) / f"{policy}.json"
            subprocess.run([sys.executable, "-m", "benchmarks.gc_pauses", "--steps", str(args.steps), "--every",
                            str(args.every), "--compile", args.compile, "--run", policy, root, str(out)], check=True)
            results[policy] = json.loads(out.read_text())
    for name, run in results.items():
        print(f"{name}: {1e3 * run['mean_seconds']:.1f} ms a collection "
              f"({1e3 * min(run['seconds']):.1f}-{1e3 * max(run['seconds']):.1f}), oldest generation at the end "
              f"{run['oldest_generation_objects'][-1]} objects, {run['oldest_generation_tensors'][-1]} tensors")
    save(args.output_name, {k: v for k, v in vars(args).items() if k != "run"}, results)


if __name__ == "__main__":
    main()
