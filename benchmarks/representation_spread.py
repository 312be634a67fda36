"""How far apart the examples stay inside GEM while it trains, layer by layer, step by step.

A layer's spread is the standard deviation of its output over a batch's examples, averaged over its features,
divided by the output's root mean square: near 1 when examples differ by as much as the layer outputs, near 0
when the layer hands every example nearly the same vector. When the trunk's spread falls towards 0 the towers see
little but the surface, and the model predicts base rates: the stall that two synthetic seeds of a bias-free GEM
met after a 20-step warm-up (`results/gem_quality_qkv_bias.json`). Each run trains as `gem_quality.py` trains GEM
(same data, split, schedule over the whole run) and stops after `--steps` steps; nothing is evaluated.

    python benchmarks/gem_quality.py --prepare-to .gpu_data/quality --datasets synthetic
    python benchmarks/representation_spread.py --data .gpu_data/quality --seeds 0 2 4 --steps 250 --jobs 2 \\
        --variants gem gem_no_bias:sequence.bias=false \\
        "gem_no_bias_warmup100:sequence.bias=false,train.warmup_steps=100" gem_warmup100:train.warmup_steps=100

Variants: NAME:KEY=VALUE,...; model settings as dotted keys, training settings as `train.<TrainConfig field>`.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from benchmarks.common import in_processes, named_settings, save, saved_results, train_changes  # noqa: E402
from benchmarks.gem_quality import add_training_arguments, data_root, model_settings, train_settings  # noqa: E402

COLLAPSED = 0.02  # the trunk's spread below which the model has been seen to predict base rates only
RECOVERED = 0.1  # ... and above which it is taken to have come back (its spread starts near 0.3)
# Runs are traced, never evaluated nor stopped; each step is read before the next one runs (the hook reads layers)
UNEVALUATED = {"eval_every": 0, "early_stopping_patience": 0, "step_readout": "each_step"}


class _Enough(Exception):
    """Raised by the step hook after the last recorded step: the rest of the run is not needed."""


def spread(output) -> tuple[float, float]:
    """(std over the batch averaged over features / rms, rms) of a layer's output [B, ...] (history tokens [N, d]
    count each token as an example)."""
    t = output.detach().float().flatten(1)
    rms = float(t.pow(2).mean().sqrt())
    return float(t.std(0).mean()) / max(rms, 1e-12), rms


def layer_hooks(model, latest: dict) -> None:
    """Record each watched layer's spread into `latest` on every forward."""
    def keep(name):
        def hook(module, inputs, output):
            latest[name] = spread(output[0] if isinstance(output, tuple) else output)
        return hook

    def embeddings(module, inputs, output):
        for name, tensor in zip(("pooled", "candidate", "history"), output):
            latest[f"embeddings.{name}"] = spread(tensor)

    model.embeddings.register_forward_hook(embeddings)
    for branch in model.branches:  # its summary tokens, what the interaction arm reads
        branch.register_forward_hook(keep(f"branch.{branch.name}"))
    for i, layer in enumerate(model.interaction):
        layer.register_forward_hook(keep(f"interaction.{i}"))
    model.trunk.register_forward_hook(keep("trunk"))


def trace(root: str, name: str, settings: dict, args, seed: int) -> dict:
    from gem_ops.data.loader import TrainingData
    from gem_ops.model.config import FeatureSpec, model_config
    from gem_ops.train.engine import train
    from gem_ops.train.model_state import seeded_model

    data = TrainingData.at(root)
    logs, plan = data.open(), data.plans[1]
    config = model_config("gem", width=args.width, **{"sequence.max_history_len": args.max_history_len}
                          | model_settings(settings))
    train_config = train_settings(args, plan, seed, **train_changes(settings) | UNEVALUATED)
    model = seeded_model(FeatureSpec.from_logs(logs), config, args.device, seed)
    latest: dict = {}
    layer_hooks(model, latest)
    steps = []

    def record(step: int, loss: float) -> None:
        if step % args.record_every == 0 or step + 1 == args.steps:
            steps.append({"step": step, "loss": loss, "layers": dict(latest)})
        if step + 1 >= args.steps:
            raise _Enough

    try:
        train(logs, plan, config, train_config, device=args.device, model=model, step_hooks=[record])
    except _Enough:
        pass
    return {"variant": name, "seed": seed, "settings": settings, "steps": steps}


