"""Bad input stopped at the door: the reader names the file, the column and the values at fault for
non-finite dense features, unsafe or reserved names, ids beyond int64 and a malformed parquet_template,
warns about repeated events, and a property-based test throws random malformed logs at the reader and
at sequence_logs: every outcome is a clean result or a clear ValueError, never another exception."""

import logging
import math
from datetime import date

import polars as pl
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gem_ops.data.event_logs import read_event_log
from gem_ops.data.raw_event_logs import parquet_path
from gem_ops.data.schema import EventLogError
from gem_ops.data.sequence_logs import SequenceLogsConfig, build_sequence_logs
from tests.event_log_builders import valid_raw_events, write


def error_of(frame: pl.DataFrame, tmp_path) -> EventLogError:
    path = write(frame, tmp_path / "events.parquet")
    with pytest.raises(EventLogError) as info:
        read_event_log(path)
    assert str(path) in str(info.value)
    return info.value


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_dense_features_name_file_and_column(tmp_path, bad):
    frame = valid_raw_events().with_columns(pl.Series("item_bid", [0.5, bad, 1.0, bad]))
    err = error_of(frame, tmp_path)
    assert err.column == "item_bid" and "2 NaN or infinite value(s) of 4" in str(err)


@pytest.mark.parametrize("name", ["../../../../../escaped", "/abs/path", "with space", "fëed", "", "a" * 65])
def test_unsafe_surface_names_are_refused_and_named(tmp_path, name):
    frame = valid_raw_events().with_columns(pl.Series("surface", ["feed", name, "feed", "feed"]))
    err = error_of(frame, tmp_path)
    assert err.column == "surface" and repr(name)[1:-1] in str(err) and "not safe names" in str(err)


def test_unsafe_event_types_and_column_names_are_refused(tmp_path):
    err = error_of(valid_raw_events().with_columns(pl.Series("event_type", ["a/b"] * 4)), tmp_path)
    assert err.column == "event_type"
    err = error_of(valid_raw_events().rename({"label_click": "label_cl ick"}), tmp_path)
    assert err.column == "label_cl ick"


def test_a_surface_named_all_is_refused(tmp_path):
    err = error_of(valid_raw_events().with_columns(pl.Series("surface", ["all", "feed", "feed", "feed"])), tmp_path)
    assert err.column == "surface" and "reserved" in str(err)


def test_ids_beyond_int64_are_named(tmp_path):
    frame = valid_raw_events().with_columns(pl.Series("item_id", [1, 2, 3, 2**63 + 5], dtype=pl.UInt64))
    err = error_of(frame, tmp_path)
    assert err.column == "item_id" and str(2**63 + 5) in str(err)


def test_parquet_template_placeholders_are_checked():
    assert parquet_path("/data/{date}.parquet", date(2026, 11, 3)) == "/data/2026-11-03.parquet"
    for template in ("/data/{day}.parquet", "/data/events.parquet", "/data/{date}/{hour}.parquet"):
        with pytest.raises(ValueError, match="one placeholder"):
            parquet_path(template, date(2026, 11, 3))


def test_repeated_events_are_kept_with_a_warning(tmp_path, caplog):
    frame = pl.concat([valid_raw_events(), valid_raw_events().head(2)])
    with caplog.at_level(logging.WARNING, logger="gem_ops.data.event_logs"):
        assert read_event_log(write(frame, tmp_path / "events.parquet")).height == 6
    assert "2 event(s) repeat another row exactly" in caplog.text


# --- random malformed logs -------------------------------------------------------------------------

CELLS = {
    "int": st.one_of(st.none(), st.integers(-(2**63), 2**63 - 1)),
    "float": st.one_of(st.none(), st.floats(allow_nan=True, allow_infinity=True)),
    "text": st.one_of(st.none(), st.text(max_size=8)),
    "label": st.one_of(st.none(), st.sampled_from([0, 1, 2, -1])),
    "time": st.one_of(st.none(), st.sampled_from(["2026-11-01T00:00:01", "2026-11-01 12:00", "not a time",
                                                  "2100-01-01T00:00:00", "2026-11-01T23:59:59Z"])),
}
COLUMNS = {"user_id": "int", "timestamp": "time", "item_id": "int", "surface": "text", "event_type": "text",
           "label_click": "label", "user_segment": "int", "item_bid": "float", "item_title": "text"}


@st.composite
def malformed_logs(draw) -> pl.DataFrame:
    n = draw(st.integers(0, 6))
    chosen = draw(st.lists(st.sampled_from(list(COLUMNS)), min_size=1, unique=True))
    data = {}
    for name in chosen:
        kind = draw(st.sampled_from(list(CELLS))) if draw(st.booleans()) else COLUMNS[name]
        data[name] = draw(st.lists(CELLS[kind], min_size=n, max_size=n))
    return pl.DataFrame(data, strict=False)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(frame=malformed_logs())
def test_random_malformed_logs_give_a_result_or_a_clear_error(tmp_path, frame):
    path = write(frame, tmp_path / "events.parquet")
    try:
        events = read_event_log(path)
    except ValueError as error:
        assert str(path) in str(error)
        return
    out = tmp_path / "sequence_logs"
    try:
        build_sequence_logs([write(events, tmp_path / "canonical.parquet")], out, SequenceLogsConfig(eval_days=0))
    except ValueError:
        pass
