"""gem_foundation_model materialized with Dagster on a real MLflow SQLite store: a torchrun job of 2
processes launched through Dagster Pipes (its progress in the run log, its figures as metadata), the
MLflow run's metrics, plot and registered model, which loads back and predicts what the trained model did;
the next day warm-starts from the sharded checkpoint on one process."""

import dagster as dg
import mlflow.pyfunc
import numpy as np
import pytest
import torch

from gem_ops.data.loader import SequenceLogs
from gem_ops.train.model_state import load_model_state, model_from_state
from gem_ops.train.mlflow_model import batch_to_frame, predict_frame

from tests.gem_asset_setup import DAYS, MODEL_NAME


def _metadata(result):
    events = {m.asset_key.to_user_string(): m for m in result.get_asset_materialization_events()}
    return events["gem_foundation_model"].materialization.metadata


def test_runs_succeed_and_report_quality_as_metadata(gem_asset_runs):
    assert all(r.success for r in gem_asset_runs["results"].values())
    meta = _metadata(gem_asset_runs["results"][DAYS[2]])
    assert meta["steps"].value == 6
    assert meta["world_size"].value == 2
    assert meta["samples_per_second"].value > 0
    assert meta["imbalance_observed.tokens"].value >= 1.0
    # Read as tables on the run page, not as JSON blobs; the loss curves as an inline image.
    assert isinstance(meta["eval"], dg.TableMetadataValue)
    report = {record.data["group"]: record.data for record in meta["eval"].value.records}
    assert {"all/click", "all/conversion"} <= set(report)
    assert 0.0 <= report["all/click"]["auc"] <= 1.0 and report["all/click"]["ne"] > 0
    assert report["all/click"]["examples"] >= report["all/click"]["positives"] > 0
    assert "eval.all.click.auc" in meta
    plan = {record.data["table"]: record.data["sharding"] for record in meta["sharding_plan"].value.records}
    assert plan and all(plan.values())
    assert meta["loss_curves"].value.startswith("![training loss and eval NE by step](data:image/png;base64,")
    assert "losses" not in meta


def test_the_run_page_shows_the_calibration_the_model_serves_with(gem_asset_runs):
    """One row per (surface, objective), the very scale and shift of the run's calibration.json in MLflow."""
    import mlflow.artifacts

    meta = _metadata(gem_asset_runs["results"][DAYS[2]])
    rows = {record.data["group"]: record.data for record in meta["calibration"].value.records}
    run_id = meta["mlflow_run_id"].value
    artifacts = gem_asset_runs["client"].get_run(run_id).info.artifact_uri
    fitted = mlflow.artifacts.load_dict(f"{artifacts}/calibration.json")
    logs = SequenceLogs(gem_asset_runs["root"] / "lake" / "sequence_logs" / DAYS[2].isoformat())
    assert len(rows) == len(logs.surfaces) * len(logs.objectives)
    for d, surface in enumerate(logs.surfaces):  # the calibration's rows are the logs' surfaces and objectives
        for t, objective in enumerate(logs.objectives):
            row = rows[f"{surface}/{objective}"]
            assert row["scale"] == fitted["scale"][d][t] and row["shift"] == fitted["shift"][d][t]
            # Three days of logs: too few to backtest a pool or fit a trend.
            assert row["rate_from"] == "held-out day" and row["trend_taken"] is False


def test_pipes_streams_progress_into_the_run_log(gem_asset_runs):
    messages = gem_asset_runs["logs"][DAYS[2]]
    assert any("step 6/6: loss" in m for m in messages), messages[-20:]
    assert any("2 rank(s)" in m for m in messages)


def test_second_day_warm_starts_from_the_first(gem_asset_runs):
    first, second = (_metadata(gem_asset_runs["results"][d]) for d in DAYS[2:])
    assert first["warm_start"].value == "none"
    assert DAYS[2].isoformat() in second["warm_start"].value
    # The run log and the metadata say where each GEM started and whether it replaces one of its day.
    assert first["training"].value == (f"GEM starts from its initialization: no earlier day has a checkpoint; the "
                                       f"first GEM of {DAYS[2].isoformat()}.")
    assert second["training"].value.startswith(f"GEM warm-starts from {second['warm_start'].value}; the first GEM")
    assert any(m == first["training"].value for m in gem_asset_runs["logs"][DAYS[2]])
    assert second["world_size"].value == 1


