"""Knowledge generation: a teacher scores examples once; its logits, and the candidate-independent user
representation each example reads (gem_ops.transfer.user_representations: a lookup by domain, user and
day, never a teacher forward pass at serving), are stored with the teacher's identity and joined into
the students' batches by example index."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from gem_ops.data.loader import SequenceBatch, SequenceLogs
from gem_ops.metrics.quality import quality_report
from gem_ops.model.config import FeatureSpec
from gem_ops.model.features import model_input
from gem_ops.model.gem import GEMModel
from gem_ops.train.acceleration import autocast_context
from gem_ops.transfer.user_representations import UserRepresentations, representations_of_examples
from gem_ops.transfer.vector_files import column_vectors, read_vector_file, vector_column, write_vector_file

METADATA_KEY = b"gem.teacher"


@dataclass
class TeacherPredictions:
    """Per scored example: the teacher's logit per objective and the user representation it reads."""

    example_index: np.ndarray  # [N] int64, rows of the sequence logs' examples
    logits: np.ndarray  # [N, T] float32, in `objectives` order
    representation: np.ndarray  # [N, H] float16 (H = 0: the teacher offers none)
    objectives: tuple[str, ...]
    teacher: dict[str, Any] = field(default_factory=dict)  # e.g. model name, version, run id, kind

    def __post_init__(self):
        n = self.example_index.shape[0]
        if self.logits.shape[0] != n or self.representation.shape[0] != n:
            raise ValueError(f"teacher predictions: {n} examples but {self.logits.shape[0]} logit rows "
                             f"and {self.representation.shape[0]} representation rows")

    def __len__(self) -> int:
        return int(self.example_index.shape[0])

    @property
    def representation_dim(self) -> int:
        return int(self.representation.shape[1])

    def with_logits(self, logits: np.ndarray) -> TeacherPredictions:
        """The same examples with other logits (e.g. the Student Adapter's)."""
        return replace(self, logits=np.asarray(logits, dtype=np.float32))


def prediction_rows(logs: SequenceLogs, predictions: TeacherPredictions, indices: np.ndarray) -> np.ndarray:
    """The rows of `predictions` holding the logs' examples `indices`, in that order."""
    position = np.full(len(logs), -1, dtype=np.int64)
    position[predictions.example_index] = np.arange(len(predictions))
    rows = position[np.asarray(indices, dtype=np.int64)]
    if (rows < 0).any():
        raise ValueError(f"the predictions do not cover {int((rows < 0).sum())} of the examples to report on")
    return rows


def predictions_quality(logs: SequenceLogs, predictions: TeacherPredictions, indices: np.ndarray,
                        tasks: tuple[str, ...]) -> dict[str, dict[str, float]]:
    """Quality (per domain and task, and over all) of stored predictions on `indices`, rows of the logs'
    examples, for `tasks`: objectives of both the predictions and the data."""
    spec = FeatureSpec.from_logs(logs)
    missing = [t for t in tasks if t not in predictions.objectives or t not in spec.objectives]
    if missing:
        raise ValueError(f"tasks {missing} are not objectives of both the predictions {list(predictions.objectives)} "
                         f"and the data {list(spec.objectives)}")
    rows = prediction_rows(logs, predictions, indices)
    logits = predictions.logits[rows][:, [predictions.objectives.index(t) for t in tasks]]
    columns = [spec.objectives.index(t) for t in tasks]
    batch = logs.batch(indices, max_history_len=0)
    return quality_report(torch.from_numpy(logits), batch.labels[:, columns], batch.label_mask[:, columns],
                          batch.surface, spec.surfaces, tuple(tasks))


