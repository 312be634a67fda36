"""The local runner's run config: the user's settings merged over the embedded short budgets one setting
at a time, so that configuring `epochs` alone does not drop the half width and short histories."""

import dagster as dg

from pipelines.definitions import defs
from pipelines.run_local import LOCAL_DATA, LOCAL_STUDENTS, LOCAL_TRAINING, local_run_config


def test_one_setting_keeps_the_other_defaults_of_its_op():
    config = local_run_config({"ops": {
        "gem_foundation_model": {"config": {"epochs": 3, "model_overrides": {"sequence.activation": "silu"}}},
        "vertical_models": {"config": {"domains": ["feed"]}},
        "raw_event_logs": {"config": {"synthetic_users": 300}}}})
    gem = config["ops"]["gem_foundation_model"]["config"]
    assert (gem["epochs"] == 3 and gem["width"] == LOCAL_TRAINING["width"]
            and gem["lr_dense"] == LOCAL_TRAINING["lr_dense"])
    assert gem["model_overrides"] == {"sequence.max_history_len": "128", "sequence.activation": "silu"}
    verticals = config["ops"]["vertical_models"]["config"]
    assert verticals["domains"] == ["feed"] and verticals["max_steps"] == LOCAL_STUDENTS["max_steps"]
    assert config["ops"]["raw_event_logs"]["config"] == {**LOCAL_DATA, "synthetic_users": 300}
    assert verticals["mode"] == "direct"
    assert config["loggers"]["console"]["config"]["log_level"] == "INFO"
    assert dg.validate_run_config(defs.resolve_job_def("gem_pipeline"), config)


def test_no_user_config_gives_the_embedded_budgets():
    config = local_run_config({})
    assert config["ops"]["gem_foundation_model"]["config"] == LOCAL_TRAINING
    assert config["ops"]["domain_foundation_models"]["config"] == {**LOCAL_STUDENTS, "width": 0.5}


def test_the_run_says_at_its_start_whether_it_retrains_a_day():
    from pipelines.run_local import retraining_note

    with dg.instance_for_test() as instance:
        assert retraining_note(instance, "2026-11-14").startswith("2026-11-14: first run in this instance")
        instance.report_runless_asset_event(dg.AssetMaterialization("vertical_models", partition="2026-11-14"))
        note = retraining_note(instance, "2026-11-14")
        assert note.startswith("2026-11-14: retraining (run ") and "replaces its champion only if" in note
        assert retraining_note(instance, "2026-11-15").startswith("2026-11-15: first run")


def test_the_runner_takes_its_days_and_partitions_from_parquet_files_and_runs_the_job_asked(tmp_path):
    """Three days of event files in June 2025, long before the default partitions: `--job prepare_data` with
    only a parquet_template runs those three days, starting the partitions where the files start."""
    import os
    import subprocess
    import sys
    from dataclasses import replace
    from datetime import date, timedelta

    import yaml

    from gem_ops.data.synthetic import STRONG_SIGNAL, generate_day

    first = date(2025, 6, 1)
    synthetic = replace(STRONG_SIGNAL, n_users=200, start_date=first)
    (tmp_path / "events").mkdir()
    for offset in range(3):
        day = first + timedelta(days=offset)
        generate_day(synthetic, day).write_parquet(tmp_path / "events" / f"{day}.parquet")
    (tmp_path / "events" / "2025-13-01.parquet").touch()  # shaped like a day, but none: not data
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({"ops": {
        "raw_event_logs": {"config": {"source": "parquet",
                                      "parquet_template": str(tmp_path / "events" / "{date}.parquet")}},
        "shuffled_batches": {"config": {"world_sizes": [1], "sub_batch_size": 16, "sub_batches_per_rank": 1}}}}))
    env = {k: v for k, v in os.environ.items() if k != "GEM_PARTITIONS_START"}
    env |= {"DAGSTER_HOME": str(tmp_path / "dagster"), "GEM_LAKE_DIR": str(tmp_path / "lake"),
            "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}"}
    # An op of the other job in the config is named, not silently dropped: asked beside the run above (each is
    # mostly a process importing the pipeline), in an instance of its own.
    other_job = tmp_path / "other_job.yaml"
    other_job.write_text(yaml.safe_dump({"ops": {"vertical_models": {"config": {"domains": ["feed"]}}}}))
    refusing = subprocess.Popen([sys.executable, "-m", "pipelines.run_local", "--job", "prepare_data", "--config",
                                 str(other_job)], env={**env, "DAGSTER_HOME": str(tmp_path / "refused")},
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        done = subprocess.run([sys.executable, "-m", "pipelines.run_local", "--job", "prepare_data",
                               "--config", str(config)],
                              env=env, capture_output=True, text=True, timeout=600)
        _, refused = refusing.communicate(timeout=300)
    finally:
        refusing.kill()
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "prepare_data: 3 day(s), 2025-06-01 .. 2025-06-03; partitions start on 2025-06-01" in done.stdout
    assert "GEM_PARTITIONS_START=2025-06-01 make dagster" in done.stdout
    assert "gem_foundation_model" not in done.stdout  # the embedded training budgets belong to the other job
    assert sorted(p.name for p in (tmp_path / "lake" / "raw_event_logs").iterdir()) == [
        "2025-06-01.parquet", "2025-06-02.parquet", "2025-06-03.parquet"]
    assert (tmp_path / "lake" / "shuffled_batches" / "2025-06-03").is_dir()
    assert refusing.returncode != 0 and "ops ['vertical_models'] are not in job prepare_data" in refused
