"""Raw event-log files read for sequence_logs: their time ranges and declared order from Parquet metadata, string
columns as codes straight from the Parquet dictionaries, and the events of row slices or hash buckets of users as
contiguous arrays (Events). Labels and features stay in the files until the examples are written."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

from gem_ops.data.schema import CATEGORY_COLUMNS, SORTED_BY_KEY, USER_TIME_ORDER, EventLogColumns


def per_file_times(paths: list[str]) -> pl.DataFrame:
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


def declares_mergeable_order(per_file: pl.DataFrame) -> bool:
    """Every file declares (user, time) order and the files cover disjoint times, in order (strictly:
    events of two files at one instant must not see each other, which merging runs would not know)."""
    present = per_file.filter(pl.col("n") > 0)
    disjoint = bool((present["last"].head(-1) < present["first"].tail(-1)).all()) if present.height > 1 else True
    return bool(present["sorted"].all()) and disjoint


def user_range_chunks(users: list[np.ndarray], chunk_events: int):
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


def read_category_codes(path: str) -> dict[str, tuple[np.ndarray, list[str]]]:
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


class EventEncoder:
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
class Events:
    """The events of one build step as contiguous arrays (EVENT_FIELDS), made of parts (input files,
    their row slices, or their share of a bucket) in input order. Labels and features are left in the
    input: each part's `source` gives them back for its labelled events when its examples are written."""

    columns: dict[str, np.ndarray]
    part_offsets: np.ndarray
    sources: list[pl.LazyFrame]

    @property
    def n(self) -> int:
        return int(self.part_offsets[-1])

    def permuted(self, order: np.ndarray) -> Events:
        """The same events in `order`, as one part (its examples are not written from it)."""
        return Events({k: v[order] for k, v in self.columns.items()}, np.array([0, len(order)]), [])


def read_events(slices: list[tuple[str, int, int]], encoder: EventEncoder, codes: dict[str, dict[str, np.ndarray]],
                users: dict[str, np.ndarray] | None = None) -> Events:
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
    return Events(columns, np.cumsum([0] + lengths), sources)


def read_bucket(paths, encoder: EventEncoder, bucket: int, n_buckets: int) -> Events:
    # Each user lands in exactly one bucket, so timelines never split across buckets.
    in_bucket = pl.col("user_id").hash(seed=0) % n_buckets == bucket
    frames = [pl.scan_parquet(p).select(encoder.columns.all).filter(in_bucket).collect() for p in paths]
    parts = [f.select(expr.alias(k) for k, expr in encoder.event_columns.items()) for f in frames]
    codes = [encoder.string_codes(f) for f in frames]
    columns = {k: np.concatenate([p[k].to_numpy() for p in parts]) for k in encoder.event_columns}
    columns |= {k: np.concatenate([c[k] for c in codes]) for k in encoder.vocab}
    return Events(columns, np.cumsum([0] + [f.height for f in frames]), [f.lazy() for f in frames])


def _int_view(array: pa.Array) -> np.ndarray:
    """A null-free integer Arrow array as a numpy view (pyarrow's to_numpy imports pandas)."""
    width = array.type.bit_width // 8
    return np.frombuffer(array.buffers()[1], dtype=f"<i{width}", count=len(array), offset=array.offset * width)
