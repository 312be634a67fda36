"""All data steps in one call (raw days -> sequence_logs -> shuffled_batches plans), for scripts and
tests that need a training set without running the Dagster assets one by one."""

from __future__ import annotations

import os
from collections.abc import Sequence
from datetime import date, timedelta
from pathlib import Path

from gem_ops.data.batch_shuffling import ShufflingConfig, plan_base_batch_shuffling, write_plan
from gem_ops.data.loader import TrainingData
from gem_ops.data.raw_event_logs import EventSource, load_day, write_partition
from gem_ops.data.sequence_logs import SequenceLogsConfig, build_sequence_logs


def prepare_training_data(
    source: EventSource,
    end: date,
    days: int,
    destination: str | os.PathLike,
    sequences: SequenceLogsConfig = SequenceLogsConfig(),
    shuffling: ShufflingConfig = ShufflingConfig(),
    world_sizes: Sequence[int] = (1,),
) -> TrainingData:
    """Days end-days+1 .. end of `source` under destination/raw, then sequence_logs and one plan per world size."""
    destination = Path(destination)
    paths = []
    for i in range(days):
        day = end - timedelta(days=days - 1 - i)
        frame = load_day(source, day)
        if frame.height:
            paths.append(write_partition(frame, destination / "raw" / f"{day.isoformat()}.parquet"))
    if not paths:
        raise ValueError(f"no events from the {source.kind} source in the {days} days up to {end}")
    data = TrainingData(destination / "sequence_logs")
    build_sequence_logs(paths, data.sequence_logs, sequences)
    logs = data.open()
    train = logs.split_indices("train")
    lengths = logs.history_lengths()[train]
    for world_size in world_sizes:
        plan = plan_base_batch_shuffling(lengths, world_size, shuffling, train)
        data.plans[world_size] = write_plan(plan, destination / "plans" / f"world_size={world_size}.parquet",
                                            logs.max_history_len)
    return data
