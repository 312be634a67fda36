"""Event-log reading and validation, daily raw partitions, and atomic writes."""

from datetime import date, datetime, timezone
import os
from pathlib import Path

import polars as pl
import pytest

from gem_ops.data.atomic import atomic_path, write_parquet_atomic
from gem_ops.data.event_logs import read_event_log
from gem_ops.data.raw_event_logs import EventSource, load_day, write_partition
from gem_ops.data.schema import REQUIRED_COLUMNS, EventLogError
from tests.event_log_builders import CANONICAL_DTYPES, DAY0, hand_events, ts, valid_raw_events, write

CANONICAL = {c: CANONICAL_DTYPES[c] for c in ("user_id", "timestamp", "item_id", "surface", "event_type",
                                              "label_click", "user_segment", "item_bid")}


def read_error(path: Path) -> EventLogError:
    with pytest.raises(EventLogError) as info:
        read_event_log(path)
    assert str(path) in str(info.value)
    return info.value


def assert_names_column(err: EventLogError, column: str):
    assert err.column == column
    assert f"'{column}'" in str(err)


# --- reader: bad input ---------------------------------------------------------------------------


@pytest.mark.parametrize("column", REQUIRED_COLUMNS)
def test_missing_required_column_names_file_and_column(tmp_path, column):
    path = write(valid_raw_events().drop(column), tmp_path / "events.parquet")
    err = read_error(path)
    assert_names_column(err, column)
    assert "missing" in str(err)


@pytest.mark.parametrize(
    "column, bad_values",
    [
        ("user_id", ["a", "b", "c", "d"]),
        ("surface", [1, 2, 3, 4]),
        ("label_click", ["0", "1", "0", "1"]),
        ("user_segment", ["x", "y", "x", "y"]),
        ("item_bid", ["0.5", "1", "2", "3"]),
    ],
)
def test_mistyped_column_names_file_and_column(tmp_path, column, bad_values):
    frame = valid_raw_events().with_columns(pl.Series(column, bad_values))
    err = read_error(write(frame, tmp_path / "events.parquet"))
    assert_names_column(err, column)


@pytest.mark.parametrize("column", ["user_id", "item_id"])
def test_null_ids_are_rejected(tmp_path, column):
    frame = valid_raw_events().with_columns(pl.Series(column, [1, None, 3, 4], dtype=pl.Int64))
    err = read_error(write(frame, tmp_path / "events.parquet"))
    assert_names_column(err, column)
    assert "null" in str(err)


def test_unparseable_timestamp_shows_an_example_value(tmp_path):
    stamps = ["2026-11-01T10:00:00Z", "yesterday at noon", "2026-11-01 11:00:00", "2026-11-01T12:00:00"]
    frame = valid_raw_events().with_columns(pl.Series("timestamp", stamps))
    err = read_error(write(frame, tmp_path / "events.parquet"))
    assert_names_column(err, "timestamp")
    assert "yesterday at noon" in str(err)
    assert "1 value(s)" in str(err)


def test_empty_file_is_rejected(tmp_path):
    err = read_error(write(valid_raw_events().head(0), tmp_path / "empty.parquet"))
    assert "no rows" in str(err)


def test_log_without_label_column_is_rejected(tmp_path):
    err = read_error(write(valid_raw_events().drop("label_click"), tmp_path / "events.parquet"))
    assert "label_" in str(err)


def test_label_values_outside_0_1_are_rejected(tmp_path):
    frame = valid_raw_events().with_columns(pl.Series("label_click", [0, 1, 2, -1]))
    err = read_error(write(frame, tmp_path / "events.parquet"))
    assert_names_column(err, "label_click")
    assert "2 label value(s)" in str(err)


def test_file_that_is_not_parquet_is_rejected(tmp_path):
    path = tmp_path / "events.parquet"
    path.write_text("user_id,timestamp\n1,2026-11-01\n")
    assert "Parquet" in str(read_error(path))


def test_missing_file_is_rejected(tmp_path):
    assert "not found" in str(read_error(tmp_path / "nowhere.parquet"))


# --- reader: good input --------------------------------------------------------------------------


