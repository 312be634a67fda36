"""MLflow tracking for the library: where the store lives, the code's git state, and run handles.

Everything talks to MLflow through `MlflowClient` with explicit run ids (never the fluent
`mlflow.start_run` global), so parallel steps and worker processes cannot log into each other's runs.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import math
import os
import subprocess
import tempfile
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

# Artifact transfers draw progress bars into pipeline logs, where nobody watches them move; set it to
# true to have them back.
os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
# The store's one-time table set-up and the model packaging's routine steps are announced at INFO in every
# pipeline log; only their warnings matter.
for _notice in ("mlflow.store.db.utils", "alembic.runtime.migration", "mlflow.pyfunc"):
    logging.getLogger(_notice).setLevel(logging.WARNING)

try:
    from mlflow.entities import Metric, Param, RunStatus, RunTag
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient
    from mlflow.utils.mlflow_tags import MLFLOW_GIT_COMMIT, MLFLOW_PARENT_RUN_ID
except ImportError:  # a training worker on a machine without MLflow: it can only log nothing
    MlflowClient = MlflowException = None
    MLFLOW_GIT_COMMIT, MLFLOW_PARENT_RUN_ID = "mlflow.source.git.commit", "mlflow.parentRunId"

PROJECT_ROOT = Path(__file__).resolve().parents[1]
TRACKING_DIR = PROJECT_ROOT / "mlflow"

# Our own tags (MLflow has no standard ones for these).
GIT_DIRTY_TAG = "gem.git.dirty"
# "parent": one per pipeline run; "step": one per step, nested under it; "model": one per model a step trains
RUN_ROLE_TAG = "gem.run_role"
FAILED_STEP_TAG = "gem.failed_step"  # set on a parent once any of its steps failed; never cleared
# MLflow 3's UI opens an experiment in its GenAI (traces) view unless told it holds model training.
EXPERIMENT_TAGS = {"mlflow.experimentKind": "custom_model_development"}


def default_tracking_uri() -> str:
    """MLFLOW_TRACKING_URI when set, else the project's SQLite store."""
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{TRACKING_DIR / 'mlflow.db'}"


def default_ui_url(tracking_uri: str | None = None) -> str:
    """Where people open the runs: MLFLOW_UI_URL, else a tracking server's own URL, else the local UI that
    `make mlflow-ui` starts on the project's store."""
    tracking_uri = tracking_uri or default_tracking_uri()
    if os.environ.get("MLFLOW_UI_URL"):
        return os.environ["MLFLOW_UI_URL"].rstrip("/")
    if tracking_uri.startswith(("http://", "https://")):
        return tracking_uri.rstrip("/")
    return "http://127.0.0.1:5000"


def default_artifact_location() -> str:
    """Where a database store's new experiments keep their artifacts, as a URI: GEM_MLFLOW_ARTIFACT_ROOT (a
    folder or a URI; mlflow/server.py reads the same variable), else the project's mlflow/artifacts folder."""
    root = os.environ.get("GEM_MLFLOW_ARTIFACT_ROOT") or str(TRACKING_DIR / "artifacts")
    if urlparse(root).scheme not in ("", "file"):
        return root  # s3://, gs://, ...: as it is
    return Path(root.removeprefix("file://")).resolve().as_uri()


def is_local_store(tracking_uri: str) -> bool:
    """True for a store this process writes itself (a database), False for a tracking server."""
    return not tracking_uri.startswith(("http://", "https://", "databricks"))


# The SQLAlchemy dialects MLflow stores runs in; a URI may name a driver too (postgresql+psycopg2://).
DATABASE_SCHEMES = ("sqlite", "postgresql", "mysql", "mssql")


def is_database_uri(tracking_uri: str) -> bool:
    """True for a database MLflow writes through SQLAlchemy: SQLite, or a PostgreSQL (MySQL, MSSQL) server."""
    return tracking_uri.split(":", 1)[0].split("+", 1)[0].lower() in DATABASE_SCHEMES


def is_logging_rank() -> bool:
    """Only rank 0 of a distributed job logs; a process outside torchrun has no RANK and logs."""
    return os.environ.get("RANK") in (None, "0")


