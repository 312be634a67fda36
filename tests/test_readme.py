"""The README's run configs, as written: each YAML block parses and is a valid run config of the job it
is for (Dagster's own validation against the code location's jobs)."""

import re
from pathlib import Path

import dagster as dg
import pytest
import yaml

from pipelines.definitions import defs

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```yaml\n(.*?)```", README.read_text(), flags=re.S)


def _job_for(ops: dict) -> str:
    if "mfu_report" in ops:
        return "measure_mfu"
    return "prepare_data" if set(ops) <= {"raw_event_logs", "sequence_logs", "shuffled_batches"} else "gem_pipeline"


def test_the_readme_has_run_configs():
    assert len(BLOCKS) >= 3


@pytest.mark.parametrize("block", BLOCKS, ids=[f"block{i}" for i in range(len(BLOCKS))])
def test_every_readme_run_config_is_valid_for_its_job(block):
    config = yaml.safe_load(block)
    job = defs.resolve_job_def(_job_for(config["ops"]))
    assert dg.validate_run_config(job, config) is not None
