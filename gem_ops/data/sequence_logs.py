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
from gem_ops.data.sequence_layout import EXAMPLES, MANIFEST, TIMELINE_FIELDS, TIMELINES, read_manifest  # noqa: F401
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
        paths = per_file["_file"].to_list()  # in time order: the merge in _user_time_order relies on it
        categories = {path: _read_categories(path) for path in paths}
    n_events = int(per_file["n"].sum())
    declared_mergeable = _declared_mergeable(per_file)
    if n_events == 0:
        raise ValueError(f"no events in {len(paths)} event-log file(s), e.g. {paths[0]}")
    surfaces, event_types = (sorted({v for c in categories.values() for v in _dictionary_values(c[name])})
                             for name in CATEGORY_COLUMNS)
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
    if n_buckets > 1:
        categories.clear()  # the codes are reread per bucket: keep memory bounded
    encoder = _Encoder(surfaces, event_types, history_types, columns)
    with atomic_path(destination) as tmp, reusable_heap():
        writer = _SequenceLogsWriter(tmp, config.max_history_len, timer)
        try:
            if streaming:
                chunk_events = min(config.chunk_events, config.max_events_in_memory)
                _build_streaming(paths, categories, encoder, chunk_events, eval_start_ms, writer, timer)
            else:
                for bucket in range(n_buckets):
                    with timer("read"):
                        parts = _read_bucket(paths, encoder, categories, bucket, n_buckets)
                    _build_in_memory(parts, encoder, config.chunk_events, declared_mergeable, eval_start_ms, writer, timer)
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
        manifest = {"summary": asdict(summary), "config": asdict(config), "labels": list(columns.labels)}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2, default=str))
    return summary


def _build_streaming(paths, categories, encoder: _Encoder, chunk_events: int, eval_start_ms: int,
                     writer: _SequenceLogsWriter, timer: StageTimer) -> None:
    """Files that declare (user, time) order over disjoint days: one range of users at a time is read
    (a row slice of every file), so memory holds one range, whatever the total."""
    with timer("scan"):
        users = [pl.read_parquet(p, columns=["user_id"])["user_id"].to_numpy() for p in paths]
        codes = [encoder.codes(categories.pop(p)) for p in paths]
    for chunk in _user_range_chunks(users, chunk_events):
        with timer("read"):  # user ids were read already: the slices skip that column
            parts = [
                encoder.encode(pl.scan_parquet(paths[i]).select(encoder.numeric_columns[1:]).slice(a, b - a).collect(),
                               {k: v[a:b] for k, v in codes[i].items()} | {"user_id": users[i][a:b]})
                for i, a, b in chunk
            ]
        rows, ends = _build_timelines(parts, encoder, writer, timer, declared_mergeable=True)
        offsets = np.cumsum([0] + [p.height for p in parts])
        _write_examples([(p, rows[s:e], ends[s:e]) for p, s, e in zip(parts, offsets[:-1], offsets[1:])],
                        encoder, eval_start_ms, writer, timer)


def _build_in_memory(parts: list[_Part], encoder: _Encoder, chunk_events: int, declared_mergeable: bool,
                     eval_start_ms: int, writer: _SequenceLogsWriter, timer: StageTimer) -> None:
    """Files read whole: in ranges of users where every file is sorted by user, else all at once;
    examples are written per input file, in its order."""
    users = [p.column("user_id") for p in parts]
    if not (declared_mergeable or all(np.all(u[1:] >= u[:-1]) for u in users)):
        chunk_events = sum(len(u) for u in users) or 1  # one range: the rows cannot be cut by user
    user_row = [np.empty(p.height, dtype=np.int32) for p in parts]
    history_end = [np.empty(p.height, dtype=np.int32) for p in parts]
    for chunk in _user_range_chunks(users, chunk_events):
        rows, ends = _build_timelines([parts[i].slice(a, b) for i, a, b in chunk], encoder, writer, timer,
                                      declared_mergeable)
        offset = 0
        for i, a, b in chunk:  # back into each input part's own order
            user_row[i][a:b], history_end[i][a:b] = rows[offset:offset + b - a], ends[offset:offset + b - a]
            offset += b - a
    for part, rows, ends in zip(parts, user_row, history_end):
        _write_examples([(part, rows, ends)], encoder, eval_start_ms, writer, timer)


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
        rows.append({"_file": path, "n": meta.num_rows, "first": first, "last": last, "sorted": declared == USER_TIME_ORDER})
    schema = {"_file": pl.String, "n": pl.Int64, "first": pl.Int64, "last": pl.Int64, "sorted": pl.Boolean}
    return pl.DataFrame(rows, schema=schema).sort("first", nulls_last=True)


