"""TorchRec embedding tables: pooled non-sequence ids (EmbeddingBagCollection) and sequence tokens
(EmbeddingCollection), the candidate item sharing the history items' table."""

from __future__ import annotations

import logging

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from gem_ops.model import features as F
from gem_ops.model.config import FeatureSpec, ModelConfig
from gem_ops.model.features import ModelInput
from kernels.table_gradient import table_gradient

# TorchRec's collections ask torch whether they are being traced, and torch answers the first time with a
# deprecation notice in every training log.
logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)

ITEM_TABLE = "item"
# History tables of at most this many rows (surface, event type, action, age, the match flags) are looked up
# together, as one stacked table (summed_rows).
CONTEXT_TABLE_MAX_ROWS = 256


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
        context = {t.name for t in sequence if t.embedding_dim == ds and t.num_embeddings <= CONTEXT_TABLE_MAX_ROWS}
        self.context_keys = [k for k in self.history_keys if self.table_of[k] in context]
        self.n_pooled = len(self.pooled_keys)
        self.dim = config.embedding.dim
        self.history_norm = nn.LayerNorm(config.embedding.sequence_dim, device=device)

    def forward(self, x: ModelInput) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # By key, not by position: a sharded collection returns its tables grouped by rank.
        by_key = self.pooled(x.pooled).to_dict()
        pooled = torch.stack([self._at_width(key, by_key[key]) for key in self.pooled_keys], dim=1)
        context = self._context_tables()
        ids = {k: jt.values() for k, jt in x.sequence.to_dict().items()} if context else None
        # Bucketed sizes (x.padded): history ids padded with row 0 up to the events' capacity, so that the lookups
        # give the capacity's rows (rows past the last example's, whose gradient is zero) without a copy.
        capacity = x.history_action.shape[0] if x.padded else None
        if ids is not None and capacity is not None:
            ids = {k: v if k == F.CANDIDATE_ITEM else nn.functional.pad(v, (0, capacity - v.shape[0]))
                   for k, v in ids.items()}
        seq = self._sequence_lookups(x.sequence, ids, looked_up_here=bool(context))
        candidate = self._at_width(F.CANDIDATE_ITEM, seq[F.CANDIDATE_ITEM])
        parts = [self._at_width(key, seq[key]) for key in self.history_keys if key in seq]
        if capacity is not None:  # parts looked up through the collections: padded after (a copy each)
            parts = [nn.functional.pad(p, (0, 0, 0, capacity - p.shape[0])) if p.shape[0] < capacity else p
                     for p in parts]
        if not context:
            return pooled, candidate, self.history_tokens(*parts)
        return pooled, candidate, self.history_tokens(*parts, context_ids=[ids[k] for k in self.context_keys],
                                                      context_tables=context)

    def history_tokens(self, *parts: torch.Tensor, context_ids: list[torch.Tensor] | None = None,
                       context_tables: list[torch.Tensor] | None = None) -> torch.Tensor:
        """[N, ds]: each event's item and context embeddings summed and normed, in the autocast dtype under
        autocast (what the sequence layers read). Compiled with the step (acceleration.compile_model_step), the
        context tables' lookups, the sum, the norm and the cast are one kernel and the parts' gradient is one
        tensor, not an eager add per part."""
        total = sum(parts)
        if context_ids:
            total = total + summed_rows(context_ids, context_tables)
        history = self.history_norm(total)
        if torch.is_autocast_enabled(history.device.type):
            history = history.to(torch.get_autocast_dtype(history.device.type))
        return history

    def _context_tables(self) -> list[torch.Tensor] | None:
        """The context tables' weights (context_keys) where this module may read them itself: not where TorchRec or
        FSDP2 shards them (their own forward gathers them) nor where their gradients are sparse."""
        if not self.context_keys or type(self.sequence) is not EmbeddingCollection:
            return None
        modules = [self.sequence.embeddings[self.table_of[k]] for k in self.context_keys]
        if any(m.sparse or isinstance(m.weight, DTensor) for m in modules):
            return None
        return [m.weight for m in modules]

    def _sequence_lookups(self, kjt: KeyedJaggedTensor, ids: dict | None = None, looked_up_here: bool = False
                          ) -> dict[str, torch.Tensor]:
        """Key -> its embeddings [n, width]: all keys through the TorchRec collections, or (looked_up_here) the main
        collection's tables read directly from `ids` (key -> id tensor), the context tables' keys left out
        (history_tokens sums those)."""
        if not self.sequence_other and not looked_up_here:
            return {key: jt.values() for key, jt in self.sequence(kjt).items()}
        # KeyedJaggedTensor.to_dict costs host time: only where ids were not given or a collection reads the KJT.
        by_key = None if looked_up_here and ids is not None and not self.sequence_other else kjt.to_dict()
        if looked_up_here:
            ids = {k: jt.values() for k, jt in by_key.items()} if ids is None else ids
            out = self._lookups_by_table([key for key in self.sequence_keys if key not in self.context_keys], ids)
        else:
            out = self._collection_lookups(self.sequence, by_key)
        for collection in self.sequence_other.values():
            out.update(self._collection_lookups(collection, by_key))
        return out

    def _lookups_by_table(self, keys: list[str], ids: dict) -> dict[str, torch.Tensor]:
        """Key -> its rows from the main collection's tables. Each table's gradient is one kernels.table_gradient
        over all of its keys (the candidate and the history items share one): one table-sized buffer, not one per
        key and then an add of them (tests/test_model_blocks.py reads the graph)."""
        by_table: dict[str, list[str]] = {}
        for key in keys:
            by_table.setdefault(self.table_of[key], []).append(key)
        out = {}
        for table, names in by_table.items():
            rows = _TableRows.apply(self.sequence.embeddings[table].weight, *(ids[key] for key in names))
            out.update(zip(names, rows))
        return out

    @staticmethod
    def _collection_lookups(collection: EmbeddingCollection, ids: dict) -> dict[str, torch.Tensor]:
        keys = [k for config in collection.embedding_configs() for k in config.feature_names]
        return {key: jt.values()
                for key, jt in collection(KeyedJaggedTensor.from_jt_dict({k: ids[k] for k in keys})).items()}

    def _at_width(self, key: str, values: torch.Tensor) -> torch.Tensor:
        table = self.table_of[key]
        return self.projections[table](values) if table in self.projections else values


