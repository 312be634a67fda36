"""Small hand-built event logs for the data tests (gem_ops.data)."""

from __future__ import annotations

from datetime import date, datetime, timedelta, timezone
from pathlib import Path

import polars as pl

from gem_ops.data.event_logs import normalize_event_log
from gem_ops.data.loader import SequenceLogs
from gem_ops.data.sequence_logs import SequenceLogsConfig, SequenceLogsSummary, build_sequence_logs

DAY0 = date(2026, 11, 1)

# The canonical dtype of every column the tests' event logs use (gem_ops.data.schema).
CANONICAL_DTYPES = {
    "user_id": pl.Int64,
    "timestamp": pl.Datetime("ms", "UTC"),
    "item_id": pl.Int64,
    "surface": pl.String,
    "event_type": pl.String,
    "label_click": pl.Int8,
    "label_conversion": pl.Int8,
    "user_segment": pl.Int64,
    "user_age_bucket": pl.Int64,
    "item_category": pl.Int64,
    "item_advertiser": pl.Int64,
    "item_bid": pl.Float32,
}

# (user_id, day, second of day, item_id, surface, event_type, label_click, label_conversion)
# Item ids are unique, so an example can be found by its item.
HAND_EVENTS = [
    # user 7: ties on day 1, a history-only view in the tie, a 'notification' on day 2
    (7, 0, 100, 11, "feed", "organic_view", None, None),
    (7, 0, 200, 12, "feed", "ad_impression", 1, 0),
    (7, 1, 50, 13, "reels", "ad_impression", 0, None),
    (7, 1, 50, 14, "reels", "ad_impression", 1, 1),
    (7, 1, 50, 15, "feed", "organic_view", None, None),
    (7, 2, 10, 16, "search", "notification", 0, None),
    (7, 2, 20, 17, "feed", "ad_impression", 0, 0),
    # user 42: one event
    (42, 1, 500, 21, "feed", "ad_impression", 0, 0),
    # user 1000: one view, then ads on day 0 and day 2
    (1000, 0, 0, 31, "feed", "organic_view", None, None),
    (1000, 0, 1, 32, "reels", "ad_impression", 0, 0),
    (1000, 0, 2, 33, "feed", "ad_impression", 1, 0),
    (1000, 2, 5, 34, "stories", "ad_impression", 0, None),
]
HAND_HISTORY_ITEMS = {  # candidate item -> history items, all event types, no truncation
    12: [11],
    13: [11, 12],
    14: [11, 12],
    16: [11, 12, 13, 14, 15],
    17: [11, 12, 13, 14, 15, 16],
    21: [],
    32: [31],
    33: [31, 32],
    34: [31, 32, 33],
}


def ts(day: int, second: float) -> datetime:
    return datetime(DAY0.year, DAY0.month, DAY0.day, tzinfo=timezone.utc) + timedelta(days=day, seconds=second)


def hand_events(rows=HAND_EVENTS) -> pl.DataFrame:
    """The hand-built log in canonical dtypes, with one sparse and one dense feature."""
    frame = pl.DataFrame(
        {
            "user_id": [r[0] for r in rows],
            "timestamp": [ts(r[1], r[2]) for r in rows],
            "item_id": [r[3] for r in rows],
            "surface": [r[4] for r in rows],
            "event_type": [r[5] for r in rows],
            "label_click": pl.Series([r[6] for r in rows], dtype=pl.Int8),
            "label_conversion": pl.Series([r[7] for r in rows], dtype=pl.Int8),
            "user_segment": [r[0] % 5 for r in rows],
            "item_bid": [r[3] / 10 for r in rows],
        }
    )
    return normalize_event_log(frame, "hand-built")


def valid_raw_events(n: int = 4) -> pl.DataFrame:
    """A small valid log as a user might write it (not yet canonical)."""
    return pl.DataFrame(
        {
            "user_id": list(range(n)),
            "timestamp": [ts(0, 60 * i) for i in range(n)],
            "item_id": [100 + i for i in range(n)],
            "surface": ["feed"] * n,
            "event_type": ["ad_impression"] * n,
            "label_click": [i % 2 for i in range(n)],
            "user_segment": [i % 3 for i in range(n)],
            "item_bid": [0.5 * i for i in range(n)],
        }
    )


def write(frame: pl.DataFrame, path: Path) -> Path:
    frame.write_parquet(path)
    return path


def example_by_item(logs: SequenceLogs, item_id: int) -> int:
    (rows,) = (logs.column("item_id") == item_id).nonzero()
    assert rows.size == 1, f"item {item_id} is not exactly one example"
    return int(rows[0])


def history_items(logs: SequenceLogs, item_id: int, max_history_len: int | None = None) -> list[int]:
    batch = logs.batch([example_by_item(logs, item_id)], max_history_len=max_history_len)
    return batch.history_item_id.tolist()


def histories_by_key(logs: SequenceLogs) -> list[tuple]:
    """Every example as ((user_id, timestamp, item_id), labels, history item ids, history ages), sorted,
    so logs whose examples come in different row orders compare equal."""
    batch = logs.batch(range(len(logs)))
    users = logs.user_ids[logs.column("user_row")]
    offsets = batch.history_offsets.tolist()
    items, ages = batch.history_item_id.tolist(), batch.history_age_seconds.tolist()
    labels = batch.labels.tolist()
    out = []
    for i in range(batch.size):
        a, b = offsets[i], offsets[i + 1]
        key = (int(users[i]), int(batch.timestamp[i]), int(batch.item_id[i]))
        out.append((key, tuple(labels[i]), tuple(items[a:b]), tuple(ages[a:b])))
    return sorted(out)


def build(paths, destination: Path, **config) -> tuple[SequenceLogsSummary, SequenceLogs]:
    """Builds sequence_logs from event files (or one frame) and opens it."""
    if isinstance(paths, pl.DataFrame):
        paths = [write(paths, destination.parent / f"{destination.name}-events.parquet")]
    summary = build_sequence_logs(paths, destination, SequenceLogsConfig(**config))
    return summary, SequenceLogs(destination)
