"""The data benchmarks/mfu.py trains on, prepared here (the GPU machine has no polars): the pipeline's
sequence_logs of 2026-11-14 on its default synthetic source (14 days, 5000 users), histories of up to
1024 events, the last day held out, and a Base Batch Shuffling plan of --batch-size examples per rank and
step for each of --world-sizes (weak scaling: `mfu.py --nproc 2` trains twice the samples per step).

    python -m benchmarks.mfu_data DIR [--batch-size 1024] [--world-sizes 1 2]
    python -m benchmarks.mfu --data DIR          # then, on the GPU machine
"""

from __future__ import annotations

import argparse
import json
from datetime import date
from pathlib import Path

END = date(2026, 11, 14)
DAYS = 14
SUB_BATCH = 128


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("destination", type=Path)
    parser.add_argument("--batch-size", type=int, default=1024, help=f"a multiple of {SUB_BATCH}")
    parser.add_argument("--max-history-len", type=int, default=1024)
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[1])
    args = parser.parse_args()
    if args.batch_size % SUB_BATCH or args.batch_size < SUB_BATCH:
        raise SystemExit(f"--batch-size must be a positive multiple of {SUB_BATCH}, got {args.batch_size}")

    from assets.raw_event_logs import RawEventLogsConfig
    from gem_ops.data.batch_shuffling import ShufflingConfig
    from gem_ops.data.prepare import prepare_training_data
    from gem_ops.data.sequence_logs import SequenceLogsConfig

    data = prepare_training_data(RawEventLogsConfig().event_source(), END, DAYS, args.destination,
                                 SequenceLogsConfig(max_history_len=args.max_history_len, eval_days=1),
                                 ShufflingConfig(SUB_BATCH, args.batch_size // SUB_BATCH), world_sizes=args.world_sizes)
    summary = json.loads((data.sequence_logs / "manifest.json").read_text())["summary"]
    print(f"{data.sequence_logs}: {summary['n_events']} events, {summary['n_examples']} examples "
          f"({summary['n_train']} train), plan {data.plans[1]}")


if __name__ == "__main__":
    main()
