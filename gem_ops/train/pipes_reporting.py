"""Progress and final figures of a training job, streamed by rank 0: to Dagster Pipes when the job was
launched by a Pipes client (DAGSTER_PIPES_CONTEXT is set), else to the log. Only `dagster_pipes` (the
small, dependency-free package) is imported, and only then: gem_ops never imports dagster."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
from collections.abc import Iterator
from typing import Any

from gem_ops.metadata_views import Markdown, Table

log = logging.getLogger(__name__)

PIPES_CONTEXT_ENV = "DAGSTER_PIPES_CONTEXT"


def progress_line(step: int, total: int, metrics: dict[str, float]) -> str:
    return (f"step {step + 1}/{total}: loss {metrics['train.loss']:.4f}, "
            f"{metrics['train.step_seconds'] * 1000:.0f} ms, "
            f"imbalance {metrics.get('train.imbalance.compute_seconds', math.nan):.3f} (compute) "
            f"{metrics.get('train.imbalance.tokens', math.nan):.3f} (tokens)")


class LogReporter:
    def __init__(self, every: int):
        self.every = max(1, every)

    def step(self, step: int, total: int, metrics: dict[str, float]) -> None:
        if (step + 1) % self.every == 0 or step + 1 == total:
            log.info(progress_line(step, total, metrics))

    def message(self, text: str) -> None:
        log.info(text)

    def finish(self, metadata: dict[str, Any]) -> None:
        figures = {k: v for k, v in metadata.items() if not isinstance(v, (Markdown, Table))}  # views are for UIs
        log.info("result: %s", json.dumps(figures, default=str))


class PipesReporter(LogReporter):
    def __init__(self, pipes, every: int):
        super().__init__(every)
        self.pipes = pipes

    def step(self, step: int, total: int, metrics: dict[str, float]) -> None:
        if (step + 1) % self.every == 0 or step + 1 == total:
            self.pipes.log.info(progress_line(step, total, metrics))

    def message(self, text: str) -> None:
        self.pipes.log.info(text)

    def finish(self, metadata: dict[str, Any]) -> None:
        # An undefined figure (NaN) is left out, as in MLflow, rather than shown as an empty entry.
        values = {key: pipes_value(value) for key, value in metadata.items()
                  if not (isinstance(value, float) and math.isnan(value))}
        if self.pipes.is_asset_step:
            self.pipes.report_asset_materialization(metadata=values)
        else:
            self.pipes.report_custom_message({key: v["raw_value"] for key, v in values.items()})


def pipes_value(value: Any) -> dict[str, Any]:
    """A metadata entry with an explicit Pipes type (tables and markdown as such, dicts as json, missing numbers
    as null)."""
    if isinstance(value, Markdown):
        return {"raw_value": value.text, "type": "md"}
    if isinstance(value, Table):
        return {"raw_value": {"records": list(value.records),
                              "schema": [{"name": name, "type": kind} for name, kind in value.columns]},
                "type": "table"}
    if isinstance(value, bool):
        return {"raw_value": value, "type": "bool"}
    if isinstance(value, int):
        return {"raw_value": value, "type": "int"}
    if isinstance(value, float):
        return {"raw_value": value if math.isfinite(value) else None,
                "type": "float" if math.isfinite(value) else "null"}
    if isinstance(value, (dict, list)):
        return {"raw_value": json.loads(json.dumps(value, default=str)), "type": "json"}
    if value is None:
        return {"raw_value": None, "type": "null"}
    return {"raw_value": str(value), "type": "text"}


@contextlib.contextmanager
def open_reporter(rank: int, every: int) -> Iterator[LogReporter | None]:
    """Rank 0's reporter (Pipes under a Pipes client, else the log); None on other ranks."""
    if rank != 0:
        yield None
    elif os.environ.get(PIPES_CONTEXT_ENV):
        from dagster_pipes import open_dagster_pipes

        with open_dagster_pipes() as pipes:
            yield PipesReporter(pipes, every)
    else:
        yield LogReporter(every)
