"""The processes a benchmark trains in end with it: a `timeout` or `kill` reaches only the benchmark's own process."""

import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[1]

BENCHMARK = textwrap.dedent("""
    import time
    from benchmarks.common import in_processes
    for _ in in_processes(time.sleep, {"a": (120,), "b": (120,)}, 2):
        pass
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_the_worker_processes_end_when_the_benchmark_is_killed():
    benchmark = subprocess.Popen([sys.executable, "-c", BENCHMARK], cwd=ROOT)
    workers: list[psutil.Process] = []
    try:
        parent = psutil.Process(benchmark.pid)
        deadline = time.monotonic() + 60
        while len(workers) < 2 and time.monotonic() < deadline:  # both spawned and sleeping in their call
            time.sleep(0.5)
            workers = [p for p in parent.children() if "spawn_main" in " ".join(p.cmdline())]
        assert len(workers) == 2, "the benchmark did not start its two worker processes"
        time.sleep(5)  # past the initializer, inside time.sleep(120)
        benchmark.send_signal(signal.SIGTERM)  # as `timeout` does: the parent alone
        benchmark.wait(30)
        gone, alive = psutil.wait_procs(workers, timeout=30)
        assert not alive, f"worker processes {[p.pid for p in alive]} outlived the benchmark"
    finally:  # nothing left running, whatever failed
        for process in [psutil.Process(benchmark.pid), *workers] if benchmark.poll() is None else workers:
            if process.is_running():
                process.kill()
