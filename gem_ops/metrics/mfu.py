"""Model FLOPs utilization (MFU) of real training steps.

MFU = achieved model FLOP/s (flops.py's analytic count of each step's batch / the step's wall time,
data loading, embeddings and optimizer included) / the device's dense bf16 peak from its datasheet.
Beside it: the measured GEMM rate of the device (a large timed matmul), which is what a perfect step
could reach in practice. On a CPU there is no datasheet entry: MFU is taken against the measured GEMM.

`measure_mfu` runs the training loop itself (gem_ops.train.loop.train) for a timed window of steps,
then profiles a few more with torch.profiler, scoped per module of the model (forward) and per phase
of the step (data, forward, backward, optimizer). `StepMFU` is the cheap per-step version that every
training run logs (train.model_tflops, train.mfu).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch.autograd.profiler import record_function

# Dense (no structured sparsity) bf16 tensor-core peaks, vendor datasheets, by a substring of
# torch.cuda.get_device_name(). Order matters: the first match wins.
PEAK_BF16_FLOPS: tuple[tuple[str, float], ...] = (
    ("H200", 989e12),  # H200 SXM (NVL: 835e12)
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989e12),  # H100 SXM ("NVIDIA H100 80GB HBM3")
    ("GH200", 989e12),
    ("B200", 2250e12),
    ("A100", 312e12),
    ("L40S", 362e12),
    ("L4", 121e12),
    ("A10G", 70e12),
)

# What the CUDA profiler lists with device time that is no GPU work: a kernel launch that waited for
# room in a full launch queue. Left out of every phase, module and busy figure.
HOST_WAITS = frozenset({"Command Buffer Full"})

# Step phases, as scoped by the training loop (record_function), and the model's module scopes.
PHASES = ("data", "data.load", "forward", "backward", "optimizer")  # data.load: the prefetch thread's
# Nested: sequence.branch (one sequence's layer of a block, with its jagged bookkeeping) holds the
# summary projection, the sequence layer, the CLS projection and the cross attention.
MODULE_SCOPES = ("embeddings", "input_projections", "sequence.branch", "sequence.summarize", "sequence.layers",
                 "sequence.cls_out", "cross_attention", "wukong", "trunk", "towers")


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    import platform

    try:
        return next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or device.type


def spec_peak_flops(device: torch.device) -> float | None:
    """The datasheet's dense bf16 peak of the device, None where the table has no entry (CPUs)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_BF16_FLOPS if key in name), None)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@functools.cache
def measured_matmul_flops(device: torch.device | str, dtype: torch.dtype | None = None, size: int | None = None,
                          repeats: int | None = None) -> float:
    """FLOP/s of a timed square matmul: bf16 8192³ on CUDA, fp32 1024³ on CPU (cached per process)."""
    device = torch.device(device)
    cuda = device.type == "cuda"
    dtype = dtype or (torch.bfloat16 if cuda else torch.float32)
    size = size or (8192 if cuda else 1024)
    repeats = repeats or (20 if cuda else 5)
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    for _ in range(3):
        torch.matmul(a, b)
    _sync(device)
    best = math.inf
    for _ in range(2):  # the better of two timed rounds: less noise from anything else on the machine
        began = time.perf_counter()
        for _ in range(repeats):
            torch.matmul(a, b)
        _sync(device)
        best = min(best, (time.perf_counter() - began) / repeats)
    return 2.0 * size**3 / best


def peak_flops(device: torch.device | str) -> tuple[float, str]:
    """(the FLOP/s MFU is taken against, where it comes from: "spec" or "measured")."""
    device = torch.device(device)
    spec = spec_peak_flops(device)
    return (spec, "spec") if spec is not None else (measured_matmul_flops(device), "measured")


class StepMFU:
    """Per-step model FLOP/s and MFU for a training loop's metrics (the peak is looked up once)."""

    def __init__(self, device: torch.device | str, world_size: int = 1):
        self.peak, self.peak_source = peak_flops(device)
        self.world_size = world_size

    def metrics(self, flops: float, seconds: float) -> dict[str, float]:
        """flops: the step's model FLOPs over all ranks; seconds: its wall time."""
        if seconds <= 0:
            return {}
        rate = flops / seconds
        return {"train.model_tflops": rate / 1e12, "train.mfu": rate / (self.peak * self.world_size)}


