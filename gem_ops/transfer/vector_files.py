"""Parquet files of per-row vectors with a JSON header in the file's metadata (teacher predictions, user
representations): written aside then renamed, read back with a clear error for a missing or foreign file."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from gem_ops.data.atomic import atomic_path


def vector_column(vectors: np.ndarray) -> pa.Array:
    """[N, H] float16 as a fixed-size list column."""
    n, h = vectors.shape
    if not n:
        return pa.array([], pa.list_(pa.float16(), h))
    return pa.FixedSizeListArray.from_arrays(pa.array(np.ascontiguousarray(vectors).reshape(-1), pa.float16()), h)


def column_vectors(column: pa.ChunkedArray, rows: int) -> np.ndarray:
    """The [rows, H] float16 array of a fixed-size list column (writable, for torch)."""
    array = column.combine_chunks()
    values = array.values.to_numpy(zero_copy_only=False) if len(array) else np.zeros(0, np.float16)
    return values.reshape(rows, array.type.list_size).copy()


def write_vector_file(columns: dict[str, pa.Array], key: bytes, header: dict[str, Any],
                      destination: str | os.PathLike) -> Path:
    table = pa.table(columns).replace_schema_metadata({key: json.dumps(header).encode()})
    with atomic_path(destination) as tmp:
        pq.write_table(table, tmp)
    return Path(destination)


def read_vector_file(path: str | os.PathLike, key: bytes, what: str) -> tuple[pa.Table, dict[str, Any]]:
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{what} {path} do not exist: materialize teacher_predictions first")
    table = pq.read_table(path)
    raw = (table.schema.metadata or {}).get(key)
    if raw is None:
        raise ValueError(f"{path}: not a {what} file (no {key.decode()} metadata)")
    return table, json.loads(raw)
