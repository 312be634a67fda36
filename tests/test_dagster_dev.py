"""`dagster dev` really started on the project's workspace.yaml, asked over GraphQL for the asset graph."""

import json
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.servers import free_port, group_processes, start_server, stop_server

PROJECT = Path(__file__).resolve().parents[1]
QUERY = """
{ assetNodes { assetKey { path } groupName isPartitioned
    dependencyKeys { path } assetChecksOrError { ... on AssetChecks { checks { name blocking } } } }
  repositoriesOrError { ... on RepositoryConnection { nodes { name jobs { name } schedules { name } } } } }
"""


@pytest.mark.server
def test_dagster_dev_serves_the_asset_graph(tmp_path):
    port = free_port()
    dagster = str(Path(sys.executable).with_name("dagster"))
    proc = start_server(
        [dagster, "dev", "-w", str(PROJECT / "workspace.yaml"), "-h", "127.0.0.1", "-p", str(port)],
        url=f"http://127.0.0.1:{port}/server_info",
        env={"DAGSTER_HOME": str(tmp_path), "GEM_LAKE_DIR": str(tmp_path / "lake"), "DAGSTER_DISABLE_TELEMETRY": "yes"},
        timeout=120,
    )
    try:
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/graphql",
            data=json.dumps({"query": QUERY}).encode(),
            headers={"Content-Type": "application/json"},
        )
        data = _until_loaded(request)
    finally:
        stop_server(proc)
    assert proc.poll() is not None and not group_processes(proc.pid)

    nodes = {"/".join(n["assetKey"]["path"]): n for n in data["assetNodes"]}
    assert {"raw_event_logs", "sequence_logs", "shuffled_batches"} <= set(nodes)
    assert ["raw_event_logs"] in [d["path"] for d in nodes["sequence_logs"]["dependencyKeys"]]
    assert ["sequence_logs"] in [d["path"] for d in nodes["shuffled_batches"]["dependencyKeys"]]
    assert all(nodes[k]["isPartitioned"] for k in ("raw_event_logs", "sequence_logs", "shuffled_batches"))
    checks = {c["name"]: c["blocking"] for c in nodes["sequence_logs"]["assetChecksOrError"]["checks"]}
    assert checks == {"no_future_leakage": True, "length_distribution": False}
    repo = data["repositoriesOrError"]["nodes"][0]
    assert {"prepare_data", "gem_pipeline"} <= {j["name"] for j in repo["jobs"]}
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
