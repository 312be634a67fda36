"""Where a GEM step's attention work goes, counted on the host from a prepared plan (no GPU): every jagged attention
call of the model's forward on real plan steps, by block, branch and kind (self attention over [summary tokens,
history], the candidate's cross attention over it), with its sequences, its visible pairs, and how much of the work a
kernel does is real: the tiles' fill (visible pairs over BLOCK_M x BLOCK_N tiles covering each sequence) and the head
dim over its padded size. The lengths do not depend on the model's width, so the forward runs at a small width; the
head dim is the configured shape's.

    python -m benchmarks.mfu_data .gpu_data/mfu
    python -m benchmarks.attention_calls --data .gpu_data/mfu --width 0.5 --max-history-len 512

With --save-calls FILE the recorded lengths of --timed-steps of those steps are kept (npz, host); on a GPU,
--time-calls FILE runs each of those calls as the model makes it (bf16, the shape's heads and head dim; self
attention reads q, k and v from one fused projection, the cross attention its k and v) and reports its kernels'
device time, forward and forward + backward, from the profiler (tile lists cached, as every layer after a step's
first finds them):

    python -m benchmarks.attention_calls --data .gpu_data/mfu --save-calls .gpu_data/calls_w05_L512.npz
    python -m benchmarks.attention_calls --time-calls .gpu_data/calls_w05_L512.npz --output-name NAME   # GPU

`--variants default split_head ...` times kernel settings (KERNEL_VARIANTS) side by side on the same inputs.
"""

from __future__ import annotations

import argparse
import contextlib
from pathlib import Path

import numpy as np

from benchmarks.common import save
from benchmarks.jagged_attention import KERNEL_VARIANTS, kernel_variant
from kernels.triton.triton_jagged_attention import computed_dim, padded_dim

TILES = ((128, 64), (128, 128), (64, 64), (32, 32))  # (BLOCK_M, BLOCK_N): the forward's configs, and a smaller one
RUN_WIDTH = 0.0625  # the forward that records the calls: lengths are the same at every width


def tile_work(q_lengths: np.ndarray, kv_lengths: np.ndarray, block_m: int, block_n: int) -> float:
    """Query-key pairs the tiles covering every sequence compute (non-causal: every tile of a sequence is visited)."""
    return float((np.ceil(q_lengths / block_m) * block_m * np.ceil(kv_lengths / block_n) * block_n).sum())


def recorded_calls(spec, config, batch) -> list[tuple[np.ndarray, np.ndarray, bool]]:
    """(query lengths, key lengths, causal) of every attention call of the model's forward on a loader batch, in
    order."""
    import torch

    import gem_ops.model.sequence as sequence_layers
    from gem_ops.model.features import model_input
    from gem_ops.train.model_state import seeded_model

    calls = []
    attention = sequence_layers.jagged_attention_packed

    def recording(packed, q_offsets, kv_offsets=None, causal=False, **kwargs):
        keys = q_offsets if kv_offsets is None else kv_offsets
        calls.append((np.diff(q_offsets.numpy()), np.diff(keys.numpy()), causal))
        return attention(packed, q_offsets, kv_offsets, causal=causal, **kwargs)

    model = seeded_model(spec, config)
    sequence_layers.jagged_attention_packed = recording
    try:
        with torch.no_grad():
            model(model_input(batch, spec, config, with_level_sizes=True))
    finally:
        sequence_layers.jagged_attention_packed = attention
    return calls


def call_names(config) -> list[str]:
    """Each call's place, in the forward's order: per block, per branch, its self then its cross attention."""
    return [f"block {b} {branch} {kind}" for b in range(config.blocks) for branch in config.sequence.branches
            for kind in ("self", "cross")]


def save_calls(path: Path, recorded: list[list[tuple]], names: list[str], heads: int, head_dim: int) -> None:
    """Each recorded step's calls (query lengths, key lengths, causal) under "step|name|field", with the shape."""
    arrays = {"heads": np.array(heads), "head_dim": np.array(head_dim)}
    for step, calls in enumerate(recorded):
        for name, (q, kv, causal) in zip(names, calls):
            arrays.update({f"{step}|{name}|q": q, f"{step}|{name}|kv": kv, f"{step}|{name}|causal": np.array(causal)})
    tmp = path.with_name(path.name + ".tmp.npz")
    np.savez(tmp, **arrays)
    tmp.replace(path)


@contextlib.contextmanager
def naming_the_call(where: str):
    """An error inside the block carries `where` as a note, printed under its message: a CUDA fault ends the process
    (it is sticky), and a log's tail is all that may come back from a GPU machine."""
    try:
        yield
    except Exception as error:
        error.add_note(f"while timing {where}")
        raise


