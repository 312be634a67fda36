"""sequence_logs: user timelines stored once as jagged columns, and training examples that point into them.

Layout of a sequence_logs folder (written atomically):
    timelines/         Parquet parts, one row per user: user_id and list columns item_id, timestamp (ms), surface,
                       event_type, action (bitmask of positive labels), sorted by time
    examples/          Parquet parts, one row per labelled event (a request): user_row (row in timelines),
                       history_end (how many of that user's timeline events are strictly earlier),
                       history_len (history_end truncated to max_history_len), the candidate's
                       features and labels, and split (0 train, 1 eval)
    manifest.json      vocabularies, column roles, counts, the eval cut-off and the config

A request's history is timeline[user_row][history_end - history_len : history_end]: every event of
the same user strictly before the request time, most recent last, so nothing at or after the request
leaks in. Storage grows with events, not events x history length.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from gem_ops.data.atomic import atomic_path
from gem_ops.data.schema import EventLogColumns, classify_columns

TIMELINE_FIELDS = ("item_id", "timestamp", "surface", "event_type", "action")
MANIFEST = "manifest.json"
TIMELINES = "timelines"
EXAMPLES = "examples"


@dataclass(frozen=True)
class SequenceLogsConfig:
    max_history_len: int = 1024
    """Histories longer than this keep their most recent events."""
    eval_days: int = 1
    """Requests on the last `eval_days` calendar days (UTC) of the data form the eval split."""
    history_event_types: tuple[str, ...] | None = None
    """Event types that join timelines; None means all (MovieLens keeps sampled negatives out)."""
    max_events_in_memory: int = 30_000_000
    """Above this many events, users are processed in hash buckets so memory stays bounded."""

    def __post_init__(self):
        if self.max_history_len < 1:
            raise ValueError(f"max_history_len must be >= 1, got {self.max_history_len}")
        if self.eval_days < 0:
            raise ValueError(f"eval_days must be >= 0, got {self.eval_days}")
        if self.max_events_in_memory < 1:
            raise ValueError(f"max_events_in_memory must be >= 1, got {self.max_events_in_memory}")


@dataclass
class SequenceLogsSummary:
    path: str
    n_events: int
    n_users: int
    n_timeline_events: int
    n_examples: int
    n_train: int
    n_eval: int
    n_buckets: int
    eval_start: str | None
    surfaces: list[str]
    event_types: list[str]
    objectives: list[str]
    sparse_features: list[str]
    dense_features: list[str]
    timeline_length_quantiles: dict[str, float] = field(default_factory=dict)
    history_length_quantiles: dict[str, float] = field(default_factory=dict)


def build_sequence_logs(
    event_paths: Sequence[str | os.PathLike], destination: str | os.PathLike, config: SequenceLogsConfig
) -> SequenceLogsSummary:
    """Builds a sequence_logs folder from event-log Parquet files already in the canonical schema."""
    if not event_paths:
        raise ValueError("build_sequence_logs needs at least one event-log file")
    paths = [str(p) for p in event_paths]
    scan = pl.scan_parquet(paths, include_file_paths="_file")
    columns = classify_columns(scan.drop("_file").collect_schema(), source=paths[0])
    per_file = (
        scan.group_by("_file")
        .agg(pl.len().alias("n"), pl.col("timestamp").min().alias("first"), pl.col("timestamp").max().alias("last"),
             pl.col("surface").unique().alias("surfaces"), pl.col("event_type").unique().alias("event_types"))
        .sort("first")
        .collect()
    )
    paths = per_file["_file"].to_list()  # in time order: the merge in _user_time_order relies on it
    n_events = int(per_file["n"].sum())
    surfaces = sorted(set(per_file["surfaces"].explode().to_list()))
    event_types = sorted(set(per_file["event_types"].explode().to_list()))
    eval_start = None
    if config.eval_days > 0:
        eval_start = per_file["last"].max().date() - timedelta(days=config.eval_days - 1)
    eval_start_ms = _epoch_ms(eval_start) if eval_start else np.iinfo(np.int64).max
    history_types = config.history_event_types
    if history_types is not None and not set(history_types) & set(event_types):
        raise ValueError(f"history_event_types {list(history_types)} match no event_type in the data ({event_types})")

    n_buckets = max(1, math.ceil(n_events / config.max_events_in_memory))
    encoder = _Encoder(surfaces, event_types, history_types, columns)
    with atomic_path(destination) as tmp:
        writer = _SequenceLogsWriter(tmp)
        for bucket in range(n_buckets):
            parts = []
            for path in paths:
                part = pl.scan_parquet(path).select(columns.all)
                if n_buckets > 1:  # each user lands in exactly one bucket: timelines never split
                    part = part.filter(pl.col("user_id").hash(seed=0) % n_buckets == bucket)
                parts.append(part.collect())
            if sum(p.height for p in parts):
                writer.write(*_build_chunk(parts, encoder, config.max_history_len, eval_start_ms, writer.n_users))
        summary = SequenceLogsSummary(
            path=str(destination),
            n_events=n_events,
            n_users=writer.n_users,
            n_timeline_events=writer.n_timeline_events,
            n_examples=writer.n_examples,
            n_train=writer.n_examples - writer.n_eval,
            n_eval=writer.n_eval,
            n_buckets=n_buckets,
            eval_start=eval_start.isoformat() if eval_start else None,
            surfaces=surfaces,
            event_types=event_types,
            objectives=list(columns.objectives),
            sparse_features=list(columns.sparse_features),
            dense_features=list(columns.dense_features),
            timeline_length_quantiles=writer.timeline_quantiles(),
            history_length_quantiles=writer.history_quantiles(),
        )
        manifest = {"summary": asdict(summary), "config": asdict(config), "labels": list(columns.labels)}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2, default=str))
    return summary


def read_manifest(path: str | os.PathLike) -> dict:
    return json.loads((Path(path) / MANIFEST).read_text())


class _Encoder:
    """Maps strings to small integer codes and labels to the action bitmask."""

    def __init__(self, surfaces, event_types, history_types, columns: EventLogColumns):
        self.surface = pl.Enum(surfaces)
        self.event_type = pl.Enum(event_types)
        self.history_codes = None if history_types is None else [event_types.index(t) for t in history_types if t in event_types]
        self.columns = columns
        if len(columns.labels) > 8:
            raise ValueError(f"at most 8 objectives fit the action bitmask, found {len(columns.labels)}")

    def encode(self, frame: pl.DataFrame) -> pl.DataFrame:
        action = pl.lit(0, pl.Int8)
        for bit, name in enumerate(self.columns.labels):
            action = action + (pl.col(name).fill_null(0) == 1).cast(pl.Int8) * (1 << bit)
        return frame.with_columns(
            pl.col("timestamp").dt.epoch("ms").alias("timestamp"),
            pl.col("surface").cast(self.surface).to_physical().cast(pl.Int8),
            pl.col("event_type").cast(self.event_type).to_physical().cast(pl.Int8),
            action.alias("action"),
            pl.any_horizontal(pl.col(c).is_not_null() for c in self.columns.labels).alias("_labelled"),
        )


def _is_user_time_sorted(user: np.ndarray, ts: np.ndarray) -> bool:
    du, dt = np.diff(user), np.diff(ts)
    return bool(np.all((du > 0) | ((du == 0) & (dt >= 0))))


def _user_time_order(user: np.ndarray, ts: np.ndarray, part_offsets: np.ndarray) -> np.ndarray:
    """The permutation that puts events in (user, time) order.

    raw_event_logs stores each daily partition sorted by (user_id, timestamp), and the partitions
    cover disjoint days, so each user's timeline is the concatenation of one run per partition:
    ordering the runs is enough, and the gathers that follow read memory in runs, not at random.
    Anything else (overlapping or unsorted parts) falls back to one global sort.
    """
    bounds = list(zip(part_offsets[:-1], part_offsets[1:]))
    parts_sorted = all(_is_user_time_sorted(user[a:b], ts[a:b]) for a, b in bounds if b > a)
    disjoint = all(ts[b1 - 1] <= ts[a2] for (a1, b1), (a2, b2) in zip(bounds, bounds[1:]) if b1 > a1 and b2 > a2)
    if not (parts_sorted and disjoint):
        return _sort_order(user, ts)
    n = len(user)
    new_run = np.empty(n, dtype=bool)
    new_run[0] = True
    np.not_equal(user[1:], user[:-1], out=new_run[1:])
    new_run[part_offsets[1:-1]] = True
    run_start = np.flatnonzero(new_run)
    run_len = np.diff(np.append(run_start, n))
    # Runs appear in partition order, so a stable sort by user keeps each user's runs in time order.
    run_order = _stable_argsort(user[run_start])
    run_start, run_len = run_start[run_order], run_len[run_order]
    out_start = np.cumsum(run_len) - run_len
    return np.repeat(run_start - out_start, run_len) + np.arange(n, dtype=np.int64)


def _sort_order(user: np.ndarray, ts: np.ndarray) -> np.ndarray:
    """Stable (user, time) order; one packed integer key when the value ranges allow it."""
    u0, t0 = user.min(), ts.min()
    user_bits, time_bits = int(user.max() - u0).bit_length(), int(ts.max() - t0).bit_length()
    if user_bits + time_bits <= 63:
        key = ((user - u0) << time_bits) | (ts - t0)
        return _stable_argsort(key)
    return _stable_argsort(user, ts)


def _stable_argsort(*keys: np.ndarray) -> np.ndarray:
    frame = pl.DataFrame({f"k{i}": k for i, k in enumerate(keys)})
    return frame.select(pl.arg_sort_by(frame.columns, maintain_order=True)).to_series().to_numpy()


def _build_chunk(parts: list[pl.DataFrame], encoder: _Encoder, max_len: int, eval_start_ms: int, user_base: int):
    """One bucket of users: timelines in (user, time) order; examples in input order."""
    parts = [encoder.encode(p) for p in parts if p.height]
    part_offsets = np.cumsum([0] + [p.height for p in parts])
    events = pl.concat(parts, rechunk=False)
    n = events.height
    user = events["user_id"].to_numpy()
    ts = events["timestamp"].to_numpy()
    order = _user_time_order(user, ts, part_offsets)
    user_s, ts_s = user[order], ts[order]

    new_user = np.empty(n, dtype=bool)
    new_user[0] = True
    np.not_equal(user_s[1:], user_s[:-1], out=new_user[1:])
    new_run = new_user.copy()
    new_run[1:] |= ts_s[1:] != ts_s[:-1]  # a run is one user's events at one instant

    event_type_s = events["event_type"].to_numpy()[order]
    is_hist = None if encoder.history_codes is None else np.isin(event_type_s, encoder.history_codes)
    if is_hist is None:
        hist_before = np.arange(n, dtype=np.int64)  # history events earlier in (user, time) order
    else:
        hist_before = np.cumsum(is_hist, dtype=np.int64) - is_hist

    run_id = np.cumsum(new_run) - 1
    user_id_of_row = np.cumsum(new_user) - 1
    user_first = np.flatnonzero(new_user)
    # Strictly before the request: history events before the first event at this instant.
    history_end_s = hist_before[np.flatnonzero(new_run)[run_id]] - hist_before[user_first[user_id_of_row]]
    pointer_s = (user_id_of_row + user_base) << 32 | history_end_s  # user_row and history_end, one scatter
    pointer = np.empty(n, dtype=np.int64)
    pointer[order] = pointer_s

    timeline = {"item_id": events["item_id"].to_numpy()[order], "timestamp": ts_s, "event_type": event_type_s,
                "surface": events["surface"].to_numpy()[order], "action": events["action"].to_numpy()[order]}
    if is_hist is None:
        hist_per_user = np.diff(np.append(user_first, n))
    else:
        timeline = {k: v[is_hist] for k, v in timeline.items()}
        hist_per_user = np.add.reduceat(is_hist.astype(np.int64), user_first)
    offsets = pa.array(np.concatenate([[0], np.cumsum(hist_per_user)]))
    timelines = pl.DataFrame(
        {"user_id": user_s[user_first]}
        | {k: pl.Series(k, pa.LargeListArray.from_arrays(offsets, pa.array(timeline[k]))) for k in TIMELINE_FIELDS}
    )

    c = encoder.columns
    user_row = (pointer >> 32).astype(np.int32)
    history_end = (pointer & 0xFFFFFFFF).astype(np.int32)
    examples = events.select(
        pl.Series("user_row", user_row),
        pl.Series("history_end", history_end),
        pl.Series("history_len", np.minimum(history_end, max_len)),
        "timestamp", "item_id", "surface", "event_type", *c.labels, *c.sparse_features, *c.dense_features,
        (pl.col("timestamp") >= eval_start_ms).cast(pl.Int8).alias("split"),
        "_labelled",
    )
    if not bool(examples["_labelled"].all()):
        examples = examples.filter("_labelled")
    return timelines, examples.drop("_labelled"), hist_per_user


class _SequenceLogsWriter:
    """Writes each bucket of users as one part file of timelines and one of examples."""

    def __init__(self, folder: Path):
        self.folder = folder
        (folder / TIMELINES).mkdir(parents=True)
        (folder / EXAMPLES).mkdir()
        self.n_parts = self.n_users = self.n_timeline_events = self.n_examples = self.n_eval = 0
        self._timeline_lengths: list[np.ndarray] = []
        self._history_lengths: list[np.ndarray] = []

    def write(self, timelines: pl.DataFrame, examples: pl.DataFrame, timeline_lengths: np.ndarray):
        name = f"part-{self.n_parts:05d}.parquet"
        timelines.write_parquet(self.folder / TIMELINES / name, compression="lz4")
        examples.write_parquet(self.folder / EXAMPLES / name, compression="lz4")
        self.n_parts += 1
        self.n_users += timelines.height
        self.n_timeline_events += int(timeline_lengths.sum())
        self.n_examples += examples.height
        self.n_eval += int(examples["split"].sum())
        self._timeline_lengths.append(timeline_lengths)
        self._history_lengths.append(examples["history_len"].to_numpy())

    def timeline_quantiles(self) -> dict[str, float]:
        return _quantiles(np.concatenate(self._timeline_lengths)) if self._timeline_lengths else {}

    def history_quantiles(self) -> dict[str, float]:
        return _quantiles(np.concatenate(self._history_lengths)) if self._history_lengths else {}


def _quantiles(values: np.ndarray) -> dict[str, float]:
    if values.size == 0:
        return {}
    qs = {"p50": 0.5, "p90": 0.9, "p99": 0.99, "max": 1.0}
    out = {k: float(np.quantile(values, q)) for k, q in qs.items()}
    out["mean"] = float(values.mean())
    return out


def _epoch_ms(day) -> int:
    return int(datetime(day.year, day.month, day.day, tzinfo=timezone.utc).timestamp() * 1000)
