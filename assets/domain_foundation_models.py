"""domain_foundation_models: one medium model per domain, learning from GEM (the middle of the hierarchy)."""

import dagster as dg
from pydantic import Field

from assets.partitions import daily_partitions
from assets.resources import LakeResource, MLflowResource
from assets.sequence_logs import sequence_logs_path
from assets.student_training import StudentTrainingConfig
from assets.teacher_predictions import predictions_path, teacher_predictions
from gem_ops.data.loader import SequenceLogs
from gem_ops.metrics.quality import flat_metrics
from gem_ops.transfer.config import TransferWindows
from gem_ops.transfer.hierarchy import DomainData, as_teacher, train_domain_foundation_model
from gem_ops.transfer.knowledge import read_predictions, write_predictions
from gem_ops.transfer.registry import lineage_tags, load_model_version, model_identity, register_student
from gem_ops.transfer.student import Teacher


class DomainFoundationModelsConfig(StudentTrainingConfig):
    preset: str = "domain_fm"
    registered_model_prefix: str = Field("domain_fm", description="Each domain's model registers as <prefix>_<domain>.")


def fm_predictions_path(lake: LakeResource, day: str, domain: str):
    return lake.path("domain_foundation_models", day, f"{domain}.parquet")


@dg.asset(partitions_def=daily_partitions, deps=[teacher_predictions], group_name="transfer", kinds={"pytorch", "mlflow"})
def domain_foundation_models(context: dg.AssetExecutionContext, config: DomainFoundationModelsConfig,
                             lake: LakeResource, mlflow: MLflowResource):
    """Per domain: a domain FM trained on the domain's fresh data with GEM's knowledge (distillation through
    a Student Adapter, representation transfer, shared tables), registered in MLflow; it then scores its
    domain's examples for the vertical models below it."""
    day = context.partition_key
    logs = SequenceLogs(sequence_logs_path(lake, day))
    gem_predictions = read_predictions(predictions_path(lake, day))
    client = mlflow.get_client()
    identity = gem_predictions.teacher
    gem = Teacher(load_model_version(client, identity["name"], identity["version"]), gem_predictions, identity)
    window = TransferWindows(student_days=identity["student_days"])
    summary = {}
    with mlflow.asset_run(context) as run:
        run.log_params(config.model_dump())
        for domain in config.selected(logs.surfaces):
            data = DomainData.of(logs, domain, window)
            name = f"{config.registered_model_prefix}_{domain}"
            tags = lineage_tags("direct", identity) | {"domain": domain}
            with run.child(f"{name} [{day}]", tags) as child:
                fm = train_domain_foundation_model(logs, data, config.model(), config.train(),
                                                   lake.path("domain_foundation_models", day, domain, "work"),
                                                   config.transfer(), gem, config.shuffling(), child)
                version = register_student(client, child.run_id, fm.model, fm.data, data.eval, name, tags)
                me = {**model_identity(name, version, "domain_fm"), "teacher": identity,
                      "student_days": identity["student_days"], "domain": domain}
                scored = as_teacher(fm, data, me).predictions
                write_predictions(scored, fm_predictions_path(lake, day, domain))
                if fm.adapter_report:
                    child.log_metrics(flat_metrics(fm.adapter_report["teacher"], "adapter.before")
                                      | flat_metrics(fm.adapter_report["adapted"], "adapter.after"))
            report = fm.result.final_report
            summary[domain] = {"model": name, "version": version, "train_examples": int(data.train.size),
                               **{g: round(report[g]["auc"], 4) for g in report if g.startswith("all/")}}
            context.log.info(f"{name} v{version}: {summary[domain]}")
    return dg.MaterializeResult(metadata={"models": dg.MetadataValue.json(summary), "teacher_version": identity["version"]})
