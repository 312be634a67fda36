"""Quality against compute on the eval days: fixed history caps against the adaptive policy at the same mean cost.

One GEM config (histories up to 1024 events, a pyramid that keeps 32 tokens after its first level) is trained
once per seed on the STRONG_SIGNAL synthetic log, whose long-range retargeting pattern only a long history can
see. Every trained model then scores the same eval examples with each request's history cut to a fixed cap
(16, 64, 256, 1024) and to the caps the adaptive policy (gem_ops.serving.adaptive) picks, its mean budget
set to each fixed cap's mean cost (FLOPs per candidate, fitted on the eval requests' history lengths, which a
server knows before it scores: the users' histories grow, so the training days' lengths would undershoot): the next
smaller fixed cap for most requests, the longest cap the budget allows for the longest histories; and to the
caps of the bucketed policy, one cap per band of history length, chosen at the same budget on the log loss of
the held-out newest training day scored at every cap of MENU_CAPS (a band whose users gain from more history
gets it); and to the caps of the match-reach policy at the same budget: a candidate whose item the user last met
deeper in the history than a base cap reads down to that event (a per-user lookup a server answers before
scoring), every other candidate the base cap, chosen on the same held-out losses. The eval examples whose
candidate the user met only beyond 64 events are also scored alone at every fixed cap (`far_match_slice`). Saves
AUC / NE per objective, mean ± standard deviation over seeds, the paired adaptive-minus-fixed differences,
and the mean cost of each, to benchmarks/results/adaptive_compute.json.

With --retrieved-events K the run is of another kind: each seed trains one model whose histories also carry up
to K older events of the candidate's item from beyond their recent ones (sequence.retrieved_events) and one
plain model, and the retrieval policy (each fixed cap's recent events plus the retrieved ones, whose number, and
cost, varies by request) is scored against the fixed cap of equal mean cost on both models. --retrieval-key names an
item feature to retrieve by instead of the item (e.g. item_genre with --log movielens, where no user meets an item
twice).

    python benchmarks/adaptive_compute.py [--seeds 0 1 2] [--epochs 1] [--max-steps N] [--models-dir DIR]

--models-dir keeps each seed's trained model there and reuses it when run again (same settings).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

import numpy as np  # noqa: E402

from benchmarks.common import save  # noqa: E402

if TYPE_CHECKING:
    import torch

FIXED_CAPS = (16, 64, 256, 1024)
MENU_CAPS = (16, 32, 64, 128, 256, 512, 1024)
BUCKET_EDGES = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096)  # bands of the user's whole history length
METRICS = ("auc", "ne")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--max-steps", type=int, default=None)
    parser.add_argument("--width", type=float, default=0.5)
    parser.add_argument("--blocks", type=int, default=2)
    parser.add_argument("--lr-dense", type=float, default=3e-3)
    parser.add_argument("--lr-schedule", choices=("constant", "cosine"), default="constant",
                        help="after the warm-up (TrainConfig.lr_schedule); cosine, as gem_quality.py and transfer.py")
    parser.add_argument("--weight-average-decay", type=float, default=0.0,
                        help="keep a moving average of the weights (TrainConfig.weight_average_decay; 0: off)")
    parser.add_argument("--models-dir", type=Path, default=None)
    parser.add_argument("--history-cut-share", type=float, default=0.0,
                        help="train on histories cut to random lengths for this share of examples (TrainConfig)")
    parser.add_argument("--log", choices=("strong", "recurring", "movielens"), default="strong",
                        help="the synthetic log: STRONG_SIGNAL, or RECURRING_SIGNAL (retargeting every other day, "
                             "each early item once: far history that only power users need); or the bundled "
                             "MovieLens sample replayed onto the same 14 days")
    parser.add_argument("--retrieved-events", type=int, default=0,
                        help="also train each seed's model with up to this many older events of the candidate's item "
                             "before its recent ones (sequence.retrieved_events) and score the retrieval policy: "
                             "each fixed cap's recent events plus those, against the fixed cap of equal cost on both "
                             "models (the other policies are left out of such a run)")
    parser.add_argument("--retrieval-key", default="item",
                        help="what a retrieved event shares with the candidate: item, or an item feature "
                             "(item_category on the synthetic logs, item_genre on MovieLens)")
    parser.add_argument("--recalibrate", action="store_true",
                        help="with --retrieved-events: also score every policy after Platt scaling fitted on the "
                             "held-out day scored the same way (`recalibrated` in the results)")
    parser.add_argument("--output-name", default="adaptive_compute", help="results/<name>.json")
    args = parser.parse_args()
    if args.recalibrate and not args.retrieved_events:
        parser.error("--recalibrate scores the policies of a retrieval run: it needs --retrieved-events K (K >= 1)")

    from datetime import date

    import torch

    from gem_ops.data.batch_shuffling import ShufflingConfig
    from gem_ops.data.movielens import MOVIELENS_HISTORY_EVENT_TYPES
    from gem_ops.data.prepare import prepare_training_data
    from gem_ops.data.raw_event_logs import EventSource
    from gem_ops.data.sequence_logs import SequenceLogsConfig
    from gem_ops.data.synthetic import RECURRING_SIGNAL, STRONG_SIGNAL
    from gem_ops.model.config import FeatureSpec, model_config
    from gem_ops.serving.adaptive import (fit_bucketed_policy, fit_match_policy, fit_policy, fixed_cap_of_cost,
                                          history_costs, request_costs, retrieval_costs)
    from gem_ops.train.batches import newest_days
    from gem_ops.train.config import TrainConfig
    from gem_ops.train.engine import train
    from gem_ops.train.model_state import load_model_state, model_from_state, model_state, save_model_state

    long_cap = max(FIXED_CAPS)
    config = model_config("gem", width=args.width, blocks=args.blocks,
                          **{"sequence.max_history_len": long_cap, "sequence.first_level_tokens": 32})
    runs, policies = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        if args.log == "movielens":  # ratings and sampled negatives; only the ratings form the timelines
            source, history_types = EventSource("movielens", movielens_replay_days=14), MOVIELENS_HISTORY_EVENT_TYPES
        else:
            source = EventSource("synthetic", {"strong": STRONG_SIGNAL, "recurring": RECURRING_SIGNAL}[args.log])
            history_types = None
        data = prepare_training_data(source, date(2026, 11, 14), 14, tmp,
                                     SequenceLogsConfig(max_history_len=long_cap, eval_days=2,
                                                        history_event_types=history_types),
                                     ShufflingConfig(sub_batch_size=64, sub_batches_per_rank=4))
        logs = data.open()
        spec = FeatureSpec.from_logs(logs)
        costs = history_costs(config, spec)
        # The policy reads each user's whole history length (events before the request), as a serving system
        # knows it: past the model's maximum, longer histories still tell power users apart.
        user_lengths = logs.column("history_end").astype(np.int64)
        eval_indices = logs.split_indices("eval")
        eval_lengths = user_lengths[eval_indices]
        held = newest_days(logs, data.plans[1], 1)  # held out of training: what the bucketed policy is fitted on
        # How far back each candidate was last met in its user's whole history (0: never): the match-reach policy's key.
        eval_depths = logs.candidate_depths(eval_indices)
        held_depths = logs.candidate_depths(held) if not args.retrieved_events else None  # match-reach's only
        far = (eval_depths > 64) & (eval_depths <= long_cap)
        # Every policy's caps on the eval examples: the fixed ones, and the adaptive one at each fixed cap's cost.
        caps = {f"fixed_{c}": np.full(eval_lengths.shape, c) for c in FIXED_CAPS}
        for i, c in enumerate(FIXED_CAPS[1:-1], start=1):
            budget = request_costs(costs, eval_lengths, c).mean()
            policy = fit_policy(eval_lengths, costs, budget, FIXED_CAPS[i - 1], FIXED_CAPS[i + 1:])
            policies[f"adaptive_at_{c}"] = {**policy.to_dict(), "mean_budget_flops": float(budget)}
            caps[f"adaptive_at_{c}"] = policy.caps(eval_lengths)
        cost = {name: float(request_costs(costs, eval_lengths, c).mean()) for name, c in caps.items()}

        def trained(seed: int, retrieved_events: int = 0):
            train_config = TrainConfig(epochs=args.epochs, max_steps=args.max_steps, lr_dense=args.lr_dense,
                                       lr_schedule=args.lr_schedule, weight_average_decay=args.weight_average_decay,
                                       eval_max_examples=1000, validation_days=1, seed=seed,
                                       history_cut_share=args.history_cut_share)
            found = f"_found{retrieved_events}" if retrieved_events else ""
            found += f"_by_{args.retrieval_key}" if retrieved_events and args.retrieval_key != "item" else ""
            found += f"_{args.lr_schedule}" if args.lr_schedule != "constant" else ""
            found += f"_average{args.weight_average_decay:g}" if args.weight_average_decay else ""
            cached = args.models_dir / f"{args.log}_seed{seed}_{args.epochs}_{args.max_steps}_{args.width}" \
                f"_{args.blocks}_cut{args.history_cut_share:g}{found}_v1.pt" if args.models_dir else None
            if cached is not None and cached.exists():
                return model_from_state(load_model_state(cached)), None
            torch.manual_seed(seed)
            retrieving = dataclasses.replace(config, sequence=dataclasses.replace(
                config.sequence, retrieved_events=retrieved_events, retrieval_key=args.retrieval_key))
            model, result = train(logs, data.plans[1], retrieving, train_config)
            if cached is not None:
                save_model_state(model_state(model), cached)
            return model, round(result.seconds, 1)

        if args.retrieved_events:  # the fixed caps, the retrieval policy and the fixed caps of its costs only
            for name in [n for n in caps if not n.startswith("fixed_")]:
                del caps[name], cost[name], policies[name]
            for c in FIXED_CAPS[:-1]:
                found = np.array([m.size for m in logs.retrieve_matches(eval_indices, np.minimum(eval_lengths, c),
                                                                        args.retrieved_events, args.retrieval_key)])
                cost[f"retrieved_at_{c}"] = float(retrieval_costs(costs, eval_lengths, c, found).mean())
                equal = fixed_cap_of_cost(costs, eval_lengths, cost[f"retrieved_at_{c}"])
                policies[f"retrieved_at_{c}"] = {"cap": c, "retrieved_events": args.retrieved_events,
                                                 "share_with_retrieved": float((found > 0).mean()),
                                                 "fixed_cap_of_equal_cost": equal}
                caps[f"fixed_{equal}"] = np.full(eval_lengths.shape, equal)
                cost[f"fixed_{equal}"] = float(request_costs(costs, eval_lengths, equal).mean())
        for seed in args.seeds:
            if args.retrieved_events:
                runs[seed] = _retrieval_run(trained, seed, args.retrieved_events, logs, eval_indices, caps, far,
                                            held if args.recalibrate else None)
                print(f"seed {seed}: " + ", ".join(f"{n} {q['all/click']['auc']:.4f}" for n, q in runs[seed].items()
                                                    if isinstance(q, dict) and "all/click" in q), flush=True)
                continue
            model, seconds = trained(seed)
            held_losses = {cap: _request_losses(model, logs, held, cap) for cap in MENU_CAPS}
            seed_caps = dict(caps)
            for c in FIXED_CAPS[1:-1]:
                policy = fit_bucketed_policy(user_lengths[held], held_losses, eval_lengths, costs,
                                             request_costs(costs, eval_lengths, c).mean(), BUCKET_EDGES)
                seed_caps[f"bucketed_at_{c}"] = chosen = policy.caps(eval_lengths)
                policies.setdefault(f"bucketed_at_{c}", {})[seed] = {
                    **policy.to_dict(), "mean_cost_flops": float(request_costs(costs, eval_lengths, chosen).mean())}
                match = fit_match_policy(held_depths, held_losses, eval_lengths, eval_depths, costs,
                                         request_costs(costs, eval_lengths, c).mean())
                seed_caps[f"matched_at_{c}"] = chosen = match.caps(eval_lengths, eval_depths)
                policies.setdefault(f"matched_at_{c}", {})[seed] = {
                    **match.to_dict(), "mean_cost_flops": float(request_costs(costs, eval_lengths, chosen).mean()),
                    "share_reaching_past_base": float((chosen > match.base_cap).mean())}
            runs[seed] = {name: _quality(model, logs, eval_indices, c) for name, c in seed_caps.items()}
            runs[seed]["far_match_slice"] = {f"fixed_{c}": _quality(model, logs, eval_indices[far],
                                                                    np.full(far.sum(), c))
                                              for c in FIXED_CAPS} if far.any() else {}
            runs[seed]["train_seconds"] = seconds
            print(f"seed {seed}: " + ", ".join(f"{n} {q['all/click']['auc']:.4f}" for n, q in runs[seed].items()
                                                if n in seed_caps), flush=True)
    for c in FIXED_CAPS[1:-1] if not args.retrieved_events else ():  # each seed fits its own bucketed and match-reach
        for kind in ("bucketed", "matched"):  # caps: their mean cost over the seeds
            cost[f"{kind}_at_{c}"] = float(np.mean([p["mean_cost_flops"] for p in policies[f"{kind}_at_{c}"].values()]))
    if args.retrieved_events:  # the same caps scored by the model that never retrieved
        cost.update({f"plain_{name}": value for name, value in list(cost.items()) if name.startswith("fixed_")})
    summary = _summary(runs, cost, args.seeds, {p: v["fixed_cap_of_equal_cost"] for p, v in policies.items()
                                                 if p.startswith("retrieved_at_")})
    if args.retrieved_events and args.recalibrate:  # the same comparisons, every policy calibrated on the held-out day
        summary["recalibrated"] = _summary({s: runs[s]["recalibrated"] for s in args.seeds}, cost, args.seeds,
                                           {p: v["fixed_cap_of_equal_cost"] for p, v in policies.items()
                                            if p.startswith("retrieved_at_")})
        for line in summary["recalibrated"]["table"]:
            print("recalibrated", line)
    slice_runs = {s: runs[s]["far_match_slice"] for s in args.seeds}
    summary["far_match_slice"] = {name: {g: {m: {"mean": float(np.mean([slice_runs[s][name][g][m]
                                                                        for s in args.seeds])),
                                                 "std": float(np.std([slice_runs[s][name][g][m] for s in args.seeds],
                                                                     ddof=1))
                                                 if len(args.seeds) > 1 else 0.0} for m in METRICS}
                                         for g in slice_runs[args.seeds[0]][name]}
                                  for name in slice_runs[args.seeds[0]]}
    for line in summary["table"]:
        print(line)
    log = {"strong": "STRONG_SIGNAL", "recurring": "RECURRING_SIGNAL", "movielens": "MovieLens latest-small"}[args.log]
    settings = {**vars(args), "log": log, "days": 14, "eval_days": 2, "fixed_caps": FIXED_CAPS,
                "eval_examples": int(eval_indices.size), "model": config.to_dict(),
                "eval_history_length_quantiles": {q: float(np.quantile(eval_lengths, q)) for q in (0.5, 0.9, 0.99)},
                "eval_share_beyond_1024": float((eval_lengths > long_cap).mean()),
                "eval_candidate_met_before": float((eval_depths > 0).mean()),
                "eval_candidate_met_only_beyond_64": float(far.mean()), "far_match_slice_examples": int(far.sum())}
    save(args.output_name, settings, {"policies": policies, "mean_cost_flops": cost, "runs": runs, **summary})


def _retrieval_run(trained, seed: int, retrieved_events: int, logs, eval_indices, caps: dict, far,
                   held=None) -> dict:
    """One seed of a retrieval run: the model trained with retrieved events scores each fixed cap with them
    (retrieved_at_<cap>) and without (fixed_<cap>); the model trained without scores the fixed caps (plain_fixed_<cap>).
    With `held` (the held-out day), every policy is also scored recalibrated on it (`recalibrated`)."""
    model, seconds = trained(seed, retrieved_events)
    plain, plain_seconds = trained(seed)
    # (model, cap, retrieved events) per policy: every cap is one number for all requests in a retrieval run
    served = {name: (model, int(c[0]), 0) for name, c in caps.items()}
    served |= {f"plain_{name}": (plain, int(c[0]), 0) for name, c in caps.items()}
    served |= {f"retrieved_at_{c}": (model, c, retrieved_events) for c in FIXED_CAPS[:-1]}
    run, recalibrated = {}, {}
    for name, (scorer, cap, retrieved) in served.items():
        scores = _scores(scorer, logs, eval_indices, np.full(eval_indices.size, cap), retrieved)
        run[name] = _report(scorer, scores)
        if held is not None:
            fit = _scores(scorer, logs, held, np.full(held.size, cap), retrieved)
            recalibrated[name] = _report(scorer, _calibrated(scores, fit, len(scorer.spec.surfaces)))
    if held is not None:
        run["recalibrated"] = recalibrated
    run["far_match_slice"] = {} if not far.any() else {  # none on a log where no user meets an item twice
        **{f"fixed_{c}": _quality(plain, logs, eval_indices[far], np.full(far.sum(), c)) for c in FIXED_CAPS},
        "retrieved_at_64": _quality(model, logs, eval_indices[far], np.full(far.sum(), 64), retrieved_events)}
    run["train_seconds"] = {"retrieval": seconds, "plain": plain_seconds}
    return run


def _request_losses(model, logs, indices, cap: int) -> np.ndarray:
    """Each example's log loss summed over its labelled objectives, its history cut to `cap`."""
    import torch
    import torch.nn.functional as F

    from gem_ops.model.features import model_input

    model.eval()
    out = []
    with torch.no_grad():
        for start in range(0, indices.size, 512):
            x = model_input(logs.batch(indices[start : start + 512], cap), model.spec, model.config)
            loss = F.binary_cross_entropy_with_logits(model(x).float(), x.labels.float(), reduction="none")
            out.append((loss * x.label_mask).sum(1).numpy())
    return np.concatenate(out)


