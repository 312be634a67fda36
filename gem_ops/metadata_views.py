"""Figures as a person reads them on a run page: tables and inline images as plain values, which the assets
hand to Dagster (and the training job sends through Pipes) in place of JSON blobs."""

from __future__ import annotations

import base64
import io
import math
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Markdown:
    text: str


@dataclass(frozen=True)
class Table:
    columns: tuple[tuple[str, str], ...]  # (name, type); types as Dagster's table schema names them
    records: tuple[dict[str, Any], ...]


def figure_markdown(figure, alt: str, dpi: int = 72) -> Markdown:
    """The figure as a markdown image with its PNG inline (a few tens of kB at this resolution); closes it."""
    import matplotlib.pyplot as plt

    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=dpi, bbox_inches="tight")
    plt.close(figure)
    return Markdown(f"![{alt}](data:image/png;base64,{base64.b64encode(buffer.getvalue()).decode()})")


def _number(value: Any) -> float | None:
    """An undefined figure (NaN) shows as an empty cell."""
    value = float(value)
    return value if math.isfinite(value) else None


def quality_table(report: dict[str, dict[str, float]]) -> Table:
    """One row per (domain or all)/objective of an eval report: AUC, NE, calibration and its standard error
    (the labels' draw), examples and positives."""
    records = tuple(
        {"group": group, "auc": _number(f["auc"]), "ne": _number(f["ne"]), "calibration": _number(f["calibration"]),
         "calibration_stderr": _number(f.get("calibration_stderr", math.nan)),
         "examples": int(f.get("count", 0)), "positives": int(f.get("positives", 0))}
        for group, f in sorted(report.items()) if isinstance(f, dict) and "auc" in f)
    columns = (("group", "string"), ("auc", "float"), ("ne", "float"), ("calibration", "float"),
               ("calibration_stderr", "float"), ("examples", "int"), ("positives", "int"))
    return Table(columns, records)


def models_quality_table(reports: dict[str, dict[str, dict[str, float]]]) -> Table:
    """quality_table's rows for several models at once, each row led by its model."""
    base = quality_table({})
    records = tuple({"model": model, **row} for model, report in reports.items() for row in quality_table(report).records)
    return Table((("model", "string"), *base.columns), records)


def mapping_table(mapping: dict[str, Any], key: str, value: str) -> Table:
    """A two-column table of a flat mapping (e.g. each embedding table and how it is sharded)."""
    return Table(((key, "string"), (value, "string")), tuple({key: k, value: str(v)} for k, v in mapping.items()))
