"""Serving latency on this machine's CPU cores (or a GPU with --device cuda for the eager path): p50 / p99 and
requests per second of one request (one user, N candidates) for N = 1, 100 and 1000, eager (GEMModel on a
loader batch, as the pyfunc runs it without its table conversion) against the exported artifact
(ExportedProgram, and AOTInductor where it compiles); fixed against adaptive history caps at the same mean
cost; and latency against history length (plot saved beside the JSON).

Two models with random weights (latency does not depend on their values): the vertical preset as registered
(histories up to 64 events, a 64-wide looked-up representation) and a long-history GEM (width 0.5, 2 blocks,
up to 1024 events) for the history sweeps. Request history lengths for the fixed/adaptive comparison are
drawn lognormal (median ~33 events, a long tail past 1024, like the synthetic log's activity). Timing starts
once the 1-minute load average is below --max-load (the machine is shared), and the paths compared in a figure
(eager, exported, compiled; fixed and adaptive caps) take turns request by request, so that the load moves them alike.

    python benchmarks/serving.py [--requests 30] [--formats exported_program aot_inductor] [--threads 2]
    python benchmarks/serving.py --device cuda      # eager on the GPU (scores copied back: the server's latency)
    python benchmarks/serving.py --retrieved-events 8   # serving_retrieved.json: recent events plus retrieved ones

With --retrieved-events K the run measures only what retrieval costs a server: the long-history model trained
to read up to K retrieved older events of each candidate's item (sequence.retrieved_events) at history caps 16
and 64 with every candidate's K slots full (the most a request can cost), side by side with the same model
without retrieval at those caps and at cap + K.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

import numpy as np  # noqa: E402

from benchmarks.common import RESULTS, Quiet, save  # noqa: E402

CANDIDATES = (1, 100, 1000)
HISTORY_SWEEP = (0, 16, 64, 256, 1024)
SWEEP_CANDIDATES = 100


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=30, help="timed requests per figure")
    parser.add_argument("--formats", nargs="+", default=["exported_program", "aot_inductor"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-load", type=float, default=1.3)
    parser.add_argument("--load-wait", type=float, default=900.0)
    parser.add_argument("--device", default="cpu", help="cuda: the eager path on the GPU (the exported "
                        "artifacts are CPU programs), saved as serving_cuda.json")
    parser.add_argument("--fixed-cap", type=int, default=256, help="the fixed cap the adaptive policy matches in cost "
                        "(its short cap: a quarter of it)")
    parser.add_argument("--retrieved-events", type=int, default=0, help="measure retrieval's cost only (see above)")
    args = parser.parse_args()

    import torch

    from gem_ops.model.config import model_config
    from gem_ops.model.features import model_input
    from gem_ops.serving.adaptive import fit_policy, history_costs, request_costs
    from gem_ops.serving.client import ServingClient
    from gem_ops.serving.export import example_request, export_serving
    from gem_ops.serving.latency import LatencySettings, measure_side_by_side, warm_up_latency
    from gem_ops.train.warm_up import length_buckets
    from gem_ops.serving.request import request_batch
    from gem_ops.train.model_state import seeded_model
    from tests.model_inputs import SPEC

    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    formats = args.formats if device.type == "cpu" else []
    quiet = Quiet(args.max_load, args.load_wait)
    models = {"vertical": seeded_model(SPEC, model_config("vertical", teacher_representation_dim=64)).eval(),
              "long_history": seeded_model(SPEC, model_config("gem", width=0.5, blocks=2, **{
                  "sequence.max_history_len": 1024, "sequence.first_level_tokens": 32})).eval()}
    if args.retrieved_events:
        long = models["long_history"].config
        models = {"long_history": models["long_history"],
                  "long_history_retrieving": seeded_model(SPEC, replace(long, sequence=replace(
                      long.sequence, retrieved_events=args.retrieved_events))).eval()}
    models = {name: model.to(device) for name, model in models.items()}

    def eager(model):
        def score(request):
            batch = request_batch(request, SPEC)
            # the scores back on the host, as a server returns them (on a GPU: the wait for the device)
            return torch.sigmoid(model(model_input(batch, SPEC, model.config).to(device))).cpu()
        return score

    results = {"latency": {}, "fixed_vs_adaptive": {}, "history_sweep": {}, "export_seconds": {}, "loads": []}

    def timed(scorers: dict, counts=CANDIDATES) -> dict:
        """{name: {candidates: figures}} of {name: (score, request_of)}, taking turns request by request."""
        results["loads"].append(quiet.wait())
        figures = measure_side_by_side(scorers, LatencySettings(counts, args.requests, 2))
        return {name: {str(n): f for n, f in by_count.items()} for name, by_count in figures.items()}

    with tempfile.TemporaryDirectory() as tmp:
        scorers = {}
        for name, model in models.items():
            scorers[name] = {"eager": eager(model)}
            for fmt in formats:
                try:
                    exported = export_serving(model, Path(tmp) / f"{name}_{fmt}", fmt)
                except Exception as error:  # noqa: BLE001 - recorded: AOTInductor needs a working compiler
                    results["export_seconds"][f"{name}.{fmt}"] = f"failed: {error}"
                    continue
                results["export_seconds"][f"{name}.{fmt}"] = round(exported.seconds, 1)
                scorers[name][fmt] = ServingClient(exported.folder).score
            # Untimed on a GPU, one request per history-length bucket and candidate count, as a server warms up
            # before it takes traffic: the attention kernel tunes and compiles each bucket on its first call.
            full = model.config.sequence.max_history_len
            for score in scorers[name].values() if device.type == "cuda" else ():
                warm_up_latency(score, lambda n, length, model=model: example_request(model, n, length, 0),
                                [0, *length_buckets(full)], CANDIDATES)
        if args.retrieved_events:
            results = {"retrieved": _retrieval_latency(models, scorers, args.retrieved_events, timed),
                       "export_seconds": results["export_seconds"], "loads": results["loads"]}
            save("serving_retrieved", {**vars(args), "models": {n: m.config.to_dict() for n, m in models.items()},
                                       "torch_threads": torch.get_num_threads(), "device": device.type}, results)
            return
        # 1. The vertical at its full history: eager against exported, 1 / 100 / 1000 candidates.
        vertical = models["vertical"]
        full = vertical.config.sequence.max_history_len
        results["latency"] = timed({mode: (score, lambda n, seed: example_request(vertical, n, full, seed))
                                    for mode, score in scorers["vertical"].items()})
        for mode, figures in results["latency"].items():
            print(f"vertical {mode}: " + _line(figures), flush=True)
        # 2. Fixed against adaptive history caps, same mean cost, on the long-history model.
        long = models["long_history"]
        costs = history_costs(long.config, SPEC)
        lengths = np.minimum(np.random.default_rng(0).lognormal(3.5, 1.5, 20_000).astype(int), 4096)
        budget = request_costs(costs, lengths, args.fixed_cap).mean()
        policy = fit_policy(lengths, costs, budget, args.fixed_cap // 4, (1024, 256))  # as adaptive_compute.py
        draw = np.random.default_rng(1).choice(lengths, 10_000)
        caps = {f"fixed_{args.fixed_cap}": lambda n: args.fixed_cap,
                f"adaptive_at_{args.fixed_cap}": lambda n: int(policy.caps(np.array([n]))[0])}

        def capped(cap_of):
            def request_of(n, seed):
                length = int(draw[seed % draw.size])
                return example_request(long, n, min(length, cap_of(length)), seed)
            return request_of
        figures = timed({f"{label}/{mode}": (score, capped(cap_of)) for label, cap_of in caps.items()
                         for mode, score in scorers["long_history"].items()}, (1, SWEEP_CANDIDATES))
        for label in caps:
            results["fixed_vs_adaptive"][label] = {mode: figures[f"{label}/{mode}"] for mode in scorers["long_history"]}
            print(f"{label}: " + "; ".join(f"{m} {_line(f)}" for m, f in results["fixed_vs_adaptive"][label].items()),
                  flush=True)
        results["fixed_vs_adaptive"]["policy"] = policy.to_dict() | {"mean_budget_flops": float(budget)}
        # 3. Latency against history length, 100 candidates.
        results["history_sweep"] = {mode: {} for mode in scorers["long_history"]}
        for length in HISTORY_SWEEP:
            figures = timed({mode: (score, lambda n, seed, length=length: example_request(long, n, length, seed))
                             for mode, score in scorers["long_history"].items()}, (SWEEP_CANDIDATES,))
            for mode, by_count in figures.items():
                results["history_sweep"][mode][str(length)] = by_count[str(SWEEP_CANDIDATES)]
        for mode, by_length in results["history_sweep"].items():
            print(f"history sweep {mode}: " + ", ".join(f"{L}: {f['p50_ms']:.1f} ms" for L, f in by_length.items()),
                  flush=True)
    name = "serving" if device.type == "cpu" else f"serving_{device.type}"
    _plot(results["history_sweep"], RESULTS / f"{name}_latency_vs_history.png")
    if device.type == "cuda":
        results["device_name"] = torch.cuda.get_device_name(device)
    save(name, {**vars(args), "candidates": CANDIDATES, "history_sweep": HISTORY_SWEEP,
                "models": {n: m.config.to_dict() for n, m in models.items()},
                "torch_threads": torch.get_num_threads(), "device": device.type}, results)


def _retrieval_latency(models: dict, scorers: dict, k: int, timed) -> dict:
    """Per cap (16, 64): the plain model at cap and at cap + k, and the retrieving model at cap with every
    candidate's k retrieved slots full; 1 and 100 candidates, each scoring path."""
    from gem_ops.serving.export import example_request

    out = {}
    for cap in (16, 64):
        def full_slots(n, seed, cap=cap):
            request = example_request(models["long_history_retrieving"], n, cap, seed)
            request["retrieved_count"].fill_(k)
            return request

        runs = {f"fixed_{cap}": ("long_history",
                                 lambda n, seed, cap=cap: example_request(models["long_history"], n, cap, seed)),
                f"fixed_{cap + k}": ("long_history",
                                      lambda n, seed, cap=cap: example_request(models["long_history"], n,
                                                                               cap + k, seed)),
                f"retrieved_at_{cap}": ("long_history_retrieving", full_slots)}
        figures = timed({f"{label}/{mode}": (score, request_of) for label, (model, request_of) in runs.items()
                         for mode, score in scorers[model].items()}, (1, SWEEP_CANDIDATES))
        for label, (model, _) in runs.items():
            out[label] = {mode: figures[f"{label}/{mode}"] for mode in scorers[model]}
            print(f"{label}: " + "; ".join(f"{m} {_line(f)}" for m, f in out[label].items()), flush=True)
    return out


def _line(figures: dict) -> str:
    return ", ".join(f"N={n}: p50 {f['p50_ms']:.2f} / p99 {f['p99_ms']:.2f} ms, {f['requests_per_s']:.0f} req/s"
                     for n, f in figures.items())


def _plot(sweep: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6, 4))
    for mode, by_length in sweep.items():
        lengths = [int(L) for L in by_length]
        axis.plot(lengths, [f["p50_ms"] for f in by_length.values()], marker="o", label=f"{mode} p50")
        axis.plot(lengths, [f["p99_ms"] for f in by_length.values()], linestyle="--", label=f"{mode} p99")
    axis.set_xscale("symlog", linthresh=16)
    axis.set_yscale("log")
    axis.set_xlabel("history length (events)")
    axis.set_ylabel(f"latency per request, {SWEEP_CANDIDATES} candidates (ms)")
    axis.set_title("Serving latency against history length (long-history GEM, CPU)")
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
