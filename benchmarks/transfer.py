"""Knowledge transfer to the vertical models, over several seeds: each vertical (domain, objective) trained
alone, with plain distillation, with direct transfer (GEM -> VM: Student Adapter, the teacher's looked-up
user representation, the shared item table through a projection), the same without the adapter, and with
hierarchical transfer (GEM -> domain FM -> VM), at the same student size, data and budget, on drifting
synthetic logs and on the bundled MovieLens sample.

The teacher (GEM) learns from every training day; a second GEM (`stale_gem`) from the days that end
`staleness_days` earlier, and judges the Student Adapter (stale_direct against stale_direct_no_adapter),
since an adapter exists to correct a teacher that retrains less often than its students. Each transfer runs
twice: the teacher's targets learned by an auxiliary head, and (`*_serving`) by the serving head as soft
targets beside the labels. The vertical models learn from the newest `student_days` training days of their domain,
the domain FMs from `--domain-fm-days` (default: every training day), the newest day held out for early stopping
and calibration; all are judged on the same eval days. Everything trains through gem_ops.train.engine; each
(dataset, seed, domain) is one job, training that seed's GEMs for itself. Per vertical, over the seeds: each
variant's AUC / NE / calibration (mean and spread), the teachers' on the same examples, and the share of the
teacher-alone AUC gap a variant closes, computed only where the teacher beats the alone model by more than the
seeds' spread. Beside them, each student's parameter count and its single-request latency on the CPU (one user,
`--candidates` candidates, the median of `--latency-reps` forward passes, one thread). Saved to
benchmarks/results/<--output-name>.json.

    python benchmarks/transfer.py --seeds 0 1 2 [--datasets synthetic movielens] [--gem-epochs 2]
    python benchmarks/transfer.py --prepare-to .gpu_data/transfer             # on a machine with polars
    python benchmarks/transfer.py --device cuda --jobs 6 --data .gpu_data/transfer
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from datetime import date
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from benchmarks.common import in_processes, save, saved_results  # noqa: E402

END = date(2026, 11, 14)
DAYS = 14
FIGURES = ("auc", "ne", "calibration", "calibration_stderr")
# variant -> (teacher: none / gem (fresh) / stale_gem / fm (the domain FM, from the fresh GEM), TransferConfig settings)
# Each transfer with the teacher's targets learned by an auxiliary head, and (`_serving`, the product's default)
# by the serving head. The domain FMs train with the default TransferConfig.
PLAIN = {"student_adapter": False, "representation": False, "shared_tables": ()}
AUXILIARY = {"distillation_head": "auxiliary"}
SERVING = {"distillation_head": "serving"}
VARIANTS = {
    "alone": (None, {}),
    "distillation": ("gem", {**PLAIN, **AUXILIARY}),
    "direct": ("gem", AUXILIARY),
    "hierarchical": ("fm", AUXILIARY),
    "stale_direct": ("stale_gem", AUXILIARY),
    "stale_direct_no_adapter": ("stale_gem", {**AUXILIARY, "student_adapter": False}),
    "distillation_serving": ("gem", {**PLAIN, **SERVING}),
    "direct_serving": ("gem", SERVING),
    "stale_direct_serving": ("stale_gem", SERVING),
    "stale_direct_serving_no_adapter": ("stale_gem", {**SERVING, "student_adapter": False}),
}
# Ablations (--variants): which mechanism of the full transfer pays, and hierarchical with the serving head.
ABLATIONS = {
    "direct_serving_no_representation": ("gem", {**SERVING, "representation": False}),
    "direct_serving_no_sharing": ("gem", {**SERVING, "shared_tables": ()}),
    "direct_serving_no_adapter": ("gem", {**SERVING, "student_adapter": False}),
    # The shared item table kept as the teacher's, or trained on the student's 4 days too (the default, "auto", trains
    # both and keeps the lower validation NE).
    "direct_serving_fixed_tables": ("gem", {**SERVING, "freeze_shared": True}),
    "direct_serving_trainable_tables": ("gem", {**SERVING, "freeze_shared": False}),
    "hierarchical_serving": ("fm", SERVING),
    # From an FM trained on its domain's days before the verticals' (its targets there out of sample).
    "hierarchical_serving_fm_before": ("fm_before", SERVING),
    # The looked-up representation with the sequence arm's summary of the user beside the trunk's output.
    "direct_serving_summary": ("gem_summary", SERVING),
    "distillation_serving_summary": ("gem_summary", {**SERVING, "student_adapter": False, "shared_tables": ()}),
    # The Student Adapter with a shift per candidate category too (CATEGORY_FEATURE: the dataset's column).
    "stale_direct_serving_category_adapter": ("stale_gem", {**SERVING, "adapter_feature": "category"}),
    # Either adapter under a prior that keeps a task with few labels near the teacher (adapter_shrinkage).
    "stale_direct_serving_shrunk_adapter": ("stale_gem", {**SERVING, "adapter_shrinkage": True}),
    "stale_direct_serving_shrunk_category_adapter": ("stale_gem", {**SERVING, "adapter_feature": "category",
                                                                   "adapter_shrinkage": True}),
    # Either adapter fitted only on the students' held-out newest day (adapter_fit), not on the day they train on.
    "stale_direct_serving_held_out_adapter": ("stale_gem", {**SERVING, "adapter_fit": "held_out"}),
    "stale_direct_serving_held_out_category_adapter": ("stale_gem", {**SERVING, "adapter_feature": "category",
                                                                     "adapter_fit": "held_out"}),
    # The teacher's targets weighed 4 times the labels whatever --distillation-weight (which the variants above take).
    "direct_serving_weight4": ("gem", {**SERVING, "distillation_weight": 4.0}),
    "distillation_serving_weight4": ("gem", {**PLAIN, **SERVING, "distillation_weight": 4.0}),
    "hierarchical_serving_weight4": ("fm", {**SERVING, "distillation_weight": 4.0}),
    # Shifts only (adapter_shift_only): the teacher's ranking within a domain and category kept as it is.
    "stale_direct_serving_shift_category_adapter": ("stale_gem", {**SERVING, "adapter_feature": "category",
                                                                  "adapter_fit": "held_out",
                                                                  "adapter_shift_only": True}),
}
CATEGORY_FEATURE = {"synthetic": "item_category", "movielens": "item_genre"}
ALL_VARIANTS = {**VARIANTS, **ABLATIONS}
GUARDED = ("direct", "direct_serving", "direct_serving_summary", "hierarchical", "hierarchical_serving")
TEACHERS = ("gem", "stale_gem", "fm", "fm_before")
GATE = "fm_held_out_day"  # a row's record of the teacher gate, not a model


def synthetic_source(ad_quality_drift: float = 0.0, category_quality_drift: float = 0.0):
    from gem_ops.data.raw_event_logs import EventSource
    from gem_ops.data.synthetic import STRONG_SIGNAL, SurfaceSpec

    # Click rates trend up on feed and down on reels: a teacher trained on older days is miscalibrated;
    # with ad_quality_drift the ads' ranking moves too (with category_quality_drift, whole categories' ranking),
    # which a stale teacher gets wrong, not just its scale.
    drifting = replace(STRONG_SIGNAL, ad_quality_drift=ad_quality_drift, category_quality_drift=category_quality_drift,
                       surfaces=(SurfaceSpec("feed", 0.45, 0.06, 0.4, ctr_drift=0.08),
                                 SurfaceSpec("reels", 0.25, 0.14, 0.35, ctr_drift=-0.06),
                                 SurfaceSpec("stories", 0.15, 0.06, None), SurfaceSpec("search", 0.15, 0.2, 0.4)))
    return EventSource("synthetic", drifting), None


def movielens_source():
    from gem_ops.data.movielens import MOVIELENS_HISTORY_EVENT_TYPES
    from gem_ops.data.raw_event_logs import EventSource

    return EventSource("movielens", movielens_replay_days=DAYS), MOVIELENS_HISTORY_EVENT_TYPES


def cpu_latency(model, logs, row: int, candidates: int, reps: int) -> float:
    """Median seconds of one request's forward pass on the CPU: one user's history, `candidates` candidates."""
    import torch

    from gem_ops.model.features import model_input

    batch = logs.batch([row] * candidates, model.config.sequence.max_history_len)
    x = model_input(batch, model.spec, model.config)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    model.eval()
    try:
        with torch.no_grad():
            for _ in range(3):
                model(x)
            times = []
            for _ in range(reps):
                began = time.perf_counter()
                model(x)
                times.append(time.perf_counter() - began)
    finally:
        torch.set_num_threads(threads)
    return statistics.median(times)


def run_seed(name: str, seed: int, args, logs, window, work: Path, domains: list[str]) -> dict:
    """GEM, the FMs of `domains` and every vertical variant of one seed."""
    import numpy as np

    from gem_ops.data.batch_shuffling import ShufflingConfig, read_plan
    from gem_ops.model.config import model_config
    from gem_ops.train.config import TrainConfig
    from gem_ops.train.engine import train
    from gem_ops.transfer import windows
    from gem_ops.transfer.config import FM_DISTILLATION_WEIGHT, TransferConfig
    from gem_ops.transfer.hierarchy import (
        DomainData,
        as_teacher,
        choose_domain_teacher,
        students_examples,
        train_domain_foundation_model,
        train_vertical_model,
    )
    from gem_ops.transfer.knowledge import score_examples
    from gem_ops.transfer.student import Teacher, kept_validation_ne, prediction_report, write_student_plan
    from gem_ops.transfer.user_representations import compute_user_representations

    shuffling = ShufflingConfig(sub_batch_size=128, sub_batches_per_rank=2, seed=seed)
    gem_config = model_config("gem", width=args.gem_width, **{"sequence.max_history_len": args.max_history_len})
    fm_base = model_config("domain_fm", width=0.5, **{"sequence.max_history_len": args.max_history_len})
    vm_base = model_config("vertical", **{"sequence.max_history_len": 64})

    def settings(epochs: int, eval_every: int, min_steps: int = 0, warmup_share: float = 0.0) -> TrainConfig:
        return TrainConfig(epochs=epochs, lr_dense=args.lr_dense, lr_schedule="cosine", validation_days=1,
                           warmup_share=warmup_share,
                           eval_every=eval_every, early_stopping_patience=args.patience,
                           early_stopping_min_steps=min_steps, eval_max_examples=1_000_000, seed=seed,
                           weight_average_decay=args.weight_average_decay)

    def student_settings() -> TrainConfig:  # the domain FMs' and the vertical models'
        return settings(args.student_epochs, args.student_eval_every, warmup_share=args.student_warmup_share)

    def train_gem(label: str, gem_window, scored,
                  sources: tuple[str, ...] = ("trunk",)) -> tuple[list[Teacher], object]:
        """The GEM of `gem_window`, as one teacher per representation source, scoring `scored`."""
        began = time.perf_counter()
        examples = windows.teacher_examples(logs, gem_window)
        plan = write_student_plan(logs, examples, work / f"{label}_plan.parquet", shuffling, args.max_history_len)
        first_epoch = int(args.gem_min_epochs * read_plan(plan).shape[0])
        model, run = train(logs, plan, gem_config, settings(args.gem_epochs, args.gem_eval_every, first_epoch),
                           device=args.device)
        teachers = []
        for source in sources:
            identity = {"name": label}
            table = compute_user_representations(model, logs, scored, identity, device=args.device, source=source)
            predictions = score_examples(model, logs, scored, identity, representations=table, device=args.device)
            teachers.append(Teacher(model, predictions, identity, table))
        model.cpu()  # students share its tables on the CPU
        print(f"{name} seed {seed}: {label} {run.steps} steps (kept {run.best_step}) in "
              f"{time.perf_counter() - began:.0f} s", flush=True)
        return teachers, run

    def train_fm(part, label: str):
        run = train_domain_foundation_model(logs, part, fm_base, student_settings(),
                                            work / f"{part.domain}_{label}_{seed}",
                                            TransferConfig(distillation_weight=FM_DISTILLATION_WEIGHT), gem, shuffling,
                                            device=args.device)
        return as_teacher(run, part, {"name": f"{label}_{part.domain}"}, args.device)

    began = time.perf_counter()
    needed = {ALL_VARIANTS[v][0] for v in args.variants}
    # Trained up to the students' newest day; scores the FMs' days too.
    (gem, *gem_summary), gem_run = train_gem("gem", replace(window, staleness_days=0), students_examples(logs, window),
                                            ("trunk", "summary") if "gem_summary" in needed else ("trunk",))
    teachers = {None: None, "gem": gem, "gem_summary": gem_summary[0] if gem_summary else None}
    if "stale_gem" in needed:  # `staleness_days` older: where the Student Adapter matters (vertical models only)
        verticals_only = students_examples(logs, replace(window, domain_fm_days=window.student_days))
        (teachers["stale_gem"],), _ = train_gem("stale_gem", window, verticals_only)
    rows = {}
    for domain in domains:
        part = DomainData.of(logs, domain, window)
        gate = None
        if "fm" in needed:
            teachers["fm"] = train_fm(part, "fm")
            gate = choose_domain_teacher(logs, part, teachers["fm"].predictions, gem.predictions)
        if "fm_before" in needed:  # the FM's knowledge of the verticals' days is out of sample
            teachers["fm_before"] = train_fm(replace(part, foundation=np.setdiff1d(part.foundation, part.train)),
                                             "fm_before")
        tasks = [t for t in windows.labelled_tasks(logs, part.train) if t in windows.labelled_tasks(logs, part.eval)]
        for task in (t for t in tasks if t in args.tasks):
            config = replace(vm_base, tasks=(task,))
            row = {who: _figures(prediction_report(logs, teachers[who].predictions, part.eval, config), task)
                   for who in TEACHERS if who in teachers}
            row["calibration_if_rate_held"] = calibration_if_rate_held(logs, part, task)
            if gate is not None:  # the FM against GEM on the FM's held-out day: who would teach (TeacherChoice)
                row[GATE] = {"fm_auc": gate.fm_auc, "gem_auc": gate.gem_auc,
                             "fm_teaches": float(gate.teacher == "domain_fm")}
            for variant in args.variants:
                teacher, transfer = ALL_VARIANTS[variant]
                if transfer.get("adapter_feature") == "category":
                    transfer = {**transfer, "adapter_feature": CATEGORY_FEATURE[name]}
                run = train_vertical_model(logs, part, task, vm_base, student_settings(),
                                           work / f"{domain}_{task}_{variant}_{seed}",
                                           TransferConfig(**{"distillation_weight": args.distillation_weight,
                                                             **transfer}),
                                           teachers[teacher], shuffling, device=args.device)
                row[variant] = _figures(run.result.final_report, task)
                row[variant]["validation_ne"] = kept_validation_ne(run.result, run.model.objectives)
                row[variant]["steps"], row[variant]["kept_step"] = (run.result.steps,
                                                                    run.result.best_step or run.result.steps)
                if run.shared_tables:  # which tables the student kept, and each candidate's validation NE
                    row[variant]["kept_fixed_tables"] = float(run.shared_tables["kept"] == "fixed")
                    row[variant].update({f"validation_ne_{who}": ne
                                         for who, ne in run.shared_tables["validation_ne"].items()})
                if run.adapter_report:  # the teacher as its adapter maps it, on the same eval examples
                    row[variant].update({f"adapted_teacher_{m}": value for m, value in
                                         _figures(run.adapter_report["adapted"], task).items()})
                row[variant]["parameters"] = sum(p.numel() for p in run.model.parameters())
                row[variant]["cpu_latency_s"] = cpu_latency(run.model.cpu(), run.data, int(part.eval[0]),
                                                            args.candidates, args.latency_reps)
            rows[f"{domain}/{task}"] = row
            print(f"{name} seed {seed} {domain}/{task}: " + ", ".join(
                f"{v} {row[v]['auc']:.4f}/{row[v]['ne']:.4f}" for v in (*TEACHERS, *args.variants) if v in row),
                  flush=True)
    return {"verticals": rows, "gem_eval": gem_run.final_report, "gem_steps": gem_run.steps,
            "seconds": round(time.perf_counter() - began, 1)}


def with_guarded(row: dict) -> dict:
    """The seed's figures and, per transfer variant, `<variant>_guarded`: the student a guard would keep,
    the variant unless the alone model's validation NE (newest training day, at the step it kept) is lower."""
    out = dict(row)
    alone = row["alone"].get("validation_ne", math.nan)
    for variant in (v for v in GUARDED if v in row):
        mine = row[variant].get("validation_ne", math.nan)
        out[f"{variant}_guarded"] = row["alone"] if alone < mine else row[variant]  # NaN compares False
    return out


