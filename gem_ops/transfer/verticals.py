"""One domain's vertical models, one per objective: trained from their teacher, registered as challengers
and promoted only when not measurably worse than their champions on the same eval examples (see
registry.promote_if_not_worse)."""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
from mlflow.tracking import MlflowClient

from gem_ops.data.loader import SequenceLogs
from gem_ops.tracking import RunTracker
from gem_ops.transfer.config import StudentSettings
from gem_ops.transfer.hierarchy import DomainData, train_vertical_model
from gem_ops.transfer.registry import (CHALLENGER, PromotionDecision, lineage_tags, promote_if_not_worse,
                                     register_student)
from gem_ops.transfer.knowledge import TeacherPredictions, predictions_quality
from gem_ops.transfer.student import Teacher
from gem_ops.transfer.windows import labelled_tasks


@dataclass(frozen=True)
class VerticalSettings(StudentSettings):
    mode: str = "hierarchical"  # hierarchical, direct or alone (recorded in the lineage tags)
    prefix: str = "vertical"  # registered as <prefix>_<domain>_<objective>
    ne_tolerance: float = 0.0
    ne_standard_errors: float = 0.0
    promotion_max_examples: int = 20_000
    seed: int = 0
    compare_alone: bool = True  # also train the same vertical without a teacher, for the summary (not registered)
    # An objective gets a vertical only with this many positives in its training examples and in the examples it
    # is judged on: with fewer, no figure can tell the model from the base rate.
    min_positives: int = 50


@dataclass(frozen=True)
class VerticalOutcome:
    """One vertical model: its registration and promotion, and its eval figures on its domain and task
    beside GEM's and beside the same model trained alone."""

    name: str
    version: str
    decision: PromotionDecision
    figures: dict[str, dict[str, float]]  # "vertical" / "alone" / "gem" -> auc, ne, calibration, count, positives
    shared_tables: str = ""  # "fixed" (the teacher's) or "trained"; "" without shared tables

    def summary(self) -> dict:
        return {"version": self.version, "promoted": self.decision.promoted, "reason": self.decision.reason,
                "eval_examples": int(self.figures["vertical"]["count"]),
                **({"shared_tables": self.shared_tables} if self.shared_tables else {}),
                **{f"{who}.{m}": round(v[m], 4) for who, v in self.figures.items()
                   for m in ("auc", "ne", "calibration")}}


def comparison_examples(data: DomainData, limit: int, seed: int) -> np.ndarray:
    """The eval examples challenger and champion are both scored on (a fixed sample above `limit`)."""
    if data.eval.size <= limit:
        return data.eval
    return np.sort(np.random.default_rng(seed).choice(data.eval, limit, replace=False))


def vertical_objectives(logs: SequenceLogs, data: DomainData,
                        settings: VerticalSettings) -> tuple[list[str], dict[str, str]]:
    """The objectives of the domain that get a vertical, and for each objective left out, why (with its counts)."""
    compare = comparison_examples(data, settings.promotion_max_examples, settings.seed)
    labelled = [t for t in labelled_tasks(logs, data.train) if t in labelled_tasks(logs, compare)]
    train_counts, judged_counts = logs.label_counts(data.train), logs.label_counts(compare)
    tasks, left_out = [], {}
    for task in logs.objectives:
        train_positives, judged_positives = train_counts[task][1], judged_counts[task][1]
        if task in labelled and min(train_positives, judged_positives) >= settings.min_positives:
            tasks.append(task)
        elif train_counts[task][0] and judged_counts[task][0]:
            left_out[f"{data.domain}/{task}"] = (
                f"{train_positives} positives in {data.train.size} training examples and {judged_positives} in the "
                f"{compare.size} eval examples it would be judged on; a vertical needs {settings.min_positives} in "
                f"each (min_positives)")
    return tasks, left_out


def domain_verticals(client: MlflowClient, tracker: RunTracker, logs: SequenceLogs, data: DomainData,
                     teacher: Teacher | None, settings: VerticalSettings, work_dir: Path, run_label: str,
                     gem: TeacherPredictions | None = None,
                     tasks: list[str] | None = None) -> Iterator[VerticalOutcome]:
    """A VerticalOutcome for each of `tasks` (default: vertical_objectives'), each model in its own MLflow run
    nested under `tracker`'s; `gem`: GEM's scores of the eval examples, for the figures beside it."""
    if tasks is None:
        tasks, _ = vertical_objectives(logs, data, settings)
    compare = comparison_examples(data, settings.promotion_max_examples, settings.seed)
    # One evaluation, reported the same everywhere (the run log, MLflow, the promotion, the summary): every
    # model is judged on the comparison examples, all of them.
    judged = replace(data, eval=compare)
    train_config = replace(settings.train, eval_max_examples=max(settings.train.eval_max_examples, compare.size))
    scored: dict = {}  # the teachers of this domain's models, scored once for all its comparisons
    for task in tasks:
        name = f"{settings.prefix}_{data.domain}_{task}"
        tags = (lineage_tags(settings.mode, teacher.identity if teacher else None)
                | {"domain": data.domain, "task": task})
        # The part that tells the models apart first: run names are cut short in MLflow's tables.
        with tracker.child(f"{data.domain}/{task} · {name} [{run_label}]", tags) as child:
            vm = train_vertical_model(logs, judged, task, settings.base, train_config,
                                      work_dir / f"{data.domain}_{task}",
                                      settings.transfer, teacher, settings.shuffling, child)
            version = register_student(client, child.run_id, vm.model, vm.data, data.eval, name, tags, CHALLENGER)
            decision = promote_if_not_worse(client, name, logs, compare, task, version, settings.ne_tolerance, scored,
                                            settings.ne_standard_errors)
            child.log_dict(decision.to_dict(), "promotion.json")
            group = f"{data.domain}/{task}"
            figures = {"vertical": vm.result.final_report[group]}
            if settings.compare_alone and teacher is not None:
                alone = train_vertical_model(logs, judged, task, settings.base, train_config,
                                             work_dir / f"{data.domain}_{task}_alone", settings.transfer, None,
                                             settings.shuffling)
                figures["alone"] = alone.result.final_report[group]
            if gem is not None:
                figures["gem"] = predictions_quality(logs, gem, compare, (task,))[group]
            child.log_metrics({f"compare.{who}.{m}": v[m] for who, v in figures.items()
                               for m in ("auc", "ne", "calibration") if math.isfinite(v[m])})
        yield VerticalOutcome(name, version, decision, figures, vm.shared_tables.get("kept", ""))
