"""One domain's foundation model: trained from GEM on the domain's days (TransferWindows.domain_fm_days),
registered in MLflow with GEM's lineage, then scoring the domain's examples as the teacher of its vertical
models."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any

from mlflow.tracking import MlflowClient

from gem_ops.data.loader import SequenceLogs
from gem_ops.metrics.quality import flat_metrics
from gem_ops.tracking import RunTracker
from gem_ops.transfer.config import StudentSettings
from gem_ops.transfer.hierarchy import DomainData, as_teacher, choose_domain_teacher, train_domain_foundation_model
from gem_ops.transfer.knowledge import write_predictions
from gem_ops.transfer.registry import lineage_tags, model_identity, register_student
from gem_ops.transfer.student import Teacher
from gem_ops.transfer.user_representations import representations_path, write_user_representations


@dataclass(frozen=True)
class DomainModelSettings(StudentSettings):
    prefix: str = "domain_fm"  # registered as <prefix>_<domain>
    # The domain's verticals learn from GEM where the FM does not beat it on the FM's held-out day (TeacherChoice)
    teacher_gate: bool = True


@dataclass(frozen=True)
class DomainModel:
    name: str
    version: str
    train_examples: int
    report: dict[str, dict[str, float]]  # the final eval report, per domain/task group
    teaches: dict[str, Any] = field(default_factory=dict)  # TeacherChoice.to_dict(): who teaches the verticals

    def summary(self) -> dict[str, Any]:
        return {"model": self.name, "version": self.version, "train_examples": self.train_examples,
                **{g: round(figures["auc"], 4) for g, figures in self.report.items()  # AUC of a one-class group: none
                   if g.startswith("all/") and math.isfinite(figures.get("auc", math.nan))},
                **({"verticals_learn_from": self.teaches["teacher"], "held_out_day": self.teaches}
                   if self.teaches else {})}


def domain_foundation_model(client: MlflowClient, tracker: RunTracker, logs: SequenceLogs, data: DomainData,
                            gem: Teacher, settings: DomainModelSettings, work_dir: str | os.PathLike,
                            predictions_path: str | os.PathLike, run_label: str) -> DomainModel:
    """Trains, registers (in an MLflow run nested under `tracker`'s) and scores one domain's FM; the predictions
    its verticals learn from are written to `predictions_path`: the FM's (its identity, GEM's as its teacher), or
    GEM's where the teacher gate keeps GEM; the FM's user representations go beside them either way
    (`<name>.representations.parquet`)."""
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
        choice = None
        if settings.teacher_gate:
            choice = choose_domain_teacher(logs, data, teacher.predictions, gem.predictions)
        keeps_gem = choice is not None and choice.teacher == "gem"
        write_predictions((gem if keeps_gem else teacher).predictions, predictions_path)
        child.set_tags({"verticals_learn_from": "gem" if keeps_gem else "domain_fm"})
        if choice is not None:
            aucs = {"held_out_day.fm_auc": choice.fm_auc, "held_out_day.gem_auc": choice.gem_auc}
            child.log_metrics({k: v for k, v in aucs.items() if math.isfinite(v)})
        if fm.adapter_report:
            child.log_metrics(flat_metrics(fm.adapter_report["teacher"], "adapter.before")
                              | flat_metrics(fm.adapter_report["adapted"], "adapter.after"))
    return DomainModel(name, version, int(data.foundation.size), fm.result.final_report,
                       choice.to_dict() if choice is not None else {})
