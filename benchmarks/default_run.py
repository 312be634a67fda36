"""The embedded default end to end (`python -m pipelines.run_local`, what `make pipeline` runs) once per seed, each in
fresh Dagster, MLflow and lake stores: GEM's eval figures per (domain, objective) and each vertical's against the same
vertical trained alone and against GEM, as the run's summary states them, as mean ± standard deviation over seeds.

The seed is the training seed of every model and of the batch plans (`shuffled_batches`, `gem_foundation_model`,
`domain_foundation_models`, `vertical_models`); the synthetic log, and with it every eval example, is the same in
every run. About 7 minutes a seed on 2 cores.

    python benchmarks/default_run.py [--seeds 0 1 2] [--output-name default_run]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import yaml

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import mean_std, save

PROJECT_ROOT = Path(__file__).resolve().parents[1]
SEEDED_OPS = ("shuffled_batches", "gem_foundation_model", "domain_foundation_models", "vertical_models")
MIN_POSITIVES = 50  # GEM's groups judged against the base rate (the first-run test's threshold)
WHO = ("vertical", "alone", "gem")
METRICS = ("auc", "ne", "calibration")


def run_seed(seed: int, folder: Path) -> dict:
    """One run of the embedded default in stores under `folder`; its GEM and vertical figures from MLflow."""
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{folder / 'mlflow.db'}"
    config = folder / "seed.yaml"
    config.write_text(yaml.safe_dump({"ops": {op: {"config": {"seed": seed}} for op in SEEDED_OPS}}))
    env = {**os.environ, "DAGSTER_HOME": str(folder / "dagster"), "GEM_LAKE_DIR": str(folder / "lake"),
           "MLFLOW_TRACKING_URI": uri}
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "pipelines.run_local", "--config", str(config)], cwd=PROJECT_ROOT,
                          env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"seed {seed}: pipelines.run_local failed\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name("gem")
    (gem,) = client.search_runs([experiment.experiment_id], "tags.`dagster.asset_key` = 'gem_foundation_model'")
    m = gem.data.metrics
    groups = sorted(k[len("eval."):-len(".positives")] for k in m if k.startswith("eval.") and k.endswith(".positives"))
    gem_figures = {g: {"positives": m[f"eval.{g}.positives"], **{x: m[f"eval.{g}.{x}"] for x in METRICS
                                                                   if f"eval.{g}.{x}" in m}} for g in groups}
    verticals = {}
    for r in client.search_runs([experiment.experiment_id]):
        if "task" not in r.data.tags:
            continue
        vm = r.data.metrics
        verticals[f"{r.data.tags['domain']}/{r.data.tags['task']}"] = {
            who: {x: vm[f"compare.{who}.{x}"] for x in METRICS if f"compare.{who}.{x}" in vm} for who in WHO}
    summary = next((line for line in done.stdout.splitlines() if line.startswith("GEM on the eval day")), "")
    return {"seconds": round(seconds, 1), "gem": gem_figures, "verticals": verticals, "summary_line": summary}


def summarize(runs: dict[int, dict]) -> dict:
    """Mean ± standard deviation over seeds of every figure, the paired vertical-minus-alone AUC / NE per vertical,
    and the share of GEM's AUC lead over alone that the vertical closes (where GEM leads by more than the spread)."""
    seeds = sorted(runs)
    stat = lambda xs: {"mean": float(np.mean(xs)),  # noqa: E731
                       "std": float(np.std(xs, ddof=1)) if len(xs) > 1 else 0.0}
    gem = {}
    for g in runs[seeds[0]]["gem"]:
        gem[g] = {x: stat([runs[s]["gem"][g][x] for s in seeds]) for x in ("positives", *METRICS)
                  if all(x in runs[s]["gem"][g] for s in seeds)}
        gem[g]["ne_below_1_every_seed"] = all(runs[s]["gem"][g]["ne"] < 1 for s in seeds)
    verticals = {}
    for task in runs[seeds[0]]["verticals"]:
        per = [runs[s]["verticals"][task] for s in seeds]
        out = {who: {x: stat([p[who][x] for p in per]) for x in METRICS} for who in WHO}
        for x in ("auc", "ne"):
            diffs = [p["vertical"][x] - p["alone"][x] for p in per]
            spread = max(out["vertical"][x]["std"], out["alone"][x]["std"])
            better = np.mean(diffs) if x == "auc" else -np.mean(diffs)
            out[f"vertical_minus_alone_{x}"] = {"mean": float(np.mean(diffs)), "per_seed": diffs, "seed_spread": spread,
                                                "beats_by_more_than_spread": bool(better > spread)}
        lead = out["gem"]["auc"]["mean"] - out["alone"]["auc"]["mean"]
        gap_real = lead > max(out["gem"]["auc"]["std"], out["alone"]["auc"]["std"])
        out["gem_lead_real"] = bool(gap_real)
        out["gap_closed_auc"] = (out["vertical"]["auc"]["mean"]
                                 - out["alone"]["auc"]["mean"]) / lead if gap_real else None
        out["ne_below_1_every_seed"] = all(p["vertical"]["ne"] < 1 for p in per)
        verticals[task] = out
    return {"gem": gem, "verticals": verticals, "seconds": stat([runs[s]["seconds"] for s in seeds])}


def table(summary: dict) -> list[str]:
    f = mean_std
    lines = ["| GEM group | positives | AUC | NE | calibration |", "| --- | --- | --- | --- | --- |"]
    lines += [f"| {g} | {v['positives']['mean']:.0f} | {f(v['auc'])} | {f(v['ne'])} | "
              f"{f(v['calibration']) if 'calibration' in v else '—'} |"
              for g, v in summary["gem"].items() if v["positives"]["mean"] >= MIN_POSITIVES]
    lines += ["",
              "| vertical | AUC: vertical / alone / GEM | NE: vertical / alone | vertical − alone AUC | gap closed |",
              "| --- | --- | --- | --- | --- |"]
    for task, v in summary["verticals"].items():
        gap = "—" if v["gap_closed_auc"] is None else f"{v['gap_closed_auc']:.2f}"
        lines.append(f"| {task} | {f(v['vertical']['auc'])} / {f(v['alone']['auc'])} / {f(v['gem']['auc'])} | "
                     f"{f(v['vertical']['ne'])} / {f(v['alone']['ne'])} | "
                     f"{v['vertical_minus_alone_auc']['mean']:+.3f} | {gap} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--output-name", default="default_run", help="results/<name>.json")
    args = parser.parse_args()
    runs = {}
    for seed in args.seeds:
        with tempfile.TemporaryDirectory(prefix=f"default_run_{seed}_") as tmp:
            runs[seed] = run_seed(seed, Path(tmp))
        print(f"seed {seed}: {runs[seed]['seconds']:.0f} s; {runs[seed]['summary_line']}", flush=True)
    summary = summarize(runs)
    lines = table(summary)
    print("\n".join(lines))
    save(args.output_name, {**vars(args), "command": "python -m pipelines.run_local --config <seed.yaml>",
                            "seeded_ops": SEEDED_OPS, "min_positives": MIN_POSITIVES},
         {"runs": runs, **summary, "table": lines})


if __name__ == "__main__":
    main()
