"""The data benchmarks/mfu.py trains on, prepared here (the GPU machine has no polars): the pipeline's
sequence_logs of 2026-11-14 on its default synthetic source (14 days, 5000 users), histories of up to
1024 events, the last day held out, and a Base Batch Shuffling plan of --batch-size examples per rank and
step for each of --world-sizes (weak scaling: `mfu.py --nproc 2` trains twice the samples per step).

    python -m benchmarks.mfu_data DIR [--batch-size 1024] [--world-sizes 1 2]
    python -m benchmarks.mfu --data DIR          # then, on the GPU machine

`--repeat-step K` also writes DIR/plans_repeat_K, each plan's step K as every one of its steps: batches of one set of
sizes, what a step costs where nothing is new from step to step (`mfu.py --plans DIR/plans_repeat_K`).
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
    parser.add_argument("--repeat-step", type=int, default=None, help="also a plan of this step alone, repeated")
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
    if args.repeat_step is not None:
        for path in data.plans.values():
            print(f"step {args.repeat_step} repeated: {repeated_step_plan(path, args.repeat_step)}")


def repeated_step_plan(path: Path, step: int) -> Path:
    """A copy of the plan at `path` (in plans_repeat_<step> beside its folder) whose every step is its step `step`."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from gem_ops.data.atomic import atomic_path

    table = pq.read_table(path)
    steps = table.column("step").to_numpy()
    if not 0 <= step <= steps.max():
        raise SystemExit(f"--repeat-step {step}: {path} has steps 0-{steps.max()}")
    rows = table.filter(pa.compute.equal(table.column("step"), step))
    by_rank = {int(r): i for i, r in enumerate(rows.column("rank").to_numpy())}
    take = [by_rank[int(r)] for r in table.column("rank").to_numpy()]
    for name in ("cost", "examples"):
        table = table.set_column(table.schema.get_field_index(name), name, rows.column(name).take(take))
    out = path.parent.parent / f"plans_repeat_{step}" / path.name
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(out) as tmp:
        pq.write_table(table.replace_schema_metadata(pq.read_schema(path).metadata), tmp)
    return out


if __name__ == "__main__":
    main()
