"""Jobs and schedules over the asset graph."""

import dagster as dg

from assets.partitions import daily_partitions

prepare_data_job = dg.define_asset_job(
    "prepare_data",
    selection=dg.AssetSelection.groups("data"),
    partitions_def=daily_partitions,
    description="One day's raw events, then sequence_logs and shuffled_batches over the look-back window.",
)

gem_pipeline_job = dg.define_asset_job(
    "gem_pipeline",
    selection=dg.AssetSelection.groups("data", "training"),
    partitions_def=daily_partitions,
    description="The day's data, then GEM retrained on it, warm-started from the previous day's checkpoint.",
)

# Daily retraining on the newest partition (off until turned on in the UI).
gem_pipeline_schedule = dg.build_schedule_from_partitioned_job(gem_pipeline_job, hour_of_day=1)
