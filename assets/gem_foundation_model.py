"""gem_foundation_model: GEM pretrained on a day's shuffled_batches plan, as a torchrun job that Dagster
Pipes launches and listens to (progress lines in the run log, final figures as metadata)."""

import dagster as dg
from pydantic import Field

from assets.partitions import daily_partitions
from assets.resources import LakeResource, MLflowResource
from assets.sequence_logs import sequence_logs_path
from assets.model_training import TorchrunJobConfig
from assets.shuffled_batches import shuffled_batches
from gem_ops.train.checkpoint import previous_checkpoint


class GEMTrainingConfig(TorchrunJobConfig):
    warm_start: bool = Field(True, description="Start from the latest earlier partition's checkpoint, if any.")
    registered_model_name: str = "gem_foundation_model"


def runs_dir(lake: LakeResource):
    return lake.path("gem_foundation_model")


def training_command(config: GEMTrainingConfig, lake: LakeResource, day: str, run_id: str | None,
                     tracking_uri: str, warm) -> list[str]:
    extra = ["--checkpoint-dir", str(runs_dir(lake) / day / "checkpoints"), "--progress-every", "25",
             "--registered-model-name", config.registered_model_name, "--mlflow-tracking-uri", tracking_uri]
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
    with mlflow.asset_run(context) as run:
        command = training_command(config, lake, day, run.run_id, mlflow.tracking_uri, warm)
        context.log.info("launching: %s", " ".join(command))
        completed = pipes_subprocess_client.run(command=command, context=context)
    reported = completed.get_materialize_result()
    return dg.MaterializeResult(
        metadata={**(reported.metadata or {}), "warm_start": str(warm) if warm else "none",
                  "registered_model": config.registered_model_name}
    )
