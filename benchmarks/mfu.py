"""MFU of GEM training, end to end through the engine as gem_foundation_model runs it: each run is the
engine's torchrun job (`python -m torch.distributed.run ... -m gem_ops.train`, the command
gem_ops.train.launch builds for the assets) with an MFU window (warm-up steps, a timed window, profiled
steps; gem_ops.train.mfu_window). MFU over the whole timed window (its model FLOPs over its wall time:
the mean step) and the median step's beside it, samples/s, and the loss after the same steps, per
model shape and precision (and repeat); then the forward and backward speed of the dense layers alone
(the GPU preset's shapes, bf16 and FP8 side by side). Saved as benchmarks/results/mfu_<device>.json
with the commit, the machine and the settings.

    python -m benchmarks.mfu --device cuda --data DIR --preset gem_gpu \\
        --shapes preset w0.5_L512:width=0.5,max_history_len=512
    python -m benchmarks.mfu --device cpu --data DIR --preset vertical --max-history-len 32 --steps 3 \\
        --precisions fp32 --dense-tokens 512 --dense-batch 64 --compile none    # a dry run of every stage

DIR holds sequence_logs/ and plans/world_size=W.parquet (prepared by benchmarks/mfu_data.py: the GPU
machine has no polars). On a CPU, FP8 cannot run: the dense-layer stage emulates it (numbers
meaningless, code checked).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import shutil
import statistics
import time
from pathlib import Path

import torch
from torch import nn

from benchmarks.common import TRAIN, named_settings, save, saved_results, setting, train_changes
from gem_ops.train.config import TrainConfig

ROOT = Path(__file__).resolve().parents[1]
LOSS_STEPS = 5  # the loss compared between precisions: the mean over the last steps both ran

COMPILE_SETTINGS = TrainConfig.choices("compile")


def _allocator_env() -> dict[str, str]:
    """The environment for a measured subprocess: expandable segments unless set (the jagged batches change
    shape every step, which fragments a fixed-block pool)."""
    import os

    return {**os.environ,
            "PYTORCH_CUDA_ALLOC_CONF": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")}


def timed(fn, device: torch.device, reps: int, warmup: int = 3) -> float:
    """Median seconds of fn() (CUDA events on a GPU)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize(device)
            times.append(start.elapsed_time(end) / 1e3)
        else:
            began = time.perf_counter()
            fn()
            times.append(time.perf_counter() - began)
    return statistics.median(times)


def fp8_gemm_flops(device: torch.device, size: int = 8192, reps: int = 20) -> float | None:
    """FLOP/s of torch._scaled_mm on e4m3 inputs with tensorwise scales (None where it cannot run)."""
    if device.type != "cuda":
        return None
    a = torch.randn(size, size, device=device).to(torch.float8_e4m3fn)
    b = torch.randn(size, size, device=device).to(torch.float8_e4m3fn).t()  # column-major, as required
    one = torch.ones((), device=device)
    seconds = timed(lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16), device, reps)
    return 2.0 * size**3 / seconds


def dense_shapes(model_config, spec, tokens: int, batch: int) -> dict[str, dict]:
    """The dense layers FP8 takes, at the config's widths: rows are history tokens or examples."""
    from gem_ops.model.gem import CROSS_QUERIES

    d, ds = model_config.embedding.dim, model_config.embedding.sequence_dim
    wk, seq = model_config.wukong, model_config.sequence
    n_out = wk.n_fm + wk.n_lcb
    n_in = n_out + len(seq.branches) * (seq.summary_tokens + CROSS_QUERIES)  # a Wukong layer after the first
    return {
        "sequence_ffn": {"rows": tokens, "widths": [ds, seq.ffn_mult * ds, ds]},
        "sequence_qkv": {"rows": tokens, "widths": [ds, 3 * ds]},
        "cross_kv": {"rows": tokens, "widths": [ds, 2 * ds]},
        "wukong_mlp": {"rows": batch, "widths": [n_in * wk.fm_rank, wk.mlp_hidden, wk.n_fm * d]},
    }


