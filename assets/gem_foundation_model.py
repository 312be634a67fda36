"""gem_foundation_model: GEM pretrained on a day's shuffled_batches plan, as a torchrun job that Dagster
Pipes launches and listens to (progress lines in the run log, final figures as metadata)."""

import dagster as dg
from pydantic import Field

from assets.model_training import TorchrunJobConfig
from assets.partitions import daily_partitions
from assets.resources import LakeResource, MLflowResource
from assets.sequence_logs import sequence_logs_path
from assets.shuffled_batches import shuffled_batches
from gem_ops.data.loader import SequenceLogs
from gem_ops.train.batches import plan_for_world_size
from gem_ops.train.checkpoint import previous_checkpoint
from gem_ops.train.data_check import training_data_problem
from gem_ops.train.warm_start import warm_start_conflict


class GEMTrainingConfig(TorchrunJobConfig):
    warm_start: bool = Field(True, description="Start from the latest earlier partition's checkpoint, if any.")
    registered_model_name: str = "gem_foundation_model"


def runs_dir(lake: LakeResource):
    return lake.path("gem_foundation_model")


def checkpoint_dir(lake: LakeResource, day: str, dagster_run_id: str):
    """One folder per materialization: a new run trains afresh; only a retry within the run resumes."""
    return runs_dir(lake) / day / "runs" / dagster_run_id / "checkpoints"


def how_it_trains(instance: dg.DagsterInstance, day: str, warm, enabled: bool) -> str:
    """One line for the run log and the metadata: where GEM starts from and what this materialization replaces
    (a second run of the same day retrains it and registers a new version; the earlier versions stay)."""
    start = (f"warm-starts from {warm}" if warm is not None else
             "starts from its initialization (warm_start is off)" if not enabled else
             "starts from its initialization: no earlier day has a checkpoint")
    earlier = instance.fetch_materializations(
        dg.AssetRecordsFilter(dg.AssetKey("gem_foundation_model"), asset_partitions=[day]), limit=1).records
    if not earlier:
        return f"GEM {start}; the first GEM of {day}."
    return (f"GEM {start}; it retrains {day}, materialized before by run "
            f"{earlier[0].event_log_entry.run_id[:8]}, and registers a new version (the earlier ones stay registered).")


def training_command(config: GEMTrainingConfig, lake: LakeResource, day: str, run_id: str | None,
                     warm, dagster_run_id: str) -> list[str]:
    extra = ["--checkpoint-dir", str(checkpoint_dir(lake, day, dagster_run_id)), "--progress-every", "25",
             "--registered-model-name", config.registered_model_name]
    if run_id is not None:
        extra += ["--mlflow-run-id", run_id]
    if warm is not None:
        extra += ["--warm-start", str(warm)]
    return config.torchrun_command(sequence_logs_path(lake, day), lake.path("shuffled_batches", day), extra)


@dg.asset(partitions_def=daily_partitions, deps=[shuffled_batches], group_name="training", kinds={"pytorch", "mlflow"})
def gem_foundation_model(
    context: dg.AssetExecutionContext,
    config: GEMTrainingConfig,
    lake: LakeResource,
    mlflow: MLflowResource,
    pipes_subprocess_client: dg.PipesSubprocessClient,
):
    """Trains GEM with torchrun (embeddings sharded by TorchRec, dense layers under FSDP2), evaluates per
    domain and task, and registers the model in MLflow; rank 0 reports back through Pipes."""
    day = context.partition_key
    warm = previous_checkpoint(runs_dir(lake), day) if config.warm_start else None
    # At once, before torchrun would start (and restart) a job that cannot load its checkpoint or its data.
    conflict = warm_start_conflict(warm, config.model()) if warm is not None else None
    plans = lake.path("shuffled_batches", day)
    problem = conflict or training_data_problem(SequenceLogs(sequence_logs_path(lake, day)),
                                                plan_for_world_size(plans, config.nproc_per_node), config.train())
    if problem is not None:
        raise dg.Failure(description=problem)
    training = how_it_trains(context.instance, day, warm, config.warm_start)
    context.log.info(training)
    with lake.partition_lock(context), mlflow.asset_run(context) as run:
        command = training_command(config, lake, day, run.run_id, warm, context.run_id)
        context.log.info("launching: %s", " ".join(command))
        completed = pipes_subprocess_client.run(command=command, context=context, env=mlflow.job_env())
    reported = completed.get_materialize_result()
    return dg.MaterializeResult(
        metadata={**(reported.metadata or {}), "warm_start": str(warm) if warm else "none", "training": training,
                  "registered_model": config.registered_model_name}
    )
