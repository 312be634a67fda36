"""The Dagster code location: assets, checks, resources, jobs and schedules."""

import dagster as dg

from assets.domain_foundation_models import domain_foundation_models
from assets.gem_foundation_model import gem_foundation_model
from assets.mfu_report import mfu_report
from assets.raw_event_logs import raw_event_logs
from assets.resources import LakeResource, MLflowResource
from assets.sequence_logs import sequence_logs
from assets.serving_models import serving_models
from assets.shuffled_batches import shuffled_batches
from assets.teacher_predictions import teacher_predictions
from assets.vertical_models import vertical_models
from pipelines.jobs import gem_pipeline_job, gem_pipeline_schedule, measure_mfu_job, prepare_data_job
from pipelines.sensors import new_event_days_sensor

defs = dg.Definitions(
    assets=[raw_event_logs, sequence_logs, shuffled_batches, gem_foundation_model, teacher_predictions,
            domain_foundation_models, vertical_models, serving_models, mfu_report],
    jobs=[prepare_data_job, gem_pipeline_job, measure_mfu_job],
    schedules=[gem_pipeline_schedule],
    sensors=[new_event_days_sensor],
    resources={"lake": LakeResource(), "mlflow": MLflowResource(),
               "pipes_subprocess_client": dg.PipesSubprocessClient()},
)
