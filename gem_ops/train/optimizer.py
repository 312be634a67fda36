"""Row-wise Adagrad for embedding tables, AdamW for dense parameters, as one TorchRec CombinedOptimizer
(keyed by parameter name, so checkpoints and sharded runs address the same state)."""

from __future__ import annotations

import math

import torch
from torch import nn
from torchrec.optim import CombinedOptimizer, KeyedOptimizerWrapper, RowWiseAdagrad

from gem_ops.train.config import TrainConfig
from kernels.rowwise_adagrad import rowwise_adagrad_


def split_parameters(model: nn.Module) -> tuple[dict[str, nn.Parameter], dict[str, nn.Parameter]]:
    """(embedding tables, dense parameters) by name; frozen parameters are left out.

    TorchRec's unsharded collections hold their tables as nn.EmbeddingBag / nn.Embedding modules."""
    tables = {id(p) for m in model.modules() if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) for p in m.parameters()}
    sparse, dense = {}, {}
    for name, param in model.named_parameters():
        if param.requires_grad:
            (sparse if id(param) in tables else dense)[name] = param
    return sparse, dense


def dense_optimizer(dense: dict[str, nn.Parameter], config: TrainConfig) -> KeyedOptimizerWrapper:
    """AdamW (or RAdam, config.dense_optimizer) with decoupled weight decay; none on biases and norms."""
    no_decay = {id(p) for name, p in dense.items() if p.dim() < 2 or "norm" in name}

    def build(params: list[torch.Tensor]) -> torch.optim.Optimizer:
        groups = [{"params": [p for p in params if id(p) not in no_decay], "weight_decay": config.weight_decay},
                  {"params": [p for p in params if id(p) in no_decay], "weight_decay": 0.0}]
        if config.dense_optimizer == "radam":  # no fused kernel: foreach on a GPU
            return torch.optim.RAdam(groups, lr=config.lr_dense, decoupled_weight_decay=True)
        # One kernel over all parameters on a GPU (the default, foreach, takes several per step).
        fused = bool(params) and all(p.is_cuda for p in params) or None
        return torch.optim.AdamW(groups, lr=config.lr_dense, fused=fused)

    return KeyedOptimizerWrapper(dense, build)


class SparseRowWiseAdagrad(RowWiseAdagrad):
    """TorchRec's row-wise Adagrad (same state: one accumulator per row, "sum" and "step"), which also
    takes sparse gradients: then only the rows a batch looked up are read and written, as FBGEMM's
    fused optimizer does for sharded tables, instead of the whole table every step."""

    @torch.no_grad()
    def step(self, closure=None):
        loss = None if closure is None else closure()
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    self._update(param, group)
        return loss

    def _update(self, param: torch.Tensor, group: dict) -> None:
        state = self.state[param]
        state["step"] += 1
        lr = group["lr"] / (1 + (float(state["step"]) - 1) * group["lr_decay"])
        grad = param.grad.coalesce() if param.grad.is_sparse else param.grad
        rows, values = (grad.indices()[0], grad.values()) if grad.is_sparse else (None, grad)
        if group["maximize"]:
            values = -values
        if group["weight_decay"]:
            values = values + group["weight_decay"] * (param if rows is None else param[rows])
        if rows is None:  # the whole table: one pass over gradient and table (kernels.rowwise_adagrad)
            rowwise_adagrad_(param, values, state["sum"], lr, group["eps"])
            return
        state["sum"].index_add_(0, rows, values.pow(2).mean(1, keepdim=True))
        param.index_add_(0, rows, values / state["sum"][rows].sqrt().add_(group["eps"]), alpha=-lr)


def sparse_table_gradients(model: nn.Module) -> list[str]:
    """Makes the unsharded embedding tables (TorchRec's nn.Embedding / nn.EmbeddingBag modules) return
    sparse gradients: the rows looked up, not a dense table-sized gradient. For one-process training;
    sharded tables (DMP) have FBGEMM's fused sparse update already. Returns the modules' names."""
    names = []
    for name, module in model.named_modules():
        if isinstance(module, (nn.Embedding, nn.EmbeddingBag)) and module.weight.requires_grad:
            module.sparse = True
            names.append(name)
    return names


def table_optimizer(tables: dict[str, nn.Parameter], config: TrainConfig, **adagrad: float) -> KeyedOptimizerWrapper:
    return KeyedOptimizerWrapper(tables, lambda ps: SparseRowWiseAdagrad(ps, lr=config.lr_sparse, **adagrad))


def build_optimizer(model: nn.Module, config: TrainConfig, **adagrad: float) -> CombinedOptimizer:
    sparse, dense = split_parameters(model)
    optimizers = []
    if sparse:
        optimizers.append(("sparse", table_optimizer(sparse, config, **adagrad)))
    if dense:
        optimizers.append(("dense", dense_optimizer(dense, config)))
    return CombinedOptimizer(optimizers)


def warmup_steps(config: TrainConfig, total_steps: int) -> int:
    """The warm-up's length: warmup_steps, cut to warmup_share of the run when that is set."""
    steps = config.warmup_steps
    if config.warmup_share > 0:
        steps = min(steps, math.ceil(config.warmup_share * total_steps))
    return max(1, steps)


def set_dense_lr(optimizer: CombinedOptimizer, config: TrainConfig, step: int, total_steps: int) -> float:
    """Linear warm-up, then constant or a cosine decay to min_lr_ratio x lr_dense at total_steps."""
    warmup = warmup_steps(config, total_steps)
    lr = config.lr_dense * min(1.0, (step + 1) / warmup)
    if config.lr_schedule == "cosine" and step >= warmup:
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        floor = config.min_lr_ratio
        lr = config.lr_dense * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))
    for name, opt in optimizer.optimizers:
        if name == "dense":
            for group in opt.param_groups:
                group["lr"] = lr
    return lr
