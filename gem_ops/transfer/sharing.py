"""Parameter sharing: a student starts from its teacher's embedding tables (optionally frozen). A shared
table must have the teacher's shape, so the student's config takes the teacher's rows and width for it."""

from __future__ import annotations

from dataclasses import replace

from torch import nn

from gem_ops.model import features as F
from gem_ops.model.config import ModelConfig
from gem_ops.model.embeddings import ITEM_TABLE

# Table -> the EmbeddingConfig fields that set its shape. Sequence tables share one width (TorchRec's
# EmbeddingCollection), pooled ones another.
_SEQUENCE_WIDTH = ("sequence_dim",)
_POOLED_WIDTH = ("dim",)
SHAPE_FIELDS: dict[str, tuple[str, ...]] = {
    ITEM_TABLE: ("item_buckets", *_SEQUENCE_WIDTH),
    F.HISTORY_SURFACE: _SEQUENCE_WIDTH, F.HISTORY_EVENT_TYPE: _SEQUENCE_WIDTH, F.HISTORY_ACTION: _SEQUENCE_WIDTH,
    F.HISTORY_AGE: ("age_buckets", *_SEQUENCE_WIDTH), F.HISTORY_MATCH: _SEQUENCE_WIDTH,
    F.USER_ID: ("user_buckets", *_POOLED_WIDTH), F.SURFACE: _POOLED_WIDTH,
}


def _shape_fields(table: str) -> tuple[str, ...]:
    if table in SHAPE_FIELDS:
        return SHAPE_FIELDS[table]
    if table.startswith("history_"):  # a history item feature's (sparse_buckets rows) or its match flag's
        return _SEQUENCE_WIDTH if table.endswith("_match") else ("sparse_buckets", *_SEQUENCE_WIDTH)
    return ("sparse_buckets", *_POOLED_WIDTH)  # any other pooled table is a sparse feature's


def sharing_config(student: ModelConfig, teacher: ModelConfig, tables: tuple[str, ...]) -> ModelConfig:
    """The student's config with each shared table shaped like the teacher's."""
    emb = student.embedding
    for table in tables:
        emb = replace(emb, **{name: getattr(teacher.embedding, name) for name in _shape_fields(table)})
    heads = student.sequence.heads
    if emb.sequence_dim % heads:
        raise ValueError(f"sharing {tables} gives the student sequence_dim {emb.sequence_dim}, "
                         f"not a multiple of its {heads} attention heads")
    return replace(student, embedding=emb)


def embedding_tables(model: nn.Module) -> dict[str, nn.Parameter]:
    """Table name -> weight, for the pooled and the sequence collections."""
    emb = model.embeddings
    tables = {name: bag.weight for name, bag in emb.pooled.embedding_bags.items()}
    tables.update({name: e.weight for name, e in emb.sequence.embeddings.items()})
    return tables


def share_tables(student: nn.Module, teacher: nn.Module, tables: tuple[str, ...], freeze: bool = False) -> list[str]:
    """Copies the named tables from teacher to student (freezing them if asked); returns the names."""
    theirs, ours = embedding_tables(teacher), embedding_tables(student)
    for table in tables:
        if table not in theirs or table not in ours:
            raise ValueError(f"cannot share embedding table {table!r}: teacher has {sorted(theirs)}, student {sorted(ours)}")
        if theirs[table].shape != ours[table].shape:
            raise ValueError(f"cannot share embedding table {table!r}: teacher shape {tuple(theirs[table].shape)}, "
                             f"student {tuple(ours[table].shape)} (build the student with sharing_config)")
        ours[table].data.copy_(theirs[table].data)
        ours[table].requires_grad_(not freeze)
    return list(tables)
