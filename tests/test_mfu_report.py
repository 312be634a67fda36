"""mfu_report materialized with Dagster on CPU into a temporary instance and a real MLflow SQLite store: the
engine's torchrun job launched through Dagster Pipes, as gem_foundation_model launches it; its metadata,
and the MLflow run's metrics, per-step curve, plot and report read back."""

import json
import math
import re
from datetime import date, timedelta
from pathlib import Path

import dagster as dg
import pytest
from mlflow.tracking import MlflowClient

from assets.mfu_report import mfu_report
from assets.raw_event_logs import raw_event_logs
from assets.resources import LakeResource, MLflowResource
from assets.sequence_logs import sequence_logs
from assets.shuffled_batches import shuffled_batches

DAYS = [date(2026, 11, 1) + timedelta(days=i) for i in range(2)]
DATA_CONFIG = {
    "raw_event_logs": {"config": {"synthetic_users": 200}},
    "sequence_logs": {"config": {"lookback_days": 2, "max_history_len": 32}},
    "shuffled_batches": {"config": {"world_sizes": [1], "sub_batches_per_rank": 1, "sub_batch_size": 32}},
}
STEPS, WARMUP, PROFILED = 4, 1, 2
MFU_CONFIG = {"preset": "vertical", "width": 0.5, "steps": STEPS, "untimed_steps": WARMUP, "profile_steps": PROFILED,
              "model_overrides": {"sequence.max_history_len": "16", "embedding.item_buckets": "4096"}}


@pytest.fixture(scope="module")
def materialized(tmp_path_factory):
    root = tmp_path_factory.mktemp("mfu_report")
    uri = f"sqlite:///{root / 'mlflow.db'}"
    resources = {"lake": LakeResource(base_dir=str(root / "lake")),
                 "mlflow": MLflowResource(tracking_uri=uri, artifact_location=str(root / "artifacts")),
                 "pipes_subprocess_client": dg.PipesSubprocessClient()}
    (root / "dagster").mkdir()
    with dg.instance_for_test(temp_dir=str(root / "dagster")) as instance:
        assert dg.materialize([raw_event_logs], partition_key=DAYS[0].isoformat(), resources=resources,
                              instance=instance,
                              run_config={"ops": {"raw_event_logs": DATA_CONFIG["raw_event_logs"]}}).success
        result = dg.materialize([raw_event_logs, sequence_logs, shuffled_batches, mfu_report],
                                partition_key=DAYS[1].isoformat(), resources=resources, instance=instance,
                                run_config={"ops": {**DATA_CONFIG, "mfu_report": {"config": MFU_CONFIG}}})
        yield {"result": result, "client": MlflowClient(uri), "root": root}


def _metadata(result):
    events = {m.asset_key.to_user_string(): m for m in result.get_asset_materialization_events()}
    return events["mfu_report"].materialization.metadata


def test_materializes_with_mfu_figures_as_metadata(materialized):
    assert materialized["result"].success
    meta = _metadata(materialized["result"])
    assert meta["path"].value == "engine" and meta["world_size"].value == 1  # the torchrun job's own figures
    assert meta["mfu"].value > 0 and meta["mfu_median_step"].value > 0
    assert meta["peak_source"].value == "measured"  # a CPU has no datasheet entry: MFU against its GEMM rate
    assert 0 < meta["mfu"].value < 1.5
    assert meta["mfu"].value == pytest.approx(meta["mfu_vs_gemm"].value)
    assert meta["model_tflops"].value > 0 and meta["samples_per_second"].value > 0
    seconds = meta["seconds_per_step"].value
    assert {"time.data", "time.forward", "time.backward", "time.optimizer", "time.step"} <= set(seconds)
    assert seconds["time.forward"] > 0 and seconds["time.backward"] > 0
    assert seconds["time.module.sequence.layers"] > 0 and seconds["time.module.wukong"] > 0
    shares = meta["flops_share"].value
    assert sum(shares.values()) == pytest.approx(1.0)
    assert shares["sequence.ffn"] > 0 and shares["wukong.fm_mlp"] > 0


