"""The small two-day gem_foundation_model set-up that the conftest fixture `gem_asset_runs` materializes."""

from datetime import date, timedelta

DAYS = [date(2026, 11, 1) + timedelta(days=i) for i in range(4)]
MODEL_NAME = "gem_test"
DATA_CONFIG = {
    "raw_event_logs": {"config": {"synthetic_users": 300}},
    "sequence_logs": {"config": {"lookback_days": 3, "max_history_len": 32}},
    "shuffled_batches": {"config": {"world_sizes": [1, 2], "sub_batches_per_rank": 1, "sub_batch_size": 32}},
}
TRAIN_CONFIG = {"preset": "vertical", "width": 0.5, "max_steps": 6, "epochs": 2, "eval_max_examples": 256,
                "checkpoint_every": 3,
                "model_overrides": {"sequence.max_history_len": "16"}, "registered_model_name": MODEL_NAME}
PROCESSES = {DAYS[2]: 2, DAYS[3]: 1}
