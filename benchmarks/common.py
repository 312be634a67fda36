"""What every benchmark records beside its figures: the commit, the machine and the settings."""

from __future__ import annotations

import functools
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from benchmarks.source_tree import source_tree

RESULTS = Path(__file__).resolve().parent / "results"


def machine() -> dict:
    cpu = ""
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    out = {"host": platform.node(), "cpu": cpu, "cores": os.cpu_count(), "memory_gib": round(mem_gib, 1),
           "python": platform.python_version(), "platform": platform.platform()}
    torch = sys.modules.get("torch")  # only where the benchmark itself uses torch
    if torch is not None and torch.cuda.is_available():
        out["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return out


@functools.cache
def commit() -> dict:
    """The checkout's commit, whether tracked files differ from it, and the tree id of its files (source_tree:
    `git rev-parse <commit>^{tree}` equals it where the run's files were that commit's), as when the benchmark
    started: taken on first use, and this module takes it when imported (a long run's tree may change before it
    saves)."""
    root = Path(__file__).resolve().parents[1]
    tree = source_tree(root)
    if os.environ.get("GEM_SOURCE_COMMIT"):  # a copied tree whose .git may be stale (the GPU machine)
        # GEM_SOURCE_DIRTY "1" or "0"; unset, whether the tree matched the commit is not known (null), not clean
        dirty = {"1": True, "0": False}.get(os.environ.get("GEM_SOURCE_DIRTY", ""))
        return {"commit": os.environ["GEM_SOURCE_COMMIT"], "dirty": dirty, "tree": tree}
    run = lambda *a: subprocess.run(["git", *a], cwd=root, capture_output=True, text=True).stdout.strip()  # noqa: E731
    return {"commit": run("rev-parse", "HEAD"), "dirty": bool(run("status", "--porcelain", "--untracked-files=no")),
            "tree": tree}


def save(name: str, settings: dict, results: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    settings = json.loads(json.dumps(settings, default=str))  # paths and the like as text
    payload = {"benchmark": name, "when": datetime.now(timezone.utc).isoformat(timespec="seconds"),
               **commit(), "machine": machine(), "settings": settings, "results": results}
    path = RESULTS / f"{name}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(payload, indent=2))
    os.replace(tmp, path)
    print(f"saved {path}")
    return path


def saved_results(name: str) -> dict:
    """The results a previous run saved under `name` ({} if none): what `--resume` keeps."""
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text())["results"] if path.exists() else {}


def in_processes(work, calls: dict, processes: int):
    """Yields (key, work(*calls[key])) as each call ends, `processes` spawned processes at a time, each with
    its share of the CPU threads (small trainings leave a GPU mostly idle one at a time). A call that fails
    is reported and skipped: the others' figures are kept. The processes end with this one, however it ends (a
    `timeout` or `kill` reaches only this process: left running, they would train on and share the device
    with the next command)."""
    if processes <= 1:
        for key, call in calls.items():
            yield key, work(*call)
        return
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed

    threads = max(1, (os.cpu_count() or 1) // processes)
    with ProcessPoolExecutor(processes, mp_context=multiprocessing.get_context("spawn"),
                             initializer=_start_worker, initargs=(threads,)) as pool:
        futures = {pool.submit(work, *call): key for key, call in calls.items()}
        for future in as_completed(futures):
            if future.exception() is not None:
                print(f"{futures[future]} failed: {future.exception()!r}", flush=True)
                continue
            yield futures[future], future.result()


def _start_worker(threads: int) -> None:
    _end_with_parent()
    import torch

    torch.set_num_threads(threads)


def _end_with_parent() -> None:
    """Linux sends this process SIGTERM when its parent ends (prctl PR_SET_PDEATHSIG); elsewhere a no-op."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    parent = os.getppid()
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the parent ended before the request took effect
        os.kill(os.getpid(), signal.SIGTERM)


@dataclass(frozen=True)
class Quiet:
    """Timed runs start once the 1-minute load average is below max_load, or after timeout seconds."""

    max_load: float = float("inf")
    timeout: float = 0.0

    def wait(self) -> float:
        deadline = time.monotonic() + self.timeout
        while os.getloadavg()[0] >= self.max_load and time.monotonic() < deadline:
            time.sleep(5)
        return os.getloadavg()[0]


commit()  # the tree the benchmark starts from


def setting(item: str) -> tuple[str, object]:
    """KEY=VALUE, the value read as JSON where it parses (numbers, true/false), else as text."""
    key, sep, value = item.partition("=")
    if not sep:
        raise SystemExit(f"a setting takes KEY=VALUE, got {item!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


TRAIN = "train."  # a setting's key with this prefix names a TrainConfig field, the others the model's


def train_changes(settings: dict) -> dict:
    """The training settings among `settings`: `train.<TrainConfig field>` keys, the prefix dropped."""
    return {k[len(TRAIN):]: v for k, v in settings.items() if k.startswith(TRAIN)}


def named_settings(item: str) -> tuple[str, dict]:
    """NAME[:key=value,...]: a named variant of a run with its settings (dotted model keys and the like)."""
    name, _, rest = item.partition(":")
    return name, dict(setting(kv) for kv in rest.split(",") if kv)


def mean_std(figure: dict) -> str:
    """A {"mean", "std"} figure as a table cell: 0.812 ± 0.004."""
    return f"{figure['mean']:.3f} ± {figure['std']:.3f}"
