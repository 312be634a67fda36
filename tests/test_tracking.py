"""MLflow tracking: nested runs per Dagster run, rank-0-only logging, and the server launcher."""

import json
import multiprocessing
import shutil
import subprocess
import sys
import time
import urllib.request

import dagster as dg
import pytest
from matplotlib.figure import Figure
from mlflow.tracking import MlflowClient

from assets.resources import LakeResource, MLflowResource
from gem_ops import tracking
from gem_ops.tracking import RunGroup, RunTracker, ensure_experiment, git_commit, git_is_dirty
from tests.servers import free_port, group_processes, start_server, stop_server


@pytest.fixture(scope="session")
def empty_database(tmp_path_factory):
    # MLflow's schema migrations take seconds: run them once, copy the result per test.
    path = tmp_path_factory.mktemp("template") / "mlflow.db"
    tracking.tracking_client(f"sqlite:///{path}").search_experiments()
    return path


@pytest.fixture
def store(tmp_path, empty_database):
    """A throwaway SQLite store and artifact folder: (tracking_uri, artifact_location)."""
    shutil.copyfile(empty_database, tmp_path / "mlflow.db")
    return f"sqlite:///{tmp_path / 'mlflow.db'}", (tmp_path / "artifacts").as_uri()


@pytest.fixture
def mlflow_resource(store):
    tracking_uri, artifact_location = store
    return MLflowResource(tracking_uri=tracking_uri, artifact_location=artifact_location)


@pytest.fixture
def git_checkout(tmp_path):
    """A one-commit repository standing in for the project checkout (which may have no commit)."""
    repo = tmp_path / "checkout"
    repo.mkdir()
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@example.com"]
    subprocess.run([*git, "init", "-q"], check=True)
    (repo / "model.py").write_text("DIM = 8\n")
    subprocess.run([*git, "add", "model.py"], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "model"], check=True)
    return repo


def _materialize(assets, resource, **kwargs):
    return dg.materialize(
        assets, resources={"mlflow": resource}, instance=dg.DagsterInstance.ephemeral(), **kwargs
    )


def _runs(client: MlflowClient, experiment_name: str = "gem"):
    experiment = client.get_experiment_by_name(experiment_name)
    runs = client.search_runs([experiment.experiment_id])
    parents = [r for r in runs if r.data.tags.get(tracking.RUN_ROLE_TAG) == "parent"]
    children = [r for r in runs if r.data.tags.get(tracking.RUN_ROLE_TAG) == "step"]
    return parents, children


