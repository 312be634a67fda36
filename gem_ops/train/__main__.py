"""`python -m gem_ops.train`: one training job of the engine, on one process or launched by torchrun:

    torchrun --nproc-per-node 2 --max-restarts 2 -m gem_ops.train \\
        --sequence-logs lake/sequence_logs/2026-11-28 --plans lake/shuffled_batches/2026-11-28 \\
        --preset gem --checkpoint-dir lake/gem_foundation_model/2026-11-28/checkpoints \\
        --embedding-sharding row_wise --max-steps 500 --checkpoint-every 50

Each rank trains on its rows of plans/world_size=W.parquet; a restarted job resumes from the latest
checkpoint in --checkpoint-dir. Rank 0 logs to the MLflow run given by --mlflow-run-id and reports
progress and the final figures through Dagster Pipes when launched by a Pipes client. With --mfu-steps
the job is an MFU measurement instead: warm-up steps, a timed window and profiled steps of the same
loop (gem_ops.train.mfu_window), reported with the final figures and logged to the MLflow run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gem_ops.data.atomic import atomic_path
from gem_ops.data.loader import SequenceLogs
from gem_ops.model.config import FeatureSpec, model_config
from gem_ops.tracking import RunTracker
from gem_ops.train.batches import PlanSchedule, plan_for_world_size
from gem_ops.train.config import TrainConfig
from gem_ops.train.engine import StepHook, TrainResult, train
from gem_ops.train.mfu_window import MFUWindow
from gem_ops.train.pipes_reporting import open_reporter
from gem_ops.train.sharding import EMBEDDING_SHARDINGS
from gem_ops.train.step_readout import reads_late

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
            group.add_argument(f"--{f.name.replace('_', '-')}", action=argparse.BooleanOptionalAction,
                               default=f.default)
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
                        help="TorchRec DMP table_wise / row_wise / auto (planner; on one rank: none), fsdp "
                             "(unsharded TorchRec modules under FSDP2; chosen automatically where TorchRec's "
                             "kernels are missing), or none (one rank, the plain model)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--checkpoint-dir", type=Path, default=None)
    parser.add_argument("--warm-start", type=Path, default=None,
                        help="a checkpoint (or folder of them) to take weights from")
    parser.add_argument("--mlflow-run-id", default=None)
    parser.add_argument("--mlflow-tracking-uri", default=None,
                        help="the store or server the run is in (default: MLFLOW_TRACKING_URI, else the "
                             "project's store)")
    parser.add_argument("--registered-model-name", default=None,
                        help="rank 0 logs the trained model to the MLflow run and registers it under this name")
    parser.add_argument("--progress-every", type=int, default=10, help="steps between progress lines")
    parser.add_argument("--result-json", type=Path, default=None, help="rank 0 writes the final figures here")
    mfu = parser.add_argument_group("MFU measurement (the job runs the window's steps only, no checkpoints)")
    mfu.add_argument("--mfu-steps", type=int, default=0, help="timed steps; 0: an ordinary training job")
    mfu.add_argument("--mfu-warmup-steps", type=int, default=5)
    mfu.add_argument("--mfu-profile-steps", type=int, default=3)
    mfu.add_argument("--mfu-profiler", choices=("torch", "python"), default="torch",
                     help="torch.profiler, or cProfile for the host's Python time by function")
    parser.add_argument("--log-level", default="INFO")
    return parser.parse_args(argv)


def train_config_from(args: argparse.Namespace) -> TrainConfig:
    return TrainConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)})


def log_to_mlflow(tracker: RunTracker, logs: SequenceLogs, result: TrainResult,
                  registered_name: str | None) -> str | None:
    """Rank 0: curves, eval report and (when named) the packaged model from the exported full state."""
    if not tracker.enabled:
        return None
    from gem_ops.train.mlflow_model import INPUT_EXAMPLE_ROWS, input_example, log_model
    from gem_ops.train.model_state import load_model_state, model_from_state
    from gem_ops.train.plots import loss_curves

    tracker.log_figure(loss_curves(result.losses, result.eval_steps, result.eval_reports), "loss_curves.png")
    tracker.log_dict(result.final_report, "eval_metrics.json")
    tracker.log_dict(result.balance.to_dict(), "step_balance.json")
    if registered_name is None or result.model_state_path is None:
        return None
    model = model_from_state(load_model_state(result.model_state_path))
    eval_rows = logs.split_indices("eval")
    rows = eval_rows[:INPUT_EXAMPLE_ROWS] if len(eval_rows) else np.arange(min(INPUT_EXAMPLE_ROWS, len(logs)))
    return log_model(tracker.client, tracker.run_id, model, input_example(logs, rows, model), registered_name)


def run_page_views(result: TrainResult, surfaces, objectives) -> dict[str, Any]:
    """What a person reads on the run page: eval quality, the calibration per (surface, objective) and the
    sharding plan as tables, the loss curves."""
    from gem_ops.metadata_views import calibration_table, figure_markdown, mapping_table, quality_table
    from gem_ops.train.plots import loss_curves

    views = {"eval": quality_table(result.final_report),
             "sharding_plan": mapping_table(result.sharding_plan, "table", "sharding"),
             "loss_curves": figure_markdown(loss_curves(result.losses, result.eval_steps, result.eval_reports),
                                            "training loss and eval NE by step")}
    if result.calibration:
        views["calibration"] = calibration_table(result.calibration, surfaces, objectives)
    return views


def main(argv: list[str] | None = None, step_hooks: Sequence[StepHook] = ()) -> int:
    args = parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    # TorchRec and fbgemm log every table batch at INFO on the root logger: only warnings from them.
    logging.basicConfig(force=True, level=logging.WARNING,
                        format=f"%(asctime)s rank{rank} %(name)s %(levelname)s: %(message)s")
    logging.getLogger("gem_ops").setLevel(args.log_level)
    config = train_config_from(args)
    model = model_config(args.preset, args.depth, args.width, **parse_model_overrides(args.model_override))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    plan = plan_for_world_size(args.plans, args.plan_world_size or world_size)
    logs = SequenceLogs(args.sequence_logs)
    tracker = RunTracker.attach(args.mlflow_run_id, args.mlflow_tracking_uri)
    late = reads_late(config.step_readout, torch.device(args.device))
    window = MFUWindow(args.mfu_steps, args.mfu_warmup_steps, args.mfu_profile_steps, args.mfu_profiler,
                       reads_late=late) if args.mfu_steps else None
    with open_reporter(rank, args.progress_every) as reporter:
        if window is None:
            _, result = train(logs, plan, model, config, device=args.device, checkpoint_dir=args.checkpoint_dir,
                              warm_start=args.warm_start, tracker=tracker, embedding_sharding=args.embedding_sharding,
                              union_of_ranks=args.union_of_ranks, reporter=reporter, step_hooks=step_hooks,
                              export_model_state=True)
            metadata = {**result.metadata(), "losses": result.losses}
            spec = FeatureSpec.from_logs(logs)
            views = run_page_views(result, spec.surfaces, model.objectives(spec)) if rank == 0 else {}
            if rank == 0:
                metadata["model_version"] = log_to_mlflow(tracker, logs, result, args.registered_model_name)
        else:
            metadata = measure_mfu(window, logs, plan, model, config, args, tracker, reporter, step_hooks, rank)
            views = {}
        if rank == 0:
            metadata.update({"plan": str(plan), "mlflow_run_id": args.mlflow_run_id})
            if args.result_json is not None:  # whole or absent: a caller may stop the job once it exists
                with atomic_path(args.result_json) as tmp:
                    tmp.write_text(json.dumps(metadata, indent=2, default=str))
            # The run page shows tables and the loss curves where the result file holds raw figures.
            reporter.finish({k: v for k, v in metadata.items() if k not in ("losses", "eval", "sharding_plan")} | views)
    return 0


def measure_mfu(window: MFUWindow, logs: SequenceLogs, plan: Path, model, config: TrainConfig, args,
                tracker: RunTracker, reporter, step_hooks: Sequence[StepHook], rank: int) -> dict[str, Any]:
    """The window's run through the engine; rank 0's figures (MFU, where the time goes) as metadata."""
    from gem_ops.data.batch_shuffling import read_rank_plan
    from gem_ops.metrics.mfu import log_mfu_report

    plan_steps = PlanSchedule(read_rank_plan(plan, 0), 1, config.seed, plan).plan_steps
    config = window.train_config(config, plan_steps)
    device = torch.device(args.device)
    with window.observe(device, profile=rank == 0) as observer:
        _, result = train(logs, plan, model, config, device=args.device, tracker=tracker,
                          embedding_sharding=args.embedding_sharding, union_of_ranks=args.union_of_ranks,
                          reporter=reporter, step_hooks=[observer, *step_hooks])
    if rank != 0:
        return {}
    report = window.report(result, observer, device, model, config)
    if tracker.enabled:
        log_mfu_report(tracker, report)
    figures = report.metrics()
    details = {k: v for k, v in report.to_dict().items() if k != "profile_table"}
    if device.type == "cuda":
        stats = torch.cuda.memory_stats(device)
        details["max_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        # A step that finds no free block frees the allocator's cache and retries (a device sync).
        details["allocator"] = {k: stats.get(k, 0) for k in ("num_alloc_retries", "num_ooms", "num_device_alloc",
                                                             "num_device_free")}
    reporter.message(f"MFU {100 * report.mfu:.2f}% over the timed window (median step "
                     f"{100 * figures['mfu_median_step']:.2f}%; {report.model_flops_per_second / 1e12:.3g} model "
                     f"TFLOP/s against {report.peak_flops / 1e12:.4g} {report.peak_source} per device), "
                     f"{report.samples_per_second:.1f} samples/s on {report.world_size} x {report.device_name}")
    return {**result.metadata(), "path": "engine", "device": report.device_name, "peak_source": report.peak_source,
            **{k: v for k, v in figures.items() if not k.startswith(("time", "flops_share"))},
            "seconds_per_step": {k: v for k, v in figures.items() if k.startswith("time")},
            "flops_share": {k[len("flops_share."):]: v for k, v in figures.items() if k.startswith("flops_share.")},
            "mfu_report": details}


if __name__ == "__main__":
    sys.exit(main())