def with_gated(row: dict) -> dict:
    """The seed's figures and `hierarchical_serving[_weight4]_gated`: what the teacher gate (domain_foundation_models'
    default) trains, the hierarchical student where the FM beat GEM on its held-out day, else GEM's direct one
    (the same training as direct_serving[_weight4])."""
    out = dict(row)
    for weight in ("", "_weight4"):  # each weight's gate chooses between that weight's two students
        hierarchical, direct = f"hierarchical_serving{weight}", f"direct_serving{weight}"
        if GATE in row and {hierarchical, direct} <= set(row):
            out[f"{hierarchical}_gated"] = row[hierarchical if row[GATE]["fm_teaches"] else direct]
    return out


def calibration_if_rate_held(logs, part, task: str) -> float:
    """The newest training day's label rate (where calibration is fitted) over the eval days': what a model
    exactly calibrated on that day gets on the eval days when the rate it saw there holds."""
    from gem_ops.train.batches import MS_PER_DAY

    day = logs.column("timestamp")[part.train] // MS_PER_DAY
    (n_new, p_new), (n_eval, p_eval) = (logs.label_counts(idx)[task]
                                        for idx in (part.train[day == day.max()], part.eval))
    return (p_new / n_new) / (p_eval / n_eval) if n_new and p_eval else math.nan


