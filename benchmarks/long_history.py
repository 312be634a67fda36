"""Long histories against short ones on the synthetic log's long-range (retargeting) pattern.

The STRONG_SIGNAL synthetic preset lifts clicks and conversions on ads a user viewed in the first days;
only a history long enough to reach back there can see them. The same GEM config is trained with
histories cut to --long and to --short events, on the same data, plan and budget; the eval AUC and NE of
both and their difference are saved to benchmarks/results/long_history.json.

    python benchmarks/long_history.py [--long 128] [--short 8] [--epochs 1]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from benchmarks.common import save  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--long", type=int, default=128)
    parser.add_argument("--short", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--width", type=float, default=0.5)
    parser.add_argument("--blocks", type=int, default=2)
    parser.add_argument("--lr-dense", type=float, default=3e-3)
    args = parser.parse_args()

    from datetime import date

    from gem_ops.data.batch_shuffling import ShufflingConfig
    from gem_ops.data.prepare import prepare_training_data
    from gem_ops.data.raw_event_logs import EventSource
    from gem_ops.data.sequence_logs import SequenceLogsConfig
    from gem_ops.data.synthetic import STRONG_SIGNAL
    from gem_ops.model.config import model_config
    from gem_ops.train.comparison import compare_models, headline
    from gem_ops.train.config import TrainConfig

    def gem(max_history_len: int):
        return model_config("gem", width=args.width, blocks=args.blocks,
                            **{"sequence.max_history_len": max_history_len, "sequence.first_level_tokens": 32})

    configs = {"long": gem(args.long), "short": gem(args.short)}
    train_config = TrainConfig(epochs=args.epochs, lr_dense=args.lr_dense, eval_max_examples=1_000_000)
    with tempfile.TemporaryDirectory() as tmp:
        data = prepare_training_data(
            EventSource("synthetic", STRONG_SIGNAL), date(2026, 11, 14), 14, tmp,
            SequenceLogsConfig(max_history_len=args.long, eval_days=2),
            ShufflingConfig(sub_batch_size=64, sub_batches_per_rank=4),
        )
        results = compare_models(data.open(), data.plans[1], configs, train_config)
    table = headline(results)
    gain = {group: {m: round(table["long"][group][m] - table["short"][group][m], 4) for m in ("auc", "ne")}
            for group in table["long"]}
    for name, figures in table.items():
        print(f"{name}: {figures}")
    print(f"long - short: {gain}")
    settings = {**vars(args), "synthetic": "STRONG_SIGNAL", "days": 14, "eval_days": 2,
                "train_config": train_config.to_dict(), "models": {n: c.to_dict() for n, c in configs.items()}}
    save("long_history", settings, {"runs": results, "long_minus_short": gain})


if __name__ == "__main__":
    main()
