"""serving_models: each vertical's champion exported for serving (gem_ops.serving), its latency measured, and
made the `serving` version only within the latency budget; a blocking check fails when a champion is refused
(the previous serving version, if any, keeps serving)."""

import dagster as dg
from pydantic import Field

from assets.partitions import daily_partitions
from assets.resources import MLflowResource
from assets.vertical_models import vertical_models
from gem_ops.serving.export import FORMATS
from gem_ops.serving.latency import CANDIDATE_COUNTS, LatencySettings
from gem_ops.serving.registry import GATE_CANDIDATES, SERVING, serve_champion

CHECK = "champions_within_latency_budget"


class ServingModelsConfig(dg.Config):
    latency_budget_ms: float = Field(
        100.0, description=f"A champion serves only if its p99 latency at {GATE_CANDIDATES} candidates per request "
                          "(history at the model's maximum, measured here) is at most this many milliseconds.")
    format: str = Field("exported_program", description=f"Serving artifact: one of {list(FORMATS)} (aot_inductor "
                                                         "compiles ahead of time: about a minute per model on 2 "
                                                         "cores).")
    registered_model_prefix: str = Field("vertical", description="Serve the champions of <prefix>_* registered models.")
    models: list[str] = Field(default_factory=list,
                              description="Only these registered models; empty: all of the prefix.")
    latency_requests: int = Field(LatencySettings.requests, description="Timed requests per candidate count.")
    latency_threads: int = Field(LatencySettings.threads,
                                 description="torch threads while timing; 0: the process's setting.")
    latency_warmup: int = Field(LatencySettings.warmup,
                                description="Untimed requests per candidate count before the timed ones.")
    latency_candidates: list[int] = Field(list(CANDIDATE_COUNTS),
                                          description=f"Candidate counts per request measured; must include "
                                                      f"{GATE_CANDIDATES}, where the budget is judged.")

    def latency_settings(self) -> LatencySettings:
        if GATE_CANDIDATES not in self.latency_candidates:
            raise ValueError(f"serving_models config latency_candidates {self.latency_candidates} must include "
                             f"{GATE_CANDIDATES}: the latency budget is judged there")
        return LatencySettings(candidate_counts=tuple(self.latency_candidates), requests=self.latency_requests,
                               warmup=self.latency_warmup, threads=self.latency_threads)


@dg.asset(
    partitions_def=daily_partitions, deps=[vertical_models], group_name="serving", kinds={"pytorch", "mlflow"},
    check_specs=[dg.AssetCheckSpec(CHECK, asset="serving_models", blocking=True, partitions_def=daily_partitions,
                                   description="Every champion's exported artifact answers within the latency budget; "
                                               "one that does not is refused (an error that blocks) and the version "
                                               "serving before stays.")],
)
def serving_models(context: dg.AssetExecutionContext, config: ServingModelsConfig, mlflow: MLflowResource):
    client = mlflow.get_client()
    names = sorted(m.name for m in client.search_registered_models(f"name LIKE '{config.registered_model_prefix}_%'"))
    unknown = sorted(set(config.models) - set(names))
    if unknown:
        raise ValueError(f"serving_models config models {unknown} are not registered models of the prefix "
                         f"{config.registered_model_prefix!r}: {names}")
    names = [name for name in names if not config.models or name in config.models]
    latency = config.latency_settings()
    decisions = []
    with mlflow.asset_run(context) as run:
        run.log_params(config.model_dump())
        for name in names:
            with run.child(f"{name} · serving [{context.partition_key}]", {"model": name}) as child:
                decision = serve_champion(client, name, child, config.latency_budget_ms, config.format, latency)
                if decision is None:
                    context.log.info(f"{name}: no champion to serve")
                    continue
                child.log_metrics(decision.metrics())
                child.log_dict(decision.to_dict(), "serving_decision.json")
            decisions.append(decision)
            context.log.info(f"{name} v{decision.version}: {decision.reason}")
        run.log_dict([d.to_dict() for d in decisions], "serving_decisions.json")
    refused = [d.model for d in decisions if not d.served]
    return dg.MaterializeResult(
        metadata={"models": dg.MetadataValue.json({d.model: {
                      "version": d.version, "served": d.served, "artifact": d.artifact_uri, "format": d.format,
                      **{f"p{q}_ms.{n}": round(f[f"p{q}_ms"], 3) for n, f in d.latency.items() for q in (50, 99)},
                      **{f"requests_per_s.{n}": round(f["requests_per_s"], 1) for n, f in d.latency.items()}}
                      for d in decisions}),
                  "latency_budget_ms": config.latency_budget_ms, "alias": SERVING},
        check_results=[dg.AssetCheckResult(
            check_name=CHECK, passed=not refused, severity=dg.AssetCheckSeverity.ERROR,
            metadata={"refused": refused, "decisions": dg.MetadataValue.json([d.to_dict() for d in decisions])})],
    )
