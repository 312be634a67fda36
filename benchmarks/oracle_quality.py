"""The synthetic log's own label probabilities scored on its eval examples: the best AUC and NE any model can reach
there, and the calibration a perfect model gets on the realised labels, with its binomial standard deviation (how far
label noise alone moves a calibration figure). Day by day beside it, the true rate (the mean probability) against the
realised one: a model calibrated on past days can only follow the true rate, and only as far as it is stationary;
and how far the rates a calibration can aim at (the newest training day's, the backtested pool's) lie from the eval
days' true rates.

    python benchmarks/oracle_quality.py --sequence-logs LAKE/sequence_logs/2026-11-14 --log strong_signal \
        --compare benchmarks/results/default_run.json --output-name oracle_quality_default_run
    python benchmarks/oracle_quality.py --sequence-logs .gpu_data/transfer/synthetic/sequence_logs --log transfer \
        --compare benchmarks/results/calibration_rate.json --output-name oracle_quality_transfer

With --compare (a default_run.json, or a calibration_rate file's synthetic models), each model's calibration is also
divided by the perfect model's on the same group: the model's mean prediction over the true rate, free of the eval
day's label noise; --compare-report picks a calibration_rate file's calibration (backtested, newest_day or trend).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from datetime import date, timedelta
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from benchmarks.common import save  # noqa: E402

if TYPE_CHECKING:
    import polars as pl

MS_PER_DAY = 86_400_000
OBJECTIVES = {"click": "p_click", "conversion": "p_conversion"}
FIGURES = ("calibration", "auc", "ne")


def synthetic_config(log: str, seed: int):
    """The generator config a log was prepared with: the default run's preset, or transfer.py's drifting log."""
    from gem_ops.data.synthetic import RECURRING_SIGNAL, STRONG_SIGNAL

    if log == "transfer":
        from benchmarks.transfer import synthetic_source

        return replace(synthetic_source()[0].synthetic, seed=seed)
    return replace({"strong_signal": STRONG_SIGNAL, "recurring": RECURRING_SIGNAL}[log], seed=seed)


def example_probabilities(logs, config) -> pl.DataFrame:
    """Every labelled example of `logs` with its day, split, labels and the probabilities its labels were drawn
    with, joined from the regenerated raw events on (user, time, item)."""
    import polars as pl

    from gem_ops.data.synthetic import generate_day

    labels = logs.labels(np.arange(len(logs)))
    examples = pl.DataFrame({
        "user_id": logs.user_ids[logs.column("user_row")], "timestamp": logs.column("timestamp"),
        "item_id": logs.column("item_id"), "surface": np.array(logs.surfaces)[logs.column("surface")],
        "split": logs.column("split"),
        **{f"label_{t}": labels[:, i] for i, t in enumerate(logs.objectives)}})
    examples = examples.with_columns(day=pl.col("timestamp") // MS_PER_DAY)
    days = [date(1970, 1, 1) + timedelta(days=int(d)) for d in examples["day"].unique().sort()]
    raw = pl.concat([generate_day(config, day, label_probabilities=True) for day in days])
    raw = (raw.filter(pl.col("event_type") == "ad_impression")
           .select("user_id", pl.col("timestamp").dt.epoch("ms"), "item_id", "p_click", "p_conversion"))
    keys = ["user_id", "timestamp", "item_id"]
    collisions = raw.height - raw.unique(keys).height
    joined = examples.join(raw.unique(keys, keep="first"), on=keys, how="left")
    missing = joined.filter(pl.col("p_click").is_null()).height
    if missing:
        raise ValueError(f"{missing} of {joined.height} examples have no raw ad impression: the sequence logs were not "
                         f"prepared from this synthetic config (--log, --synthetic-seed)")
    return joined, collisions


def group_quality(frame, logs_surfaces: list[str], objectives: list[str]) -> dict:
    """AUC / NE / calibration of the true probabilities per (surface, objective) and over all surfaces, with the
    calibration's standard error under label noise alone (calibration_stderr)."""
    import torch

    from gem_ops.metrics.quality import binary_quality

    out = {}
    for task in objectives:
        labelled = frame.filter(frame[f"label_{task}"].is_not_nan())
        for surface in ["all", *logs_surfaces]:
            rows = labelled if surface == "all" else labelled.filter(labelled["surface"] == surface)
            if rows.is_empty():
                continue
            p = rows[OBJECTIVES[task]].to_numpy()
            y = rows[f"label_{task}"].to_numpy()
            quality = binary_quality(torch.tensor(np.log(p / (1 - p))), torch.tensor(y, dtype=torch.float32))
            out[f"{surface}/{task}"] = {
                **{m: float(v) for m, v in quality.items()}, "examples": int(y.size), "positives": int(y.sum()),
                "true_rate": float(p.mean()), "realised_rate": float(y.mean())}
    return out


