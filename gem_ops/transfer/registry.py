"""Models in the MLflow registry: lineage tags, loading a version back (with the user representations
table it reads), and champion/challenger promotion of vertical models."""

from __future__ import annotations

import math
import tempfile
from dataclasses import asdict, dataclass
from typing import Any

import mlflow.artifacts
import numpy as np
import torch
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from gem_ops.data.loader import SequenceLogs
from gem_ops.metrics.quality import base_rate_entropy
from gem_ops.model.config import FeatureSpec
from gem_ops.model.gem import GEMModel
from gem_ops.train.model_state import load_model_state, model_from_state
from gem_ops.transfer.knowledge import (TeacherJoinedLogs, TeacherPredictions, prediction_rows, predictions_quality,
                                       score_examples)
from gem_ops.transfer.user_representations import read_user_representations, representations_of_examples

CHAMPION, CHALLENGER = "champion", "challenger"
TEACHER_NAME, TEACHER_VERSION, TEACHER_KIND = "teacher.model_name", "teacher.model_version", "teacher.kind"
TEACHER_REPRESENTATIONS = "teacher.representations"  # the user representations table the model reads
TRANSFER_MODE = "transfer.mode"
PROMOTION_PREFIX = "promotion."


def model_identity(name: str, version: str, kind: str) -> dict[str, str]:
    return {"name": name, "version": str(version), "kind": kind}


def lineage_tags(mode: str, teacher: dict[str, Any] | None) -> dict[str, str]:
    """Tags naming the teacher a model learned from (and that teacher's own teacher, for hierarchical)."""
    tags = {TRANSFER_MODE: mode}
    if teacher:
        tags.update({TEACHER_NAME: teacher["name"], TEACHER_VERSION: str(teacher["version"]),
                     TEACHER_KIND: teacher.get("kind", "")})
        if teacher.get("representations"):
            tags[TEACHER_REPRESENTATIONS] = str(teacher["representations"])
        if teacher.get("teacher"):
            grand = teacher["teacher"]
            tags.update({"teacher.teacher.model_name": grand["name"],
                         "teacher.teacher.model_version": str(grand["version"])})
    return tags


def load_model_version(client: MlflowClient, name: str, version: str) -> GEMModel:
    """The weights of a registered version (the pyfunc package's model_state artifact)."""
    found = client.get_model_version(name, str(version))
    with tempfile.TemporaryDirectory() as tmp:  # the version's source: its logged model's artifacts
        path = mlflow.artifacts.download_artifacts(artifact_uri=f"{found.source.rstrip('/')}/artifacts/model_state.pt",
                                                   dst_path=tmp, tracking_uri=client.tracking_uri)
        state = load_model_state(path)
    return model_from_state(state).eval()


def score_version(client: MlflowClient, name: str, version: str, logs: SequenceLogs, indices: np.ndarray,
                  _cache: dict | None = None) -> tuple[GEMModel, TeacherPredictions]:
    """A registered model's predictions on `indices`. A model that reads a teacher representation looks it
    up in the table named by its lineage tags, as it would at serving: no teacher runs."""
    cache = {} if _cache is None else _cache
    key = (name, str(version))
    if key in cache:
        return cache[key]
    model = load_model_version(client, name, version)
    data: SequenceLogs | TeacherJoinedLogs = logs
    if model.config.teacher_representation_dim:
        tags = client.get_model_version(name, str(version)).tags
        if TEACHER_REPRESENTATIONS not in tags:
            raise ValueError(f"model {name} v{version} reads a teacher representation but has no "
                             f"{TEACHER_REPRESENTATIONS} tag naming the table it reads")
        table = read_user_representations(tags[TEACHER_REPRESENTATIONS])
        looked_up = TeacherPredictions(np.asarray(indices, dtype=np.int64),
                                       np.full((len(indices), len(logs.objectives)), np.nan, np.float32),
                                       representations_of_examples(table, logs, indices), tuple(logs.objectives))
        data = TeacherJoinedLogs(logs, looked_up, table)
    identity = model_identity(name, version, "")
    cache[key] = (model, score_examples(model, data, indices, identity))
    return cache[key]


