"""An embedding table's dense gradient on a GPU: the Triton kernel (kernels.table_gradient) against PyTorch's
embedding backward (the largest part's, the other parts' rows added into it with index_put_), side by side on the
same gradients, alternated repeat by repeat. Shapes of the `w0.5_L512` step (histories of ~255k tokens, width 1024):
the item table (history and candidate items, Zipf ids) and an item feature's table whose few distinct values every
history token looks up; and shapes the kernel was not tuned on. Mean milliseconds over the timed repeats (CUDA
events, the median beside it). Saved as benchmarks/results/table_gradient.json; with --configs, the kernel alone at
each chunk, column block and warp count on the `w0.5_L512` tables, as table_gradient_configs.json.

    python -m benchmarks.table_gradient                  # on a CUDA machine
    python -m benchmarks.table_gradient --configs
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics

import torch

from benchmarks.common import save
from kernels.table_gradient import table_gradient

# name: (part sizes, rows, width, distinct ids drawn, Zipf exponent)
CASES = {
    "item_table_w05_L512": ((254_772, 4096), 262_144, 1024, 262_144, 1.1),
    "category_table_w05_L512": ((254_772,), 4096, 1024, 64, 1.0),
    "uniform_narrow": ((500_000,), 1_000_000, 64, 1_000_000, 0.0),
    "zipf_d256": ((100_000, 1000), 50_000, 256, 50_000, 1.3),
}


def make_case(sizes, rows, dim, distinct, skew, seed=0):
    generator = torch.Generator().manual_seed(seed)
    weights = torch.arange(1, distinct + 1, dtype=torch.float64) ** -skew
    values = torch.randperm(rows, generator=generator)[:distinct]  # which rows the distinct ids hash to
    ids = [values[torch.multinomial(weights, n, replacement=True, generator=generator)].cuda() for n in sizes]
    grads = [torch.randn(n, dim, generator=generator).cuda() for n in sizes]
    return grads, ids


def time_methods(grads, ids, rows, reps: int) -> dict[str, list[float]]:
    """Milliseconds of each method's call, alternated, after 3 untimed calls of each."""
    times = {"aten": [], "triton": []}
    for rep in range(reps + 3):
        for method in times:
            os.environ["GEM_TABLE_GRADIENT"] = method
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            table_gradient(grads, ids, rows)
            end.record()
            end.synchronize()
            if rep >= 3:
                times[method].append(start.elapsed_time(end))
    os.environ.pop("GEM_TABLE_GRADIENT")
    return times


def time_configs(reps: int) -> dict[str, float]:
    """'<case> chunk C block_d D warps W' -> mean milliseconds of the kernel at that launch."""
    from kernels.triton.triton_table_gradient import triton_table_gradient

    results = {}
    for name in ("item_table_w05_L512", "category_table_w05_L512"):
        grads, ids = make_case(*CASES[name])
        rows = CASES[name][1]
        for chunk, block_d, warps in itertools.product((16, 32, 64), (64, 128, 256), (2, 4, 8)):
            times = []
            for rep in range(reps + 2):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                triton_table_gradient(grads, ids, rows, chunk=chunk, block_d=block_d, warps=warps)
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            key = f"{name} chunk {chunk} block_d {block_d} warps {warps}"
            results[key] = statistics.mean(times[2:])
            print(f"{key}: {results[key]:.3f} ms", flush=True)
        del grads, ids
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--cases", nargs="*", default=list(CASES), choices=list(CASES))
    parser.add_argument("--configs", action="store_true", help="the kernel alone at each launch configuration")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/table_gradient.py times a GPU kernel: no CUDA device here")
    if args.configs:
        save("table_gradient_configs", {**vars(args), "device": torch.cuda.get_device_name()}, time_configs(8))
        return
    results = {}
    for name in args.cases:
        sizes, rows, dim, distinct, skew = CASES[name]
        grads, ids = make_case(sizes, rows, dim, distinct, skew)
        os.environ["GEM_TABLE_GRADIENT"] = "aten"
        want = table_gradient(grads, ids, rows)
        os.environ.pop("GEM_TABLE_GRADIENT")
        error = (table_gradient(grads, ids, rows) - want).abs().max().item()
        times = time_methods(grads, ids, rows, args.reps)
        figures = {m: {"ms_mean": statistics.mean(t), "ms_median": statistics.median(t)} for m, t in times.items()}
        figures["speedup"] = figures["aten"]["ms_mean"] / figures["triton"]["ms_mean"]
        figures["max_abs_difference"] = error
        figures["largest_row_share"] = torch.cat(ids).bincount().max().item() / sum(sizes)
        results[name] = figures
        print(f"{name}: aten {figures['aten']['ms_mean']:.3f} ms, triton {figures['triton']['ms_mean']:.3f} ms, "
              f"{figures['speedup']:.2f}x (max difference {error:.2e})", flush=True)
        del grads, ids, want
    save("table_gradient", {**vars(args), "cases": {n: CASES[n] for n in args.cases},
                            "device": torch.cuda.get_device_name()}, results)


if __name__ == "__main__":
    main()