def dense_layer(widths: list[int], device: torch.device) -> nn.Module:
    layers = []
    for i, (a, b) in enumerate(zip(widths[:-1], widths[1:])):
        layers += [nn.Linear(a, b)] + ([nn.GELU()] if i < len(widths) - 2 else [])
    return nn.Sequential(*layers).to(device)


def bench_dense_layers(model_config, spec, args, device: torch.device) -> dict:
    """Forward and forward+backward time of each dense shape in bf16 (autocast, as training runs) and
    in FP8 (each recipe), compiled as training compiles them; the backward is their difference."""
    from gem_ops.train.acceleration import convert_to_fp8

    out = {}
    emulate = device.type != "cuda"
    shapes = dense_shapes(model_config, spec, args.dense_tokens, args.dense_batch)
    for name, shape in ((n, shapes[n]) for n in args.dense_shapes):
        rows, widths = shape["rows"], shape["widths"]
        flops = sum(2.0 * rows * a * b for a, b in zip(widths[:-1], widths[1:]))
        x = torch.randn(rows, widths[0], device=device, dtype=torch.bfloat16, requires_grad=True)
        grad = torch.randn(rows, widths[-1], device=device, dtype=torch.bfloat16)
        results = {"rows": rows, "widths": widths, "forward_flops": flops}
        for variant in ("bf16", *[f"fp8_{r}" for r in args.fp8_recipes]):
            torch.manual_seed(0)
            module = dense_layer(widths, device)
            if variant != "bf16":
                convert_to_fp8(module, variant[4:], emulate=emulate,
                               module_filter=lambda m, _: isinstance(m, nn.Linear))
            run = torch.compile(module) if args.compile != "none" else module

            def forward():
                with torch.autocast(device.type, dtype=torch.bfloat16):
                    return run(x)

            def forward_backward():
                module.zero_grad(set_to_none=True)
                x.grad = None
                forward().backward(grad)

            with torch.no_grad():
                fwd = timed(forward, device, args.dense_reps)
            both = timed(forward_backward, device, args.dense_reps)
            results[variant] = {"forward_seconds": fwd, "backward_seconds": both - fwd,
                                "forward_tflops": flops / fwd / 1e12,
                                "backward_tflops": 2 * flops / max(both - fwd, 1e-12) / 1e12}
            module = run = None  # freed before the next variant's copy
        for variant in results:
            if variant.startswith("fp8_"):
                bf16, fp8 = results["bf16"], results[variant]
                fp8["forward_speedup"] = bf16["forward_seconds"] / fp8["forward_seconds"]
                fp8["backward_speedup"] = bf16["backward_seconds"] / max(fp8["backward_seconds"], 1e-12)
        out[name] = results
        print(f"dense {name} {rows}x{widths}: " + ", ".join(
            f"{v} fwd {results[v]['forward_tflops']:.3g} bwd {results[v]['backward_tflops']:.3g} TFLOP/s"
            for v in results if isinstance(results[v], dict)), flush=True)
        torch._dynamo.reset()
    # Over all shapes together: total bf16 time over total FP8 time.
    overall = {}
    for recipe in args.fp8_recipes:
        key = f"fp8_{recipe}"
        for phase in ("forward", "backward"):
            bf16 = sum(r["bf16"][f"{phase}_seconds"] for r in out.values())
            fp8 = sum(r[key][f"{phase}_seconds"] for r in out.values())
            overall[f"{key}_{phase}_speedup"] = bf16 / max(fp8, 1e-12)
    out["all_shapes"] = overall
    return out


def run_variant(name: str) -> tuple[str, str | None, str | None]:
    """An end-to-end run's name: precision[:fp8 recipe][@compile][+NAME=VALUE...], e.g. fp8:tensorwise_fast_accum ->
    ("fp8", "tensorwise_fast_accum", None), bf16@model -> ("bf16", None, "model"); the recipe defaults to
    --fp8-recipes' first, the compile setting to --compile; the +NAME=VALUE parts are run_environment's."""
    name = name.split("+")[0]
    name, _, compile_setting = name.partition("@")
    precision, _, recipe = name.partition(":")
    if compile_setting and compile_setting not in COMPILE_SETTINGS:
        raise ValueError(f"run {name}@{compile_setting}: compile must be one of {COMPILE_SETTINGS}")
    return precision, recipe or None, compile_setting or None


