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
    records = tuple({"model": model, **row} for model, report in reports.items()
                    for row in quality_table(report).records)
    return Table((("model", "string"), *base.columns), records)


def mapping_table(mapping: dict[str, Any], key: str, value: str) -> Table:
    """A two-column table of a flat mapping (e.g. each embedding table and how it is sharded)."""
    return Table(((key, "string"), (value, "string")), tuple({key: k, value: str(v)} for k, v in mapping.items()))


def _rate_source(days: int | None) -> str:
    if days is None:
        return "held-out day"
    return {0: "every day", 1: "held-out day"}.get(days, f"newest {days} days")


def calibration_table(calibration: dict[str, Any], surfaces, objectives) -> Table:
    """One row per (surface, objective) of a fitted calibration (TrainResult.calibration, [domains][tasks] lists):
    Platt scaling's scale and final shift, the days whose label rate the shift aims at and that rate, and the
    residual's trend per day where it was looked for (taken: it moved the shift)."""
    def cell(key: str, d: int, t: int, default: Any = math.nan) -> Any:
        return calibration[key][d][t] if key in calibration else default

    records = []
    for d, surface in enumerate(surfaces):
        for t, objective in enumerate(objectives):
            fitted_trend = cell("trend_standard_error", d, t, 1.0) > 0  # find_trends records 0 where days were few
            records.append({"group": f"{surface}/{objective}", "scale": _number(cell("scale", d, t)),
                            "shift": _number(cell("shift", d, t)),
                            "rate_from": _rate_source(cell("rate_days", d, t, None)),
                            "target_rate": _number(cell("target_rate", d, t)),
                            "trend_per_day": _number(cell("trend_slope", d, t) if fitted_trend else math.nan),
                            "trend_taken": bool(cell("trend_taken", d, t, False))})
    columns = (("group", "string"), ("scale", "float"), ("shift", "float"), ("rate_from", "string"),
               ("target_rate", "float"), ("trend_per_day", "float"), ("trend_taken", "bool"))
    return Table(columns, tuple(records))