@dataclass
class MFUReport:
    device: str
    device_name: str
    precision: str
    steps: int  # timed steps (after the warm-up)
    warmup_steps: int
    samples: int
    seconds: float  # the timed window's wall time
    model_flops: float  # training (forward + backward) model FLOPs of the timed window
    peak_flops: float
    peak_source: str  # "spec" (datasheet) or "measured" (no datasheet entry: the measured GEMM)
    gemm_flops: float  # the measured GEMM rate
    forward_flops_by_module: dict[str, float]  # over the timed window
    step_seconds: list[float]
    step_flops: list[float]
    losses: list[float]
    all_step_seconds: list[float] = field(default_factory=list)  # every step run, warm-up (compilation) included
    phase_seconds: dict[str, float] = field(default_factory=dict)  # per profiled step (device time on a GPU)
    phase_cpu_seconds: dict[str, float] = field(default_factory=dict)  # host time per phase, on a GPU
    module_seconds: dict[str, float] = field(default_factory=dict)  # forward, per profiled step
    profiled_steps: int = 0
    profile_table: str = ""
    settings: dict[str, Any] = field(default_factory=dict)

    @property
    def model_flops_per_second(self) -> float:
        return self.model_flops / self.seconds if self.seconds else math.nan

    @property
    def mfu(self) -> float:
        return self.model_flops_per_second / self.peak_flops

    @property
    def median_step_flops_per_second(self) -> float:
        """The median step's rate: robust to a step that recompiles or autotunes inside the window."""
        rates = [f / s for f, s in zip(self.step_flops, self.step_seconds) if s > 0]
        return float(np.median(rates)) if rates else math.nan

    @property
    def mfu_vs_gemm(self) -> float:
        return self.model_flops_per_second / self.gemm_flops

    @property
    def samples_per_second(self) -> float:
        return self.samples / self.seconds if self.seconds else math.nan

    @property
    def median_step_seconds(self) -> float:
        return float(np.median(self.step_seconds)) if self.step_seconds else math.nan

    def metrics(self) -> dict[str, float]:
        """Flat figures for MLflow / Dagster metadata."""
        forward = sum(self.forward_flops_by_module.values()) or 1.0
        out = {"mfu": self.mfu, "mfu_vs_gemm": self.mfu_vs_gemm, "model_tflops": self.model_flops_per_second / 1e12,
               "mfu_median_step": self.median_step_flops_per_second / self.peak_flops,
               "peak_tflops": self.peak_flops / 1e12, "gemm_tflops": self.gemm_flops / 1e12,
               "samples_per_second": self.samples_per_second, "step_seconds_median": self.median_step_seconds,
               "model_tflop_per_step": self.model_flops / max(1, self.steps) / 1e12,
               "final_loss": self.losses[-1] if self.losses else math.nan}
        out.update({f"flops_share.{k}": v / forward for k, v in self.forward_flops_by_module.items()})
        out.update({f"time.{k}": v for k, v in self.phase_seconds.items()})
        out.update({f"time.module.{k}": v for k, v in self.module_seconds.items()})
        out.update({f"time_host.{k}": v for k, v in self.phase_cpu_seconds.items()})
        return out

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data.update(self.metrics())
        return data