def run_environment(name: str) -> dict[str, str]:
    """The environment variables a run's name sets for its job, e.g. bf16@model+JAGGED_ATTENTION_SPLIT_HEAD=0: kernel
    settings read at import, compared side by side with the first run like any other variant."""
    settings = {}
    for part in name.split("+")[1:]:
        if part.startswith(TRAIN):
            continue
        key, equals, value = part.partition("=")
        if not equals or not key.isidentifier() or key.upper() != key:
            raise ValueError(f"run {name}: {part!r} is neither NAME=VALUE with an upper-case environment variable "
                             f"NAME nor {TRAIN}<TrainConfig field>=VALUE")
        settings[key] = value
    return settings


def run_train_settings(name: str) -> dict[str, object]:
    """The training settings a run's name sets, e.g. bf16@model+train.step_readout=each_step (values as JSON)."""
    settings = train_changes(dict(setting(part) for part in name.split("+")[1:] if part.startswith(TRAIN)))
    if unknown := sorted(settings.keys() - {f.name for f in dataclasses.fields(TrainConfig)}):
        raise ValueError(f"run {name}: {unknown[0]!r} is not a TrainConfig field")
    return settings


def compare_runs(baseline: str, base: list[dict], runs: list[dict]) -> dict:
    """A variant's runs against the baseline's, taken in turn: the loss over the last LOSS_STEPS of the first run of
    each (same seed: the same batches), the ratio of the mean samples/s over the repeats, and each repeat's."""
    n = min(len(base[0]["losses"]), len(runs[0]["losses"]))
    last = slice(n - LOSS_STEPS, n)
    base_loss, loss = statistics.mean(base[0]["losses"][last]), statistics.mean(runs[0]["losses"][last])
    base_speed, speed = [r["samples_per_second"] for r in base], [r["samples_per_second"] for r in runs]
    return {"baseline": baseline, "steps": n, "baseline_loss": base_loss, "loss": loss,
            "relative_difference": (loss - base_loss) / base_loss,
            "samples_per_second_ratio": statistics.mean(speed) / statistics.mean(base_speed),
            "paired_ratios": [f / b for b, f in zip(base_speed, speed)]}


def engine_command(args, shape: dict, variant: str, result_json: Path) -> list[str]:
    """The engine's torchrun job with an MFU window, built as the assets build theirs."""
    from gem_ops.train.launch import torchrun_command

    precision, recipe, compile_setting = run_variant(variant)
    shape = dict(shape)
    width, depth = float(shape.pop("width", args.width)), float(shape.pop("depth", args.depth))
    overrides = dict(setting(item) for item in args.set)
    length = shape.pop("max_history_len", args.max_history_len)
    if length:
        overrides["sequence.max_history_len"] = int(length)
    overrides.update(shape)
    settings = {"precision": precision, "fp8_recipe": recipe or args.fp8_recipes[0],
                "compile": compile_setting or args.compile,
                "activation_checkpointing": args.activation_checkpointing, "seed": args.seed,
                "unit_prefetch": args.unit_prefetch, **run_train_settings(variant)}
    return torchrun_command(
        args.data / "sequence_logs", args.plans or args.data / "plans", preset=args.preset, depth=depth, width=width,
        model_overrides=overrides, train_settings=settings, nproc_per_node=args.nproc,
        extra=["--device", args.device, "--mfu-steps", str(args.steps), "--mfu-warmup-steps", str(args.warmup_steps),
               "--mfu-profile-steps", str(args.profile_steps), "--mfu-profiler", args.profiler, "--progress-every", "5",
               "--result-json", str(result_json)])


def seconds_needed(runs: dict[str, list[dict]], shape_name: str, key: str) -> float:
    """How long another run of `key` takes: its shortest earlier run, or a repeat of another variant at the same
    shape where shorter (its first run compiled what the caches did not hold; a repeat finds them warm, as this
    one's will); 60 s before its first."""
    own = [r["wall_seconds"] for r in runs.get(key, []) if "wall_seconds" in r]
    if not own:
        return 60.0
    repeats = [r["wall_seconds"] for other, done in runs.items() if other != key and other.startswith(f"{shape_name}/")
               for r in [r for r in done if "wall_seconds" in r][1:]]
    return min(own + repeats)


