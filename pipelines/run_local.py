"""Runs the pipeline end to end on the embedded defaults, recorded in the Dagster instance at
DAGSTER_HOME (so every run shows in `dagster dev`) and in the project's MLflow store: raw_event_logs
for each day of the window, then the `gem_pipeline` job (data, GEM training, knowledge transfer to the
domain foundation models and vertical models) for the last day.

    python -m pipelines.run_local [--job gem_pipeline|prepare_data] [--end DAY] [--days N] [--config FILE]

The days come from the data the config names (the newest day of a `parquet_template`'s files, or of the
MovieLens replay; 2026-11-14 for the synthetic log) and the look-back window before it, and the daily
partitions start where that data starts (GEM_PARTITIONS_START, unless already set).

GEM trains for LOCAL_TRAINING's short budget and the students for LOCAL_STUDENTS', so that the whole path
runs in minutes on a laptop CPU; the run config given is merged over them setting by setting (set epochs /
max_steps for a full training), and the settings each op runs with are printed first.
"""

import argparse
import json
import os
import shutil
from datetime import date, timedelta
from pathlib import Path

import dagster as dg
import yaml

from dagster._core.storage.tags import PARTITION_SET_TAG, REPOSITORY_LABEL_TAG

from pipelines.data_window import data_window
from pipelines.orphaned_runs import close_orphaned_runs, orchestrator_tags

DEFAULT_END = "2026-11-14"
DEFAULT_PARTITIONS_START = "2026-11-01"
PARTITIONS_START_ENV = "GEM_PARTITIONS_START"
JOBS = ("gem_pipeline", "prepare_data")
INSTANCE_CONFIG = Path(__file__).resolve().parent / "configs" / "dagster.yaml"
# workspace.yaml's code location (a python_module location is named after its module) and its one repository.
CODE_LOCATION, REPOSITORY = "pipelines.definitions", "__repository__"
# GEM: up to 2 epochs at half width, histories cut to 128 events, stopped early on the held-out newest
# training day (validated every 40 steps), calibrated on it.
LOCAL_TRAINING = {"epochs": 2, "width": 0.5, "lr_dense": 3e-3, "eval_every": 40, "early_stopping_patience": 3,
                  "eval_max_examples": 20_000, "model_overrides": {"sequence.max_history_len": "128"}}
# Students (domain FMs, vertical models): short budgets too, each on its domain's newest days.
LOCAL_STUDENTS = {"max_steps": 60, "eval_every": 20, "eval_max_examples": 5_000,
                  "model_overrides": {"sequence.max_history_len": "64"}}
