"""Calibration aimed at the backtested rate forecast, with and without the residual's trend carried a day forward,
against plain Platt scaling on the newest day, on the same trained models and the same eval examples: each model
trains once per seed (`calibration_rate: backtested`, `calibration_trend`), is scored on the eval days with its
calibration (`trend`), then again with the shift before the trend (`backtested`) and with the shift Platt scaling
fitted on the held-out day alone (`newest_day`), both of which the engine records beside it. Per (domain, objective)
with enough positives: the eval days' calibration (mean prediction over mean label) and NE under each, paired by seed.

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
from benchmarks.common import mean_std, save

MODELS = {"gem": ("gem", 0.5), "vertical": ("vertical", 1.0)}
FIGURES = ("calibration", "ne", "auc")
RATES = ("newest_day", "backtested", "trend")  # Platt scaling alone (the baseline), the pooled rate, and its trend


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
        reports = {"trend": evaluate(model, logs, config, torch.device("cpu"))}
        for how, before in (("newest_day", "newest_day_shift"), ("backtested", "shift_before_trend")):
            head.set_calibration(scale, torch.tensor(result.calibration[before]))
            reports[how] = evaluate(model, logs, config, torch.device("cpu"))
        head.set_calibration(scale, shift)
        out[label] = {"reports": {how: {g: {k: float(v[k]) for k in (*FIGURES, "positives")} for g, v in r.items()}
                                  for how, r in reports.items()},
                      "rate_days": result.calibration["rate_days"], "trend_slope": result.calibration["trend_slope"],
                      "trend_taken": result.calibration["trend_taken"], "steps": result.steps,
                      "seconds": round(time.perf_counter() - began, 1)}
        print(f"seed {seed} {label}: {result.steps} steps, {out[label]['seconds']:.0f} s, rate days "
              f"{result.calibration['rate_days']}, trends taken {result.calibration['trend_taken']} slopes "
              f"{np.round(result.calibration['trend_slope'], 3).tolist()}", flush=True)
    return out


def summarize(runs: dict[int, dict], min_positives: int) -> dict:
    seeds = sorted(runs)
    summary = {}
    for label in MODELS:
        first = runs[seeds[0]][label]["reports"]["newest_day"]
        groups = [g for g, v in first.items() if "/" in g and v["positives"] >= min_positives]
        summary[label] = {}
        for g in groups:
            row = {}
            for how in RATES:
                for k in FIGURES:
                    values = [runs[s][label]["reports"][how][g][k] for s in seeds]
                    row[f"{how}.{k}"] = {"mean": float(np.mean(values)),
                                         "std": float(np.std(values, ddof=1)) if len(values) > 1 else 0.0}
            miss = {how: [abs(runs[s][label]["reports"][how][g]["calibration"] - 1) for s in seeds] for how in RATES}
            for how in RATES[1:]:  # each against Platt scaling's newest day, paired by seed
                row[f"{how}.calibration_miss_change"] = {"per_seed": [b - a for a, b in zip(miss[RATES[0]], miss[how])]}
                row[f"{how}.ne_change"] = {"per_seed": [runs[s][label]["reports"][how][g]["ne"]
                                                        - runs[s][label]["reports"][RATES[0]][g]["ne"] for s in seeds]}
                for key in ("calibration_miss_change", "ne_change"):
                    row[f"{how}.{key}"]["mean"] = float(np.mean(row[f"{how}.{key}"]["per_seed"]))
            summary[label][g] = row
    return summary


def table(name: str, summary: dict) -> list[str]:
    f = mean_std
    lines = [f"{name}: model | group | calibration {' / '.join(RATES)} | NE {' / '.join(RATES)} | NE change "
             f"{' / '.join(RATES[1:])}"]
    for label, groups in summary.items():
        for g, row in groups.items():
            lines.append(f"{label} | {g} | {' / '.join(f(row[f'{how}.calibration']) for how in RATES)} | "
                         f"{' / '.join(f(row[f'{how}.ne']) for how in RATES)} | "
                         f"{' / '.join(format(row[f'{how}.ne_change']['mean'], '+.4f') for how in RATES[1:])}")
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