def _column_stats(row_group, name: str):
    for i in range(row_group.num_columns):
        if row_group.column(i).path_in_schema == name:
            return row_group.column(i).statistics
    return None


def _is_ms(stats) -> bool:
    return stats.physical_type == "INT64" and "milliseconds" in str(stats.logical_type)


def _read_bucket(paths, encoder: _Encoder, categories, bucket: int, n_buckets: int) -> list[_Part]:
    if n_buckets == 1:
        # pop: each file's dictionary codes are freed once they are encoded
        return [encoder.encode(pl.read_parquet(p, columns=encoder.numeric_columns), encoder.codes(categories.pop(p)))
                for p in paths]
    # Each user lands in exactly one bucket, so timelines never split across buckets.
    in_bucket = pl.col("user_id").hash(seed=0) % n_buckets == bucket
    columns = encoder.columns.all
    return [encoder.encode(pl.scan_parquet(p).select(columns).filter(in_bucket).collect()) for p in paths]


def _declared_mergeable(per_file: pl.DataFrame) -> bool:
    """Every file declares (user, time) order and the files cover disjoint times, in order."""
    present = per_file.filter(pl.col("n") > 0)
    disjoint = bool((present["last"].head(-1) <= present["first"].tail(-1)).all()) if present.height > 1 else True
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


def _read_categories(path: str) -> dict[str, pa.ChunkedArray]:
    """The string columns as Parquet stores them, dictionary-encoded: no per-row strings are built."""
    # ParquetFile, not read_table: read_table imports pyarrow.dataset, which is slow to import.
    table = pq.ParquetFile(path, read_dictionary=list(CATEGORY_COLUMNS)).read(columns=list(CATEGORY_COLUMNS))
    return {name: table[name] for name in CATEGORY_COLUMNS}


def _dictionary_values(column: pa.ChunkedArray) -> set[str]:
    return {v for chunk in column.chunks for v in chunk.dictionary.to_pylist()}


class _Encoder:
    """Maps strings to small integer codes (sorted vocabularies) and labels to the action bitmask."""

    def __init__(self, surfaces, event_types, history_types, columns: EventLogColumns):
        self.vocab = {"surface": surfaces, "event_type": event_types}
        self.history_codes = None if history_types is None else [event_types.index(t) for t in history_types if t in event_types]
        self.columns = columns
        self.numeric_columns = [c for c in columns.all if c not in CATEGORY_COLUMNS]  # user_id first
        if len(columns.labels) > 8:
            raise ValueError(f"at most 8 objectives fit the action bitmask, found {len(columns.labels)}")

    def codes(self, categories: dict[str, pa.ChunkedArray]) -> dict[str, np.ndarray]:
        """Integer codes from Parquet dictionaries: each chunk's indices remapped by a tiny lookup."""
        codes = {}
        for name, vocab in self.vocab.items():
            chunks = []
            for chunk in categories[name].chunks:
                lookup = np.array([vocab.index(v) for v in chunk.dictionary.to_pylist()], dtype=np.int8)
                chunks.append(lookup[_int_view(chunk.indices)])
            codes[name] = np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.int8)
        return codes

    def encode(self, frame: pl.DataFrame, codes: dict[str, np.ndarray] | None = None) -> _Part:
        """Integer codes for the strings (given, or from the string columns), time in ms, the action
        bitmask and whether any label is present, as arrays beside the frame, which stays as read:
        adding columns to a frame read in several chunks would copy all of it."""
        if codes is None:
            codes = {name: frame[name].cast(pl.Enum(vocab)).to_physical().cast(pl.Int8).to_numpy()
                     for name, vocab in self.vocab.items()}
        derived = dict(codes)
        derived["timestamp"] = frame["timestamp"].dt.cast_time_unit("ms").to_physical().to_numpy()
        action = np.zeros(frame.height, dtype=np.int8)
        labelled = np.zeros(frame.height, dtype=bool)
        for bit, name in enumerate(self.columns.labels):
            label = frame[name].fill_null(-1).to_numpy()
            action |= (label == 1).astype(np.int8) << bit
            labelled |= label >= 0
        derived["action"], derived["labelled"] = action, labelled
        return _Part(frame, derived)


def _int_view(array: pa.Array) -> np.ndarray:
    """A null-free integer Arrow array as a numpy view (pyarrow's to_numpy imports pandas)."""
    width = array.type.bit_width // 8
    return np.frombuffer(array.buffers()[1], dtype=f"<i{width}", count=len(array), offset=array.offset * width)


def _arrow_view(values: np.ndarray) -> pa.Array:
    """A contiguous numpy array as an Arrow array without a copy (pa.array would import pandas)."""
    values = np.ascontiguousarray(values)
    return pa.Array.from_buffers(pa.from_numpy_dtype(values.dtype), len(values), [None, pa.py_buffer(values)])


