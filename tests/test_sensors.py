"""The schedule and the sensor, evaluated with Dagster's own contexts: the daily schedule asks for the
previous day's partition; the sensor starts the pipeline for each new day of event files, once."""

from datetime import datetime, timezone

import dagster as dg
import polars as pl

from pipelines.definitions import defs
from pipelines.jobs import gem_pipeline_schedule
from pipelines.data_window import landed_days
from pipelines.sensors import TEMPLATE_ENV, new_event_days_sensor


def test_the_daily_schedule_retrains_on_the_day_before():
    context = dg.build_schedule_context(scheduled_execution_time=datetime(2026, 11, 15, 1, tzinfo=timezone.utc))
    (request,) = list(gem_pipeline_schedule.evaluate_tick(context).run_requests)
    assert request.partition_key == "2026-11-14"


def _context(cursor: str | None = None) -> dg.SensorEvaluationContext:
    return dg.build_sensor_context(cursor=cursor, definitions=defs)


def _land(folder, day: str):
    pl.DataFrame({"user_id": [1]}).write_parquet(folder / f"{day}.parquet")


def test_the_sensor_starts_each_new_day_once(tmp_path, monkeypatch):
    template = str(tmp_path / "{date}.parquet")
    skipped = new_event_days_sensor.evaluate_tick(_context())
    assert not skipped.run_requests and TEMPLATE_ENV in skipped.skip_message

    monkeypatch.setenv(TEMPLATE_ENV, template)
    for day in ("2026-11-02", "2026-11-03"):
        _land(tmp_path, day)
    (tmp_path / "notes.parquet").write_text("not a day")
    assert landed_days(template) == ["2026-11-02", "2026-11-03"]

    first = new_event_days_sensor.evaluate_tick(_context())
    older, newest = first.run_requests
    assert (older.partition_key, newest.partition_key) == ("2026-11-02", "2026-11-03")
    assert older.asset_selection == [dg.AssetKey("raw_event_logs")] and newest.asset_selection is None
    assert newest.run_config["ops"]["raw_event_logs"]["config"] == {"source": "parquet", "parquet_template": template}
    assert first.cursor == "2026-11-03"

    again = new_event_days_sensor.evaluate_tick(_context(first.cursor))
    assert not again.run_requests and "no day after 2026-11-03" in again.skip_message
    _land(tmp_path, "2026-11-04")
    (later,) = new_event_days_sensor.evaluate_tick(_context(first.cursor)).run_requests
    assert later.partition_key == "2026-11-04" and later.run_key == "2026-11-04"
