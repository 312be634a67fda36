"""Row-wise Adagrad's dense table update on a GPU: the Triton kernel (kernels.rowwise_adagrad) against the eager
reference it replaced, side by side on the same tables, at the table shapes of the GPU preset (full and half
width) and one it was not written for. Mean milliseconds per update over the timed repeats (CUDA events, the
median beside it) and the bandwidth each reaches counting the bytes it must move (gradient read, table read and
written). Saved as benchmarks/results/rowwise_adagrad.json; `--untouched 0.6 --output-name rowwise_adagrad_untouched`
zeroes 60% of the rows' gradients, as a batch that looks up 40% of a table leaves them.

    python -m benchmarks.rowwise_adagrad                  # on a CUDA machine
"""

from __future__ import annotations

import argparse
import statistics

import torch

from benchmarks.common import save
from kernels.pytorch.pt_rowwise_adagrad import pt_rowwise_adagrad_
from kernels.rowwise_adagrad import rowwise_adagrad_

# (rows, dim): gem_gpu's item table at width 1 and 0.5, its user table at half width, and a narrow tall one
SHAPES = [(262_144, 2048), (262_144, 1056), (131_072, 128), (1_000_000, 64)]


def time_update(update, param, grad, state, reps: int) -> list[float]:
    """Milliseconds of each of `reps` updates after 3 untimed ones."""
    for _ in range(3):
        update(param, grad, state, 0.01, 1e-10)
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        update(param, grad, state, 0.01, 1e-10)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--shapes", nargs="*", default=[f"{r}x{d}" for r, d in SHAPES], help="ROWSxDIM")
    parser.add_argument("--untouched", type=float, default=0.0,
                        help="share of rows whose gradient is zero (rows no batch looked up: the kernel skips them)")
    parser.add_argument("--output-name", default="rowwise_adagrad")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/rowwise_adagrad.py times a GPU kernel: no CUDA device here")
    results = {}
    for shape in args.shapes:
        rows, dim = map(int, shape.split("x"))
        param = torch.randn(rows, dim, device="cuda")
        grad, state = torch.randn_like(param), torch.rand(rows, 1, device="cuda")
        grad[torch.randperm(rows, device="cuda")[:int(args.untouched * rows)]] = 0.0
        moved = 3 * param.numel() * 4  # the gradient read, the table read and written (every row)
        figures = {}
        for name, update in (("eager", pt_rowwise_adagrad_), ("triton", rowwise_adagrad_)):
            times = time_update(update, param, grad, state, args.reps)
            mean = statistics.mean(times)
            figures[name] = {"ms_mean": mean, "ms_median": statistics.median(times),
                             "gb_per_s": moved / mean / 1e6}
        figures["speedup"] = figures["eager"]["ms_mean"] / figures["triton"]["ms_mean"]
        results[shape] = figures
        print(f"{shape}: eager {figures['eager']['ms_mean']:.3f} ms, triton {figures['triton']['ms_mean']:.3f} ms "
              f"({figures['triton']['gb_per_s']:.0f} GB/s), {figures['speedup']:.2f}x", flush=True)
        del param, grad, state
    save(args.output_name, {**vars(args), "device": torch.cuda.get_device_name()}, results)


if __name__ == "__main__":
    main()
