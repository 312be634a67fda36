"""raw_event_logs: one day of validated events per partition, from the configured source."""

from dataclasses import replace
from datetime import date

import dagster as dg
from pydantic import Field

from assets.partitions import daily_partitions
from assets.resources import LakeResource, MLflowResource
from gem_ops.data.event_logs import read_event_log
from gem_ops.data.quality import null_rates
from gem_ops.data.raw_event_logs import EventSource, load_day, write_partition
from gem_ops.data.schema import REQUIRED_COLUMNS, EventLogError
from gem_ops.data.synthetic import RECURRING_SIGNAL, STRONG_SIGNAL, SyntheticConfig

MAX_FEATURE_NULL_RATE = 0.05


SYNTHETIC_PRESETS = {"ads": SyntheticConfig(n_users=5_000), "strong_signal": STRONG_SIGNAL,
                     "recurring": RECURRING_SIGNAL}


class RawEventLogsConfig(dg.Config):
    source: str = Field("synthetic", description="synthetic | movielens | parquet")
    synthetic_preset: str = Field(
        "ads", description="For source=synthetic: ads (realistic base rates, 0.8-6% CTR, faint effects) or "
                           "strong_signal (dense labels and strong planted effects, learnable in minutes) or recurring "
                           "(strong_signal with retargeting every other day: far history that power users need).")
    synthetic_users: int | None = Field(None, description="Users in the synthetic population (None: the preset's; "
                                                          "ads 5,000, strong_signal and recurring 3,000).")
    synthetic_events_per_user_per_day: float | None = Field(None, description="None: the preset's (ads 3, the "
                                                                              "others 2).")
    synthetic_seed: int = 0
    parquet_template: str = Field("", description="For source=parquet: a path with {date}, e.g. /data/{date}.parquet")
    movielens_dir: str = Field("", description="For source=movielens: the ml-latest-small folder (default: bundled).")
    movielens_replay_days: int = Field(14, description="For source=movielens: days the sample is replayed onto.")

    def event_source(self) -> EventSource:
        if self.synthetic_preset not in SYNTHETIC_PRESETS:
            raise ValueError(f"raw_event_logs.config.synthetic_preset must be one of {sorted(SYNTHETIC_PRESETS)}, "
                             f"got {self.synthetic_preset!r}")
        preset = SYNTHETIC_PRESETS[self.synthetic_preset]
        synthetic = replace(preset, seed=self.synthetic_seed,
                            n_users=self.synthetic_users or preset.n_users,
                            events_per_user_per_day=self.synthetic_events_per_user_per_day
                                                    or preset.events_per_user_per_day)
        extra = {"movielens_dir": self.movielens_dir} if self.movielens_dir else {}
        return EventSource(kind=self.source, synthetic=synthetic, parquet_template=self.parquet_template,
                           movielens_replay_days=self.movielens_replay_days, **extra)


def raw_partition_path(lake: LakeResource, day: str):
    return lake.path("raw_event_logs", f"{day}.parquet")


@dg.asset(
    partitions_def=daily_partitions,
    group_name="data",
    kinds={"polars", "parquet"},
    check_specs=[
        dg.AssetCheckSpec("schema", asset="raw_event_logs", blocking=True, partitions_def=daily_partitions,
                          description="The stored day reads back through the validating reader."),
        dg.AssetCheckSpec("null_rate", asset="raw_event_logs", partitions_def=daily_partitions,
                          description=f"No feature column is null in more than {MAX_FEATURE_NULL_RATE:.0%} of the "
                                      "events (a warning)."),
    ],
)
def raw_event_logs(
    context: dg.AssetExecutionContext, config: RawEventLogsConfig, lake: LakeResource, mlflow: MLflowResource
):
    """One UTC day of events in the documented schema, stored sorted by (user_id, timestamp)."""
    day = date.fromisoformat(context.partition_key)
    with lake.partition_lock(context), mlflow.asset_run(context) as run:
        frame = load_day(config.event_source(), day)
        path = write_partition(frame, raw_partition_path(lake, context.partition_key))
        counts = {"events": frame.height, "users": frame["user_id"].n_unique()}
        counts |= {f"events_{row['event_type']}": row["len"]
                   for row in frame["event_type"].value_counts(name="len").to_dicts()}
        rates = null_rates(frame)
        run.log_params({"source": config.source, "partition": context.partition_key, **config.model_dump()})
        run.log_metrics(counts | {f"null_rate.{k}": v for k, v in rates.items()})

    schema_ok, schema_error = True, ""
    try:
        read_event_log(path)  # the stored file must read back through the validating reader
    except EventLogError as exc:
        schema_ok, schema_error = False, str(exc)
    feature_rates = {k: v for k, v in rates.items() if k not in REQUIRED_COLUMNS and not k.startswith("label_")}
    worst = max(feature_rates.values(), default=0.0)
    return dg.MaterializeResult(
        metadata={"path": dg.MetadataValue.path(str(path)), "dagster/row_count": frame.height, **counts},
        check_results=[
            dg.AssetCheckResult(check_name="schema", passed=schema_ok,
                                metadata={"error": schema_error, "columns": frame.columns}),
            dg.AssetCheckResult(
                check_name="null_rate",
                passed=worst <= MAX_FEATURE_NULL_RATE,
                severity=dg.AssetCheckSeverity.WARN,
                metadata={"null_rates": dg.MetadataValue.json(rates), "max_feature_null_rate": worst},
            ),
        ],
    )
