"""The MFU window: warm-up steps, a timed window and a few profiled steps of the engine's own loop.

A run with an MFU window is an ordinary training run of the engine (the same launch, the same loop,
data loading, embeddings and optimizer included) whose length is the window's and whose eval and
checkpoints are off; rank 0 profiles the steps after the window with torch.profiler, scoped per module
of the model (forward) and per phase of the step (data, forward, backward, optimizer).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch.autograd.profiler import record_function

from gem_ops.metrics.flops import MODULES
from gem_ops.metrics.mfu import MFUReport, device_name, measured_matmul_flops, peak_flops
from gem_ops.metrics.overlap import communication_overlap, device_kernels
from gem_ops.model.config import ModelConfig
from gem_ops.train.config import TrainConfig
from gem_ops.train.gc_schedule import CollectionPauses
from gem_ops.train.host_profile import ProjectFrames, host_profile
from gem_ops.train.python_profile import PythonStepProfile
from gem_ops.train.step_readout import HOST_PHASES
from kernels.jagged_attention import chosen_configs, compiled_variants, stored_tunings_used, tuning_runs

# What the CUDA profiler lists with device time that is no GPU work: a kernel launch that waited for
# room in a full launch queue. Left out of every phase, module and busy figure.
HOST_WAITS = frozenset({"Command Buffer Full"})
PROFILERS = ("torch", "python")
# Step phases, as scoped by the engine (record_function), and the model's module scopes.
PHASES = ("data", "data.load", "forward", "backward", "optimizer")  # data.load: the prefetch thread's
# Nested: sequence.branch (one sequence's layer of a block, with its jagged bookkeeping) holds the
# summary projection, the sequence layer, the CLS projection and the cross attention.
MODULE_SCOPES = ("embeddings", "input_projections", "sequence.branch", "sequence.summarize", "sequence.layers",
                 "sequence.cls_out", "cross_attention", "wukong", "trunk", "towers")


@dataclass(frozen=True)
class MFUWindow:
    steps: int = 20  # timed
    warmup_steps: int = 5  # untimed first (lazy initialisation, compilation, autotuning)
    profile_steps: int = 3  # profiled after the timed ones, after one profiler warm-up step
    # "torch": torch.profiler (device kernels, phases, modules, the host's operators); "python": cProfile, the
    # host's Python time by function (gem_ops.train.python_profile)
    profiler: str = "torch"
    # Steps read late (TrainConfig.step_readout next_step): a step's hook runs once the next step is queued, so the
    # profiler's last profile_steps intervals would hold one step fewer of the host's work (and part of a step's
    # kernels queued before them), while every figure is divided by profile_steps: 2/3 of each per-step figure. The
    # window runs one step more and the profiler records one interval more: profile_steps steps queued within it.
    reads_late: bool = False

    def __post_init__(self):
        if self.steps < 1 or self.warmup_steps < 0 or self.profile_steps < 0:
            raise ValueError(f"MFU window: steps must be >= 1 and warm-up/profile steps >= 0, got {self.steps}, "
                             f"{self.warmup_steps}, {self.profile_steps}")
        if self.profiler not in PROFILERS:
            raise ValueError(f"MFU window: profiler must be one of {PROFILERS}, got {self.profiler!r}")

    @property
    def profiled_intervals(self) -> int:
        """The profiler's recorded intervals (from hook to hook) that hold profile_steps steps of host work."""
        return self.profile_steps + (1 if self.reads_late and self.profile_steps else 0)

    @property
    def total_steps(self) -> int:
        return self.warmup_steps + self.steps + (1 + self.profiled_intervals if self.profile_steps else 0)

    def train_config(self, config: TrainConfig, plan_steps: int) -> TrainConfig:
        """The run's settings: the window's length, no validation, periodic eval or checkpoints, a small
        final eval. Under the Python profiler every batch is loaded ahead, during the first (compiling) steps: from
        Python 3.12 cProfile counts every thread's calls on one stack, so the loading thread would be counted into
        the step's functions (one batch ahead or all: 0.99x the samples/s, results/mfu_cuda_w05_L512_preloaded.json)."""
        prefetch = max(config.prefetch_batches, self.total_steps) if self.profiler == "python" else \
            config.prefetch_batches
        return dataclasses.replace(config, max_steps=self.total_steps, epochs=math.ceil(self.total_steps / plan_steps),
                                   eval_every=0, checkpoint_every=0, log_every=self.total_steps, validation_days=0,
                                   early_stopping_patience=0, warm_up_lengths=True, prefetch_batches=prefetch,
                                   eval_max_examples=min(config.eval_max_examples, 256))

    @contextlib.contextmanager
    def observe(self, device: torch.device, profile: bool = True) -> Iterator[WindowObserver]:
        """Around the training run: yields the step hook to give the engine; `profile` (rank 0's) turns on
        the profiler and the module scopes."""
        observer = WindowObserver(self, profile and self.profile_steps > 0, device)
        with observer.profiler as observer.prof, observer.scopes, observer.pauses:
            try:
                yield observer
            finally:
                _set_compiler_stance("default")

    def report(self, result, observer: WindowObserver, device: torch.device, model_config: ModelConfig,
               train_config: TrainConfig) -> MFUReport:
        """The window's figures from an engine's TrainResult (a run of exactly this window)."""
        first, last = self.warmup_steps, self.warmup_steps + self.steps
        if len(result.step_ends) < last:
            raise ValueError(f"the run took {len(result.step_ends)} steps, fewer than the window's {last}")
        began = result.step_ends[first - 1] if first else result.started
        seconds = result.step_ends[last - 1] - began
        step_flops = result.step_flops[first:last]
        local = dict.fromkeys(MODULES, 0.0)
        for step in result.step_module_flops[first:last]:
            for k, v in step.items():
                local[k] = local.get(k, 0.0) + v
        forward, local_total = sum(step_flops) / 3.0, sum(local.values()) or 1.0
        peak, source = peak_flops(device)
        report = MFUReport(
            device=str(device), device_name=device_name(device), precision=train_config.precision, steps=self.steps,
            warmup_steps=self.warmup_steps, samples=int(sum(result.step_samples[first:last])), seconds=float(seconds),
            model_flops=float(sum(step_flops)), peak_flops=peak, peak_source=source,
            gemm_flops=measured_matmul_flops(device),
            # Each module's share from this rank's batches, of the window's forward FLOPs over all ranks.
            forward_flops_by_module={k: v / local_total * forward for k, v in local.items()},
            step_seconds=result.step_seconds[first:last], step_flops=step_flops, losses=list(result.losses),
            all_step_seconds=list(result.step_seconds), world_size=result.world_size,
            step_read_waits=list(result.step_read_waits[first:last]),
            step_host_seconds={phase: [step[phase] for step in result.step_host_seconds[first:last]]
                               for phase in HOST_PHASES},
            step_measures={m: list(v[first:last]) for m, v in result.balance.mean.items()},
            rank_measures={m: list(v[first:last]) for m, v in result.balance.ranks.items()},
            settings={"model": model_config.to_dict(), "train": train_config.to_dict(),
                      "window": dataclasses.asdict(self), "world_size": result.world_size})
        report.step_stalls = observer.step_stalls(first, last)
        if train_config.cuda_graphs:
            report.cuda_graph_skips = {"count": result.cuda_graph_skips, "reasons": result.cuda_graph_skip_reasons}
        report.attention_configs = chosen_configs()
        report.attention_key_sources = {"tuned": tuning_runs(), "from_store": stored_tunings_used()}
        if observer.alloc_retries:
            report.settings["allocator_retries_in_window"] = observer.alloc_retries[last - 1] - (
                observer.alloc_retries[first - 1] if first else 0)
        if observer.profiling:
            observer.add_profile(report)
        return report