# The synthetic log with dense labels and strong planted effects: on the realistic ads preset an eval day holds
# too few positives (a few dozen per vertical) for any model to be told from the base rate in minutes.
LOCAL_DATA = {"synthetic_preset": "strong_signal"}
# The verticals learn from GEM directly, the teacher's targets on their serving heads: domain FMs trained for
# LOCAL_STUDENTS' few steps are too weak to teach (hierarchical stays the asset's default). A vertical's 3 days are
# a handful of steps an epoch (search / click: under 4): as many epochs as the 60 steps hold, validated every 5, the
# best kept (after one epoch, still in the warm-up, the direct verticals were 0.05-0.12 AUC lower on the eval day).
LOCAL_VERTICALS = {**LOCAL_STUDENTS, "mode": "direct", "epochs": 20, "eval_every": 5}
# GEM scores the students' days only: the FMs' 60 steps see fewer examples than those days hold (a domain FM
# learns from every training day by default).
LOCAL_TEACHER = {"domain_fm_days": 3}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--job", default="gem_pipeline", choices=JOBS,
                        help="gem_pipeline (data, GEM, transfer) or prepare_data (the data assets alone)")
    parser.add_argument("--end", default=None, help="last day (partition), YYYY-MM-DD; default: the newest day of "
                                                    f"the configured data ({DEFAULT_END} for the synthetic log)")
    parser.add_argument("--days", type=int, default=None,
                        help="days of raw events up to --end; default: the look-back window, as far as the data "
                             "reaches")
    parser.add_argument("--config", type=Path, help="Dagster run config (YAML) applied to every run")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)

    if not os.environ.get("DAGSTER_HOME"):
        raise SystemExit("DAGSTER_HOME is not set: point it at a folder for the Dagster instance (make pipeline does)")
    home = Path(os.environ["DAGSTER_HOME"])
    home.mkdir(parents=True, exist_ok=True)
    if not (home / "dagster.yaml").exists():  # the project's instance settings (no telemetry), as make pipeline gives
        shutil.copyfile(INSTANCE_CONFIG, home / "dagster.yaml")
    user = yaml.safe_load(args.config.read_text()) if args.config else {}
    try:
        window = data_window(user or {})
    except ValueError as error:
        raise SystemExit(f"{args.config}: {error}")
    if window is not None and not os.environ.get(PARTITIONS_START_ENV):
        os.environ[PARTITIONS_START_ENV] = window.first.isoformat()  # read when the definitions are imported
    from assets.partitions import LOOKBACK_DAYS, PARTITIONS_START
    from pipelines.definitions import defs

    end = date.fromisoformat(args.end) if args.end else window.end if window else date.fromisoformat(DEFAULT_END)
    days = args.days or (window.days(LOOKBACK_DAYS) if window else LOOKBACK_DAYS)
    first = end - timedelta(days=days - 1)
    if first < date.fromisoformat(PARTITIONS_START):
        raise SystemExit(f"the run starts on {first}, before the first partition ({PARTITIONS_START}): set "
                         f"{PARTITIONS_START_ENV}={first} (and the same for `make dagster`), or a later --end / fewer "
                         "--days")
    print(f"{args.job}: {days} day(s), {first} .. {end}; partitions start on {PARTITIONS_START}", flush=True)
    if PARTITIONS_START != DEFAULT_PARTITIONS_START:
        print(f"  (start the UI with {PARTITIONS_START_ENV}={PARTITIONS_START} make dagster to see these days)",
              flush=True)
    job = defs.resolve_job_def(args.job)
    run_config = for_job(local_run_config(user or {}), (user or {}).get("ops", {}), job)
    for op, settings in run_config["ops"].items():
        print(f"{op}: {json.dumps(settings.get('config', {}), sort_keys=True)}", flush=True)
    with dg.DagsterInstance.get() as instance:
        for line in close_orphaned_runs(instance, defs.resources["mlflow"]):
            print(f"closed an orphaned {line}", flush=True)
        if args.job == "gem_pipeline":
            print(retraining_note(instance, end.isoformat()), flush=True)
        for offset in range(days - 1, -1, -1):
            day = (end - timedelta(days=offset)).isoformat()
            selection = None if offset == 0 else [dg.AssetKey("raw_event_logs")]
            result = job.execute_in_process(
                partition_key=day, instance=instance, asset_selection=selection, run_config=run_config,
                raise_on_error=False, tags=local_run_tags(job.name),
            )
            print(f"{day}: {'ok' if result.success else 'FAILED'} (run {result.run_id})", flush=True)
            if offset == 0:
                print(run_summary(result), flush=True)
            for line in failed_checks(result):  # warnings too: a first model kept out for not beating the base rate
                print(line, flush=True)
            if not result.success:
                raise SystemExit(1)
    print("done: open the Dagster UI with `make dagster` and MLflow with `make mlflow-ui`")


def for_job(run_config: dict, user_ops: dict, job) -> dict:
    """The run config with only the job's ops: the embedded budgets of ops outside it are dropped, a user's
    setting for an op outside it is an error that names the op."""
    ops = set(job.graph.node_dict)
    foreign = sorted(op for op in user_ops if op not in ops)
    if foreign:
        raise SystemExit(f"--config: ops {foreign} are not in job {job.name} (its ops: {sorted(ops)})")
    return {**run_config, "ops": {op: v for op, v in run_config["ops"].items() if op in ops}}