def test_mixed_iso_strings_and_zones_normalise_to_utc_ms(tmp_path):
    stamps = ["2026-11-01T10:00:00Z", "2026-11-01 12:00:00+02:00", "2026-11-01T05:00:00.123-05:00",
              "2026-11-01T10:30:00"]
    frame = valid_raw_events().with_columns(pl.Series("timestamp", stamps))
    events = read_event_log(write(frame, tmp_path / "events.parquet"))
    utc = timezone.utc
    assert events["timestamp"].dtype == pl.Datetime("ms", "UTC")
    assert events["timestamp"].to_list() == [
        datetime(2026, 11, 1, 10, 0, tzinfo=utc),
        datetime(2026, 11, 1, 10, 0, tzinfo=utc),
        datetime(2026, 11, 1, 10, 0, 0, 123_000, tzinfo=utc),
        datetime(2026, 11, 1, 10, 30, tzinfo=utc),  # naive: taken as UTC
    ]


def test_naive_datetimes_are_taken_as_utc(tmp_path):
    naive = [datetime(2026, 11, 1, 8, 15, 0, 250_000), datetime(2026, 11, 1, 23, 59, 59)]
    frame = valid_raw_events(2).with_columns(pl.Series("timestamp", naive, dtype=pl.Datetime("us")))
    events = read_event_log(write(frame, tmp_path / "events.parquet"))
    assert events["timestamp"].to_list() == [d.replace(tzinfo=timezone.utc) for d in naive]


def test_zoned_datetimes_are_converted_to_utc(tmp_path):
    paris = pl.Series("timestamp", [datetime(2026, 11, 1, 12, 0)] * 2).dt.replace_time_zone("Europe/Paris")
    frame = valid_raw_events(2).with_columns(paris.cast(pl.Datetime("ns", "Europe/Paris")))
    events = read_event_log(write(frame, tmp_path / "events.parquet"))
    assert events["timestamp"].to_list() == [datetime(2026, 11, 1, 11, 0, tzinfo=timezone.utc)] * 2


def test_good_log_gets_canonical_dtypes(tmp_path):
    frame = valid_raw_events().with_columns(
        pl.col("user_id").cast(pl.Int32),
        pl.col("item_id").cast(pl.UInt16),
        pl.col("surface").cast(pl.Categorical),
        pl.col("label_click").cast(pl.Boolean),
        pl.col("user_segment").cast(pl.Int16),
        pl.col("item_bid").cast(pl.Float64),
    )
    events = read_event_log(write(frame, tmp_path / "events.parquet"))
    assert dict(events.schema) == CANONICAL
    assert events["label_click"].to_list() == [0, 1, 0, 1]
    assert events["item_id"].to_list() == [100, 101, 102, 103]


# --- raw_event_logs ------------------------------------------------------------------------------


def test_load_day_reads_a_parquet_day(tmp_path):
    write(valid_raw_events(), tmp_path / f"{DAY0.isoformat()}.parquet")
    source = EventSource(kind="parquet", parquet_template=str(tmp_path / "{date}.parquet"))
    events = load_day(source, DAY0)
    assert events.height == 4
    assert dict(events.schema) == CANONICAL


def test_load_day_rejects_events_from_another_day(tmp_path):
    day = date(2026, 11, 2)
    stamps = [ts(1, 10), ts(1, 20), ts(2, 5), ts(1, 86_399)]  # the third is on the next day
    path = write(valid_raw_events().with_columns(pl.Series("timestamp", stamps)), tmp_path / f"{day}.parquet")
    source = EventSource(kind="parquet", parquet_template=str(tmp_path / "{date}.parquet"))
    with pytest.raises(EventLogError) as info:
        load_day(source, day)
    assert str(path) in str(info.value)
    assert "'timestamp'" in str(info.value)
    assert "1 event(s)" in str(info.value)


def test_write_partition_sorts_by_user_then_time(tmp_path):
    events = hand_events().reverse()
    path = write_partition(events, tmp_path / "day.parquet")
    stored = pl.read_parquet(path)
    assert stored.equals(events.sort(["user_id", "timestamp"], maintain_order=True))
    keys = list(zip(stored["user_id"], stored["timestamp"]))
    assert keys == sorted(keys)


# --- atomic writes -------------------------------------------------------------------------------


