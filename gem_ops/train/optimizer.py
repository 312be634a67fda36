"""Row-wise Adagrad for embedding tables, AdamW for dense parameters, as one TorchRec CombinedOptimizer
(keyed by parameter name, so checkpoints and sharded runs address the same state)."""

from __future__ import annotations

import torch
from torch import nn
from torchrec.optim import CombinedOptimizer, KeyedOptimizerWrapper, RowWiseAdagrad

from gem_ops.train.config import TrainConfig


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
    """AdamW; no weight decay on biases and norms."""
    no_decay = {id(p) for name, p in dense.items() if p.dim() < 2 or "norm" in name}

    def adamw(params: list[torch.Tensor]) -> torch.optim.Optimizer:
        return torch.optim.AdamW(
            [{"params": [p for p in params if id(p) not in no_decay], "weight_decay": config.weight_decay},
             {"params": [p for p in params if id(p) in no_decay], "weight_decay": 0.0}],
            lr=config.lr_dense,
            # One kernel over all parameters on a GPU (the default, foreach, takes several per step).
            fused=bool(params) and all(p.is_cuda for p in params) or None,
        )

    return KeyedOptimizerWrapper(dense, adamw)


def table_optimizer(tables: dict[str, nn.Parameter], config: TrainConfig, **adagrad: float) -> KeyedOptimizerWrapper:
    return KeyedOptimizerWrapper(tables, lambda ps: RowWiseAdagrad(ps, lr=config.lr_sparse, **adagrad))


def build_optimizer(model: nn.Module, config: TrainConfig, **adagrad: float) -> CombinedOptimizer:
    sparse, dense = split_parameters(model)
    optimizers = []
    if sparse:
        optimizers.append(("sparse", table_optimizer(sparse, config, **adagrad)))
    if dense:
        optimizers.append(("dense", dense_optimizer(dense, config)))
    return CombinedOptimizer(optimizers)


def set_dense_lr(optimizer: CombinedOptimizer, config: TrainConfig, step: int) -> float:
    """Linear warm-up, then constant."""
    lr = config.lr_dense * min(1.0, (step + 1) / max(1, config.warmup_steps))
    for name, opt in optimizer.optimizers:
        if name == "dense":
            for group in opt.param_groups:
                group["lr"] = lr
    return lr
