"""TorchRec embedding tables: pooled non-sequence ids (EmbeddingBagCollection) and sequence tokens
(EmbeddingCollection), the candidate item sharing the history items' table."""

from __future__ import annotations

import logging

import torch
from torch import nn
from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from gem_ops.model import features as F
from gem_ops.model.config import FeatureSpec, ModelConfig
from gem_ops.model.features import ModelInput

# TorchRec's collections ask torch whether they are being traced, and torch answers the first time with a
# deprecation notice in every training log.
logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)

ITEM_TABLE = "item"


def pooled_tables(spec: FeatureSpec, config: ModelConfig) -> list[EmbeddingBagConfig]:
    emb = config.embedding
    rows = {F.USER_ID: emb.user_buckets, F.SURFACE: len(spec.surfaces)}
    rows.update({name: emb.sparse_buckets for name in spec.sparse_features})
    return [
        EmbeddingBagConfig(name=key, embedding_dim=emb.table_width(key, emb.dim), num_embeddings=rows[key],
                           feature_names=[key], pooling=PoolingType.SUM)
        for key in F.pooled_keys(spec)
    ]


def sequence_tables(spec: FeatureSpec, config: ModelConfig) -> list[EmbeddingConfig]:
    emb = config.embedding
    tables = {
        ITEM_TABLE: (emb.item_buckets, [F.CANDIDATE_ITEM, F.HISTORY_ITEM]),
        F.HISTORY_SURFACE: (len(spec.surfaces), [F.HISTORY_SURFACE]),
        F.HISTORY_EVENT_TYPE: (len(spec.event_types), [F.HISTORY_EVENT_TYPE]),
        F.HISTORY_ACTION: (spec.n_actions, [F.HISTORY_ACTION]),
        F.HISTORY_AGE: (emb.age_buckets, [F.HISTORY_AGE]),
        F.HISTORY_MATCH: (2, [F.HISTORY_MATCH]),
    }
    for feature in F.history_features(spec, config):
        tables[f"history_{feature}"] = (emb.sparse_buckets, [f"history_{feature}"])
        tables[f"history_{feature}_match"] = (2, [f"history_{feature}_match"])
    return [EmbeddingConfig(name=name, embedding_dim=emb.table_width(name, emb.sequence_dim), num_embeddings=rows,
                            feature_names=keys) for name, (rows, keys) in tables.items()]


def table_projections(tables, model_width: int, device) -> dict[str, nn.Linear]:
    """A learnt linear map to the model's width for every table stored at another width."""
    return {t.name: nn.Linear(t.embedding_dim, model_width, bias=False, device=device)
            for t in tables if t.embedding_dim != model_width}


class GEMEmbeddings(nn.Module):
    """Looks up every id: returns pooled tokens [B, n_pooled, d], the candidate [B, ds], history tokens [N, ds]."""

    def __init__(self, spec: FeatureSpec, config: ModelConfig, device: torch.device | None = None):
        super().__init__()
        pooled, sequence = pooled_tables(spec, config), sequence_tables(spec, config)
        ds = config.embedding.sequence_dim
        self.pooled = EmbeddingBagCollection(tables=pooled, device=device)
        self.sequence = EmbeddingCollection(tables=[t for t in sequence if t.embedding_dim == ds], device=device)
        # A TorchRec EmbeddingCollection holds tables of one width: shared tables of other widths get
        # collections of their own (none but in a student sharing a teacher's tables).
        widths = sorted({t.embedding_dim for t in sequence} - {ds})
        self.sequence_other = nn.ModuleDict({str(w): EmbeddingCollection(
            tables=[t for t in sequence if t.embedding_dim == w], device=device) for w in widths})
        self.sequence_keys = [k for t in sequence if t.embedding_dim == ds for k in t.feature_names]
        # Tables shared from a wider (or narrower) teacher reach the model's width through these.
        self.projections = nn.ModuleDict({**table_projections(pooled, config.embedding.dim, device),
                                          **table_projections(sequence, config.embedding.sequence_dim, device)})
        self.table_of = {key: t.name for t in [*pooled, *sequence] for key in t.feature_names}
        self.pooled_keys = F.pooled_keys(spec)
        self.history_keys = F.sequence_keys(spec, config)[1:]  # all but the candidate
        self.n_pooled = len(self.pooled_keys)
        self.dim = config.embedding.dim
        self.history_norm = nn.LayerNorm(config.embedding.sequence_dim, device=device)

    def forward(self, x: ModelInput) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # By key, not by position: a sharded collection returns its tables grouped by rank.
        by_key = self.pooled(x.pooled).to_dict()
        pooled = torch.stack([self._at_width(key, by_key[key]) for key in self.pooled_keys], dim=1)
        seq = self._sequence_lookups(x.sequence)
        candidate = self._at_width(F.CANDIDATE_ITEM, seq[F.CANDIDATE_ITEM].values())
        return pooled, candidate, self.history_tokens(*(self._at_width(key, seq[key].values()) for key in self.history_keys))

    def history_tokens(self, *parts: torch.Tensor) -> torch.Tensor:
        """[N, ds]: each event's item and context embeddings summed and normed, in the autocast dtype under
        autocast (what the sequence layers read). Compiled with the step (acceleration.compile_model_step), the
        sum, the norm and the cast are one kernel and the parts' gradient is one tensor, not an eager add per part."""
        history = self.history_norm(sum(parts))
        if torch.is_autocast_enabled(history.device.type):
            history = history.to(torch.get_autocast_dtype(history.device.type))
        return history

    def _sequence_lookups(self, ids: KeyedJaggedTensor) -> dict:
        if not self.sequence_other:
            return self.sequence(ids)
        by_key = ids.to_dict()
        out = self.sequence(KeyedJaggedTensor.from_jt_dict({k: by_key[k] for k in self.sequence_keys}))
        for collection in self.sequence_other.values():
            keys = [k for config in collection.embedding_configs() for k in config.feature_names]
            out.update(collection(KeyedJaggedTensor.from_jt_dict({k: by_key[k] for k in keys})))
        return out

    def _at_width(self, key: str, values: torch.Tensor) -> torch.Tensor:
        table = self.table_of[key]
        return self.projections[table](values) if table in self.projections else values