def paired(rows: list[dict], with_: str, without: str) -> dict:
    """`with_` against `without` seed by seed (one row per seed: its data, teacher and initial draws shared)."""
    differences = [row[with_]["auc"] - row[without]["auc"] for row in rows]
    return {"auc_difference": _spread(differences), "every_seed_better": all(d > 0 for d in differences)}


def with_validated_pair(row: dict, pair: tuple[str, str] | None) -> dict:
    """The seed's figures and, given a (fixed tables, trained tables) pair of variants, `validated_tables`: the
    student whose validation NE is lower, as freeze_shared="auto" keeps it (the same two trainings)."""
    if not pair or not all(v in row for v in pair):
        return row
    from gem_ops.transfer.student import kept_tables

    fixed, trained = (row[v] for v in pair)
    kept = fixed if kept_tables({"fixed": fixed["validation_ne"], "trained": trained["validation_ne"]}) == "fixed" \
        else trained
    return {**row, "validated_tables": {**kept, "kept_fixed_tables": float(kept is fixed)}}


# Each Student Adapter against none (and the category adapter against the plain one), with a stale teacher.
ADAPTER_PAIRS = (
    ("stale_direct_serving", "stale_direct_serving_no_adapter"),
    ("stale_direct_serving_category_adapter", "stale_direct_serving_no_adapter"),
    ("stale_direct_serving_category_adapter", "stale_direct_serving"),
    ("stale_direct_serving_shrunk_adapter", "stale_direct_serving_no_adapter"),
    ("stale_direct_serving_shrunk_category_adapter", "stale_direct_serving_no_adapter"),
    ("stale_direct_serving_held_out_adapter", "stale_direct_serving_no_adapter"),
    ("stale_direct_serving_held_out_category_adapter", "stale_direct_serving_no_adapter"),
    ("stale_direct_serving_shift_category_adapter", "stale_direct_serving_no_adapter"),
)


