"""Soak test of the training job under faults: the job `gem_foundation_model` launches (torchrun, 2 ranks,
restarts allowed, logging to a real MLflow SQLite store) runs again and again, and at random moments one
rank is SIGKILLed (torchrun restarts the group, which resumes from the last checkpoint) or the whole job
is (it is started again on the same checkpoint folder and MLflow run, and resumes). Every run must end
with all its steps: the last checkpoint at the final step, and an MLflow `train.loss` for every step.
Counts (runs, kills of each kind, resumes, steps trained twice, failures) are saved as JSON.

    python benchmarks/soak.py --runs 6 --steps 240 --seed 0
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from datetime import date
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from benchmarks.common import save  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MODEL_ARGS = ["--preset", "vertical", "--width", "0.5", "--model-override", "sequence.max_history_len=16",
              "--eval-max-examples", "128", "--warmup-steps", "2"]


def prepare(root: Path, world_sizes: tuple[int, ...] = (2,)):
    from gem_ops.data.batch_shuffling import ShufflingConfig
    from gem_ops.data.prepare import prepare_training_data
    from gem_ops.data.raw_event_logs import EventSource
    from gem_ops.data.sequence_logs import SequenceLogsConfig
    from gem_ops.data.synthetic import STRONG_SIGNAL

    return prepare_training_data(EventSource("synthetic", replace(STRONG_SIGNAL, n_users=400)), date(2026, 11, 4), 4,
                                 root, SequenceLogsConfig(max_history_len=32, eval_days=1),
                                 ShufflingConfig(sub_batch_size=16, sub_batches_per_rank=4), world_sizes=world_sizes)


def start(data, folder: Path, run_id: str, tracking_uri: str, args) -> subprocess.Popen:
    from gem_ops.train.launch import torchrun_prefix

    cmd = [*torchrun_prefix(2, max_restarts=args.max_restarts), "-m", "gem_ops.train",
           "--sequence-logs", str(data.sequence_logs), "--plans", str(data.plans[2].parent), *MODEL_ARGS,
           "--max-steps", str(args.steps), "--epochs", "100", "--checkpoint-every", str(args.checkpoint_every),
           "--log-every", str(args.log_every), "--checkpoint-dir", str(folder / "checkpoints"),
           "--mlflow-run-id", run_id, "--mlflow-tracking-uri", tracking_uri,
           "--result-json", str(folder / "result.json")]
    log = open(folder / "job.log", "ab")
    return subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})


def ranks_of(job: subprocess.Popen) -> list:
    import psutil

    try:
        return [p for p in psutil.Process(job.pid).children(recursive=True) if "gem_ops.train" in " ".join(p.cmdline())]
    except psutil.Error:
        return []


def kill_job(job: subprocess.Popen) -> None:
    import psutil

    processes = [psutil.Process(job.pid), *psutil.Process(job.pid).children(recursive=True)]
    groups = {os.getpgid(p.pid) for p in processes if p.is_running()}
    for group in groups:
        try:
            os.killpg(group, signal.SIGKILL)
        except ProcessLookupError:
            pass
    job.wait()
    psutil.wait_procs(processes, timeout=30)


def checkpointed_step(folder: Path) -> int:
    from gem_ops.train.checkpoint import checkpoint_steps

    steps = checkpoint_steps(folder / "checkpoints")
    return steps[-1] if steps else 0


def soak_one(index: int, data, client, experiment: str, tracking_uri: str, work: Path, rng: random.Random,
             args) -> dict:
    """One training run to its end through random kills; what happened and whether it ended whole."""
    from gem_ops.train.checkpoint import checkpoint_steps

    folder = work / f"run_{index}"
    folder.mkdir()
    run_id = client.create_run(experiment, run_name=f"soak {index}").info.run_id
    kills = {"rank": 0, "job": 0}
    starts, redone, events = 0, 0, []
    job = start(data, folder, run_id, tracking_uri, args)
    starts += 1
    began = time.monotonic()
    while True:
        wait = rng.uniform(*args.kill_after_s)
        deadline = time.monotonic() + wait
        while job.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        if job.poll() is not None:
            break
        if time.monotonic() - began > args.run_timeout_s:
            kill_job(job)
            events.append("timed out")
            break
        done_steps = len({m.step for m in client.get_metric_history(run_id, "train.loss")})
        resumed_from = checkpointed_step(folder)
        kind = rng.choice(["rank", "job"]) if kills["rank"] + kills["job"] < args.max_kills else None
        if kind is None:
            continue
        if kind == "rank":
            ranks = ranks_of(job)
            if not ranks:
                continue
            rng.choice(ranks).kill()
        else:
            kill_job(job)
        kills[kind] += 1
        redone += max(0, done_steps - resumed_from)
        events.append(f"{kind} killed after {done_steps} logged steps, checkpoint at {resumed_from}")
        if kind == "job":
            job = start(data, folder, run_id, tracking_uri, args)
            starts += 1
    code = job.wait()
    logged = sorted({m.step for m in client.get_metric_history(run_id, "train.loss")})
    result = json.loads((folder / "result.json").read_text()) if (folder / "result.json").exists() else {}
    whole = (code == 0 and result.get("steps") == args.steps
             and checkpoint_steps(folder / "checkpoints")[-1:] == [args.steps]
             and len(logged) == args.steps and logged[-1] - logged[0] == args.steps - 1)
    client.set_terminated(run_id, "FINISHED" if whole else "FAILED")
    return {"run": index, "exit_code": code, "starts": starts, "kills": kills, "steps_trained_twice": redone,
            "logged_steps": len(logged), "final_checkpoint": checkpointed_step(folder), "complete": whole,
            "seconds": round(time.monotonic() - began, 1), "events": events}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=6)
    parser.add_argument("--steps", type=int, default=240)
    parser.add_argument("--checkpoint-every", type=int, default=25)
    parser.add_argument("--log-every", type=int, default=7, help="not a divisor of --checkpoint-every on purpose")
    parser.add_argument("--max-restarts", type=int, default=3)
    parser.add_argument("--max-kills", type=int, default=3, help="per run")
    parser.add_argument("--kill-after-s", type=float, nargs=2, default=[6.0, 18.0])
    parser.add_argument("--run-timeout-s", type=float, default=600.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-name", default="soak")
    args = parser.parse_args()

    from gem_ops.tracking import ensure_experiment, tracking_client

    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory(prefix="gem-soak-") as tmp:
        work = Path(tmp)
        data = prepare(work / "data")
        tracking_uri = f"sqlite:///{work / 'mlflow.db'}"
        client = tracking_client(tracking_uri)
        experiment = ensure_experiment(client, "soak", str(work / "artifacts"))
        runs = []
        for index in range(args.runs):
            runs.append(soak_one(index, data, client, experiment, tracking_uri, work, rng, args))
            print(json.dumps({k: v for k, v in runs[-1].items() if k != "events"}), flush=True)
            totals = {"runs": len(runs), "complete": sum(r["complete"] for r in runs),
                      "kills_rank": sum(r["kills"]["rank"] for r in runs),
                      "kills_job": sum(r["kills"]["job"] for r in runs),
                      "resumes": sum(r["starts"] - 1 + r["kills"]["rank"] for r in runs),
                      "steps_trained_twice": sum(r["steps_trained_twice"] for r in runs),
                      "failed": [r["run"] for r in runs if not r["complete"]]}
            save(args.output_name, vars(args), {"totals": totals, "runs": runs})


if __name__ == "__main__":
    main()