def _scores(model, logs, indices, caps, retrieved_events: int = 0) -> dict[str, torch.Tensor]:
    """Logits, labels, label mask and surface of `indices`, each example's history cut to its cap (the same
    examples for every policy), with up to `retrieved_events` older events of the candidate's item before those."""
    import torch

    from gem_ops.model.features import model_input

    model.eval()
    parts = {"logits": [], "labels": [], "label_mask": [], "surface": []}
    with torch.no_grad():
        for cap in np.unique(caps):
            chosen = indices[caps == cap]
            for start in range(0, chosen.size, 512):
                rows = chosen[start : start + 512]
                # The cap bounds the recent events; retrieved ones come on top (as the model trained and a server
                # sends them: retrieval_costs), within the model's longest history.
                batch = logs.batch(rows, model.config.sequence.max_history_len, np.full(rows.size, int(cap)),
                                   retrieved_events=retrieved_events, retrieval_key=model.config.sequence.retrieval_key)
                x = model_input(batch, model.spec, model.config)
                parts["logits"].append(model(x).float())
                parts["labels"].append(x.labels)
                parts["label_mask"].append(x.label_mask)
                parts["surface"].append(batch.surface)
    return {k: torch.cat(v) for k, v in parts.items()}


def _report(model, scores: dict) -> dict:
    from gem_ops.metrics.quality import quality_report

    report = quality_report(scores["logits"], scores["labels"], scores["label_mask"], scores["surface"],
                            model.spec.surfaces, model.objectives)
    return {g: {m: float(v[m]) for m in METRICS} for g, v in report.items() if g.startswith("all/")}