def test_mlflow_run_has_metrics_plot_and_registered_model(gem_asset_runs):
    client = gem_asset_runs["client"]
    meta = _metadata(gem_asset_runs["results"][DAYS[2]])
    run = client.get_run(meta["mlflow_run_id"].value)
    assert run.info.status == "FINISHED"
    assert run.data.params["model.sequence.max_history_len"] == "16"
    assert len(client.get_metric_history(run.info.run_id, "train.loss")) == 6
    assert "eval.all.click.auc" in run.data.metrics
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"loss_curves.png", "eval_metrics.json"} <= artifacts
    # The model is an MLflow logged model, an output of the run (MLflow's Models views list it).
    (output,) = run.outputs.model_outputs
    logged = client.get_logged_model(output.model_id)
    assert logged.source_run_id == run.info.run_id and str(logged.status) == "READY"
    versions = client.search_model_versions(f"name='{MODEL_NAME}'")
    assert sorted(int(v.version) for v in versions) == [1, 2]
    (version,) = [v for v in versions if str(v.version) == str(meta["model_version"].value)]
    assert version.run_id == run.info.run_id and version.source == logged.artifact_location


def test_registered_model_loads_back_and_predicts_the_same(gem_asset_runs):
    day = DAYS[3]
    meta = _metadata(gem_asset_runs["results"][day])
    lake = gem_asset_runs["root"] / "lake"
    logs = SequenceLogs(lake / "sequence_logs" / day.isoformat())
    model = model_from_state(load_model_state(meta["model_state"].value)).eval()
    frame = batch_to_frame(logs.batch(np.arange(min(50, len(logs))), 16), model.spec)
    expected = predict_frame(model, frame)

    mlflow.set_tracking_uri(gem_asset_runs["uri"])
    loaded = mlflow.pyfunc.load_model(f"models:/{MODEL_NAME}/{meta['model_version'].value}")
    got = loaded.predict(frame)
    assert list(got.columns) == ["p_click", "p_conversion"]
    np.testing.assert_allclose(got.to_numpy(), expected.to_numpy(), rtol=1e-5, atol=1e-6)
    assert torch.all(torch.isfinite(torch.from_numpy(got.to_numpy())))


def test_training_settings_of_the_run_config_reach_the_torchrun_job(tmp_path):
    """Every TrainConfig field the Dagster config sets becomes a flag the training job accepts."""
    from assets.gem_foundation_model import GEMTrainingConfig, training_command
    from assets.resources import LakeResource
    from gem_ops.train.__main__ import parse_args

    config = GEMTrainingConfig(preset="gem_gpu", precision="fp8", fp8_recipe="tensorwise_fast_accum", compile="dense",
                               activation_checkpointing="sequence", lr_dense=2e-3, max_steps=7,
                               sparse_table_gradients=True, step_readout="each_step")
    command = training_command(config, LakeResource(base_dir=str(tmp_path)), "2026-11-01", None, None, "run-1")
    args = parse_args(command[command.index("gem_ops.train") + 1:])
    assert (args.precision, args.fp8_recipe, args.compile, args.activation_checkpointing, args.step_readout) == (
        "fp8", "tensorwise_fast_accum", "dense", "sequence", "each_step")
    assert (args.lr_dense, args.max_steps, args.preset) == (2e-3, 7, "gem_gpu")
    assert args.sparse_table_gradients is True
    off = training_command(config.model_copy(update={"sparse_table_gradients": False}),
                           LakeResource(base_dir=str(tmp_path)), "2026-11-01", None, None, "run-1")
    assert parse_args(off[off.index("gem_ops.train") + 1:]).sparse_table_gradients is False
    assert config.train().checkpoint_every == 50


