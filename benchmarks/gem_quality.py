"""Offline quality of GEM against two baselines on the same split of the bundled MovieLens sample.

The models, each trained with the same loop, plan, epochs and optimizer settings:
    gem                  the GEM preset (pyramid sequence arm, InterFormer, Wukong)
    gem_no_sequence      the same model without its sequence arm
    logistic_regression  per-task logistic regression on the same hashed ids
AUC, normalized entropy and calibration per task (and per surface) on the eval days, saved to
benchmarks/results/gem_quality.json.

    python benchmarks/gem_quality.py [--epochs 2] [--max-history-len 256] [--width 1.0]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from datetime import date
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from benchmarks.common import save  # noqa: E402

END = date(2026, 11, 14)
DAYS = 14


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--max-history-len", type=int, default=256)
    parser.add_argument("--eval-days", type=int, default=2)
    parser.add_argument("--width", type=float, default=1.0)
    parser.add_argument("--lr-dense", type=float, default=2e-3)
    parser.add_argument("--models", nargs="+", default=["gem", "gem_no_sequence", "logistic_regression"])
    args = parser.parse_args()

    from gem_ops.data.batch_shuffling import ShufflingConfig
    from gem_ops.data.movielens import MOVIELENS_HISTORY_EVENT_TYPES
    from gem_ops.data.prepare import prepare_training_data
    from gem_ops.data.raw_event_logs import EventSource
    from gem_ops.data.sequence_logs import SequenceLogsConfig
    from gem_ops.model.config import model_config
    from gem_ops.train.comparison import compare_models, headline
    from gem_ops.train.config import TrainConfig

    configs = {
        "gem": model_config("gem", width=args.width, **{"sequence.max_history_len": args.max_history_len}),
        "gem_no_sequence": model_config("gem", width=args.width, use_sequence=False),
        "logistic_regression": model_config("logistic_regression"),
    }
    train_config = TrainConfig(epochs=args.epochs, lr_dense=args.lr_dense, eval_max_examples=1_000_000)
    with tempfile.TemporaryDirectory() as tmp:
        data = prepare_training_data(
            EventSource("movielens", movielens_replay_days=DAYS), END, DAYS, tmp,
            SequenceLogsConfig(max_history_len=args.max_history_len, eval_days=args.eval_days,
                               history_event_types=MOVIELENS_HISTORY_EVENT_TYPES),
            ShufflingConfig(sub_batch_size=128, sub_batches_per_rank=2),
        )
        logs = data.open()
        split = {"train": int(logs.split_indices("train").size), "eval": int(logs.split_indices("eval").size)}
        print(f"MovieLens: {len(logs)} examples, {split}", flush=True)
        def progress(name: str, step: int, loss: float) -> None:
            if (step + 1) % 100 == 0:
                print(f"  {name} step {step + 1}: loss {loss:.4f}", flush=True)

        results = compare_models(logs, data.plans[1], {n: configs[n] for n in args.models}, train_config, progress)
    for name, figures in headline(results).items():
        print(f"{name}: {figures} ({results[name]['train_seconds']} s)")
    settings = {**vars(args), "end": END.isoformat(), "days": DAYS, "split": split,
                "train_config": train_config.to_dict(), "models": {n: configs[n].to_dict() for n in args.models}}
    save("gem_quality", settings, results)


if __name__ == "__main__":
    main()
