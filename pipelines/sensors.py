"""A sensor that starts the daily pipeline when a new day of event logs lands in the input folder.

The files follow GEM_EVENTS_TEMPLATE, a path with {date} (e.g. /data/events/{date}.parquet), read through
the `parquet` source. Each evaluation looks for days newer than the last one it started (its cursor): the
newest new day runs the whole `gem_pipeline`; older new days that landed with it only bring their raw
events in (the newest day's sequence_logs reads them as its look-back window)."""

from __future__ import annotations

import os
from datetime import date

import dagster as dg

from assets.partitions import PARTITIONS_START
from pipelines.data_window import landed_days
from pipelines.jobs import gem_pipeline_job

TEMPLATE_ENV = "GEM_EVENTS_TEMPLATE"


@dg.sensor(job=gem_pipeline_job, minimum_interval_seconds=60, default_status=dg.DefaultSensorStatus.STOPPED,
           description=f"Starts gem_pipeline for each new day of event logs under {TEMPLATE_ENV} (a path with "
                       f"{{date}}).")
def new_event_days_sensor(context: dg.SensorEvaluationContext):
    template = os.environ.get(TEMPLATE_ENV)
    if not template:
        return dg.SkipReason(f"{TEMPLATE_ENV} is not set: point it at the event files, e.g. "
                             f"/data/events/{{date}}.parquet")
    today = date.today().isoformat()
    new = [d for d in landed_days(template) if d > (context.cursor or "") and PARTITIONS_START <= d <= today]
    if not new:
        return dg.SkipReason(f"no day after {context.cursor or 'the start'} under {template}")
    source = {"ops": {"raw_event_logs": {"config": {"source": "parquet", "parquet_template": template}}}}
    requests = [dg.RunRequest(run_key=day, partition_key=day, run_config=source, tags={"gem/landed": day},
                              asset_selection=None if day == new[-1] else [dg.AssetKey("raw_event_logs")])
                for day in new]
    context.update_cursor(new[-1])
    return requests