@torch.no_grad()
def score_examples(model: GEMModel, logs: SequenceLogs, indices: np.ndarray, teacher: dict[str, Any] | None = None,
                   batch_size: int = 1024, device: torch.device | str = "cpu", precision: str = "auto",
                   representations: UserRepresentations | None = None) -> TeacherPredictions:
    """The model's logits of the given examples (in length-sorted batches), with each example's row of
    `representations` (none without them)."""
    device = torch.device(device)
    was_training = model.training
    model.eval().to(device)
    indices = np.asarray(indices, dtype=np.int64)
    max_len = model.config.sequence.max_history_len
    order = indices[np.argsort(logs.history_lengths(max_len)[indices], kind="stable")]
    parts: dict[str, list[np.ndarray]] = {"index": [], "logits": []}
    for start in range(0, order.size, batch_size):
        chunk = order[start : start + batch_size]
        x = model_input(logs.batch(chunk, max_len), model.spec, model.config, with_level_sizes=True).to(device)
        with autocast_context(device, precision):
            logits = model(x)
        parts["index"].append(chunk)
        parts["logits"].append(logits.float().cpu().numpy())
    model.train(was_training)
    example_index = np.concatenate(parts["index"]) if parts["index"] else np.zeros(0, np.int64)
    representation = (representations_of_examples(representations, logs, example_index) if representations is not None
                      else np.zeros((example_index.size, 0), np.float16))
    return TeacherPredictions(
        example_index=example_index,
        logits=np.concatenate(parts["logits"]) if parts["logits"] else np.zeros((0, len(model.objectives)), np.float32),
        representation=representation,
        objectives=tuple(model.objectives),
        teacher=dict(teacher or {}),
    )


def write_predictions(predictions: TeacherPredictions, destination: str | os.PathLike) -> Path:
    """One Parquet file (example_index, logit_<objective>..., representation), written aside then renamed;
    the teacher's identity and objectives go in the file's metadata."""
    columns = {"example_index": pa.array(predictions.example_index, pa.int64())}
    for t, name in enumerate(predictions.objectives):
        columns[f"logit_{name}"] = pa.array(predictions.logits[:, t], pa.float32())
    if predictions.representation_dim:  # a teacher without user representations stores none
        columns["representation"] = vector_column(predictions.representation)
    header = {"objectives": list(predictions.objectives), "teacher": predictions.teacher}
    return write_vector_file(columns, METADATA_KEY, header, destination)


def read_predictions(path: str | os.PathLike) -> TeacherPredictions:
    table, meta = read_vector_file(path, METADATA_KEY, "teacher predictions")
    representation = (column_vectors(table.column("representation"), table.num_rows)
                      if "representation" in table.column_names else np.zeros((table.num_rows, 0), np.float16))
    return TeacherPredictions(
        example_index=table.column("example_index").to_numpy(),
        logits=np.stack([table.column(f"logit_{t}").to_numpy() for t in meta["objectives"]], 1).astype(np.float32),
        representation=representation,
        objectives=tuple(meta["objectives"]),
        teacher=meta["teacher"],
    )


class TeacherJoinedLogs:
    """Sequence logs whose batches carry a teacher's logits and representation (everything else is the
    wrapped logs'). Every batched example must have been scored; neutral requests (a student computing its
    own user representations) read the teacher's table by domain, user and day."""

    def __init__(self, logs: SequenceLogs, predictions: TeacherPredictions,
                 representations: UserRepresentations | None = None):
        if tuple(predictions.objectives) != tuple(logs.objectives):
            raise ValueError(f"teacher objectives {predictions.objectives} differ from the data's {logs.objectives}")
        self.logs, self.predictions, self.representations = logs, predictions, representations
        self._row = np.full(len(logs), -1, dtype=np.int64)
        self._row[predictions.example_index] = np.arange(len(predictions))
        self._logits = torch.from_numpy(predictions.logits)
        self._rep = torch.from_numpy(predictions.representation)

    def __getattr__(self, name: str):
        return getattr(self.logs, name)

    def __len__(self) -> int:
        return len(self.logs)

    def batch(self, indices, max_history_len: int | None = None, history_caps: np.ndarray | None = None,
              retrieved_events: int = 0, retrieval_key: str = "item") -> SequenceBatch:
        batch = self.logs.batch(indices, max_history_len, history_caps, retrieved_events, retrieval_key)
        rows = self._row[np.asarray(indices, dtype=np.int64)]
        if (rows < 0).any():
            missing = np.asarray(indices)[rows < 0][:5].tolist()
            raise KeyError(f"the teacher ({self.predictions.teacher or 'unnamed'}) did not score example(s) {missing}; "
                           "score the student's training and eval examples")
        rows_t = torch.from_numpy(rows)
        return replace(batch, teacher_logits=self._logits[rows_t], teacher_representation=self._rep[rows_t])

    def neutral_requests(self, user_rows, request_ms, surfaces, item_id: int, max_history_len: int | None = None):
        batch = self.logs.neutral_requests(user_rows, request_ms, surfaces, item_id, max_history_len)
        if self.representations is None:
            return batch
        rep = self.representations.lookup(batch.surface.numpy(), batch.user_id.numpy(), batch.timestamp.numpy())
        return replace(batch, teacher_representation=torch.from_numpy(rep))