def local_run_config(user: dict) -> dict:
    """The embedded short budgets with the user's run config merged over them, setting by setting: configuring
    one setting of an op (say `epochs`) keeps that op's other defaults (width, history length, ...)."""
    defaults = {"loggers": {"console": {"config": {"log_level": "INFO"}}},  # every event still lands in the instance
                "ops": {"raw_event_logs": {"config": LOCAL_DATA},
                        "gem_foundation_model": {"config": LOCAL_TRAINING},
                        "teacher_predictions": {"config": LOCAL_TEACHER},
                        "domain_foundation_models": {"config": {**LOCAL_STUDENTS, "width": 0.5}},
                        "vertical_models": {"config": LOCAL_VERTICALS}}}
    return _merged(defaults, user or {})


def _merged(base: dict, over: dict) -> dict:
    out = dict(base)
    for key, value in over.items():
        out[key] = _merged(base[key], value) if isinstance(value, dict) and isinstance(base.get(key), dict) else value
    return out


def local_run_tags(job_name: str) -> dict[str, str]:
    """Tags that place a run executed here under its job in the Dagster UI, as a run launched there is: the
    UI lists a job's runs (and partitions) by the code location's repository label, which a run executed
    in process does not get by itself; plus this process's identity, to close the run if the process dies."""
    return {REPOSITORY_LABEL_TAG: f"{REPOSITORY}@{CODE_LOCATION}", PARTITION_SET_TAG: f"{job_name}_partition_set",
            **orchestrator_tags()}


def retraining_note(instance: dg.DagsterInstance, day: str) -> str:
    """What this run does to the models an earlier run of the same day left (said at its start)."""
    earlier = instance.fetch_materializations(
        dg.AssetRecordsFilter(dg.AssetKey("vertical_models"), asset_partitions=[day]), limit=1).records
    if not earlier:
        return (f"{day}: first run in this instance: GEM and the verticals train from the start; a vertical becomes "
                f"champion only if it beats the base rate.")
    return (f"{day}: retraining (run {earlier[0].event_log_entry.run_id[:8]} materialized this day before): GEM and "
            f"every vertical train again and register new versions; a vertical replaces its champion only if it is "
            f"not measurably worse on the same eval examples (else the promotion check fails and the champion stays).")


def run_summary(result) -> str:
    """GEM's eval figures and the vertical models' summary table, from the run's materializations."""
    metadata = {e.asset_key.to_user_string(): e.materialization.metadata
                for e in result.get_asset_materialization_events()}
    lines = []
    gem = metadata.get("gem_foundation_model", {})
    if gem:
        groups = {k: v.value for k, v in gem.items() if k.startswith("eval.") and k.endswith((".auc", ".ne"))}
        lines.append("GEM on the eval day (AUC / NE): " + ", ".join(
            f"{k[5:-4]} {groups[k]:.3f} / {groups[k[:-4] + '.ne']:.3f}" for k in sorted(groups) if k.endswith(".auc")
            and k[:-4] + ".ne" in groups))
    if "vertical_models" in metadata and "summary" in metadata["vertical_models"]:
        lines.append(metadata["vertical_models"]["summary"].value)
    return "\n".join(lines)


def failed_checks(result) -> list[str]:
    """A line per asset check that did not pass in the run, with what it reported: the promotion gate
    is the one a second run of the same day can fail, when a retrained challenger is not better than
    the champion the first run promoted."""
    lines = []
    for event in result.all_events:
        if event.event_type_value != "ASSET_CHECK_EVALUATION" or event.asset_check_evaluation_data.passed:
            continue
        check = event.asset_check_evaluation_data
        reported = {key: value.value for key, value in check.metadata.items() if key != "decisions"}
        lines.append(f"  check {check.asset_key.to_user_string()}:{check.check_name} did not pass: {reported}")
        gate = check.check_name == "challengers_not_worse_than_champions"
        if gate and not reported.get("kept_out_against_a_champion"):
            lines.append("  Those first models did not beat the base rate: none of them became champion, and nothing "
                         "they would replace serves yet (a warning; train them longer or on more days).")
        elif gate:
            lines.append("  The champions stay registered. To accept challengers up to a margin, set "
                         "ops.vertical_models.config.ne_tolerance (or ne_standard_errors) in --config; to start "
                         "over, use a fresh "
                         "DAGSTER_HOME, lake (GEM_LAKE_DIR) and MLflow store (MLFLOW_TRACKING_URI).")
    return lines


if __name__ == "__main__":
    main()
