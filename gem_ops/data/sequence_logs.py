"""sequence_logs: user timelines stored once as jagged columns, and training examples that point into them.

Layout of a sequence_logs folder (written atomically):
    timelines/         Parquet parts, one row per user: user_id and list columns item_id, timestamp (ms), surface,
                       event_type, action (bitmask of positive labels), sorted by time
    examples/          Parquet parts, one row per labelled event (a request): user_row (row in timelines),
                       history_end (how many of that user's timeline events are strictly earlier),
                       the candidate's features and labels, and split (0 train, 1 eval)
    manifest.json      vocabularies, column roles, counts, the eval cut-off and the config

A request's history is timeline[user_row][history_end - L : history_end] with L = min(history_end,
max_history_len): the user's events strictly before the request time, most recent last, so nothing at
or after the request leaks in. Storage grows with events, not events x history length.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow as pa

from gem_ops.data.atomic import atomic_path
from gem_ops.data.heap import reusable_heap
from gem_ops.data.raw_event_reading import (EventEncoder, Events, declares_mergeable_order, per_file_times,
                                            read_bucket, read_category_codes, read_events, user_range_chunks)
from gem_ops.data.schema import CATEGORY_COLUMNS, classify_columns
from gem_ops.data.sequence_layout import (  # noqa: F401
    EXAMPLES, ITEM_FEATURE_PREFIX, ITEMS, MANIFEST, TIMELINE_FIELDS, TIMELINES, read_manifest)
from gem_ops.data.sequence_log_writer import SequenceLogsWriter, StageTimer
from gem_ops.data.timeline_runs import TimelineRuns, mergeable, sort_order


@dataclass(frozen=True)
class SequenceLogsConfig:
    max_history_len: int = 1024
    """Histories longer than this keep their most recent events."""
    eval_days: int = 1
    """Requests on the last `eval_days` calendar days (UTC) of the data form the eval split."""
    history_event_types: tuple[str, ...] | None = None
    """Event types that join timelines; None means all (MovieLens keeps sampled negatives out)."""
    max_events_in_memory: int = 30_000_000
    """Above this many events, input is read a range (or, for files that do not declare their order,
    a hash bucket) of users at a time, so memory stays bounded."""
    chunk_events: int = 2_000_000
    """Users are processed in ranges of about this many events: a smaller working set is faster."""

    def __post_init__(self):
        if self.max_history_len < 1:
            raise ValueError(f"max_history_len must be >= 1, got {self.max_history_len}")
        if self.eval_days < 0:
            raise ValueError(f"eval_days must be >= 0, got {self.eval_days}")
        for name in ("max_events_in_memory", "chunk_events"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


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
    n_user_ranges: int
    eval_start: str | None
    surfaces: list[str]
    event_types: list[str]
    objectives: list[str]
    sparse_features: list[str]
    dense_features: list[str]
    timeline_length_quantiles: dict[str, float] = field(default_factory=dict)
    history_length_quantiles: dict[str, float] = field(default_factory=dict)
    stage_seconds: dict[str, float] = field(default_factory=dict)
    item_features: list[str] = field(default_factory=list)  # sparse item features history events carry


def build_sequence_logs(
    event_paths: Sequence[str | os.PathLike], destination: str | os.PathLike, config: SequenceLogsConfig
) -> SequenceLogsSummary:
    """Builds a sequence_logs folder from event-log Parquet files already in the canonical schema."""
    if not event_paths:
        raise ValueError("build_sequence_logs needs at least one event-log file")
    timer = StageTimer()
    paths = [str(p) for p in event_paths]
    columns = classify_columns(pl.scan_parquet(paths).collect_schema(), source=paths[0])
    with timer("scan"):
        per_file = per_file_times(paths)
        paths = per_file["_file"].to_list()  # in time order: merging per-file runs relies on it
        categories = {path: read_category_codes(path) for path in paths}
    n_events = int(per_file["n"].sum())
    declared_mergeable = declares_mergeable_order(per_file)
    if n_events == 0:
        raise ValueError(f"no events in {len(paths)} event-log file(s), e.g. {paths[0]}")
    surfaces, event_types = (sorted({v for c in categories.values() for v in c[name][1]}) for name in CATEGORY_COLUMNS)
    eval_start = None
    if config.eval_days > 0:
        last = datetime.fromtimestamp(per_file["last"].max() / 1000, tz=timezone.utc)
        eval_start = last.date() - timedelta(days=config.eval_days - 1)
    eval_start_ms = _epoch_ms(eval_start) if eval_start else np.iinfo(np.int64).max
    history_types = config.history_event_types
    if history_types is not None and not set(history_types) & set(event_types):
        raise ValueError(f"history_event_types {list(history_types)} match no event_type in the data ({event_types})")

    # Inputs that fit are read whole (fastest). Larger ones that declare their order stream one range
    # of users at a time; larger undeclared ones are read in hash buckets of users.
    fits = n_events <= config.max_events_in_memory
    streaming = declared_mergeable and not fits
    n_buckets = 1 if fits or streaming else math.ceil(n_events / config.max_events_in_memory)
    encoder = EventEncoder(surfaces, event_types, history_types, columns)
    if n_buckets > 1:
        categories.clear()  # codes come from each bucket's own strings: keep memory bounded
    else:
        with timer("scan"):
            codes = {path: encoder.codes(categories.pop(path)) for path in paths}
    with atomic_path(destination) as tmp, reusable_heap():
        writer = SequenceLogsWriter(tmp, config.max_history_len, timer)
        try:
            if streaming:
                chunk_events = min(config.chunk_events, config.max_events_in_memory)
                _build_streaming(paths, codes, encoder, chunk_events, eval_start_ms, writer, timer)
            elif n_buckets == 1:
                with timer("read"):
                    events = read_events([(p, 0, n) for p, n in zip(paths, per_file["n"])], encoder, codes)
                _build(events, encoder, config.chunk_events, declared_mergeable, eval_start_ms, writer, timer,
                       examples_per_part=True)
            else:
                for bucket in range(n_buckets):
                    with timer("read"):
                        events = read_bucket(paths, encoder, bucket, n_buckets)
                    _build(events, encoder, config.chunk_events, False, eval_start_ms, writer, timer,
                           examples_per_part=True)
        finally:
            writer.close()
        summary = SequenceLogsSummary(
            path=str(destination),
            n_events=n_events,
            n_users=writer.n_users,
            n_timeline_events=writer.n_timeline_events,
            n_examples=writer.n_examples,
            n_train=writer.n_examples - writer.n_eval,
            n_eval=writer.n_eval,
            n_buckets=n_buckets,
            n_user_ranges=writer.n_timeline_parts,
            eval_start=eval_start.isoformat() if eval_start else None,
            surfaces=surfaces,
            event_types=event_types,
            objectives=list(columns.objectives),
            sparse_features=list(columns.sparse_features),
            dense_features=list(columns.dense_features),
            timeline_length_quantiles=writer.timeline_quantiles(),
            history_length_quantiles=writer.history_quantiles(),
            stage_seconds=timer.seconds,
        )
        with timer("items"):
            item_features = _write_items(paths, columns, tmp / ITEMS)
        summary.item_features = item_features
        summary.stage_seconds = timer.seconds
        manifest = {"summary": asdict(summary), "config": asdict(config), "labels": list(columns.labels)}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2, default=str))
    return summary


def _write_items(paths: list[str], columns, destination: Path) -> list[str]:
    """items.parquet: every item's sparse item features (their last values in file order); returns their
    names. History events read their items' features from it, organic views and all."""
    names = [c for c in columns.sparse_features if c.startswith(ITEM_FEATURE_PREFIX)]
    items = (pl.scan_parquet(paths).select(["item_id", *names])
             .unique(subset="item_id", keep="last", maintain_order=False)
             .sort("item_id").collect())
    items.write_parquet(destination)
    return names


