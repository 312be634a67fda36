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

import contextlib
import json
import math
import os
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

from gem_ops.data.atomic import atomic_path
from gem_ops.data.heap import reusable_heap
from gem_ops.data.sequence_layout import (  # noqa: F401
    EXAMPLES, ITEM_FEATURE_PREFIX, ITEMS, MANIFEST, TIMELINE_FIELDS, TIMELINES, read_manifest)
from gem_ops.data.schema import CATEGORY_COLUMNS, SORTED_BY_KEY, USER_TIME_ORDER, EventLogColumns, classify_columns



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
        per_file = _per_file_times(paths)
        paths = per_file["_file"].to_list()  # in time order: merging per-file runs relies on it
        categories = {path: _read_category_codes(path) for path in paths}
    n_events = int(per_file["n"].sum())
    declared_mergeable = _declared_mergeable(per_file)
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
    encoder = _Encoder(surfaces, event_types, history_types, columns)
    if n_buckets > 1:
        categories.clear()  # codes come from each bucket's own strings: keep memory bounded
    else:
        with timer("scan"):
            codes = {path: encoder.codes(categories.pop(path)) for path in paths}
    with atomic_path(destination) as tmp, reusable_heap():
        writer = _SequenceLogsWriter(tmp, config.max_history_len, timer)
        try:
            if streaming:
                chunk_events = min(config.chunk_events, config.max_events_in_memory)
                _build_streaming(paths, codes, encoder, chunk_events, eval_start_ms, writer, timer)
            elif n_buckets == 1:
                with timer("read"):
                    events = _read_events([(p, 0, n) for p, n in zip(paths, per_file["n"])], encoder, codes)
                _build(events, encoder, config.chunk_events, declared_mergeable, eval_start_ms, writer, timer,
                       examples_per_part=True)
            else:
                for bucket in range(n_buckets):
                    with timer("read"):
                        events = _read_bucket(paths, encoder, bucket, n_buckets)
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


def _build_streaming(paths, codes, encoder: _Encoder, chunk_events: int, eval_start_ms: int,
                     writer: _SequenceLogsWriter, timer: StageTimer) -> None:
    """Files that declare (user, time) order over disjoint days: one range of users at a time is read
    (a row slice of every file), so memory holds one range, whatever the total."""
    with timer("scan"):
        users = {p: pl.read_parquet(p, columns=["user_id"])["user_id"].to_numpy() for p in paths}
    for chunk in _user_range_chunks([users[p] for p in paths], chunk_events):
        with timer("read"):  # user ids were read already: the slices skip that column
            events = _read_events([(paths[i], a, b) for i, a, b in chunk], encoder, codes, users)
        # One timelines part and one examples part per range.
        _build(events, encoder, max(events.n, 1), True, eval_start_ms, writer, timer, examples_per_part=False)


def _per_file_times(paths: list[str]) -> pl.DataFrame:
    """Rows and first/last timestamp (ms) of each file, from Parquet statistics where the writer kept
    them (raw values: converting them to datetimes would import pandas)."""
    rows = []
    for path in paths:
        meta = pq.ParquetFile(path).metadata
        stats = [_column_stats(meta.row_group(i), "timestamp") for i in range(meta.num_row_groups)]
        if meta.num_rows and all(s is not None and s.has_min_max and _is_ms(s) for s in stats):
            first, last = min(s.min_raw for s in stats), max(s.max_raw for s in stats)
        else:
            ms = pl.col("timestamp").dt.cast_time_unit("ms").to_physical()
            first, last = pl.scan_parquet(path).select(ms.min(), ms.max()).collect().row(0)
        declared = (meta.metadata or {}).get(SORTED_BY_KEY.encode(), b"").decode()
        rows.append({"_file": path, "n": meta.num_rows, "first": first, "last": last,
                     "sorted": declared == USER_TIME_ORDER})
    schema = {"_file": pl.String, "n": pl.Int64, "first": pl.Int64, "last": pl.Int64, "sorted": pl.Boolean}
    return pl.DataFrame(rows, schema=schema).sort("first", nulls_last=True)


