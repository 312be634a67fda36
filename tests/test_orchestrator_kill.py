"""`pipelines.run_local` killed (SIGKILL) twice on a small config, then run again: once while it writes
sequence_logs (tests/orchestrator_drill.py holds it there), once while GEM trains. The training job dies
with its orchestrator; the next run marks each killed Dagster run failed and its MLflow runs killed, clears
the half-written partition and rebuilds a consistent one; only the finished run registers a GEM.
About 3 minutes on 2 cores, so marked slow."""

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import dagster as dg
import psutil
import pytest
import yaml
from mlflow.tracking import MlflowClient

from gem_ops.data.loader import SequenceLogs

PROJECT_ROOT = Path(__file__).resolve().parents[1]
END = "2026-11-03"
ASIDE = r"\..+\.\d+\.\w+"  # what atomic writers set aside: .<name>.<pid>.<random> (not DCP's .metadata)
STUDENTS = {"max_steps": 2, "eval_max_examples": 256, "sub_batch_size": 16, "sub_batches_per_rank": 1,
            "model_overrides": {"sequence.max_history_len": "16"}}
CONFIG = {"ops": {
    "raw_event_logs": {"config": {"synthetic_users": 300}},
    "sequence_logs": {"config": {"lookback_days": 3, "max_history_len": 32}},
    "shuffled_batches": {"config": {"world_sizes": [1], "sub_batches_per_rank": 1, "sub_batch_size": 32}},
    "gem_foundation_model": {"config": {"preset": "vertical", "width": 0.5, "epochs": 50, "max_steps": 400,
                                        "eval_every": 0, "early_stopping_patience": 0, "eval_max_examples": 256}},
    "domain_foundation_models": {"config": {**STUDENTS, "preset": "domain_fm", "width": 0.5}},
    # two steps of training: promote them
    "vertical_models": {"config": {**STUDENTS, "ne_tolerance": 10.0, "min_positives": 1}},
}}


def _wait_for(condition, timeout: float, what: str, proc: subprocess.Popen):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = condition()
        if found:
            return found
        assert proc.poll() is None, f"the pipeline ended ({proc.returncode}) before {what}"
        time.sleep(0.5)
    raise AssertionError(f"no {what} within {timeout} s")


def _trainers(proc: subprocess.Popen) -> list[psutil.Process]:
    try:
        children = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    return [p for p in children if any("gem_ops.train" in part for part in _cmdline(p))]


def _cmdline(process: psutil.Process) -> list[str]:
    try:
        return process.cmdline()
    except psutil.Error:
        return []


@pytest.mark.slow
def test_a_killed_orchestrator_leaves_nothing_running_or_half_written(tmp_path, monkeypatch):
    lake, home, marker = tmp_path / "lake", tmp_path / "dagster", tmp_path / "stalled"
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    env = {**os.environ, "DAGSTER_HOME": str(home), "GEM_LAKE_DIR": str(lake), "MLFLOW_TRACKING_URI": uri,
           "GEM_DRILL_MARKER": str(marker), "OMP_NUM_THREADS": "1"}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(CONFIG))
    args = ["--end", END, "--days", "3", "--config", str(tmp_path / "config.yaml")]

    def start(module: str, log: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", module, *args], cwd=PROJECT_ROOT, env=env,
                                stdout=open(tmp_path / log, "w"), stderr=subprocess.STDOUT)

    # 1. Killed with sequence_logs written aside, not yet renamed into place.
    stalled = start("tests.orchestrator_drill", "stalled.log")
    _wait_for(marker.exists, 300, "stall in sequence_logs", stalled)
    aside = list((lake / "sequence_logs").glob(f".{END}.*"))
    assert aside and not (lake / "sequence_logs" / END).exists()
    assert all(re.fullmatch(ASIDE, p.name) for p in aside), aside
    stalled.kill()
    stalled.wait()

    # 2. Killed while GEM trains: the training job ends with it.
    training = start("pipelines.run_local", "training.log")
    trainers = _wait_for(lambda: _trainers(training), 300, "GEM training process", training)
    time.sleep(3)
    trainers = _trainers(training) or trainers
    training.kill()
    training.wait()
    _, alive = psutil.wait_procs(trainers, timeout=60)
    assert not alive, [p.cmdline() for p in alive]

    # 3. Run again: it finishes.
    done = subprocess.run([sys.executable, "-m", "pipelines.run_local", *args], check=False, cwd=PROJECT_ROOT,
                          env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert (tmp_path / "training.log").read_text().count("closed an orphaned run") == 1
    assert done.stdout.count("closed an orphaned run") == 1

    monkeypatch.setenv("DAGSTER_HOME", str(home))
    with dg.DagsterInstance.get() as instance:
        runs = instance.get_runs(filters=dg.RunsFilter(job_name="gem_pipeline", tags={"dagster/partition": END}))
        statuses = sorted(r.status.value for r in runs)
        assert statuses == ["FAILURE", "FAILURE", "SUCCESS"], statuses
        killed = [r.run_id for r in runs if r.status == dg.DagsterRunStatus.FAILURE]
        finished = next(r.run_id for r in runs if r.status == dg.DagsterRunStatus.SUCCESS)
        for run_id in killed:
            messages = [e.message for e in instance.all_logs(run_id)]
            assert any("ended without finishing it (killed)" in m for m in messages), messages[-3:]

    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name("gem").experiment_id
    assert not client.search_runs([experiment], "attributes.status = 'RUNNING'")
    for run_id in killed:
        of_run = client.search_runs([experiment], f"tags.`dagster.run_id` = '{run_id}'")
        assert of_run and {r.info.status for r in of_run} <= {"KILLED", "FINISHED"}, [r.info.status for r in of_run]
    (gem,) = client.search_model_versions("name='gem_foundation_model'")
    assert client.get_run(gem.run_id).data.tags["dagster.run_id"] == finished

    leftovers = [p for p in lake.rglob(".*") if re.fullmatch(ASIDE, p.name)]
    assert not leftovers, leftovers
    logs = SequenceLogs(lake / "sequence_logs" / END)
    assert len(logs) > 0 and logs.split_indices("eval").size > 0