def test_every_training_setting_is_a_run_config_field_and_reaches_the_job_with_its_value(tmp_path):
    """A user in the Dagster UI sets what the engine takes, the speed settings included: each TrainConfig field is a
    field of the run config, and the torchrun job parses the value the config gave it."""
    import dataclasses

    from assets.gem_foundation_model import GEMTrainingConfig, training_command
    from assets.resources import LakeResource
    from gem_ops.train.__main__ import parse_args, train_config_from
    from gem_ops.train.config import TrainConfig

    names = {f.name for f in dataclasses.fields(TrainConfig)}
    assert names - set(GEMTrainingConfig.model_fields) == set()
    config = GEMTrainingConfig(preset="gem_gpu", compile="model", cuda_graphs=True, size_bucket=1.1, gc_every=0,
                               prefetch_batches=3, dense_optimizer="radam", weight_decay=0.05, clip_grad_norm=0.0,
                               unit_prefetch=True, warm_up_lengths=True, eval_batch_size=64, keep_checkpoints=5,
                               log_every=4, lr_schedule="constant", validation_days=2, seed=9)
    command = training_command(config, LakeResource(base_dir=str(tmp_path)), "2026-11-01", None, None, "run-1")
    parsed = train_config_from(parse_args(command[command.index("gem_ops.train") + 1:]))
    assert parsed == config.train()
    assert (parsed.cuda_graphs, parsed.size_bucket, parsed.gc_every, parsed.prefetch_batches) == (True, 1.1, 0, 3)
    with pytest.raises(ValueError, match="cuda_graphs"):
        config.model_copy(update={"compile": "dense"}).train()


def _materialize_gem(gem_asset_runs, day, **config):
    import dagster as dg

    from assets.gem_foundation_model import gem_foundation_model
    from tests.gem_asset_setup import TRAIN_CONFIG

    return dg.materialize([gem_foundation_model], partition_key=day.isoformat(), resources=gem_asset_runs["resources"],
                          instance=gem_asset_runs["instance"], raise_on_error=False,
                          run_config={"ops": {"gem_foundation_model": {"config": {**TRAIN_CONFIG, **config}}}})


def test_materializing_a_partition_again_is_a_new_training_run(gem_asset_runs):
    """Its own checkpoint folder: it trains every step again rather than resuming the earlier run's last
    checkpoint and registering the same weights."""
    again = _materialize_gem(gem_asset_runs, DAYS[3])
    assert again.success
    first, second = _metadata(gem_asset_runs["results"][DAYS[3]]), _metadata(again)
    assert second["steps"].value == first["steps"].value == 6
    assert second["model_version"].value != first["model_version"].value
    folders = sorted((gem_asset_runs["root"] / "lake" / "gem_foundation_model" / DAYS[3].isoformat()
                      / "runs").iterdir())
    assert {f.name for f in folders} == {gem_asset_runs["results"][DAYS[3]].run_id, again.run_id}


def test_a_warm_start_the_model_cannot_take_fails_at_once_naming_the_settings(gem_asset_runs):
    """Twice the width cannot load yesterday's weights: the asset fails before any training job starts,
    saying which weights and which settings differ."""
    import time

    began = time.monotonic()
    wider = _materialize_gem(gem_asset_runs, DAYS[3], width=1.0)
    assert not wider.success and time.monotonic() - began < 60
    failure = next(e for e in wider.all_events if e.event_type_value == "STEP_FAILURE").event_specific_data.error
    assert "cannot warm-start from" in failure.message and "differ in shape" in failure.message
    assert "embedding.dim: 16 there, 32 here" in failure.message


def test_undefined_figures_are_left_out_of_the_reported_metadata():
    from gem_ops.train.pipes_reporting import PipesReporter

    class Pipes:
        is_asset_step = True

        def report_asset_materialization(self, metadata):
            self.reported = metadata

    pipes = Pipes()
    PipesReporter(pipes, 10).finish({"eval.all.click.auc": 0.7, "eval.stories.conversion.auc": float("nan"),
                                     "steps": 6, "warm_start": None})
    assert set(pipes.reported) == {"eval.all.click.auc", "steps", "warm_start"}
    assert pipes.reported["eval.all.click.auc"] == {"raw_value": 0.7, "type": "float"}


def test_a_second_materialization_of_a_day_says_it_retrains_it():
    from assets.gem_foundation_model import how_it_trains

    day = DAYS[2].isoformat()
    with dg.instance_for_test() as instance:
        assert how_it_trains(instance, day, None, False).endswith(f"(warm_start is off); the first GEM of {day}.")
        instance.report_runless_asset_event(dg.AssetMaterialization("gem_foundation_model", partition=day))
        again = how_it_trains(instance, day, "/lake/ckpt", True)
    assert again.startswith(f"GEM warm-starts from /lake/ckpt; it retrains {day}, materialized before by run ")
    assert again.endswith("registers a new version (the earlier ones stay registered).")