def end_to_end(args, shape_name: str, shape: dict, variant: str, seconds_left: float, seconds_needed: float = 60
               ) -> dict:
    """One engine run; its figures, or why there are none. Not started with less time left than `seconds_needed`
    (the shortest earlier run of the same kind): a run cut by the budget spends device time and leaves nothing."""
    import subprocess
    import tempfile

    if seconds_left < seconds_needed:
        return {"skipped": f"time budget: {seconds_left:.0f} s left, a run takes {seconds_needed:.0f} s"}
    with tempfile.TemporaryDirectory() as tmp:
        output = Path(tmp) / "result.json"
        command = engine_command(args, shape, variant, output)
        env = {**_allocator_env(), **run_environment(variant)}
        began = time.perf_counter()
        cut = False
        try:
            returncode, last_lines = _run_echoing(command, env, None if math.isinf(seconds_left) else seconds_left)
        except subprocess.TimeoutExpired:
            if not output.exists():
                return {"error": f"timed out after {seconds_left:.0f} s", "command": command}
            cut = True  # stopped while it shut down: its result was written (whole: the job writes it atomically)
        if not output.exists():
            return {"error": f"the engine's job exited with code {returncode} and no result", "command": command,
                    "stderr_tail": last_lines}
        reported = json.loads(output.read_text())
    report = reported["mfu_report"]
    run = {"path": reported["path"], "launch": "torchrun", "command": command, "environment": run_environment(variant),
           "wall_seconds": time.perf_counter() - began, **({"cut_after_its_result": True} if cut else {}),
           "world_size": reported["world_size"], "embedding_sharding": reported["embedding_sharding"],
           "mfu_window_mean": report["mfu"], "mfu_median_step": report["mfu_median_step"],
           **{k: report[k] for k in ("model_tflops", "samples_per_second", "step_seconds_mean", "step_seconds_median",
                                     "model_tflop_per_step", "peak_source", "peak_flops", "gemm_flops", "steps",
                                     "warmup_steps", "seconds", "step_seconds", "step_flops", "all_step_seconds",
                                     "step_read_waits", "step_host_seconds", "losses", "phase_seconds",
                                     "phase_cpu_seconds", "module_seconds", "communication",
                                     "forward_flops_by_module", "max_memory_gib", "allocator", "step_measures",
                                     "rank_measures", "step_stalls", "cuda_graph_skips", "attention_configs",
                                     "attention_key_sources", "top_kernels", "eager_operators", "host", "host_python")
                  if k in report}}
    if run.get("top_kernels"):  # where the profiled steps' device time went, by kind of kernel
        from gem_ops.metrics.kernels import time_by_kind

        run["kernel_time_by_kind"] = time_by_kind(run["top_kernels"])
    if run_variant(variant)[0] == "fp8" and run["peak_source"] == "spec":  # beside the bf16-peak figure
        from gem_ops.metrics.mfu import FP8_PEAK_OVER_BF16

        run["mfu_vs_fp8_peak"] = run["mfu_window_mean"] / FP8_PEAK_OVER_BF16
    measures = report.get("step_measures") or {}
    if len(measures.get("compute_seconds", ())) >= 3:  # what each step's forward costs per token and per pair
        from gem_ops.data.step_cost import fit_step_cost

        try:
            run["forward_step_cost"] = fit_step_cost(measures["compute_seconds"], measures["tokens"],
                                                     measures["attention_cost"]).to_dict()
        except ValueError as error:
            run["forward_step_cost"] = f"not fitted: {error}"
    ranks = report.get("rank_measures") or {}
    if run["world_size"] > 1 and ranks.get("compute_seconds"):  # each rank's planned cost against its observed
        from gem_ops.data.step_cost import planned_against_observed

        try:
            run["rank_balance"] = planned_against_observed(ranks["compute_seconds"], ranks["tokens"],
                                                           ranks["attention_cost"])
        except ValueError as error:
            run["rank_balance"] = f"not fitted: {error}"
    fp8_peak = f", {100 * run['mfu_vs_fp8_peak']:.1f}% against the FP8 peak" if "mfu_vs_fp8_peak" in run else ""
    print(f"{shape_name}/{variant}: MFU {100 * run['mfu_window_mean']:.1f}% over the window{fp8_peak} (median step "
          f"{100 * run['mfu_median_step']:.1f}%), {run['model_tflops']:.0f} model TFLOP/s, "
          f"{run['samples_per_second']:.0f} samples/s, mean step {run['step_seconds_mean'] * 1e3:.0f} ms "
          f"(median {run['step_seconds_median'] * 1e3:.0f} ms){_stalls(run.get('step_stalls') or {})}", flush=True)
    if host := run.get("step_host_seconds"):  # the host's side of the unprofiled steps, by phase
        means = [f"{phase} {statistics.mean(seconds) * 1e3:.1f} ms" for phase, seconds in host.items() if seconds]
        print(f"  host queuing a step, mean over the window: {', '.join(means)}", flush=True)
    skips = run.get("cuda_graph_skips") or {}
    if skips.get("count"):
        print(f"  CUDA graphs: {skips['count']} of the compiled step's graphs ran without them: "
              f"{'; '.join(skips['reasons']) or 'no reason given'}", flush=True)
    python = run.get("host_python") or {}
    for row in python.get("own", [])[:12]:  # where the host's Python time goes, per step
        print(f"  host {row['own_ms']:7.2f} ms own, {row['ms']:7.2f} ms in, {row['calls']:6.1f} calls  "
              f"{row['function']}", flush=True)
    return run


