"""Resources the assets share: MLflow tracking and the local data lake."""

import contextlib
import fcntl
import os
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path

import dagster as dg
from mlflow.tracking import MlflowClient
from pydantic import Field

from gem_ops import tracking
from gem_ops.tracking import RunGroup, RunTracker

DAGSTER_RUN_ID_TAG = "dagster.run_id"


def _asset_label(context: dg.AssetExecutionContext) -> str:
    # A multi-asset step may materialize several keys at once.
    return ",".join(sorted(key.to_user_string() for key in context.selected_asset_keys))


def parent_run_name(job_name: str, context: dg.AssetExecutionContext, run_id: str) -> str:
    """What a person looks for: the job (or "materialize" for a selection launched from the UI), the
    partition, then the Dagster run's short id, e.g. 'gem_pipeline 2026-11-14 · 6afbb032'."""
    job = "materialize" if job_name.startswith("__") else job_name  # __ASSET_JOB, __ephemeral_asset_job__
    if context.has_partition_key:
        job += f" {context.partition_key}"
    elif context.has_partition_key_range:
        job += f" {context.partition_key_range.start}...{context.partition_key_range.end}"
    return f"{job} · {run_id[:8]}"


class MLflowResource(dg.ConfigurableResource):
    """MLflow tracking: one run per asset materialization, nested under one run per Dagster run."""

    tracking_uri: str = Field(
        default_factory=tracking.default_tracking_uri,
        description="MLflow store or server; MLFLOW_TRACKING_URI or the project's SQLite store.",
    )
    experiment_name: str = "gem"
    artifact_location: str | None = Field(
        default=None,
        description="Artifact location of a new experiment. None: the project's mlflow/artifacts "
        "for a local store, the server's own root for a tracking server.",
    )
    ui_url: str | None = Field(
        default=None, description="MLflow UI base URL, for the run links in Dagster's metadata. None: MLFLOW_UI_URL, "
        "else a tracking server's own URL, else http://127.0.0.1:5000 (what `make mlflow-ui` serves).")

    def get_client(self) -> MlflowClient:
        return tracking.tracking_client(self.tracking_uri)

    def job_env(self) -> dict[str, str]:
        """The environment that points a training job at this store. Not a command-line flag: a database URI
        may hold a password, which the logged command line and the process list would show."""
        return {"MLFLOW_TRACKING_URI": self.tracking_uri}

    def experiment_id(self, client: MlflowClient | None = None) -> str:
        location = self.artifact_location
        if location is None and tracking.is_local_store(self.tracking_uri):
            location = tracking.default_artifact_location()
        return tracking.ensure_experiment(client or self.get_client(), self.experiment_name, location)

    @property
    def link_base(self) -> str:
        return self.ui_url or tracking.default_ui_url(self.tracking_uri)

    def run_url(self, run_id: str) -> str:
        experiment_id = self.get_client().get_run(run_id).info.experiment_id
        return tracking.run_url(self.link_base, experiment_id, run_id)

    @contextlib.contextmanager
    def asset_run(
        self, context: dg.AssetExecutionContext, run_name: str | None = None
    ) -> Iterator[RunTracker]:
        """`with mlflow.asset_run(context) as run:` inside an asset body.

        The run ends FINISHED, or FAILED when the body raises (the error goes on); off rank 0
        nothing is created and the tracker does nothing.
        """
        if not tracking.is_logging_rank():
            yield RunTracker.disabled()
            return

        client = self.get_client()
        dagster_run = context.run
        source = tracking.source_tags()
        group = RunGroup(
            client,
            self.experiment_id(client),
            key_tag=DAGSTER_RUN_ID_TAG,
            key=dagster_run.run_id,
            parent_name=parent_run_name(dagster_run.job_name, context, dagster_run.run_id),
            parent_tags={"dagster.job_name": dagster_run.job_name, **source},
        )
        asset_label = _asset_label(context)
        tags = {"dagster.job_name": dagster_run.job_name, "dagster.asset_key": asset_label, **source}
        name = run_name or asset_label
        if context.has_partition_key:
            tags["dagster.partition_key"] = context.partition_key
            name = run_name or f"{asset_label} [{context.partition_key}]"
        elif context.has_partition_key_range:  # a backfill that runs many partitions in one step
            keys = context.partition_key_range
            tags["dagster.partition_key_range"] = f"{keys.start}...{keys.end}"
            name = run_name or f"{asset_label} [{keys.start}...{keys.end}]"

        run = group.start_child(name, tags)
        url = tracking.run_url(self.link_base, group.experiment_id, run.run_id)
        context.log.info(f"MLflow run {run.run_id}: {url}")
        if len(context.selected_asset_keys) == 1:
            context.add_asset_metadata({"mlflow_run_id": run.run_id, "mlflow_run": dg.MetadataValue.url(url)})
        try:
            yield run
        except BaseException:
            group.end_child(run.run_id, failed=True)
            raise
        group.end_child(run.run_id, failed=False)


def _default_lake_dir() -> str:
    return os.environ.get("GEM_LAKE_DIR") or str(tracking.PROJECT_ROOT / "lake")


class LakeResource(dg.ConfigurableResource):
    """The folder that holds the pipeline's data files (GEM_LAKE_DIR, else <project>/lake)."""

    base_dir: str = Field(default_factory=_default_lake_dir)

    def path(self, *parts: str) -> Path:
        """A path under the lake; its parent folders exist."""
        path = Path(self.base_dir).joinpath(*parts)
        path.parent.mkdir(parents=True, exist_ok=True)
        return path

    @contextlib.contextmanager
    def partition_lock(self, context: dg.AssetExecutionContext) -> Iterator[None]:
        """One materialization of an asset's partition at a time: a second one fails at once, naming the run
        that holds the partition, rather than mixing their files. The OS drops the lock with its process, so
        a killed run never leaves it behind (and the processes it starts do not inherit it)."""
        if not context.has_partition_key:
            yield
            return
        asset, key = _asset_label(context), context.partition_key
        with open(self.path(".locks", asset.replace("/", "__"), f"{key}.lock"), "a+") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                lock.seek(0)
                raise dg.Failure(description=f"{asset} [{key}] is being materialized by another run "
                                             f"({lock.read().strip() or 'unknown'}): wait for it or cancel it, "
                                             "then materialize again") from None
            lock.seek(0)
            lock.truncate()
            lock.write(f"Dagster run {context.run_id}, pid {os.getpid()}, since "
                       f"{datetime.now(timezone.utc).isoformat(timespec='seconds')}")
            lock.flush()
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)