def test_git_state(git_checkout, tmp_path):
    head = subprocess.run(
        ["git", "-C", str(git_checkout), "rev-parse", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    assert git_commit(git_checkout) == head
    assert git_is_dirty(git_checkout) is False
    (git_checkout / "model.py").write_text("DIM = 16\n")
    assert git_is_dirty(git_checkout) is True
    outside = tmp_path / "not_a_repo"
    outside.mkdir()
    assert git_commit(outside) is None and git_is_dirty(outside) is None


def test_assets_log_nested_runs(store, mlflow_resource, git_checkout, monkeypatch):
    monkeypatch.setattr(tracking, "PROJECT_ROOT", git_checkout)

    @dg.asset(key_prefix="gem")
    def tiny_features(context: dg.AssetExecutionContext, mlflow: MLflowResource) -> None:
        with mlflow.asset_run(context) as run:
            run.log_params({"rows": 3, "model": {"dim": 8}})
            run.log_metric_history("loss", [1.0, 0.5, 0.25])
            figure = Figure()
            figure.subplots().plot([1.0, 0.5, 0.25])
            run.log_figure(figure, "plots/loss.png")
            run.log_dict({"rows": 3}, "summary.json")

    @dg.asset(deps=[tiny_features])
    def tiny_model(context: dg.AssetExecutionContext, mlflow: MLflowResource) -> None:
        with mlflow.asset_run(context) as run:
            for step in range(3):
                run.log_metrics({"auc": 0.6 + 0.1 * step}, step=step)

    result = _materialize([tiny_features, tiny_model], mlflow_resource)
    assert result.success

    client = MlflowClient(store[0])
    parents, children = _runs(client)
    assert len(parents) == 1
    parent = parents[0]
    assert parent.data.tags["dagster.run_id"] == result.run_id
    assert parent.info.status == "FINISHED" and parent.info.end_time is not None

    by_key = {child.data.tags["dagster.asset_key"]: child for child in children}
    assert set(by_key) == {"gem/tiny_features", "tiny_model"}
    commit = git_commit(git_checkout)
    for key, child in by_key.items():
        tags = child.data.tags
        assert tags["mlflow.parentRunId"] == parent.info.run_id
        assert tags["dagster.run_id"] == result.run_id
        assert tags["dagster.job_name"] == result.dagster_run.job_name
        assert tags["mlflow.source.git.commit"] == commit
        assert tags[tracking.GIT_DIRTY_TAG] == "false"
        assert "dagster.partition_key" not in tags
        assert child.info.run_name == key
        assert child.info.status == "FINISHED"
        assert child.info.artifact_uri.startswith(store[1])

    features = by_key["gem/tiny_features"]
    assert features.data.params == {"rows": "3", "model.dim": "8"}
    loss = client.get_metric_history(features.info.run_id, "loss")
    assert [(m.step, m.value) for m in sorted(loss, key=lambda m: m.step)] == [
        (0, 1.0), (1, 0.5), (2, 0.25),
    ]
    auc = client.get_metric_history(by_key["tiny_model"].info.run_id, "auc")
    assert [m.value for m in sorted(auc, key=lambda m: m.step)] == pytest.approx([0.6, 0.7, 0.8])
    artifacts = {a.path for a in client.list_artifacts(features.info.run_id)}
    assert artifacts == {"plots", "summary.json"}
    assert [a.path for a in client.list_artifacts(features.info.run_id, "plots")] == ["plots/loss.png"]

    # The Dagster materialization links back to its MLflow run.
    materialization = result.asset_materializations_for_node("tiny_model")[0]
    run = by_key["tiny_model"].info
    assert materialization.metadata["mlflow_run_id"].value == run.run_id
    link = materialization.metadata["mlflow_run"]
    assert isinstance(link, dg.UrlMetadataValue)
    assert link.value == f"http://127.0.0.1:5000/#/experiments/{run.experiment_id}/runs/{run.run_id}"


def test_failing_asset_fails_its_run_and_the_parent(store, mlflow_resource):
    @dg.asset
    def clean_logs(context: dg.AssetExecutionContext, mlflow: MLflowResource) -> None:
        with mlflow.asset_run(context) as run:
            run.log_metric("rows", 10)

    @dg.asset(deps=[clean_logs])
    def broken_model(context: dg.AssetExecutionContext, mlflow: MLflowResource) -> None:
        with mlflow.asset_run(context) as run:
            run.log_metric("loss", float("nan"))
            raise ValueError("diverged")

    result = _materialize([clean_logs, broken_model], mlflow_resource, raise_on_error=False)
    assert not result.success

    parents, children = _runs(MlflowClient(store[0]))
    status = {child.data.tags["dagster.asset_key"]: child.info.status for child in children}
    assert status == {"clean_logs": "FINISHED", "broken_model": "FAILED"}
    assert [parent.info.status for parent in parents] == ["FAILED"]


def test_failed_parent_stays_failed_after_later_steps(store):
    client = tracking.tracking_client(store[0])
    group = RunGroup(client, ensure_experiment(client, "gem", store[1]), "dagster.run_id", "r1")
    parent_status = lambda: client.get_run(group.parent_run_id(create=False)).info.status  # noqa: E731

    first = group.start_child("first", {})
    assert parent_status() == "RUNNING"
    group.end_child(first.run_id, failed=True)
    second = group.start_child("second", {})
    assert parent_status() == "FAILED"
    group.end_child(second.run_id, failed=False)
    assert parent_status() == "FAILED"
    assert client.get_run(second.run_id).info.status == "FINISHED"


def test_undefined_metrics_are_left_out(store):
    """NaN and infinite figures (a metric of a group with one class) never reach the run, in any of the
    tracker's logging calls; the defined ones do."""
    client = tracking.tracking_client(store[0])
    group = RunGroup(client, ensure_experiment(client, "gem", store[1]), "dagster.run_id", "nan-run")
    run = group.start_child("eval", {})
    run.log_metrics({"eval.stories.conversion.auc": float("nan"), "eval.all.click.auc": 0.7, "x": float("inf")})
    run.log_metrics_by_step({1: {"loss": 0.5, "validation.ne": float("nan")}, 2: {"loss": 0.4}})
    run.log_metric_history("curve", [0.3, float("nan"), 0.2])
    group.end_child(run.run_id, failed=False)
    metrics = client.get_run(run.run_id).data.metrics
    assert set(metrics) == {"eval.all.click.auc", "loss", "curve"}
    assert [m.value for m in client.get_metric_history(run.run_id, "curve")] == [0.3, 0.2]
    assert not client.get_metric_history(run.run_id, "validation.ne")


def _run_one_step(tracking_uri: str, barrier, failed: bool) -> None:
    barrier.wait()  # all processes open the fresh store and claim the parent at once
    client = tracking.tracking_client(tracking_uri)
    group = RunGroup(client, ensure_experiment(client, "gem"), "dagster.run_id", "parallel-run")
    run = group.start_child("step", {})
    group.end_child(run.run_id, failed=failed)


def test_parallel_steps_share_one_parent(tmp_path):
    # Like Dagster's multiprocess executor: steps of one run start together in separate processes,
    # here on a store that does not exist yet, so they also race to create its tables.
    tracking_uri = f"sqlite:///{tmp_path / 'fresh.db'}"
    processes = 4
    context = multiprocessing.get_context("fork")
    barrier = context.Barrier(processes)
    workers = [
        context.Process(target=_run_one_step, args=(tracking_uri, barrier, i == 0))
        for i in range(processes)
    ]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(60)
    assert [worker.exitcode for worker in workers] == [0] * processes

    client = MlflowClient(tracking_uri)
    assert len(client.search_experiments(filter_string="name = 'gem'")) == 1
    parents, children = _runs(client)
    assert len(parents) == 1
    assert len(children) == processes
    assert {child.data.tags["mlflow.parentRunId"] for child in children} == {parents[0].info.run_id}
    assert parents[0].info.status == "FAILED"


def test_nothing_is_logged_off_rank_zero(store, mlflow_resource, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    trackers = []

    @dg.asset
    def shard_stats(context: dg.AssetExecutionContext, mlflow: MLflowResource) -> None:
        with mlflow.asset_run(context) as run:
            run.log_params({"shard": 1})
            run.log_metrics({"rows": 5.0}, step=0)
            run.log_dict({"rows": 5}, "stats.json")
            trackers.append(run)

    assert _materialize([shard_stats], mlflow_resource).success
    assert [tracker.enabled for tracker in trackers] == [False]
    assert RunTracker.attach("any-run-id", store[0]).enabled is False

    monkeypatch.delenv("RANK")
    client = MlflowClient(store[0])
    assert client.get_experiment_by_name("gem") is None
    all_experiments = [e.experiment_id for e in client.search_experiments()]
    assert client.search_runs(all_experiments) == []


def test_partitioned_asset_is_tagged_with_its_partition(store, mlflow_resource):
    @dg.asset(partitions_def=dg.StaticPartitionsDefinition(["2026-11-28", "2026-11-29"]))
    def daily_events(context: dg.AssetExecutionContext, mlflow: MLflowResource) -> None:
        with mlflow.asset_run(context) as run:
            run.log_metric("events", 7)

    result = _materialize([daily_events], mlflow_resource, partition_key="2026-11-29")
    assert result.success

    [parent], children = _runs(MlflowClient(store[0]))
    [child] = children
    assert child.data.tags["dagster.partition_key"] == "2026-11-29"
    assert child.data.tags["dagster.asset_key"] == "daily_events"
    assert child.info.run_name == "daily_events [2026-11-29]"
    # The parent is named for the job (a selection of assets: "materialize"), the partition, the run.
    assert parent.info.run_name == f"materialize 2026-11-29 · {result.run_id[:8]}"


def test_lake_paths(tmp_path, monkeypatch):
    lake = LakeResource(base_dir=str(tmp_path / "lake"))
    path = lake.path("sequence_logs", "2026-11-29", "part-0.parquet")
    assert path == tmp_path / "lake" / "sequence_logs" / "2026-11-29" / "part-0.parquet"
    assert path.parent.is_dir()
    monkeypatch.setenv("GEM_LAKE_DIR", str(tmp_path / "elsewhere"))
    assert LakeResource().base_dir == str(tmp_path / "elsewhere")


def test_database_stores_and_their_artifact_root(tmp_path, monkeypatch):
    # Any database MLflow writes itself is prepared alike (tables, the Default experiment's artifact root).
    for uri in ("sqlite:///x.db", "postgresql://u:p@db/mlflow", "postgresql+psycopg2://u@127.0.0.1:5432/m"):
        assert tracking.is_database_uri(uri) and tracking.is_local_store(uri)
    for uri in ("http://127.0.0.1:5000", "https://mlflow.example", "databricks"):
        assert not tracking.is_database_uri(uri)
    monkeypatch.delenv("GEM_MLFLOW_ARTIFACT_ROOT", raising=False)
    assert tracking.default_artifact_location() == (tracking.TRACKING_DIR / "artifacts").as_uri()
    monkeypatch.setenv("GEM_MLFLOW_ARTIFACT_ROOT", str(tmp_path / "shared"))
    assert tracking.default_artifact_location() == (tmp_path / "shared").as_uri()
    monkeypatch.setenv("GEM_MLFLOW_ARTIFACT_ROOT", "s3://bucket/mlflow")
    assert tracking.default_artifact_location() == "s3://bucket/mlflow"


def _get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.load(response)


@pytest.mark.server
def test_server_script_serves_runs_logged_with_and_without_it(tmp_path, empty_database):
    shutil.copyfile(empty_database, tmp_path / "m.db")
    tracking_uri = f"sqlite:///{tmp_path / 'm.db'}"
    artifact_root = tmp_path / "artifacts"

    # Logged straight into the store, as the pipeline does when no server runs.
    offline_client = tracking.tracking_client(tracking_uri)
    experiment_id = ensure_experiment(offline_client, "gem", artifact_root.as_uri())
    offline = RunTracker(offline_client, offline_client.create_run(experiment_id).info.run_id)
    offline.log_dict({"rows": 3}, "summary.json")

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    script = tracking.PROJECT_ROOT / "mlflow" / "server.py"
    command = [
        sys.executable, str(script), "--port", str(port),
        "--backend-store-uri", tracking_uri, "--artifact-root", str(artifact_root),
    ]
    server = start_server(command, f"{url}/health", timeout=60)
    try:
        client = MlflowClient(url)
        run_id = client.create_run(experiment_id, run_name="through-server").info.run_id
        client.log_param(run_id, "lr", "0.01")
        client.log_metric(run_id, "loss", 0.5, step=1)
        client.set_terminated(run_id)

        run = _get_json(f"{url}/api/2.0/mlflow/runs/get?run_id={run_id}")["run"]
        assert run["info"]["status"] == "FINISHED"
        assert run["data"]["params"] == [{"key": "lr", "value": "0.01"}]
        assert [(m["key"], m["value"], m["step"]) for m in run["data"]["metrics"]] == [
            ("loss", 0.5, 1)
        ]

        # The server shows the artifacts of the run it never saw being logged.
        listing = _get_json(f"{url}/api/2.0/mlflow/artifacts/list?run_id={offline.run_id}")
        assert [f["path"] for f in listing["files"]] == ["summary.json"]
        artifact = f"{url}/get-artifact?path=summary.json&run_uuid={offline.run_id}"
        assert _get_json(artifact) == {"rows": 3}

        # An experiment created through the server uses the same folder.
        new_id = client.create_experiment("via-server")
        location = client.get_experiment(new_id).artifact_location
        assert location == f"{artifact_root.as_uri()}/{new_id}"
    finally:
        group = server.pid
        stop_server(server)
    assert server.poll() is not None
    assert group_processes(group) == []


def test_an_unreachable_server_fails_fast_naming_its_uri(monkeypatch):
    uri = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    monkeypatch.setattr(tracking, "CONNECT_TIMEOUT_S", 2.0)
    began = time.monotonic()
    with pytest.raises(ConnectionError, match=rf"MLflow tracking server {uri} did not answer within 2 s"):
        tracking.tracking_client(uri)
    assert time.monotonic() - began < 10