def test_the_windows_untimed_steps_leave_the_learning_rates_warm_up_alone(tmp_path):
    from assets.mfu_report import MFUReportConfig
    from gem_ops.train.__main__ import parse_args

    config = MFUReportConfig(untimed_steps=3, warmup_steps=40)
    command = config.torchrun_command(tmp_path / "logs", tmp_path / "plans", config.window_flags())
    args = parse_args(command[command.index("gem_ops.train") + 1:])
    assert (args.mfu_warmup_steps, args.warmup_steps) == (3, 40)


@pytest.mark.parametrize("late", [False, True])
def test_the_profile_holds_profile_steps_steps_whether_steps_are_read_late_or_at_once(late):
    """Read late, a step's hook runs once the next step is queued: the recording from the hook after the window to
    the last one would hold one step fewer than the figures are divided by (2/3 of each per-step figure at 3)."""
    import torch
    from torch.autograd.profiler import record_function

    from gem_ops.train.mfu_window import MFUWindow, recorded_steps

    window = MFUWindow(steps=2, warmup_steps=1, profile_steps=3, reads_late=late)
    assert window.total_steps == 7 + late
    queued = []
    with window.observe(torch.device("cpu")) as observer:
        for step in range(window.total_steps):  # the engine's order: queue a step, then read the one before it
            with record_function("forward"):
                torch.ones(8).sum()
            with record_function("optimizer"):
                torch.ones(8).mul_(2)
            queued.append(step)
            if not late:
                observer(step, 0.0)
            elif step:
                observer(step - 1, 0.0)
        if late:
            observer(window.total_steps - 1, 0.0)  # the last step read at once
    assert recorded_steps(observer.prof) == 3
    assert sum(e.name == "forward" for e in observer.prof.events()) == 3
    assert observer.recorded_seconds > 0


def test_mlflow_run_has_metrics_curve_plot_and_report(materialized):
    client = materialized["client"]
    run = client.get_run(_metadata(materialized["result"])["mlflow_run_id"].value)
    assert run.info.status == "FINISHED"
    metrics = run.data.metrics
    assert 0 < metrics["mfu.mfu"] < 1.5
    assert metrics["mfu.samples_per_second"] > 0
    assert metrics["mfu.gemm_tflops"] > 0
    assert len(client.get_metric_history(run.info.run_id, "mfu.step_model_tflops")) == STEPS
    assert run.data.params["mfu.steps"] == str(STEPS)
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"mfu_report.png", "mfu_report.json", "mfu_profile.txt"} <= artifacts
    local = client.download_artifacts(run.info.run_id, "mfu_report.json", str(materialized["root"]))
    report = json.loads(open(local).read())
    assert len(report["step_seconds"]) == STEPS and all(s > 0 for s in report["step_seconds"])
    # what the batch planner's cost model is fitted to: each timed step's compute, tokens and attention cost
    measures = report["step_measures"]
    assert set(measures) == {"compute_seconds", "tokens", "attention_cost"}
    assert all(len(v) == STEPS and all(x > 0 for x in v) for v in measures.values())
    assert all(c >= t for c, t in zip(measures["attention_cost"], measures["tokens"]))  # (L + 1)^2 >= L + 1
    assert report["model_flops"] == pytest.approx(sum(report["step_flops"]))
    # what stalls a step from the host, per timed step: nothing here, the collector being off between its
    # scheduled collections (every 50 steps), nothing compiled (compile "none"), no attention kernel on a CPU
    stalls = report["step_stalls"]
    assert stalls == {"gc_seconds": [0.0] * STEPS, "compiled_graphs": [0.0] * STEPS,
                      "attention_tunings": [0.0] * STEPS, "attention_compiles": [0.0] * STEPS,
                      "cuda_graph_recordings": [0.0] * STEPS}
    # the host's time blocked reading each step back: part of the step's own time
    waits = report["step_read_waits"]
    assert len(waits) == STEPS and all(0 <= w <= s for w, s in zip(waits, report["step_seconds"]))
    # the host's time in each phase of queuing each timed step, the profiler off
    host = report["step_host_seconds"]
    assert list(host) == ["data", "forward", "backward", "optimizer"]
    assert all(len(v) == STEPS and all(x >= 0 for x in v) for v in host.values())
    assert all(f > 0 and b > 0 for f, b in zip(host["forward"], host["backward"]))
    assert report["attention_key_sources"] == {"tuned": 0, "from_store": 0}  # keys tuned here or taken from disk
    # MFU over the window's wall time (the mean step), which holds every step's own time and what runs
    # between steps; the median step's figure beside it.
    assert report["seconds"] >= sum(report["step_seconds"])
    assert math.isclose(report["model_flops"] / report["seconds"] / 1e12, metrics["mfu.model_tflops"], rel_tol=1e-6)
    assert math.isclose(report["step_seconds_mean"], report["seconds"] / STEPS, rel_tol=1e-6)
    assert "mfu.mfu_median_step" in metrics