def _quality(model, logs, indices, caps, retrieved_events: int = 0) -> dict:
    """AUC / NE per objective of `indices` scored at their caps (_scores)."""
    return _report(model, _scores(model, logs, indices, caps, retrieved_events))


def _calibrated(scores: dict, fit: dict, surfaces: int) -> dict:
    """`scores` after Platt scaling per (surface, objective) fitted on `fit` (the held-out day served the same way):
    a server calibrates the configuration it serves, not the model's whole histories."""
    from gem_ops.train.calibration import fit_calibration

    scale, shift = fit_calibration(fit["logits"], fit["labels"], fit["label_mask"], fit["surface"], surfaces)
    return {**scores, "logits": scores["logits"] * scale[scores["surface"]] + shift[scores["surface"]]}


def _summary(runs: dict, cost: dict, seeds: list[int], equal_caps: dict[str, int] | None = None) -> dict:
    """Mean ± standard deviation over seeds per policy, and each adaptive or bucketed policy minus the fixed cap of
    equal cost, paired by seed: it beats the fixed cap when the mean difference exceeds both policies' seed spreads."""
    policies = [name for name in cost]
    groups = [g for g in runs[seeds[0]][policies[0]]]
    stats = {p: {g: {m: {"mean": float(np.mean([runs[s][p][g][m] for s in seeds])),
                         "std": float(np.std([runs[s][p][g][m] for s in seeds], ddof=1)) if len(seeds) > 1 else 0.0}
                     for m in METRICS} for g in groups} for p in policies}
    versus, table = {}, [f"{'policy':<18} {'mean GFLOP':>10} "
                         + " ".join(f"{g + ' ' + m:>22}" for g in groups for m in METRICS)]
    for p in policies:
        table.append(f"{p:<18} {cost[p] / 1e9:>10.4f} " + " ".join(
            f"{stats[p][g][m]['mean']:>13.4f} ± {stats[p][g][m]['std']:.4f}" for g in groups for m in METRICS))
    # Each policy against the fixed cap of its cost; a retrieval policy against that cap on both models too.
    pairs = [(p, "fixed_" + p.split("_at_")[1]) for p in policies
             if p.startswith(("adaptive_at_", "bucketed_at_", "matched_at_"))]
    for p, cap in (equal_caps or {}).items():
        pairs += [(p, f"fixed_{cap}"), (p, f"plain_fixed_{cap}")]
    for p, fixed in pairs:
        versus.setdefault(p, {})
        for g in groups:
            for m in METRICS:
                diffs = [runs[s][p][g][m] - runs[s][fixed][g][m] for s in seeds]
                better = np.mean(diffs) if m == "auc" else -np.mean(diffs)  # NE: lower is better
                spread = max(stats[p][g][m]["std"], stats[fixed][g][m]["std"])
                key = f"{g}.{m}" if not equal_caps or p not in equal_caps else f"{g}.{m} vs {fixed}"
                versus[p][key] = {"mean_difference": float(np.mean(diffs)), "per_seed": diffs,
                                  "seed_spread": spread, "beats_by_more_than_spread": bool(better > spread)}
    return {"stats": stats, "adaptive_minus_fixed": versus, "table": table}


if __name__ == "__main__":
    main()
