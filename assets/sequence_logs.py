"""sequence_logs: timelines and examples over a look-back window of raw_event_logs partitions."""

from datetime import date, timedelta

import dagster as dg
from pydantic import Field

from assets.partitions import LOOKBACK_DAYS, PARTITIONS_START, daily_partitions, lookback_window
from assets.metadata_values import metadata_value
from assets.raw_event_logs import raw_partition_path, raw_event_logs
from assets.resources import LakeResource, MLflowResource
from gem_ops.data.loader import SequenceLogs
from gem_ops.metadata_views import figure_markdown
from gem_ops.data.plots import length_histogram
from gem_ops.data.quality import leakage_violations, length_distribution
from gem_ops.data.sequence_logs import SequenceLogsConfig, build_sequence_logs

MAX_EMPTY_HISTORY_SHARE = 0.5
BUILDER_DEFAULTS = SequenceLogsConfig()


class SequenceLogsAssetConfig(dg.Config):
    lookback_days: int = Field(LOOKBACK_DAYS, description=f"Raw days read, at most {LOOKBACK_DAYS}.")
    max_history_len: int = Field(BUILDER_DEFAULTS.max_history_len,
                                 description="Histories longer than this keep their most recent events.")
    eval_days: int = Field(BUILDER_DEFAULTS.eval_days,
                           description="Requests on the last this many days form the eval split.")
    history_event_types: list[str] | None = Field(None, description="Event types that join timelines; all if unset.")
    max_events_in_memory: int = Field(BUILDER_DEFAULTS.max_events_in_memory,
                                      description="Above this many events, users are read a range at a time.")
    chunk_events: int = Field(BUILDER_DEFAULTS.chunk_events,
                              description="Users are processed in ranges of about this many events (the working "
                                          "set: lower it when memory is short).")

    def builder_config(self) -> SequenceLogsConfig:
        types = tuple(self.history_event_types) if self.history_event_types else None
        return SequenceLogsConfig(max_history_len=self.max_history_len, eval_days=self.eval_days,
                                  history_event_types=types, max_events_in_memory=self.max_events_in_memory,
                                  chunk_events=self.chunk_events)


def sequence_logs_path(lake: LakeResource, day: str):
    return lake.path("sequence_logs", day)


def window_days(end: date, lookback_days: int) -> list[date]:
    if not 1 <= lookback_days <= LOOKBACK_DAYS:
        raise ValueError(f"lookback_days must be in [1, {LOOKBACK_DAYS}], got {lookback_days}")
    first = max(end - timedelta(days=lookback_days - 1), date.fromisoformat(PARTITIONS_START))
    return [first + timedelta(days=i) for i in range((end - first).days + 1)]


def length_table(columns: dict[str, dict[str, float]]) -> str:
    """Markdown: one row per statistic (quantiles, mean, empty share), one column per length measured."""
    names = list(dict.fromkeys(k for figures in columns.values() for k in figures))
    lines = ["| | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for name in names:
        cells = [f"{figures[name]:.3g}" if name in figures else "–" for figures in columns.values()]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


@dg.asset(
    partitions_def=daily_partitions,
    deps=[dg.AssetDep(raw_event_logs, partition_mapping=lookback_window)],
    group_name="data",
    kinds={"polars", "parquet"},
    check_specs=[
        dg.AssetCheckSpec("no_future_leakage", asset="sequence_logs", blocking=True, partitions_def=daily_partitions,
                          description="No example's history holds an event at or after its own request time."),
        dg.AssetCheckSpec("length_distribution", asset="sequence_logs", partitions_def=daily_partitions,
                          description=f"At most {MAX_EMPTY_HISTORY_SHARE:.0%} of the examples come with an empty "
                                      "history (a warning: the look-back window may be too short)."),
    ],
)
def sequence_logs(
    context: dg.AssetExecutionContext, config: SequenceLogsAssetConfig, lake: LakeResource, mlflow: MLflowResource
):
    """User timelines stored once (jagged), and examples pointing into them; train/eval split by time."""
    days = window_days(date.fromisoformat(context.partition_key), config.lookback_days)
    paths = [raw_partition_path(lake, d.isoformat()) for d in days]
    missing = [d.isoformat() for d, p in zip(days, paths) if not p.exists()]
    if missing:
        raise FileNotFoundError(f"raw_event_logs partitions missing for this window: {', '.join(missing)}; "
                                "materialize them first")
    builder = config.builder_config()
    destination = sequence_logs_path(lake, context.partition_key)
    with lake.partition_lock(context), mlflow.asset_run(context) as run:
        summary = build_sequence_logs(paths, destination, builder)
        logs = SequenceLogs(destination)
        leaks = leakage_violations(logs)
        history = length_distribution(logs.history_lengths())
        timeline_lengths = logs.timeline_offsets[1:] - logs.timeline_offsets[:-1]
        figure = length_histogram({"history at request": logs.history_lengths(), "user timeline": timeline_lengths},
                                  f"sequence_logs {context.partition_key}")
        counts = {k: getattr(summary, k)
                  for k in ("n_events", "n_users", "n_examples", "n_train", "n_eval", "n_buckets")}
        run.log_params(config.model_dump() | {"window": f"{days[0]}..{days[-1]}"})
        run.log_metrics(counts | {f"history_len.{k}": v for k, v in history.items()}
                        | {f"leakage.{k}": v for k, v in leaks.items()})
        run.log_figure(figure, "length_histogram.png")
        histogram = metadata_value(figure_markdown(figure, "history and timeline lengths"))
        run.log_artifact(str(destination / "manifest.json"))

    return dg.MaterializeResult(
        metadata={
            "path": dg.MetadataValue.path(str(destination)),
            "dagster/row_count": summary.n_examples,
            "window": f"{days[0]} .. {days[-1]}",
            "eval_start": summary.eval_start or "",
            **counts,
            "lengths": dg.MetadataValue.md(length_table({"history at request": history,
                                                         "user timeline": summary.timeline_length_quantiles})),
            "length_histogram": histogram,
        },
        check_results=[
            dg.AssetCheckResult(check_name="no_future_leakage", passed=sum(leaks.values()) == 0, metadata=leaks),
            dg.AssetCheckResult(
                check_name="length_distribution",
                passed=history.get("empty_share", 1.0) <= MAX_EMPTY_HISTORY_SHARE
                and history.get("max", 0) <= builder.max_history_len,
                severity=dg.AssetCheckSeverity.WARN,
                metadata=history,
            ),
        ],
    )
