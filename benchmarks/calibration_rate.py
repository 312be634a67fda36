"""Calibration aimed at the backtested rate forecast against plain Platt scaling on the newest day, on the same
trained models and the same eval examples: each model trains once per seed (`calibration_rate: backtested`), is
scored on the eval days with its calibration, then again with the shift Platt scaling fitted on the held-out day
alone (`newest_day`, which the engine records beside it). Per (domain, objective) with enough positives: the eval
days' calibration (mean prediction over mean label) and NE under both, paired by seed.

GEM (half width, histories of 128, as transfer.py's teacher) and the vertical preset (the size of the models that
serve) train on every domain of the prepared logs (`transfer.py --prepare-to DIR`).

    python benchmarks/calibration_rate.py --data .gpu_data/transfer [--datasets synthetic movielens] [--seeds 0 1 2]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import save

MODELS = {"gem": ("gem", 0.5), "vertical": ("vertical", 1.0)}
FIGURES = ("calibration", "ne", "auc")


def run_seed(logs, plan, seed: int, args) -> dict:
    import torch

    from gem_ops.model.config import model_config
    from gem_ops.train.calibration import output_calibration
    from gem_ops.train.config import TrainConfig
    from gem_ops.train.engine import train
    from gem_ops.train.evaluation import evaluate

    config = TrainConfig(epochs=args.epochs, max_steps=args.max_steps, lr_dense=args.lr_dense, lr_schedule="cosine",
                         validation_days=1, eval_every=args.eval_every, early_stopping_patience=3,
                         eval_max_examples=1_000_000, seed=seed, calibration_rate="backtested")
    out = {}
    for label, (preset, width) in MODELS.items():
        began = time.perf_counter()
        torch.manual_seed(seed)
        model, result = train(logs, plan, model_config(preset, width=width, **{
            "sequence.max_history_len": args.max_history_len}), config)
        head = output_calibration(model)
        scale, shift = torch.tensor(result.calibration["scale"]), torch.tensor(result.calibration["shift"])
        reports = {"backtested": evaluate(model, logs, config, torch.device("cpu"))}
        head.set_calibration(scale, torch.tensor(result.calibration["newest_day_shift"]))
        reports["newest_day"] = evaluate(model, logs, config, torch.device("cpu"))
        head.set_calibration(scale, shift)
        out[label] = {"reports": {how: {g: {k: float(v[k]) for k in (*FIGURES, "positives")} for g, v in r.items()}
                                  for how, r in reports.items()},
                      "rate_days": result.calibration["rate_days"], "steps": result.steps,
                      "seconds": round(time.perf_counter() - began, 1)}
        print(f"seed {seed} {label}: {result.steps} steps, {out[label]['seconds']:.0f} s, rate days "
              f"{result.calibration['rate_days']}", flush=True)
    return out


def summarize(runs: dict[int, dict], min_positives: int) -> dict:
    seeds = sorted(runs)
    summary = {}
    for label in MODELS:
        first = runs[seeds[0]][label]["reports"]["backtested"]
        groups = [g for g, v in first.items() if "/" in g and v["positives"] >= min_positives]
        summary[label] = {}
        for g in groups:
            row = {}
            for how in ("newest_day", "backtested"):
                for k in FIGURES:
                    values = [runs[s][label]["reports"][how][g][k] for s in seeds]
                    row[f"{how}.{k}"] = {"mean": float(np.mean(values)),
                                         "std": float(np.std(values, ddof=1)) if len(values) > 1 else 0.0}
            miss = {how: [abs(runs[s][label]["reports"][how][g]["calibration"] - 1) for s in seeds]
                    for how in ("newest_day", "backtested")}
            row["calibration_miss_change"] = {"per_seed": [b - a for a, b in zip(miss["newest_day"], miss["backtested"])]}
            row["ne_change"] = {"per_seed": [runs[s][label]["reports"]["backtested"][g]["ne"]
                                             - runs[s][label]["reports"]["newest_day"][g]["ne"] for s in seeds]}
            for key in ("calibration_miss_change", "ne_change"):
                row[key]["mean"] = float(np.mean(row[key]["per_seed"]))
            summary[label][g] = row
    return summary


def table(name: str, summary: dict) -> list[str]:
    f = lambda s: f"{s['mean']:.3f} ± {s['std']:.3f}"  # noqa: E731
    lines = [f"{name}: model | group | calibration newest day / backtested | NE newest day / backtested | NE change"]
    for label, groups in summary.items():
        for g, row in groups.items():
            lines.append(f"{label} | {g} | {f(row['newest_day.calibration'])} / {f(row['backtested.calibration'])} | "
                         f"{f(row['newest_day.ne'])} / {f(row['backtested.ne'])} | {row['ne_change']['mean']:+.4f}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, required=True, help="prepared datasets (<name>/sequence_logs, plans)")
    parser.add_argument("--datasets", nargs="+", default=["synthetic", "movielens"])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--max-steps", type=int, default=None)
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--lr-dense", type=float, default=3e-3)
    parser.add_argument("--max-history-len", type=int, default=128)
    parser.add_argument("--min-positives", type=int, default=200, help="groups judged: this many eval positives")
    parser.add_argument("--output-name", default="calibration_rate")
    args = parser.parse_args()

    from gem_ops.data.loader import TrainingData

    results = {}
    for name in args.datasets:
        data = TrainingData.at(args.data / name)
        logs = data.open()
        runs = {seed: run_seed(logs, data.plans[1], seed, args) for seed in args.seeds}
        summary = summarize(runs, args.min_positives)
        lines = table(name, summary)
        print("\n".join(lines), flush=True)
        results[name] = {"runs": runs, "summary": summary, "table": lines}
    save(args.output_name, vars(args), results)


if __name__ == "__main__":
    main()
