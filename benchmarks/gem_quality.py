"""Offline quality of GEM against the models users would pick instead, on the same data, split, training
budget and engine, over several seeds: the default synthetic log and the bundled MovieLens sample.

The models (`--models`; none: only the `--variants`, set against a baseline that a run before trained):
    gem                  the GEM preset (pyramid sequence arm, InterFormer, Wukong), `--width`, `--max-history-len`
    gem_no_sequence      the same model without its sequence arm
    logistic_regression  per-task logistic regression on the same hashed ids
    dlrm, dcn            TorchRec's DLRM and DLRM-DCN (DCN-v2 cross layers) on the same ids and dense features
Every model trains through gem_ops.train.engine with the same settings: up to `--epochs` passes, the newest
training day held out for early stopping (every `--eval-every` steps, patience `--patience`, not before
`--min-epochs` epochs) and Platt calibration, then is judged on the eval day(s). Per dataset, model and
seed: AUC, NE and calibration per (domain, objective) and over all, the training FLOPs (the analytic count
of the steps run) and seconds.
The summary gives each figure's mean and spread (max - min) over the seeds, and for every group with at
least `--min-positives` positives whether GEM's mean AUC beats every other model's by more than the
larger of the two spreads. `--budgets` adds GEM and DLRM at other widths (FLOPs against quality: the
compute each needs for DLRM's best AUC).

    python benchmarks/gem_quality.py --prepare-to .gpu_data/quality        # on a machine with polars
    python benchmarks/gem_quality.py --device cuda --jobs 8 --data .gpu_data/quality --budgets 0.25 2.0
    python benchmarks/gem_quality.py --datasets synthetic --seeds 0 --max-steps 20 --output-name gem_quality_dryrun
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from benchmarks.common import TRAIN, in_processes, named_settings, save, saved_results, train_changes  # noqa: E402
from gem_ops.data.loader import TrainingData  # noqa: E402

END = date(2026, 11, 14)
DAYS = 14
METRICS = ("auc", "ne", "calibration", "calibration_stderr")


def prepare(dataset: str, root: Path, max_history_len: int, synthetic_users: int):
    from gem_ops.data.batch_shuffling import ShufflingConfig
    from gem_ops.data.movielens import MOVIELENS_HISTORY_EVENT_TYPES
    from gem_ops.data.prepare import prepare_training_data
    from gem_ops.data.raw_event_logs import EventSource
    from gem_ops.data.sequence_logs import SequenceLogsConfig
    from gem_ops.data.synthetic import SyntheticConfig

    if dataset == "movielens":
        source = EventSource("movielens", movielens_replay_days=DAYS)
        sequences = SequenceLogsConfig(max_history_len=max_history_len, eval_days=2,
                                       history_event_types=MOVIELENS_HISTORY_EVENT_TYPES)
    else:  # raw_event_logs' synthetic source with the default generator; two eval days (one day of the
        # embedded default's 5,000 users holds ~175 clicks: too few to tell models apart)
        source = EventSource("synthetic", SyntheticConfig(n_users=synthetic_users))
        sequences = SequenceLogsConfig(max_history_len=max_history_len, eval_days=2)
    return prepare_training_data(source, END, DAYS, root / dataset, sequences, ShufflingConfig(128, 4))


def data_root(dataset: str, args, tmp: Path) -> Path:
    """The dataset's prepared folder: under --data, or prepared into `tmp`."""
    if args.data is not None:
        return args.data / dataset
    return prepare(dataset, tmp, args.max_history_len, args.synthetic_users).sequence_logs.parent


def model_configs(args, variants: dict[str, dict]) -> dict[str, object]:
    from gem_ops.model.config import model_config

    history = {"sequence.max_history_len": args.max_history_len}
    configs = {
        "gem": model_config("gem", width=args.width, **history),
        "gem_no_sequence": model_config("gem", width=args.width, use_sequence=False),
        "logistic_regression": model_config("logistic_regression"),
        "dlrm": model_config("dlrm"),
        "dcn": model_config("dcn"),
    }
    configs = {name: configs[name] for name in args.models}
    for name, settings in variants.items():  # ablations of GEM at the same width and history
        configs[name] = model_config("gem", width=args.width, **history | model_settings(settings))
    for width in args.budgets:  # FLOPs against quality: the same architectures narrower or wider
        configs[f"gem@{width:g}"] = model_config("gem", width=args.width * width, **history)
        configs[f"dlrm@{width:g}"] = model_config("dlrm", width=width)
    return configs


