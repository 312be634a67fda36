"""Runs whose orchestrating process died (e.g. a killed `pipelines.run_local`): the Dagster run is marked
failed and its MLflow runs killed, so that neither stays STARTED / RUNNING for good.

A run executed in a process of its own (run_local's in-process runs) carries that process's identity in a
tag; the run is orphaned when that process is gone (its pid unused, or reused by a process started later)."""

from __future__ import annotations

import socket

import dagster as dg
import psutil
from mlflow.entities import RunStatus

from assets.resources import DAGSTER_RUN_ID_TAG, MLflowResource

ORCHESTRATOR_TAG = "gem/orchestrator"
UNFINISHED = [dg.DagsterRunStatus.STARTED, dg.DagsterRunStatus.STARTING, dg.DagsterRunStatus.CANCELING]


def orchestrator_tags() -> dict[str, str]:
    """Tags naming this process (host, pid, start time) for a run it executes itself."""
    me = psutil.Process()
    return {ORCHESTRATOR_TAG: f"{socket.gethostname()}:{me.pid}:{me.create_time():.3f}"}


def close_orphaned_runs(instance: dg.DagsterInstance, mlflow: MLflowResource) -> list[str]:
    """Marks every unfinished run whose orchestrating process on this host is gone as failed, and its
    still-running MLflow runs as killed; returns a line per run closed."""
    closed = []
    for run in instance.get_runs(filters=dg.RunsFilter(statuses=UNFINISHED)):
        owner = _dead_owner(run.tags.get(ORCHESTRATOR_TAG))
        if owner is None:
            continue
        instance.report_run_failed(run, f"The process that ran this run ({owner}) ended without finishing it "
                                        "(killed); marked failed by the next pipelines.run_local.")
        killed = _kill_mlflow_runs(mlflow, run.run_id)
        closed.append(f"run {run.run_id} of {run.job_name} (partition {run.tags.get('dagster/partition', '-')}): "
                      f"its process {owner} is gone; marked failed, {killed} MLflow run(s) marked killed")
    return closed


def _dead_owner(tag: str | None) -> str | None:
    """'pid P on host H' when the tag names a process of this host that no longer runs, else None."""
    if not tag:
        return None
    host, pid, started = tag.rsplit(":", 2)
    if host != socket.gethostname():
        return None  # another machine's process: not ours to judge
    try:
        alive = abs(psutil.Process(int(pid)).create_time() - float(started)) < 1.0
    except psutil.NoSuchProcess:
        alive = False
    return None if alive else f"pid {pid} on {host}"


def _kill_mlflow_runs(mlflow: MLflowResource, dagster_run_id: str) -> int:
    client = mlflow.get_client()
    experiments = [e.experiment_id for e in client.search_experiments()]
    if not experiments:
        return 0
    query = f"tags.`{DAGSTER_RUN_ID_TAG}` = '{dagster_run_id}' and attributes.status = 'RUNNING'"
    runs = client.search_runs(experiments, query, max_results=1000)
    for run in runs:
        client.set_terminated(run.info.run_id, RunStatus.to_string(RunStatus.KILLED))
    return len(runs)
