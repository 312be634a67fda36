"""Training settings."""

from __future__ import annotations

import json
import typing
from dataclasses import asdict, dataclass
from typing import Any, Literal


CALIBRATION_RATES = ("newest_day", "backtested")


@dataclass(frozen=True)
class TrainConfig:
    epochs: int = 1  # passes over the plan's steps (each pass in its own seeded order)
    max_steps: int | None = None  # stop early after this many steps in all
    lr_dense: float = 1e-3  # the dense optimizer's rate
    # adamw; radam: torch's RAdam with decoupled weight decay, whose rectified steps keep the first full-rate steps
    # from collapsing every example's representation onto one vector (benchmarks/README, the bias-free stall), by
    # scaling the early steps well below the rate (which costs GEM on MovieLens: AdamW stays the default)
    dense_optimizer: Literal["adamw", "radam"] = "adamw"
    lr_sparse: float = 0.05  # row-wise Adagrad on embedding tables
    weight_decay: float = 0.01  # dense parameters only
    warmup_steps: int = 20  # linear warm-up of the dense learning rate
    # When > 0, the warm-up is at most this share of the run's steps: a short run (a student on one fresh day
    # trains ~30 steps) would otherwise spend most of them below its learning rate. 0: warmup_steps as given
    warmup_share: float = 0.0
    # After the warm-up: constant, or a cosine decay over the run's steps down to min_lr_ratio x lr_dense
    lr_schedule: Literal["constant", "cosine"] = "constant"
    min_lr_ratio: float = 0.1
    clip_grad_norm: float = 1.0  # dense parameters; 0 disables
    # Exponential moving average of all weights, tables included, with this decay per step; validation
    # judges and training keeps the average (weight_average.py). 0: off, the last (or best) step's weights
    weight_average_decay: float = 0.0
    # Share of training examples whose history is cut to a random length (log-uniform from 1 to the model's
    # maximum, drawn per step from the seed): a model then meets at training the shorter histories a server
    # gives it under a compute budget (adaptive history caps), not only full ones. 0: every history whole
    history_cut_share: float = 0.0
    # auto: bf16 autocast on CUDA, fp32 on CPU; fp8: bf16 autocast with the large linear layers in FP8
    # (fp8_recipe; CUDA GPUs with FP8 tensor cores only; see train/acceleration.py)
    precision: Literal["auto", "fp32", "bf16", "fp8"] = "auto"
    # tensorwise_triton (the fastest on the H200): tensorwise scales, all products in fast accumulation,
    # casts by kernels.fp8_cast (train/fp8_linear.py); the others are torchao's, tensorwise_fast_accum
    # being tensorwise with the gradient products in fast accumulation too
    fp8_recipe: Literal["tensorwise_triton", "tensorwise", "tensorwise_fast_accum", "rowwise"] = "tensorwise_triton"
    # dense: torch.compile of each dense block; model: of the whole step after the embedding lookups, one graph
    compile: Literal["none", "dense", "model"] = "none"
    # With compile "model": the compiled step's forward and backward replayed from CUDA graphs (Inductor's
    # "reduce-overhead"), one graph recorded per set of batch sizes met: no per-kernel host work where sizes
    # repeat (size_bucket rounds them to a ladder: an 81-step plan of the MFU benchmark's meets 81 sets exact, 47 at
    # 1.05, 31 at 1.1; later epochs meet the same sets). Off: on one H100 at half width, L512 it trained at 0.87x
    # the samples/s of the step without graphs even where every step had the same sizes (benchmarks/README.md).
    # A run reports the graphs Inductor ran without them and why (TrainResult.cuda_graph_skips, MLflow too).
    cuda_graphs: bool = False
    # Inductor settings for what compile compiles, NAME=VALUE pairs separated by commas (values as JSON where they
    # parse, else text; names as in torch._inductor.config), e.g. "cpp_wrapper=true" (the compiled graphs launch
    # their kernels from C++) or "combo_kernels=true"; torch.compile's `options`. "": Inductor's defaults
    compile_options: str = ""
    # > 1: every size the compiled step sees (history events, each pyramid level's tokens) rounded up to a ladder
    # of sizes this ratio apart (features.bucketed), rows past the last example's no example's; 0: exact sizes
    size_bucket: float = 0.0
    # One-process training: embedding tables with sparse gradients, updated only in the rows looked up.
    # Off by default: on the H200 it cut the GPU preset's bf16 MFU from 45% to 31% (coalescing the
    # sparse gradients waits on the device every step) against updating the whole tables.
    sparse_table_gradients: bool = False
    activation_checkpointing: Literal["none", "sequence"] = "none"  # sequence: recompute the sequence layers
    # Several ranks under FSDP2: each dense unit starts the next one's all-gather (forward) and the previous
    # one's (backward) as soon as its own parameters are in, in the order of the first step (unit_prefetch.py)
    unit_prefetch: bool = False
    # Before the first step: one zero-loss pass per history-length bucket, so that kernel tuning and compiling
    # happen there rather than in whichever later step first reaches a bucket (warm_up.py; MFU windows set it)
    warm_up_lengths: bool = False
    # Python's garbage collector: off while steps run, a collection of what the steps made every gc_every steps,
    # between steps (gc_schedule.py); 0: automatic collection, pauses landing inside whichever step
    gc_every: int = 50
    prefetch_batches: int = 1  # batches loaded ahead in a background thread while a step runs; 0: none
    # When the host reads a step's loss and gradient norm: next_step queues the next step on the device first, so
    # the device does not wait for the host between steps (step_readout.py); each_step waits for every step (a
    # diverging step then stops before another is queued, every gradient checked); auto: next_step on CUDA
    step_readout: Literal["auto", "each_step", "next_step"] = "auto"
    eval_every: int = 0  # steps between evaluations (on the validation day when there is one); 0: only at the end
    # The newest days of the training examples held out: early stopping and calibration read them
    validation_days: int = 0
    # With validation days: stop after this many evaluations without a better validation NE, and keep the
    # best evaluated weights (0: train to the end, still keeping the best)
    early_stopping_patience: int = 0
    # No stop before this step (an early plateau on a noisy validation day must not end training); the best
    # weights are tracked from the first evaluation all the same
    early_stopping_min_steps: int = 0
    calibrate: bool = True  # with validation days: Platt scaling per (domain, task) fitted on them at the end
    # The rate that calibration aims at: the validation day's own (newest_day), or per (domain, task) the newest
    # days' pooled rate that forecast each next day clearly better (backtested; gem_ops.train.calibration_rate)
    calibration_rate: str = "backtested"
    # Also carry a significant trend of the model's residual over the newest week one day forward
    # (gem_ops.train.calibration_trend): a rate that trends has moved again by the day the model serves
    calibration_trend: bool = True
    eval_max_examples: int = 20_000  # a fixed subset of the eval split, for speed
    eval_batch_size: int = 512
    checkpoint_every: int = 0  # steps between checkpoints; 0: only at the end
    keep_checkpoints: int = 2
    log_every: int = 10  # steps between metric flushes to MLflow
    seed: int = 0

    @classmethod
    def choices(cls, name: str) -> tuple[str, ...]:
        """The values a setting typed as a Literal takes, e.g. choices("compile")."""
        return typing.get_args(typing.get_type_hints(cls)[name])

    def __post_init__(self):
        for name in ("epochs", "eval_max_examples", "eval_batch_size", "keep_checkpoints", "log_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"TrainConfig.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("precision", "fp8_recipe", "compile", "activation_checkpointing", "lr_schedule",
                     "dense_optimizer", "step_readout"):
            allowed = self.choices(name)
            if getattr(self, name) not in allowed:
                raise ValueError(f"TrainConfig.{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if self.cuda_graphs and self.compile != "model":
            raise ValueError(f"TrainConfig.cuda_graphs replays the compiled step: it needs compile='model', "
                             f"got compile={self.compile!r}")
        if self.compile_options:
            if self.compile == "none":
                raise ValueError(f"TrainConfig.compile_options {self.compile_options!r} set Inductor's compile: they "
                                 "need compile='dense' or 'model', got compile='none'")
            check_inductor_options(compile_option_values(self.compile_options))
        if self.size_bucket and self.size_bucket <= 1:
            raise ValueError(f"TrainConfig.size_bucket must be 0 (exact sizes) or > 1, got {self.size_bucket}")
        if self.gc_every < 0:
            raise ValueError(f"TrainConfig.gc_every must be >= 0 (0: Python's automatic collection), "
                             f"got {self.gc_every}")
        if self.prefetch_batches < 0:
            raise ValueError(f"TrainConfig.prefetch_batches must be >= 0, got {self.prefetch_batches}")
        if self.early_stopping_min_steps < 0:
            raise ValueError(f"TrainConfig.early_stopping_min_steps must be >= 0, got {self.early_stopping_min_steps}")
        if self.validation_days < 0 or self.early_stopping_patience < 0:
            raise ValueError("TrainConfig.validation_days and early_stopping_patience must be >= 0, got "
                             f"{self.validation_days} and {self.early_stopping_patience}")
        if self.early_stopping_patience and not (self.validation_days and self.eval_every):
            raise ValueError("TrainConfig.early_stopping_patience needs validation_days >= 1 (what to judge on) "
                             "and eval_every >= 1 (how often)")
        if self.calibration_rate not in CALIBRATION_RATES:
            raise ValueError(f"TrainConfig.calibration_rate must be one of {CALIBRATION_RATES}, "
                             f"got {self.calibration_rate!r}")
        if not 0 <= self.history_cut_share <= 1:
            raise ValueError(f"TrainConfig.history_cut_share must be within [0, 1], got {self.history_cut_share}")
        if not 0 <= self.weight_average_decay < 1:
            raise ValueError(f"TrainConfig.weight_average_decay must be within [0, 1), got {self.weight_average_decay}")
        if not 0 <= self.warmup_share <= 1:
            raise ValueError(f"TrainConfig.warmup_share must be within [0, 1], got {self.warmup_share}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"TrainConfig.min_lr_ratio must be within [0, 1], got {self.min_lr_ratio}")
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError(f"TrainConfig.max_steps must be >= 1 or None, got {self.max_steps}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def compile_option_values(text: str) -> dict[str, Any]:
    """TrainConfig.compile_options as torch.compile's options: "cpp_wrapper=true,max_autotune=false" ->
    {"cpp_wrapper": True, "max_autotune": False}."""
    options = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, value = item.partition("=")
        if not sep or not name.strip():
            raise ValueError(f"TrainConfig.compile_options takes NAME=VALUE pairs separated by commas, got {item!r}")
        try:
            options[name.strip()] = json.loads(value)
        except json.JSONDecodeError:
            options[name.strip()] = value.strip()
    return options


def check_inductor_options(options: dict[str, Any]) -> None:
    """A name that is no Inductor setting is a typo that torch.compile would only report at the first step."""
    import torch._inductor.config as inductor_config

    known = inductor_config.get_config_copy()
    if unknown := sorted(set(options) - set(known)):
        raise ValueError(f"TrainConfig.compile_options: {unknown[0]!r} is not an Inductor setting "
                         "(torch._inductor.config)")
