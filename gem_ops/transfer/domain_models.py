"""One domain's foundation model: trained from GEM on the domain's days (TransferWindows.domain_fm_days),
registered in MLflow with GEM's lineage, then scoring the domain's examples as the teacher of its vertical
models."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from mlflow.tracking import MlflowClient

from gem_ops.data.loader import SequenceLogs
from gem_ops.metrics.quality import flat_metrics
from gem_ops.tracking import RunTracker
from gem_ops.transfer.config import StudentSettings
from gem_ops.transfer.hierarchy import DomainData, as_teacher, train_domain_foundation_model
from gem_ops.transfer.knowledge import write_predictions
from gem_ops.transfer.registry import lineage_tags, model_identity, register_student
from gem_ops.transfer.student import Teacher
from gem_ops.transfer.user_representations import representations_path, write_user_representations


@dataclass(frozen=True)
class DomainModelSettings(StudentSettings):
    prefix: str = "domain_fm"  # registered as <prefix>_<domain>


@dataclass(frozen=True)
class DomainModel:
    name: str
    version: str
    train_examples: int
    report: dict[str, dict[str, float]]  # the final eval report, per domain/task group

    def summary(self) -> dict[str, Any]:
        return {"model": self.name, "version": self.version, "train_examples": self.train_examples,
                **{g: round(self.report[g]["auc"], 4) for g in self.report if g.startswith("all/")}}


def domain_foundation_model(client: MlflowClient, tracker: RunTracker, logs: SequenceLogs, data: DomainData,
                            gem: Teacher, settings: DomainModelSettings, work_dir: str | os.PathLike,
                            predictions_path: str | os.PathLike, run_label: str) -> DomainModel:
    """Trains, registers (in an MLflow run nested under `tracker`'s) and scores one domain's FM; its
    predictions, with its identity and GEM's as their teacher, are written to `predictions_path`, and its
    user representations beside them (`<name>.representations.parquet`)."""
    name = f"{settings.prefix}_{data.domain}"
    tags = lineage_tags("direct", gem.identity) | {"domain": data.domain}
    with tracker.child(f"{data.domain} · {name} [{run_label}]", tags) as child:
        fm = train_domain_foundation_model(logs, data, settings.base, settings.train, work_dir, settings.transfer,
                                           gem, settings.shuffling, child)
        version = register_student(client, child.run_id, fm.model, fm.data, data.eval, name, tags)
        representations = representations_path(predictions_path)
        identity = {**model_identity(name, version, "domain_fm"), "teacher": gem.identity,
                    "student_days": gem.identity["student_days"],
                    "domain_fm_days": gem.identity.get("domain_fm_days"), "domain": data.domain,
                    "representations": str(representations)}
        teacher = as_teacher(fm, data, identity)
        write_user_representations(teacher.representations, representations)
        write_predictions(teacher.predictions, predictions_path)
        if fm.adapter_report:
            child.log_metrics(flat_metrics(fm.adapter_report["teacher"], "adapter.before")
                              | flat_metrics(fm.adapter_report["adapted"], "adapter.after"))
    return DomainModel(name, version, int(data.foundation.size), fm.result.final_report)
