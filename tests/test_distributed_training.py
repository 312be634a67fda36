"""The engine across processes (torchrun, gloo, CPU): 2 ranks take the same steps as one process on the
union of their batches, for each way of sharding the tables, and as one process without torchrun; a job
killed with SIGKILL resumes from its last checkpoint; torchrun restarts a job whose rank failed and it
completes (faults injected by tests/fault_drill.py, which wraps the production entry point)."""

import dataclasses
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from datetime import date
from pathlib import Path

import psutil
import pytest
import torch

from gem_ops.data.batch_shuffling import ShufflingConfig
from gem_ops.data.prepare import prepare_training_data
from gem_ops.data.raw_event_logs import EventSource
from gem_ops.data.sequence_logs import SequenceLogsConfig
from gem_ops.data.synthetic import STRONG_SIGNAL
from gem_ops.model.config import model_config
from gem_ops.train.checkpoint import checkpoint_steps, load_checkpoint
from gem_ops.train.config import TrainConfig
from gem_ops.train.engine import train
from gem_ops.train.launch import torchrun_prefix
from gem_ops.train.model_state import load_model_state, model_from_state

PROJECT_ROOT = Path(__file__).resolve().parents[1]
TINY = model_config("vertical", width=0.5, **{"sequence.max_history_len": 16})
TINY_ARGS = ["--preset", "vertical", "--width", "0.5", "--model-override", "sequence.max_history_len=16"]
STEPS = 6
CONFIG = TrainConfig(max_steps=STEPS, eval_max_examples=128, warmup_steps=2, log_every=2)
CONFIG_ARGS = ["--max-steps", str(STEPS), "--eval-max-examples", "128", "--warmup-steps", "2", "--log-every", "2"]
# Same examples, weights and updates; only float summation order differs (all-to-all and reduce-scatter
# sum in another order than one process does). Measured: <= 2e-7 relative over 6 steps.
LOSS_RTOL = 1e-5
JOB_TIMEOUT_S = 120


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    small = dataclasses.replace(STRONG_SIGNAL, n_users=400)
    return prepare_training_data(
        EventSource("synthetic", small), date(2026, 11, 4), 4, tmp_path_factory.mktemp("distributed"),
        SequenceLogsConfig(max_history_len=32, eval_days=1), ShufflingConfig(sub_batch_size=16, sub_batches_per_rank=4),
        world_sizes=(1, 2),
    )


@pytest.fixture(scope="module")
def union_run(data, tmp_path_factory):
    """One process (in this one, no torchrun) on the union of both ranks' rows of the world_size=2 plan."""
    return train(data.open(), data.plans[2], TINY, CONFIG, embedding_sharding="table_wise",
                 checkpoint_dir=tmp_path_factory.mktemp("union"), union_of_ranks=True)[1]


@pytest.fixture(scope="module")
def row_wise_job(data, tmp_path_factory) -> dict:
    """The 2-rank job on row-wise tables, watched while it runs for the sockets its processes listen on: the
    comparison with one process and the loopback check both read this one job."""
    folder = tmp_path_factory.mktemp("row_wise")
    proc = start_job(data, folder / "checkpoints", folder / "result.json", "--embedding-sharding", "row_wise")
    listening: set[tuple[str, int, str]] = set()
    try:
        while proc.poll() is None:
            try:
                tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
            except psutil.NoSuchProcess:
                break
            for process in tree:
                try:
                    listening |= {(c.laddr.ip, c.laddr.port, " ".join(process.cmdline()[:4]))
                                  for c in process.net_connections("inet")
                                  if c.status == psutil.CONN_LISTEN}
                except (psutil.NoSuchProcess, psutil.AccessDenied):
                    pass
            time.sleep(0.1)
    finally:
        result = finish(proc, folder / "result.json")
    return {"result": result, "log": (folder / "result.log").read_text(), "listening": listening}


