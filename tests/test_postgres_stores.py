"""Both stores on a real PostgreSQL server that the test starts (Debian's postgresql package; skipped, naming
it, where it is not installed): `python -m pipelines.run_local` runs the whole gem_pipeline job (data, GEM
trained through torchrun and registered, teacher predictions, a domain foundation model and a vertical) on
tiny settings, with the Dagster instance configured by pipelines/configs/dagster-postgres.yaml alone and
MLFLOW_TRACKING_URI a postgresql:// URI. Then everything is read back from PostgreSQL itself, and no SQLite
file was written. About a minute on 2 cores."""

import os
import pwd
import shutil
import subprocess
import sys
import time
from pathlib import Path
from unittest import mock

import dagster as dg
import pytest
import yaml
from mlflow.tracking import MlflowClient

from tests.postgres_server import INSTALL_HINT, running_postgres, server_bin_dir, unprivileged_user

pytestmark = pytest.mark.server

PROJECT_ROOT = Path(__file__).resolve().parents[1]
END, DAYS = "2026-11-03", 2
# The smallest models and budgets that still run every asset; no validation day, so no early stopping.
_SMALL = {"eval_every": 0, "eval_max_examples": 256, "validation_days": 0, "early_stopping_patience": 0,
          "calibrate": False, "model_overrides": {"sequence.max_history_len": "16"}}
_STUDENT = {**_SMALL, "max_steps": 3, "sub_batch_size": 32, "sub_batches_per_rank": 1, "domains": ["feed"]}
RUN_CONFIG = {"ops": {
    "raw_event_logs": {"config": {"synthetic_users": 300}},
    "sequence_logs": {"config": {"lookback_days": DAYS, "max_history_len": 32}},
    "shuffled_batches": {"config": {"world_sizes": [1], "sub_batches_per_rank": 1, "sub_batch_size": 32}},
    "gem_foundation_model": {"config": {**_SMALL, "preset": "vertical", "width": 0.5, "epochs": 1, "max_steps": 4}},
    "teacher_predictions": {"config": {"student_days": 1}},
    "domain_foundation_models": {"config": _STUDENT},
    "vertical_models": {"config": {**_STUDENT, "compare_alone": False, "promotion_max_examples": 256,
                                   "min_positives": 1}},
    # Where the runs are stored is on trial here, not latency: a loaded machine's p99 must not fail the run, and
    # one champion timed on a few requests stores what every one would.
    "serving_models": {"config": {"latency_budget_ms": 60_000, "models": ["vertical_feed_click"],
                                  "latency_requests": 3}},
}}
JOB_ASSETS = {"raw_event_logs", "sequence_logs", "shuffled_batches", "gem_foundation_model", "teacher_predictions",
              "domain_foundation_models", "vertical_models", "serving_models"}
REGISTERED = {"gem_foundation_model", "domain_fm_feed", "vertical_feed_click"}


@pytest.fixture(scope="module")
def postgres():
    bin_dir = server_bin_dir()
    if bin_dir is None:
        pytest.skip(f"no PostgreSQL server (initdb, postgres) on PATH or under /usr/lib/postgresql/*/bin: "
                    f"{INSTALL_HINT}")
    user = unprivileged_user()
    if user and not _user_exists(user):
        pytest.skip(f"running as root, and PostgreSQL will not: no `{user}` user to run it as ({INSTALL_HINT})")
    with running_postgres(bin_dir) as server:
        yield server


@pytest.fixture(scope="module")
def full_run(postgres, tmp_path_factory):
    root = tmp_path_factory.mktemp("postgres_stores")
    home, artifacts = root / "dagster", root / "mlflow" / "artifacts"
    home.mkdir()
    shutil.copy(PROJECT_ROOT / "pipelines" / "configs" / "dagster-postgres.yaml", home / "dagster.yaml")
    config = root / "run_config.yaml"
    config.write_text(yaml.safe_dump(RUN_CONFIG))
    project_store = PROJECT_ROOT / "mlflow" / "mlflow.db"
    project_store_before = project_store.stat().st_mtime_ns if project_store.exists() else None
    dagster_url, mlflow_url = postgres.create_database("dagster"), postgres.create_database("mlflow")
    env = {**os.environ, "DAGSTER_HOME": str(home), "DAGSTER_POSTGRES_URL": dagster_url,
           "MLFLOW_TRACKING_URI": mlflow_url, "GEM_MLFLOW_ARTIFACT_ROOT": str(artifacts),
           "GEM_LAKE_DIR": str(root / "lake"), "PYTHONPATH": str(PROJECT_ROOT)}
    began = time.monotonic()
    # From the temporary folder, so a store MLflow or Dagster opened relative to the working directory
    # (./mlruns, a .db) would show up there.
    done = subprocess.run([sys.executable, "-m", "pipelines.run_local", "--config", str(config), "--days", str(DAYS),
                           "--end", END], cwd=root, env=env, capture_output=True, text=True, timeout=500)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    print(f"run_local on PostgreSQL: {time.monotonic() - began:.0f} s")
    project_store_after = project_store.stat().st_mtime_ns if project_store.exists() else None
    return {"root": root, "home": home, "artifacts": artifacts, "dagster_url": dagster_url, "mlflow_url": mlflow_url,
            "postgres": postgres, "project_store_untouched": project_store_before == project_store_after}