@dataclass
class _Part:
    """One input file (or its share of a bucket): the frame as read, and arrays derived from it."""

    frame: pl.DataFrame
    derived: dict[str, np.ndarray]

    @property
    def height(self) -> int:
        return self.frame.height

    def column(self, name: str) -> np.ndarray:
        return self.derived[name] if name in self.derived else self.frame[name].to_numpy()

    def slice(self, start: int, end: int) -> _Part:
        return _Part(self.frame.slice(start, end - start), {k: v[start:end] for k, v in self.derived.items()})


def _is_user_time_sorted(user: np.ndarray, ts: np.ndarray) -> bool:
    du, dt = np.diff(user), np.diff(ts)
    return bool(np.all((du > 0) | ((du == 0) & (dt >= 0))))


def _user_time_order(user: np.ndarray, ts: np.ndarray, part_offsets: np.ndarray, declared_mergeable: bool) -> np.ndarray:
    """The permutation that puts events in (user, time) order.

    raw_event_logs stores each daily partition sorted by (user_id, timestamp), and the partitions
    cover disjoint days, so each user's timeline is the concatenation of one run per partition:
    ordering the runs is enough, and the gathers that follow read memory in runs, not at random.
    Files that declare that order in their metadata (raw_event_logs writes it) are trusted; others
    are checked, and anything else (overlapping or unsorted parts) falls back to one global sort.
    """
    if not (declared_mergeable or _mergeable(user, ts, part_offsets)):
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
    # Built as a running sum of steps (1 inside a run, a jump between runs): one array, no temporaries;
    # int32 while it fits, which halves the index traffic of every gather that follows.
    order = np.ones(n, dtype=np.int32 if n < 2**31 else np.int64)
    order[0] = run_start[0]
    out_start = np.cumsum(run_len[:-1])
    order[out_start] = run_start[1:] - (run_start[:-1] + run_len[:-1] - 1)
    return np.cumsum(order, out=order)


def _mergeable(user: np.ndarray, ts: np.ndarray, part_offsets: np.ndarray) -> bool:
    bounds = [(a, b) for a, b in zip(part_offsets[:-1], part_offsets[1:]) if b > a]
    parts_sorted = all(_is_user_time_sorted(user[a:b], ts[a:b]) for a, b in bounds)
    # A part is sorted by user first, so its last row need not be its latest event: compare max with min.
    return parts_sorted and all(ts[a1:b1].max() <= ts[a2:b2].min() for (a1, b1), (a2, b2) in zip(bounds, bounds[1:]))


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


def _build_timelines(parts: list[_Part], encoder: _Encoder, writer: _SequenceLogsWriter, timer: StageTimer,
                     declared_mergeable: bool) -> tuple[np.ndarray, np.ndarray]:
    """One range of users: writes their timelines in (user, time) order and returns, for every event
    in input order, its user's timeline row and its history_end.

    Arrays are dropped as soon as they are used: peak memory is about the input plus a few columns.
    """
    user_base = writer.n_users
    with timer("columns"):
        parts = [p for p in parts if p.height]
        part_offsets = np.cumsum([0] + [p.height for p in parts])
        n = int(part_offsets[-1])
        user, ts = _column(parts, "user_id"), _column(parts, "timestamp")
    with timer("order"):
        order = _user_time_order(user, ts, part_offsets, declared_mergeable)
        user_s, ts_s = user[order], ts[order]
        del user, ts
        new_user = np.empty(n, dtype=bool)
        new_user[0] = True
        np.not_equal(user_s[1:], user_s[:-1], out=new_user[1:])
        new_run = new_user.copy()
        new_run[1:] |= ts_s[1:] != ts_s[:-1]  # a run is one user's events at one instant
        user_first = np.flatnonzero(new_user)
        user_ids = user_s[user_first]
        del user_s, new_user
        user_len = np.diff(np.append(user_first, n))
        event_type_s = _column(parts, "event_type")[order]
        is_hist = None if encoder.history_codes is None else np.isin(event_type_s, encoder.history_codes)
    with timer("timelines"):
        timeline = {"item_id": _column(parts, "item_id")[order], "timestamp": ts_s, "event_type": event_type_s,
                    "surface": _column(parts, "surface")[order], "action": _column(parts, "action")[order]}
        del ts_s
        if is_hist is None:
            hist_per_user = user_len
        else:
            timeline = {k: v[is_hist] for k, v in timeline.items()}
            hist_per_user = np.add.reduceat(is_hist.astype(np.int64), user_first)
        offsets = _arrow_view(np.concatenate([[0], np.cumsum(hist_per_user)]))
        timelines = pl.DataFrame(
            {"user_id": user_ids}
            | {k: pl.Series(k, pa.LargeListArray.from_arrays(offsets, _arrow_view(timeline.pop(k)))) for k in TIMELINE_FIELDS}
        )
    writer.write_timelines(timelines, hist_per_user)  # in the background, while examples are made
    del timelines
    with timer("pointers"):
        # Per event in (user, time) order: where its instant's run starts, and where its user starts.
        run_start = np.where(new_run, np.arange(n, dtype=np.int32), 0)
        np.maximum.accumulate(run_start, out=run_start)
        del new_run
        user_start = np.repeat(user_first.astype(np.int32), user_len)
        # Strictly before the request: the user's history events before the first event at this instant.
        if is_hist is None:
            run_start -= user_start
            sorted_values = run_start
        else:  # count only history events
            hist_before = np.cumsum(is_hist, dtype=np.int32) - is_hist
            sorted_values = hist_before[run_start] - hist_before[user_start]
            del hist_before, run_start
        history_end = np.empty(n, dtype=np.int32)
        history_end[order] = sorted_values
        del sorted_values, user_start
        user_row = np.empty(n, dtype=np.int32)
        user_row[order] = np.repeat(np.arange(user_base, user_base + len(user_first), dtype=np.int32), user_len)
        del order
    return user_row, history_end


