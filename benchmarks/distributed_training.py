"""Weak scaling of GEM pretraining through the engine: the torchrun job gem_foundation_model launches (the
command gem_ops.train.launch builds), with benchmarks/mfu.py's MFU window, on 1 and on N processes of the same
per-rank batch. Per world size: samples/s over the timed window (the mean step; the median step's beside it)
and the scaling efficiency, samples/s at N / (N x samples/s at 1); per rank, the forward seconds observed
against those a step cost fitted to every (step, rank) plans from the rank's tokens and attention pairs, with
both imbalances; the communication no compute hid, per profiled step (rank 0's GPU); and the loss of every run
after the same samples. Saved as benchmarks/results/distributed_training_<device>.json.

    python -m benchmarks.mfu_data DIR --world-sizes 1 2                     # a machine with polars
    python -m benchmarks.distributed_training --device cuda --data DIR --preset gem_gpu --precision bf16@model
    python -m benchmarks.distributed_training --device cpu --data DIR --preset vertical --max-history-len 32 \\
        --steps 6 --warmup-steps 2 --precision fp32 --compile none         # a dry run on 2 CPU ranks (gloo)
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import statistics
import time
from pathlib import Path

from benchmarks.common import save
from benchmarks.mfu import COMPILE_SETTINGS, end_to_end

LOSS_STEPS = 4  # steps of the largest world size whose samples the losses are compared over


def loss_after_same_samples(runs: dict[int, dict], samples_per_rank_step: int) -> dict:
    """Every run's mean loss over the same samples: the last LOSS_STEPS steps of the largest world size that every
    run reached, and the steps that trained the same number of samples in each smaller one (weak scaling: a step
    of W ranks trains W times a step of one). Losses are each step's over all ranks' samples."""
    largest = max(runs)
    reach = min(len(r["losses"]) * w for w, r in runs.items())  # in steps of one rank
    end = reach // largest * largest  # a sample count every run reached at a step boundary
    window = min(LOSS_STEPS * largest, end)
    out = {"samples": end * samples_per_rank_step, "window_samples": window * samples_per_rank_step, "loss": {}}
    for w, r in runs.items():
        steps = r["losses"][(end - window) // w : end // w]
        out["loss"][str(w)] = statistics.mean(steps) if steps else math.nan
    base = out["loss"]["1"]
    out["relative_difference"] = {w: (v - base) / base for w, v in out["loss"].items() if w != "1"}
    return out


def samples_per_step(run: dict) -> float:
    """Samples per step of the timed window, all ranks."""
    return run["samples_per_second"] * run["seconds"] / run["steps"]


def scaling(runs: dict[int, dict]) -> dict:
    """Per world size: samples/s (window mean, median step), the efficiency against one rank, the rank balance and
    the exposed communication."""
    base_median = samples_per_step(runs[1]) / runs[1]["step_seconds_median"]
    out = {}
    for w, r in runs.items():
        median_rate = samples_per_step(r) / r["step_seconds_median"]
        communication = r.get("communication") or {}
        out[str(w)] = {
            "samples_per_second": r["samples_per_second"], "samples_per_second_median_step": median_rate,
            "scaling_efficiency": r["samples_per_second"] / (w * runs[1]["samples_per_second"]),
            "scaling_efficiency_median_step": median_rate / (w * base_median),
            "mfu_window_mean": r["mfu_window_mean"], "step_seconds_mean": r["step_seconds_mean"],
            "step_seconds_median": r["step_seconds_median"], "embedding_sharding": r["embedding_sharding"],
            "rank_balance": r.get("rank_balance"),
            "exposed_communication_seconds_per_step": communication.get("exposed_communication_seconds",
                                                                        "not measured: profiles a GPU's kernels"),
            "communication": communication,
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    parser.add_argument("--data", type=Path, required=True,
                        help="sequence_logs/ and plans/world_size=W.parquet for every W (benchmarks/mfu_data.py)")
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--preset", default="gem_gpu")
    parser.add_argument("--width", type=float, default=1.0)
    parser.add_argument("--depth", type=float, default=1.0)
    parser.add_argument("--max-history-len", type=int, default=0, help="0: the preset's")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="model settings (dotted keys)")
    parser.add_argument("--precision", default="bf16@model",
                        help="one run name of benchmarks/mfu.py: precision[:fp8 recipe][@compile][+NAME=VALUE]")
    parser.add_argument("--fp8-recipes", nargs="+", default=["tensorwise_triton"])
    parser.add_argument("--compile", choices=COMPILE_SETTINGS, default="dense")
    parser.add_argument("--activation-checkpointing", choices=("none", "sequence"), default="none")
    parser.add_argument("--unit-prefetch", action="store_true", help="FSDP2 prefetch in the units' order")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per run")
    parser.add_argument("--warmup-steps", type=int, default=10)
    parser.add_argument("--profile-steps", type=int, default=2, help="profiled after the window (rank 0)")
    parser.add_argument("--plans", type=Path, default=None, help="the plans' folder instead of DATA/plans")
    parser.add_argument("--profiler", choices=("torch", "python"), default="torch",
                        help="torch.profiler (device kernels, exposed communication), or cProfile (host Python)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--time-budget", type=float, default=0, help="seconds for every run (0: no limit)")
    parser.add_argument("--copy-to", type=Path, help="also copy the JSON here")
    parser.add_argument("--output-name", default=None,
                        help="results/<name>.json (default distributed_training_<device>)")
    args = parser.parse_args()
    if 1 not in args.world_sizes:
        parser.error("--world-sizes must include 1 (the baseline of the scaling efficiency)")
    missing = [str(p) for p in [args.data / "sequence_logs", *(args.data / "plans" / f"world_size={w}.parquet"
                                                               for w in args.world_sizes)] if not p.exists()]
    if missing:
        parser.error(f"--data {args.data}: missing {', '.join(missing)} (benchmarks/mfu_data.py --world-sizes ...)")

    began = time.perf_counter()
    name = args.output_name or f"distributed_training_{args.device}"
    settings = {**vars(args), "loss_steps": LOSS_STEPS,
                "note": "weak scaling: every rank trains the plan's per-rank batch; samples/s over each run's timed "
                        "window (data loading included, evaluation not)"}
    runs, results = {}, {}
    for world_size in sorted(args.world_sizes):
        if args.device == "cpu":  # ranks share the cores
            os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // world_size))
        left = math.inf if not args.time_budget else args.time_budget - (time.perf_counter() - began)
        run = end_to_end(argparse.Namespace(**vars(args), nproc=world_size), "preset", {}, args.precision, left)
        results.setdefault("runs", {})[str(world_size)] = run
        if "samples_per_second" not in run:
            print(f"world size {world_size}: no figures ({run.get('error') or run.get('skipped')})", flush=True)
            break
        runs[world_size] = run
        balance = run.get("rank_balance")
        print(f"world size {world_size}: {run['samples_per_second']:.1f} samples/s"
              + (f", imbalance observed {balance['imbalance']['observed']:.3f} against planned "
                 f"{balance['imbalance']['planned']:.3f}" if isinstance(balance, dict) else ""), flush=True)
        save(name, settings, results)
    if 1 in runs and len(runs) > 1:
        per_rank_step = round(samples_per_step(runs[1]))
        results["per_world_size"] = scaling(runs)
        results["loss_after_same_samples"] = loss_after_same_samples(runs, per_rank_step)
        for w, figures in results["per_world_size"].items():
            print(f"world size {w}: efficiency {figures['scaling_efficiency']:.3f} (window mean), "
                  f"{figures['scaling_efficiency_median_step']:.3f} (median step)", flush=True)
    results["wall_seconds"] = time.perf_counter() - began
    path = save(name, settings, results)
    if args.copy_to is not None:
        args.copy_to.mkdir(parents=True, exist_ok=True)
        shutil.copy(path, args.copy_to / path.name)


if __name__ == "__main__":
    main()
