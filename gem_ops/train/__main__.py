"""`python -m gem_ops.train`: one GEM training job, on one process or launched by torchrun:

    torchrun --nproc-per-node 2 --max-restarts 2 -m gem_ops.train \\
        --sequence-logs lake/sequence_logs/2026-11-28 --plans lake/shuffled_batches/2026-11-28 \\
        --preset gem --checkpoint-dir lake/gem_foundation_model/2026-11-28/checkpoints \\
        --embedding-sharding row_wise --max-steps 500 --checkpoint-every 50

Each rank trains on its rows of plans/world_size=W.parquet; a restarted job resumes from the latest
checkpoint in --checkpoint-dir. Rank 0 logs to the MLflow run given by --mlflow-run-id and reports
progress and the final figures through Dagster Pipes when launched by a Pipes client.

For fault-tolerance drills, GEM_TRAIN_FAIL_AT_STEP=k makes rank GEM_TRAIN_FAIL_RANK (default 1) exit
with an error after step k on a job's first attempt (TORCHELASTIC_RESTART_COUNT 0), and
GEM_TRAIN_STEP_DELAY_S adds a pause after every step.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import time
import types
import typing
from pathlib import Path
from typing import Any

import numpy as np

from gem_ops.data.loader import SequenceLogs
from gem_ops.model.config import model_config
from gem_ops.tracking import RunTracker
from gem_ops.train.config import TrainConfig
from gem_ops.train.distributed import DistributedTrainResult, plan_for_world_size, train_distributed
from gem_ops.train.pipes_reporting import open_reporter
from gem_ops.train.sharding import EMBEDDING_SHARDINGS

log = logging.getLogger("gem_ops.train")


def parse_model_overrides(values: list[str]) -> dict[str, Any]:
    """Each value a JSON object, or key=value with the value read as JSON where it parses
    (`sequence.max_history_len=256`, `use_sequence=false`), else as a string (`sequence.activation=silu`)."""
    overrides: dict[str, Any] = {}
    for value in values:
        if value.lstrip().startswith("{"):
            overrides.update(json.loads(value))
        elif "=" in value:
            key, raw = value.split("=", 1)
            try:
                overrides[key.strip()] = json.loads(raw)
            except json.JSONDecodeError:
                overrides[key.strip()] = raw
        else:
            raise ValueError(f"--model-override {value!r}: expected key=value or a JSON object")
    return overrides


def _add_train_config_arguments(parser: argparse.ArgumentParser) -> None:
    hints = typing.get_type_hints(TrainConfig)
    group = parser.add_argument_group("training settings (TrainConfig)")
    for f in dataclasses.fields(TrainConfig):
        base = hints[f.name]
        if typing.get_origin(base) in (typing.Union, types.UnionType):  # int | None -> int
            base = next(t for t in typing.get_args(base) if t is not type(None))
        if typing.get_origin(base) is typing.Literal:
            group.add_argument(f"--{f.name.replace('_', '-')}", choices=typing.get_args(base), default=f.default)
        elif base is bool:  # --name / --no-name: bool("False") would be True
            group.add_argument(f"--{f.name.replace('_', '-')}", action=argparse.BooleanOptionalAction, default=f.default)
        else:
            group.add_argument(f"--{f.name.replace('_', '-')}", type=base, default=f.default)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m gem_ops.train", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sequence-logs", required=True, type=Path, help="a sequence_logs folder")
    parser.add_argument("--plans", required=True, type=Path,
                        help="a folder of shuffled_batches plans (world_size=W.parquet) or one plan file")
    parser.add_argument("--plan-world-size", type=int, default=None,
                        help="which plan of --plans to read (default: the job's world size)")
    parser.add_argument("--union-of-ranks", action="store_true",
                        help="one process trains on every rank's rows of the plan at once (the same global "
                             "batches a multi-rank job takes)")
    parser.add_argument("--preset", default="gem")
    parser.add_argument("--depth", type=float, default=1.0)
    parser.add_argument("--width", type=float, default=1.0)
    parser.add_argument("--model-override", action="append", default=[], metavar="KEY=VALUE|JSON",
                        help='dotted model settings, e.g. sequence.max_history_len=256 or {"blocks": 2}; repeatable')
    _add_train_config_arguments(parser)
    parser.add_argument("--embedding-sharding", "--sharding", choices=EMBEDDING_SHARDINGS, default="auto",
                        help="TorchRec DMP table_wise / row_wise / auto (planner), or fsdp (unsharded TorchRec "
                             "modules under FSDP2; chosen automatically where TorchRec's kernels are missing)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--checkpoint-dir", type=Path, default=None)
    parser.add_argument("--warm-start", type=Path, default=None, help="a checkpoint (or folder of them) to take weights from")
    parser.add_argument("--mlflow-run-id", default=None)
    parser.add_argument("--mlflow-tracking-uri", default=None)
    parser.add_argument("--registered-model-name", default=None,
                        help="rank 0 logs the trained model to the MLflow run and registers it under this name")
    parser.add_argument("--progress-every", type=int, default=10, help="steps between progress lines")
    parser.add_argument("--result-json", type=Path, default=None, help="rank 0 writes the final figures here")
    parser.add_argument("--log-level", default="INFO")
    return parser.parse_args(argv)


def train_config_from(args: argparse.Namespace) -> TrainConfig:
    return TrainConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)})


class FaultDrill:
    """GEM_TRAIN_FAIL_AT_STEP / GEM_TRAIN_FAIL_RANK / GEM_TRAIN_STEP_DELAY_S (see the module docstring)."""

    def __init__(self, rank: int):
        fail_at = os.environ.get("GEM_TRAIN_FAIL_AT_STEP")
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        failing_rank = int(os.environ.get("GEM_TRAIN_FAIL_RANK", "1"))
        self.fail_after = int(fail_at) if fail_at and first_attempt and rank == failing_rank else None
        self.delay = float(os.environ.get("GEM_TRAIN_STEP_DELAY_S", "0"))

    def __call__(self, step: int, loss: float) -> None:
        if self.delay:
            time.sleep(self.delay)
        if self.fail_after is not None and step + 1 == self.fail_after:
            raise RuntimeError(f"GEM_TRAIN_FAIL_AT_STEP: rank fails after step {step + 1} on purpose")


def log_to_mlflow(tracker: RunTracker, logs: SequenceLogs, result: DistributedTrainResult, registered_name: str | None) -> str | None:
    """Rank 0: curves, eval report and (when named) the packaged model from the exported full state."""
    if not tracker.enabled:
        return None
    import torch

    from gem_ops.train.loop import model_from_state
    from gem_ops.train.mlflow_model import INPUT_EXAMPLE_ROWS, batch_to_frame, log_model
    from gem_ops.train.plots import loss_curves

    tracker.log_figure(loss_curves(result.losses, result.eval_steps, result.eval_reports), "loss_curves.png")
    tracker.log_dict(result.final_report, "eval_metrics.json")
    tracker.log_dict(result.balance.to_dict(), "step_balance.json")
    if registered_name is None or result.model_state_path is None:
        return None
    model = model_from_state(torch.load(result.model_state_path, map_location="cpu", weights_only=False))
    eval_rows = logs.split_indices("eval")
    rows = eval_rows[:INPUT_EXAMPLE_ROWS] if len(eval_rows) else np.arange(min(INPUT_EXAMPLE_ROWS, len(logs)))
    example = logs.batch(rows, model.config.sequence.max_history_len)
    return log_model(tracker.client, tracker.run_id, model, batch_to_frame(example, model.spec), registered_name)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    # TorchRec and fbgemm log every table batch at INFO on the root logger: only warnings from them.
    logging.basicConfig(force=True, level=logging.WARNING, format=f"%(asctime)s rank{rank} %(name)s %(levelname)s: %(message)s")
    logging.getLogger("gem_ops").setLevel(args.log_level)
    config = train_config_from(args)
    model = model_config(args.preset, args.depth, args.width, **parse_model_overrides(args.model_override))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    plan = plan_for_world_size(args.plans, args.plan_world_size or world_size)
    tracker = RunTracker.attach(args.mlflow_run_id, args.mlflow_tracking_uri)
    with open_reporter(rank, args.progress_every) as reporter:
        result = train_distributed(
            SequenceLogs(args.sequence_logs), plan, model, config, embedding_sharding=args.embedding_sharding,
            checkpoint_dir=args.checkpoint_dir, warm_start=args.warm_start, tracker=tracker, device=args.device,
            union_of_ranks=args.union_of_ranks, reporter=reporter, on_step=FaultDrill(rank),
        )
        if rank == 0:
            version = log_to_mlflow(tracker, SequenceLogs(args.sequence_logs), result, args.registered_model_name)
            metadata = {**result.metadata(), "plan": str(plan), "losses": result.losses,
                        "mlflow_run_id": args.mlflow_run_id, "model_version": version}
            if args.result_json is not None:
                args.result_json.parent.mkdir(parents=True, exist_ok=True)
                args.result_json.write_text(json.dumps(metadata, indent=2, default=str))
            reporter.finish(metadata)
    return 0


if __name__ == "__main__":
    sys.exit(main())