class WindowObserver:
    """The step hook of an MFU run: steps the profiler, and keeps the final eval from compiling anew."""

    def __init__(self, window: MFUWindow, profiling: bool, device: torch.device):
        self.window, self.profiling, self.device = window, profiling, device
        self.prof = None
        self.recording_began, self.recorded_seconds = math.nan, math.nan  # the profiler's recorded steps, wall
        self.alloc_retries: list[int] = []  # the allocator's count after each step (CUDA)
        # What can stall a step from the host, as running totals: before the first step, then after each
        self.pauses = CollectionPauses()
        self.stalls: list[tuple] = [self._stall_counts()]
        self.scopes = contextlib.ExitStack()
        self.profiler = contextlib.nullcontext()
        self.python = PythonStepProfile() if profiling and window.profiler == "python" else None
        if self.python is not None:
            self.scopes.enter_context(self.python.backward_on_this_thread())
            self.scopes.callback(self.python.stop)
        elif profiling:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            # Shapes and stacks name the tensors of the ops run outside compiled code (profiled steps only).
            self.profiler = torch.profiler.profile(
                activities=activities, record_shapes=True, with_stack=True, schedule=torch.profiler.schedule(
                    wait=window.warmup_steps + window.steps, warmup=1, active=window.profiled_intervals, repeat=1))

    def _stall_counts(self) -> tuple[float, int, int, int, int]:
        from torch._dynamo.utils import counters

        # Inductor counts the inputs each CUDA graph it records copies in: it grows only when one is recorded.
        return (self.pauses.seconds, counters["stats"]["unique_graphs"], tuning_runs(), compiled_variants(),
                counters["inductor"]["cudagraph_recorded_non_static_inputs"])

    def step_stalls(self, first: int, last: int) -> dict[str, list[float]]:
        """Per step from `first` to `last` (excluded): seconds in garbage collection, graphs compiled by
        torch.compile, attention-kernel tunings, attention-kernel binaries compiled or loaded (a tuning compiles
        its candidates; without one, a new specialisation of a tuned kernel), and 1 where CUDA graphs were recorded
        (TrainConfig.cuda_graphs: sizes not met before). Counted between the steps' reads: with steps read late, what
        the host did while it queued the next step falls in the step before."""
        names = ("gc_seconds", "compiled_graphs", "attention_tunings", "attention_compiles", "cuda_graph_recordings")
        pairs = list(zip(self.stalls[first:last], self.stalls[first + 1 : last + 1]))
        stalls = {name: [float(after[i] - before[i]) for before, after in pairs] for i, name in enumerate(names)}
        stalls["cuda_graph_recordings"] = [float(n > 0) for n in stalls["cuda_graph_recordings"]]
        return stalls

    def __call__(self, step: int, loss: float) -> None:
        self.stalls.append(self._stall_counts())
        if self.device.type == "cuda":  # a step that found no free block freed the cache and retried: a sync
            self.alloc_retries.append(torch.cuda.memory_stats(self.device).get("num_alloc_retries", 0))
        if self.prof is not None:
            starts = step == self.window.warmup_steps + self.window.steps  # the recording starts after this hook
            ends = step + 1 == self.window.total_steps
            if self.device.type == "cuda" and (starts or ends):
                # Recording starts (or ends) with no earlier step's kernels (or this one's) still to run: the
                # device's figures are those of the steps queued within the recording
                torch.cuda.synchronize(self.device)
            if ends:
                self.recorded_seconds = time.perf_counter() - self.recording_began
            self.prof.step()
            if starts:
                self.recording_began = time.perf_counter()
        if self.python is not None:  # one step after the window, as the torch profiler's warm-up step
            if step == self.window.warmup_steps + self.window.steps:
                self.python.start()
            elif step + 1 == self.window.total_steps:
                self.python.stop()
        elif self.profiling and step + 1 == self.window.warmup_steps + self.window.steps:
            # The module scopes' global hooks cost host time in every module call (and guards in compiled
            # code): on for the profiled steps only, after the timed window.
            self.scopes.enter_context(module_scopes())
        if step + 1 == self.window.total_steps:  # the final eval runs compiled blocks eagerly: no new graphs
            _set_compiler_stance("force_eager")

    def add_profile(self, report: MFUReport) -> None:
        """Seconds per profiled step by phase and by module, and the profiler's table."""
        if self.python is not None:
            report.host_python = self.python.summary()
            report.profiled_steps = report.host_python["steps"]
            return
        prof, device = self.prof, self.device
        # the steps whose work the recording holds, counted (an early stop, a readout this window did not expect)
        steps = recorded_steps(prof) or self.window.profile_steps
        report.profiled_steps = steps
        report.phase_seconds = scope_seconds(prof, device, PHASES, steps)
        if device.type == "cuda":
            # The backward's kernels are launched by autograd's device thread, outside the engine's
            # "backward" scope: it is the device's busy time less the other phases'.
            overlap = communication_overlap(device_kernels(prof, HOST_WAITS), steps)
            busy = overlap.busy_seconds
            others = sum(v for k, v in report.phase_seconds.items() if k != "backward")
            report.phase_seconds["backward"] = max(0.0, busy - others)
            report.phase_seconds["device_busy"] = busy
            report.communication = overlap.to_dict()
            report.phase_cpu_seconds = scope_seconds(prof, torch.device("cpu"), PHASES, steps)
        report.phase_seconds["step"] = self.recorded_seconds / steps
        report.module_seconds = scope_seconds(prof, device, MODULE_SCOPES, steps)
        # The forward outside the scoped modules (concatenations, the loss, unscoped projections).
        top = ("embeddings", "input_projections", "sequence.branch", "wukong", "trunk", "towers")
        report.module_seconds["other"] = max(0.0, report.phase_seconds.get("forward", 0.0)
                                             - sum(report.module_seconds[k] for k in top))
        sort_by = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
        averages = prof.key_averages()
        report.profile_table = averages.table(sort_by=sort_by, row_limit=25)
        if device.type == "cuda":
            report.top_kernels = top_device_operators(averages, steps)
            frames = ProjectFrames(prof)  # the profile's Python frames, read once for both tables
            report.eager_operators = eager_operators(prof, steps, device, frames=frames)
            report.host = host_profile(prof, steps, frames=frames)