def test_host_waits_on_a_full_launch_queue_are_not_device_time():
    """The CUDA profiler gives "Command Buffer Full" (a launch that waited for queue room) device time;
    a phase's device time leaves it out, however deep it sits under the phase's range."""
    from types import SimpleNamespace as Event

    from gem_ops.train.mfu_window import device_time

    wait = Event(name="Command Buffer Full", device_time_total=300.0, cpu_children=[])
    launch = Event(name="cudaLaunchKernel", device_time_total=340.0, cpu_children=[wait])
    kernel_op = Event(name="aten::mm", device_time_total=50.0, cpu_children=[])
    phase = Event(name="optimizer", device_time_total=390.0, cpu_children=[launch, kernel_op])
    assert device_time(phase) == 90.0


def test_eager_operators_name_their_shapes_and_the_project_line_that_ran_them():
    """The history tokens' eager sum in GEMEmbeddings.forward is found by op, shape and source line."""
    import torch

    from gem_ops.model.config import model_config
    from gem_ops.model.features import model_input
    from gem_ops.train.mfu_window import eager_operators
    from gem_ops.train.model_state import seeded_model
    from tests.model_inputs import SPEC, random_batch

    config = model_config("gem", width=0.5, blocks=1)
    model = seeded_model(SPEC, config)
    x = model_input(random_batch([30, 7, 0, 12]), SPEC, config)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True,
                                with_stack=True) as prof:
        model.loss(x)[0].backward()
    rows = eager_operators(prof, steps=1, device=torch.device("cpu"), limit=1000)
    dim = config.embedding.sequence_dim
    sums = [r for r in rows if r["name"] == "aten::add" and r["input_shapes"].startswith(f"[[49, {dim}], [49, {dim}]")]
    in_forward = [r for r in sums if r["caller"].endswith("history_tokens")]
    # one add per table looked up on its own after the first, and one for the context tables' stacked lookup
    looked_up = len(model.embeddings.history_keys) - len(model.embeddings.context_keys)
    assert in_forward and in_forward[0]["calls"] == looked_up, sums
    assert any(r["caller"] == "EmbeddingBagBackward0" for r in rows)  # backward ops: their autograd node
    assert all(r["ms"] >= 0 and r["calls"] > 0 for r in rows)