class _TableRows(torch.autograd.Function):
    """table[ids] for one or more id tensors of one table. The backward is one kernels.table_gradient over all of
    them: a deterministic sum of each row's gradients, with no copy of the parts' gradients into one tensor first."""

    @staticmethod
    def forward(ctx, table: torch.Tensor, *ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.save_for_backward(*ids)
        ctx.rows, ctx.dtype = table.shape[0], table.dtype
        return tuple(nn.functional.embedding(i, table) for i in ids)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None):
        ids = ctx.saved_tensors
        parts = [k for k, g in enumerate(grads) if g is not None]
        if not parts:
            return None, *(None for _ in ids)
        table_grad = table_gradient([grads[k] for k in parts], [ids[k] for k in parts], ctx.rows)
        return table_grad.to(ctx.dtype), *(None for _ in ids)


class _SummedRows(torch.autograd.Function):
    """Σ_j table[ids[:, j]] over a table of few rows. The backward is one product of each event's row counts with
    the [N, d] gradient: one read of it, where an embedding backward per table reads all of it each time and
    scattered adds into a few rows contend."""

    @staticmethod
    def forward(ctx, ids: torch.Tensor, table: torch.Tensor, product_dtype: torch.dtype) -> torch.Tensor:
        ctx.save_for_backward(ids)
        ctx.rows, ctx.dtype, ctx.product_dtype = table.shape[0], table.dtype, product_dtype
        return sum(table[ids[:, j]] for j in range(ids.shape[1]))  # no [N, k, d] gather left eager

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (ids,) = ctx.saved_tensors
        dtype, rows = ctx.product_dtype, ctx.rows
        if dtype != grad.dtype:
            # As a linear layer's weight gradient under autocast: a tensor-core product, where fp32 over ~100 rows ran
            # as a SIMT sgemm; rows padded to a multiple of 8, the 16-byte alignment those kernels read.
            rows = -(-rows // 8) * 8
        with torch.autocast(grad.device.type, enabled=False):
            counts = grad.new_zeros(ids.shape[0], rows, dtype=dtype).scatter_add_(1, ids, grad.new_ones(ids.shape,
                                                                                                      dtype=dtype))
            return None, (counts.t() @ grad.to(dtype))[:ctx.rows].to(ctx.dtype), None


def summed_rows(ids: list[torch.Tensor], tables: list[torch.Tensor]) -> torch.Tensor:
    """[N, d]: Σ_j tables[j][ids[j]], the tables stacked as one (their gradients are its rows; the product that
    gives them runs in the autocast dtype under autocast)."""
    first_rows = [0]
    for table in tables[:-1]:
        first_rows.append(first_rows[-1] + table.shape[0])
    stacked = torch.stack([i + first for i, first in zip(ids, first_rows)], dim=1)
    device = stacked.device.type
    product_dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else tables[0].dtype
    return _SummedRows.apply(stacked, torch.cat(tables), product_dtype)
