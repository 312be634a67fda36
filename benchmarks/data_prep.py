"""Data preparation speed and memory, and Base Batch Shuffling balance.

For each size: synthetic raw_event_logs partitions (14 days, stored as the asset stores them) are
prepared into sequence_logs, each run in a fresh process so its peak memory is its own (cold: a
Dagster step is a fresh process), and repeatedly in one process (warm, the first run left out); beside it,
in the same run, a straightforward polars version (sort by user and time, group into lists) that
writes the same two tables. Then the BBS imbalance of the largest train split for several world
sizes, against a random assignment.

The machine may be shared: before each timed run the script waits (up to --load-wait seconds) for
the 1-minute load average to fall below --max-load, and records the load each run started at.

    python benchmarks/data_prep.py [--events 1000000 10000000] [--repeats 3] [--max-load 1.3]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import statistics
import sys
import tempfile
import time
from datetime import date, timedelta
from pathlib import Path
from queue import Empty

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from benchmarks.common import Quiet, save  # noqa: E402

DAYS = 14
START = date(2026, 11, 1)
EVENTS_PER_USER_PER_DAY = 3.0


def write_raw(folder: Path, events: int) -> list[Path]:
    from gem_ops.data.raw_event_logs import write_partition
    from gem_ops.data.synthetic import SyntheticConfig, generate_day

    config = SyntheticConfig(n_users=round(events / (DAYS * EVENTS_PER_USER_PER_DAY)), seed=7)
    return [write_partition(generate_day(config, START + timedelta(days=d)),
                            folder / f"{START + timedelta(days=d)}.parquet")
            for d in range(DAYS)]


def _prepare(paths, out, queue):
    import resource

    from gem_ops.data.sequence_logs import SequenceLogsConfig, build_sequence_logs

    start = time.perf_counter()
    summary = build_sequence_logs(paths, out, SequenceLogsConfig(max_history_len=1024))
    seconds = time.perf_counter() - start
    queue.put({"seconds": seconds, "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
               "events": summary.n_events, "examples": summary.n_examples, "users": summary.n_users,
               "stage_seconds": summary.stage_seconds})


def _prepare_warm(paths, out, queue, repeats: int = 3):
    """Steady state: one process prepares the same input repeatedly (a worker preparing partition
    after partition); the first, cold, run is left out."""
    from gem_ops.data.sequence_logs import SequenceLogsConfig, build_sequence_logs

    seconds, loads = [], []
    for i in range(repeats + 1):
        shutil.rmtree(out, ignore_errors=True)
        os.sync()
        loads.append(os.getloadavg()[0])
        start = time.perf_counter()
        summary = build_sequence_logs(paths, out, SequenceLogsConfig(max_history_len=1024))
        seconds.append(time.perf_counter() - start)
    queue.put({"seconds": statistics.median(seconds[1:]), "cold_seconds": seconds[0], "all_seconds": seconds,
               "all_load_1min": loads, "events": summary.n_events, "stage_seconds_last": summary.stage_seconds})


def _prepare_naive(paths, out, queue):
    """Sort by (user, time), rank ties, group into lists: the obvious polars version."""
    import resource

    import polars as pl

    start = time.perf_counter()
    frame = (
        pl.scan_parquet([str(p) for p in paths])
        .sort(["user_id", "timestamp"])
        .with_columns((pl.col("timestamp").rank("min").over("user_id") - 1).cast(pl.Int32).alias("history_end"))
    )
    out = Path(out)
    out.mkdir()
    timelines = frame.group_by("user_id", maintain_order=True).agg("item_id", "timestamp", "surface", "event_type")
    timelines.sink_parquet(out / "timelines.parquet")
    examples = frame.filter(pl.any_horizontal(pl.col("^label_.*$").is_not_null()))
    examples.with_columns(pl.col("history_end").clip(upper_bound=1024).alias("history_len")).sink_parquet(
        out / "examples.parquet")
    seconds = time.perf_counter() - start
    n = pl.scan_parquet([str(p) for p in paths]).select(pl.len()).collect().item()
    queue.put({"seconds": seconds, "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
               "events": n})


def in_fresh_process(target, *args, quiet: Quiet = Quiet()) -> dict:
    load = quiet.wait()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=target, args=(*args, queue))
    proc.start()
    while True:
        try:
            result = queue.get(timeout=1.0)
            break
        except Empty:
            if not proc.is_alive():
                raise RuntimeError(f"{target.__name__} died with exit code {proc.exitcode}") from None
    proc.join()
    return result | {"load_1min": load}


def measure(target, paths, folder: Path, repeats: int, quiet: Quiet) -> dict:
    """Each run starts with no dirty pages pending (sync), and the previous run's output is removed
    (run 0's is kept for the balance figures), so one run's writeback does not slow the next."""
    runs = []
    for i in range(repeats):
        if i > 1:
            shutil.rmtree(folder / f"{target.__name__}-{i - 1}", ignore_errors=True)
        os.sync()
        runs.append(in_fresh_process(target, paths, str(folder / f"{target.__name__}-{i}"), quiet=quiet))
    seconds = statistics.median(r["seconds"] for r in runs)
    return {"events": runs[0]["events"], "median_seconds": seconds, "events_per_second": runs[0]["events"] / seconds,
            "peak_rss_mib": max(r["peak_rss_mib"] for r in runs), "load_1min": [r["load_1min"] for r in runs],
            "runs": runs}


def balance(sequence_logs: str, world_sizes: list[int]) -> dict:
    from gem_ops.data.batch_shuffling import ShufflingConfig, imbalance, plan_base_batch_shuffling, plan_random
    from gem_ops.data.loader import SequenceLogs

    logs = SequenceLogs(sequence_logs)
    train = logs.split_indices("train")
    lengths = logs.history_lengths()[train]
    config = ShufflingConfig()
    out = {}
    for w in world_sizes:
        start = time.perf_counter()
        plan = plan_base_batch_shuffling(lengths, w, config, train)
        seconds = time.perf_counter() - start
        out[w] = {"random": imbalance(plan_random(lengths, w, config, train)), "bbs": imbalance(plan),
                  "plan_seconds": seconds, "dropped": plan.dropped}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--events", type=int, nargs="+", default=[1_000_000, 10_000_000])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 8, 64])
    parser.add_argument("--skip-naive", action="store_true", help="leave out the straightforward polars baseline")
    parser.add_argument("--max-load", type=float, default=1.3, help="start a timed run only below this 1-minute load")
    parser.add_argument("--load-wait", type=float, default=600.0, help="seconds to wait for that before running anyway")
    args = parser.parse_args()
    quiet = Quiet(args.max_load, args.load_wait)

    results = {"prepare": {}, "balance": {}}
    with tempfile.TemporaryDirectory(prefix="data_prep_") as tmp:
        tmp = Path(tmp)
        for events in args.events:
            folder = tmp / str(events)
            start = time.perf_counter()
            paths = [str(p) for p in write_raw(folder / "raw", events)]
            generation = time.perf_counter() - start
            entry = {"generate_and_store_raw_seconds": generation,
                     "sequence_logs": measure(_prepare, paths, folder, args.repeats, quiet)}
            warm = in_fresh_process(_prepare_warm, paths, str(folder / "warm"), quiet=quiet)
            entry["sequence_logs_warm_process"] = warm | {"events_per_second": warm["events"] / warm["seconds"]}
            if not args.skip_naive:
                entry["naive_polars"] = measure(_prepare_naive, paths, folder, args.repeats, quiet)
                entry["speedup_over_naive"] = (entry["naive_polars"]["median_seconds"]
                                               / entry["sequence_logs"]["median_seconds"])
            results["prepare"][events] = entry
            print(json.dumps({events: {k: (v if not isinstance(v, dict)
                                           else {kk: vv for kk, vv in v.items() if kk != "runs"})
                                       for k, v in entry.items()}}, indent=1), flush=True)
        largest = str(tmp / str(max(args.events)) / "_prepare-0")
        results["balance"] = balance(largest, args.world_sizes)
        print(json.dumps(results["balance"], indent=1))
    settings = {"days": DAYS, "events_per_user_per_day": EVENTS_PER_USER_PER_DAY, "max_history_len": 1024,
                "sub_batch_size": 128, "sub_batches_per_rank": 4, "cost": "attention", "repeats": args.repeats,
                "events": args.events, "world_sizes": args.world_sizes, "max_load": args.max_load}
    save("data_prep", settings, results)


if __name__ == "__main__":
    main()
