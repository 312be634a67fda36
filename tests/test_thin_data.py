"""Thin data through the parquet source, as a user would feed it: a window with no labelled event and a
day with a single one. Each asset checks that it has enough to do its job and fails at once with the
counts named (before torchrun would start), leaving no GEM run, checkpoint or MLflow run behind."""

from datetime import date, timedelta

import dagster as dg
import polars as pl
import pytest
from mlflow.tracking import MlflowClient

from assets.gem_foundation_model import gem_foundation_model
from assets.raw_event_logs import raw_event_logs
from assets.resources import LakeResource, MLflowResource
from assets.sequence_logs import sequence_logs
from assets.shuffled_batches import shuffled_batches
from gem_ops.data.synthetic import SyntheticConfig, generate_day

DAYS = [date(2026, 11, 1) + timedelta(days=i) for i in range(3)]
LABELS = ("label_click", "label_conversion")
DATA = {"sequence_logs": {"config": {"lookback_days": 2, "max_history_len": 32}},
        "shuffled_batches": {"config": {"world_sizes": [1], "sub_batches_per_rank": 1, "sub_batch_size": 32}}}
GEM = {"preset": "vertical", "width": 0.5, "max_steps": 4, "eval_max_examples": 64}


def _no_labels(frame: pl.DataFrame) -> pl.DataFrame:
    return frame.with_columns([pl.lit(None, pl.Int8).alias(c) for c in LABELS])


def _one_label(frame: pl.DataFrame) -> pl.DataFrame:
    frame = frame.with_row_index("row")
    first = int(frame.filter(pl.col("label_click").is_not_null())["row"][0])
    return frame.with_columns([pl.when(pl.col("row") == first).then(pl.col(c)).otherwise(None).alias(c)
                               for c in LABELS]).drop("row")


def _materialize(tmp_path, last_day, every_day=lambda f: f, gem: dict | None = None):
    """The data assets (and GEM) for DAYS[-1] over parquet files: every day passed through `every_day`,
    the last one also through `last_day`."""
    for i, day in enumerate(DAYS):
        frame = every_day(generate_day(SyntheticConfig(n_users=200), day))
        (last_day(frame) if i == len(DAYS) - 1 else frame).write_parquet(tmp_path / f"{day}.parquet")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    resources = {"lake": LakeResource(base_dir=str(tmp_path / "lake")),
                 "mlflow": MLflowResource(tracking_uri=uri, artifact_location=str(tmp_path / "artifacts")),
                 "pipes_subprocess_client": dg.PipesSubprocessClient(env={"OMP_NUM_THREADS": "1"})}
    source = {"raw_event_logs": {"config": {"source": "parquet", "parquet_template": str(tmp_path / "{date}.parquet")}}}
    (tmp_path / "dagster").mkdir()
    with dg.instance_for_test(temp_dir=str(tmp_path / "dagster")) as instance:
        for day in DAYS[:-1]:
            assert dg.materialize([raw_event_logs], partition_key=day.isoformat(), resources=resources,
                                  instance=instance, run_config={"ops": source}).success
        config = {**source, **DATA, "gem_foundation_model": {"config": {**GEM, **(gem or {})}}}
        result = dg.materialize([raw_event_logs, sequence_logs, shuffled_batches, gem_foundation_model],
                                partition_key=DAYS[-1].isoformat(), resources=resources, instance=instance,
                                run_config={"ops": config}, raise_on_error=False)
    return result, MlflowClient(uri)


def _outcome(result) -> tuple[dict[str, str], str]:
    steps = {e.step_key: e.event_type_value for e in result.all_events
             if e.event_type_value in ("STEP_SUCCESS", "STEP_FAILURE")}
    failures = [e.step_failure_data.error.message for e in result.all_events if e.is_step_failure]
    return steps, "\n".join(failures)


def _nothing_trained(tmp_path, client: MlflowClient):
    assert not (tmp_path / "lake" / "gem_foundation_model").exists()
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert not [r for r in runs if r.info.run_name and "gem_foundation_model" in r.info.run_name]
    assert not client.search_registered_models()


def test_a_window_without_labelled_events_stops_at_the_plan_naming_the_counts(tmp_path):
    result, client = _materialize(tmp_path, last_day=lambda f: f, every_day=_no_labels)
    steps, failure = _outcome(result)
    assert steps == {"raw_event_logs": "STEP_SUCCESS", "sequence_logs": "STEP_SUCCESS",
                     "shuffled_batches": "STEP_FAILURE"}
    assert "0 training examples (click: 0 labelled, 0 positive; conversion: 0 labelled, 0 positive)" in failure
    assert "fewer than one rank's step (32 x 1)" in failure and str(DAYS[-1]) in failure
    assert not (tmp_path / "lake" / "shuffled_batches").exists()
    _nothing_trained(tmp_path, client)


@pytest.mark.parametrize("validation_days, message", [
    (1, "the training examples span the days {day}, so validation_days=1 would leave none to train on"),
    (0, "the eval examples cannot be scored: 1 of them (click: 1 labelled, {positives} positive"),
])
def test_a_day_with_a_single_labelled_event_stops_gem_before_torchrun(tmp_path, validation_days, message):
    result, client = _materialize(tmp_path, last_day=_one_label,
                                  gem={"validation_days": validation_days, "early_stopping_patience": 0})
    steps, failure = _outcome(result)
    assert steps["shuffled_batches"] == "STEP_SUCCESS" and steps["gem_foundation_model"] == "STEP_FAILURE"
    eval_day = pl.read_parquet(tmp_path / f"{DAYS[-1]}.parquet").filter(pl.col("label_click").is_not_null())
    expected = message.format(day=DAYS[-2], positives=int(eval_day["label_click"].sum()))
    assert expected in failure, failure
    assert "External execution process failed" not in failure
    _nothing_trained(tmp_path, client)
