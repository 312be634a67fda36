"""How much the engine's prefetch thread, building the next step's input, slows the training thread's host work
through Python's global interpreter lock.

First the loader's time per batch (`engine.step_input`, as the prefetch thread runs it: wall and the thread's CPU
time) over steps of an MFU data folder's plan at a shape. Then a stand-in for a host-bound step's launches (small
in-place ops, bound by Python and the dispatcher as a step's kernel launches are) timed alone and while a thread
builds batches without pause, in turns: the most the loader can take from the launching thread. At one batch a step
it is busy for its batch time of each step, so it takes about that share of this.

    python -m benchmarks.mfu_data data/mfu --world-sizes 1
    python -m benchmarks.loader_contention --data data/mfu [--preset gem_gpu --width 0.5 --max-history-len 512]
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from pathlib import Path

from benchmarks.common import save


def loader(data: Path, preset: str, width: float, max_history_len: int):
    """(a function building step s's input, the plan's step count)."""
    from gem_ops.data.loader import SequenceLogs
    from gem_ops.model.config import FeatureSpec, model_config
    from gem_ops.train.batches import rank_schedule
    from gem_ops.train.config import TrainConfig
    from gem_ops.train.engine import step_input

    plan = data / "plans" / "world_size=1.parquet"
    if not plan.exists():
        raise SystemExit(f"{plan} not found: make the data with `python -m benchmarks.mfu_data {data} --world-sizes 1`")
    logs = SequenceLogs(data / "sequence_logs")
    config = model_config(preset, width=width, **{"sequence.max_history_len": max_history_len})
    spec, train = FeatureSpec.from_logs(logs), TrainConfig()
    schedule = rank_schedule(logs, plan, 0, 1, 1, train.seed, max_history_len)
    return (lambda step: step_input(logs, schedule.examples(step), step, spec, config, train)), schedule.plan_steps


def batch_times(load, steps: list[int]) -> dict:
    wall, cpu, sizes = [], [], []
    for step in steps:
        began, thread_began = time.perf_counter(), time.thread_time()
        size, _, _ = load(step)
        wall.append(time.perf_counter() - began)
        cpu.append(time.thread_time() - thread_began)
        sizes.append(size)
    return {"wall_ms_mean": 1e3 * statistics.mean(wall), "thread_cpu_ms_mean": 1e3 * statistics.mean(cpu),
            "batch_size_mean": statistics.mean(sizes), "steps": steps}


def launches(ops: int) -> float:
    """Seconds for `ops` small in-place ops (no device: the dispatcher and Python alone)."""
    import torch

    x = torch.zeros(4)
    began = time.perf_counter()
    for _ in range(ops):
        x.add_(1.0)
    return time.perf_counter() - began


def contention(load, steps: list[int], ops: int, repeats: int, rounds: int) -> dict:
    """The stand-in's seconds alone and beside a thread loading without pause, `rounds` turns of `repeats` each."""
    alone, beside, loads, ratios = [], [], 0, []
    for _ in range(rounds):
        alone += [launches(ops) for _ in range(repeats)]
        stop, done = threading.Event(), [0]

        def keep_loading(stop=stop, done=done):
            i = 0
            while not stop.is_set():
                load(steps[i % len(steps)])
                done[0] += 1
                i += 1

        thread = threading.Thread(target=keep_loading, daemon=True)
        thread.start()
        time.sleep(0.1)  # the loader under way
        beside += [launches(ops) for _ in range(repeats)]
        stop.set()
        thread.join()
        loads += done[0]
        ratios.append(statistics.mean(beside[-repeats:]) / statistics.mean(alone[-repeats:]))  # a round's pair

    def figures(seconds):
        return {"ms_mean": 1e3 * statistics.mean(seconds), "ms_median": 1e3 * statistics.median(seconds)}

    return {"alone": figures(alone), "beside_a_loading_thread": figures(beside), "loads": loads,
            "ratio_mean": statistics.mean(beside) / statistics.mean(alone), "round_ratios": ratios}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, required=True, help="a folder made by benchmarks.mfu_data")
    parser.add_argument("--preset", default="gem_gpu")
    parser.add_argument("--width", type=float, default=0.5)
    parser.add_argument("--max-history-len", type=int, default=512)
    parser.add_argument("--batches", type=int, default=10, help="plan steps timed, from step 10")
    parser.add_argument("--ops", type=int, default=3000, help="small ops in one stand-in step")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--torch-threads", type=int, default=1,
                        help="intra-op threads, 1: the loader's C work takes no core from the other thread")
    parser.add_argument("--output-name", default="loader_contention")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.torch_threads)
    load, plan_steps = loader(args.data, args.preset, args.width, args.max_history_len)
    steps = [s % plan_steps for s in range(10, 10 + args.batches)]
    load(steps[0])  # first-call costs out of the figures
    results = {"loader": batch_times(load, steps),
               "contention": contention(load, steps, args.ops, args.repeats, args.rounds)}
    batch, shared = results["loader"], results["contention"]
    print(f"loader: {batch['wall_ms_mean']:.1f} ms a batch of {batch['batch_size_mean']:.0f} examples "
          f"({batch['thread_cpu_ms_mean']:.1f} ms of the thread's CPU time)")
    beside = shared["beside_a_loading_thread"]
    print(f"stand-in step: {shared['alone']['ms_mean']:.2f} ms alone, {beside['ms_mean']:.2f} ms beside a thread "
          f"loading without pause ({shared['loads']} batches): {shared['ratio_mean']:.3f}x (rounds "
          f"{min(shared['round_ratios']):.2f}-{max(shared['round_ratios']):.2f}x)")
    save(args.output_name, vars(args), results)


if __name__ == "__main__":
    main()