def version_quality(client: MlflowClient, name: str, version: str, logs: SequenceLogs, indices: np.ndarray,
                    task: str, cache: dict | None = None) -> dict[str, float]:
    """AUC, NE, calibration... of one registered model on one task over the given examples."""
    _, predictions = score_version(client, name, version, logs, indices, cache)
    return predictions_quality(logs, predictions, predictions.example_index, (task,))[f"all/{task}"]


@dataclass
class PromotionDecision:
    model: str
    challenger_version: str
    champion_version: str | None
    challenger: dict[str, float]
    champion: dict[str, float] | None
    promoted: bool
    reason: str
    ne_delta: float | None = None  # challenger's NE minus the champion's, on the same examples
    ne_delta_stderr: float | None = None  # its standard error from the paired per-example differences

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def current_version(client: MlflowClient, name: str, alias: str) -> str | None:
    try:
        return client.get_model_version_by_alias(name, alias).version
    except MlflowException:
        return None


def paired_ne_delta(logs: SequenceLogs, challenger: TeacherPredictions, champion: TeacherPredictions | None,
                    indices: np.ndarray, task: str) -> tuple[float, float]:
    """Challenger's NE minus the champion's over the examples of `indices` labelled for `task`, and the standard
    error of that difference. Both models are scored on the same examples, so the difference is the mean of
    per-example log-loss differences (over the labels' base-rate entropy): the sample's own luck, which moves
    both models' NE alike, cancels, and what remains is measured from the spread of those differences.
    Champion None: the base rate itself (a constant prediction of the labels' mean, NE 1)."""
    column = list(FeatureSpec.from_logs(logs).objectives).index(task)
    batch = logs.batch(indices, max_history_len=0)
    labelled = batch.label_mask[:, column].numpy().astype(bool)
    labels = batch.labels[labelled, column].double()
    rate = labels.mean().item() if labels.numel() else math.nan
    entropy = base_rate_entropy(rate)
    if math.isnan(entropy):
        return math.nan, math.nan
    losses = []
    for predictions in (challenger, champion):
        if predictions is None:
            logits = torch.full_like(labels, math.log(rate / (1 - rate)))
        else:
            rows = prediction_rows(logs, predictions, indices)
            logits = torch.from_numpy(predictions.logits[rows, predictions.objectives.index(task)][labelled]).double()
        losses.append(torch.nn.functional.binary_cross_entropy_with_logits(logits, labels, reduction="none"))
    difference = (losses[0] - losses[1]) / entropy
    stderr = difference.std().item() / math.sqrt(difference.numel()) if difference.numel() > 1 else math.inf
    return difference.mean().item(), stderr


