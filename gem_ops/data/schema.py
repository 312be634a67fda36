"""The event-log schema: one row per event, as every source (synthetic, MovieLens, user Parquet) writes it.

Required columns
    user_id     Int64, no nulls
    timestamp   Datetime (any unit / time zone, stored as UTC milliseconds) or an ISO-8601 string
    item_id     Int64, no nulls
    surface     String, no nulls: the domain the event happened on ("feed", "reels", ...)
    event_type  String, no nulls: what the event is ("ad_impression", "organic_view", ...)
    label_<objective>   at least one; integer 0/1, null where the objective has no label

Optional feature columns
    user_<name> / item_<name>   integer = a sparse id feature, float = a dense feature

Events whose labels are all null are history only: they join timelines but are never training examples.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import polars as pl

TIMESTAMP_DTYPE = pl.Datetime("ms", "UTC")

ID_COLUMNS = ("user_id", "item_id")
CATEGORY_COLUMNS = ("surface", "event_type")
REQUIRED_COLUMNS = ("user_id", "timestamp", "item_id", "surface", "event_type")
LABEL_PREFIX = "label_"
SORTED_BY_KEY = "gem.sorted_by"
"""Parquet key-value metadata naming the sort order a writer guarantees ("user_id,timestamp")."""
USER_TIME_ORDER = "user_id,timestamp"
FEATURE_PREFIXES = ("user_", "item_")
# Names that reach file paths, metric keys and registered model names (surfaces, event types, objectives,
# features): letters, digits, '_', '.', '-', starting with a letter or digit, at most 64 characters.
SAFE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
# "all" names the figures over every surface ("all/click"): no surface may take it.
RESERVED_SURFACES = ("all",)


def check_names(source: str, column: str, names, what: str) -> None:
    """Every name must be SAFE_NAME; the error names the file, the column and the offending values."""
    bad = sorted({str(n) for n in names if not SAFE_NAME.fullmatch(str(n))})
    if bad:
        raise EventLogError(source, column, f"{what} {bad[:5]} are not safe names: use letters, digits, '_', '.' "
                                            "or '-', starting with a letter or digit, at most 64 characters")


class EventLogError(ValueError):
    """Bad event-log input. The message names the file and the column at fault."""

    def __init__(self, source: str, column: str | None, problem: str):
        self.source, self.column, self.problem = source, column, problem
        where = f"{source}, column '{column}'" if column else source
        super().__init__(f"{where}: {problem}")


@dataclass(frozen=True)
class EventLogColumns:
    """The column roles found in one event log."""

    labels: tuple[str, ...]
    sparse_features: tuple[str, ...]
    dense_features: tuple[str, ...]

    @property
    def objectives(self) -> tuple[str, ...]:
        return tuple(c.removeprefix(LABEL_PREFIX) for c in self.labels)

    @property
    def all(self) -> tuple[str, ...]:
        return REQUIRED_COLUMNS + self.labels + self.sparse_features + self.dense_features


def classify_columns(schema: pl.Schema, source: str) -> EventLogColumns:
    """Sorts columns into labels and features, checking their dtypes."""
    labels, sparse, dense = [], [], []
    for name, dtype in schema.items():
        if name in REQUIRED_COLUMNS:
            continue
        if name.startswith(LABEL_PREFIX):
            if not (dtype.is_integer() or dtype == pl.Boolean):
                raise EventLogError(source, name, f"labels must be integer 0/1 or boolean, found {dtype}")
            labels.append(name)
        elif name.startswith(FEATURE_PREFIXES):
            if dtype.is_integer():
                sparse.append(name)
            elif dtype.is_float():
                dense.append(name)
            else:
                raise EventLogError(
                    source, name, f"features must be integer (sparse id) or float (dense), found {dtype}"
                )
    if not labels:
        raise EventLogError(source, None, f"no label column: name at least one '{LABEL_PREFIX}<objective>'")
    for name in (*labels, *sparse, *dense):
        check_names(source, name, [name], "column names")
    return EventLogColumns(tuple(labels), tuple(sparse), tuple(dense))


def check_required_dtypes(schema: pl.Schema, source: str) -> None:
    for name in REQUIRED_COLUMNS:
        if name not in schema:
            raise EventLogError(source, name, f"missing required column (have: {', '.join(schema.names())})")
    for name in ID_COLUMNS:
        if not schema[name].is_integer():
            raise EventLogError(source, name, f"ids must be integers, found {schema[name]}")
    for name in CATEGORY_COLUMNS:
        if schema[name] not in (pl.String, pl.Categorical) and not isinstance(schema[name], pl.Enum):
            raise EventLogError(source, name, f"must be a string, found {schema[name]}")
    ts = schema["timestamp"]
    if not (isinstance(ts, pl.Datetime) or ts == pl.String or ts == pl.Date):
        raise EventLogError(source, "timestamp", f"must be a datetime or an ISO-8601 string, found {ts}")
