"""Synthetic training sets for model tests (the generator's STRONG_SIGNAL preset by default)."""

from datetime import date
from pathlib import Path

from gem_ops.data.batch_shuffling import ShufflingConfig
from gem_ops.data.prepare import TrainingData, prepare_training_data
from gem_ops.data.raw_event_logs import EventSource
from gem_ops.data.sequence_logs import SequenceLogsConfig
from gem_ops.data.synthetic import STRONG_SIGNAL, SyntheticConfig


def learnable_data(root: Path, synthetic: SyntheticConfig = STRONG_SIGNAL, days: int = 14, eval_days: int = 2,
                   max_history_len: int = 256, sub_batch_size: int = 64) -> TrainingData:
    return prepare_training_data(
        EventSource("synthetic", synthetic), date(2026, 11, days), days, root,
        SequenceLogsConfig(max_history_len=max_history_len, eval_days=eval_days),
        ShufflingConfig(sub_batch_size=sub_batch_size, sub_batches_per_rank=4), world_sizes=(1,),
    )