def _stalls(stalls: dict[str, list[float]]) -> str:
    """What the window's steps spent on host work that is not training, e.g. "; in the window: gc 0.41 s
    (max 0.38 s in a step), 1 compiled graph, 0 attention tunings, 0 attention kernel binaries, 0 steps recording
    CUDA graphs"."""
    if not stalls:
        return ""
    gc_seconds = stalls.get("gc_seconds", [0.0])
    return (f"; in the window: gc {sum(gc_seconds):.2f} s (max {max(gc_seconds):.2f} s in a step), "
            f"{sum(stalls.get('compiled_graphs', [])):.0f} compiled graphs, "
            f"{sum(stalls.get('attention_tunings', [])):.0f} attention tunings, "
            f"{sum(stalls.get('attention_compiles', [])):.0f} attention kernel binaries, "
            f"{sum(stalls.get('cuda_graph_recordings', [])):.0f} steps recording CUDA graphs")


def _run_echoing(command: list[str], env: dict, timeout: float | None, keep: int = 40) -> tuple[int, list[str]]:
    """Runs command with its stderr echoed as it comes; (exit code, stderr's last `keep` lines)."""
    import collections
    import subprocess
    import sys
    import threading

    last = collections.deque(maxlen=keep)
    with subprocess.Popen(command, env=env, cwd=ROOT, stderr=subprocess.PIPE, text=True, errors="replace") as job:
        def echo():
            for line in job.stderr:
                sys.stderr.write(line)
                last.append(line.rstrip("\n"))

        reader = threading.Thread(target=echo, daemon=True)
        reader.start()
        try:
            job.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            job.kill()
            job.wait()
            raise
        finally:
            reader.join(timeout=10)  # before the pipe closes
    return job.returncode, list(last)


def run_stage(stage: str, seconds_left: float) -> dict:
    """The dense-layer stage in a child process of its own (a fresh allocator and compile cache)."""
    import subprocess
    import sys
    import tempfile

    if seconds_left < 60:
        return {"skipped": f"time budget: {seconds_left:.0f} s left"}
    with tempfile.TemporaryDirectory() as tmp:
        output = Path(tmp) / "stage.json"
        command = [sys.executable, "-m", "benchmarks.mfu", *sys.argv[1:], "--stage", stage,
                   "--stage-output", str(output)]
        env = _allocator_env()
        try:
            done = subprocess.run(command, env=env, timeout=None if math.isinf(seconds_left) else seconds_left)
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {seconds_left:.0f} s"}
        if output.exists():
            return json.loads(output.read_text())
        return {"error": f"the {stage} stage exited with code {done.returncode} and no result"}


