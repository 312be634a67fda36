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
    selection=dg.AssetSelection.groups("data", "training", "transfer", "serving"),
    partitions_def=daily_partitions,
    description="The day's data, GEM retrained on it (warm-started from the previous day's checkpoint), then its "
    "knowledge transferred to the domain foundation models and the vertical models, whose challengers are "
    "promoted only when not measurably worse than their champions; each champion is then exported for serving and "
    "serves only within the latency budget.",
)

measure_mfu_job = dg.define_asset_job(
    "measure_mfu",
    selection=dg.AssetSelection.assets("mfu_report"),
    partitions_def=daily_partitions,
    description="Model FLOPs utilization of a timed window of GEM training steps on the day's data (device, "
    "preset and precision in the run config).",
)

# Daily retraining on the newest partition (off until turned on in the UI).
gem_pipeline_schedule = dg.build_schedule_from_partitioned_job(gem_pipeline_job, hour_of_day=1)