def daily_rates(frame, objectives: list[str]) -> dict:
    """Per (surface, objective) and day: the true rate and the realised one, training and eval days alike."""
    import polars as pl

    out = {}
    for task in objectives:
        labelled = frame.filter(pl.col(f"label_{task}").is_not_nan())
        per_day = (labelled.group_by("surface", "day", "split")
                   .agg(pl.col(OBJECTIVES[task]).mean().alias("true"), pl.col(f"label_{task}").mean().alias("realised"),
                        pl.len().alias("examples"), pl.col(f"label_{task}").sum().alias("positives"))
                   .sort("surface", "day"))
        for (surface,), rows in per_day.group_by("surface", maintain_order=True):
            out[f"{surface}/{task}"] = {
                "day": [str(date(1970, 1, 1) + timedelta(days=int(d))) for d in rows["day"]],
                "eval": (rows["split"] == 1).to_list(), "true_rate": rows["true"].to_list(),
                "realised_rate": rows["realised"].to_list(), "examples": rows["examples"].to_list(),
                "positives": rows["positives"].to_list()}
    return out


def model_figures(results: dict, dataset: str, report: str = "backtested") -> dict:
    """name -> (group, {figure: mean over seeds}) of a default_run.json's GEM, verticals and alone models, or of
    a calibration_rate.json's models on `dataset` under one of its calibrations (`report`)."""
    if "gem" in results and "verticals" in results:  # default_run.json
        out = {f"gem {g.replace('.', '/')}": (g.replace(".", "/"), {m: v[m]["mean"] for m in FIGURES})
               for g, v in results["gem"].items()}
        for vertical, v in results["verticals"].items():
            out |= {f"{role} {vertical}": (vertical, {m: v[role][m]["mean"] for m in FIGURES})
                    for role in ("vertical", "alone")}
        return out
    runs = results[dataset]["runs"]  # calibration_rate.json
    reports = {(model, group): [run[model]["reports"][report][group] for run in runs.values()]
               for model in next(iter(runs.values())) for group in next(iter(runs.values()))[model]["reports"][report]}
    return {f"{model} {group}": (group, {m: float(np.mean([r[m] for r in seeds])) for m in FIGURES})
            for (model, group), seeds in reports.items()}


def calibration_targets(daily: dict) -> dict:
    """Per group, the log-odds error against each eval day's true rate of the rates a calibration can aim at, from
    the training days' counts: the newest day's (Platt scaling alone) and the backtested pool's (the engine's
    default, every group judged together as the engine judges a model's); and their root mean square over the
    groups."""
    from benchmarks.calibration_targets import forecasts, rule_pools

    groups = list(daily)
    train = ~np.array(daily[groups[0]]["eval"])  # every group of a synthetic log has every day
    n, p, true = (np.stack([np.array(daily[g][key], dtype=float) for g in groups], 1)
                  for key in ("examples", "positives", "true_rate"))
    truth = np.log(true[~train] / (1 - true[~train]))  # [eval days, groups]
    every_rule = rule_pools(n[train], p[train])
    pools = {how: every_rule[how] for how in ("newest_day", "backtested")}
    errors = {how: forecasts(n[train], p[train], k)[None, :] - truth for how, k in pools.items()}
    out = {g: {"backtested_pool": int(pools["backtested"][i]),
               "log_odds_error_against_true_rate": {how: e[:, i].tolist() for how, e in errors.items()}}
           for i, g in enumerate(groups)}
    out["root_mean_square"] = {how: float(np.sqrt(np.mean(np.square(e)))) for how, e in errors.items()}
    return out