def time_calls(path: Path, variants: tuple[str, ...] = ("default",)) -> dict:
    """Device ms of each saved call's kernels, forward and forward + backward, and per step (see the module), for
    each kernel variant in turn on the same inputs, call by call: the first variant's figures at the top level, every
    variant's under "variants" with its step's time over the first's."""
    import torch

    from benchmarks.jagged_attention import _offsets, kernel_times
    from kernels.jagged_attention import jagged_attention
    from kernels.triton import triton_jagged_attention as kernel

    saved = np.load(path)
    heads, head_dim = int(saved["heads"]), int(saved["head_dim"])
    # In the forward's order, as saved: a call that tunes its kernels first may leave its configs to later calls
    # that share its autotuning key.
    keys = list(dict.fromkeys(tuple(k.split("|")[:2]) for k in saved.files if "|" in k))
    per_call: dict[str, dict[str, dict[str, list[float]]]] = {variant: {} for variant in variants}
    for step, name in keys:
        q_lengths, kv_lengths = (saved[f"{step}|{name}|{field}"] for field in ("q", "kv"))
        causal, cross = bool(saved[f"{step}|{name}|causal"]), "cross" in name.split()
        q_offsets, kv_offsets = _offsets(q_lengths.tolist()), _offsets(kv_lengths.tolist())
        dims = (heads, head_dim)
        fused_kv = torch.randn(int(kv_lengths.sum()), (2 if cross else 3) * heads, head_dim, device="cuda",
                               dtype=torch.bfloat16, requires_grad=True)
        leaves = (torch.randn(int(q_lengths.sum()), *dims, device="cuda", dtype=torch.bfloat16, requires_grad=True),
                  fused_kv) if cross else (fused_kv,)

        def attend():
            q, k, v = (leaves[0], *fused_kv.split(heads, dim=1)) if cross else fused_kv.split(heads, dim=1)
            return jagged_attention(q, k, v, q_offsets, kv_offsets if cross else None, causal=causal)

        d_out = torch.randn(int(q_lengths.sum()), *dims, device="cuda", dtype=torch.bfloat16)
        for variant in variants:
            with kernel_variant(variant), naming_the_call(f"step {step}, call {name!r}, kernel variant {variant!r}"):
                with torch.no_grad():
                    forward = sum(kernel_times(attend).values())
                both = sum(kernel_times(lambda: torch.autograd.grad(attend(), leaves, d_out)).values())
            row = per_call[variant].setdefault(name, {"fwd_ms": [], "fwd_bwd_ms": []})
            row["fwd_ms"].append(forward)
            row["fwd_bwd_ms"].append(both)
            print(f"step {step} {name:24s} {variant:20s} forward {forward:7.3f} ms  forward + backward {both:7.3f} ms",
                  flush=True)
    chosen = {name: {" ".join(map(str, key)): str(config) for key, config in launch.chosen.items()}
              for name, launch in (("forward", kernel._launch_forward), ("dq", kernel._launch_dq),
                                   ("dkdv", kernel._launch_dkdv))}
    figures = {variant: _step_figures(rows) for variant, rows in per_call.items()}
    first = figures[variants[0]]["per_step"]
    for variant, figure in figures.items():
        figure["fwd_bwd_over_first"] = figure["per_step"]["fwd_bwd_ms"] / first["fwd_bwd_ms"]
        print(f"{variant}: a step's attention: forward {figure['per_step']['fwd_ms']:.2f} ms, forward + backward "
              f"{figure['per_step']['fwd_bwd_ms']:.2f} ms ({figure['fwd_bwd_over_first']:.3f}x {variants[0]}'s)")
    return {"heads": heads, "head_dim": head_dim, "steps": len({step for step, _ in keys}),
            "device": torch.cuda.get_device_name(), "chosen_configs": chosen, **figures[variants[0]],
            "variants": figures}


