"""`dagster dev` really started on the project's workspace.yaml, asked over GraphQL for the asset graph."""

import json
import signal
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.servers import free_port, group_processes, start_server, stop_server, until_ready

PROJECT = Path(__file__).resolve().parents[1]
QUERY = """
{ assetNodes { assetKey { path } groupName isPartitioned
    dependencyKeys { path } assetChecksOrError { ... on AssetChecks { checks { name blocking description } } } }
  repositoriesOrError { ... on RepositoryConnection { nodes { name location { name } jobs { name }
      schedules { name } } } }
  pipelineOrError(params: {pipelineName: "gem_pipeline", repositoryName: "__repository__",
                           repositoryLocationName: "pipelines.definitions"}) { ... on Pipeline { runs { runId } } } }
"""


def _local_run(instance, home: Path) -> str:
    """A day of raw events through the gem_pipeline job as `pipelines.run_local` runs it (in process, into
    `instance`, the one at `home`); its run id."""
    from assets.resources import MLflowResource
    from tests.local_runs import local_gem_pipeline, run_local

    job = local_gem_pipeline(home / "lake", MLflowResource(tracking_uri=f"sqlite:///{home / 'mlflow.db'}"))
    return run_local(job, instance, "2026-11-14", ["raw_event_logs"],
                     {"ops": {"raw_event_logs": {"config": {"synthetic_users": 200}}}}).run_id


@pytest.mark.server
def test_dagster_dev_serves_the_asset_graph(tmp_path):
    import dagster as dg

    port = free_port()
    dagster = str(Path(sys.executable).with_name("dagster"))
    # The instance is made before the server opens it; the server comes up while the run is recorded.
    with dg.DagsterInstance.from_config(str(tmp_path)) as instance:
        proc = start_server(
            [dagster, "dev", "-w", str(PROJECT / "workspace.yaml"), "-h", "127.0.0.1", "-p", str(port)],
            ready=f"http://127.0.0.1:{port}/server_info",
            env={"DAGSTER_HOME": str(tmp_path), "GEM_LAKE_DIR": str(tmp_path / "lake"),
                 "DAGSTER_DISABLE_TELEMETRY": "yes"},
            timeout=120, wait=False,
        )
        try:
            run_id = _local_run(instance, tmp_path)
            until_ready(proc)
            request = urllib.request.Request(
                f"http://127.0.0.1:{port}/graphql",
                data=json.dumps({"query": QUERY}).encode(),
                headers={"Content-Type": "application/json"},
            )
            data = _until_loaded(request)
        finally:
            stopping = time.monotonic()
            ended_by = stop_server(proc, timeout=30, first=signal.SIGINT)
            stop_seconds = time.monotonic() - stopping
    # Ctrl-C (`make dagster`) ends the webserver, the daemon and the code server.
    assert ended_by == signal.SIGINT and proc.poll() is not None and not group_processes(proc.pid), \
        f"still running {stop_seconds:.0f} s after Ctrl-C"

    nodes = {"/".join(n["assetKey"]["path"]): n for n in data["assetNodes"]}
    assert {"raw_event_logs", "sequence_logs", "shuffled_batches"} <= set(nodes)
    assert ["raw_event_logs"] in [d["path"] for d in nodes["sequence_logs"]["dependencyKeys"]]
    assert ["sequence_logs"] in [d["path"] for d in nodes["shuffled_batches"]["dependencyKeys"]]
    assert all(nodes[k]["isPartitioned"] for k in ("raw_event_logs", "sequence_logs", "shuffled_batches"))
    checks = {c["name"]: c["blocking"] for c in nodes["sequence_logs"]["assetChecksOrError"]["checks"]}
    assert checks == {"no_future_leakage": True, "length_distribution": False}
    assert all(c["description"] for c in nodes["sequence_logs"]["assetChecksOrError"]["checks"])
    repo = data["repositoriesOrError"]["nodes"][0]
    assert (repo["name"], repo["location"]["name"]) == ("__repository__", "pipelines.definitions")
    assert {"prepare_data", "gem_pipeline"} <= {j["name"] for j in repo["jobs"]}
    # A run of the local runner is listed under its job, as one launched from the UI is.
    assert run_id in {r["runId"] for r in data["pipelineOrError"]["runs"]}
    assert "gem_pipeline_schedule" in {s["name"] for s in repo["schedules"]}


def _until_loaded(request, attempts: int = 60):
    """The webserver answers before the code location has loaded; ask until the assets are there."""
    for _ in range(attempts):
        with urllib.request.urlopen(request, timeout=30) as response:
            payload = json.loads(response.read())
        if payload.get("data", {}).get("assetNodes"):
            return payload["data"]
        time.sleep(1)
    raise AssertionError(f"no asset nodes after {attempts} tries: {payload}")
