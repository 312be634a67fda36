"""A backfill of a job over a range of days, launched as its Partitions tab launches one (GraphQL's
launchPartitionBackfill against a real `dagster dev`, whose daemon runs it): the instance's dagster.yaml runs
a backfill's days one at a time in date order, so each day's raw events land before the sequence_logs that
read them in their look-back window, and every day of the range ends materialized. Slow: each day's run
starts a process (about 3 minutes on 2 cores)."""

import json
import signal
import sys
import time
import urllib.request
from pathlib import Path

import dagster as dg
import pytest

from tests.servers import free_port, start_server, stop_server

PROJECT = Path(__file__).resolve().parents[1]
ASSETS = ["raw_event_logs", "sequence_logs", "shuffled_batches"]  # the prepare_data job's
SELECTOR = {"partitionSetName": "prepare_data_partition_set", "repositorySelector": {
    "repositoryName": "__repository__", "repositoryLocationName": "pipelines.definitions"}}
DAYS = ["2026-11-02", "2026-11-03", "2026-11-04"]
RUN_CONFIG = {"ops": {"raw_event_logs": {"config": {"synthetic_users": 200}},
                      "shuffled_batches": {"config": {"world_sizes": [1], "sub_batch_size": 16,
                                                      "sub_batches_per_rank": 1}}}}
LAUNCH = """mutation($params: LaunchBackfillParams!) { launchPartitionBackfill(backfillParams: $params) {
  __typename ... on LaunchBackfillSuccess { backfillId } ... on Error { message } } }"""
STATUS = """query($id: String!) { partitionBackfillOrError(backfillId: $id) {
  ... on PartitionBackfill { status isAssetBackfill } ... on Error { message } } }"""
DONE = {"COMPLETED", "COMPLETED_SUCCESS", "COMPLETED_FAILED", "FAILED", "CANCELED"}


def _graphql(url: str, query: str, variables: dict) -> dict:
    request = urllib.request.Request(f"{url}/graphql",
                                     data=json.dumps({"query": query, "variables": variables}).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        payload = json.loads(response.read())
    assert "errors" not in payload, payload
    return payload["data"]


def _launch(url: str) -> str:
    """The backfill, once the code location has loaded (the webserver answers before it has)."""
    params = {"selector": SELECTOR, "partitionNames": DAYS, "runConfigData": RUN_CONFIG, "title": "data days"}
    for _ in range(60):
        launched = _graphql(url, LAUNCH, {"params": params})["launchPartitionBackfill"]
        if launched["__typename"] == "LaunchBackfillSuccess":
            return launched["backfillId"]
        time.sleep(2)
    raise AssertionError(f"the backfill was not launched: {launched}")


def _until_done(url: str, backfill: str, timeout: float = 420.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = _graphql(url, STATUS, {"id": backfill})["partitionBackfillOrError"]
        if state.get("status") in DONE:
            return state
        time.sleep(3)
    raise AssertionError(f"backfill {backfill} still {state} after {timeout:.0f} s")


def _materialized_at(instance: dg.DagsterInstance, asset: str, day: str) -> float:
    [record] = instance.fetch_materializations(dg.AssetRecordsFilter(dg.AssetKey(asset), asset_partitions=[day]),
                                               limit=1).records
    return record.event_log_entry.timestamp


@pytest.mark.slow
@pytest.mark.server
def test_a_backfill_over_days_lands_the_data_days_before_what_reads_them(tmp_path):
    from tests.local_runs import local_gem_pipeline, run_local
    from assets.resources import MLflowResource

    (tmp_path / "dagster.yaml").write_text((PROJECT / "pipelines" / "configs" / "dagster.yaml").read_text())
    tracking = f"sqlite:///{tmp_path / 'mlflow.db'}"
    # The day before the range, as an earlier run left it: the first day's look-back reads it.
    job = local_gem_pipeline(tmp_path / "lake", MLflowResource(tracking_uri=tracking))
    with dg.DagsterInstance.from_config(str(tmp_path)) as instance:
        run_local(job, instance, "2026-11-01", ["raw_event_logs"],
                  {"ops": {"raw_event_logs": RUN_CONFIG["ops"]["raw_event_logs"]}})

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {"DAGSTER_HOME": str(tmp_path), "GEM_LAKE_DIR": str(tmp_path / "lake"), "MLFLOW_TRACKING_URI": tracking}
    proc = start_server([str(Path(sys.executable).with_name("dagster")), "dev", "-w", str(PROJECT / "workspace.yaml"),
                         "-h", "127.0.0.1", "-p", str(port)], f"{url}/server_info", env=env, timeout=180)
    try:
        state = _until_done(url, _launch(url))
    finally:
        stop_server(proc, timeout=30, first=signal.SIGINT)
    assert state["status"] in ("COMPLETED", "COMPLETED_SUCCESS"), state

    with dg.DagsterInstance.from_config(str(tmp_path)) as instance:
        for i, day in enumerate(DAYS):
            read = ["2026-11-01", *DAYS[: i + 1]]  # the look-back days this day's sequence_logs reads
            assert max(_materialized_at(instance, "raw_event_logs", d) for d in read) \
                < _materialized_at(instance, "sequence_logs", day) < _materialized_at(instance, "shuffled_batches", day)
        runs = instance.get_runs(dg.RunsFilter(tags={"dagster/backfill": instance.get_backfills()[0].backfill_id}))
        # One run per day, each after the day before had ended.
        assert sorted(r.tags["dagster/partition"] for r in runs) == DAYS
        assert all(r.status == dg.DagsterRunStatus.SUCCESS for r in runs)
        spans = sorted((instance.get_run_record_by_id(r.run_id).start_time,
                        instance.get_run_record_by_id(r.run_id).end_time)
                       for r in runs)
        assert all(ended <= started for (_, ended), (started, _) in zip(spans, spans[1:])), spans