def train_settings(args, plan, seed: int, **changes):
    """The training settings every model here shares (`changes`: TrainConfig fields set otherwise)."""
    from gem_ops.data.batch_shuffling import read_plan
    from gem_ops.train.config import TrainConfig

    return TrainConfig(**{"epochs": args.epochs, "max_steps": args.max_steps, "lr_dense": args.lr_dense,
                          "warmup_steps": args.warmup_steps, "lr_schedule": "cosine", "validation_days": 1,
                          "eval_every": args.eval_every, "early_stopping_patience": args.patience,
                          "eval_max_examples": 1_000_000, "seed": seed,
                          "early_stopping_min_steps": int(args.min_epochs * read_plan(plan).shape[0]),
                          "weight_average_decay": args.weight_average_decay} | changes)


def model_settings(settings: dict) -> dict:
    """A variant's model settings (dotted ModelConfig keys)."""
    return {k: v for k, v in settings.items() if not k.startswith(TRAIN)}


def run(logs, plan, config, args, seed: int, changes: dict | None = None) -> dict:
    from gem_ops.train.engine import train

    began = time.perf_counter()
    _, result = train(logs, plan, config, train_settings(args, plan, seed, **(changes or {})), device=args.device)
    report = result.final_report
    return {"steps": result.steps, "best_step": result.best_step, "stopped_early": result.stopped_early,
            "train_seconds": round(time.perf_counter() - began, 1), "train_flops": float(sum(result.step_flops)),
            "eval": {g: {m: v[m] for m in (*METRICS, "count", "positives")} for g, v in report.items()}}


def summarize(runs: dict[str, list[dict]], min_positives: int) -> dict:
    """Per model and group: each metric's mean and spread over seeds; GEM against every other model."""
    table = {}
    for name, seeds in runs.items():
        groups = seeds[0]["eval"]
        table[name] = {g: {m: _spread([s["eval"][g][m] for s in seeds if g in s["eval"]]) for m in METRICS}
                       | {"positives": groups[g]["positives"]} for g in groups}
        table[name]["train_flops"] = _spread([s["train_flops"] for s in seeds])
    verdicts = {}
    if "gem" in table:
        for group, figures in table["gem"].items():
            if group == "train_flops" or figures["positives"] < min_positives:
                continue
            gem = figures["auc"]
            margins = {}
            for other in (n for n in table if n != "gem" and "@" not in n and group in table[n]):
                theirs = table[other][group]["auc"]
                margins[other] = {"auc_gain": gem["mean"] - theirs["mean"],
                                  "beyond_spread": gem["mean"] - theirs["mean"] > max(gem["spread"], theirs["spread"]),
                                  "worst_seed_above_their_best": gem["min"] > theirs["max"]}
            verdicts[group] = {"positives": figures["positives"], "vs": margins,
                               "gem_best": all(m["beyond_spread"] for m in margins.values())}
    return {"models": table, "gem_against_each": verdicts,
            "compute_efficiency": {g: compute_efficiency(table, g) for g in ("all/click", "all/conversion")}}


def compute_efficiency(table: dict, group: str) -> dict | None:
    """Training FLOPs each family needs for a quality: DLRM's best AUC over its budgets, the cheapest GEM
    budget that reaches it, and DLRM's FLOPs at its best over that GEM's (how many times less compute
    GEM needs for DLRM's best quality)."""
    def points(family: str) -> list[dict]:
        return sorted(({"model": n, "train_flops": t["train_flops"]["mean"], "auc": t[group]["auc"]["mean"]}
                       for n, t in table.items() if n.split("@")[0] == family and group in t),
                      key=lambda p: p["train_flops"])

    gem, dlrm = points("gem"), points("dlrm")
    if not gem or not dlrm:
        return None
    best = max(dlrm, key=lambda p: p["auc"])
    matching = [p for p in gem if p["auc"] >= best["auc"]]
    cheapest = matching[0] if matching else None
    return {"gem": gem, "dlrm": dlrm, "dlrm_best": best, "gem_cheapest_reaching_it": cheapest,
            "dlrm_flops_over_gem_flops": best["train_flops"] / cheapest["train_flops"] if cheapest else None}


def _spread(values: list[float]) -> dict:
    values = [v for v in values if not math.isnan(v)]
    if not values:
        return {"mean": math.nan, "spread": math.nan, "min": math.nan, "max": math.nan, "seeds": 0}
    return {"mean": statistics.mean(values), "spread": max(values) - min(values), "min": min(values),
            "max": max(values), "seeds": len(values)}


