"""raw_event_logs: one validated Parquet file per day, from any source, sorted by (user_id, timestamp).

Sorting each day once, as it lands, lets sequence_logs merge per-day runs instead of re-sorting the
whole look-back window every time it is rebuilt.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import date, datetime, timedelta, timezone
from pathlib import Path
from typing import Literal

import polars as pl

from gem_ops.data.atomic import write_parquet_atomic
from gem_ops.data.event_logs import normalize_event_log, read_event_log
from gem_ops.data.movielens import DEFAULT_MOVIELENS_DIR, load_movielens
from gem_ops.data.schema import SORTED_BY_KEY, USER_TIME_ORDER, EventLogError
from gem_ops.data.synthetic import SyntheticConfig, generate_day

Source = Literal["synthetic", "movielens", "parquet"]


@dataclass(frozen=True)
class EventSource:
    """Where a day's events come from."""

    kind: Source = "synthetic"
    synthetic: SyntheticConfig = SyntheticConfig()
    movielens_dir: str = str(DEFAULT_MOVIELENS_DIR)
    movielens_replay_days: int = 14
    """MovieLens is replayed onto this many days from the synthetic start date (see movielens.py)."""
    parquet_template: str = ""
    """For kind='parquet': a path with {date} (YYYY-MM-DD), e.g. /data/events/{date}.parquet."""


def parquet_path(template: str, day: date) -> str:
    """The day's file of a parquet_template: {date} is the one placeholder."""
    import string

    fields = {name for _, name, _, _ in string.Formatter().parse(template) if name is not None}
    if fields != {"date"}:
        raise ValueError(f"parquet_template {template!r} must hold the one placeholder {{date}}, found "
                         f"{sorted(fields) or 'none'}")
    return template.format(date=day.isoformat())


def load_day(source: EventSource, day: date) -> pl.DataFrame:
    """One day's events from `source`, validated and in canonical dtypes (may be empty)."""
    if source.kind == "synthetic":
        frame, origin = generate_day(source.synthetic, day), f"synthetic day {day}"
    elif source.kind == "movielens":
        events = load_movielens(source.movielens_dir, replay_start=source.synthetic.start_date,
                                replay_days=source.movielens_replay_days)
        frame, origin = _day_slice(events, day), f"{source.movielens_dir} ({day})"
        if frame.height == 0:
            return frame
    elif source.kind == "parquet":
        path = parquet_path(source.parquet_template, day)
        frame, origin = read_event_log(path), path
        outside = frame.height - _day_slice(frame, day).height
        if outside:
            raise EventLogError(path, "timestamp", f"{outside} event(s) fall outside the partition day {day} (UTC)")
    else:
        raise ValueError(f"unknown event source kind {source.kind!r}; use synthetic, movielens or parquet")
    return normalize_event_log(frame, origin)


def sort_for_storage(frame: pl.DataFrame) -> pl.DataFrame:
    return frame.sort(["user_id", "timestamp"], maintain_order=True)


def write_partition(frame: pl.DataFrame, destination: str | os.PathLike) -> Path:
    """Writes one day atomically, sorted by (user_id, timestamp)."""
    return write_parquet_atomic(
        sort_for_storage(frame), destination, statistics=True, metadata={SORTED_BY_KEY: USER_TIME_ORDER}
    )


def _day_slice(frame: pl.DataFrame, day: date) -> pl.DataFrame:
    start = datetime(day.year, day.month, day.day, tzinfo=timezone.utc)
    return frame.filter(pl.col("timestamp").is_between(start, start + timedelta(days=1), closed="left"))