def _write_examples(pieces: list[tuple[_Part, np.ndarray, np.ndarray]], encoder: _Encoder, eval_start_ms: int,
                    writer: _SequenceLogsWriter, timer: StageTimer) -> None:
    """The labelled events of the pieces, in their order, with their pointers into the timelines."""
    c = encoder.columns
    with timer("examples"):
        frames = []
        for part, user_row, history_end in pieces:
            d = part.derived
            examples = part.frame.select(
                pl.Series("user_row", user_row),
                pl.Series("history_end", history_end),
                pl.Series("timestamp", d["timestamp"]), "item_id",
                pl.Series("surface", d["surface"]), pl.Series("event_type", d["event_type"]),
                *c.labels, *c.sparse_features, *c.dense_features,
                pl.Series("split", (d["timestamp"] >= eval_start_ms).astype(np.int8)),
            )
            frames.append(examples if d["labelled"].all() else examples.filter(pl.Series(d["labelled"])))
        examples = frames[0] if len(frames) == 1 else pl.concat(frames)
    writer.write_examples(examples)


def _column(parts: list[_Part], name: str) -> np.ndarray:
    return np.concatenate([p.column(name) for p in parts])


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
    The loader reads parts in name order, so example indices are row numbers in that order."""

    def __init__(self, folder: Path, max_history_len: int, timer: StageTimer):
        self.folder, self.max_history_len, self.timer = folder, max_history_len, timer
        (folder / TIMELINES).mkdir(parents=True)
        (folder / EXAMPLES).mkdir()
        self.n_users = self.n_timeline_events = self.n_examples = self.n_eval = 0
        self._timeline_files = self._example_files = self.n_timeline_parts = 0
        self._timeline_lengths: list[np.ndarray] = []
        self._history_lengths: list[np.ndarray] = []
        self._pool = ThreadPoolExecutor(max_workers=1)
        self._pending: Future | None = None

    def write_timelines(self, timelines: pl.DataFrame, timeline_lengths: np.ndarray) -> None:
        """Starts writing in a thread: Parquet encoding releases the GIL, so it overlaps numpy work."""
        with self.timer("write"):
            self.finish()
        path = self.folder / TIMELINES / f"part-{self._timeline_files:05d}.parquet"
        self._pending = self._pool.submit(timelines.write_parquet, path, compression="lz4", statistics=False)
        self._timeline_files += 1
        self.n_timeline_parts = self._timeline_files
        self.n_users += timelines.height
        self.n_timeline_events += int(timeline_lengths.sum())
        self._timeline_lengths.append(timeline_lengths)

    def write_examples(self, examples: pl.DataFrame) -> None:
        with self.timer("write"):
            # Uncompressed, no statistics: examples compress little, so writing them plain is cheaper
            # (timelines, which compress well, stay lz4); loaders read whole files, so statistics buy nothing.
            path = self.folder / EXAMPLES / f"part-{self._example_files:05d}.parquet"
            examples.write_parquet(path, compression="uncompressed", statistics=False)
        self._example_files += 1
        self.n_examples += examples.height
        self.n_eval += int(examples["split"].sum())
        self._history_lengths.append(np.minimum(examples["history_end"].to_numpy(), self.max_history_len))

    def finish(self) -> None:
        if self._pending is not None:
            self._pending.result()  # re-raises a failed write
            self._pending = None

    def close(self) -> None:
        with self.timer("write"):
            self.finish()
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
