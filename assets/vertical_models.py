"""vertical_models: the small serving models, one per domain and objective, learning from GEM directly or
through their domain's foundation model; each registers as `challenger` and a blocking check promotes
only those not measurably worse than the current `champion`."""

import math

import dagster as dg
from pydantic import Field

from assets.domain_foundation_models import domain_foundation_models, fm_predictions_path
from assets.partitions import daily_partitions
from assets.resources import LakeResource, MLflowResource
from assets.sequence_logs import sequence_logs_path
from assets.student_training import StudentTrainingConfig
from assets.teacher_predictions import predictions_path, teacher_predictions
from gem_ops.data.loader import SequenceLogs
from gem_ops.transfer.config import TransferWindows
from gem_ops.transfer.hierarchy import DomainData
from gem_ops.transfer.knowledge import read_predictions
from gem_ops.transfer.registry import load_model_version
from gem_ops.transfer.student import Teacher
from gem_ops.transfer.user_representations import read_user_representations
from gem_ops.transfer.verticals import VerticalSettings, domain_verticals, vertical_objectives

CHECK = "challengers_not_worse_than_champions"


class VerticalModelsConfig(StudentTrainingConfig):
    mode: str = Field("hierarchical", description="hierarchical (GEM -> domain FM -> VM), direct (GEM -> VM) or alone.")
    # A vertical's days hold a few thousand examples, a handful of steps an epoch: one epoch ends inside the warm-up.
    # The transfer benchmark's students train up to 4 epochs, evaluated every 10 steps, the best kept.
    epochs: int = Field(4, description="Passes over the vertical's training days (early stopping keeps the best).")
    eval_every: int = Field(10, description="Steps between evaluations on the validation days (0: at the end only).")
    registered_model_prefix: str = Field("vertical",
                                         description="Each model registers as <prefix>_<domain>_<objective>.")
    ne_tolerance: float = Field(0.0, description="A challenger is not worse when its NE <= the champion's + this (+ "
                                                 "ne_standard_errors standard errors; negative: it must improve by "
                                                 "that much).")
    ne_standard_errors: float = Field(
        1.645, description="Standard errors of the paired NE difference (challenger minus champion, same examples) "
                           "allowed on top of ne_tolerance: 1.645 keeps a challenger out only when it is worse at 95% "
                           "one-sided confidence; 0 keeps out any excess, however small the sample.")
    promotion_max_examples: int = Field(20_000, description="Eval examples per domain on which challenger and "
                                                            "champion are compared.")
    compare_alone: bool = Field(True, description="Also train each vertical without its teacher (not registered), to "
                                                  "report it beside the transferred one.")
    min_positives: int = Field(50, description="An objective gets a vertical only with at least this many positives in "
                                               "its training examples and in the eval examples it is judged on.")


def summary_table(outcomes, mode: str) -> str:
    """Markdown: each vertical's eval AUC / NE / calibration beside GEM's and the alone model's."""
    def cell(figures, who):
        v = figures.get(who)
        if v is None:
            return "–"
        return f"{v['auc']:.3f} / {v['ne']:.3f} / {v['calibration']:.2f} ± {v.get('calibration_stderr', math.nan):.2f}"

    lines = [f"| vertical ({mode}) | positives | GEM | vertical | alone | promoted |", "|---|---|---|---|---|---|"]
    for o in outcomes:
        lines.append(f"| {o.name} v{o.version} | {int(o.figures['vertical']['positives'])} | "
                     f"{cell(o.figures, 'gem')} | {cell(o.figures, 'vertical')} | {cell(o.figures, 'alone')} | "
                     f"{'yes' if o.decision.promoted else 'no'} |")
    return "\n".join(lines) + ("\n\nAUC / NE / calibration ± its standard error (the eval day's labels are draws: "
                               "a calibrated model lands within about two of them) on the eval day.")


def _teacher(mode: str, lake: LakeResource, day: str, domain: str, client) -> Teacher | None:
    if mode == "alone":
        return None
    if mode not in ("direct", "hierarchical"):
        raise ValueError(f"vertical_models mode must be hierarchical, direct or alone, got {mode!r}")
    path = predictions_path(lake, day) if mode == "direct" else fm_predictions_path(lake, day, domain)
    predictions = read_predictions(path)
    identity = predictions.teacher
    return Teacher(load_model_version(client, identity["name"], identity["version"]), predictions, identity,
                   read_user_representations(identity["representations"]))