def promote_if_not_worse(client: MlflowClient, name: str, logs: SequenceLogs, indices: np.ndarray, task: str,
                         challenger_version: str | None = None, ne_tolerance: float = 0.0,
                         cache: dict | None = None, ne_standard_errors: float = 0.0) -> PromotionDecision:
    """Scores the challenger and the champion on the same examples; the challenger becomes champion unless
    its NE exceeds the champion's by more than ne_tolerance + ne_standard_errors standard errors of the
    paired difference (see paired_ne_delta; 0 standard errors: any excess keeps it out). With no champion
    yet, the base rate (NE 1) stands in for it: a first model worse than predicting the base rate is kept
    out by the same rule. A promoted version loses the challenger alias. The figures and the decision go on
    the challenger's version tags either way. `cache` keeps scored versions between calls on the same
    examples."""
    challenger_version = challenger_version or current_version(client, name, CHALLENGER)
    if challenger_version is None:
        raise ValueError(f"registered model {name!r} has no {CHALLENGER!r} version to judge")
    champion_version = current_version(client, name, CHAMPION)
    cache = {} if cache is None else cache  # shared across calls: a teacher scored once serves all its students
    challenger = version_quality(client, name, challenger_version, logs, indices, task, cache)
    champion, delta, stderr = None, None, None
    if champion_version is not None and str(champion_version) == str(challenger_version):
        champion = challenger
        promoted, reason = True, "already champion"
    else:
        scored = score_version(client, name, challenger_version, logs, indices, cache)[1]
        if champion_version is None:
            reference, reference_ne = None, 1.0
            against = "no champion yet; against the base rate's NE 1"
        else:
            champion = version_quality(client, name, champion_version, logs, indices, task, cache)
            reference = score_version(client, name, champion_version, logs, indices, cache)[1]
            reference_ne, against = champion["ne"], f"vs champion's {champion['ne']:.4f}"
        delta, stderr = paired_ne_delta(logs, scored, reference, indices, task)
        allowed = ne_tolerance + ne_standard_errors * stderr if ne_standard_errors else ne_tolerance
        promoted = _not_worse(challenger["ne"], reference_ne, delta, allowed)
        reason = (f"NE {challenger['ne']:.4f} {against}: {delta:+.4f} "
                  f"(paired standard error {stderr:.4f}) {'<=' if promoted else '>'} {allowed:+.4f} allowed"
                  + (f" (tolerance {ne_tolerance:+g} + {ne_standard_errors:g} standard errors)"
                     if ne_standard_errors else ""))
    decision = PromotionDecision(name, str(challenger_version), champion_version, challenger, champion, promoted,
                                 reason, delta, stderr)
    if promoted:
        client.set_registered_model_alias(name, CHAMPION, str(challenger_version))
        if str(current_version(client, name, CHALLENGER)) == str(challenger_version):
            client.delete_registered_model_alias(name, CHALLENGER)
    _record(client, decision)
    return decision


def _not_worse(challenger_ne: float, champion_ne: float, delta: float, allowed: float) -> bool:
    if math.isnan(champion_ne):
        return not math.isnan(challenger_ne)
    return not math.isnan(challenger_ne) and delta <= allowed


def _record(client: MlflowClient, decision: PromotionDecision) -> None:
    tags = {"decision": "promoted" if decision.promoted else "kept_out", "reason": decision.reason,
            "examples": str(int(decision.challenger["count"])), "champion_version": decision.champion_version or "none"}
    for metric in ("auc", "ne", "calibration"):
        tags[f"challenger_{metric}"] = f"{decision.challenger[metric]:.6f}"
        if decision.champion is not None:
            tags[f"champion_{metric}"] = f"{decision.champion[metric]:.6f}"
    if decision.ne_delta is not None:
        tags["ne_delta"], tags["ne_delta_stderr"] = f"{decision.ne_delta:.6f}", f"{decision.ne_delta_stderr:.6f}"
    for key, value in tags.items():
        client.set_model_version_tag(decision.model, decision.challenger_version, PROMOTION_PREFIX + key, value)


def version_for_partition(client: MlflowClient, name: str, latest_partition: str) -> tuple[str, str]:
    """(version, partition) of the newest version of `name` trained on a Dagster partition no later than
    `latest_partition` (ISO days compare as strings)."""
    found = []
    for version in client.search_model_versions(f"name = '{name}'"):
        partition = client.get_run(version.run_id).data.tags.get("dagster.partition_key") if version.run_id else None
        if partition is not None and partition <= latest_partition:
            found.append((partition, int(version.version)))
    if not found:
        raise LookupError(f"no version of registered model {name!r} was trained on a partition up to "
                          f"{latest_partition}: materialize gem_foundation_model for that day first")
    partition, version = max(found)
    return str(version), partition


def set_alias(client: MlflowClient, name: str, alias: str, version: str) -> None:
    client.set_registered_model_alias(name, alias, str(version))


def register_student(client: MlflowClient, run_id: str, model: GEMModel, data, example_indices: np.ndarray,
                     name: str, tags: dict[str, str], alias: str | None = None) -> str:
    """Logs a student's pyfunc (its input example carries the teacher columns it reads) and registers a
    version with its lineage tags (and alias)."""
    from gem_ops.train.mlflow_model import input_example, log_model

    version = log_model(client, run_id, model, input_example(data, example_indices, model), name, version_tags=tags)
    if alias:
        set_alias(client, name, alias, version)
    return version
