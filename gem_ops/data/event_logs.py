"""Reading event logs in the documented schema: validate, then normalise dtypes."""

from __future__ import annotations

import logging
import os
from datetime import datetime, timezone
from pathlib import Path

import polars as pl

from gem_ops.data.schema import (
    CATEGORY_COLUMNS,
    ID_COLUMNS,
    RESERVED_SURFACES,
    TIMESTAMP_DTYPE,
    EventLogColumns,
    EventLogError,
    check_names,
    check_required_dtypes,
    classify_columns,
)

log = logging.getLogger(__name__)
INT64_MAX = 2**63 - 1


def read_event_log(path: str | os.PathLike) -> pl.DataFrame:
    """Reads one Parquet event log, raising EventLogError (file + column) on any schema violation."""
    source = str(path)
    if not Path(path).exists():
        raise EventLogError(source, None, "file not found")
    try:
        frame = pl.read_parquet(path)
    except Exception as exc:  # polars raises several types for a corrupt or non-Parquet file
        raise EventLogError(source, None, f"not a readable Parquet file ({exc})") from exc
    return normalize_event_log(frame, source)


def normalize_event_log(frame: pl.DataFrame, source: str) -> pl.DataFrame:
    """Validates an in-memory event log and returns it in canonical dtypes and column order."""
    check_required_dtypes(frame.schema, source)
    columns = classify_columns(frame.schema, source)
    if frame.height == 0:
        raise EventLogError(source, None, "no rows: an event log must hold at least one event")
    for name in (*ID_COLUMNS, *CATEGORY_COLUMNS, "timestamp"):
        nulls = frame[name].null_count()
        if nulls:
            raise EventLogError(source, name, f"{nulls} null value(s) of {frame.height}; this column may not be null")
    for name in (*ID_COLUMNS, *columns.sparse_features):
        if frame[name].dtype == pl.UInt64 and (frame[name].max() or 0) > INT64_MAX:
            raise EventLogError(source, name, f"ids above {INT64_MAX} (the int64 range), e.g. {frame[name].max()}")
    for name in CATEGORY_COLUMNS:
        check_names(source, name, frame[name].unique().to_list(), f"{name} values")
    reserved = sorted(set(frame["surface"].unique().to_list()) & set(RESERVED_SURFACES))
    if reserved:
        raise EventLogError(source, "surface", f"{reserved} is reserved for the figures over every surface: rename it")
    for name in columns.dense_features:
        bad = frame[name].cast(pl.Float64).is_nan().sum() + frame[name].cast(pl.Float64).is_infinite().sum()
        if bad:
            raise EventLogError(source, name, f"{bad} NaN or infinite value(s) of {frame.height}; dense features "
                                              "must be finite (null where unknown)")
    duplicated = frame.height - frame.unique().height
    if duplicated:
        log.warning("%s: %d event(s) repeat another row exactly (kept: they count as separate events)",
                    source, duplicated)
    frame = frame.with_columns(_parse_timestamp(frame["timestamp"], source))
    for name in columns.labels:
        bad = frame.filter(~pl.col(name).cast(pl.Int64).is_in([0, 1]) & pl.col(name).is_not_null()).height
        if bad:
            raise EventLogError(source, name, f"{bad} label value(s) outside {{0, 1}}")
    return canonical_dtypes(frame, columns)


def canonical_dtypes(frame: pl.DataFrame, columns: EventLogColumns) -> pl.DataFrame:
    return frame.select(
        pl.col("user_id").cast(pl.Int64),
        pl.col("timestamp").cast(TIMESTAMP_DTYPE),
        pl.col("item_id").cast(pl.Int64),
        pl.col("surface").cast(pl.String),
        pl.col("event_type").cast(pl.String),
        *(pl.col(c).cast(pl.Int8) for c in columns.labels),
        *(pl.col(c).cast(pl.Int64) for c in columns.sparse_features),
        *(pl.col(c).cast(pl.Float32) for c in columns.dense_features),
    )


def _parse_timestamp(column: pl.Series, source: str) -> pl.Series:
    if isinstance(column.dtype, pl.Datetime):
        if column.dtype.time_zone is None:
            return column.dt.replace_time_zone("UTC").cast(TIMESTAMP_DTYPE)
        return column.dt.convert_time_zone("UTC").cast(TIMESTAMP_DTYPE)
    if column.dtype == pl.Date:
        return column.cast(pl.Datetime("ms")).dt.replace_time_zone("UTC")
    parsed = column.str.to_datetime(time_zone="UTC", strict=False, time_unit="ms")
    bad = parsed.is_null() & column.is_not_null()
    if bad.any():  # mixed formats: polars infers one format, so parse the rest one by one
        parsed = parsed.scatter(bad.arg_true(), pl.Series([_parse_iso(v) for v in column.filter(bad)],
                                                          dtype=pl.Datetime("us", "UTC")).cast(TIMESTAMP_DTYPE))
        bad = parsed.is_null() & column.is_not_null()
    if bad.any():
        examples = column.filter(bad).head(3).to_list()
        raise EventLogError(
            source, "timestamp", f"{int(bad.sum())} value(s) are not ISO-8601 timestamps, e.g. {examples}"
        )
    return parsed


def _parse_iso(text: str) -> datetime | None:
    try:
        value = datetime.fromisoformat(text.strip())
    except ValueError:
        return None
    return value.replace(tzinfo=timezone.utc) if value.tzinfo is None else value.astimezone(timezone.utc)