def recorded_steps(profile) -> int:
    """Training steps whose host work a profile holds: the engine's "optimizer" scopes on the host."""
    return sum(1 for event in profile.events()
               if event.name == "optimizer" and event.device_type == torch.autograd.DeviceType.CPU)


@contextlib.contextmanager
def module_scopes() -> Iterator[None]:
    """Profiler scopes (record_function) around the forward of each GEM module (MODULE_SCOPES).

    Global forward hooks, named by module class (the engine calls GEMModel.loss_sums, so the model
    itself may never pass through a hook); a branch names its own summary and CLS projections, and a
    GEMModel that is called names its trunk and input projections. Other modules cost a dict lookup."""
    from gem_ops.model.embeddings import GEMEmbeddings
    from gem_ops.model.gem import GEMModel, SequenceBranch
    from gem_ops.model.heads import DomainTaskTowers
    from gem_ops.model.sequence import JaggedCrossAttention, JaggedTransformerLayer
    from gem_ops.model.wukong import WukongLayer

    by_class = {GEMEmbeddings: "embeddings", SequenceBranch: "sequence.branch",
                JaggedTransformerLayer: "sequence.layers",
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


def top_device_operators(averages, steps: int, limit: int | None = None) -> list[dict]:
    """The kernels (and copies) with the most device time, per step, from a profile's key_averages(); all of
    them by default, so that a breakdown by kind (gem_ops.metrics.kernels) covers the whole busy time."""
    rows = sorted((a for a in averages if a.device_type == torch.autograd.DeviceType.CUDA
                   and a.self_device_time_total > 0 and not getattr(a, "is_user_annotation", False)),
                  key=lambda a: a.self_device_time_total, reverse=True)[:limit]
    return [{"name": a.key[:120], "ms": a.self_device_time_total / 1e3 / max(1, steps),
             "calls": a.count / max(1, steps)}
            for a in rows]


def eager_operators(profile, steps: int, device: torch.device, limit: int = 40,
                    frames: ProjectFrames | None = None) -> list[dict]:
    """The ATen ops that launched the most device time themselves (CPU time on a CPU), by input shapes and the
    first line of project code that called them: what runs outside compiled graphs (Inductor's kernels have no
    ATen op). Needs a profile recorded with shapes and stacks."""
    rows = {}
    frames = frames if frames is not None else ProjectFrames(profile)
    for event in profile.events():
        if event.device_type != torch.autograd.DeviceType.CPU or not event.name.startswith("aten::"):
            continue
        ms = (event.self_device_time_total if device.type == "cuda" else event.self_cpu_time_total) / 1e3
        if ms <= 0:
            continue
        where = frames.caller(event)
        key = (event.name, str(event.input_shapes)[:160], where)
        row = rows.setdefault(key, {"name": key[0], "input_shapes": key[1], "caller": where, "ms": 0.0, "calls": 0})
        row["ms"] += ms / max(1, steps)
        row["calls"] += 1 / max(1, steps)
    return sorted(rows.values(), key=lambda row: row["ms"], reverse=True)[:limit]


def scope_seconds(profile, device: torch.device, scopes: tuple[str, ...], steps: int) -> dict[str, float]:
    """Seconds per step spent in each scope: on CUDA the device time of the kernels its host range
    launched (or, where none is attributed, the span of its range on the GPU timeline), else CPU time."""
    cpu, gpu = dict.fromkeys(scopes, 0.0), dict.fromkeys(scopes, 0.0)
    for event in profile.events():
        if event.name not in cpu:
            continue
        if event.device_type == torch.autograd.DeviceType.CPU:
            cpu[event.name] += (device_time(event) if device.type == "cuda" else event.cpu_time_total) / 1e6
        elif device.type == "cuda":  # the range's mirror on the GPU timeline (gpu_user_annotation)
            gpu[event.name] += event.time_range.elapsed_us() / 1e6
    return {k: (cpu[k] or gpu[k]) / max(1, steps) for k in scopes}


def device_time(event) -> float:
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
