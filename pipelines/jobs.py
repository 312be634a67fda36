"""Jobs and schedules over the asset graph."""

import dagster as dg

from assets.partitions import daily_partitions

prepare_data_job = dg.define_asset_job(
    "prepare_data",
    selection=dg.AssetSelection.groups("data"),
    partitions_def=daily_partitions,
    description="One day's raw events, then sequence_logs and shuffled_batches over the look-back window.",
)

prepare_data_schedule = dg.build_schedule_from_partitioned_job(prepare_data_job, hour_of_day=1)
