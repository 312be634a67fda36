"""Model FLOPs of a GEM batch, counted analytically from the config, the feature spec and the batch's
actual jagged lengths, per module.

Counted: every matrix product the model runs (2·m·n·k per product), attention as 2·2·ds per visible
(query, key) pair (scores and weighted values, all heads), i.e. the sum of L² per sequence for self
attention (a causal mask sees L(L+1)/2 pairs). Not counted: embedding lookups and pooling, norms,
activations, softmax, the loss (elementwise work, a few percent of a dense layer's). A training step is
forward + backward = 3x the forward count (the backward of a product is two products of the same size).

Lengths follow the model exactly: each branch selects its events (`all`, `engaged`, `event_type:x`),
block b's sequence layer runs over K summary tokens + the branch's level-b history, the candidate's
cross attention reads the level-b history, and the next level keeps the most recent level_tokens(b).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import torch

from gem_ops.model.config import FeatureSpec, ModelConfig
from gem_ops.model.features import branch_keep_mask

CROSS_QUERIES = 2  # gem.CROSS_QUERIES: the candidate item and the mean interaction token
# The sequence tables (embeddings.sequence_tables) besides the history item features' history_* ones.
_SEQUENCE_TABLES = ("item", "history_surface", "history_event_type", "history_action", "history_age", "history_match")
TRAINING_MULTIPLIER = 3.0  # forward + backward (2x forward)

# The modules of the breakdown, in the order of the model.
MODULES = (
    "embeddings",  # lookups and sums: no matrix products
    "input_projections",  # candidate, dense and teacher-representation projections
    "sequence.summarize",  # interaction tokens -> K summary tokens per branch
    "sequence.projections",  # q/k/v and output projections of the jagged transformer layers
    "sequence.attention",  # jagged self attention (sum of L² per sequence)
    "sequence.ffn",
    "sequence.cls_out",
    "cross.projections",  # query, key/value and output projections of the candidate's cross attention
    "cross.attention",
    "wukong.fm",  # X·(Xᵀ·Y) of the Factorization Machine Block
    "wukong.fm_mlp",
    "wukong.lcb",  # Linear Compress Block and the residual mixing
    "trunk",
    "towers",
    "dlrm.dense",  # the baselines' (torchrec.models.dlrm): the dense arch's MLP,
    "dlrm.interaction",  # the pairwise dot products (DLRM) or the low-rank cross layers (DCN-v2),
    "dlrm.over",  # and the over arch's MLP
)


@dataclass
class FlopCount:
    """Forward FLOPs of one batch per module; `training` is forward + backward."""

    forward_by_module: dict[str, float] = field(default_factory=lambda: dict.fromkeys(MODULES, 0.0))
    samples: int = 0
    tokens: int = 0  # history tokens entering the first level, over all branches

    @property
    def forward(self) -> float:
        return float(sum(self.forward_by_module.values()))

    @property
    def training(self) -> float:
        return TRAINING_MULTIPLIER * self.forward

    def add(self, module: str, flops: float) -> None:
        self.forward_by_module[module] += float(flops)

    def __add__(self, other: FlopCount) -> FlopCount:
        merged = {k: self.forward_by_module.get(k, 0.0) + other.forward_by_module.get(k, 0.0)
                  for k in dict.fromkeys([*self.forward_by_module, *other.forward_by_module])}
        return FlopCount(merged, self.samples + other.samples, self.tokens + other.tokens)

    def to_dict(self) -> dict[str, float]:
        return {"forward": self.forward, "training": self.training, "samples": self.samples,
                "tokens": self.tokens, **{f"forward.{k}": v for k, v in self.forward_by_module.items()}}


def linear_flops(rows: float, in_features: int, out_features: int) -> float:
    return 2.0 * rows * in_features * out_features


def attention_pairs(q_lengths: np.ndarray, kv_lengths: np.ndarray | None = None, causal: bool = False) -> float:
    """Visible (query, key) pairs summed over sequences. Causal (aligned to the end, as the kernels do):
    query i of Lq sees keys j <= i + Lk - Lq, so a square sequence sees L(L+1)/2."""
    q = np.asarray(q_lengths, dtype=np.float64)
    k = q if kv_lengths is None else np.asarray(kv_lengths, dtype=np.float64)
    if not causal:
        return float((q * k).sum())
    # Query i (0-based) sees clip(i + 1 + Lk - Lq, 0, Lk) keys; summed in closed form.
    return float(np.where(k >= q, q * (k - q) + q * (q + 1) / 2, k * (k + 1) / 2).sum())


def attention_flops(q_lengths: np.ndarray, kv_lengths: np.ndarray | None, qk_width: int, v_width: int,
                    causal: bool = False) -> float:
    """Scores (2·D per pair) and weighted values (2·Dv per pair), all heads together (width = heads x dim)."""
    return 2.0 * attention_pairs(q_lengths, kv_lengths, causal) * (qk_width + v_width)


def branch_lengths(config: ModelConfig, spec: FeatureSpec, history_offsets: torch.Tensor,
                   history_action: torch.Tensor, history_event_type: torch.Tensor) -> dict[str, np.ndarray]:
    """Per branch, each example's history length after the branch's selection (as SequenceBranch.select)."""
    offsets = history_offsets.detach().cpu().numpy().astype(np.int64)
    lengths = np.diff(offsets)
    out = {}
    branches = config.sequence.branches if config.use_sequence else ()
    for name in branches:
        keep = branch_keep_mask(name, spec, history_action, history_event_type)
        if keep is None:
            out[name] = lengths
            continue
        counts = np.concatenate([[0], np.cumsum(keep.detach().cpu().numpy(), dtype=np.int64)])
        out[name] = counts[offsets[1:]] - counts[offsets[:-1]]
    return out


def gem_flops(config: ModelConfig, spec: FeatureSpec, lengths: Mapping[str, np.ndarray], batch_size: int,
              history_tokens: int = 0) -> FlopCount:
    """Forward FLOPs of GEMModel.loss on a batch whose branches have these per-example history lengths
    (`history_tokens`: the batch's history events before any branch selects, for shared tables' projections)."""
    count = FlopCount(samples=batch_size, tokens=int(sum(int(np.sum(v)) for v in lengths.values())))
    if config.architecture in ("dlrm", "dcn"):
        return dlrm_flops(config, spec, count)
    if config.architecture != "gem":
        return count  # the logistic regression: lookups and a tiny dense term
    B = float(batch_size)
    d, ds = config.embedding.dim, config.embedding.sequence_dim
    seq, wk = config.sequence, config.wukong
    rep = getattr(config, "teacher_representation_dim", 0)
    n_dense = len(spec.dense_features)

    count.add("input_projections", linear_flops(B, ds, d) + linear_flops(B, n_dense, d) + linear_flops(B, rep, d))
    for table, stored in config.embedding.table_widths:  # shared tables read through a projection
        pooled = table not in _SEQUENCE_TABLES and not table.startswith("history_")
        rows = B if pooled else history_tokens + (B if table == "item" else 0)
        count.add("input_projections", linear_flops(rows, stored, d if pooled else ds))
    n_pooled = 1 + len(spec.sparse_features) + 1  # user, sparse features, surface
    n = n_pooled + 1 + (1 if n_dense else 0) + (1 if rep else 0)
    n_out = wk.n_fm + wk.n_lcb
    branches = seq.branches if config.use_sequence else ()
    K = seq.summary_tokens
    extra = len(branches) * (K + CROSS_QUERIES)
    levels = {name: np.asarray(lengths[name], dtype=np.int64) for name in branches}

    for block in range(config.blocks):
        n_tokens = n if block == 0 else n_out
        for name in branches:
            L = levels[name]
            T = L + K  # summary tokens prepended
            tokens = float(T.sum())
            count.add("sequence.summarize", linear_flops(B, n_tokens * d, K * ds))
            count.add("sequence.projections", linear_flops(tokens, ds, 3 * ds) + linear_flops(tokens, ds, ds))
            count.add("sequence.attention", attention_flops(T, None, ds, ds))
            count.add("sequence.ffn", 2 * linear_flops(tokens, ds, seq.ffn_mult * ds))
            count.add("sequence.cls_out", linear_flops(B * K, ds, d))
            count.add("cross.projections", linear_flops(B * CROSS_QUERIES, d, ds)
                      + linear_flops(float(L.sum()), ds, 2 * ds)
                      + linear_flops(B * CROSS_QUERIES, ds, d))
            count.add("cross.attention", attention_flops(np.full_like(L, CROSS_QUERIES), L, ds, ds))
            levels[name] = np.minimum(L, seq.level_tokens(block))
        n_in = n_tokens + extra
        count.add("wukong.fm", 2 * 2.0 * B * n_in * d * wk.fm_rank)
        count.add("wukong.fm_mlp", linear_flops(B, n_in * wk.fm_rank, wk.mlp_hidden)
                  + linear_flops(B, wk.mlp_hidden, wk.n_fm * d))
        count.add("wukong.lcb", linear_flops(B * d, n_in, wk.n_lcb)
                  + (linear_flops(B * d, n_in, n_out) if n_in != n_out else 0.0))

    count.add("trunk", linear_flops(B, n_out * d, config.trunk_hidden))
    # Every example runs all (domain, task) towers and keeps its own domain's row: counted as run, the layers
    # after the first as the block-diagonal products they run as (heads.DomainTaskTowers). A distillation head
    # is a second set of towers.
    objectives = config.objectives(spec) if hasattr(config, "objectives") else spec.objectives
    towers = len(spec.surfaces) * len(objectives)
    sets = 2 if getattr(config, "distillation_weight", 0.0) > 0 else 1
    dims = [config.trunk_hidden] + [config.tower_hidden] * config.tower_layers + [1]
    count.add("towers", sets * (linear_flops(B, dims[0], towers * dims[1])
                                + sum(linear_flops(B, towers * a, towers * b) for a, b in zip(dims[1:-1], dims[2:]))))
    return count


def dlrm_flops(config: ModelConfig, spec: FeatureSpec, count: FlopCount) -> FlopCount:
    """gem_ops.model.baselines.TorchRecDLRM's forward: torchrec's DenseArch, InteractionArch (or
    InteractionDCNArch) and OverArch at the config's widths."""
    B, d, mlp, r = float(count.samples), config.embedding.dim, config.wukong.mlp_hidden, config.wukong.fm_rank
    features = 1 + len(spec.sparse_features) + 1 + 1  # user, sparse features, surface, candidate item
    tasks = len(config.objectives(spec))
    count.add("dlrm.dense", linear_flops(B, max(1, len(spec.dense_features)), mlp) + linear_flops(B, mlp, d))
    if config.architecture == "dcn":
        width = d * (features + 1)  # the dense arch's output and every embedding, concatenated
        count.add("dlrm.interaction", config.blocks * 2 * linear_flops(B, width, r))
        over_in = width
    else:
        count.add("dlrm.interaction", 2.0 * B * (features + 1) ** 2 * d)  # all pairs' dot products, one bmm
        over_in = d + features * (features + 1) // 2
    count.add("dlrm.over", linear_flops(B, over_in, mlp) + linear_flops(B, mlp, mlp)
              + linear_flops(B, mlp, len(spec.surfaces) * tasks))
    return count


def batch_flops(batch, spec: FeatureSpec, config: ModelConfig) -> FlopCount:
    """Forward FLOPs of a loader batch (SequenceBatch) or a ModelInput, from its actual lengths."""
    lengths = branch_lengths(config, spec, batch.history_offsets, batch.history_action, batch.history_event_type)
    return gem_flops(config, spec, lengths, int(batch.history_offsets.numel()) - 1, int(batch.history_offsets[-1]))
