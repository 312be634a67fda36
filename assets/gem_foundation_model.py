"""gem_foundation_model: the GEM foundation model trained on a day's shuffled_batches plan."""

import dagster as dg
import yaml
from pydantic import Field

from assets.partitions import daily_partitions
from assets.resources import LakeResource, MLflowResource
from assets.sequence_logs import sequence_logs_path
from assets.shuffled_batches import plan_path, shuffled_batches
from gem_ops.data.loader import SequenceLogs
from gem_ops.metrics.quality import flat_metrics
from gem_ops.model.config import model_config
from gem_ops.train.config import TrainConfig
from gem_ops.train.run import previous_checkpoint, run_training

PROGRESS_EVERY = 25  # steps between progress lines in the run's log


class GEMTrainingConfig(dg.Config):
    preset: str = Field("gem", description="Model preset: gem, domain_fm or vertical.")
    depth: float = Field(1.0, description="Scales the number of InterFormer blocks.")
    width: float = Field(1.0, description="Scales embedding and hidden widths.")
    model_overrides: dict[str, str] = Field(
        default_factory=dict, description='Dotted model settings, values in YAML, e.g. {"sequence.max_history_len": "256"}.'
    )
    epochs: int = 1
    max_steps: int | None = None
    lr_dense: float = 1e-3
    lr_sparse: float = 0.05
    eval_every: int = 0
    eval_max_examples: int = 20_000
    checkpoint_every: int = 0
    precision: str = "auto"
    warm_start: bool = Field(True, description="Start from the latest earlier partition's checkpoint, if any.")
    registered_model_name: str = "gem_foundation_model"
    seed: int = 0

    def train_config(self) -> TrainConfig:
        return TrainConfig(epochs=self.epochs, max_steps=self.max_steps, lr_dense=self.lr_dense, lr_sparse=self.lr_sparse,
                           eval_every=self.eval_every, eval_max_examples=self.eval_max_examples,
                           checkpoint_every=self.checkpoint_every, precision=self.precision, seed=self.seed)


def runs_dir(lake: LakeResource):
    return lake.path("gem_foundation_model")


@dg.asset(partitions_def=daily_partitions, deps=[shuffled_batches], group_name="training", kinds={"pytorch", "mlflow"})
def gem_foundation_model(
    context: dg.AssetExecutionContext, config: GEMTrainingConfig, lake: LakeResource, mlflow: MLflowResource
):
    """Trains GEM on the world-size-1 plan, evaluates per domain and task, registers the model in MLflow."""
    day = context.partition_key
    overrides = {key: yaml.safe_load(value) for key, value in config.model_overrides.items()}
    model = model_config(config.preset, config.depth, config.width, **overrides)
    logs = SequenceLogs(sequence_logs_path(lake, day))
    warm = previous_checkpoint(runs_dir(lake), day) if config.warm_start else None

    def progress(step: int, loss: float) -> None:
        if (step + 1) % PROGRESS_EVERY == 0:
            context.log.info(f"step {step + 1}: loss {loss:.4f}")
    with mlflow.asset_run(context) as run:
        outcome = run_training(
            logs, plan_path(lake, day, 1), model, config.train_config(),
            checkpoint_dir=runs_dir(lake) / day / "checkpoints", warm_start=warm, tracker=run,
            registered_name=config.registered_model_name, on_step=progress,
        )
        run_id = run.run_id
    result = outcome.result
    context.log.info("trained %d steps at %.0f samples/s; model version %s", result.steps,
                     result.samples_per_second, outcome.model_version)
    return dg.MaterializeResult(
        metadata={
            "steps": result.steps,
            "samples_per_second": dg.MetadataValue.float(result.samples_per_second),
            "final_train_loss": dg.MetadataValue.float(result.losses[-1]),
            "eval": dg.MetadataValue.json(result.final_report),
            **{key: dg.MetadataValue.float(value) for key, value in flat_metrics(result.final_report).items()
               if key.endswith((".auc", ".ne", ".calibration"))},
            "checkpoint": str(result.checkpoint),
            "warm_start": str(warm) if warm else "none",
            "mlflow_run_id": str(run_id),
            "model_version": str(outcome.model_version),
            "registered_model": config.registered_model_name,
        }
    )