def _column_stats(row_group, name: str):
    for i in range(row_group.num_columns):
        if row_group.column(i).path_in_schema == name:
            return row_group.column(i).statistics
    return None


def _is_ms(stats) -> bool:
    return stats.physical_type == "INT64" and "milliseconds" in str(stats.logical_type)


def _declared_mergeable(per_file: pl.DataFrame) -> bool:
    """Every file declares (user, time) order and the files cover disjoint times, in order (strictly:
    events of two files at one instant must not see each other, which merging runs would not know)."""
    present = per_file.filter(pl.col("n") > 0)
    disjoint = bool((present["last"].head(-1) < present["first"].tail(-1)).all()) if present.height > 1 else True
    return bool(present["sorted"].all()) and disjoint


def _user_range_chunks(users: list[np.ndarray], chunk_events: int):
    """Ranges of user ids of about chunk_events events, as (file index, start, end) row slices of
    files sorted by user."""
    total = sum(len(u) for u in users)
    n_chunks = math.ceil(total / chunk_events)
    if n_chunks <= 1:
        if total:
            yield [(i, 0, len(u)) for i, u in enumerate(users) if len(u)]
        return
    sample = np.concatenate([u[:: max(1, total // 100_000)] for u in users])
    splits = np.unique(np.quantile(sample, np.linspace(0, 1, n_chunks + 1)[1:-1], method="lower"))
    cuts = [np.concatenate([[0], np.searchsorted(u, splits, side="right"), [len(u)]]) for u in users]
    for c in range(len(splits) + 1):
        chunk = [(i, int(cut[c]), int(cut[c + 1])) for i, cut in enumerate(cuts) if cut[c + 1] > cut[c]]
        if chunk:
            yield chunk


def _read_category_codes(path: str) -> dict[str, tuple[np.ndarray, list[str]]]:
    """The string columns as integer codes into the file's own sorted values, straight from the
    Parquet dictionaries: no per-row strings are built."""
    # ParquetFile, not read_table: read_table imports pyarrow.dataset, which is slow to import.
    table = pq.ParquetFile(path, read_dictionary=list(CATEGORY_COLUMNS)).read(columns=list(CATEGORY_COLUMNS))
    out = {}
    for name in CATEGORY_COLUMNS:
        chunks = table[name].chunks
        dictionaries = [chunk.dictionary.to_pylist() for chunk in chunks]
        values = sorted({v for d in dictionaries for v in d})
        codes = np.empty(len(table), dtype=np.int8)
        offset = 0
        for chunk, dictionary in zip(chunks, dictionaries):
            lookup = np.array([values.index(v) for v in dictionary], dtype=np.int8)
            np.take(lookup, _int_view(chunk.indices), out=codes[offset:offset + len(chunk)])
            offset += len(chunk)
        out[name] = (codes, values)
    return out


class _Encoder:
    """Maps strings to small integer codes (sorted vocabularies) and labels to the action bitmask."""

    def __init__(self, surfaces, event_types, history_types, columns: EventLogColumns):
        self.vocab = {"surface": surfaces, "event_type": event_types}
        self.history_codes = None if history_types is None else [event_types.index(t) for t in history_types
                                                                 if t in event_types]
        self.columns = columns
        if len(columns.labels) > 8:
            raise ValueError(f"at most 8 objectives fit the action bitmask, found {len(columns.labels)}")
        # Per event: time in ms, the bitmask of positive labels, and whether any label is present.
        bits = [(pl.col(name) == 1).fill_null(False).cast(pl.Int16) * (1 << bit)
                for bit, name in enumerate(columns.labels)]
        self.labelled = pl.any_horizontal([pl.col(name).is_not_null() for name in columns.labels])
        self.event_columns = {
            "user_id": pl.col("user_id"),
            "timestamp": pl.col("timestamp").dt.cast_time_unit("ms").to_physical(),
            "item_id": pl.col("item_id"),
            "action": pl.sum_horizontal(bits).cast(pl.Int8, wrap_numerical=True),
            "labelled": self.labelled,
        }
        self.example_columns = [*columns.labels, *columns.sparse_features, *columns.dense_features]

    def codes(self, file_codes: dict[str, tuple[np.ndarray, list[str]]]) -> dict[str, np.ndarray]:
        """A file's codes, renumbered from its own values to the vocabularies (in place)."""
        out = {}
        for name, vocab in self.vocab.items():
            codes, values = file_codes[name]
            if values != vocab:
                np.take(np.array([vocab.index(v) for v in values], dtype=np.int8), codes, out=codes)
            out[name] = codes
        return out

    def string_codes(self, frame: pl.DataFrame) -> dict[str, np.ndarray]:
        return {name: frame[name].cast(pl.Enum(vocab)).to_physical().cast(pl.Int8).to_numpy()
                for name, vocab in self.vocab.items()}


EVENT_FIELDS = ("user_id", "timestamp", "item_id", "surface", "event_type", "action", "labelled")


@dataclass
class _Events:
    """The events of one build step as contiguous arrays (EVENT_FIELDS), made of parts (input files,
    their row slices, or their share of a bucket) in input order. Labels and features are left in the
    input: each part's `source` gives them back for its labelled events when its examples are written."""

    columns: dict[str, np.ndarray]
    part_offsets: np.ndarray
    sources: list[pl.LazyFrame]

    @property
    def n(self) -> int:
        return int(self.part_offsets[-1])

    def permuted(self, order: np.ndarray) -> _Events:
        """The same events in `order`, as one part (its examples are not written from it)."""
        return _Events({k: v[order] for k, v in self.columns.items()}, np.array([0, len(order)]), [])


def _read_events(slices: list[tuple[str, int, int]], encoder: _Encoder, codes: dict[str, dict[str, np.ndarray]],
                 users: dict[str, np.ndarray] | None = None) -> _Events:
    """Row slices [start, stop) of files into one set of arrays, one file at a time, so only the
    arrays themselves stay in memory. Labels and features are read later, for labelled rows only."""
    lengths = [b - a for _, a, b in slices]
    n = sum(lengths)
    dtypes = {"user_id": np.int64, "timestamp": np.int64, "item_id": np.int64, "surface": np.int8,
              "event_type": np.int8, "action": np.int8, "labelled": np.bool_}
    columns = {k: np.empty(n, dtype=dtypes[k]) for k in EVENT_FIELDS}
    names = [k for k in encoder.event_columns if users is None or k != "user_id"]
    offset, sources = 0, []
    for (path, a, _), length in zip(slices, lengths):
        source = pl.scan_parquet(path).slice(a, length)
        frame = source.select(encoder.event_columns[k].alias(k) for k in names).collect()
        end = offset + length
        for k in names:
            columns[k][offset:end] = frame[k].to_numpy()
        if users is not None:
            columns["user_id"][offset:end] = users[path][a:a + length]
        for k, v in codes[path].items():
            columns[k][offset:end] = v[a:a + length]
        offset = end
        sources.append(source)
    return _Events(columns, np.cumsum([0] + lengths), sources)


def _read_bucket(paths, encoder: _Encoder, bucket: int, n_buckets: int) -> _Events:
    # Each user lands in exactly one bucket, so timelines never split across buckets.
    in_bucket = pl.col("user_id").hash(seed=0) % n_buckets == bucket
    frames = [pl.scan_parquet(p).select(encoder.columns.all).filter(in_bucket).collect() for p in paths]
    parts = [f.select(expr.alias(k) for k, expr in encoder.event_columns.items()) for f in frames]
    codes = [encoder.string_codes(f) for f in frames]
    columns = {k: np.concatenate([p[k].to_numpy() for p in parts]) for k in encoder.event_columns}
    columns |= {k: np.concatenate([c[k] for c in codes]) for k in encoder.vocab}
    return _Events(columns, np.cumsum([0] + [f.height for f in frames]), [f.lazy() for f in frames])


def _int_view(array: pa.Array) -> np.ndarray:
    """A null-free integer Arrow array as a numpy view (pyarrow's to_numpy imports pandas)."""
    width = array.type.bit_width // 8
    return np.frombuffer(array.buffers()[1], dtype=f"<i{width}", count=len(array), offset=array.offset * width)


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


def _is_user_time_sorted(user: np.ndarray, ts: np.ndarray) -> bool:
    du, dt = np.diff(user), np.diff(ts)
    return bool(np.all((du > 0) | ((du == 0) & (dt >= 0))))


def _mergeable(user: np.ndarray, ts: np.ndarray, part_offsets: np.ndarray) -> bool:
    """Every part sorted by (user, time), and the parts cover disjoint times, in order."""
    bounds = [(a, b) for a, b in zip(part_offsets[:-1], part_offsets[1:]) if b > a]
    parts_sorted = all(_is_user_time_sorted(user[a:b], ts[a:b]) for a, b in bounds)
    # A part is sorted by user first, so its last row need not be its latest event: compare max with min.
    return parts_sorted and all(ts[a1:b1].max() < ts[a2:b2].min() for (a1, b1), (a2, b2) in zip(bounds, bounds[1:]))


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


class _Runs:
    """A user's events within one part, in input order, form a run: parts are sorted by (user, time)
    and cover disjoint times in order (raw_event_logs stores each day so), so a user's timeline is the
    concatenation of their runs in part order. Sorting the runs (stably, by user) is the whole sort,
    and the gathers that follow read memory in runs, not at random.

    A request's history_end is the number of its user's timeline events in earlier runs plus those
    before its instant (its first event at the same time) in its own run: per run, one number (`base`)
    that is broadcast over the run in input order, so pointers need no scatter of per-event arrays.
    """

    def __init__(self, events: _Events, history_codes: list[int] | None):
        user, n = events.columns["user_id"], events.n
        # Positions and counts as int32 while they fit: half the memory traffic of int64.
        self.index = index = np.int32 if n < 2**31 else np.int64
        new_run = np.empty(n, dtype=bool)
        new_run[0] = True
        np.not_equal(user[1:], user[:-1], out=new_run[1:])
        inner = events.part_offsets[1:-1]
        new_run[inner[inner < n]] = True
        self.start = np.flatnonzero(new_run).astype(index)
        del new_run
        self.length = np.diff(self.start, append=index(n))
        run_user = user[self.start]
        # Runs appear in part order, so a stable sort by user keeps each user's runs in time order;
        # the runs' user ids are a few sorted sequences, which numpy's stable sort (timsort) merges.
        self.order = np.argsort(run_user, kind="stable").astype(index)
        sorted_start, sorted_length = self.start[self.order], self.length[self.order]
        sorted_user = run_user[self.order]
        del run_user
        new_user = np.empty(len(sorted_user), dtype=bool)
        new_user[0] = True
        np.not_equal(sorted_user[1:], sorted_user[:-1], out=new_user[1:])
        self.first_run = np.flatnonzero(new_user)  # in sorted order, each user's first run
        self.user_ids = sorted_user[self.first_run]
        del sorted_user
        self.user_events = np.add.reduceat(sorted_length, self.first_run, dtype=np.int64)
        # Timeline events (all events, or those of the history event types) per run and before each run.
        if history_codes is None:
            self.is_hist = self.hist_before = None
            sorted_counted = sorted_length
        else:
            self.is_hist = np.isin(events.columns["event_type"], history_codes)
            self.hist_before = np.zeros(n + 1, dtype=index)
            np.cumsum(self.is_hist, out=self.hist_before[1:])
            sorted_counted = self.hist_before[sorted_start + sorted_length] - self.hist_before[sorted_start]
        self.timeline_lengths = (self.user_events if history_codes is None
                                 else np.add.reduceat(sorted_counted, self.first_run, dtype=np.int64))
        # The user's timeline events in earlier runs, less the count before the run's own start, so
        # that adding the count before an event's instant gives its history_end.
        base = np.cumsum(sorted_counted, dtype=index)
        base -= sorted_counted
        base -= np.repeat(base[self.first_run], np.diff(self.first_run, append=len(base)))
        base -= sorted_start if self.hist_before is None else self.hist_before[sorted_start]
        # Per run, in input order: its user's row (from 0) and its base.
        self.base = np.empty(len(self.start), dtype=index)
        self.base[self.order] = base
        self.row = np.empty(len(self.start), dtype=np.int32)
        self.row[self.order] = np.cumsum(new_user, dtype=np.int32) - 1

    def user_chunks(self, chunk_events: int):
        """Consecutive user ranges [first, last) of about chunk_events events."""
        n_users = len(self.user_ids)
        total = int(self.user_events.sum())
        n_chunks = min(n_users, math.ceil(total / chunk_events))
        cuts = np.searchsorted(np.cumsum(self.user_events), np.arange(1, n_chunks) * (total / n_chunks), side="right")
        bounds = np.unique(np.concatenate([[0], cuts, [n_users]]))
        return list(zip(bounds[:-1].tolist(), bounds[1:].tolist()))

    def positions(self, first_user: int, last_user: int) -> np.ndarray:
        """Input positions of the timeline events of users [first_user, last_user), in (user, time) order."""
        r0 = self.first_run[first_user]
        r1 = self.first_run[last_user] if last_user < len(self.first_run) else len(self.order)
        runs = self.order[r0:r1]
        start, length = self.start[runs], self.length[runs]
        # A running sum of steps (1 inside a run, a jump between runs): one array, no temporaries;
        # int32 while it fits, which halves the index traffic of every gather that follows.
        pos = np.ones(int(length.sum()), dtype=self.index)
        pos[0] = start[0]
        pos[np.cumsum(length[:-1])] = start[1:] - (start[:-1] + length[:-1] - 1)
        np.cumsum(pos, out=pos)
        return pos if self.is_hist is None else pos[self.is_hist[pos]]

    def pointers(self, events: _Events, start: int, stop: int, user_base: int,
                 rows: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """user_row and history_end of the events at input positions [start, stop), a whole number of
        runs, or of those of them at `rows` (offsets from start)."""
        r0, r1 = np.searchsorted(self.start, [start, stop])
        user, ts = events.columns["user_id"][start:stop], events.columns["timestamp"][start:stop]
        new_instant = np.empty(stop - start, dtype=bool)
        new_instant[0] = True
        new_instant[1:] = (ts[1:] != ts[:-1]) | (user[1:] != user[:-1])
        instant_start = np.where(new_instant, np.arange(start, stop, dtype=self.index), self.index(0))
        np.maximum.accumulate(instant_start, out=instant_start)
        run = np.repeat(np.arange(r0, r1, dtype=self.index), self.length[r0:r1])
        if rows is not None:
            instant_start, run = instant_start[rows], run[rows]
        before = instant_start if self.hist_before is None else self.hist_before[instant_start]
        history_end = self.base[run]
        history_end += before
        user_row = self.row[run]
        user_row += np.int32(user_base)
        return user_row, history_end.astype(np.int32, copy=False)


def _build(events: _Events, encoder: _Encoder, chunk_events: int, declared_mergeable: bool, eval_start_ms: int,
           writer: _SequenceLogsWriter, timer: StageTimer, examples_per_part: bool) -> None:
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


def _build_with_inputs(events: _Events, inputs: list[Future], encoder: _Encoder, chunk_events: int,
                       declared_mergeable: bool, eval_start_ms: int, writer: _SequenceLogsWriter, timer: StageTimer,
                       examples_per_part: bool) -> None:
    user_base = writer.n_users
    with timer("order"):
        c = events.columns
        if declared_mergeable or _mergeable(c["user_id"], c["timestamp"], events.part_offsets):
            merged, order = events, None
        else:  # overlapping or unsorted parts: one global sort
            order = _sort_order(c["user_id"], c["timestamp"])
            merged = events.permuted(order)
        runs = _Runs(merged, encoder.history_codes)
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


def _examples(events: _Events, start: int, stop: int, rows: np.ndarray | None, user_row: np.ndarray,
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


class StageTimer:
    """Wall time per named stage, summed over buckets: where preparation spends its time."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start


class _SequenceLogsWriter:
    """Numbered part files: timelines per range of users, examples per input file (and bucket).
    The loader reads parts in name order, so example indices are row numbers in that order.

    Files are written in two background threads (Parquet encoding releases the GIL, so it overlaps
    the numpy work of the next range or part, and the last files finish side by side), at most
    `max_pending` at a time so memory stays bounded."""

    def __init__(self, folder: Path, max_history_len: int, timer: StageTimer, max_pending: int = 3):
        self.folder, self.max_history_len, self.timer, self.max_pending = folder, max_history_len, timer, max_pending
        (folder / TIMELINES).mkdir(parents=True)
        (folder / EXAMPLES).mkdir()
        self.n_users = self.n_timeline_events = self.n_examples = self.n_eval = 0
        self._timeline_files = self._example_files = self.n_timeline_parts = 0
        self._timeline_lengths: list[np.ndarray] = []
        self._history_lengths: list[np.ndarray] = []
        self._pool = ThreadPoolExecutor(max_workers=2)
        self._pending: list[Future] = []

    def write_timelines(self, timelines: pl.DataFrame, timeline_lengths: np.ndarray) -> None:
        path = self.folder / TIMELINES / f"part-{self._timeline_files:05d}.parquet"
        self._submit(timelines, path)
        self._timeline_files += 1
        self.n_timeline_parts = self._timeline_files
        self.n_users += timelines.height
        self.n_timeline_events += int(timeline_lengths.sum())
        self._timeline_lengths.append(timeline_lengths)

    def write_examples(self, examples: pl.DataFrame) -> None:
        path = self.folder / EXAMPLES / f"part-{self._example_files:05d}.parquet"
        self._submit(examples, path)
        self._example_files += 1
        self.n_examples += examples.height
        self.n_eval += int(examples["split"].sum())
        self._history_lengths.append(np.minimum(examples["history_end"].to_numpy(), self.max_history_len))

    def _submit(self, frame: pl.DataFrame, path: Path) -> None:
        # Uncompressed: lz4 made timelines 2.3x smaller on disk but doubled the CPU time of writing
        # them, the largest single item in a build's profile on 2 cores; examples compress little
        # anyway. No statistics: loaders read whole files, so statistics buy nothing.
        with self.timer("write"):
            while len(self._pending) >= self.max_pending:
                self._pending.pop(0).result()  # re-raises a failed write
        self._pending.append(self._pool.submit(frame.write_parquet, path, compression="uncompressed", statistics=False))

    def close(self) -> None:
        with self.timer("write"):
            try:
                while self._pending:
                    self._pending.pop(0).result()
            finally:
                for future in self._pending:
                    future.cancel()
                self._pool.shutdown()

    def timeline_quantiles(self) -> dict[str, float]:
        return _quantiles(np.concatenate(self._timeline_lengths)) if self._timeline_lengths else {}

    def history_quantiles(self) -> dict[str, float]:
        return _quantiles(np.concatenate(self._history_lengths)) if self._history_lengths else {}


def _quantiles(values: np.ndarray) -> dict[str, float]:
    """Quantiles of non-negative integer lengths from their histogram: one pass, no sort."""
    if values.size == 0:
        return {}
    cumulative = np.cumsum(np.bincount(values))
    qs = {"p50": 0.5, "p90": 0.9, "p99": 0.99}
    out = {k: float(np.searchsorted(cumulative, q * values.size)) for k, q in qs.items()}
    return out | {"max": float(values.max()), "mean": float(values.mean())}


def _epoch_ms(day) -> int:
    return int(datetime(day.year, day.month, day.day, tzinfo=timezone.utc).timestamp() * 1000)