def trunk_course(steps: list[dict]) -> dict:
    """The trunk's spread at the start, its minimum, at the last step traced; the step at which it first fell
    below COLLAPSED and the one at which it next came back above RECOVERED (None: not within the trace)."""
    trunk = [(s["step"], s["layers"]["trunk"][0]) for s in steps]
    fell = next((step for step, t in trunk if t < COLLAPSED), None)
    back = None if fell is None else next((step for step, t in trunk if step > fell and t >= RECOVERED), None)
    return {"first": trunk[0][1], "min": min(t for _, t in trunk), "last": trunk[-1][1], "last_step": trunk[-1][0],
            "collapsed_at": fell, "recovered_at": back,
            # to the end of the trace when it has not come back: a lower bound then
            "steps_collapsed": 0 if fell is None else (back if back is not None else trunk[-1][0] + 1) - fell}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", default="synthetic", choices=("synthetic", "movielens"))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 2, 4])
    parser.add_argument("--variants", nargs="+", default=["gem"], metavar="NAME:KEY=VALUE,...")
    parser.add_argument("--steps", type=int, default=250, help="steps traced from the start of each run")
    parser.add_argument("--record-every", type=int, default=5)
    add_training_arguments(parser)
    parser.add_argument("--output-name", default="representation_spread")
    parser.add_argument("--resume", action="store_true", help="keep the runs saved under --output-name")
    args = parser.parse_args()

    variants = dict(map(named_settings, args.variants))
    for name, settings in variants.items():
        if fixed := sorted(set(train_changes(settings)) & set(UNEVALUATED)):
            parser.error(f"--variants {name}: train.{', train.'.join(fixed)} cannot be set here: each run is traced "
                         "for --steps steps without evaluation")
    with tempfile.TemporaryDirectory() as tmp:
        root = str(data_root(args.dataset, args, Path(tmp)))
        calls = {(name, seed): (root, name, settings, args, seed) for name, settings in variants.items()
                 for seed in args.seeds}
        kept = saved_results(args.output_name).get("runs", []) if args.resume else []
        runs = [r for r in kept if r["variant"] in variants]
        calls = {key: call for key, call in calls.items() if key not in {(r["variant"], r["seed"]) for r in runs}}
        for _, figures in in_processes(trace, calls, args.jobs):
            runs.append(figures)
            report(figures)
            _save(args, runs)
        if not calls:  # only the summary of what was kept
            _save(args, runs)


def report(run: dict) -> None:
    course = trunk_course(run["steps"])
    print(f"{run['variant']} seed {run['seed']}: trunk spread {course['first']:.3f} at the start, min "
          f"{course['min']:.4f}, {course['last']:.4f} at step {course['last_step']}; below {COLLAPSED} at step "
          f"{course['collapsed_at']}, back above {RECOVERED} at step {course['recovered_at']}", flush=True)


def _save(args, runs: list[dict]) -> None:
    traced = ("variant", "seed", "settings", "steps")  # the summary is recomputed from them on every save
    runs = sorted(({k: r[k] for k in traced} | {"trunk": trunk_course(r["steps"])} for r in runs),
                  key=lambda r: (r["variant"], r["seed"]))
    save(args.output_name, vars(args), {"dataset": args.dataset, "collapsed_below": COLLAPSED,
                                        "recovered_above": RECOVERED, "runs": runs})


if __name__ == "__main__":
    main()
