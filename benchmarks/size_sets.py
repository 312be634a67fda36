"""How many distinct sets of sizes GEM's compiled step meets over a prepared plan, exact and at each
`TrainConfig.size_bucket` ratio, and the tokens the padding adds (host only, no GPU). With
`TrainConfig.cuda_graphs` a graph is recorded for each new set, so this is how many recordings an epoch costs.

    python -m benchmarks.mfu_data .gpu_data/mfu
    python -m benchmarks.size_sets --data .gpu_data/mfu --width 0.5 --max-history-len 512
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from benchmarks.common import save


def size_set(x) -> tuple:
    """Every tensor's shape in a model input and its pyramid's level sizes: what a compiled graph is recorded for."""
    shapes = tuple((name, tuple(value.shape)) for name, value in sorted(vars(x).items())
                   if isinstance(value, torch.Tensor))
    levels = tuple(tuple(branch) for branch in (x.level_sizes or ()))
    return shapes, levels


def count_sets(batches, ratios: list[float], model_input_of) -> dict:
    """For each ratio (0: exact sizes): distinct sets, the step each first appears at, and padded over real tokens
    summed over every pyramid level."""
    real = sum(sum(map(sum, model_input_of(batch, 0.0).level_sizes)) for batch in batches)
    results = {}
    for ratio in ratios:
        seen, padded = {}, 0
        for step, batch in enumerate(batches):
            x = model_input_of(batch, ratio)
            seen.setdefault(size_set(x), step)
            padded += sum(map(sum, x.level_sizes))
        results[str(ratio)] = {"sets": len(seen), "steps": len(batches), "first_steps": sorted(seen.values()),
                               "padded_over_real_tokens": padded / real}
        print(f"size_bucket {ratio}: {len(seen)} sets over {len(batches)} steps, "
              f"{padded / real:.4f}x the level tokens")
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, required=True, help="mfu_data's folder (sequence_logs, plans)")
    parser.add_argument("--preset", default="gem_gpu")
    parser.add_argument("--width", type=float, default=1.0)
    parser.add_argument("--max-history-len", type=int, default=0, help="0: the preset's")
    parser.add_argument("--ratios", type=float, nargs="+", default=[0.0, 1.02, 1.05, 1.1, 1.2])
    parser.add_argument("--output-name", default="size_sets")
    args = parser.parse_args()

    from gem_ops.data.loader import SequenceLogs
    from gem_ops.model.config import FeatureSpec, model_config
    from gem_ops.model.features import model_input
    from gem_ops.train.batches import rank_schedule

    history = {"sequence.max_history_len": args.max_history_len} if args.max_history_len else {}
    config = model_config(args.preset, width=args.width, **history)
    max_len = config.sequence.max_history_len
    logs = SequenceLogs(args.data / "sequence_logs")
    spec = FeatureSpec.from_logs(logs)
    schedule = rank_schedule(logs, args.data / "plans" / "world_size=1.parquet", 0, 1, 1, 0, max_len)
    batches = [logs.batch(schedule.examples(step), max_len) for step in range(schedule.total_steps)]

    def model_input_of(batch, ratio):
        return model_input(batch, spec, config, with_level_sizes=True, size_bucket=ratio)

    results = count_sets(batches, args.ratios, model_input_of)
    save(args.output_name, vars(args), results)


if __name__ == "__main__":
    main()
