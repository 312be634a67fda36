"""Distributed GEM training throughput: the same job on 1 and on N processes (torchrun; gloo on CPU,
NCCL with --device cuda), samples/s per world size and the scaling efficiency
(samples/s at N / (N x samples/s at 1)). Each world size trains on its own plan with the same per-rank
batch, i.e. weak scaling. Saved as benchmarks/results/distributed_training_<device>.json.

    python -m benchmarks.distributed_training --device cpu --world-sizes 1 2 --steps 20
    python -m benchmarks.distributed_training --device cuda --world-sizes 1 2 --preset gem --steps 100
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import tempfile
import types
from datetime import date
from pathlib import Path

from benchmarks.common import save
from gem_ops.train.launch import torchrun_prefix

ROOT = Path(__file__).resolve().parents[1]
WARMUP_STEPS = 5


def run_job(world_size: int, data, args, workdir: Path) -> dict:
    result = workdir / f"result_ws{world_size}.json"
    cmd = [*torchrun_prefix(world_size), "-m", "gem_ops.train", "--sequence-logs", str(data.sequence_logs),
           "--plans", str(data.plans[world_size].parent),
           "--preset", args.preset, "--width", str(args.width), "--depth", str(args.depth),
           "--model-override", f"sequence.max_history_len={args.max_history_len}",
           "--max-steps", str(args.steps), "--epochs", str(args.epochs), "--warmup-steps", "1",
           "--eval-max-examples", str(args.eval_examples),
           "--embedding-sharding", args.embedding_sharding, "--device", args.device,
           "--checkpoint-dir", str(workdir / f"checkpoints_ws{world_size}"), "--result-json", str(result),
           "--progress-every", str(max(1, args.steps // 4))]
    threads = args.threads_per_rank or max(1, (os.cpu_count() or 1) // world_size)
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": str(threads)}, start_new_session=True)
    try:
        code = proc.wait(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    if code != 0:
        raise RuntimeError(f"world size {world_size}: torchrun exited with {code}")
    return json.loads(result.read_text())


def synthetic_data(args, workdir: Path):
    from gem_ops.data.batch_shuffling import ShufflingConfig
    from gem_ops.data.prepare import prepare_training_data
    from gem_ops.data.raw_event_logs import EventSource
    from gem_ops.data.sequence_logs import SequenceLogsConfig
    from gem_ops.data.synthetic import SyntheticConfig

    return prepare_training_data(
        EventSource("synthetic", SyntheticConfig(n_users=args.users)), date(2026, 11, args.days), args.days,
        workdir / "data", SequenceLogsConfig(max_history_len=args.max_history_len, eval_days=1),
        ShufflingConfig(sub_batch_size=args.sub_batch_size, sub_batches_per_rank=4),
        world_sizes=tuple(args.world_sizes))


def prepared_data(folder: Path, world_sizes: list[int]):
    """A folder holding sequence_logs/ and plans/world_size=W.parquet, prepared elsewhere (a GPU machine
    may lack the data-preparation libraries)."""
    plans = {w: folder / "plans" / f"world_size={w}.parquet" for w in world_sizes}
    missing = [str(p) for p in [folder / "sequence_logs", *plans.values()] if not p.exists()]
    if missing:
        raise SystemExit(f"--data {folder}: missing {missing}")
    return types.SimpleNamespace(sequence_logs=folder / "sequence_logs", plans=plans)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--preset", default="vertical")
    parser.add_argument("--width", type=float, default=1.0)
    parser.add_argument("--depth", type=float, default=1.0)
    parser.add_argument("--max-history-len", type=int, default=64)
    parser.add_argument("--users", type=int, default=2000)
    parser.add_argument("--days", type=int, default=6)
    parser.add_argument("--sub-batch-size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--eval-examples", type=int, default=256)
    parser.add_argument("--embedding-sharding", default="auto")
    parser.add_argument("--threads-per-rank", type=int, default=0,
                        help="OMP threads per rank; 0: the cores split evenly")
    parser.add_argument("--timeout", type=int, default=1800)
    parser.add_argument("--data", type=Path, help="prepared sequence_logs/ and plans/ instead of fresh synthetic data")
    parser.add_argument("--epochs", type=int, default=1)
    args = parser.parse_args()
    if 1 not in args.world_sizes:
        parser.error("--world-sizes must include 1 (the baseline of the scaling efficiency)")

    with tempfile.TemporaryDirectory(prefix="gem-dist-bench-") as tmp:
        workdir = Path(tmp)
        data = prepared_data(args.data, args.world_sizes) if args.data else synthetic_data(args, workdir)
        runs = {}
        for world_size in args.world_sizes:
            r = run_job(world_size, data, args, workdir)
            # Steady state: the median step after WARMUP_STEPS (the first steps initialise lazily, and on
            # GPU each new length bucket autotunes the attention kernel once).
            per_step = r["samples"] / len(r["step_seconds"])
            steady = sorted(r["step_seconds"][WARMUP_STEPS:])
            rate = per_step / steady[len(steady) // 2]
            timed = r["step_seconds"][WARMUP_STEPS:]
            runs[world_size] = {"samples_per_second": rate,
                                "samples_per_second_mean": len(timed) * per_step / sum(timed),
                                "samples_per_second_all_steps": r["samples_per_second"],
                                "rank_batch_size": per_step / world_size,
                                "step_seconds": r["step_seconds"], "steps": r["steps"], "samples": r["samples"],
                                "embedding_sharding": r["embedding_sharding"],
                                "imbalance_observed": r["imbalance_observed"],
                                "imbalance_observed.tokens": r["imbalance_observed.tokens"],
                                "final_train_loss": r["final_train_loss"]}
            print(f"world size {world_size}: {rate:.1f} samples/s "
                  f"(imbalance {r['imbalance_observed']:.3f} compute, {r['imbalance_observed.tokens']:.3f} tokens)")
    base, base_mean = runs[1]["samples_per_second"], runs[1]["samples_per_second_mean"]
    results = {"per_world_size": {str(w): {**r, "scaling_efficiency": r["samples_per_second"] / (w * base),
                                           "scaling_efficiency_mean": r["samples_per_second_mean"] / (w * base_mean)}
                                  for w, r in runs.items()}}
    settings = {**vars(args), "warmup_steps": WARMUP_STEPS,
                "note": "weak scaling: every rank trains the same batch size; samples/s from the median step time "
                        "after the warm-up steps (mean beside it), data loading included, evaluation and checkpoints "
                        "not"}
    save(f"distributed_training_{args.device}", settings, results)


if __name__ == "__main__":
    main()
