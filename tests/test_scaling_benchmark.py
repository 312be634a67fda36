"""The weak-scaling benchmark (benchmarks/distributed_training.py) through the engine's torchrun job on 1 and 2 CPU
ranks (gloo): samples/s and efficiency over the timed windows, each rank's planned against observed forward
seconds, and the losses after the same samples; and the per-rank figures the engine keeps for it."""

import json
import math
import subprocess
import sys
from pathlib import Path
from unittest import mock

import numpy as np
import pytest

from benchmarks import mfu_data
from benchmarks.distributed_training import loss_after_same_samples, scaling
from gem_ops.train.step_balance import MEASURES, BalanceLog

ROOT = Path(__file__).resolve().parents[1]
PER_RANK_BATCH = 128


def test_the_balance_log_keeps_each_ranks_figures_and_resumes_an_older_record_aligned():
    log = BalanceLog()
    log.add(0, np.array([[1.0, 10, 100], [3.0, 10, 100]]))
    log.add(1, np.array([[2.0, 12, 144], [2.0, 8, 64]]))
    assert log.ranks["compute_seconds"] == [[1.0, 3.0], [2.0, 2.0]] and log.ranks["tokens"][1] == [12.0, 8.0]
    assert log.observed()["compute_seconds"] == pytest.approx(5 / 4)
    again = BalanceLog.from_dict(json.loads(json.dumps(log.to_dict())))
    assert again == log
    older = {k: v for k, v in log.to_dict().items() if k != "ranks"}  # saved before ranks were kept
    resumed = BalanceLog.from_dict(older)
    resumed.add(2, np.array([[1.0, 5, 25], [1.0, 5, 25]]))
    assert all(len(resumed.ranks[m]) == len(resumed.steps) == 3 for m in MEASURES)
    assert resumed.ranks["tokens"] == [[], [], [5.0, 5.0]]


def _run(world: int, losses: list[float], samples_per_second: float, steps: int = 4) -> dict:
    return {"losses": losses, "samples_per_second": samples_per_second, "steps": steps,
            "seconds": steps * world * 10 / samples_per_second, "step_seconds_mean": 0.1, "step_seconds_median": 0.1,
            "mfu_window_mean": 0.3, "embedding_sharding": "auto", "world_size": world}


def test_losses_are_compared_over_the_same_samples_and_efficiency_against_one_rank():
    one = _run(1, [float(i) for i in range(12)], 100.0)
    two = _run(2, [10.0 * i for i in range(6)], 180.0)
    compared = loss_after_same_samples({1: one, 2: two}, samples_per_rank_step=10)
    # 12 one-rank steps = 6 two-rank steps: the last 4 of the two-rank run (samples 40..120), steps 4..11 of one
    assert compared["samples"] == 120 and compared["window_samples"] == 80
    assert compared["loss"] == {"1": np.mean(range(4, 12)), "2": np.mean([20.0, 30, 40, 50])}
    short = loss_after_same_samples({1: _run(1, [1.0] * 5, 100.0), 2: two}, samples_per_rank_step=10)
    assert short["samples"] == 40 and short["loss"]["2"] == np.mean([0.0, 10.0])  # only 4 one-rank steps in common
    figures = scaling({1: one, 2: two})
    assert figures["2"]["scaling_efficiency"] == pytest.approx(0.9)
    assert figures["1"]["scaling_efficiency"] == 1.0
    assert figures["2"]["exposed_communication_seconds_per_step"].startswith("not measured")


@pytest.fixture(scope="module")
def scaling_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("scaling")
    data, output = root / "data", root / "scaling.json"
    # The data step in this process (no interpreter to start); the benchmark in its own, as it is run.
    with mock.patch.object(sys, "argv", ["mfu_data", str(data), "--batch-size", str(PER_RANK_BATCH),
                                         "--max-history-len", "32", "--world-sizes", "1", "2"]):
        mfu_data.main()
    subprocess.run([sys.executable, "-m", "benchmarks.distributed_training", "--device", "cpu", "--data", str(data),
                    "--preset", "vertical", "--max-history-len", "32", "--steps", "6", "--warmup-steps", "2",
                    "--profile-steps", "0", "--precision", "fp32", "--compile", "none", "--output-name",
                    str(output.with_suffix(""))], cwd=ROOT, check=True, timeout=600)
    return json.loads(output.read_text())


def test_both_world_sizes_run_the_engines_torchrun_job_with_the_same_per_rank_batch(scaling_run):
    runs = scaling_run["results"]["runs"]
    assert {w: (r["path"], r["launch"], r["world_size"]) for w, r in runs.items()} == {
        "1": ("engine", "torchrun", 1), "2": ("engine", "torchrun", 2)}
    for w, r in runs.items():
        assert r["samples_per_second"] * r["seconds"] / r["steps"] == pytest.approx(int(w) * PER_RANK_BATCH, rel=1e-6)
    figures = scaling_run["results"]["per_world_size"]
    assert figures["2"]["scaling_efficiency"] == pytest.approx(
        runs["2"]["samples_per_second"] / (2 * runs["1"]["samples_per_second"]))
    assert figures["1"]["rank_balance"] is None  # one rank: nothing to balance


def test_each_rank_is_planned_against_what_it_took(scaling_run):
    balance = scaling_run["results"]["per_world_size"]["2"]["rank_balance"]
    ranks = balance["per_rank"]
    measures = scaling_run["results"]["runs"]["2"]["rank_measures"]
    assert len(ranks) == 2 and balance["steps"] == len(measures["tokens"]) == 6
    for r, figures in enumerate(ranks):
        assert figures["tokens"] == sum(step[r] for step in measures["tokens"]) > 0
        assert figures["observed_seconds"] == pytest.approx(sum(step[r] for step in measures["compute_seconds"]))
        assert figures["planned_seconds"] > 0
    assert ranks[0]["tokens"] == pytest.approx(ranks[1]["tokens"], rel=0.05)  # Base Batch Shuffling balanced them
    assert balance["imbalance"]["planned"] < 1.05 and balance["imbalance"]["observed"] >= 1.0


def test_the_losses_after_the_same_samples_are_reported(scaling_run):
    compared = scaling_run["results"]["loss_after_same_samples"]
    assert compared["samples"] > 0 and compared["samples"] % (2 * PER_RANK_BATCH) == 0
    assert all(math.isfinite(v) and v > 0 for v in compared["loss"].values())
    assert set(compared["relative_difference"]) == {"2"}
