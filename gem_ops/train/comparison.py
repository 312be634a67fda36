"""Train several model configs on the same data, plan and budget, and compare their eval quality."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping

from gem_ops.data.loader import SequenceLogs
from gem_ops.model.config import ModelConfig
from gem_ops.train.config import TrainConfig
from gem_ops.train.engine import train

HEADLINE = ("auc", "ne", "calibration")


def compare_models(logs: SequenceLogs, plan_path: str | os.PathLike, configs: Mapping[str, ModelConfig],
                   train_config: TrainConfig,
                   progress: Callable[[str, int, float], None] | None = None) -> dict[str, dict]:
    """{name: {"eval": quality report, "steps", "train_seconds", "samples_per_second"}}."""
    results = {}
    for name, config in configs.items():
        began = time.perf_counter()
        hooks = [lambda step, loss, name=name: progress(name, step, loss)] if progress else []
        _, result = train(logs, plan_path, config, train_config, step_hooks=hooks)
        results[name] = {
            "steps": result.steps,
            "train_seconds": round(time.perf_counter() - began, 1),
            "samples_per_second": round(result.samples_per_second, 1),
            "eval": result.final_report,
        }
    return results


def headline(results: Mapping[str, dict],
             groups: tuple[str, ...] | None = None) -> dict[str, dict[str, dict[str, float]]]:
    """{model: {group: {auc, ne, calibration}}} for the "all/<task>" groups (or the given ones), rounded."""
    table = {}
    for name, result in results.items():
        report = result["eval"]
        wanted = groups or tuple(g for g in report if g.startswith("all/"))
        table[name] = {g: {m: round(report[g][m], 4) for m in HEADLINE} for g in wanted if g in report}
    return table