def summarize(seeds: list[dict], validated_pair: tuple[str, str] | None = None) -> dict:
    """Per vertical: each variant's figures as mean and spread over seeds, the gap closed where real, and
    the protocol's comparisons."""
    out = {}
    for key in seeds[0]["verticals"]:
        rows = [with_validated_pair(with_gated(with_guarded(s["verticals"][key])), validated_pair) for s in seeds]
        per = {who: {m: _spread([r[who][m] for r in rows]) for m in rows[0][who]}
               for who in rows[0] if who != "calibration_if_rate_held"}
        teacher, alone = per["gem"]["auc"], per["alone"]["auc"]
        real_gap = teacher["mean"] - alone["mean"] > max(teacher["spread"], alone["spread"])
        gap = {v: ((per[v]["auc"]["mean"] - alone["mean"]) / (teacher["mean"] - alone["mean"]) if real_gap else None)
               for v in per if v not in (*TEACHERS, GATE, "alone")}
        out[key] = {"figures": per, "gap_real": real_gap, "gap_closed_auc": gap,
                    "hierarchical_not_worse_than_alone": {
                        v: per[v]["auc"]["mean"] >= alone["mean"] - max(per[v]["auc"]["spread"], alone["spread"])
                        for v in ("hierarchical", "hierarchical_serving", "hierarchical_guarded",
                                  "hierarchical_serving_guarded", "hierarchical_serving_fm_before",
                                  "hierarchical_serving_gated", "hierarchical_serving_weight4",
                                  "hierarchical_serving_weight4_gated") if v in per},
                    "full_over_plain_distillation": {  # each against plain distillation at its own weight
                        full: gap[full] / gap[plain] if real_gap and gap[plain] > 0 else None
                        for full, plain in (("direct", "distillation"), ("direct_serving", "distillation_serving"),
                                            ("direct_serving_summary", "distillation_serving"),
                                            ("direct_serving_trainable_tables", "distillation_serving"),
                                            ("direct_serving_fixed_tables", "distillation_serving"),
                                            ("direct_serving_weight4", "distillation_serving_weight4"),
                                            ("validated_tables", "distillation_serving"))
                        if full in per and plain in per},
                    # Each mechanism's own worth: the full transfer against it without that mechanism.
                    "mechanisms": {f"{with_} over {without}": _gain(per, with_, without) for with_, without in (
                        ("stale_direct", "stale_direct_no_adapter"),
                        *ADAPTER_PAIRS,
                        ("direct_serving", "direct_serving_no_adapter"),
                        ("direct_serving", "direct_serving_no_representation"),
                        ("direct_serving", "direct_serving_no_sharing"),
                        ("direct_serving_summary", "direct_serving"),
                        ("distillation_serving_summary", "distillation_serving")) if with_ in per and without in per},
                    "paired": {f"{with_} over {without}": paired(rows, with_, without) for with_, without in (
                        ("direct", "distillation"), ("direct_serving", "distillation_serving"),
                        ("direct_serving_summary", "distillation_serving"),
                        ("direct_serving", "direct_serving_trainable_tables"),
                        ("direct_serving", "direct_serving_fixed_tables"),
                        ("direct_serving_weight4", "direct_serving"),
                        ("direct_serving_weight4", "distillation_serving_weight4"),
                        ("distillation_serving_weight4", "distillation_serving"),
                        ("validated_tables", "distillation_serving"),
                        *ADAPTER_PAIRS,
                        ("hierarchical", "alone"), ("hierarchical_serving", "alone"),
                        ("hierarchical_serving_gated", "alone"),
                        ("hierarchical_serving_weight4_gated", "alone"),
                        ("hierarchical_serving_weight4", "hierarchical_serving"),
                        ("hierarchical_serving_weight4_gated", "hierarchical_serving_gated"),
                        ("hierarchical_serving_fm_before", "alone"),
                        ("hierarchical_serving_fm_before", "hierarchical_serving")) if with_ in per and without in per},
                    "calibration_if_rate_held": seeds[0]["verticals"][key].get("calibration_if_rate_held", math.nan)}
    return out


