"""gem_foundation_model materialized with Dagster on a real MLflow SQLite store: a torchrun job of 2
processes launched through Dagster Pipes (its progress in the run log, its figures as metadata), the
MLflow run's metrics, plot and registered model, which loads back and predicts what the trained model did;
the next day warm-starts from the sharded checkpoint on one process."""

from datetime import date, timedelta

import dagster as dg
import mlflow.pyfunc
import numpy as np
import pytest
import torch
from mlflow.tracking import MlflowClient

from assets.gem_foundation_model import gem_foundation_model
from assets.raw_event_logs import raw_event_logs
from assets.resources import LakeResource, MLflowResource
from assets.sequence_logs import sequence_logs
from assets.shuffled_batches import shuffled_batches
from gem_ops.data.loader import SequenceLogs
from gem_ops.train.loop import model_from_state
from gem_ops.train.mlflow_model import batch_to_frame, predict_frame

DAYS = [date(2026, 11, 1) + timedelta(days=i) for i in range(4)]
MODEL_NAME = "gem_test"
DATA_CONFIG = {
    "raw_event_logs": {"config": {"synthetic_users": 300}},
    "sequence_logs": {"config": {"lookback_days": 3, "max_history_len": 32}},
    "shuffled_batches": {"config": {"world_sizes": [1, 2], "sub_batches_per_rank": 1, "sub_batch_size": 32}},
}
TRAIN_CONFIG = {"preset": "vertical", "width": 0.5, "max_steps": 6, "eval_max_examples": 256, "checkpoint_every": 3,
                "model_overrides": {"sequence.max_history_len": "16"}, "registered_model_name": MODEL_NAME}
PROCESSES = {DAYS[2]: 2, DAYS[3]: 1}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("gem_asset")
    uri = f"sqlite:///{root / 'mlflow.db'}"
    resources = {"lake": LakeResource(base_dir=str(root / "lake")),
                 "mlflow": MLflowResource(tracking_uri=uri, artifact_location=str(root / "artifacts")),
                 "pipes_subprocess_client": dg.PipesSubprocessClient(env={"OMP_NUM_THREADS": "1"})}
    (root / "dagster").mkdir()
    with dg.instance_for_test(temp_dir=str(root / "dagster")) as instance:
        for day in DAYS[:2]:
            assert dg.materialize([raw_event_logs], partition_key=day.isoformat(), resources=resources,
                                  instance=instance, run_config={"ops": {"raw_event_logs": DATA_CONFIG["raw_event_logs"]}}).success
        results = {}
        for day in DAYS[2:]:  # the second training day warm-starts from the first
            results[day] = dg.materialize(
                [raw_event_logs, sequence_logs, shuffled_batches, gem_foundation_model], partition_key=day.isoformat(),
                resources=resources, instance=instance,
                run_config={"ops": {**DATA_CONFIG, "gem_foundation_model": {
                    "config": {**TRAIN_CONFIG, "nproc_per_node": PROCESSES[day]}}}},
            )
        logs = {day: [e.message for e in instance.all_logs(r.run_id)] for day, r in results.items()}
        yield {"root": root, "results": results, "client": MlflowClient(uri), "uri": uri, "logs": logs}


def _metadata(result):
    events = {m.asset_key.to_user_string(): m for m in result.get_asset_materialization_events()}
    return events["gem_foundation_model"].materialization.metadata


def test_runs_succeed_and_report_quality_as_metadata(trained):
    assert all(r.success for r in trained["results"].values())
    meta = _metadata(trained["results"][DAYS[2]])
    assert meta["steps"].value == 6
    assert meta["world_size"].value == 2
    assert meta["samples_per_second"].value > 0
    assert meta["imbalance_observed.tokens"].value >= 1.0
    report = meta["eval"].value
    assert {"all/click", "all/conversion"} <= set(report)
    assert 0.0 <= report["all/click"]["auc"] <= 1.0 and report["all/click"]["ne"] > 0
    assert "eval.all.click.auc" in meta


def test_pipes_streams_progress_into_the_run_log(trained):
    messages = trained["logs"][DAYS[2]]
    assert any("step 6/6: loss" in m for m in messages), messages[-20:]
    assert any("2 rank(s)" in m for m in messages)


def test_second_day_warm_starts_from_the_first(trained):
    first, second = (_metadata(trained["results"][d]) for d in DAYS[2:])
    assert first["warm_start"].value == "none"
    assert DAYS[2].isoformat() in second["warm_start"].value
    assert second["world_size"].value == 1


def test_mlflow_run_has_metrics_plot_and_registered_model(trained):
    client = trained["client"]
    meta = _metadata(trained["results"][DAYS[2]])
    run = client.get_run(meta["mlflow_run_id"].value)
    assert run.info.status == "FINISHED"
    assert run.data.params["model.sequence.max_history_len"] == "16"
    assert len(client.get_metric_history(run.info.run_id, "train.loss")) == 6
    assert "eval.all.click.auc" in run.data.metrics
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"loss_curves.png", "eval_metrics.json", "model"} <= artifacts
    versions = client.search_model_versions(f"name='{MODEL_NAME}'")
    assert sorted(int(v.version) for v in versions) == [1, 2]
    assert {v.run_id for v in versions if str(v.version) == str(meta["model_version"].value)} == {run.info.run_id}


def test_registered_model_loads_back_and_predicts_the_same(trained):
    day = DAYS[3]
    meta = _metadata(trained["results"][day])
    lake = trained["root"] / "lake"
    logs = SequenceLogs(lake / "sequence_logs" / day.isoformat())
    model = model_from_state(torch.load(meta["model_state"].value, weights_only=False)).eval()
    frame = batch_to_frame(logs.batch(np.arange(min(50, len(logs))), 16), model.spec)
    expected = predict_frame(model, frame)

    mlflow.set_tracking_uri(trained["uri"])
    loaded = mlflow.pyfunc.load_model(f"models:/{MODEL_NAME}/{meta['model_version'].value}")
    got = loaded.predict(frame)
    assert list(got.columns) == ["p_click", "p_conversion"]
    np.testing.assert_allclose(got.to_numpy(), expected.to_numpy(), rtol=1e-5, atol=1e-6)
    assert torch.all(torch.isfinite(torch.from_numpy(got.to_numpy())))