def test_mfu_benchmark_runs_compile_settings_side_by_side_against_the_first():
    """`--precisions bf16@dense bf16@model`: each run's engine command carries its own compile setting, and each
    variant is compared with the first (loss after the same steps, samples/s ratio, per repeat)."""
    import argparse
    from pathlib import Path

    from benchmarks.mfu import compare_runs, engine_command, run_variant

    assert run_variant("fp8:rowwise@model") == ("fp8", "rowwise", "model")
    assert run_variant("bf16") == ("bf16", None, None)
    with pytest.raises(ValueError, match="compile must be one of"):
        run_variant("bf16@everything")
    args = argparse.Namespace(width=1.0, depth=1.0, set=[], max_history_len=0, fp8_recipes=["tensorwise_triton"],
                              compile="dense", activation_checkpointing="none", seed=0, unit_prefetch=False,
                              data=Path("data"), preset="gem_gpu", nproc=1, device="cuda", steps=3,
                              warmup_steps=1, profile_steps=2, profiler="python", plans=None)
    commands = {v: engine_command(args, {}, v, Path("r.json")) for v in ("bf16", "bf16@model")}
    assert [commands[v][commands[v].index("--compile") + 1] for v in commands] == ["dense", "model"]
    assert all(c[c.index("--mfu-profiler") + 1] == "python" for c in commands.values())
    assert all(str(Path("data") / "plans") in c for c in commands.values())
    repeated = engine_command(argparse.Namespace(**{**vars(args), "plans": Path("data/plans_repeat_7")}), {}, "bf16",
                              Path("r.json"))
    assert str(Path("data/plans_repeat_7")) in repeated and str(Path("data") / "plans") not in repeated

    base = [{"losses": [1.0] * 8, "samples_per_second": 100.0}, {"losses": [1.0] * 8, "samples_per_second": 110.0}]
    runs = [{"losses": [1.01] * 8, "samples_per_second": 120.0}, {"losses": [1.0] * 8, "samples_per_second": 121.0}]
    compared = compare_runs("bf16@dense", base, runs)
    assert compared["relative_difference"] == pytest.approx(0.01)
    assert compared["samples_per_second_ratio"] == pytest.approx(120.5 / 105.0)
    assert compared["paired_ratios"] == pytest.approx([1.2, 121.0 / 110.0])


def test_mfu_benchmark_starts_no_run_that_the_time_left_cannot_finish():
    """A run cut by the time budget spends device time and leaves nothing: with less time left than the shortest
    earlier run of its kind, it is skipped before anything starts (args are not even read)."""
    from benchmarks.mfu import end_to_end

    skipped = end_to_end(None, "preset", {}, "fp8@model", seconds_left=150.0, seconds_needed=240.0)
    assert skipped == {"skipped": "time budget: 150 s left, a run takes 240 s"}
    assert "skipped" in end_to_end(None, "preset", {}, "bf16", seconds_left=59.0)


def test_a_variants_cold_first_run_does_not_hold_back_its_repeats():
    """A variant's first run compiles (250 s); a repeat of another variant at the shape shows a warm run's time
    (95 s): its next repeat is started with 100 s left, not skipped as one of 250 s."""
    from benchmarks.mfu import seconds_needed

    runs = {"w/bf16@model": [{"wall_seconds": 250.0}],
            "w/bf16@model+X=1": [{"wall_seconds": 120.0}, {"wall_seconds": 95.0}],
            "other/bf16@model": [{"wall_seconds": 30.0}, {"wall_seconds": 20.0}],
            "w/fp8@model": [{"skipped": "time budget"}]}
    assert seconds_needed(runs, "w", "w/bf16@model") == 95.0  # a repeat elsewhere at this shape, not another shape's
    assert seconds_needed(runs, "w", "w/bf16@model+X=1") == 95.0  # its own shortest
    assert seconds_needed(runs, "w", "w/fp8@model") == 60.0  # none of its own yet
    assert seconds_needed({"w/a": [{"wall_seconds": 250.0}], "w/b": [{"wall_seconds": 80.0}]}, "w", "w/a") == 250.0


