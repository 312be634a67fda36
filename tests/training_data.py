"""Synthetic training sets for model tests: the generator's planted signal, made strong and dense enough
to be learnt in seconds on a CPU."""

from datetime import date
from pathlib import Path

from gem_ops.data.batch_shuffling import ShufflingConfig
from gem_ops.data.prepare import TrainingData, prepare_training_data
from gem_ops.data.raw_event_logs import EventSource
from gem_ops.data.sequence_logs import SequenceLogsConfig
from gem_ops.data.synthetic import SurfaceSpec, SyntheticConfig

LEARNABLE = SyntheticConfig(
    n_users=3000, n_items=2000, n_ads=3000, n_advertisers=50, events_per_user_per_day=2.0, ad_share=0.6,
    surfaces=(SurfaceSpec("feed", 0.45, 0.12, 0.4), SurfaceSpec("reels", 0.25, 0.08, 0.35),
              SurfaceSpec("stories", 0.15, 0.06, None), SurfaceSpec("search", 0.15, 0.2, 0.4)),
    interest_ctr_lift=5.0, segment_category_sigma=1.0, ad_quality_sigma=0.8, age_surface_sigma=0.6,
    retarget_share=0.3, retarget_ctr_lift=6.0,
)


def learnable_data(root: Path, synthetic: SyntheticConfig = LEARNABLE, days: int = 14, eval_days: int = 2,
                   max_history_len: int = 256, sub_batch_size: int = 64) -> TrainingData:
    return prepare_training_data(
        EventSource("synthetic", synthetic), date(2026, 11, days), days, root,
        SequenceLogsConfig(max_history_len=max_history_len, eval_days=eval_days),
        ShufflingConfig(sub_batch_size=sub_batch_size, sub_batches_per_rank=4), world_sizes=(1,),
    )
