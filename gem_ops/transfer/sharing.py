"""Parameter sharing: a student starts from its teacher's embedding tables (optionally frozen). A shared
table has the teacher's shape (rows and width); the student keeps its own widths, and reads a table of
another width through a learnt projection (EmbeddingConfig.table_widths) while it trains. Once trained,
fold_projections stores each such table at the student's width (the projection has no bias, so this is
exact): the student serves at its own size."""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from gem_ops.model import build_model
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
    """The student's config with each shared table stored like the teacher's (its rows and width); the
    student keeps its own widths, and a table at another width reaches them through a learnt projection."""
    emb = student.embedding
    widths = dict(emb.table_widths)
    for table in tables:
        rows, width_field = _shape_fields(table)[:-1], _shape_fields(table)[-1]
        emb = replace(emb, **{name: getattr(teacher.embedding, name) for name in rows})
        theirs = teacher.embedding.table_width(table, getattr(teacher.embedding, width_field))
        if theirs != getattr(student.embedding, width_field):
            widths[table] = theirs
    return replace(student, embedding=replace(emb, table_widths=tuple(sorted(widths.items()))))


def embedding_tables(model: nn.Module) -> dict[str, nn.Parameter]:
    """Table name -> weight, for the pooled and the sequence collections."""
    emb = model.embeddings
    tables = {name: bag.weight for name, bag in emb.pooled.embedding_bags.items()}
    for collection in (emb.sequence, *emb.sequence_other.values()):
        tables.update({name: e.weight for name, e in collection.embeddings.items()})
    return tables


def share_tables(student: nn.Module, teacher: nn.Module, tables: tuple[str, ...], freeze: bool = False) -> list[str]:
    """Copies the named tables from teacher to student (freezing them if asked), and starts the projection of
    a table stored at another width than the student's at the table's principal directions; returns the names."""
    theirs, ours = embedding_tables(teacher), embedding_tables(student)
    for table in tables:
        if table not in theirs or table not in ours:
            raise ValueError(f"cannot share embedding table {table!r}: teacher has {sorted(theirs)}, "
                             f"student {sorted(ours)}")
        if theirs[table].shape != ours[table].shape:
            raise ValueError(f"cannot share embedding table {table!r}: teacher shape {tuple(theirs[table].shape)}, "
                             f"student {tuple(ours[table].shape)} (build the student with sharing_config)")
        ours[table].data.copy_(theirs[table].data)
        ours[table].requires_grad_(not freeze)
        projection = student.embeddings.projections[table] if table in student.embeddings.projections else None
        if projection is not None:
            principal_projection(theirs[table].detach(), projection)
    return list(tables)


@torch.no_grad()
def principal_projection(table: torch.Tensor, projection: nn.Linear) -> None:
    """The projection's rows set to the table's top principal directions (as many as the student's width;
    random orthonormal rows where the student is wider): at the start it keeps what varies most."""
    width = projection.out_features
    centred = table.float() - table.float().mean(0)
    _, _, directions = torch.linalg.svd(centred, full_matrices=False)  # [min(rows, d), d]
    weight = torch.empty(width, table.shape[1])
    torch.nn.init.orthogonal_(weight)
    k = min(width, directions.shape[0])
    weight[:k] = directions[:k]
    projection.weight.copy_(weight.to(projection.weight))


@torch.no_grad()
def fold_projections(model: nn.Module) -> nn.Module:
    """The same model with every projected table stored at the model's width (rows @ projection^T) and no
    projections: equal outputs, the student's own size. Returns `model` itself when it has none."""
    projections = model.embeddings.projections
    if len(projections) == 0:
        return model
    emb = model.config.embedding
    config = replace(model.config, embedding=replace(emb, table_widths=tuple(
        (name, width) for name, width in emb.table_widths if name not in projections)))
    weights = embedding_tables(model)
    folded = build_model(model.spec, config, next(model.parameters()).device)
    key_of = lambda m: {id(p): name for name, p in m.named_parameters()}  # noqa: E731
    theirs, ours = key_of(model), key_of(folded)
    moved = {theirs[id(weights[table])] for table in projections}  # a table's key names its collection
    state = {k: v for k, v in model.state_dict().items()
             if k not in moved and not k.startswith("embeddings.projections.")}
    new_tables = embedding_tables(folded)
    for table, projection in projections.items():
        state[ours[id(new_tables[table])]] = projection(weights[table].float()).to(weights[table].dtype)
    folded.load_state_dict(state)
    return folded