def run_here(args) -> None:
    """The child's side of run_stage: the dense-layer stage, its result (or its error) as JSON."""
    from gem_ops.data.loader import SequenceLogs
    from gem_ops.model.config import FeatureSpec

    device = torch.device(args.device)
    logs = SequenceLogs(args.data / "sequence_logs")
    try:
        result = bench_dense_layers(model_config_of(args), FeatureSpec.from_logs(logs), args, device)
    except Exception as error:  # reported in the JSON beside the stages that ran
        result = {"error": f"{type(error).__name__}: {error}"}
        print(f"{args.stage} failed: {error}", flush=True)
    args.stage_output.write_text(json.dumps(result, default=str))


def model_config_of(args):
    from gem_ops.model.config import model_config

    overrides = {"sequence.max_history_len": args.max_history_len} if args.max_history_len else {}
    overrides.update(setting(item) for item in args.set)
    return model_config(args.preset, args.depth, args.width, **overrides)


def spread(runs: list[dict], key: str) -> dict:
    values = [r[key] for r in runs if key in r]
    if not values:
        return {}
    return {"mean": statistics.mean(values), "min": min(values), "max": max(values),
            "spread": max(values) - min(values), "runs": len(values)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    parser.add_argument("--data", type=Path, required=True, help="a folder with sequence_logs/ and plans/")
    parser.add_argument("--plans", type=Path, default=None,
                        help="the plans' folder instead of DATA/plans (e.g. mfu_data.py --repeat-step's)")
    parser.add_argument("--nproc", type=int, default=1,
                        help="torchrun processes (a plan for that world size must exist)")
    parser.add_argument("--preset", default="gem_gpu")
    parser.add_argument("--width", type=float, default=1.0)
    parser.add_argument("--depth", type=float, default=1.0)
    parser.add_argument("--max-history-len", type=int, default=0, help="0: the preset's")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                        help="model settings over the preset's, e.g. embedding.sequence_dim=1024 (values as JSON)")
    parser.add_argument("--shapes", nargs="+", default=["preset"], metavar="NAME[:KEY=VALUE,...]",
                        help="model shapes to run, each the preset with these settings (width, depth, "
                             "max_history_len, dotted settings); preset: the preset as it is")
    parser.add_argument("--steps", type=int, default=15, help="timed steps per run")
    parser.add_argument("--warmup-steps", type=int, default=6)
    parser.add_argument("--profile-steps", type=int, default=3)
    parser.add_argument("--profiler", choices=("torch", "python"), default="torch",
                        help="torch.profiler over the profiled steps (device kernels, phases), or cProfile (the "
                             "host's Python time by function)")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each shape and precision")
    parser.add_argument("--precisions", nargs="*", default=["bf16"],
                        help="end-to-end runs, each precision[:fp8 recipe][@compile][+NAME=VALUE...] (environment "
                             "variables of its job, or train.<TrainConfig field>=VALUE), run in turn and compared with "
                             "the first (none: the other stages alone)")
    parser.add_argument("--fp8-recipes", nargs="+", default=["tensorwise_triton", "tensorwise"],
                        help="the first is the end-to-end run's; the dense-layer stage times each")
    parser.add_argument("--compile", choices=COMPILE_SETTINGS, default="dense",
                        help="the engine's TrainConfig.compile (the dense-layer stage compiles its layers unless none)")
    parser.add_argument("--activation-checkpointing", choices=("none", "sequence"), default="none")
    parser.add_argument("--unit-prefetch", action="store_true", help="FSDP2 prefetch in the units' order (--nproc > 1)")
    parser.add_argument("--dense-tokens", type=int, default=262_144, help="rows of the sequence-layer shapes")
    parser.add_argument("--dense-batch", type=int, default=2048, help="rows of the Wukong shape")
    parser.add_argument("--dense-reps", type=int, default=20)
    parser.add_argument("--dense-shapes", nargs="+", default=["sequence_ffn", "sequence_qkv", "cross_kv"],
                        help="of sequence_ffn, sequence_qkv, cross_kv (the layers FP8 takes) and wukong_mlp "
                             "(left in bf16)")
    parser.add_argument("--skip-dense", action="store_true")
    parser.add_argument("--time-budget", type=float, default=0,
                        help="seconds; later stages are skipped past it (0: none)")
    parser.add_argument("--copy-to", type=Path, help="also copy the JSON here")
    parser.add_argument("--output-name", default=None, help="results/<name>.json (default mfu_<device>)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--resume", action="store_true", help="keep the runs saved under --output-name, add the "
                        "repeats they lack")
    parser.add_argument("--stage", help=argparse.SUPPRESS)  # a child process runs the dense stage
    parser.add_argument("--stage-output", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()

    from gem_ops.metrics.mfu import device_name, measured_matmul_flops, peak_flops

    if args.stage:
        run_here(args)
        return
    began = time.perf_counter()
    left = lambda: math.inf if not args.time_budget else args.time_budget - (time.perf_counter() - began)  # noqa: E731
    device = torch.device(args.device)
    if args.copy_to is not None:
        args.copy_to.mkdir(parents=True, exist_ok=True)

    import kernels.jagged_attention as attention
    import triton  # noqa: F401  (its version below; the GPU path needs it)
    import torchao

    resumed = {}  # a run cut short by the GPU machine's time limit goes on with the repeats it lacks
    if args.resume:
        saved = saved_results(args.output_name or f"mfu_{device.type}").get("end_to_end", {})
        resumed = {key: [r for r in kept if "mfu_window_mean" in r] for key, kept in saved.items()}
    peak, source = peak_flops(device)
    results: dict = {"path": "engine", "device_name": device_name(device), "peak_flops": peak, "peak_source": source,
                     "versions": {"torch": torch.__version__, "torchao": torchao.__version__,
                                  "triton": getattr(triton, "__version__", "")},
                     "attention_backends": attention.available_backends()}
    settings = {**vars(args), "model": model_config_of(args).to_dict(), "loss_steps": LOSS_STEPS}

    def checkpoint_results() -> None:
        path = save(args.output_name or f"mfu_{device.type}", settings, results)
        if args.copy_to is not None:
            shutil.copy(path, args.copy_to / path.name)

    results["end_to_end"] = dict(resumed)  # in every save from the first on: a run cut short keeps what it resumed
    results["gemm_bf16_flops" if device.type == "cuda" else "gemm_fp32_flops"] = measured_matmul_flops(device)
    try:
        results["gemm_fp8_flops"] = fp8_gemm_flops(device)
    except RuntimeError as error:
        results["gemm_fp8_flops"] = f"failed: {error}"
    print(f"GEMM: {json.dumps({k: v for k, v in results.items() if k.startswith('gemm')})}", flush=True)
    checkpoint_results()

    runs = results["end_to_end"]
    summary = results.setdefault("summary", {})
    for shape_name, shape in map(named_settings, args.shapes):
        for repeat in range(args.repeats):  # precisions alternate: a run cut short by the budget leaves pairs
            for variant in args.precisions:
                key = f"{shape_name}/{variant}"
                if len(runs.setdefault(key, [])) > repeat:
                    continue
                needed = seconds_needed(runs, shape_name, key)
                runs[key].append(end_to_end(args, shape_name, shape, variant, left(), needed))
                summary.update({k: {m: spread(v, m) for m in ("mfu_window_mean", "mfu_median_step",
                                                              "samples_per_second")} for k, v in runs.items()})
                checkpoint_results()
    if not args.skip_dense:
        results["dense_layers"] = run_stage("dense", left())
        checkpoint_results()

    comparisons = {}
    baseline = args.precisions[0] if args.precisions else None
    for shape_name, _ in map(named_settings, args.shapes):
        done = {v: [r for r in runs[f"{shape_name}/{v}"] if "losses" in r] for v in args.precisions}
        for variant in (v for v in args.precisions[1:] if done[baseline] and done[v]):
            comparisons[f"{shape_name}/{variant}"] = compare_runs(baseline, done[baseline], done[variant])
    results["loss_comparisons"] = comparisons
    results["wall_seconds"] = time.perf_counter() - began
    checkpoint_results()
    print(json.dumps({"summary": summary, "loss_comparisons": comparisons}, indent=1))


if __name__ == "__main__":
    main()