def _step_figures(rows: dict[str, dict[str, list[float]]]) -> dict:
    """Per call the mean over steps; per step the sum over calls; the self and cross attentions' shares."""
    figures = {"per_call": {name: {field: float(np.mean(values)) for field, values in row.items()}
                            for name, row in rows.items()}}
    figures["per_step"] = {field: sum(row[field] for row in figures["per_call"].values())
                           for field in ("fwd_ms", "fwd_bwd_ms")}
    for kind in ("self", "cross"):
        figures[f"{kind}_share_of_fwd_bwd"] = sum(row["fwd_bwd_ms"] for name, row in figures["per_call"].items()
                                                  if name.endswith(kind)) / figures["per_step"]["fwd_bwd_ms"]
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, help="mfu_data's folder (sequence_logs, plans)")
    parser.add_argument("--preset", default="gem_gpu")
    parser.add_argument("--width", type=float, default=0.5)
    parser.add_argument("--max-history-len", type=int, default=512)
    parser.add_argument("--steps", type=int, default=8, help="plan steps, evenly spaced over the plan")
    parser.add_argument("--output-name", default="attention_calls_w05_L512")
    parser.add_argument("--save-calls", type=Path, help="keep the recorded lengths of --timed-steps steps (npz)")
    parser.add_argument("--timed-steps", type=int, default=2, help="with --save-calls: the first this many steps")
    parser.add_argument("--time-calls", type=Path, help="GPU: time the calls a --save-calls file holds")
    parser.add_argument("--variants", nargs="+", choices=sorted(KERNEL_VARIANTS), default=["default"],
                        help="with --time-calls: kernel settings timed side by side, call by call, against the first")
    args = parser.parse_args()
    if args.time_calls:
        save(args.output_name, vars(args), time_calls(args.time_calls, tuple(args.variants)))
        return
    if args.data is None:
        parser.error("--data is required (or --time-calls)")

    from gem_ops.data.batch_shuffling import read_rank_plan
    from gem_ops.data.loader import SequenceLogs
    from gem_ops.model.config import model_config
    from gem_ops.model.features import FeatureSpec

    history = {"sequence.max_history_len": args.max_history_len}
    shape = model_config(args.preset, width=args.width, **history)
    head_dim = shape.embedding.sequence_dim // shape.sequence.heads
    logs = SequenceLogs(args.data / "sequence_logs")
    plan = read_rank_plan(args.data / "plans" / "world_size=1.parquet", 0)
    spec, run_config = FeatureSpec.from_logs(logs), model_config(args.preset, width=RUN_WIDTH, **history)
    names = call_names(run_config)
    tiles = [f"{m}x{n}" for m, n in TILES]
    totals = {name: {"pairs": 0.0, "sequences": 0, "queries": 0.0, "keys": 0.0, "tiles": dict.fromkeys(tiles, 0.0)}
              for name in names}
    steps = np.linspace(0, len(plan) - 1, args.steps).round().astype(int)
    recorded = []
    for step in steps:
        calls = recorded_calls(spec, run_config, logs.batch(plan[step], args.max_history_len))
        recorded.append(calls)
        if len(calls) != len(names):
            raise RuntimeError(f"{len(calls)} attention calls, expected {len(names)} ({names})")
        for name, (q, kv, _) in zip(names, calls):
            row = totals[name]
            row["pairs"] += float((q * kv).sum())
            row["sequences"] += q.size
            row["queries"] += float(q.sum())
            row["keys"] += float(kv.sum())
            for tile, (m, n) in zip(tiles, TILES):
                row["tiles"][tile] += tile_work(q, kv, m, n)
    all_pairs = sum(row["pairs"] for row in totals.values())
    per_call = {name: {"share_of_pairs": row["pairs"] / all_pairs,
                       "mean_query_length": row["queries"] / row["sequences"],
                       "mean_key_length": row["keys"] / row["sequences"],
                       "tile_fill": {tile: row["pairs"] / work for tile, work in row["tiles"].items()}}
                for name, row in totals.items()}
    fill = {tile: all_pairs / sum(row["tiles"][tile] for row in totals.values()) for tile in tiles}
    computed = computed_dim(head_dim)  # 96 as 64 + 32; padded with JAGGED_ATTENTION_SPLIT_HEAD=0
    results = {"head_dim": head_dim, "padded_head_dim": padded_dim(head_dim), "computed_head_dim": computed,
               "head_dim_fill": head_dim / computed, "tile_fill": fill,
               "real_work_share": {tile: f * head_dim / computed for tile, f in fill.items()},
               "calls_per_step": len(names), "per_call": per_call}
    print(f"head dim {head_dim} (computed at {computed}), {len(names)} calls a step, "
          f"{len(steps)} steps")
    for name, row in per_call.items():
        print(f"  {name:24s} pairs {row['share_of_pairs']:6.1%}  lengths q {row['mean_query_length']:6.1f} "
              f"kv {row['mean_key_length']:6.1f}  fill " +
              " ".join(f"{tile} {f:.2f}" for tile, f in row["tile_fill"].items()))
    print("every call: fill " + " ".join(f"{tile} {f:.2f}" for tile, f in fill.items()) +
          "; real work with the head dim's padding: " +
          " ".join(f"{tile} {f:.2f}" for tile, f in results["real_work_share"].items()))
    if args.save_calls:
        save_calls(args.save_calls, recorded[:args.timed_steps], names, shape.sequence.heads, head_dim)
        print(f"saved the calls of {min(args.timed_steps, len(recorded))} steps to {args.save_calls}")
        return
    save(args.output_name, {**vars(args), "steps_used": steps.tolist(), "tiles": TILES}, results)


if __name__ == "__main__":
    main()
