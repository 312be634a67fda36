"""teacher_predictions: GEM scores the students' training and eval examples (knowledge generation)."""

from datetime import date, timedelta

import dagster as dg
from pydantic import Field

from assets.gem_foundation_model import gem_foundation_model
from assets.partitions import daily_partitions
from assets.resources import LakeResource, MLflowResource
from assets.sequence_logs import sequence_logs_path
from gem_ops.data.loader import SequenceLogs
from gem_ops.metrics.quality import flat_metrics
from gem_ops.transfer.config import TransferWindows
from gem_ops.transfer.hierarchy import students_examples
from gem_ops.transfer.knowledge import score_examples, write_predictions
from gem_ops.transfer.registry import lineage_tags, load_model_version, model_identity, version_for_partition
from gem_ops.transfer.student import prediction_report
from gem_ops.transfer.user_representations import (compute_user_representations, representations_path,
                                                   write_user_representations)
from gem_ops.transfer.windows import eval_examples


class TeacherPredictionsConfig(dg.Config):
    registered_model_name: str = "gem_foundation_model"
    staleness_days: int = Field(0, description="Score with the GEM of the partition this many days earlier (a stale "
                                "teacher).")
    student_days: int = Field(3, description="Newest training days the vertical models learn from.")
    domain_fm_days: int | None = Field(None, description="Newest training days the domain FMs learn from (None: every "
                                       "training day; at least student_days). Every student's days and the eval split "
                                       "are scored.")
    batch_size: int = 1024
    log_artifact: bool = Field(True, description="Also store the predictions file in the MLflow run.")


def predictions_path(lake: LakeResource, day: str):
    return lake.path("teacher_predictions", f"{day}.parquet")


@dg.asset(partitions_def=daily_partitions, deps=[gem_foundation_model], group_name="transfer",
          kinds={"pytorch", "mlflow"})
def teacher_predictions(context: dg.AssetExecutionContext, config: TeacherPredictionsConfig, lake: LakeResource,
                        mlflow: MLflowResource):
    """GEM's logits per task of the students' examples, and its candidate-independent representation of
    each (domain, user, day) they fall on (a feature table the students look up), tied to its version."""
    day = context.partition_key
    latest = (date.fromisoformat(day) - timedelta(days=config.staleness_days)).isoformat()
    client = mlflow.get_client()
    version, trained_on = version_for_partition(client, config.registered_model_name, latest)
    representations = representations_path(predictions_path(lake, day))
    teacher = {**model_identity(config.registered_model_name, version, "gem"), "partition": trained_on,
               "student_days": config.student_days, "domain_fm_days": config.domain_fm_days,
               "representations": str(representations)}
    logs = SequenceLogs(sequence_logs_path(lake, day))
    model = load_model_version(client, config.registered_model_name, version)
    indices = students_examples(logs, TransferWindows.of_teacher(teacher))
    with lake.partition_lock(context), mlflow.asset_run(context) as run:
        table = compute_user_representations(model, logs, indices, teacher, config.batch_size)
        write_user_representations(table, representations)
        predictions = score_examples(model, logs, indices, teacher, config.batch_size, representations=table)
        path = write_predictions(predictions, predictions_path(lake, day))
        report = prediction_report(logs, predictions, eval_examples(logs), model.config)
        run.set_tags(lineage_tags("gem", teacher) | {"teacher.partition": trained_on})
        run.log_params(config.model_dump())
        run.log_metrics(flat_metrics(report, "teacher.eval") | {"examples": len(predictions)})
        if config.log_artifact:
            run.log_artifact(path, "teacher_predictions")
            run.log_artifact(representations, "teacher_predictions")
        if run.run_id:  # the model version points back at what it scored
            client.set_model_version_tag(config.registered_model_name, version, f"teacher_predictions.{day}",
                                         run.run_id)
    context.log.info(f"{config.registered_model_name} v{version} (trained on {trained_on}) scored {len(predictions)} "
                     "examples")
    return dg.MaterializeResult(metadata={
        "path": dg.MetadataValue.path(str(path)), "teacher_version": version, "teacher_partition": trained_on,
        "examples": len(predictions), "representation_dim": predictions.representation_dim,
        "user_representations": dg.MetadataValue.path(str(representations)), "user_days": len(table),
        "teacher_eval": dg.MetadataValue.json({g: {m: round(v[m], 4) for m in ("auc", "ne", "calibration")}
                                                for g, v in report.items() if g.startswith("all/")}),
    })