def start_job(data, checkpoint_dir: Path, result: Path, *extra: str, max_restarts: int = 0,
              env: dict[str, str] | None = None, nproc: int = 2) -> subprocess.Popen:
    # With faults to inject, the test's wrapper of the entry point; else the production one.
    module = "tests.fault_drill" if env and any(k.startswith("GEM_TRAIN_") for k in env) else "gem_ops.train"
    cmd = [*torchrun_prefix(nproc, max_restarts), "-m", module,
           "--sequence-logs", str(data.sequence_logs), "--plans", str(data.plans[2].parent),
           *TINY_ARGS, *CONFIG_ARGS, "--checkpoint-dir", str(checkpoint_dir), "--result-json", str(result), *extra]
    log = open(result.with_suffix(".log"), "wb")
    return subprocess.Popen(cmd, cwd=PROJECT_ROOT, env={**os.environ, **(env or {})}, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)


def stop_group(proc: subprocess.Popen) -> None:
    """SIGKILL to torchrun's process group and to each rank's: torchrun starts every rank in a session of its own."""
    try:
        ranks = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        ranks = []
    groups = {proc.pid}
    for child in ranks:
        try:
            groups.add(os.getpgid(child.pid))
        except ProcessLookupError:
            pass
    for group in groups:
        try:
            os.killpg(group, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(timeout=30)
    psutil.wait_procs(ranks, timeout=30)


def finish(proc: subprocess.Popen, result: Path) -> dict:
    try:
        code = proc.wait(timeout=JOB_TIMEOUT_S)
    finally:
        stop_group(proc)
    log = result.with_suffix(".log").read_text(errors="replace")
    assert code == 0, f"torchrun exited with {code}:\n{log[-6000:]}"
    return json.loads(result.read_text())


def run_job(data, tmp_path: Path, *extra: str, **kwargs) -> dict:
    return finish(start_job(data, tmp_path / "checkpoints", tmp_path / "result.json", *extra, **kwargs),
                  tmp_path / "result.json")


# TorchRec's row-wise sharding and FSDP2 in the default run; table-wise and FSDP2's prefetch order with the slow tests
# Steps read late (the next one queued first, figures gathered between the hosts) with row-wise tables.
@pytest.mark.parametrize("sharding", [pytest.param("table_wise", marks=pytest.mark.slow), "row_wise",
                                      "row_wise+next_step", "fsdp",
                                      pytest.param("fsdp+unit_prefetch", marks=pytest.mark.slow)])
def test_two_ranks_match_one_process_on_the_same_batches(data, union_run, sharding, tmp_path, request):
    sharding, _, option = sharding.partition("+")
    flags = {"unit_prefetch": ["--unit-prefetch"], "next_step": ["--step-readout", "next_step"], "": []}[option]
    if (sharding, option) == ("row_wise", ""):
        job = request.getfixturevalue("row_wise_job")
        result, log = job["result"], job["log"]
    else:
        result = run_job(data, tmp_path, "--embedding-sharding", sharding, *flags)
        log = (tmp_path / "result.log").read_text()
    assert ("FSDP2 prefetch set over" in log) == (option == "unit_prefetch")
    assert ("steps read late" in log) == (option == "next_step")
    assert result["world_size"] == 2 and result["embedding_sharding"] == sharding and result["steps"] == STEPS
    assert result["losses"] == pytest.approx(union_run.losses, rel=LOSS_RTOL)
    assert all(v.startswith(sharding if sharding != "fsdp" else "fsdp") for v in result["sharding_plan"].values())
    # The imbalance seen: compute time (noisy on a shared CPU) and tokens (as the plan balanced them).
    assert result["imbalance_observed"] >= 1.0
    assert 1.0 <= result["imbalance_observed.tokens"] < 1.05
    assert result["eval.all.click.auc"] == pytest.approx(union_run.final_report["all/click"]["auc"], abs=1e-4)
    # The exported full weights rebuild the plain model, equal to the final sharded checkpoint's.
    model = model_from_state(load_model_state(result["model_state"]))
    final = load_checkpoint(result["checkpoint"])
    assert final.step == STEPS
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, final.state["model"][name], msg=lambda m: f"{name}: {m}")


