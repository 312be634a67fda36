"""Run config shared by every asset that trains a model: the model (a preset, scaled, with dotted
overrides) and the training settings (TrainConfig's fields of the same names)."""

import dagster as dg
import yaml
from pydantic import Field

from gem_ops.model.config import ModelConfig, model_config
from gem_ops.train import launch
from gem_ops.train.config import TrainConfig


class ModelTrainingConfig(dg.Config):
    preset: str = Field("gem", description="Model preset: gem, gem_gpu, domain_fm or vertical.")
    depth: float = Field(1.0, description="Scales the number of InterFormer blocks.")
    width: float = Field(1.0, description="Scales embedding and hidden widths.")
    model_overrides: dict[str, str] = Field(
        default_factory=dict,
        description='Dotted model settings, values in YAML, e.g. {"sequence.max_history_len": "256"}.'
    )
    epochs: int = 1
    max_steps: int | None = None
    lr_dense: float = 1e-3
    lr_sparse: float = 0.05
    warmup_steps: int = 20
    warmup_share: float = Field(
        0.0, description="When > 0, the warm-up is at most this share of the run's steps (for short runs, e.g. "
        "students on one fresh day); 0: warmup_steps as given.")
    lr_schedule: str = Field("cosine", description="After the warm-up: cosine (decay to min_lr_ratio x lr_dense) or "
                             "constant.")
    min_lr_ratio: float = 0.1
    validation_days: int = Field(
        1, description="Newest training days held out for early stopping and calibration (0: none).")
    eval_every: int = Field(50, description="Steps between evaluations on the validation days (0: at the end only).")
    early_stopping_patience: int = Field(
        3, description="Stop after this many evaluations without a better validation NE (0: train to the end); the "
        "best evaluated weights are kept either way.")
    early_stopping_min_steps: int = Field(
        0, description="No early stop before this step (a plateau early on a noisy validation day is no end).")
    weight_average_decay: float = Field(
        0.0, description="Keep a moving average of the weights with this decay per step (e.g. 0.998); validation "
        "judges it and training keeps it (0: off).")
    history_cut_share: float = Field(
        0.0, description="Share of training examples whose history is cut to a random length, for a model served "
        "with adaptive history caps (0: whole histories).")
    calibrate: bool = Field(True, description="Fit Platt scaling per (domain, task) on the validation days at the end.")
    calibration_rate: str = Field(
        "backtested", description="The rate calibration aims at: the validation day's own (newest_day), or per "
        "(domain, task) the newest days' pooled rate that forecast each next day on the days before clearly better "
        "(backtested).")
    calibration_trend: bool = Field(
        True, description="Also carry a significant trend of the model's residual (labels over calibrated predictions, "
        "day by day over the newest week) one day forward: a rate that trends has moved again by the day it serves.")
    eval_max_examples: int = 20_000
    checkpoint_every: int = Field(50, description="Steps between checkpoints: a killed or restarted job resumes there.")
    precision: str = Field("auto", description="auto (bf16 on CUDA, fp32 on CPU), fp32, bf16 or fp8.")
    fp8_recipe: str = Field(
        "tensorwise_triton", description="With precision fp8: tensorwise_triton (the fastest), or torchao's "
        "tensorwise, tensorwise_fast_accum or rowwise.")
    compile: str = Field("none", description="dense: torch.compile of the dense blocks and sequence layers; model: of "
                         "the whole step after the embedding lookups, as one graph.")
    compile_options: str = Field(
        TrainConfig.compile_options,
        description="Inductor settings for compile, NAME=VALUE pairs separated by commas (names as in "
                    "torch._inductor.config), e.g. cpp_wrapper=true: the compiled graphs launch their kernels from "
                    "C++.")
    sparse_table_gradients: bool = Field(
        False, description="One-process training: update only the embedding rows a batch looked up (slower on the "
        "H200).")
    activation_checkpointing: str = Field("none", description="sequence: recompute the sequence layers in the "
                                          "backward.")
    step_readout: str = Field(
        "auto", description="next_step: read a step's loss once the next step is queued, so the GPU does not wait "
        "for the host between steps; each_step: after every step (a diverging step stops in itself); auto: next_step "
        "on CUDA.")
    dense_optimizer: str = Field(TrainConfig.dense_optimizer,
                                 description="adamw, or radam (rectified: no warm-up needed).")
    weight_decay: float = Field(TrainConfig.weight_decay, description="Decoupled weight decay of the dense parameters.")
    clip_grad_norm: float = Field(TrainConfig.clip_grad_norm,
                                  description="Clip the dense gradients' norm to this (0: no clipping).")
    cuda_graphs: bool = Field(
        TrainConfig.cuda_graphs,
        description="With compile model: replay the compiled step from CUDA graphs, one per set of batch sizes met "
                    "(pair with size_bucket so that sizes repeat).")
    size_bucket: float = Field(
        TrainConfig.size_bucket,
        description="> 1: round every size the compiled step sees up to a ladder of sizes this ratio apart (fewer "
                    "recompiles and graphs); 0: exact sizes.")
    unit_prefetch: bool = Field(
        TrainConfig.unit_prefetch,
        description="Several ranks under FSDP2: start the next dense unit's all-gather (and the previous one's in the "
                    "backward) while this one computes.")
    warm_up_lengths: bool = Field(
        TrainConfig.warm_up_lengths,
        description="Before the first step, one zero-loss pass per history-length bucket, so that tuning and "
                    "compiling happen before the timed steps.")
    gc_every: int = Field(
        TrainConfig.gc_every, description="Python's garbage collector paused while steps run and run between steps "
        "every this many steps (0: automatic collection).")
    prefetch_batches: int = Field(TrainConfig.prefetch_batches,
                                  description="Batches loaded ahead in a background thread (0: none).")
    eval_batch_size: int = TrainConfig.eval_batch_size
    keep_checkpoints: int = Field(TrainConfig.keep_checkpoints, description="Checkpoints kept on disk (the newest).")
    log_every: int = Field(TrainConfig.log_every, description="Steps between metric flushes to MLflow.")
    seed: int = 0

    def model(self) -> ModelConfig:
        overrides = {key: yaml.safe_load(value) for key, value in self.model_overrides.items()}
        return model_config(self.preset, self.depth, self.width, **overrides)

    def train_settings(self) -> dict:
        """TrainConfig's fields that this config sets."""
        return {name: getattr(self, name) for name in TrainConfig.__dataclass_fields__
                if name in type(self).model_fields}

    def train(self) -> TrainConfig:
        return TrainConfig(**self.train_settings())


class TorchrunJobConfig(ModelTrainingConfig):
    """A model trained by the engine as a torchrun job (gem_foundation_model, mfu_report)."""

    nproc_per_node: int = Field(1, description="Training processes (torchrun ranks); a plan for this world size must "
                                "exist.")
    max_restarts: int = Field(2, description="torchrun restarts of the whole job when a rank dies.")
    embedding_sharding: str = Field(
        "auto", description="auto (TorchRec planner; one rank: none), table_wise, row_wise, fsdp or none.")
    device: str = Field("cpu", description="cpu (gloo) or cuda (NCCL).")

    def torchrun_command(self, sequence_logs, plans, extra: list[str]) -> list[str]:
        """The engine's torchrun job for this model and these settings (see gem_ops.train.launch)."""
        return launch.torchrun_command(
            sequence_logs, plans, preset=self.preset, depth=self.depth, width=self.width,
            model_overrides={key: yaml.safe_load(value) for key, value in self.model_overrides.items()},
            train_settings=self.train_settings(), nproc_per_node=self.nproc_per_node, max_restarts=self.max_restarts,
            extra=["--embedding-sharding", self.embedding_sharding, "--device", self.device, *extra])
