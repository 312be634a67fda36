"""mfu_report: model FLOPs utilization of a timed window of GEM training steps on the day's data, measured
on the engine's own loop launched as gem_foundation_model launches it (torchrun through Dagster Pipes),
logged to MLflow with its plot and profile."""

import dagster as dg
from pydantic import Field

from assets.model_training import TorchrunJobConfig
from assets.partitions import daily_partitions
from assets.resources import LakeResource, MLflowResource
from assets.sequence_logs import sequence_logs, sequence_logs_path
from assets.shuffled_batches import shuffled_batches


class MFUReportConfig(TorchrunJobConfig):
    max_restarts: int = Field(0, description="torchrun restarts of the whole job when a rank dies.")
    steps: int = Field(20, description="Timed training steps.")
    # Not warmup_steps: that is the learning rate's warm-up, a training setting this job passes on too
    untimed_steps: int = Field(5, description="Untimed steps first (lazy initialisation, compilation, autotuning).")
    profile_steps: int = Field(3, description="Profiled steps after the timed ones (per-module time breakdown).")

    def window_flags(self) -> list[str]:
        return ["--mfu-steps", str(self.steps), "--mfu-warmup-steps", str(self.untimed_steps),
                "--mfu-profile-steps", str(self.profile_steps)]


FIGURES = ("mfu", "mfu_median_step", "mfu_vs_gemm", "model_tflops", "peak_tflops", "gemm_tflops",
           "samples_per_second", "step_seconds_mean", "step_seconds_median", "model_tflop_per_step")


@dg.asset(partitions_def=daily_partitions, deps=[sequence_logs, shuffled_batches], group_name="reports",
          kinds={"pytorch", "mlflow"})
def mfu_report(context: dg.AssetExecutionContext, config: MFUReportConfig, lake: LakeResource, mlflow: MLflowResource,
               pipes_subprocess_client: dg.PipesSubprocessClient):
    """Achieved model FLOP/s, MFU against the device's datasheet peak (and the measured GEMM rate) over
    the timed window, samples/s and where a step's time goes, for the configured model and launch."""
    day = context.partition_key
    with lake.partition_lock(context), mlflow.asset_run(context) as run:
        command = config.torchrun_command(sequence_logs_path(lake, day), lake.path("shuffled_batches", day),
                                          [*config.window_flags(), "--mlflow-run-id", run.run_id])
        context.log.info("launching: %s", " ".join(command))
        completed = pipes_subprocess_client.run(command=command, context=context, env=mlflow.job_env())
    reported = {key: value.value for key, value in (completed.get_materialize_result().metadata or {}).items()}
    context.log.info(f"MFU {100 * reported['mfu']:.2f}% over the window ({reported['model_tflops']:.3g} model TFLOP/s "
                     f"against {reported['peak_tflops']:.4g} {reported['peak_source']}), "
                     f"{reported['samples_per_second']:.1f} samples/s on {reported['device']}")
    return dg.MaterializeResult(metadata={
        "path": reported["path"], "device": reported["device"], "peak_source": reported["peak_source"],
        "world_size": reported["world_size"], **{k: reported[k] for k in FIGURES},
        "seconds_per_step": dg.MetadataValue.json(reported["seconds_per_step"]),
        "flops_share": dg.MetadataValue.json(reported["flops_share"]),
    })
