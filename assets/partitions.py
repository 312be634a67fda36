"""Partitioning shared by the data assets: one partition per UTC day."""

import os

import dagster as dg

# The first daily partition; GEM_PARTITIONS_START moves it (the local runner sets it from the data it is
# given; start `make dagster` with the same value to see those days).
PARTITIONS_START = os.environ.get("GEM_PARTITIONS_START") or "2026-11-01"
LOOKBACK_DAYS = 14
"""Days of raw events behind one sequence_logs partition (histories reach this far back)."""

daily_partitions = dg.DailyPartitionsDefinition(start_date=PARTITIONS_START, timezone="UTC")

lookback_window = dg.TimeWindowPartitionMapping(
    start_offset=-(LOOKBACK_DAYS - 1), end_offset=0, allow_nonexistent_upstream_partitions=True
)