def _query(postgres, database: str, sql: str) -> list[tuple]:
    connection = postgres.connect(database)
    try:
        with connection.cursor() as cursor:
            cursor.execute(sql)
            return cursor.fetchall()
    finally:
        connection.close()


def test_the_dagster_runs_and_their_events_are_in_postgres(full_run):
    with mock.patch.dict(os.environ, {"DAGSTER_POSTGRES_URL": full_run["dagster_url"]}):
        with dg.DagsterInstance.from_config(str(full_run["home"])) as instance:
            assert type(instance.run_storage).__name__ == "PostgresRunStorage"
            runs = instance.get_runs()
            assert len(runs) == DAYS and {run.job_name for run in runs} == {"gem_pipeline"}
            assert {run.status for run in runs} == {dg.DagsterRunStatus.SUCCESS}
            gem = instance.get_latest_materialization_event(dg.AssetKey("gem_foundation_model"))
            assert gem.run_id == runs[0].run_id and gem.asset_materialization.partition == END

    postgres = full_run["postgres"]
    assert _query(postgres, "dagster", "SELECT status, count(*) FROM runs GROUP BY status") == [("SUCCESS", DAYS)]
    materialized = _query(postgres, "dagster", "SELECT DISTINCT asset_key FROM event_logs "
                                               "WHERE dagster_event_type = 'ASSET_MATERIALIZATION'")
    assert {dg.AssetKey.from_db_string(key).to_user_string() for (key,) in materialized} == JOB_ASSETS
    ((events,),) = _query(postgres, "dagster", "SELECT count(*) FROM event_logs")
    assert events > 100  # the step and log events too
    # The training job gets the MLflow URI (which may hold a password) in its environment, not in the command
    # line that the run's log keeps.
    leaked = _query(postgres, "dagster",
                    f"SELECT count(*) FROM event_logs WHERE event LIKE '%{full_run['mlflow_url']}%'")
    assert leaked == [(0,)]


def test_the_mlflow_runs_metrics_and_registered_models_are_in_postgres(full_run):
    client = MlflowClient(full_run["mlflow_url"])
    experiment = client.get_experiment_by_name("gem")
    runs = client.search_runs([experiment.experiment_id], max_results=1000)
    assert {run.data.tags.get("dagster.asset_key") for run in runs} >= JOB_ASSETS
    assert all(run.info.status == "FINISHED" for run in runs)
    (gem_run,) = [run for run in runs if run.data.tags.get("dagster.asset_key") == "gem_foundation_model"]
    assert gem_run.data.metrics and client.get_metric_history(gem_run.info.run_id, "train.loss")

    versions = {model.name: client.get_registered_model(model.name).latest_versions
                for model in client.search_registered_models()}
    # GEM, the feed domain FM and a vertical per feed objective with labels (click at least).
    assert REGISTERED <= set(versions) and all(versions.values())
    assert all(name in REGISTERED or name.startswith("vertical_feed_") for name in versions), set(versions)
    gem_version = client.get_model_version("gem_foundation_model", "1")
    assert gem_version.run_id == gem_run.info.run_id

    # The stored rows themselves, and the artifacts in the configured folder (every experiment, MLflow's
    # Default one included, the same as on SQLite).
    postgres = full_run["postgres"]
    ((metrics,),) = _query(postgres, "mlflow", "SELECT count(*) FROM metrics")
    assert metrics > 10
    stored = _query(postgres, "mlflow", "SELECT name, version FROM model_versions")
    assert {name for name, _ in stored} == set(versions)
    artifacts = full_run["artifacts"].as_uri()
    assert all(e.artifact_location.startswith(artifacts) for e in client.search_experiments())
    assert gem_version.source.startswith(artifacts)  # teacher_predictions loaded GEM back from there
    assert list(full_run["artifacts"].rglob("model_state.pt"))


def test_no_sqlite_store_was_written(full_run):
    written = [path for path in full_run["root"].rglob("*") if path.is_file() and _is_sqlite(path)]
    assert written == [] and not (full_run["root"] / "mlruns").exists()
    assert not list(full_run["home"].rglob("*.db"))
    assert full_run["project_store_untouched"], "the project's mlflow/mlflow.db was written"


def _user_exists(name: str) -> bool:
    try:
        pwd.getpwnam(name)
    except KeyError:
        return False
    return True


def _is_sqlite(path: Path) -> bool:
    with open(path, "rb") as file:
        return file.read(16) == b"SQLite format 3\x00"
