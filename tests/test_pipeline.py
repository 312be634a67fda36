"""The data assets materialized with Dagster into a temporary instance and a real MLflow SQLite store."""

from datetime import date, timedelta

import dagster as dg
import numpy as np
import pytest
from mlflow.tracking import MlflowClient

from assets.raw_event_logs import raw_event_logs
from assets.resources import LakeResource, MLflowResource
from assets.sequence_logs import sequence_logs
from assets.shuffled_batches import shuffled_batches
from gem_ops.data.batch_shuffling import read_rank_plan
from gem_ops.data.loader import SequenceLogs

DAYS = [date(2026, 11, 1) + timedelta(days=i) for i in range(3)]
RUN_CONFIG = {
    "ops": {
        "raw_event_logs": {"config": {"synthetic_users": 400}},
        "sequence_logs": {"config": {"lookback_days": 3, "max_history_len": 64}},
        "shuffled_batches": {"config": {"world_sizes": [1, 2], "sub_batches_per_rank": 1, "sub_batch_size": 16}},
    }
}


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    root = tmp_path_factory.mktemp("pipeline")
    resources = {
        "lake": LakeResource(base_dir=str(root / "lake")),
        "mlflow": MLflowResource(tracking_uri=f"sqlite:///{root / 'mlflow.db'}",
                                 artifact_location=str(root / "artifacts")),
    }
    (root / "dagster").mkdir()
    with dg.instance_for_test(temp_dir=str(root / "dagster")) as instance:
        results = {}
        for day in DAYS[:-1]:
            results[day] = dg.materialize(
                [raw_event_logs], partition_key=day.isoformat(), resources=resources, instance=instance,
                run_config={"ops": {"raw_event_logs": RUN_CONFIG["ops"]["raw_event_logs"]}},
            )
        results[DAYS[-1]] = dg.materialize(
            [raw_event_logs, sequence_logs, shuffled_batches], partition_key=DAYS[-1].isoformat(),
            resources=resources, instance=instance, run_config=RUN_CONFIG,
        )
        yield {"root": root, "results": results, "instance": instance,
               "client": MlflowClient(f"sqlite:///{root / 'mlflow.db'}")}


def test_every_run_succeeds_and_checks_pass(pipeline):
    assert all(r.success for r in pipeline["results"].values())
    evaluations = pipeline["results"][DAYS[-1]].get_asset_check_evaluations()
    by_name = {e.check_name: e for e in evaluations}
    assert set(by_name) == {"schema", "null_rate", "no_future_leakage", "length_distribution"}
    assert all(e.passed for e in evaluations)
    assert by_name["no_future_leakage"].metadata["leaked"].value == 0
    # Each evaluation belongs to the day it judged (a plot over partitions reads one point per day).
    assert {e.partition for e in evaluations} == {DAYS[-1].isoformat()}


def test_every_asset_check_says_what_it_checks():
    from pipelines.definitions import defs

    specs = [spec for assets in defs.assets for spec in getattr(assets, "check_specs", [])]
    assert len(specs) >= 5
    assert all(spec.description for spec in specs), [spec.name for spec in specs if not spec.description]


def test_outputs_land_in_the_lake(pipeline):
    lake = pipeline["root"] / "lake"
    assert sorted(p.name for p in (lake / "raw_event_logs").iterdir()) == [f"{d}.parquet" for d in DAYS]
    logs = SequenceLogs(lake / "sequence_logs" / DAYS[-1].isoformat())
    assert len(logs) > 0 and logs.max_history_len == 64
    for world_size in (1, 2):
        plan = read_rank_plan(lake / "shuffled_batches" / DAYS[-1].isoformat() / f"world_size={world_size}.parquet", 0)
        assert plan.shape[1] == 16
        assert set(plan.ravel()) <= set(logs.split_indices("train"))


def test_materialization_metadata(pipeline):
    result = pipeline["results"][DAYS[-1]]
    materializations = {m.asset_key.to_user_string(): m for m in result.get_asset_materialization_events()}
    seq_meta = materializations["sequence_logs"].materialization.metadata
    assert seq_meta["window"].value == f"{DAYS[0]} .. {DAYS[-1]}"
    assert seq_meta["n_examples"].value > 0
    lengths = seq_meta["lengths"]  # read as a table in the UI, not a JSON blob
    assert isinstance(lengths, dg.MarkdownMetadataValue)
    assert lengths.value.startswith("| | history at request | user timeline |") and "| p50 |" in lengths.value
    balance = materializations["shuffled_batches"].materialization.metadata["imbalance"].value
    assert set(balance) == {"1", "2"} or set(balance) == {1, 2}
    # The plots logged to MLflow are on the Dagster run page too, as inline images.
    for asset, key in (("sequence_logs", "length_histogram"), ("shuffled_batches", "balance_chart")):
        image = materializations[asset].materialization.metadata[key]
        assert isinstance(image, dg.MarkdownMetadataValue) and image.value.startswith("![")
        assert "(data:image/png;base64,iVBORw0KGgo" in image.value  # a PNG's signature, base64-encoded


