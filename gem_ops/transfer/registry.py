"""Models in the MLflow registry: lineage tags, loading a version back (with the teachers it reads
representations from), and champion/challenger promotion of vertical models."""

from __future__ import annotations

import math
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from gem_ops.data.loader import SequenceLogs
from gem_ops.model.gem import GEMModel
from gem_ops.train.loop import model_from_state
from gem_ops.transfer.knowledge import TeacherJoinedLogs, TeacherPredictions, predictions_quality, score_examples

CHAMPION, CHALLENGER = "champion", "challenger"
TEACHER_NAME, TEACHER_VERSION, TEACHER_KIND = "teacher.model_name", "teacher.model_version", "teacher.kind"
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
        if teacher.get("teacher"):
            grand = teacher["teacher"]
            tags.update({"teacher.teacher.model_name": grand["name"], "teacher.teacher.model_version": str(grand["version"])})
    return tags


def load_model_version(client: MlflowClient, name: str, version: str) -> GEMModel:
    """The weights of a registered version (the pyfunc package's model_state artifact)."""
    found = client.get_model_version(name, str(version))
    root = client.get_run(found.run_id).info.artifact_uri.rstrip("/")
    package = found.source[len(root) + 1:] if found.source.startswith(root + "/") else "model"
    with tempfile.TemporaryDirectory() as tmp:
        path = client.download_artifacts(found.run_id, f"{package}/artifacts/model_state.pt", tmp)
        state = torch.load(Path(path), map_location="cpu", weights_only=False)
    return model_from_state(state).eval()


def score_version(client: MlflowClient, name: str, version: str, logs: SequenceLogs, indices: np.ndarray,
                  _cache: dict | None = None) -> tuple[GEMModel, TeacherPredictions]:
    """A registered model's predictions on `indices`. A model that reads a teacher representation is fed
    the representation of the very teacher version it was trained with (from its lineage tags)."""
    cache = {} if _cache is None else _cache
    key = (name, str(version))
    if key in cache:
        return cache[key]
    model = load_model_version(client, name, version)
    data: SequenceLogs | TeacherJoinedLogs = logs
    if model.config.teacher_representation_dim:
        tags = client.get_model_version(name, str(version)).tags
        if TEACHER_NAME not in tags:
            raise ValueError(f"model {name} v{version} reads a teacher representation but has no {TEACHER_NAME} tag")
        _, teacher = score_version(client, tags[TEACHER_NAME], tags[TEACHER_VERSION], logs, indices, cache)
        data = TeacherJoinedLogs(logs, _full_objectives(teacher, logs))
    identity = model_identity(name, version, "")
    cache[key] = (model, score_examples(model, data, indices, identity))
    return cache[key]


def _full_objectives(predictions: TeacherPredictions, logs: SequenceLogs) -> TeacherPredictions:
    """A teacher's predictions with a column per data objective (NaN where the teacher has no such task);
    only the representation of a teacher is read here."""
    if tuple(predictions.objectives) == tuple(logs.objectives):
        return predictions
    logits = np.full((len(predictions), len(logs.objectives)), np.nan, dtype=np.float32)
    for t, name in enumerate(predictions.objectives):
        logits[:, list(logs.objectives).index(name)] = predictions.logits[:, t]
    return TeacherPredictions(predictions.example_index, logits, predictions.representation, tuple(logs.objectives),
                              predictions.teacher)


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

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def current_version(client: MlflowClient, name: str, alias: str) -> str | None:
    try:
        return client.get_model_version_by_alias(name, alias).version
    except MlflowException:
        return None


def promote_if_not_worse(client: MlflowClient, name: str, logs: SequenceLogs, indices: np.ndarray, task: str,
                         challenger_version: str | None = None, ne_tolerance: float = 0.0,
                         cache: dict | None = None) -> PromotionDecision:
    """Scores the challenger and the champion on the same examples; the challenger becomes champion when
    its NE is not above the champion's (+ ne_tolerance). The figures and the decision go on the
    challenger's version tags either way. `cache` keeps scored versions between calls on the same examples."""
    challenger_version = challenger_version or current_version(client, name, CHALLENGER)
    if challenger_version is None:
        raise ValueError(f"registered model {name!r} has no {CHALLENGER!r} version to judge")
    champion_version = current_version(client, name, CHAMPION)
    cache = {} if cache is None else cache  # shared across calls: a teacher scored once serves all its students
    challenger = version_quality(client, name, challenger_version, logs, indices, task, cache)
    champion = None
    if champion_version is None:
        promoted, reason = True, "no champion yet"
    elif champion_version == str(challenger_version):
        champion = challenger
        promoted, reason = True, "already champion"
    else:
        champion = version_quality(client, name, champion_version, logs, indices, task, cache)
        promoted = _not_worse(challenger["ne"], champion["ne"], ne_tolerance)
        reason = (f"NE {challenger['ne']:.4f} {'<=' if promoted else '>'} champion's {champion['ne']:.4f}"
                  + (f" {ne_tolerance:+g}" if ne_tolerance else ""))
    decision = PromotionDecision(name, str(challenger_version), champion_version, challenger, champion, promoted, reason)
    if promoted:
        client.set_registered_model_alias(name, CHAMPION, str(challenger_version))
    _record(client, decision)
    return decision


def _not_worse(challenger_ne: float, champion_ne: float, tolerance: float) -> bool:
    if math.isnan(champion_ne):
        return not math.isnan(challenger_ne)
    return not math.isnan(challenger_ne) and challenger_ne <= champion_ne + tolerance


def _record(client: MlflowClient, decision: PromotionDecision) -> None:
    tags = {"decision": "promoted" if decision.promoted else "kept_out", "reason": decision.reason,
            "examples": str(int(decision.challenger["count"])), "champion_version": decision.champion_version or "none"}
    for metric in ("auc", "ne", "calibration"):
        tags[f"challenger_{metric}"] = f"{decision.challenger[metric]:.6f}"
        if decision.champion is not None:
            tags[f"champion_{metric}"] = f"{decision.champion[metric]:.6f}"
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
        raise LookupError(f"no version of registered model {name!r} was trained on a partition up to {latest_partition}: "
                          "materialize gem_foundation_model for that day first")
    partition, version = max(found)
    return str(version), partition


def set_alias(client: MlflowClient, name: str, alias: str, version: str) -> None:
    client.set_registered_model_alias(name, alias, str(version))


def register_student(client: MlflowClient, run_id: str, model: GEMModel, data, example_indices: np.ndarray,
                     name: str, tags: dict[str, str], alias: str | None = None) -> str:
    """Logs a student's pyfunc (its input example carries the teacher columns it reads) and registers a
    version with its lineage tags (and alias)."""
    from gem_ops.train.mlflow_model import INPUT_EXAMPLE_ROWS, batch_to_frame, log_model

    example = batch_to_frame(data.batch(example_indices[:INPUT_EXAMPLE_ROWS], model.config.sequence.max_history_len),
                             model.spec)
    version = log_model(client, run_id, model, example, name, version_tags=tags)
    if alias:
        set_alias(client, name, alias, version)
    return version
