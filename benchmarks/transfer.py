"""Knowledge transfer: vertical models trained alone, with direct transfer (GEM -> VM) and with
hierarchical transfer (GEM -> domain FM -> VM), each with and without the Student Adapter, at the same
student size and training budget, on drifting synthetic logs and on the bundled MovieLens sample.

The teacher (GEM) learns from the training days that end `staleness_days` before the students' do; the
students learn from the newest `student_days` training days of their domain; all are judged on the
same eval days. For each vertical model (domain, objective): AUC and NE of every variant, of the
teachers on the same examples, and the share of the teacher-student gap that transfer closes,
(student - alone) / (teacher - alone). Saved to benchmarks/results/transfer.json.

    python benchmarks/transfer.py [--datasets synthetic movielens] [--gem-steps 400] [--student-epochs 2]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from dataclasses import replace
from datetime import date
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from benchmarks.common import save  # noqa: E402

END = date(2026, 11, 14)
DAYS = 14
VARIANTS = ("alone", "direct", "direct_no_adapter", "hierarchical", "hierarchical_no_adapter")
FIGURES = ("auc", "ne", "calibration")


def synthetic_source():
    from gem_ops.data.raw_event_logs import EventSource
    from gem_ops.data.synthetic import STRONG_SIGNAL, SurfaceSpec

    # Click rates trend up on feed and down on reels: a teacher trained on older days is miscalibrated.
    drifting = replace(STRONG_SIGNAL, surfaces=(
        SurfaceSpec("feed", 0.45, 0.06, 0.4, ctr_drift=0.08), SurfaceSpec("reels", 0.25, 0.14, 0.35, ctr_drift=-0.06),
        SurfaceSpec("stories", 0.15, 0.06, None), SurfaceSpec("search", 0.15, 0.2, 0.4)))
    return EventSource("synthetic", drifting), None


def movielens_source():
    from gem_ops.data.movielens import MOVIELENS_HISTORY_EVENT_TYPES
    from gem_ops.data.raw_event_logs import EventSource

    return EventSource("movielens", movielens_replay_days=DAYS), MOVIELENS_HISTORY_EVENT_TYPES


def figures(report: dict, task: str) -> dict:
    return {m: round(report[f"all/{task}"][m], 4) for m in FIGURES}


def gap_closed(student: dict, alone: dict, teacher: dict) -> dict:
    """Share of the teacher-student gap closed, per figure (NE: lower is better, the same formula); None
    where the teacher is not better than the student trained alone (there is no gap to close)."""
    out = {}
    for m, sign in (("auc", 1), ("ne", -1)):
        gap = teacher[m] - alone[m]
        out[m] = round((student[m] - alone[m]) / gap, 3) if sign * gap > 1e-4 else None
    return out


def run_dataset(name: str, args, work: Path) -> dict:
    import numpy as np

    from gem_ops.data.batch_shuffling import ShufflingConfig
    from gem_ops.data.prepare import prepare_training_data
    from gem_ops.data.sequence_logs import SequenceLogsConfig
    from gem_ops.model.config import model_config
    from gem_ops.train.config import TrainConfig
    from gem_ops.train.engine import train
    from gem_ops.transfer import windows
    from gem_ops.transfer.config import TransferConfig, TransferWindows
    from gem_ops.transfer.hierarchy import DomainData, as_teacher, students_examples, train_domain_foundation_model, \
        train_vertical_model
    from gem_ops.transfer.knowledge import score_examples
    from gem_ops.transfer.user_representations import compute_user_representations
    from gem_ops.transfer.student import Teacher, prediction_report, write_student_plan

    source, history_types = {"synthetic": synthetic_source, "movielens": movielens_source}[name]()
    data = prepare_training_data(source, END, DAYS, work / name,
                                 SequenceLogsConfig(max_history_len=args.max_history_len, eval_days=args.eval_days,
                                                    history_event_types=history_types))
    logs = data.open()
    window = TransferWindows(student_days=args.student_days, staleness_days=args.staleness_days)
    shuffling = ShufflingConfig(sub_batch_size=128, sub_batches_per_rank=2)
    gem_config = model_config("gem", width=args.gem_width, **{"sequence.max_history_len": args.max_history_len})
    fm_base = model_config("domain_fm", width=0.5, **{"sequence.max_history_len": args.max_history_len})
    vm_base = model_config("vertical", **{"sequence.max_history_len": 64})
    # GEM by steps; students by passes over their (small) fresh data: more passes overfit it.
    train_config = lambda steps=None, epochs=100: TrainConfig(  # noqa: E731
        max_steps=steps, epochs=epochs, lr_dense=2e-3, eval_max_examples=1_000_000)

    began = time.perf_counter()
    teacher_rows = windows.teacher_examples(logs, window)
    plan = write_student_plan(logs, teacher_rows, work / name / "gem_plan.parquet", shuffling, args.max_history_len)
    gem_model, gem_run = train(logs, plan, gem_config, train_config(args.gem_steps))
    print(f"{name}: GEM {gem_run.steps} steps on {teacher_rows.size} stale examples in "
          f"{time.perf_counter() - began:.0f} s; eval {figures(gem_run.final_report, logs.objectives[0])}", flush=True)
    scored = students_examples(logs, window)
    table = compute_user_representations(gem_model, logs, scored, {"name": "gem"})
    gem = Teacher(gem_model, score_examples(gem_model, logs, scored, {"name": "gem"}, representations=table),
                  {"name": "gem"}, table)

    domains = args.domains or _largest_domains(logs, window, args.top_domains)
    results = {}
    for domain in domains:
        part = DomainData.of(logs, domain, window)
        fms = {}
        for adapter in (True, False):
            transfer = TransferConfig(student_adapter=adapter)
            run = train_domain_foundation_model(logs, part, fm_base, train_config(epochs=args.fm_epochs),
                                                work / name / domain / f"fm_{adapter}", transfer, gem, shuffling)
            fms[adapter] = as_teacher(run, part, {"name": f"fm_{domain}"})
        tasks = [t for t in windows.labelled_tasks(logs, part.train) if t in windows.labelled_tasks(logs, part.eval)]
        for task in [t for t in tasks if t in args.tasks]:
            key = f"{domain}/{task}"
            config = replace(vm_base, tasks=(task,))
            row = {"train_examples": int(part.train.size), "eval_examples": int(part.eval.size),
                   "teacher_gem": figures(prediction_report(logs, gem.predictions, part.eval, config), task),
                   "teacher_fm": figures(prediction_report(logs, fms[True].predictions, part.eval, config), task)}
            teachers = {"alone": None, "direct": gem, "direct_no_adapter": gem,
                        "hierarchical": fms[True], "hierarchical_no_adapter": fms[False]}
            for variant in VARIANTS:
                transfer = TransferConfig(student_adapter="no_adapter" not in variant)
                run = train_vertical_model(logs, part, task, vm_base, train_config(epochs=args.student_epochs),
                                           work / name / domain / task / variant, transfer, teachers[variant], shuffling)
                row[variant] = figures(run.result.final_report, task)
            for variant in VARIANTS[1:]:
                row[f"gap_closed.{variant}"] = gap_closed(row[variant], row["alone"], row["teacher_gem"])
            results[key] = row
            print(f"{name} {key}: " + ", ".join(f"{v} {row[v]['auc']:.4f}/{row[v]['ne']:.4f}"
                                               for v in ("teacher_gem", "teacher_fm", *VARIANTS)), flush=True)
    mean = {v: {m: round(float(np.mean([r[v][m] for r in results.values()])), 4) for m in FIGURES}
            for v in ("teacher_gem", "teacher_fm", *VARIANTS)}
    return {"verticals": results, "mean": mean,
            "gap_closed_of_mean": {v: gap_closed(mean[v], mean["alone"], mean["teacher_gem"]) for v in VARIANTS[1:]},
            "gem_eval": gem_run.final_report, "examples": {"teacher": int(teacher_rows.size), "all": len(logs)},
            "seconds": round(time.perf_counter() - began, 1)}


def _largest_domains(logs, window, n: int) -> list[str]:
    import numpy as np

    from gem_ops.transfer import windows

    fresh = windows.student_examples(logs, window)
    counts = np.bincount(logs.column("surface")[fresh], minlength=len(logs.surfaces))
    return [logs.surfaces[i] for i in np.argsort(-counts)[:n]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--datasets", nargs="+", default=["synthetic", "movielens"])
    parser.add_argument("--domains", nargs="*", default=None, help="default: the --top-domains largest")
    parser.add_argument("--top-domains", type=int, default=2)
    parser.add_argument("--tasks", nargs="+", default=["click", "conversion"])
    parser.add_argument("--student-days", type=int, default=3)
    parser.add_argument("--staleness-days", type=int, default=3)
    parser.add_argument("--eval-days", type=int, default=2)
    parser.add_argument("--max-history-len", type=int, default=128)
    parser.add_argument("--gem-width", type=float, default=0.5)
    parser.add_argument("--gem-steps", type=int, default=400)
    parser.add_argument("--fm-epochs", type=int, default=2, help="passes of each domain FM over its domain's fresh data")
    parser.add_argument("--student-epochs", type=int, default=2, help="passes of each vertical model over its data")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        results = {name: run_dataset(name, args, Path(tmp)) for name in args.datasets}
    for name, result in results.items():
        print(f"{name} mean: {result['mean']}\n  gap closed: {result['gap_closed_of_mean']}")
    save("transfer", {**vars(args), "end": END.isoformat(), "days": DAYS}, results)


if __name__ == "__main__":
    main()