def _build_streaming(paths, codes, encoder: EventEncoder, chunk_events: int, eval_start_ms: int,
                     writer: SequenceLogsWriter, timer: StageTimer) -> None:
    """Files that declare (user, time) order over disjoint days: one range of users at a time is read
    (a row slice of every file), so memory holds one range, whatever the total."""
    with timer("scan"):
        users = {p: pl.read_parquet(p, columns=["user_id"])["user_id"].to_numpy() for p in paths}
    for chunk in user_range_chunks([users[p] for p in paths], chunk_events):
        with timer("read"):  # user ids were read already: the slices skip that column
            events = read_events([(paths[i], a, b) for i, a, b in chunk], encoder, codes, users)
        # One timelines part and one examples part per range.
        _build(events, encoder, max(events.n, 1), True, eval_start_ms, writer, timer, examples_per_part=False)


def _build(events: Events, encoder: EventEncoder, chunk_events: int, declared_mergeable: bool, eval_start_ms: int,
           writer: SequenceLogsWriter, timer: StageTimer, examples_per_part: bool) -> None:
    """Timelines of the users in `events` (written in ranges of about chunk_events events), then the
    examples of each part, in input order, with their pointers into the timelines."""
    if events.n == 0:
        return
    # Labels and features of each part's labelled rows are read in a thread from the start: polars
    # releases the GIL, so the reading overlaps the numpy work of ordering and timelines.
    with ThreadPoolExecutor(max_workers=1) as reader:
        inputs = [reader.submit(source.filter(encoder.labelled).select(encoder.example_columns).collect)
                  for source in events.sources]
        try:
            _build_with_inputs(events, inputs, encoder, chunk_events, declared_mergeable, eval_start_ms, writer,
                               timer, examples_per_part)
        finally:
            for future in inputs:
                future.cancel()