def test_mlflow_runs_metrics_and_artifacts(pipeline):
    client = pipeline["client"]
    experiment = client.get_experiment_by_name("gem")
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"  # UI opens on runs
    runs = client.search_runs([experiment.experiment_id], max_results=100)
    last_run_id = pipeline["results"][DAYS[-1]].run_id
    parent = [r for r in runs
              if r.data.tags.get("dagster.run_id") == last_run_id and "mlflow.parentRunId" not in r.data.tags]
    assert len(parent) == 1 and parent[0].info.status == "FINISHED"
    children = {
        r.data.tags["dagster.asset_key"]: r
        for r in runs
        if r.data.tags.get("mlflow.parentRunId") == parent[0].info.run_id
    }
    assert set(children) == {"raw_event_logs", "sequence_logs", "shuffled_batches"}
    for child in children.values():
        assert child.info.status == "FINISHED"
        assert child.data.tags["dagster.partition_key"] == DAYS[-1].isoformat()

    seq = children["sequence_logs"]
    assert seq.data.metrics["n_examples"] > 0
    assert seq.data.metrics["leakage.leaked"] == 0
    assert {a.path for a in client.list_artifacts(seq.info.run_id)} >= {"length_histogram.png", "manifest.json"}
    shuffled = children["shuffled_batches"]
    assert 1.0 <= shuffled.data.metrics["ws2.imbalance_bbs"] <= shuffled.data.metrics["ws2.imbalance_random"] + 1e-9
    assert {a.path for a in client.list_artifacts(shuffled.info.run_id)} >= {"balance.png", "balance.json"}
    raw = children["raw_event_logs"]
    assert raw.data.metrics["events"] > 0 and raw.data.params["source"] == "synthetic"


def test_missing_upstream_partition_names_the_day(tmp_path):
    resources = {
        "lake": LakeResource(base_dir=str(tmp_path / "lake")),
        "mlflow": MLflowResource(tracking_uri=f"sqlite:///{tmp_path / 'm.db'}", artifact_location=str(tmp_path / "a")),
    }
    with dg.instance_for_test(temp_dir=str(tmp_path)) as instance:
        result = dg.materialize(
            [sequence_logs], partition_key="2026-11-02", resources=resources, instance=instance,
            run_config={"ops": {"sequence_logs": {"config": {"lookback_days": 2}}}}, raise_on_error=False,
        )
    assert not result.success
    failure = result.get_step_failure_events()[0].step_failure_data.error
    assert "2026-11-01" in str(failure) and "2026-11-02" in str(failure)


def test_movielens_source_through_the_assets(tmp_path):
    """The bundled MovieLens sample: ratings are history, sampled negatives are examples only."""
    resources = {
        "lake": LakeResource(base_dir=str(tmp_path / "lake")),
        "mlflow": MLflowResource(tracking_uri=f"sqlite:///{tmp_path / 'm.db'}", artifact_location=str(tmp_path / "a")),
    }
    raw_config = {"ops": {"raw_event_logs": {"config": {"source": "movielens", "movielens_replay_days": 2}}}}
    with dg.instance_for_test(temp_dir=str(tmp_path)) as instance:
        first = dg.materialize([raw_event_logs], partition_key="2026-11-01", resources=resources, instance=instance,
                               run_config=raw_config)
        config = {"ops": {**raw_config["ops"],
                          "sequence_logs": {"config": {"lookback_days": 2, "history_event_types": ["rating"]}}}}
        second = dg.materialize([raw_event_logs, sequence_logs], partition_key="2026-11-02", resources=resources,
                                instance=instance, run_config=config)
    assert first.success and second.success
    logs = SequenceLogs(tmp_path / "lake" / "sequence_logs" / "2026-11-02")
    rating = logs.event_types.index("rating")
    assert set(np.unique(logs.timeline_column("event_type"))) == {rating}
    example_types = set(np.unique(logs.column("event_type")))
    assert example_types == {rating, logs.event_types.index("sampled_negative")}
    assert set(logs.surfaces) <= {"action", "comedy", "drama", "other"}


def test_local_runner_explains_a_failed_promotion_gate():
    """A second run of the same day can fail the vertical models' gate: the runner says which models
    were kept out and which setting accepts them."""
    from pipelines.run_local import failed_checks

    check = "challengers_not_worse_than_champions"

    def gate(against_a_champion: bool):
        @dg.asset(check_specs=[dg.AssetCheckSpec(check, asset="verticals", blocking=True)])
        def verticals():
            return dg.MaterializeResult(check_results=[dg.AssetCheckResult(
                check_name=check, passed=False,
                severity=dg.AssetCheckSeverity.ERROR if against_a_champion else dg.AssetCheckSeverity.WARN,
                metadata={"kept_out": ["vertical_feed_click"], "decisions": "[...]",
                          "kept_out_against_a_champion": ["vertical_feed_click"] if against_a_champion else []})])
        return dg.materialize([verticals], raise_on_error=False)

    result = gate(against_a_champion=True)
    assert not result.success
    lines = failed_checks(result)
    assert "verticals:challengers_not_worse_than_champions" in lines[0] and "vertical_feed_click" in lines[0]
    assert "decisions" not in lines[0] and "ne_tolerance" in lines[1]
    first = gate(against_a_champion=False)  # a first model that did not beat the base rate: a warning
    assert first.success and "did not beat the base rate" in failed_checks(first)[1]