def _gain(per: dict, with_: str, without: str) -> dict:
    """`with_` against `without`: mean AUC and NE differences, and whether the AUC gain exceeds the spread."""
    auc = per[with_]["auc"]["mean"] - per[without]["auc"]["mean"]
    return {"auc_gain": auc, "ne_gain": per[without]["ne"]["mean"] - per[with_]["ne"]["mean"],
            "beyond_spread": auc > max(per[with_]["auc"]["spread"], per[without]["auc"]["spread"])}


def largest_domains(logs, window, n: int) -> list[str]:
    import numpy as np

    from gem_ops.transfer import windows

    fresh = windows.student_examples(logs, window)
    counts = np.bincount(logs.column("surface")[fresh], minlength=len(logs.surfaces))
    return [logs.surfaces[i] for i in np.argsort(-counts)[:n]]


def _figures(report: dict, task: str) -> dict:
    return {m: report[f"all/{task}"][m] for m in FIGURES}


def _spread(values: list[float]) -> dict:
    values = [v for v in values if not math.isnan(v)]
    if not values:
        return {"mean": math.nan, "spread": math.nan}
    return {"mean": statistics.mean(values), "spread": max(values) - min(values)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--datasets", nargs="+", default=["synthetic", "movielens"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--domains", nargs="*", default=None, help="default: the --top-domains largest")
    parser.add_argument("--top-domains", type=int, default=2)
    parser.add_argument("--tasks", nargs="+", default=["click", "conversion"])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(ALL_VARIANTS),
                        help="vertical variants to train (alone is always among them: the gaps are measured from it)")
    parser.add_argument("--student-days", type=int, default=4, help="the newest is held out for validation")
    parser.add_argument("--staleness-days", type=int, default=3)
    parser.add_argument("--ad-quality-drift", type=float, default=0.0,
                        help="synthetic: sd of each ad's daily log-quality step (ranking drift a stale teacher misses)")
    parser.add_argument("--category-quality-drift", type=float, default=0.0,
                        help="synthetic: the same step per item category, shared by its ads (a category's season)")
    parser.add_argument("--domain-fm-days", type=int, default=None,
                        help="days the domain FMs learn from (default: all)")
    parser.add_argument("--eval-days", type=int, default=2)
    parser.add_argument("--max-history-len", type=int, default=128)
    parser.add_argument("--gem-width", type=float, default=0.5)
    parser.add_argument("--gem-epochs", type=int, default=3)
    parser.add_argument("--gem-eval-every", type=int, default=50)
    parser.add_argument("--gem-min-epochs", type=float, default=1.0, help="GEM's epochs before it may stop early")
    parser.add_argument("--student-epochs", type=int, default=4)
    parser.add_argument("--student-eval-every", type=int, default=10)
    parser.add_argument("--student-warmup-share", type=float, default=0.0,
                        help="the students' (and domain FMs') warm-up at most this share of their steps (0: 20 steps)")
    parser.add_argument("--patience", type=int, default=3)
    parser.add_argument("--lr-dense", type=float, default=3e-3)
    parser.add_argument("--distillation-weight", type=float, default=None,
                        help="the vertical models' weight of the teacher's targets beside the labels (default: "
                             "TransferConfig's, 4; the result files before it was 4 ran at 1)")
    parser.add_argument("--weight-average-decay", type=float, default=0.0,
                        help="every model keeps an exponential moving average of its weights (0: off; "
                             "results/transfer_synthetic_weight_average.json: 0.998)")
    parser.add_argument("--candidates", type=int, default=1, help="candidates of the latency request")
    parser.add_argument("--latency-reps", type=int, default=50)
    parser.add_argument("--device", default="cpu", help="where every model trains and scores (latency: on the CPU)")
    parser.add_argument("--jobs", type=int, default=1, help="(dataset, seed) runs at once, in separate processes")
    parser.add_argument("--data", type=Path, default=None,
                        help="prepared data (<dataset>/sequence_logs, plans) to reuse")
    parser.add_argument("--prepare-to", type=Path, default=None, help="only prepare the datasets under this folder")
    parser.add_argument("--output-name", default="transfer")
    parser.add_argument("--resume", action="store_true", help="keep the seeds saved under --output-name")
    parser.add_argument("--validated-pair", nargs=2, metavar=("FIXED", "TRAINED"), default=None,
                        help="variants trained with the shared tables fixed and trained: the summary adds "
                             "`validated_tables`, the one of each seed with the lower validation NE")
    parser.add_argument("--summarize-from", metavar="NAME", default=None,
                        help="only summarize the seeds of results/NAME.json again (with --validated-pair), "
                             "saved under --output-name with NAME's commit")
    args = parser.parse_args()
    args.variants = list(dict.fromkeys(["alone", *args.variants]))

    if args.summarize_from is not None:
        resummarize(args.summarize_from, args.output_name, args.validated_pair)
        return

    if args.prepare_to is not None:  # the GPU machine has no polars: prepare here, carry the folder there
        for name in args.datasets:
            prepare(name, args.prepare_to / name, args)
        return
    from gem_ops.data.loader import TrainingData
    from gem_ops.transfer.config import TransferConfig

    if args.distillation_weight is None:  # recorded with the results as it ran
        args.distillation_weight = TransferConfig.distillation_weight
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        roots = {name: args.data / name if args.data is not None else prepare(name, Path(tmp) / name, args)
                 for name in args.datasets}
        domains = {name: args.domains or largest_domains(TrainingData.at(roots[name]).open(), windows_of(args),
                                                         args.top_domains) for name in args.datasets}
        done: dict = {name: [] for name in args.datasets}
        if args.resume:  # a run cut short (the GPU machine's time limit) goes on where it stopped
            for name, saved in saved_results(args.output_name).items():
                if name in done:
                    done[name] = saved["seeds"]
        # One job per (dataset, seed, domain), each training the seed's GEMs: the domains run side by side.
        jobs = [(n, s, d) for n in args.datasets for s in args.seeds if s not in {f["seed"] for f in done[n]}
                for d in domains[n]]
        calls = {(n, s, d): (n, str(roots[n]), s, args, tmp, d) for n, s, d in jobs}
        parts: dict = {}
        for (name, seed, domain), figures in in_processes(_run_one, calls, args.jobs):
            parts.setdefault((name, seed), {})[domain] = figures
            if len(parts[(name, seed)]) < len(domains[name]):
                continue  # a seed counts once all its domains are done
            done[name].append(merged_seed(seed, [parts[(name, seed)][d] for d in domains[name]]))
            for d in (d for d in args.datasets if done[d]):
                seeds = sorted(done[d], key=lambda f: f["seed"])
                results[d] = {"seeds": seeds, "summary": summarize(seeds, args.validated_pair)}
            save(args.output_name, {**vars(args), "end": END.isoformat(), "days": DAYS,
                                    "variants": {v: ALL_VARIANTS[v] for v in args.variants}}, results)