def test_a_run_stopped_by_the_budget_after_writing_its_result_keeps_its_figures(monkeypatch, capsys):
    """The job writes its result, then shuts down; a budget that ends during the shutdown keeps the figures."""
    import sys

    import benchmarks.mfu as mfu

    host = {"data": [0.001, 0.003], "forward": [0.05, 0.07], "backward": [0.1, 0.1], "optimizer": [0.01, 0.01]}
    report = {"mfu": 0.3, "mfu_median_step": 0.31, "model_tflops": 300.0, "samples_per_second": 4500.0,
              "step_seconds_mean": 0.2, "step_seconds_median": 0.2, "step_host_seconds": host}
    result = {"path": "engine", "world_size": 1, "embedding_sharding": "none", "mfu_report": report}

    def job(args, shape, variant, output):
        script = (f"import pathlib, time; pathlib.Path({str(output)!r}).write_text({json.dumps(result)!r}); "
                  "time.sleep(60)")
        return [sys.executable, "-c", script]

    monkeypatch.setattr(mfu, "engine_command", job)
    run = mfu.end_to_end(None, "preset", {}, "bf16", seconds_left=3.0, seconds_needed=0.0)
    assert run["cut_after_its_result"] and run["mfu_window_mean"] == 0.3 and run["samples_per_second"] == 4500.0
    # the host's time by phase kept per step, and printed as the window's means
    assert run["step_host_seconds"] == host
    assert ("host queuing a step, mean over the window: data 2.0 ms, forward 60.0 ms, backward 100.0 ms, "
            "optimizer 10.0 ms") in capsys.readouterr().out
    # Stopped before it wrote anything: no figures.
    monkeypatch.setattr(mfu, "engine_command", lambda *a: [sys.executable, "-c", "import time; time.sleep(60)"])
    assert mfu.end_to_end(None, "preset", {}, "bf16", seconds_left=1.0, seconds_needed=0.0)["error"].startswith(
        "timed out")


def test_a_runs_name_sets_environment_variables_of_its_job_alone(monkeypatch):
    """`--precisions bf16@model bf16@model+JAGGED_ATTENTION_SPLIT_HEAD=0`: the second run's job sees the setting, the
    first's does not, and a malformed setting is refused with the run's name."""
    import sys

    import benchmarks.mfu as mfu

    name = "bf16@model+JAGGED_ATTENTION_SPLIT_HEAD=1+JAGGED_ATTENTION_ATOMIC_DQ=short"
    assert mfu.run_variant(name) == ("bf16", None, "model")
    assert mfu.run_environment(name) == {"JAGGED_ATTENTION_SPLIT_HEAD": "1", "JAGGED_ATTENTION_ATOMIC_DQ": "short"}
    assert mfu.run_environment("bf16@model") == {}
    for bad in ("bf16+split", "bf16+lower_case=1"):
        with pytest.raises(ValueError, match=re.escape(f"run {bad}:")):
            mfu.run_environment(bad)
    monkeypatch.delenv("JAGGED_ATTENTION_SPLIT_HEAD", raising=False)
    report = {"mfu": 0.3, "mfu_median_step": 0.31, "model_tflops": 300.0, "samples_per_second": 4500.0,
              "step_seconds_mean": 0.2, "step_seconds_median": 0.2}

    def job(args, shape, variant, output):
        script = ("import json, os, pathlib; pathlib.Path(%r).write_text(json.dumps({'path': "
                  "os.environ.get('JAGGED_ATTENTION_SPLIT_HEAD', 'unset'), 'world_size': 1, "
                  "'embedding_sharding': 'none', 'mfu_report': %r}))" % (str(output), report))
        return [sys.executable, "-c", script]

    monkeypatch.setattr(mfu, "engine_command", job)
    runs = {v: mfu.end_to_end(None, "preset", {}, v, seconds_left=60.0, seconds_needed=0.0)
            for v in ("bf16", "bf16+JAGGED_ATTENTION_SPLIT_HEAD=1")}
    assert runs["bf16"]["path"] == "unset" and runs["bf16"]["environment"] == {}
    assert runs["bf16+JAGGED_ATTENTION_SPLIT_HEAD=1"]["path"] == "1"


