"""Runs of the gem_pipeline job executed in process as `pipelines.run_local` executes them, into a test's own
Dagster instance: `dagster dev` on that instance lists them under the job."""

from pathlib import Path

import dagster as dg

from assets.resources import LakeResource, MLflowResource
from pipelines.definitions import defs
from pipelines.jobs import gem_pipeline_job
from pipelines.run_local import local_run_tags


def local_gem_pipeline(lake: Path, mlflow: MLflowResource) -> dg.JobDefinition:
    """The gem_pipeline job over a lake and an MLflow store of the test's own."""
    resources = {"lake": LakeResource(base_dir=str(lake)), "mlflow": mlflow,
                 "pipes_subprocess_client": dg.PipesSubprocessClient(env={"OMP_NUM_THREADS": "1"})}
    definitions = dg.Definitions(assets=defs.assets, jobs=[gem_pipeline_job], resources=resources)
    return definitions.resolve_job_def("gem_pipeline")


def run_local(job: dg.JobDefinition, instance: dg.DagsterInstance, day: str, assets: list[str], run_config: dict):
    """One day of `assets` through the job, tagged as the local runner tags its runs; fails unless it succeeds."""
    result = job.execute_in_process(partition_key=day, instance=instance, run_config=run_config,
                                    asset_selection=[dg.AssetKey(a) for a in assets], tags=local_run_tags(job.name))
    assert result.success
    return result
