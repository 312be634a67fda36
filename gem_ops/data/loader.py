"""Turns example indices into a training batch: jagged histories (values + offsets), ids, labels."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch

from gem_ops.data.sequence_layout import EXAMPLES, ITEMS, TIMELINE_FIELDS, TIMELINES, read_manifest, retrieval_keys


@dataclass
class SequenceBatch:
    """One batch. History tensors are jagged: values of all examples back to back, sliced by offsets."""

    example_index: torch.Tensor  # [B] row in examples
    timestamp: torch.Tensor  # [B] request time, ms since epoch
    user_id: torch.Tensor  # [B]
    item_id: torch.Tensor  # [B] candidate item
    surface: torch.Tensor  # [B] domain id
    sparse_features: dict[str, torch.Tensor]  # name -> [B] ids
    dense_features: torch.Tensor  # [B, n_dense] float32
    labels: torch.Tensor  # [B, n_objectives] float32, 0 where unlabelled
    label_mask: torch.Tensor  # [B, n_objectives] bool
    history_offsets: torch.Tensor  # [B + 1] int64
    history_item_id: torch.Tensor  # [N]
    history_surface: torch.Tensor  # [N]
    history_event_type: torch.Tensor  # [N]
    history_action: torch.Tensor  # [N] bitmask of the event's positive labels
    history_age_seconds: torch.Tensor  # [N] float32, request time minus event time
    # Knowledge transfer: a teacher's logits [B, n_objectives] and representation [B, H], when joined in.
    teacher_logits: torch.Tensor | None = None
    teacher_representation: torch.Tensor | None = None
    # name -> [N]: each history event's item feature (item_category, ...); -1 where the item has none
    history_item_features: dict[str, torch.Tensor] = field(default_factory=dict)
    # [B]: how many of each history's first events were retrieved (sequence.retrieved_events), when any were asked
    retrieved_lengths: torch.Tensor | None = None

    @property
    def size(self) -> int:
        return int(self.item_id.shape[0])

    @property
    def history_lengths(self) -> torch.Tensor:
        return self.history_offsets[1:] - self.history_offsets[:-1]

    def to(self, device: torch.device | str) -> SequenceBatch:
        moved = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, dict):
                moved[f.name] = {k: v.to(device) for k, v in value.items()}
            else:
                moved[f.name] = value if value is None else value.to(device)
        return SequenceBatch(**moved)


class SequenceLogs:
    """A sequence_logs folder opened for reading; histories are sliced out of flat timeline arrays."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        manifest = read_manifest(self.path)
        summary = manifest["summary"]
        self.objectives: list[str] = summary["objectives"]
        self.surfaces: list[str] = summary["surfaces"]
        self.event_types: list[str] = summary["event_types"]
        self.sparse_features: list[str] = summary["sparse_features"]
        self.dense_features: list[str] = summary["dense_features"]
        self.max_history_len: int = manifest["config"]["max_history_len"]
        self._labels: list[str] = manifest["labels"]

        timelines = _read_tables(self.path / TIMELINES)
        first = timelines.column(TIMELINE_FIELDS[0]).combine_chunks()
        lengths = pc.list_value_length(first).to_numpy(zero_copy_only=False)
        self.timeline_offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=self.timeline_offsets[1:])
        self.user_ids = timelines.column("user_id").to_numpy()
        self._timeline = {name: _flat_values(timelines.column(name)) for name in TIMELINE_FIELDS}
        self._timeline_features: dict[str, np.ndarray] = {}  # item features of every timeline event, as retrieved

        examples = _read_tables(self.path / EXAMPLES)
        self._examples = {name: _column(examples, name) for name in examples.column_names if name not in self._labels}
        self._label_values = np.stack(
            [_column(examples, c, fill_null=0) for c in self._labels], 1).astype(np.float32)
        self._label_mask = np.stack([pc.is_valid(examples.column(c)).to_numpy(zero_copy_only=False)
                                     for c in self._labels], 1)
        self.n_examples = examples.num_rows
        self.history_item_features: list[str] = summary.get("item_features", [])
        self._items = ItemFeatures(self.path / ITEMS, self.history_item_features)

    def __len__(self) -> int:
        return self.n_examples

    def column(self, name: str) -> np.ndarray:
        """A column of the examples table (history_end, split, timestamp, ...)."""
        return self._examples[name]

    def timeline_column(self, name: str) -> np.ndarray:
        """A flat timeline field over all users, sliced by timeline_offsets."""
        return self._timeline[name]

    def split_indices(self, split: str) -> np.ndarray:
        code = {"train": 0, "eval": 1}[split]
        return np.flatnonzero(self._examples["split"] == code)

    def label_counts(self, indices: np.ndarray) -> dict[str, tuple[int, int]]:
        """Objective -> (labelled examples, positives) among the examples at `indices`."""
        idx = np.asarray(indices, dtype=np.int64)
        mask, values = self._label_mask[idx], self._label_values[idx]
        return {name: (int(mask[:, t].sum()), int((values[:, t] * mask[:, t]).sum()))
                for t, name in enumerate(self.objectives)}

    def labels(self, indices: np.ndarray) -> np.ndarray:
        """[len(indices), n_objectives] float32 labels of the examples at `indices`, NaN where unlabelled."""
        idx = np.asarray(indices, dtype=np.int64)
        return np.where(self._label_mask[idx], self._label_values[idx], np.nan)

    def history_lengths(self, max_history_len: int | None = None) -> np.ndarray:
        limit = self.max_history_len if max_history_len is None else min(max_history_len, self.max_history_len)
        return np.minimum(self._examples["history_end"], limit)

    def batch(self, indices: np.ndarray | list[int], max_history_len: int | None = None,
              history_caps: np.ndarray | None = None, retrieved_events: int = 0,
              retrieval_key: str = "item") -> SequenceBatch:
        """Gathers the examples at `indices`; histories keep their most recent `max_history_len` events, and with
        `history_caps` (one per index) at most that many each. With `retrieved_events`, up to that many older
        events matching the candidate on `retrieval_key`, from beyond those recent ones, come before them
        (retrieve_matches)."""
        idx = np.asarray(indices, dtype=np.int64)
        if idx.size and (idx.min() < 0 or idx.max() >= self.n_examples):
            raise IndexError(f"example index out of range [0, {self.n_examples}) in {self.path}")
        ex = self._examples
        limit = self.max_history_len if max_history_len is None else min(max_history_len, self.max_history_len)
        lengths = self.history_lengths(max_history_len)[idx].astype(np.int64)
        if history_caps is not None:
            if np.shape(history_caps) != idx.shape:
                raise ValueError(f"history_caps must hold one cap per index ({idx.size}), got shape "
                                 f"{np.shape(history_caps)}")
            lengths = np.minimum(lengths, np.maximum(np.asarray(history_caps, dtype=np.int64), 0))
        retrieved = None
        if retrieved_events:
            retrieved = self.retrieve_matches(idx, lengths, min(retrieved_events, limit), retrieval_key)
            # Within the model's longest history: a retrieved event takes the place of the oldest recent one.
            lengths = np.minimum(lengths, limit - np.array([r.size for r in retrieved], dtype=np.int64))
        return SequenceBatch(
            example_index=torch.from_numpy(idx),
            timestamp=torch.from_numpy(ex["timestamp"][idx]),
            user_id=torch.from_numpy(self.user_ids[ex["user_row"][idx]].astype(np.int64)),
            item_id=torch.from_numpy(ex["item_id"][idx]),
            surface=torch.from_numpy(ex["surface"][idx].astype(np.int64)),
            sparse_features={name: torch.from_numpy(ex[name][idx]) for name in self.sparse_features},
            dense_features=torch.from_numpy(
                np.stack([ex[name][idx] for name in self.dense_features], 1).astype(np.float32)
                if self.dense_features
                else np.zeros((idx.size, 0), dtype=np.float32)
            ),
            labels=torch.from_numpy(self._label_values[idx]),
            label_mask=torch.from_numpy(self._label_mask[idx]),
            **self._histories(ex["user_row"][idx], lengths, ex["history_end"][idx], ex["timestamp"][idx], retrieved),
            retrieved_lengths=(None if retrieved is None else
                               torch.from_numpy(np.array([r.size for r in retrieved], dtype=np.int64))),
        )

    def retrieve_matches(self, indices: np.ndarray, recent: np.ndarray, most: int,
                         key: str = "item") -> list[np.ndarray]:
        """Per example: the timeline positions of the (up to `most`) latest events older than its `recent` most
        recent events that match its candidate on `key` (the candidate's item, or an item feature such as its
        category; an unknown value matches nothing), oldest first: the hard search of retrieval-based
        long-history models, a per-user index lookup on a server, which puts far history in front of the model
        at the cost of a few events instead of all between."""
        if most < 0:
            raise ValueError(f"retrieved_events must be >= 0, got {most}")
        rows, ends = self._examples["user_row"][indices], self._examples["history_end"][indices]
        wanted, timeline_values = self._retrieval_values(key, indices)
        starts = self.timeline_offsets[rows]
        found = []
        for start, end, keep, value in zip(starts, ends, recent, wanted):
            older = (start + np.flatnonzero(timeline_values[start : start + end - keep] == value) if value >= 0
                     else np.zeros(0, np.int64))  # an unknown value matches nothing
            found.append(older[-most:] if most else older[:0])
        return found

    def _retrieval_values(self, key: str, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(the candidates' values of `key`, every timeline event's), for retrieve_matches."""
        if key == "item":
            return self._examples["item_id"][indices], self._timeline["item_id"]
        offered = retrieval_keys(self.history_item_features, self.sparse_features)
        if key not in offered:
            raise ValueError(f"retrieval key {key!r} is not an item feature of both the candidates and the history "
                             f"events in {self.path}; retrieval keys here: {list(offered)}")
        if key not in self._timeline_features:
            self._timeline_features[key] = self._items.of(self._timeline["item_id"])[key].numpy()
        return self._examples[key][indices], self._timeline_features[key]

    def candidate_depths(self, indices: np.ndarray | list[int]) -> np.ndarray:
        """For each example, how many events back its candidate item last appears in the user's whole history
        before the request (1: the latest event; 0: never), beyond any history cap: what a server's per-user
        index of last interactions answers with one lookup per candidate."""
        idx = np.asarray(indices, dtype=np.int64)
        rows, ends, items = (self._examples["user_row"][idx], self._examples["history_end"][idx],
                             self._examples["item_id"][idx])
        starts = self.timeline_offsets[rows]
        timeline_items = self._timeline["item_id"]
        depths = np.zeros(idx.size, dtype=np.int64)
        for i, (start, end, item) in enumerate(zip(starts, ends, items)):
            seen = np.flatnonzero(timeline_items[start : start + end] == item)
            if seen.size:
                depths[i] = end - seen[-1]
        return depths

    def neutral_requests(self, user_rows: np.ndarray, request_ms: np.ndarray, surfaces: np.ndarray, item_id: int,
                         max_history_len: int | None = None) -> SequenceBatch:
        """Requests with no candidate (item `item_id`, unknown item features, no dense features, no labels)
        of the timelines' users `user_rows` at times `request_ms` on `surfaces`: each one's history is the
        user's events strictly before its time (the most recent max_history_len of them)."""
        user_rows = np.asarray(user_rows, dtype=np.int64)
        request_ms = np.asarray(request_ms, dtype=np.int64)
        ts = self._timeline["timestamp"]
        starts, stops = self.timeline_offsets[user_rows], self.timeline_offsets[user_rows + 1]
        ends = np.array([np.searchsorted(ts[a:b], t) for a, b, t in zip(starts, stops, request_ms)], dtype=np.int64)
        limit = self.max_history_len if max_history_len is None else min(max_history_len, self.max_history_len)
        n = user_rows.size
        return SequenceBatch(
            example_index=torch.full((n,), -1, dtype=torch.int64),
            timestamp=torch.from_numpy(request_ms),
            user_id=torch.from_numpy(self.user_ids[user_rows].astype(np.int64)),
            item_id=torch.full((n,), item_id, dtype=torch.int64),
            surface=torch.from_numpy(np.asarray(surfaces, dtype=np.int64)),
            sparse_features={name: torch.full((n,), -1, dtype=torch.int64) for name in self.sparse_features},
            dense_features=torch.zeros(n, len(self.dense_features)),
            labels=torch.zeros(n, len(self.objectives)),
            label_mask=torch.zeros(n, len(self.objectives), dtype=torch.bool),
            **self._histories(user_rows, np.minimum(ends, limit), ends, request_ms),
        )

    def _histories(self, user_rows: np.ndarray, lengths: np.ndarray, ends: np.ndarray, request_ms: np.ndarray,
                   retrieved: list[np.ndarray] | None = None) -> dict[str, torch.Tensor]:
        """The jagged history fields of requests: each one's `lengths` timeline events before its `ends`, after
        its `retrieved` timeline positions when given."""
        end = self.timeline_offsets[user_rows] + ends
        offsets = np.zeros(lengths.size + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        # Flat positions of every history event: each request's run [end - length, end).
        positions = np.repeat(end - lengths - offsets[:-1], lengths) + np.arange(offsets[-1], dtype=np.int64)
        if retrieved is not None:
            runs = np.split(positions, offsets[1:-1])
            positions = np.concatenate([np.concatenate([r, run]) for r, run in zip(retrieved, runs)] or [positions])
            lengths = lengths + np.array([r.size for r in retrieved], dtype=np.int64)
            offsets = np.zeros(lengths.size + 1, dtype=np.int64)
            np.cumsum(lengths, out=offsets[1:])
        request_ts = np.repeat(request_ms, lengths)
        t = self._timeline
        return {
            "history_offsets": torch.from_numpy(offsets),
            "history_item_id": torch.from_numpy(t["item_id"][positions]),
            "history_surface": torch.from_numpy(t["surface"][positions].astype(np.int64)),
            "history_event_type": torch.from_numpy(t["event_type"][positions].astype(np.int64)),
            "history_action": torch.from_numpy(t["action"][positions].astype(np.int64)),
            "history_age_seconds": torch.from_numpy(((request_ts - t["timestamp"][positions]) / 1000.0)
                                                    .astype(np.float32)),
            "history_item_features": self._items.of(t["item_id"][positions]),
        }


class ItemFeatures:
    """Item id -> its sparse item features (items.parquet), looked up for history events."""

    def __init__(self, path: Path, names: list[str]):
        self.names = names
        if not names:
            self.ids, self.values = np.zeros(0, np.int64), {}
            return
        table = pq.read_table(path, columns=["item_id", *names])
        self.ids = table.column("item_id").to_numpy()  # sorted by the writer
        self.values = {name: _column(table, name, fill_null=-1).astype(np.int64) for name in names}

    def of(self, item_ids: np.ndarray) -> dict[str, torch.Tensor]:
        if not self.names:
            return {}
        row = np.searchsorted(self.ids, item_ids).clip(max=max(len(self.ids) - 1, 0))
        known = self.ids[row] == item_ids
        return {name: torch.from_numpy(np.where(known, values[row], -1)) for name, values in self.values.items()}


@dataclass
class TrainingData:
    """Prepared training data: sequence_logs/ and, per world size, its Base Batch Shuffling plan."""

    sequence_logs: Path
    plans: dict[int, Path] = field(default_factory=dict)  # world size -> plan

    @classmethod
    def at(cls, root: str | os.PathLike) -> TrainingData:
        """What prepare_training_data wrote under `root` (reading it needs no polars)."""
        root = Path(root)
        if not (root / "sequence_logs").is_dir():
            raise FileNotFoundError(f"{root} holds no prepared data: {root / 'sequence_logs'} is missing")
        plans = {int(p.stem.split("=")[1]): p for p in (root / "plans").glob("world_size=*.parquet")}
        return cls(root / "sequence_logs", plans)

    def open(self) -> SequenceLogs:
        return SequenceLogs(self.sequence_logs)


def _read_tables(folder: Path) -> pa.Table:
    files = sorted(folder.glob("*.parquet"))
    if not files:
        raise FileNotFoundError(f"no Parquet files in {folder}: not a sequence_logs folder")
    return pa.concat_tables(pq.read_table(f) for f in files)


def _flat_values(column: pa.ChunkedArray) -> np.ndarray:
    """The values of a list column, all rows back to back (the rows' slices are the offsets)."""
    return column.combine_chunks().flatten().to_numpy(zero_copy_only=False)


def _column(table: pa.Table, name: str, fill_null=None) -> np.ndarray:
    column = table.column(name)
    if fill_null is not None:
        column = pc.fill_null(column, fill_null)
    return column.to_numpy()