def test_killed_job_resumes_from_its_last_checkpoint(data, union_run, tmp_path):
    checkpoints, result = tmp_path / "checkpoints", tmp_path / "result.json"
    slow = {"GEM_TRAIN_STEP_DELAY_S": "1.0"}
    job = start_job(data, checkpoints, result, "--embedding-sharding", "row_wise", "--checkpoint-every", "2", env=slow)
    try:
        deadline = time.monotonic() + JOB_TIMEOUT_S
        while not checkpoint_steps(checkpoints) and job.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        stop_group(job)  # SIGKILL to torchrun and every rank, mid-run
    saved = checkpoint_steps(checkpoints)
    assert saved and saved[-1] < STEPS and not result.exists(), "the job was not killed between checkpoints"

    resumed = finish(start_job(data, checkpoints, result, "--embedding-sharding", "row_wise",
                               "--checkpoint-every", "2"),
                     result)
    assert resumed["resumed_from"] == saved[-1] and resumed["steps"] == STEPS
    assert len(resumed["losses"]) == STEPS
    assert resumed["losses"] == pytest.approx(union_run.losses, rel=LOSS_RTOL)


def test_torchrun_restarts_a_failed_rank_and_the_job_completes(data, union_run, tmp_path):
    drill = {"GEM_TRAIN_FAIL_AT_STEP": "3", "GEM_TRAIN_FAIL_RANK": "1"}
    result = run_job(data, tmp_path, "--embedding-sharding", "table_wise", "--checkpoint-every", "2",
                     max_restarts=1, env=drill)
    log = (tmp_path / "result.log").read_text(errors="replace")
    assert "rank fails after step 3 on purpose" in log
    assert result["resumed_from"] == 2 and result["steps"] == STEPS
    assert result["losses"] == pytest.approx(union_run.losses, rel=LOSS_RTOL)


@pytest.mark.parametrize("sharding", [pytest.param("row_wise", marks=pytest.mark.slow), "fsdp"])
def test_two_ranks_keep_and_resume_the_weight_average_of_one_process(data, sharding, tmp_path):
    """Each rank averages its own shards (TorchRec's sharded tables, FSDP2's DTensors) and checkpoints them under
    its rank: a job whose rank fails after step 3 resumes at step 2 and keeps the average one process keeps."""
    config = dataclasses.replace(CONFIG, weight_average_decay=0.8)
    _, union = train(data.open(), data.plans[2], TINY, config, embedding_sharding="table_wise",
                     checkpoint_dir=tmp_path / "union", union_of_ranks=True, export_model_state=True)
    drill = {"GEM_TRAIN_FAIL_AT_STEP": "3", "GEM_TRAIN_FAIL_RANK": "1"}
    result = run_job(data, tmp_path, "--embedding-sharding", sharding, "--checkpoint-every", "2",
                     "--weight-average-decay", "0.8", max_restarts=1, env=drill)
    assert result["resumed_from"] == 2 and result["steps"] == STEPS
    kept = model_from_state(load_model_state(result["model_state"])).state_dict()
    # atol 1e-4: the keys' bias has no true gradient (softmax ignores a shift), so Adam steps on the summation
    # noise that differs between 2 ranks and one process (up to 6e-5 here); a lost or unresumed average is ~1e-3 off
    for name, value in load_model_state(union.model_state_path)["model"].items():
        torch.testing.assert_close(kept[name], value, rtol=1e-4, atol=1e-4, msg=lambda m: f"{name}: {m}")


def test_one_process_matches_two_ranks_through_the_same_engine(data, union_run, tmp_path):
    """The engine on one rank (torchrun with one process, the plain model: nothing to shard) on the
    world_size=2 plan's union against the 2-rank runs above: the same losses."""
    result = run_job(data, tmp_path, "--plan-world-size", "2", "--union-of-ranks", nproc=1)
    assert result["world_size"] == 1 and result["embedding_sharding"] == "none"
    assert result["losses"] == pytest.approx(union_run.losses, rel=LOSS_RTOL)