def _build_with_inputs(events: Events, inputs: list[Future], encoder: EventEncoder, chunk_events: int,
                       declared_mergeable: bool, eval_start_ms: int, writer: SequenceLogsWriter, timer: StageTimer,
                       examples_per_part: bool) -> None:
    user_base = writer.n_users
    with timer("order"):
        c = events.columns
        if declared_mergeable or mergeable(c["user_id"], c["timestamp"], events.part_offsets):
            merged, order = events, None
        else:  # overlapping or unsorted parts: one global sort
            order = sort_order(c["user_id"], c["timestamp"])
            merged = events.permuted(order)
        runs = TimelineRuns(merged, encoder.history_codes)
    for first, last in runs.user_chunks(chunk_events):
        with timer("timelines"):
            pos = runs.positions(first, last)
            lengths = runs.timeline_lengths[first:last]
            offsets = _arrow_view(np.concatenate([[0], np.cumsum(lengths)]))
            timelines = pl.DataFrame(
                [pl.Series(_ArrowArray(_arrow_view(runs.user_ids[first:last]))).alias("user_id")]
                + [pl.Series(_ArrowArray(pa.LargeListArray.from_arrays(offsets, _arrow_view(merged.columns[k][pos]))))
                   .alias(k) for k in TIMELINE_FIELDS]
            )
            del pos
        writer.write_timelines(timelines, lengths)  # in the background, while the next range is made
        del timelines
    if order is not None:  # pointers in sorted order, put back into input order
        with timer("pointers"):
            user_row, history_end = np.empty(events.n, dtype=np.int32), np.empty(events.n, dtype=np.int32)
            user_row[order], history_end[order] = runs.pointers(merged, 0, events.n, user_base)
        del merged, runs
    frames = []
    for k, part_inputs in enumerate(inputs):
        start, stop = int(events.part_offsets[k]), int(events.part_offsets[k + 1])
        if start == stop:
            continue
        labelled = events.columns["labelled"][start:stop]
        rows = None if labelled.all() else np.flatnonzero(labelled)  # gathering by index is faster than a mask
        with timer("pointers"):  # of the labelled events only
            if order is None:
                user_row_k, history_end_k = runs.pointers(events, start, stop, user_base, rows)
            else:
                user_row_k, history_end_k = (_take(a[start:stop], rows) for a in (user_row, history_end))
        with timer("read"):
            labels_and_features = part_inputs.result()
        frames.append(_examples(events, start, stop, rows, user_row_k, history_end_k, labels_and_features,
                                eval_start_ms, timer))
        if examples_per_part:
            writer.write_examples(frames.pop())
    if frames:
        writer.write_examples(frames[0] if len(frames) == 1 else pl.concat(frames))


def _take(values: np.ndarray, rows: np.ndarray | None) -> np.ndarray:
    return values if rows is None else values[rows]


def _examples(events: Events, start: int, stop: int, rows: np.ndarray | None, user_row: np.ndarray,
              history_end: np.ndarray, inputs: pl.DataFrame, eval_start_ms: int, timer: StageTimer) -> pl.DataFrame:
    """The labelled events (`rows`, or all) of one part, in its order, with their pointers into the
    timelines and their labels and features (`inputs`, read for those rows)."""
    with timer("examples"):
        if inputs.height != (stop - start if rows is None else len(rows)):
            raise RuntimeError("labelled rows of the input changed while sequence_logs was being built")
        c = events.columns
        ts = _take(c["timestamp"][start:stop], rows)
        return inputs.select(
            pl.Series("user_row", user_row),
            pl.Series("history_end", history_end),
            pl.Series("timestamp", ts),
            pl.Series("item_id", _take(c["item_id"][start:stop], rows)),
            pl.Series("surface", _take(c["surface"][start:stop], rows)),
            pl.Series("event_type", _take(c["event_type"][start:stop], rows)),
            *inputs.columns,
            pl.Series("split", (ts >= eval_start_ms).astype(np.int8)),
        )


def _arrow_view(values: np.ndarray) -> pa.Array:
    """A contiguous numpy array as an Arrow array without a copy (pa.array would import pandas)."""
    values = np.ascontiguousarray(values)
    return pa.Array.from_buffers(pa.from_numpy_dtype(values.dtype), len(values), [None, pa.py_buffer(values)])


class _ArrowArray:
    """Hands an Arrow array to polars through the Arrow C data interface: polars' pyarrow path imports
    pyarrow.compute, which is slow to import."""

    def __init__(self, array: pa.Array):
        self.array = array

    def __arrow_c_array__(self, requested_schema=None):
        return self.array.__arrow_c_array__(requested_schema)


def _epoch_ms(day) -> int:
    return int(datetime(day.year, day.month, day.day, tzinfo=timezone.utc).timestamp() * 1000)
