"""Typed model configs and the named presets (GEM, domain foundation model, vertical model).

A preset is scaled from the config alone: `depth` multiplies the number of InterFormer blocks (and the
tower depth), `width` the embedding and hidden widths, e.g. `model_config("gem", width=2.0)`.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields, is_dataclass, replace
from typing import Any, Literal

from gem_ops.data.sequence_layout import retrieval_keys

Activation = Literal["softmax", "silu"]
Architecture = Literal["gem", "logistic_regression", "dlrm", "dcn"]


@dataclass(frozen=True)
class FeatureSpec:
    """What the data offers the model; read from a sequence_logs manifest (see from_logs)."""

    surfaces: tuple[str, ...]
    event_types: tuple[str, ...]
    objectives: tuple[str, ...]
    sparse_features: tuple[str, ...]
    dense_features: tuple[str, ...]
    # Item features every history event carries (its item's item_category, ...), a subset of sparse_features.
    history_item_features: tuple[str, ...] = ()

    @classmethod
    def from_logs(cls, logs: Any) -> FeatureSpec:
        return cls(*(tuple(getattr(logs, name, ())) for name in
                     ("surfaces", "event_types", "objectives", "sparse_features", "dense_features",
                      "history_item_features")))

    @property
    def n_actions(self) -> int:
        """Values of the per-event action bitmask (one bit per objective)."""
        return 1 << len(self.objectives)


@dataclass(frozen=True)
class EmbeddingConfig:
    dim: int = 64  # pooled (non-sequence) embeddings: one interaction token each
    sequence_dim: int = 64  # sequence tokens; the candidate item shares the history items' table
    item_buckets: int = 131_072  # item ids are hashed into this many rows
    user_buckets: int = 65_536
    sparse_buckets: int = 4_096  # each other sparse id feature
    age_buckets: int = 40  # log2 buckets of the time between an event and the request
    # Tables stored at another width than the model's (table name, width), each read through a learnt
    # projection to the model's width: a teacher's table shared with a narrower student.
    table_widths: tuple[tuple[str, int], ...] = ()

    def table_width(self, table: str, model_width: int) -> int:
        return dict((name, width) for name, width in self.table_widths).get(table, model_width)


@dataclass(frozen=True)
class WukongConfig:
    """One Wukong layer per InterFormer block: FM block (n_fm outputs) beside a Linear Compress Block (n_lcb)."""

    n_fm: int = 8
    n_lcb: int = 8
    fm_rank: int = 16  # k of the optimized FM: X·(Xᵀ·Y) with Y of shape [n, k]
    mlp_hidden: int = 256


@dataclass(frozen=True)
class SequenceConfig:
    """The pyramid: block b keeps the most recent level_tokens(b) history tokens after its layer."""

    max_history_len: int = 1024  # histories are cut to their most recent events first
    first_level_tokens: int = 256
    shrink: int = 4  # each level keeps 1/shrink of the previous one's tokens
    min_level_tokens: int = 8
    heads: int = 2
    ffn_mult: int = 2
    activation: Activation = "softmax"
    summary_tokens: int = 2  # non-sequence summary tokens prepended to each sequence (read back as CLS)
    branches: tuple[str, ...] = ("all", "engaged")
    """Parallel sequences: "all" events, "engaged" (events with a positive label), or "event_type:<name>"."""
    # Up to this many older events that match the candidate, from beyond the recent events, come before them
    # (SequenceLogs.retrieve_matches; a server's per-user index lookup): far history at the cost of a few
    # events, within max_history_len. Part of the model's inputs: trained, evaluated and served with them.
    retrieved_events: int = 0
    # What a retrieved event shares with the candidate: "item" (its own item), or an item feature the candidate
    # and the history events both carry (e.g. its category: the hard search of SIM), for logs where users
    # rarely meet one item twice.
    retrieval_key: str = "item"
    # Under ModelConfig.scaled: False keeps heads ∝ √width (the head dim shrinks too); True keeps the head dim and
    # scales the number of heads with width, as a GPU preset wants: head dims of 64 or 128 are the attention
    # kernels' and tensor cores' full-speed shapes, and the layers' widths stay multiples of them.
    keep_head_dim: bool = False
    # Biases of the sequence layers' linear maps (qkv, output, feed-forward, cross attention). Without them a step
    # skips their gradients' column sums over every history token (memory-bound: 1.06x the samples/s at gem_gpu's
    # width 0.5), but two seeds in five of the gem preset trained far worse without them after a 20-step warm-up
    # (with 100 steps all five trained as with them, but that warm-up costs GEM on MovieLens: benchmarks/README.md).
    bias: bool = True
    # With biases on, whether the maps into the attention keep theirs: the self attention's qkv and the cross
    # attention's kv (each right after a LayerNorm). Under softmax attention they add nothing the model lacks:
    # a key bias shifts a query's every score alike (softmax ignores it), a value bias passes through the
    # attention's weights, which sum to one, into the output map's own bias (the cross attention's: for every
    # non-empty history), and a query bias is the norm's shift through an invertible query map. False skips
    # their gradients' column sums over every history token (1.016x the samples/s at gem_gpu's width 0.5), but
    # the two seeds that trained far worse without any bias did so without these alone: what they change is the
    # optimiser's path, not what the model can compute.
    qkv_bias: bool = True

    def level_tokens(self, block: int) -> int:
        return max(self.min_level_tokens, self.first_level_tokens // self.shrink**block)


@dataclass(frozen=True)
class ModelConfig:
    # logistic_regression, dlrm, dcn: baselines on the same ids and dense features, without the history
    architecture: Architecture = "gem"
    embedding: EmbeddingConfig = field(default_factory=EmbeddingConfig)
    wukong: WukongConfig = field(default_factory=WukongConfig)
    sequence: SequenceConfig = field(default_factory=SequenceConfig)
    blocks: int = 3  # InterFormer blocks: each one sequence layer per branch + one Wukong layer
    trunk_hidden: int = 256
    tower_hidden: int = 64
    tower_layers: int = 1
    use_sequence: bool = True  # False: the non-sequence model alone (a baseline)
    # History tokens carry their items' features (FeatureSpec.history_item_features) where the data has them
    history_item_features: bool = True
    dropout: float = 0.0
    tasks: tuple[str, ...] = ()  # the objectives this model predicts, in order; empty: all the data's
    # Knowledge transfer (gem_ops.transfer): a teacher representation of this width enters as one more
    # interaction token; teacher targets are learned with this weight by an auxiliary head on the shared
    # trunk (the serving head keeps to the true labels) or by the serving head itself (soft targets).
    teacher_representation_dim: int = 0
    # Dropout on the looked-up representation while training: the student must not lean on it alone.
    teacher_representation_dropout: float = 0.2
    distillation_weight: float = 0.0
    distillation_head: Literal["auxiliary", "serving"] = "auxiliary"

    def __post_init__(self):
        if not 0 <= self.sequence.retrieved_events <= self.sequence.max_history_len:
            raise ValueError("ModelConfig sequence.retrieved_events must be within [0, sequence.max_history_len "
                             f"{self.sequence.max_history_len}], got {self.sequence.retrieved_events}")
        if self.distillation_head not in ("auxiliary", "serving"):
            raise ValueError("ModelConfig.distillation_head must be 'auxiliary' or 'serving', got "
                             f"{self.distillation_head!r}")
        if self.teacher_representation_dim < 0 or self.distillation_weight < 0:
            raise ValueError("ModelConfig: teacher_representation_dim and distillation_weight must be >= 0, got "
                             f"{self.teacher_representation_dim} and {self.distillation_weight}")

    def objectives(self, spec: FeatureSpec) -> tuple[str, ...]:
        """The objectives this model predicts: `tasks`, or all of the data's."""
        unknown = [t for t in self.tasks if t not in spec.objectives]
        if unknown:
            raise ValueError(f"ModelConfig.tasks {unknown} are not objectives of the data {spec.objectives}")
        return tuple(self.tasks) or spec.objectives

    def task_columns(self, spec: FeatureSpec) -> list[int]:
        """Columns of the data's label matrix that this model's tasks read."""
        return [spec.objectives.index(t) for t in self.objectives(spec)]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        return _from_dict(cls, data)

    def scaled(self, depth: float = 1.0, width: float = 1.0) -> ModelConfig:
        """The same architecture, deeper (more blocks, tower layers) and/or wider (dims, hidden sizes)."""
        if depth <= 0 or width <= 0:
            raise ValueError(f"depth and width must be > 0, got depth={depth}, width={width}")
        w = lambda n, multiple=8: max(multiple, int(round(n * width / multiple)) * multiple)  # noqa: E731
        if self.sequence.keep_head_dim:
            if self.embedding.sequence_dim % self.sequence.heads:
                raise ValueError(f"sequence.keep_head_dim needs embedding.sequence_dim ({self.embedding.sequence_dim}) "
                                 f"to be a multiple of sequence.heads ({self.sequence.heads})")
            heads = max(1, int(round(self.sequence.heads * width)))
            sequence_dim = heads * (self.embedding.sequence_dim // self.sequence.heads)
        else:
            heads = max(1, int(round(self.sequence.heads * math.sqrt(width))))
            sequence_dim = w(self.embedding.sequence_dim, 8 * heads)
        return replace(
            self,
            blocks=max(1, round(self.blocks * depth)),
            tower_layers=max(1, round(self.tower_layers * depth)),
            trunk_hidden=w(self.trunk_hidden),
            tower_hidden=w(self.tower_hidden),
            embedding=replace(self.embedding, dim=w(self.embedding.dim), sequence_dim=sequence_dim),
            wukong=replace(self.wukong, mlp_hidden=w(self.wukong.mlp_hidden)),
            sequence=replace(self.sequence, heads=heads),
        )


PRESETS: dict[str, ModelConfig] = {
    # The foundation model: long histories, several branches, deep interleaving; the interaction arm is
    # wider than the sequence arm, so the candidate's cross attention maps between two widths.
    "gem": ModelConfig(embedding=EmbeddingConfig(dim=96, sequence_dim=64)),
    # GEM sized for one H200 (benchmarks/mfu.py): wide sequence layers (2048, 16 heads of 128) over
    # histories of up to 1024 events with a slow pyramid (1024, 256, 64, 16 tokens), a wide Wukong arm.
    # The width puts most of a step in large matrix products, where FP8 pays; 1024 examples per step
    # fit the H200 without activation checkpointing. About 300 GFLOP per example for forward + backward
    # at the synthetic log's mean history (~340 events). Every large linear layer's widths are multiples
    # of 16, as FP8 (precision="fp8") needs; scaled, it keeps heads of 128 (width 0.5: 8 heads, 1024 wide).
    "gem_gpu": ModelConfig(
        embedding=EmbeddingConfig(dim=256, sequence_dim=2048, item_buckets=262_144, user_buckets=131_072),
        wukong=WukongConfig(n_fm=16, n_lcb=16, fm_rank=32, mlp_hidden=4096),
        sequence=SequenceConfig(max_history_len=1024, first_level_tokens=1024, heads=16, ffn_mult=4, summary_tokens=4,
                                keep_head_dim=True),
        blocks=4, trunk_hidden=1024, tower_hidden=256,
    ),
    # A domain foundation model: medium size, trained on one domain's data.
    "domain_fm": ModelConfig(
        embedding=EmbeddingConfig(dim=48, sequence_dim=48, item_buckets=65_536, user_buckets=32_768),
        wukong=WukongConfig(n_fm=6, n_lcb=6, fm_rank=12, mlp_hidden=192),
        sequence=SequenceConfig(max_history_len=512, first_level_tokens=128, branches=("all",)),
        blocks=2, trunk_hidden=192, tower_hidden=48,
    ),
    # A vertical (production) model: small, short history.
    "vertical": ModelConfig(
        embedding=EmbeddingConfig(dim=32, sequence_dim=32, item_buckets=32_768, user_buckets=16_384,
                                  sparse_buckets=1_024),
        wukong=WukongConfig(n_fm=4, n_lcb=4, fm_rank=8, mlp_hidden=128),
        sequence=SequenceConfig(max_history_len=64, first_level_tokens=32, heads=1, summary_tokens=1,
                                branches=("all",)),
        blocks=1, trunk_hidden=128, tower_hidden=32,
    ),
    # Baseline: logistic regression on the same hashed ids (no history, so histories are not loaded).
    "logistic_regression": ModelConfig(architecture="logistic_regression", use_sequence=False,
                                       sequence=SequenceConfig(max_history_len=1)),
    # TorchRec's DLRM and DLRM-DCN (DCN-v2 cross layers: `blocks` of them, rank fm_rank) on the same
    # ids and dense features, 64-wide tables and 512-wide MLPs (mlp_hidden); no history.
    "dlrm": ModelConfig(architecture="dlrm", use_sequence=False, embedding=EmbeddingConfig(dim=64),
                        wukong=WukongConfig(mlp_hidden=512), sequence=SequenceConfig(max_history_len=1)),
    "dcn": ModelConfig(architecture="dcn", use_sequence=False, embedding=EmbeddingConfig(dim=64),
                       wukong=WukongConfig(fm_rank=64, mlp_hidden=512), sequence=SequenceConfig(max_history_len=1),
                       blocks=3),
}


def check_retrieval_key(config: ModelConfig, spec: FeatureSpec) -> None:
    key, offered = config.sequence.retrieval_key, retrieval_keys(spec.history_item_features, spec.sparse_features)
    if config.sequence.retrieved_events and key not in offered:
        raise ValueError(f"ModelConfig sequence.retrieval_key {key!r} is neither 'item' nor an item feature of the "
                         f"candidates and their history events; this data offers {list(offered)}")


def model_config(preset: str = "gem", depth: float = 1.0, width: float = 1.0, **overrides: Any) -> ModelConfig:
    """A named preset, scaled, with top-level or dotted overrides ("sequence.max_history_len": 64)."""
    if preset not in PRESETS:
        raise ValueError(f"unknown model preset {preset!r}; presets: {sorted(PRESETS)}")
    config = PRESETS[preset].scaled(depth, width) if (depth, width) != (1.0, 1.0) else PRESETS[preset]
    data = config.to_dict()
    for key, value in overrides.items():
        node, *path = key.replace("__", ".").split(".")
        target = data
        for part in [node, *path][:-1]:
            if part not in target or not isinstance(target[part], dict):
                raise ValueError(f"unknown model setting {key!r}")
            target = target[part]
        if ([node, *path][-1]) not in target:
            raise ValueError(f"unknown model setting {key!r}")
        target[[node, *path][-1]] = value
    return ModelConfig.from_dict(data)


def _from_dict(cls: type, data: dict[str, Any]):
    known = {f.name: f for f in fields(cls)}
    unknown = set(data) - set(known)
    if unknown:
        raise ValueError(f"unknown {cls.__name__} settings: {sorted(unknown)}")
    values = {}
    for name, value in data.items():
        default = known[name].default_factory() if callable(known[name].default_factory) else known[name].default
        if is_dataclass(default) and isinstance(value, dict):
            value = _from_dict(type(default), value)
        elif isinstance(value, list):
            value = _as_tuples(value)
        values[name] = value
    return cls(**values)


def _as_tuples(value: Any) -> Any:
    """JSON's lists back to the tuples they were saved from, nested ones too (table_widths' pairs)."""
    return tuple(_as_tuples(v) for v in value) if isinstance(value, list) else value