def test_a_runs_name_sets_training_settings_of_its_job_alone():
    """`bf16@model+train.step_readout=each_step`: a TrainConfig field reaches that run's job as its flag."""
    import argparse

    import benchmarks.mfu as mfu

    name = "bf16@model+train.step_readout=each_step+JAGGED_ATTENTION_TMA=0"
    assert mfu.run_train_settings(name) == {"step_readout": "each_step"}
    assert mfu.run_environment(name) == {"JAGGED_ATTENTION_TMA": "0"}
    with pytest.raises(ValueError, match=re.escape("run bf16+train.later=1: 'later' is not a TrainConfig field")):
        mfu.run_train_settings("bf16+train.later=1")
    args = argparse.Namespace(width=1.0, depth=1.0, set=[], max_history_len=0, fp8_recipes=["tensorwise_triton"],
                              compile="model", activation_checkpointing="none", seed=0, unit_prefetch=False,
                              data=Path("data"), preset="gem_gpu", nproc=1, device="cuda", steps=2, warmup_steps=1,
                              profile_steps=0, profiler="torch", plans=None)
    from gem_ops.train.__main__ import parse_args

    command = mfu.engine_command(args, {}, name + "+train.unit_prefetch=true", Path("result.json"))
    job = parse_args(command[command.index("gem_ops.train") + 1:])  # the flags as the job reads them
    assert (job.step_readout, job.unit_prefetch) == ("each_step", True)  # values read as JSON: true is a boolean
    assert "--step-readout" not in mfu.engine_command(args, {}, "bf16@model", Path("result.json"))


def test_step_ratios_compare_the_same_batches_and_replace_chosen_steps():
    from benchmarks.mfu_step_ratios import compare

    before = {"step_seconds": [1.0, 2.0, 1.0], "step_flops": [10.0, 20.0, 10.0], "peak_flops": 10.0,
              "mfu_window_mean": 1.0}
    after = dict(before, step_seconds=[0.9, 4.0, 0.8], mfu_window_mean=40 / 5.7 / 10)
    figures = compare(before, after, replace_steps=[1])
    assert figures["steps_compared"] == 2 and abs(figures["step_ratio_mean"] - 0.85) < 1e-12
    assert abs(figures["mfu_window_mean_with_replaced_steps"] - 40 / 3.7 / 10) < 1e-12
    with pytest.raises(ValueError, match="same batches"):
        compare(before, dict(after, step_flops=[1.0, 2.0, 3.0]), [])


def test_a_repeated_step_plan_gives_every_step_that_steps_examples_per_rank(tmp_path):
    """mfu_data.py --repeat-step: each rank's batch of the chosen step at every step, the plan's metadata kept."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from benchmarks.mfu_data import repeated_step_plan
    from gem_ops.data.batch_shuffling import read_rank_plan

    examples = pa.array([[10 * s + r, 10 * s + r + 100] for s in range(3) for r in range(2)], pa.list_(pa.int64(), 2))
    table = pa.table({"step": pa.array([0, 0, 1, 1, 2, 2], pa.int32()), "rank": pa.array([0, 1] * 3, pa.int32()),
                      "cost": [float(i) for i in range(6)], "examples": examples})
    path = tmp_path / "plans" / "world_size=2.parquet"
    path.parent.mkdir()
    pq.write_table(table.replace_schema_metadata({"gem.plan": '{"world_size": 2}'}), path)
    out = repeated_step_plan(path, 1)
    assert out == tmp_path / "plans_repeat_1" / "world_size=2.parquet"
    for rank in (0, 1):
        assert read_rank_plan(out, rank).tolist() == [[10 + rank, 110 + rank]] * 3
    assert pq.read_schema(out).metadata[b"gem.plan"] == b'{"world_size": 2}'
    with pytest.raises(SystemExit, match="--repeat-step 5"):
        repeated_step_plan(path, 5)
