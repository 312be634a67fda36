"""The serving side of the registry: a champion becomes the `serving` version only when its exported
artifact answers within the latency budget (p99 at 100 candidates); a slower one is refused and the previous
serving version stays. The artifact is logged in the run that exported it (under `serving/`), and the model
version points to it with its `serving.*` tags, beside its latency figures."""

from __future__ import annotations

import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import mlflow.artifacts
from mlflow.tracking import MlflowClient

from gem_ops.serving.client import ServingClient
from gem_ops.serving.export import example_request, export_serving
from gem_ops.serving.latency import LatencySettings, measure_latency
from gem_ops.tracking import RunTracker
from gem_ops.transfer.registry import CHAMPION, current_version, load_model_version, set_alias

SERVING = "serving"  # the alias of the version that serves
ARTIFACT_PATH = "serving"
TAG_PREFIX = "serving."
GATE_CANDIDATES = 100


@dataclass(frozen=True)
class ServingDecision:
    model: str
    version: str
    previous_version: str | None  # the serving version before this decision
    served: bool
    reason: str
    artifact_uri: str
    format: str
    export_seconds: float
    latency: dict[str, dict[str, float]]  # candidates -> p50_ms, p99_ms, ...

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def metrics(self) -> dict[str, float]:
        return {f"latency.{n}.{key}": value for n, figures in self.latency.items() for key, value in figures.items()
                if key != "requests"} | {"export_seconds": self.export_seconds}


def serve_champion(client: MlflowClient, name: str, tracker: RunTracker, budget_p99_ms: float,
                   format: str = "exported_program",
                   latency: LatencySettings = LatencySettings()) -> ServingDecision | None:
    """Exports `name`'s champion into `tracker`'s run, measures its latency and makes it the serving version
    if its p99 at GATE_CANDIDATES candidates is within `budget_p99_ms`. None when there is no champion."""
    version = current_version(client, name, CHAMPION)
    if version is None:
        return None
    if GATE_CANDIDATES not in latency.candidate_counts:
        raise ValueError(f"latency candidate counts {latency.candidate_counts} must include {GATE_CANDIDATES}: "
                         "the latency budget is judged there")
    model = load_model_version(client, name, version)
    with tempfile.TemporaryDirectory() as tmp:
        exported = export_serving(model, Path(tmp) / ARTIFACT_PATH, format)
        served_by = ServingClient(exported.folder)
        history = model.config.sequence.max_history_len  # the worst case the model reads
        figures = measure_latency(served_by.score, lambda n, seed: example_request(model, n, history, seed), latency)
        tracker.log_artifacts(exported.folder, ARTIFACT_PATH)
    p99 = figures[GATE_CANDIDATES]["p99_ms"]
    previous = current_version(client, name, SERVING)
    served = p99 <= budget_p99_ms
    reason = (f"p99 {p99:.2f} ms at {GATE_CANDIDATES} candidates {'<=' if served else 'exceeds'} the budget "
              f"latency_budget_ms={budget_p99_ms:g}"
              + ("" if served else f"; version {previous} keeps serving" if previous else "; nothing serves"))
    decision = ServingDecision(name, str(version), previous, served, reason, f"runs:/{tracker.run_id}/{ARTIFACT_PATH}",
                               format, exported.seconds, {str(n): f for n, f in figures.items()})
    _record(client, decision)
    if served:
        set_alias(client, name, SERVING, version)
    return decision


def _record(client: MlflowClient, decision: ServingDecision) -> None:
    tags = {"decision": "served" if decision.served else "refused", "reason": decision.reason,
            "artifact": decision.artifact_uri, "format": decision.format}
    tags |= {f"p99_ms_{n}": f"{f['p99_ms']:.3f}" for n, f in decision.latency.items()}
    for key, value in tags.items():
        client.set_model_version_tag(decision.model, decision.version, TAG_PREFIX + key, value)


def download_serving_artifact(client: MlflowClient, name: str, destination: str, alias: str = SERVING) -> str:
    """The serving artifact folder of `name`'s `alias` version, downloaded to `destination`."""
    version = current_version(client, name, alias)
    if version is None:
        raise LookupError(f"registered model {name!r} has no {alias!r} version: materialize serving_models first")
    uri = client.get_model_version(name, version).tags.get(TAG_PREFIX + "artifact")
    if uri is None:
        raise LookupError(f"{name} v{version} has no {TAG_PREFIX}artifact tag: it was never exported for serving")
    return mlflow.artifacts.download_artifacts(artifact_uri=uri, dst_path=destination, tracking_uri=client.tracking_uri)