def test_plan_for_another_world_size_is_refused(data, tmp_path):
    with pytest.raises(ValueError, match="made for world size 2, the job has 1"):
        train(data.open(), data.plans[2], TINY, CONFIG, checkpoint_dir=tmp_path)


def test_two_nodes_train_under_an_hsdp_mesh(data, union_run, tmp_path):
    """Two torchrun agents of one process each, as two nodes would run them: dense layers get the 2-D
    (replicate x shard) mesh, and the job still trains like one process on the union of the batches."""
    port = _free_port()
    agents, results = [], []
    for node in range(2):
        result = tmp_path / f"node{node}.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
               "--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", str(port),
               "-m", "gem_ops.train", "--sequence-logs", str(data.sequence_logs), "--plans", str(data.plans[2].parent),
               *TINY_ARGS, *CONFIG_ARGS, "--embedding-sharding", "table_wise",
               "--checkpoint-dir", str(tmp_path / "checkpoints"), "--result-json", str(result)]
        log = open(result.with_suffix(".log"), "wb")
        agents.append(subprocess.Popen(cmd, cwd=PROJECT_ROOT, stdout=log, stderr=subprocess.STDOUT,
                                       start_new_session=True))
        results.append(result)
    worker = agents[1]
    try:
        assert worker.wait(timeout=JOB_TIMEOUT_S) == 0, \
            results[1].with_suffix(".log").read_text(errors="replace")[-4000:]
        head = finish(agents[0], results[0])
    finally:
        for agent in agents:
            stop_group(agent)
    log = results[0].with_suffix(".log").read_text(errors="replace")
    assert "2 node(s)" in log and "mesh (2, 1)" in log, log[-3000:]
    assert head["world_size"] == 2 and head["steps"] == STEPS
    assert head["losses"] == pytest.approx(union_run.losses, rel=LOSS_RTOL)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_job_listens_on_loopback_alone(row_wise_job):
    """Every socket the torchrun agent and its ranks listen on is bound to the loopback address, not to
    every interface."""
    listening = row_wise_job["listening"]
    assert listening, "saw no listening socket: the probe missed the job"
    assert all(ip in ("127.0.0.1", "::1") for ip, _, _ in listening), sorted(listening)


def test_the_job_ends_with_the_process_that_started_it(data, tmp_path):
    """An asset's step killed with SIGKILL (no chance to stop anything): the torchrun agent it started and
    the agent's ranks stop too, rather than training on and registering a model nobody asked for."""
    starter = textwrap.dedent(f"""
        import subprocess, sys, time
        from gem_ops.train.launch import torchrun_prefix
        cmd = [*torchrun_prefix(2), "-m", "gem_ops.train", "--sequence-logs", {str(data.sequence_logs)!r},
               "--plans", {str(data.plans[2].parent)!r}, *{TINY_ARGS!r}, "--max-steps", "100000",
               "--epochs", "1000", "--checkpoint-dir", {str(tmp_path / "checkpoints")!r}]
        job = subprocess.Popen(cmd)
        print(job.pid, flush=True)
        time.sleep(600)
    """)
    parent = subprocess.Popen([sys.executable, "-c", starter], cwd=PROJECT_ROOT, stdout=subprocess.PIPE, text=True)
    agent = psutil.Process(int(parent.stdout.readline()))
    deadline = time.monotonic() + 60
    while len(agent.children(recursive=True)) < 2 and time.monotonic() < deadline:  # both ranks started
        time.sleep(0.2)
    ranks = agent.children(recursive=True)
    assert len(ranks) >= 2
    parent.kill()
    parent.wait()
    gone, alive = psutil.wait_procs([agent, *ranks], timeout=60)
    for process in alive:
        process.kill()
    assert not alive, [p.pid for p in alive]