@contextlib.contextmanager
def module_scopes() -> Iterator[None]:
    """Profiler scopes (record_function) around the forward of each GEM module (MODULE_SCOPES).

    Global forward hooks, named by module class (GEMModel.loss calls encode directly, so the model
    itself may never pass through a hook); a branch names its own summary and CLS projections, and a
    GEMModel that is called names its trunk and input projections. Other modules cost a dict lookup."""
    from gem_ops.model.embeddings import GEMEmbeddings
    from gem_ops.model.gem import GEMModel, SequenceBranch
    from gem_ops.model.heads import DomainTaskTowers
    from gem_ops.model.sequence import JaggedCrossAttention, JaggedTransformerLayer
    from gem_ops.model.wukong import WukongLayer

    by_class = {GEMEmbeddings: "embeddings", SequenceBranch: "sequence.branch", JaggedTransformerLayer: "sequence.layers",
                JaggedCrossAttention: "cross_attention", WukongLayer: "wukong", DomainTaskTowers: "towers"}
    names: dict[int, str] = {}
    open_scopes: dict[int, list] = {}

    def name_children(module: torch.nn.Module) -> None:
        if isinstance(module, SequenceBranch):
            for child in module.summarize:
                names[id(child)] = "sequence.summarize"
            for child in module.cls_out:
                names[id(child)] = "sequence.cls_out"
        elif isinstance(module, GEMModel):
            names[id(module.trunk)] = "trunk"
            for name in ("candidate_proj", "dense_proj", "teacher_proj"):
                if getattr(module, name, None) is not None:
                    names[id(getattr(module, name))] = "input_projections"

    def before(module, args):
        scope = names.get(id(module)) or by_class.get(type(module))
        if isinstance(module, (SequenceBranch, GEMModel)):
            name_children(module)
        if scope is not None:
            rf = record_function(scope)
            rf.__enter__()
            open_scopes.setdefault(id(module), []).append(rf)

    def after(module, args, output):
        stack = open_scopes.get(id(module))
        if stack:
            stack.pop().__exit__(None, None, None)

    handles = [torch.nn.modules.module.register_module_forward_pre_hook(before),
               torch.nn.modules.module.register_module_forward_hook(after, always_call=True)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _scope_seconds(profile, device: torch.device, scopes: tuple[str, ...], steps: int) -> dict[str, float]:
    """Seconds per step spent in each scope: on CUDA the device time of the kernels its host range
    launched (or, where none is attributed, the span of its range on the GPU timeline), else CPU time."""
    cpu, gpu = dict.fromkeys(scopes, 0.0), dict.fromkeys(scopes, 0.0)
    for event in profile.events():
        if event.name not in cpu:
            continue
        if event.device_type == torch.autograd.DeviceType.CPU:
            cpu[event.name] += (_device_time(event) if device.type == "cuda" else event.cpu_time_total) / 1e6
        elif device.type == "cuda":  # the range's mirror on the GPU timeline (gpu_user_annotation)
            gpu[event.name] += event.time_range.elapsed_us() / 1e6
    return {k: (cpu[k] or gpu[k]) / max(1, steps) for k in scopes}


def _device_time(event) -> float:
    """A host range's device time (us), less the host waits (HOST_WAITS) within it."""
    waits, stack = 0.0, list(event.cpu_children)
    while stack:
        child = stack.pop()
        if child.name in HOST_WAITS:
            waits += child.device_time_total
        else:
            stack.extend(child.cpu_children)
    return event.device_time_total - waits


def _set_compiler_stance(stance: str) -> None:
    set_stance = getattr(torch.compiler, "set_stance", None)  # torch >= 2.6
    if set_stance is not None:
        set_stance(stance)


def measure_mfu(logs, plan_path, model_config, train_config, *, steps: int = 20, warmup_steps: int = 5,
                profile_steps: int = 3, device: torch.device | str = "cpu", rank: int = 0) -> MFUReport:
    """Trains `warmup_steps + steps + 1 + profile_steps` real steps of the plan with the training loop
    (loader, embeddings, optimizer and all) and measures the `steps` after the warm-up; then profiles
    `profile_steps` more (after one profiler warm-up step). Eval and checkpoints are left out."""
    from gem_ops.metrics.flops import MODULES, batch_flops
    from gem_ops.model.config import FeatureSpec
    from gem_ops.train.batches import PlanSchedule
    from gem_ops.train.loop import train

    device = torch.device(device)
    if steps < 1 or warmup_steps < 0 or profile_steps < 0:
        raise ValueError(f"steps must be >= 1 and warmup/profile steps >= 0, got {steps}, {warmup_steps}, {profile_steps}")
    total = warmup_steps + steps + (1 + profile_steps if profile_steps else 0)
    plan_steps = PlanSchedule(plan_path, rank, 1, train_config.seed).plan_steps
    config = dataclasses.replace(train_config, max_steps=total, epochs=math.ceil(total / plan_steps), eval_every=0,
                                 checkpoint_every=0, eval_max_examples=min(train_config.eval_max_examples, 256),
                                 log_every=total)
    gemm = measured_matmul_flops(device)
    peak, source = peak_flops(device)

    profiler = contextlib.nullcontext()
    if profile_steps:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        profiler = torch.profiler.profile(
            activities=activities,
            schedule=torch.profiler.schedule(wait=warmup_steps + steps, warmup=1, active=profile_steps, repeat=1))
    def on_step(step: int, loss: float) -> None:
        if profile_steps:
            prof.step()
        if step + 1 == total:  # the loop's final evaluation runs compiled blocks eagerly: no new graphs
            _set_compiler_stance("force_eager")

    with profiler as prof, module_scopes():
        try:
            _, result = train(logs, plan_path, model_config, config, device=device, rank=rank, on_step=on_step)
        finally:
            _set_compiler_stance("default")

    window = slice(warmup_steps, warmup_steps + steps)
    step_seconds = result.step_seconds[window]
    step_flops = result.step_flops[window]
    spec = FeatureSpec.from_logs(logs)
    schedule = PlanSchedule(plan_path, rank, config.epochs, config.seed)
    by_module = dict.fromkeys(MODULES, 0.0)
    samples = 0
    for step in range(warmup_steps, warmup_steps + steps):  # the window's batches again, outside the timing
        batch = logs.batch(schedule.examples(step), model_config.sequence.max_history_len)
        samples += batch.size
        for k, v in batch_flops(batch, spec, model_config).forward_by_module.items():
            by_module[k] = by_module.get(k, 0.0) + v
    report = MFUReport(
        device=str(device), device_name=device_name(device), precision=config.precision, steps=steps,
        warmup_steps=warmup_steps, samples=samples, seconds=float(sum(step_seconds)), model_flops=float(sum(step_flops)),
        peak_flops=peak, peak_source=source, gemm_flops=gemm, forward_flops_by_module=by_module,
        step_seconds=step_seconds, step_flops=step_flops, losses=list(result.losses),
        all_step_seconds=list(result.step_seconds),
        settings={"model": model_config.to_dict(), "train": config.to_dict()},
    )
    if profile_steps:
        report.profiled_steps = profile_steps
        report.phase_seconds = _scope_seconds(prof, device, PHASES, profile_steps)
        if device.type == "cuda":
            # The backward's kernels are launched by autograd's device thread, outside the loop's
            # "backward" scope: it is the device's busy time less the other phases'.
            scopes = {*PHASES, *MODULE_SCOPES}  # their mirrors on the GPU timeline span kernels, not add to them
            busy = sum(e.time_range.elapsed_us() for e in prof.events()
                       if e.device_type == torch.autograd.DeviceType.CUDA and e.name not in scopes
                       and e.name not in HOST_WAITS) / 1e6 / profile_steps
            others = sum(v for k, v in report.phase_seconds.items() if k != "backward")
            report.phase_seconds["backward"] = max(0.0, busy - others)
            report.phase_seconds["device_busy"] = busy
            report.phase_cpu_seconds = _scope_seconds(prof, torch.device("cpu"), PHASES, profile_steps)
        profiled = result.step_seconds[warmup_steps + steps + 1:]
        report.phase_seconds["step"] = float(np.mean(profiled)) if profiled else math.nan
        report.module_seconds = _scope_seconds(prof, device, MODULE_SCOPES, profile_steps)
        # The forward outside the scoped modules (concatenations, the loss, unscoped projections).
        top = ("embeddings", "input_projections", "sequence.branch", "wukong", "trunk", "towers")
        report.module_seconds["other"] = max(0.0, report.phase_seconds.get("forward", 0.0)
                                             - sum(report.module_seconds[k] for k in top))
        sort_by = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
        report.profile_table = prof.key_averages().table(sort_by=sort_by, row_limit=25)
    return report


def mfu_figure(report: MFUReport):
    """Three panels: step time by phase and forward time by module (profiled steps), the share of model
    FLOPs by module, and the timed window's per-step model TFLOP/s against the peak."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(17, 4.8))
    unit = "device" if report.device.startswith("cuda") else "CPU"
    phases = {k: v * 1e3 for k, v in report.phase_seconds.items() if k not in ("step", "device_busy")}
    modules = {k: v * 1e3 for k, v in report.module_seconds.items() if v > 0}
    ax = axes[0]
    labels = [*phases, *[f"fwd: {k}" for k in modules]]
    ax.barh(labels, [*phases.values(), *modules.values()], color=["C0"] * len(phases) + ["C1"] * len(modules))
    ax.invert_yaxis()
    step_ms = report.phase_seconds.get("step", math.nan) * 1e3
    busy = report.phase_seconds.get("device_busy")
    busy_text = f", device busy {busy * 1e3:.1f} ms" if busy is not None else ""
    ax.set_xlabel(f"ms per step ({unit} time; wall step {step_ms:.1f} ms{busy_text})")
    ax.set_title("where a step's time goes (profiled)")

    flops = {k: v for k, v in report.forward_flops_by_module.items() if v > 0}
    total = sum(flops.values()) or 1.0
    ax = axes[1]
    ax.barh(list(flops), [100 * v / total for v in flops.values()], color="C2")
    ax.invert_yaxis()
    ax.set_xlabel("% of model FLOPs")
    ax.set_title(f"model FLOPs by module ({report.model_flops / max(1, report.steps) / 1e12:.3g} TFLOP per step)")

    ax = axes[2]
    rates = [f / s / 1e12 for f, s in zip(report.step_flops, report.step_seconds)]
    ax.plot(range(report.warmup_steps, report.warmup_steps + len(rates)), rates, marker="o", label="model TFLOP/s")
    ax.axhline(report.gemm_flops / 1e12, color="C3", linestyle="--", label=f"measured GEMM {report.gemm_flops / 1e12:.3g}")
    if report.peak_source == "spec":
        ax.axhline(report.peak_flops / 1e12, color="k", linestyle=":", label=f"peak {report.peak_flops / 1e12:.4g}")
    ax.set_xlabel("step")
    ax.set_ylabel("TFLOP/s")
    ax.set_yscale("log")
    ax.legend(fontsize=8)
    ax.set_title(f"MFU {100 * report.mfu:.1f}% ({report.peak_source} peak), {report.samples_per_second:.4g} samples/s")
    fig.suptitle(f"{report.device_name}, {report.precision}")
    fig.tight_layout()
    return fig


def log_mfu_report(tracker, report: MFUReport) -> None:
    """Metrics (mfu.*), the per-step rate as a curve, the figure and the full report to an MLflow run."""
    import matplotlib.pyplot as plt

    tracker.log_params({"mfu": {"device": report.device_name, "peak_source": report.peak_source,
                                "steps": report.steps, "warmup_steps": report.warmup_steps},
                        **report.settings})
    tracker.log_metrics({f"mfu.{k}": v for k, v in report.metrics().items() if math.isfinite(v)}, step=report.steps)
    rates = [f / s / 1e12 for f, s in zip(report.step_flops, report.step_seconds)]
    if rates:
        tracker.log_metric_history("mfu.step_model_tflops", rates,
                                   range(report.warmup_steps, report.warmup_steps + len(rates)))
    fig = mfu_figure(report)
    tracker.log_figure(fig, "mfu_report.png")
    plt.close(fig)
    data = report.to_dict()
    tracker.log_dict({k: v for k, v in data.items() if k != "profile_table"}, "mfu_report.json")
    if report.profile_table:
        tracker.log_text(report.profile_table, "mfu_profile.txt")
