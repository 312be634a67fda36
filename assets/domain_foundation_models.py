"""domain_foundation_models: one medium model per domain, learning from GEM (the middle of the hierarchy)."""

import dagster as dg
from pydantic import Field

from assets.metadata_values import metadata_value
from assets.partitions import daily_partitions
from assets.resources import LakeResource, MLflowResource
from assets.sequence_logs import sequence_logs_path
from assets.student_training import StudentTrainingConfig
from assets.teacher_predictions import predictions_path, teacher_predictions
from gem_ops.data.loader import SequenceLogs
from gem_ops.metadata_views import models_quality_table
from gem_ops.transfer.config import FM_DISTILLATION_WEIGHT, TransferWindows
from gem_ops.transfer.domain_models import DomainModelSettings, domain_foundation_model
from gem_ops.transfer.hierarchy import DomainData
from gem_ops.transfer.knowledge import read_predictions
from gem_ops.transfer.registry import load_model_version
from gem_ops.transfer.student import Teacher
from gem_ops.transfer.user_representations import read_user_representations


class DomainFoundationModelsConfig(StudentTrainingConfig):
    preset: str = "domain_fm"
    distillation_weight: float = Field(FM_DISTILLATION_WEIGHT, description="Weight of the loss on GEM's targets "
                                       "against the labels'; a domain FM learns from every day of its domain.")
    registered_model_prefix: str = Field("domain_fm", description="Each domain's model registers as <prefix>_<domain>.")
    teacher_gate: bool = Field(True, description="A domain's vertical models learn from GEM instead of the domain's "
                               "FM where the FM does not rank the FM's held-out day better than GEM (AUC).")


def fm_predictions_path(lake: LakeResource, day: str, domain: str):
    return lake.path("domain_foundation_models", day, f"{domain}.parquet")


@dg.asset(partitions_def=daily_partitions, deps=[teacher_predictions], group_name="transfer",
          kinds={"pytorch", "mlflow"})
def domain_foundation_models(context: dg.AssetExecutionContext, config: DomainFoundationModelsConfig,
                             lake: LakeResource, mlflow: MLflowResource):
    """Per domain: a domain FM trained on the domain's days (teacher_predictions' domain_fm_days) with GEM's
    knowledge (distillation through a Student Adapter, representation transfer, shared tables), registered in
    MLflow; it then scores its domain's examples for the vertical models below it."""
    day = context.partition_key
    logs = SequenceLogs(sequence_logs_path(lake, day))
    gem_predictions = read_predictions(predictions_path(lake, day))
    client = mlflow.get_client()
    identity = gem_predictions.teacher
    gem = Teacher(load_model_version(client, identity["name"], identity["version"]), gem_predictions, identity,
                  read_user_representations(identity["representations"]))
    window = TransferWindows.of_teacher(identity)
    settings = DomainModelSettings(**config.student_settings(), prefix=config.registered_model_prefix,
                                   teacher_gate=config.teacher_gate)
    summary, skipped, reports = {}, {}, {}
    with lake.partition_lock(context), mlflow.asset_run(context) as run:
        run.log_params(config.model_dump())
        for domain in config.selected(logs.surfaces):
            data = DomainData.of(logs, domain, window)
            reason = data.shortfall(logs, settings.shuffling.rank_batch_size)
            if reason is not None:
                skipped[domain] = reason
                fm_predictions_path(lake, day, domain).unlink(missing_ok=True)  # no stale FM teaches its verticals
                context.log.warning(f"skipped {reason}")
                continue
            fm = domain_foundation_model(client, run, logs, data, gem, settings,
                                         lake.path("domain_foundation_models", day, domain, "work"),
                                         fm_predictions_path(lake, day, domain), day)
            summary[domain] = fm.summary()
            reports[f"{fm.name} v{fm.version}"] = fm.report
            context.log.info(f"{fm.name} v{fm.version}: {summary[domain]}")
        if skipped:
            run.set_tags({f"skipped.{d}": r for d, r in skipped.items()})
    return dg.MaterializeResult(metadata={"models": dg.MetadataValue.json(summary),
                                          "skipped": dg.MetadataValue.json(skipped),
                                          "quality": metadata_value(models_quality_table(reports)),
                                          "teacher_version": identity["version"]})