def _git(repo_dir: Path, *args: str) -> str | None:
    try:
        done = subprocess.run(
            # --no-optional-locks: a status query must not rewrite the index of a shared checkout.
            ["git", "--no-optional-locks", *args],
            cwd=repo_dir, capture_output=True, text=True, timeout=10, check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip()


def git_commit(repo_dir: str | os.PathLike | None = None) -> str | None:
    """The checked-out commit of the project (or `repo_dir`); None outside a repo or before a commit."""
    return _git(Path(repo_dir or PROJECT_ROOT), "rev-parse", "--verify", "HEAD") or None


def git_is_dirty(repo_dir: str | os.PathLike | None = None) -> bool | None:
    """Whether tracked or untracked (not ignored) files differ from the commit; None outside a repo."""
    status = _git(Path(repo_dir or PROJECT_ROOT), "status", "--porcelain")
    return None if status is None else bool(status)


def source_tags(repo_dir: str | os.PathLike | None = None) -> dict[str, str]:
    """Tags that tie a run to the code that produced it; empty when the commit is unknown."""
    commit = git_commit(repo_dir)
    if commit is None:
        return {}
    return {MLFLOW_GIT_COMMIT: commit, GIT_DIRTY_TAG: str(git_is_dirty(repo_dir)).lower()}


@functools.cache
def _prepare_database_store(tracking_uri: str) -> None:
    # Parallel step processes may open a fresh database at once, and MLflow creates its tables
    # without a lock (the lock file serializes the processes of one machine); the first one in also
    # gives MLflow's "Default" experiment the project's artifact root (the client alone would use
    # ./mlruns under the working directory). SQLite or PostgreSQL alike.
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    digest = hashlib.sha256(tracking_uri.encode()).hexdigest()[:16]
    with open(Path(tempfile.gettempdir()) / f"gem-mlflow-init-{digest}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        SqlAlchemyStore(tracking_uri, default_artifact_location()).engine.dispose()


CONNECT_TIMEOUT_S = float(os.environ.get("GEM_MLFLOW_CONNECT_TIMEOUT_S", "15"))
_ANSWERED: set[str] = set()  # servers this process has reached


def check_server(tracking_uri: str, timeout_s: float | None = None) -> None:
    """Fails fast, naming the URI and the wait, when an MLflow server does not answer its /health (MLflow's
    client would retry for minutes before its first request gave up)."""
    import requests

    timeout_s = CONNECT_TIMEOUT_S if timeout_s is None else timeout_s
    began, error = time.monotonic(), None
    while time.monotonic() - began < timeout_s:
        try:
            if requests.get(tracking_uri.rstrip("/") + "/health", timeout=min(5.0, timeout_s)).ok:
                _ANSWERED.add(tracking_uri)
                return
        except requests.RequestException as failure:
            error = failure
        time.sleep(0.5)
    raise ConnectionError(f"the MLflow tracking server {tracking_uri} did not answer within {timeout_s:.0f} s "
                          f"({type(error).__name__ if error else 'no healthy answer'}): start it, or point "
                          "MLFLOW_TRACKING_URI (or the mlflow resource's tracking_uri) at one that runs")


def tracking_client(tracking_uri: str | None = None) -> MlflowClient:
    tracking_uri = tracking_uri or default_tracking_uri()
    if is_database_uri(tracking_uri):
        _prepare_database_store(tracking_uri)
    elif tracking_uri.startswith(("http://", "https://")) and tracking_uri not in _ANSWERED:
        check_server(tracking_uri)
    return MlflowClient(tracking_uri=tracking_uri)


def ensure_experiment(client: MlflowClient, name: str, artifact_location: str | None = None) -> str:
    """The id of experiment `name`, created (or restored from deletion) if needed.

    `artifact_location` only applies when the experiment is created: MLflow never moves one.
    """
    experiment = client.get_experiment_by_name(name)
    if experiment is None:
        try:
            return client.create_experiment(name, artifact_location=artifact_location, tags=EXPERIMENT_TAGS)
        except MlflowException as error:
            if error.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
            experiment = client.get_experiment_by_name(name)  # a parallel step created it first
    if experiment.lifecycle_stage == "deleted":
        client.restore_experiment(experiment.experiment_id)
    return experiment.experiment_id


def _now_ms() -> int:
    return int(time.time() * 1000)


def _flatten(params: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    flat = {}
    for key, value in params.items():
        if isinstance(value, Mapping):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


class RunTracker:
    """Logs into one MLflow run. Disabled (every method a no-op) off rank 0 or without a run."""

    def __init__(self, client: MlflowClient | None, run_id: str | None):
        self.enabled = client is not None and run_id is not None and is_logging_rank()
        self.client = client if self.enabled else None
        self.run_id = run_id if self.enabled else None

    @classmethod
    def disabled(cls) -> RunTracker:
        return cls(None, None)

    @classmethod
    def attach(cls, run_id: str | None, tracking_uri: str | None = None) -> RunTracker:
        """For worker processes (e.g. under torchrun) handed the run id that an asset opened."""
        if run_id is None or not is_logging_rank():
            return cls.disabled()
        if MlflowClient is None:
            raise RuntimeError(f"MLflow run {run_id} was given but mlflow is not installed here")
        return cls(tracking_client(tracking_uri), run_id)

    def log_params(self, params: Mapping[str, Any]) -> None:
        """Nested mappings become dotted keys (`model.dim`), so a config dict logs as it is."""
        if self.enabled:
            flat = _flatten(params)
            self.client.log_batch(self.run_id, params=[Param(k, str(v)) for k, v in flat.items()])

    # Undefined figures (NaN: a metric of a group with one class or none) are left out rather than logged:
    # a run holds only what could be measured.
    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        if self.enabled:
            now = _now_ms()
            batch = [Metric(k, float(v), now, step or 0) for k, v in metrics.items() if math.isfinite(v)]
            if batch:
                self.client.log_batch(self.run_id, metrics=batch)

    def log_metrics_by_step(self, rows: Mapping[int, Mapping[str, float]]) -> None:
        """Metrics of many steps in a few batched calls (MLflow takes up to 1000 per call)."""
        if self.enabled:
            now = _now_ms()
            batch = [Metric(k, float(v), now, int(s)) for s, metrics in rows.items() for k, v in metrics.items()
                     if math.isfinite(v)]
            for start in range(0, len(batch), 1000):
                self.client.log_batch(self.run_id, metrics=batch[start : start + 1000])

    def log_metric(self, key: str, value: float, step: int | None = None) -> None:
        self.log_metrics({key: value}, step=step)

    def log_metric_history(
        self, key: str, values: Sequence[float], steps: Iterable[int] | None = None
    ) -> None:
        """A whole curve in a few batched calls (one call per point is slow on a remote server)."""
        if self.enabled:
            now = _now_ms()
            steps = range(len(values)) if steps is None else steps
            batch = [Metric(key, float(v), now, int(s)) for s, v in zip(steps, values, strict=True) if math.isfinite(v)]
            for start in range(0, len(batch), 1000):
                self.client.log_batch(self.run_id, metrics=batch[start : start + 1000])

    @contextlib.contextmanager
    def child(self, run_name: str, tags: Mapping[str, Any] | None = None) -> Iterator[RunTracker]:
        """A run nested under this one (one per model when a step trains several), ended FINISHED, or
        FAILED when the body raises; it inherits this run's Dagster and git tags."""
        if not self.enabled:
            yield RunTracker.disabled()
            return
        parent = self.client.get_run(self.run_id)
        inherited = {k: v for k, v in parent.data.tags.items()
                     if k.startswith(("dagster.", "gem.git", "mlflow.source.git"))}
        run = self.client.create_run(parent.info.experiment_id, run_name=run_name,
                                     tags={**inherited, **{k: str(v) for k, v in (tags or {}).items()},
                                           MLFLOW_PARENT_RUN_ID: self.run_id, RUN_ROLE_TAG: "model"})
        try:
            yield RunTracker(self.client, run.info.run_id)
        except BaseException:
            self.client.set_terminated(run.info.run_id, RunStatus.to_string(RunStatus.FAILED))
            raise
        self.client.set_terminated(run.info.run_id, RunStatus.to_string(RunStatus.FINISHED))

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        if self.enabled:
            self.client.log_batch(self.run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])

    def log_dict(self, obj: Any, artifact_file: str) -> None:
        if self.enabled:
            self.client.log_dict(self.run_id, obj, artifact_file)

    def log_text(self, text: str, artifact_file: str) -> None:
        if self.enabled:
            self.client.log_text(self.run_id, text, artifact_file)

    def log_table(self, data: Mapping[str, Sequence[Any]], artifact_file: str) -> None:
        """Columns by name; shown as a table in the MLflow UI (artifact_file must end in .json)."""
        if self.enabled:
            self.client.log_table(self.run_id, dict(data), artifact_file)

    def log_figure(self, figure: Any, artifact_file: str) -> None:
        if self.enabled:
            self.client.log_figure(self.run_id, figure, artifact_file)

    def log_artifact(self, local_path: str | os.PathLike, artifact_path: str | None = None) -> None:
        if self.enabled:
            self.client.log_artifact(self.run_id, os.fspath(local_path), artifact_path)

    def log_artifacts(self, local_dir: str | os.PathLike, artifact_path: str | None = None) -> None:
        if self.enabled:
            self.client.log_artifacts(self.run_id, os.fspath(local_dir), artifact_path)


@dataclass(frozen=True)
class RunGroup:
    """The MLflow runs of one pipeline run: one parent, and a nested child run per step.

    Steps may run in parallel processes, so the parent is claimed without a lock: whoever finds
    none creates one and looks again; the earliest (start_time, run_id) wins and later duplicates
    are deleted. A child that was opened under a duplicate is moved to the winner when it ends.
    """

    client: MlflowClient
    experiment_id: str
    key_tag: str  # the tag naming the pipeline run, e.g. "dagster.run_id"
    key: str
    parent_name: str | None = None
    parent_tags: Mapping[str, str] = field(default_factory=dict)

    def _parents(self):
        query = f"tags.`{self.key_tag}` = '{self.key}' and tags.`{RUN_ROLE_TAG}` = 'parent'"
        runs = self.client.search_runs([self.experiment_id], query, max_results=1000)
        return sorted(runs, key=lambda run: (run.info.start_time, run.info.run_id))

    def parent_run_id(self, create: bool = True) -> str | None:
        parents = self._parents()
        if not parents and create:
            tags = {**self.parent_tags, self.key_tag: self.key, RUN_ROLE_TAG: "parent"}
            self.client.create_run(self.experiment_id, tags=tags, run_name=self.parent_name)
            parents = self._parents()
        if not parents:
            return None
        winner, *duplicates = parents
        for duplicate in duplicates:
            try:
                self.client.set_terminated(duplicate.info.run_id, "KILLED")
                self.client.delete_run(duplicate.info.run_id)
            except MlflowException:
                pass  # another process deleted it first
        return winner.info.run_id

    def start_child(self, run_name: str, tags: Mapping[str, str]) -> RunTracker:
        parent_id = self.parent_run_id()
        tags = {**tags, self.key_tag: self.key, RUN_ROLE_TAG: "step", MLFLOW_PARENT_RUN_ID: parent_id}
        child = self.client.create_run(self.experiment_id, tags=tags, run_name=run_name)
        self._set_parent_status(parent_id, RunStatus.RUNNING)
        return RunTracker(self.client, child.info.run_id)

    def end_child(self, child_run_id: str, failed: bool) -> None:
        status = RunStatus.FAILED if failed else RunStatus.FINISHED
        self.client.set_terminated(child_run_id, RunStatus.to_string(status))
        parent_id = self.parent_run_id(create=False)
        if parent_id is None:  # the parent was deleted by hand meanwhile
            return
        if self.client.get_run(child_run_id).data.tags.get(MLFLOW_PARENT_RUN_ID) != parent_id:
            self.client.set_tag(child_run_id, MLFLOW_PARENT_RUN_ID, parent_id)
        self._set_parent_status(parent_id, status)

    def _set_parent_status(self, parent_id: str, status: int) -> None:
        # FAILED must survive steps that run in parallel: the failure flag is set before the
        # status is written, and every other writer re-reads the flag after writing, so the last
        # write to land is FAILED whichever order the processes interleave in.
        if status == RunStatus.FAILED:
            self.client.set_tag(parent_id, FAILED_STEP_TAG, "true")
        self._write_status(parent_id, status)
        if status != RunStatus.FAILED and FAILED_STEP_TAG in self.client.get_run(parent_id).data.tags:
            self._write_status(parent_id, RunStatus.FAILED)

    def _write_status(self, run_id: str, status: int) -> None:
        if RunStatus.is_terminated(status):
            self.client.set_terminated(run_id, RunStatus.to_string(status))  # end_time = now
        else:
            self.client.update_run(run_id, status=RunStatus.to_string(status))


def experiment_url(ui_url: str, experiment_id: str) -> str:
    return f"{ui_url.rstrip('/')}/#/experiments/{experiment_id}"


def run_url(ui_url: str, experiment_id: str, run_id: str) -> str:
    return f"{experiment_url(ui_url, experiment_id)}/runs/{run_id}"