def add_training_arguments(parser: argparse.ArgumentParser) -> None:
    """The data and training settings (train_settings) shared with the benchmarks that train as this one does."""
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--jobs", type=int, default=1, help="trainings at once (processes sharing the device)")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--max-steps", type=int, default=None)
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--patience", type=int, default=3)
    parser.add_argument("--min-epochs", type=float, default=1.0, help="epochs before early stopping may stop a run")
    parser.add_argument("--lr-dense", type=float, default=3e-3)
    parser.add_argument("--warmup-steps", type=int, default=20, help="linear warm-up of the dense learning rate")
    parser.add_argument("--weight-average-decay", type=float, default=0.998,
                        help="every model keeps an exponential moving average of its weights (0: off)")
    parser.add_argument("--width", type=float, default=0.5)
    parser.add_argument("--max-history-len", type=int, default=256)
    parser.add_argument("--synthetic-users", type=int, default=10_000)
    parser.add_argument("--data", type=Path, default=None,
                        help="prepared data (<dataset>/sequence_logs, plans) to reuse")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--datasets", nargs="+", default=["synthetic", "movielens"], choices=("synthetic", "movielens"))
    parser.add_argument("--models", nargs="*", default=["gem", "gem_no_sequence", "logistic_regression", "dlrm", "dcn"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--variants", nargs="*", default=[], metavar="NAME:KEY=VALUE,...",
                        help="GEM with other settings, e.g. gem_no_bias:sequence.bias=false (model) or "
                             "gem_radam:train.dense_optimizer=radam (training)")
    parser.add_argument("--budgets", nargs="*", type=float, default=[], help="extra widths of GEM and DLRM")
    parser.add_argument("--budget-datasets", nargs="*", default=None, help="datasets of the budgets (default: all)")
    add_training_arguments(parser)
    parser.add_argument("--min-positives", type=int, default=200)
    parser.add_argument("--prepare-to", type=Path, default=None, help="only prepare the datasets under this folder")
    parser.add_argument("--output-name", default="gem_quality")
    parser.add_argument("--resume", action="store_true", help="keep the trainings saved under --output-name")
    args = parser.parse_args()

    if args.prepare_to is not None:  # the GPU machine has no polars: prepare here, carry the folder there
        for dataset in args.datasets:
            prepare(dataset, args.prepare_to, args.max_history_len, args.synthetic_users)
        return
    variants = dict(map(named_settings, args.variants))
    configs = model_configs(args, variants)
    with tempfile.TemporaryDirectory() as tmp:
        roots = {d: data_root(d, args, Path(tmp)) for d in args.datasets}
        budget_sets = set(args.budget_datasets if args.budget_datasets is not None else args.datasets)
        jobs = [(d, name, seed) for d in args.datasets for name in configs
                if "@" not in name or d in budget_sets for seed in args.seeds]
        runs: dict = {d: {} for d in args.datasets}
        if args.resume:  # a run cut short (the GPU machine's time limit) goes on where it stopped
            for d, saved in saved_results(args.output_name).items():
                if d in runs:
                    runs[d] = {n: r for n, r in saved["runs"].items() if n in configs}
            jobs = [(d, n, s) for d, n, s in jobs if s not in {r["seed"] for r in runs[d].get(n, [])}]
        changes = {name: train_changes(settings) for name, settings in variants.items()}
        calls = {(d, n, s): (str(roots[d]), configs[n], args, s, changes.get(n)) for d, n, s in jobs}
        for (dataset, name, seed), figures in in_processes(_train_one, calls, args.jobs):
            runs[dataset].setdefault(name, []).append(figures)
            print(f"{dataset} {name} seed {seed}: " + ", ".join(
                f"{g} {figures['eval'][g]['auc']:.4f}/{figures['eval'][g]['ne']:.4f}" for g in figures["eval"]
                if g.startswith("all/")) + f" ({figures['steps']} steps, {figures['train_seconds']} s)", flush=True)
            results = {}
            for d in args.datasets:
                if not runs[d]:
                    continue
                logs = TrainingData.at(roots[d]).open()
                ordered = {n: sorted(r, key=lambda f: f["seed"]) for n, r in runs[d].items()}
                results[d] = {"split": {"train": int(logs.split_indices("train").size),
                                        "eval": int(logs.split_indices("eval").size)},
                              "runs": ordered, "summary": summarize(ordered, args.min_positives)}
            save(args.output_name, {**vars(args), "models": {n: c.to_dict() for n, c in configs.items()}}, results)


_OPENED: dict = {}  # per process: root -> (logs, plan), read once


def _train_one(root: str, config, args, seed: int, changes: dict | None) -> dict:
    if root not in _OPENED:
        data = TrainingData.at(root)
        _OPENED[root] = data.open(), data.plans[1]
    logs, plan = _OPENED[root]
    return {"seed": seed, **run(logs, plan, config, args, seed, changes)}


if __name__ == "__main__":
    main()