def test_write_parquet_atomic_failure_leaves_nothing(tmp_path):
    with pytest.raises(Exception):
        write_parquet_atomic(valid_raw_events(), tmp_path / "out.parquet", compression="no-such-codec")
    assert list(tmp_path.iterdir()) == []


def test_write_parquet_atomic_failure_keeps_existing_file(tmp_path):
    destination = tmp_path / "out.parquet"
    destination.write_bytes(b"previous")
    with pytest.raises(Exception):
        write_parquet_atomic(valid_raw_events(), destination, compression="no-such-codec")
    assert destination.read_bytes() == b"previous"
    assert list(tmp_path.iterdir()) == [destination]


def test_write_parquet_atomic_success_replaces_file(tmp_path):
    destination = tmp_path / "out.parquet"
    destination.write_bytes(b"previous")
    write_parquet_atomic(valid_raw_events(), destination)
    assert pl.read_parquet(destination).equals(valid_raw_events())
    assert list(tmp_path.iterdir()) == [destination]


def test_atomic_path_body_error_leaves_no_file_or_temporary(tmp_path):
    with pytest.raises(RuntimeError, match="boom"):
        with atomic_path(tmp_path / "out.bin") as tmp:
            tmp.write_bytes(b"half written")
            raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []


def test_atomic_path_body_error_keeps_existing_folder(tmp_path):
    destination = tmp_path / "folder"
    destination.mkdir()
    (destination / "a.txt").write_text("old")
    with pytest.raises(RuntimeError):
        with atomic_path(destination) as tmp:
            tmp.mkdir()
            (tmp / "b.txt").write_text("new")
            raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == [destination]
    assert [p.name for p in destination.iterdir()] == ["a.txt"]
    assert (destination / "a.txt").read_text() == "old"


def test_atomic_path_success_replaces_folder(tmp_path):
    destination = tmp_path / "folder"
    destination.mkdir()
    (destination / "a.txt").write_text("old")
    with atomic_path(destination) as tmp:
        tmp.mkdir()
        (tmp / "b.txt").write_text("new")
        assert not (destination / "b.txt").exists()  # nothing visible before the rename
    assert list(tmp_path.iterdir()) == [destination]
    assert [p.name for p in destination.iterdir()] == ["b.txt"]


def test_atomic_path_success_replaces_file(tmp_path):
    destination = tmp_path / "out.bin"
    destination.write_bytes(b"old")
    with atomic_path(destination) as tmp:
        tmp.write_bytes(b"new")
    assert destination.read_bytes() == b"new"
    assert list(tmp_path.iterdir()) == [destination]


def test_a_writer_killed_mid_write_leaves_nothing_behind_the_next_write(tmp_path):
    """SIGKILL while a sequence-logs-style folder is half written: the next write of the same destination
    removes what the dead writer left, while a live writer's temporary folder stays."""
    import signal
    import subprocess
    import sys
    import time

    destination = tmp_path / "2026-11-03"
    script = (f"from gem_ops.data.atomic import atomic_path\nimport time\n"
              f"with atomic_path({str(destination)!r}) as tmp:\n"
              f"    tmp.mkdir()\n    (tmp / 'part-0.parquet').write_bytes(b'half')\n    time.sleep(60)\n")
    writer = subprocess.Popen([sys.executable, "-c", script], cwd=Path(__file__).resolve().parents[1])
    deadline = time.monotonic() + 30
    while not list(tmp_path.glob(".2026-11-03.*/2026-11-03/part-0.parquet")) and time.monotonic() < deadline:
        time.sleep(0.1)
    live = tmp_path / f".2026-11-03.{os.getpid()}.live"  # a writer of this process, still at work
    live.mkdir()
    writer.send_signal(signal.SIGKILL)
    writer.wait()
    assert len(list(tmp_path.glob(".2026-11-03.*"))) == 2  # the dead writer's and the live one's
    with atomic_path(destination) as tmp:
        tmp.mkdir()
        (tmp / "part-0.parquet").write_bytes(b"whole")
    assert sorted(p.name for p in tmp_path.iterdir()) == [live.name, "2026-11-03"]
    assert (destination / "part-0.parquet").read_bytes() == b"whole"
