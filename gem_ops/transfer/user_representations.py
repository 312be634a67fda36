"""Candidate-independent teacher representations, per domain, user and day: a feature table that a student
reads by lookup, at training and at serving, without running the teacher.

The representation of (domain, user, day D) is the teacher's trunk output (beside its sequence arm's summary
of the user's recent events, with source "summary") for a neutral request of that user on that domain at
D's first instant: the user's history strictly before D (so nothing of D leaks),
no candidate (a reserved item id, item features unknown, no dense features). A request on day D reads
row (domain, user, D): in production the table is computed once a day, after the day's logs close.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from gem_ops.data.loader import SequenceLogs
from gem_ops.model.features import model_input
from gem_ops.train.acceleration import autocast_context
from gem_ops.transfer.vector_files import column_vectors, read_vector_file, vector_column, write_vector_file

MS_PER_DAY = 86_400_000
METADATA_KEY = b"gem.user_representations"
NO_ITEM = -1  # the neutral request's candidate: an id no event carries
REPRESENTATION_SOURCES = ("trunk", "summary")


@dataclass
class UserRepresentations:
    """Rows keyed by (domain, user_id, day): day = UTC days since the epoch of the requests they serve."""

    domain: np.ndarray  # [R] int64, index into `domains`
    user_id: np.ndarray  # [R] int64
    day: np.ndarray  # [R] int64
    vectors: np.ndarray  # [R, H] float16
    domains: tuple[str, ...]
    teacher: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return int(self.user_id.shape[0])

    @property
    def dim(self) -> int:
        return int(self.vectors.shape[1])

    def lookup(self, domain: np.ndarray, user_id: np.ndarray, request_ms: np.ndarray) -> np.ndarray:
        """[N, H] float16: each request's row (its domain, user and day); zeros where the table has none
        (a user the teacher never saw before that day)."""
        keys = self._keys(np.asarray(domain), np.asarray(user_id), np.asarray(request_ms) // MS_PER_DAY)
        order = np.argsort(self._own_keys, kind="stable")
        sorted_keys = self._own_keys[order]
        at = np.searchsorted(sorted_keys, keys).clip(max=max(len(sorted_keys) - 1, 0))
        found = (sorted_keys[at] == keys) if len(sorted_keys) else np.zeros(keys.shape, bool)
        out = np.zeros((keys.shape[0], self.dim), dtype=np.float16)
        out[found] = self.vectors[order[at[found]]]
        return out

    @property
    def _own_keys(self) -> np.ndarray:
        return self._keys(self.domain, self.user_id, self.day)

    def _keys(self, domain: np.ndarray, user_id: np.ndarray, day: np.ndarray) -> np.ndarray:
        # A structured key sorts by domain, then user, then day.
        keys = np.empty(domain.shape[0], dtype=[("d", np.int64), ("u", np.int64), ("t", np.int64)])
        keys["d"], keys["u"], keys["t"] = domain, user_id, day
        return keys


@torch.no_grad()
def compute_user_representations(model, logs: SequenceLogs, indices: np.ndarray, teacher: dict[str, Any] | None = None,
                                 batch_size: int = 1024, device: torch.device | str = "cpu",
                                 precision: str = "auto", source: str = "trunk") -> UserRepresentations:
    """The teacher's representation of every (domain, user, day) the examples `indices` fall on: its trunk
    output (`source` "trunk") or, for a model with a sequence arm, the trunk's output beside the arm's
    summary of the user's recent events ("summary", GEMModel.user_summary)."""
    if source not in REPRESENTATION_SOURCES:
        raise ValueError(f"representation source {source!r}: use one of {list(REPRESENTATION_SOURCES)}")
    if source == "summary" and not hasattr(model, "user_summary"):
        raise ValueError(f"representation source 'summary': {type(model).__name__} has no sequence arm to summarize")
    represent = model.user_summary if source == "summary" else model.encode
    device = torch.device(device)
    indices = np.asarray(indices, dtype=np.int64)
    domain = logs.column("surface")[indices].astype(np.int64)
    user_row = logs.column("user_row")[indices].astype(np.int64)
    day = logs.column("timestamp")[indices] // MS_PER_DAY
    keys = np.unique(np.stack([domain, user_row, day], 1), axis=0)  # [R, 3]
    was_training = model.training
    model.eval().to(device)
    max_len = model.config.sequence.max_history_len
    vectors = []
    for start in range(0, len(keys), batch_size):
        part = keys[start : start + batch_size]
        batch = logs.neutral_requests(part[:, 1], part[:, 2] * MS_PER_DAY, part[:, 0], NO_ITEM, max_len)
        x = model_input(batch, model.spec, model.config, with_level_sizes=True).to(device)
        with autocast_context(device, precision):
            vectors.append(represent(x).float().cpu().numpy().astype(np.float16))
    model.train(was_training)
    hidden = vectors[0].shape[1] if vectors else model.config.trunk_hidden
    return UserRepresentations(domain=keys[:, 0], user_id=logs.user_ids[keys[:, 1]].astype(np.int64), day=keys[:, 2],
                               vectors=np.concatenate(vectors) if vectors else np.zeros((0, hidden), np.float16),
                               domains=tuple(logs.surfaces), teacher=dict(teacher or {}))


def representations_of_examples(table: UserRepresentations, logs: SequenceLogs, indices: np.ndarray) -> np.ndarray:
    """[N, H]: the row each example reads (its domain, user and request day)."""
    if tuple(table.domains) != tuple(logs.surfaces):
        raise ValueError(f"user representations for domains {list(table.domains)}, the data has {list(logs.surfaces)}")
    indices = np.asarray(indices, dtype=np.int64)
    return table.lookup(logs.column("surface")[indices], logs.user_ids[logs.column("user_row")[indices]],
                        logs.column("timestamp")[indices])


def representations_path(predictions_path: str | os.PathLike) -> Path:
    """Where a teacher's user representations are kept: beside its predictions file."""
    path = Path(predictions_path)
    return path.with_name(path.name.removesuffix(".parquet") + ".representations.parquet")


def write_user_representations(table: UserRepresentations, destination: str | os.PathLike) -> Path:
    columns = {"domain": pa.array(np.asarray(table.domains, dtype=object)[table.domain] if len(table) else [],
                                  pa.string()),
               "user_id": pa.array(table.user_id, pa.int64()), "day": pa.array(table.day, pa.int64()),
               "representation": vector_column(table.vectors)}
    header = {"domains": list(table.domains), "teacher": table.teacher, "dim": table.dim}
    return write_vector_file(columns, METADATA_KEY, header, destination)


def read_user_representations(path: str | os.PathLike) -> UserRepresentations:
    arrow, header = read_vector_file(path, METADATA_KEY, "user representations")
    domains = tuple(header["domains"])
    index = {name: i for i, name in enumerate(domains)}
    return UserRepresentations(
        domain=np.array([index[d] for d in arrow.column("domain").to_pylist()], dtype=np.int64),
        user_id=arrow.column("user_id").to_numpy(), day=arrow.column("day").to_numpy(),
        vectors=column_vectors(arrow.column("representation"), arrow.num_rows), domains=domains,
        teacher=header["teacher"])
