"""Two saved MFU runs on the same data and plan, step by step: each timed step's seconds in the second run over
the first's (the same batch), and each run's window MFU with chosen steps given the first run's time instead
(what a stall on those steps cost).

    python -m benchmarks.mfu_step_ratios mfu_cuda_eager_ops "preset/bf16@model" mfu_cuda_in_place_qkv \
        "preset/bf16@model" --replace-steps 7 --output-name mfu_cuda_in_place_qkv_ratios

Runs are results/<name>.json end-to-end entries; every repeat of the second is compared with the first's first.
"""

from __future__ import annotations

import argparse
import json
import statistics

from benchmarks.common import RESULTS, save


def compare(before: dict, after: dict, replace_steps: list[int]) -> dict:
    if before["step_flops"] != after["step_flops"]:
        raise ValueError("the two runs did not time the same batches (their step_flops differ)")
    kept = [i for i in range(len(before["step_seconds"])) if i not in replace_steps]
    ratios = [after["step_seconds"][i] / before["step_seconds"][i] for i in kept]
    seconds = [before["step_seconds"][i] if i in replace_steps else s for i, s in enumerate(after["step_seconds"])]
    peak = after["peak_flops"] * after.get("world_size", 1)
    return {"step_ratio_mean": statistics.mean(ratios), "step_ratio_min": min(ratios), "step_ratio_max": max(ratios),
            "steps_compared": len(kept), "mfu_window_mean": after["mfu_window_mean"],
            "mfu_window_mean_with_replaced_steps": sum(after["step_flops"]) / sum(seconds) / peak}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("before_file")
    parser.add_argument("before_run", help='e.g. "preset/bf16@model"')
    parser.add_argument("after_file")
    parser.add_argument("after_run")
    parser.add_argument("--replace-steps", type=int, nargs="*", default=[],
                        help="window steps (from 0) left out of the ratios and given the first run's time")
    parser.add_argument("--output-name", default="mfu_step_ratios")
    args = parser.parse_args()
    load = lambda name, run: json.loads(  # noqa: E731
        (RESULTS / f"{name}.json").read_text())["results"]["end_to_end"][run]
    before = load(args.before_file, args.before_run)[0]
    results = {f"repeat_{i}": compare(before, after, args.replace_steps)
               for i, after in enumerate(load(args.after_file, args.after_run))}
    for name, figures in results.items():
        print(name, {k: round(v, 4) for k, v in figures.items()})
    save(args.output_name, vars(args), results)


if __name__ == "__main__":
    main()