def compared(oracle: dict, models: dict) -> dict:
    """Each model against the perfect model on its group: calibration over the perfect model's (the model's mean
    prediction over the true rate, free of the eval days' label noise), and the AUC and NE left to reach."""
    return {name: {**figures, "calibration_over_perfect_model": figures["calibration"] / oracle[group]["calibration"],
                   "auc_below_perfect_model": oracle[group]["auc"] - figures["auc"],
                   "ne_above_perfect_model": figures["ne"] - oracle[group]["ne"]}
            for name, (group, figures) in models.items() if group in oracle}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sequence-logs", type=Path, required=True, help="a sequence_logs folder of a synthetic log")
    parser.add_argument("--log", choices=("strong_signal", "recurring", "transfer"), default="strong_signal",
                        help="the generator config it was prepared from: a raw_event_logs preset, or transfer.py's log")
    parser.add_argument("--synthetic-seed", type=int, default=0)
    parser.add_argument("--compare", type=Path, help="a default_run.json or calibration_rate.json whose models to set "
                                                     "beside the perfect model")
    parser.add_argument("--compare-dataset", default="synthetic", help="the dataset of a calibration_rate.json")
    parser.add_argument("--compare-report", default="backtested",
                        help="which calibration of a calibration_rate.json: backtested, newest_day or trend")
    parser.add_argument("--output-name", default="oracle_quality")
    args = parser.parse_args()

    from gem_ops.data.loader import SequenceLogs

    logs = SequenceLogs(args.sequence_logs)
    frame, collisions = example_probabilities(logs, synthetic_config(args.log, args.synthetic_seed))
    eval_frame = frame.filter(frame["split"] == 1)
    oracle = group_quality(eval_frame, logs.surfaces, logs.objectives)
    results = {"eval": oracle, "daily": daily_rates(frame, logs.objectives)}
    results["calibration_targets"] = calibration_targets(results["daily"])
    print(f"{'group':<20} {'positives':>9} {'AUC':>7} {'NE':>7} {'calibration':>11} {'stderr':>10}")
    for group, q in oracle.items():
        print(f"{group:<20} {q['positives']:>9} {q['auc']:>7.4f} {q['ne']:>7.4f} {q['calibration']:>11.3f} "
              f"{q['calibration_stderr']:>10.3f}")
    targets = results["calibration_targets"]
    print("\ncalibration targets' log-odds error against the eval days' true rates (newest day / backtested pool):")
    for group, row in targets.items():
        if group != "root_mean_square":
            errors = row["log_odds_error_against_true_rate"]
            newest, pooled = (np.round(errors[how], 3).tolist() for how in ("newest_day", "backtested"))
            print(f"  {group:<18} {newest} / {pooled} (pool {row['backtested_pool']})")
    print(f"  root mean square: {targets['root_mean_square']}")
    if args.compare:
        import json

        results["models"] = compared(oracle, model_figures(json.loads(args.compare.read_text())["results"],
                                                            args.compare_dataset, args.compare_report))
        print(f"\n{'model':<26} {'calibration':>11} {'over perfect':>12} {'AUC to reach':>12} {'NE over':>8}")
        for name, m in results["models"].items():
            print(f"{name:<26} {m['calibration']:>11.3f} {m['calibration_over_perfect_model']:>12.3f} "
                  f"{m['auc_below_perfect_model']:>12.4f} {m['ne_above_perfect_model']:>8.4f}")
    settings = {**{k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                "eval_examples": int(eval_frame.height), "raw_key_collisions": collisions}
    save(args.output_name, settings, results)


if __name__ == "__main__":
    main()