@dg.asset(
    partitions_def=daily_partitions, deps=[teacher_predictions, domain_foundation_models], group_name="transfer",
    kinds={"pytorch", "mlflow"},
    check_specs=[dg.AssetCheckSpec(CHECK, asset="vertical_models", blocking=True, partitions_def=daily_partitions,
                                   description="Each challenger is compared with its champion on the same eval "
                                               "examples; only one not measurably worse is promoted (else an error "
                                               "that blocks). With no champion yet, the base rate (NE 1) stands in "
                                               "for it (a first model kept out is a warning).")],
)
def vertical_models(context: dg.AssetExecutionContext, config: VerticalModelsConfig, lake: LakeResource,
                    mlflow: MLflowResource):
    day = context.partition_key
    logs = SequenceLogs(sequence_logs_path(lake, day))
    client = mlflow.get_client()
    window = TransferWindows.of_teacher(read_predictions(predictions_path(lake, day)).teacher)
    settings = VerticalSettings(**config.student_settings(), mode=config.mode, prefix=config.registered_model_prefix,
                                ne_tolerance=config.ne_tolerance, ne_standard_errors=config.ne_standard_errors,
                                promotion_max_examples=config.promotion_max_examples,
                                seed=config.seed, compare_alone=config.compare_alone,
                                min_positives=config.min_positives)
    gem = read_predictions(predictions_path(lake, day))
    outcomes, skipped = [], {}
    with lake.partition_lock(context), mlflow.asset_run(context) as run:
        run.log_params(config.model_dump())
        for domain in config.selected(logs.surfaces):
            data = DomainData.of(logs, domain, window)
            reason = data.shortfall(logs, settings.shuffling.rank_batch_size)
            if reason is None and config.mode == "hierarchical" and not fm_predictions_path(lake, day, domain).exists():
                reason = f"domain {domain!r}: no domain FM was trained for it on {day} (see domain_foundation_models)"
            if reason is not None:
                skipped[domain] = reason
                context.log.warning(f"skipped {reason}")
                continue
            tasks, left_out = vertical_objectives(logs, data, settings)
            for vertical, why in left_out.items():
                skipped[vertical] = why
                context.log.warning(f"no vertical for {vertical}: {why}")
            if not tasks:
                continue
            teacher = _teacher(config.mode, lake, day, domain, client)
            for outcome in domain_verticals(client, run, logs, data, teacher, settings,
                                            lake.path("vertical_models", day), day, gem, tasks):
                outcomes.append(outcome)
                context.log.info(f"{outcome.name} v{outcome.version}: {outcome.summary()}")
        run.log_dict([o.decision.to_dict() for o in outcomes], "promotion_decisions.json")
        table = summary_table(outcomes, config.mode)
        run.log_text(table, "summary.md")
    context.log.info("vertical models against GEM and the same models trained alone (eval day):\n" + table)
    decisions = [o.decision for o in outcomes]
    kept_out = [d.model for d in decisions if not d.promoted]
    # Kept out against a serving champion: an error that blocks. A first model kept out for not beating the
    # base rate replaces nothing that serves: a warning (nothing is promoted either way).
    regressions = [d.model for d in decisions if not d.promoted and d.champion_version is not None]
    return dg.MaterializeResult(
        metadata={"models": dg.MetadataValue.json({o.name: o.summary() for o in outcomes}), "mode": config.mode,
                  "skipped": dg.MetadataValue.json(skipped),
                  "summary": dg.MetadataValue.md(table)},
        check_results=[dg.AssetCheckResult(
            check_name=CHECK, passed=not kept_out,
            severity=dg.AssetCheckSeverity.ERROR if regressions else dg.AssetCheckSeverity.WARN,
            metadata={"kept_out": kept_out, "kept_out_against_a_champion": regressions,
                      "decisions": dg.MetadataValue.json([d.to_dict() for d in decisions])},
        )],
    )
