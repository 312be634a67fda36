"""The local runner's run config: the user's settings merged over the embedded short budgets one setting
at a time, so that configuring `epochs` alone does not drop the half width and short histories."""

import dagster as dg

from pipelines.definitions import defs
from pipelines.run_local import LOCAL_STUDENTS, LOCAL_TRAINING, local_run_config


def test_one_setting_keeps_the_other_defaults_of_its_op():
    config = local_run_config({"ops": {
        "gem_foundation_model": {"config": {"epochs": 3, "model_overrides": {"sequence.activation": "silu"}}},
        "vertical_models": {"config": {"domains": ["feed"]}},
        "raw_event_logs": {"config": {"synthetic_users": 300}}}})
    gem = config["ops"]["gem_foundation_model"]["config"]
    assert gem["epochs"] == 3 and gem["width"] == LOCAL_TRAINING["width"] and gem["lr_dense"] == LOCAL_TRAINING["lr_dense"]
    assert gem["model_overrides"] == {"sequence.max_history_len": "128", "sequence.activation": "silu"}
    verticals = config["ops"]["vertical_models"]["config"]
    assert verticals["domains"] == ["feed"] and verticals["max_steps"] == LOCAL_STUDENTS["max_steps"]
    assert config["ops"]["raw_event_logs"]["config"] == {"synthetic_users": 300}
    assert config["loggers"]["console"]["config"]["log_level"] == "INFO"
    assert dg.validate_run_config(defs.resolve_job_def("gem_pipeline"), config)


def test_no_user_config_gives_the_embedded_budgets():
    config = local_run_config({})
    assert config["ops"]["gem_foundation_model"]["config"] == LOCAL_TRAINING
    assert config["ops"]["domain_foundation_models"]["config"] == {**LOCAL_STUDENTS, "width": 0.5}
