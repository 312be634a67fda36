"""mfu_report: model FLOPs utilization of a timed window of real GEM training steps on the day's data
(gem_ops.metrics.mfu), logged to MLflow with its plot and profile."""

import dagster as dg
from pydantic import Field

from assets.model_training import ModelTrainingConfig
from assets.partitions import daily_partitions
from assets.resources import LakeResource, MLflowResource
from assets.sequence_logs import sequence_logs, sequence_logs_path
from assets.shuffled_batches import plan_path, shuffled_batches


class MFUReportConfig(ModelTrainingConfig):
    steps: int = Field(20, description="Timed training steps.")
    warmup_steps: int = Field(5, description="Untimed steps first (lazy initialisation, compilation, autotuning).")
    profile_steps: int = Field(3, description="Profiled steps after the timed ones (per-module time breakdown).")
    device: str = Field("cpu", description="cpu or cuda.")


@dg.asset(partitions_def=daily_partitions, deps=[sequence_logs, shuffled_batches], group_name="reports",
          kinds={"pytorch", "mlflow"})
def mfu_report(context: dg.AssetExecutionContext, config: MFUReportConfig, lake: LakeResource, mlflow: MLflowResource):
    """Achieved model FLOP/s, MFU against the device's datasheet peak (and the measured GEMM rate),
    samples/s and where a step's time goes, for the configured model on one device."""
    from gem_ops.data.loader import SequenceLogs
    from gem_ops.metrics.mfu import log_mfu_report, measure_mfu

    day = context.partition_key
    with mlflow.asset_run(context) as run:
        report = measure_mfu(SequenceLogs(sequence_logs_path(lake, day)), plan_path(lake, day, 1), config.model(),
                             config.train(), steps=config.steps, warmup_steps=config.warmup_steps,
                             profile_steps=config.profile_steps, device=config.device)
        log_mfu_report(run, report)
    figures = report.metrics()
    context.log.info(f"MFU {100 * report.mfu:.2f}% ({report.model_flops_per_second / 1e12:.3g} model TFLOP/s "
                     f"against {report.peak_flops / 1e12:.4g} {report.peak_source}), "
                     f"{report.samples_per_second:.1f} samples/s on {report.device_name}")
    return dg.MaterializeResult(metadata={
        "device": report.device_name, "peak_source": report.peak_source,
        **{k: figures[k] for k in ("mfu", "mfu_vs_gemm", "model_tflops", "peak_tflops", "gemm_tflops",
                                   "samples_per_second", "step_seconds_median", "model_tflop_per_step")},
        "seconds_per_step": dg.MetadataValue.json({k: v for k, v in figures.items() if k.startswith("time")}),
        "flops_share": dg.MetadataValue.json({k[len("flops_share."):]: v for k, v in figures.items()
                                              if k.startswith("flops_share.")}),
    })