def resummarize(source: str, output_name: str, validated_pair: tuple[str, str] | None) -> None:
    """The seeds of results/<source>.json summarized again, saved as results/<output_name>.json with the
    source's commit, machine and settings beside this summary's."""
    import json

    from benchmarks.common import RESULTS

    saved = json.loads((RESULTS / f"{source}.json").read_text())
    results = {name: {"seeds": part["seeds"], "summary": summarize(part["seeds"], validated_pair)}
               for name, part in saved["results"].items()}
    save(output_name, {"summarized_from": source, "validated_pair": validated_pair,
                       "source": {k: saved[k] for k in ("commit", "dirty", "when", "machine", "settings")}}, results)


def prepare(name: str, root: Path, args) -> Path:
    from gem_ops.data.prepare import prepare_training_data
    from gem_ops.data.sequence_logs import SequenceLogsConfig

    sources = {"synthetic": lambda: synthetic_source(args.ad_quality_drift, args.category_quality_drift),
               "movielens": movielens_source}
    source, history_types = sources[name]()
    prepare_training_data(source, END, DAYS, root, SequenceLogsConfig(
        max_history_len=args.max_history_len, eval_days=args.eval_days, history_event_types=history_types))
    return root


def windows_of(args):
    from gem_ops.transfer.config import TransferWindows

    return TransferWindows(student_days=args.student_days, staleness_days=args.staleness_days,
                           domain_fm_days=args.domain_fm_days)


def merged_seed(seed: int, parts: list[dict]) -> dict:
    """One seed's figures from its per-domain jobs (each with GEMs of its own, trained alike)."""
    return {"seed": seed, "verticals": {k: v for p in parts for k, v in p["verticals"].items()},
            "gem_eval": parts[0]["gem_eval"], "gem_steps": [p["gem_steps"] for p in parts],
            "seconds": max(p["seconds"] for p in parts)}


def _run_one(name: str, root: str, seed: int, args, work: str, domain: str) -> dict:
    from gem_ops.data.loader import TrainingData

    folder = Path(work) / f"{name}_{seed}_{domain}"
    folder.mkdir(parents=True, exist_ok=True)
    return run_seed(name, seed, args, TrainingData.at(root).open(), windows_of(args), folder, [domain])


if __name__ == "__main__":
    main()
