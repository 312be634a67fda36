"""Model FLOPs utilization (MFU): the arithmetic and the report.

MFU = achieved model FLOP/s (flops.py's analytic count of each step's batch / the steps' wall time,
data loading, embeddings and optimizer included) / the device's dense bf16 peak from its datasheet.
Beside it: the measured GEMM rate of the device (a large timed matmul), which is what a perfect step
could reach in practice. On a CPU there is no datasheet entry: MFU is taken against the measured GEMM.

`StepMFU` is what every training step logs (train.model_tflops, train.mfu); `MFUReport` holds a timed
window of training steps (gem_ops.train.mfu_window measures it, on the engine's own loop) and is
logged by `log_mfu_report`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

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
# Every device with FP8 tensor cores (Hopper, Ada, Blackwell) lists a dense FP8 peak of twice its bf16 one.
FP8_PEAK_OVER_BF16 = 2.0

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
    seconds: float  # the timed window's wall time, from the end of its first step's predecessor to its last's end
    model_flops: float  # training (forward + backward) model FLOPs of the timed window, all ranks
    peak_flops: float  # one device's
    peak_source: str  # "spec" (datasheet) or "measured" (no datasheet entry: the measured GEMM)
    gemm_flops: float  # the measured GEMM rate
    forward_flops_by_module: dict[str, float]  # over the timed window
    step_seconds: list[float]
    step_flops: list[float]
    losses: list[float]
    all_step_seconds: list[float] = field(default_factory=list)  # every step run, warm-up (compilation) included
    # per timed step, rank 0's host seconds blocked reading it back (TrainResult.step_read_waits)
    step_read_waits: list[float] = field(default_factory=list)
    # per phase (data, forward, backward, optimizer), per timed step: rank 0's host seconds queuing it, no sync added
    # (TrainResult.step_host_seconds)
    step_host_seconds: dict[str, list[float]] = field(default_factory=dict)
    # per timed step, the ranks' mean forward compute seconds, tokens and attention cost ((L + 1)^2 summed): what
    # the batch planner's cost model is fitted to (linear, so it holds for the means as for each rank)
    step_measures: dict[str, list[float]] = field(default_factory=dict)
    # the same per timed step and rank ([steps][ranks]): what each rank's planned cost is set against
    rank_measures: dict[str, list[list[float]]] = field(default_factory=dict)
    # the attention kernels' configs chosen per tuning key (kernel -> key -> config): what a side-by-side run ran
    attention_configs: dict[str, dict[str, str]] = field(default_factory=dict)
    # new tuning keys in this process: tuned here, or their config taken from the tuning store of earlier runs
    attention_key_sources: dict[str, int] = field(default_factory=dict)
    # per timed step, what stalled it from the host: seconds in garbage collection, graphs that torch.compile
    # compiled, attention-kernel tunings (gem_ops.train.mfu_window)
    step_stalls: dict[str, list[float]] = field(default_factory=dict)
    # with TrainConfig.cuda_graphs, over the run: the compiled step's graphs run without them, and Inductor's reasons
    cuda_graph_skips: dict[str, Any] = field(default_factory=dict)
    phase_seconds: dict[str, float] = field(default_factory=dict)  # per profiled step (device time on a GPU)
    phase_cpu_seconds: dict[str, float] = field(default_factory=dict)  # host time per phase, on a GPU
    module_seconds: dict[str, float] = field(default_factory=dict)  # forward, per profiled step
    # per profiled step on rank 0's GPU: collectives' seconds, the part no compute ran beside, compute (overlap.py)
    communication: dict[str, float] = field(default_factory=dict)
    profiled_steps: int = 0
    profile_table: str = ""
    # the kernels and copies with the most device time per profiled step: name, milliseconds, calls (GPU only)
    top_kernels: list[dict[str, Any]] = field(default_factory=list)
    # ATen ops by input shapes and calling line, with the device time they launched per profiled step (GPU only)
    eager_operators: list[dict[str, Any]] = field(default_factory=list)
    # the host's side of a profiled step (GPU only): kernel launches, device waits and value reads by calling line,
    # project functions by host time (gem_ops.train.host_profile)
    host: dict[str, Any] = field(default_factory=dict)
    # with the window's Python profiler: steps counted, functions by own and by inclusive host time per step
    host_python: dict[str, Any] = field(default_factory=dict)
    settings: dict[str, Any] = field(default_factory=dict)
    world_size: int = 1

    @property
    def model_flops_per_second(self) -> float:
        return self.model_flops / self.seconds if self.seconds else math.nan

    @property
    def mfu(self) -> float:
        """Over the whole timed window: its model FLOPs over its wall time (the mean step, not the median)."""
        return self.model_flops_per_second / (self.peak_flops * self.world_size)

    @property
    def median_step_flops_per_second(self) -> float:
        """The median step's rate: robust to a step that recompiles or autotunes inside the window."""
        rates = [f / s for f, s in zip(self.step_flops, self.step_seconds) if s > 0]
        return float(np.median(rates)) if rates else math.nan

    @property
    def mfu_vs_gemm(self) -> float:
        return self.model_flops_per_second / (self.gemm_flops * self.world_size)

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
               "mfu_median_step": self.median_step_flops_per_second / (self.peak_flops * self.world_size),
               "step_seconds_mean": self.seconds / max(1, self.steps),
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
    ax.axhline(report.gemm_flops / 1e12, color="C3", linestyle="--",
               label=f"measured GEMM {report.gemm_flops / 1e12:.3g}")
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
