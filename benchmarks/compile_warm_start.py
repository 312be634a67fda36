"""What a new process pays to compile GEM's step (TrainConfig.compile="model") when the compile caches are warm,
with and without AOTAutograd's cache keeping graphs that hold a torch.autograd.Function (take_rows).

For each setting: a fresh cache folder, then the same child process twice (cold, then warm). Each child builds a
small GEM, compiles its step through Inductor, runs one batch forward and backward and reports the seconds to that
first gradient and AOTAutograd's cache counters. Saved as benchmarks/results/compile_warm_start.json.

    python -m benchmarks.compile_warm_start            # about 2.5 minutes on 2 CPU cores
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from benchmarks.common import save


def child(allow_custom_functions: bool, width: float, blocks: int) -> None:
    import torch
    import torch._functorch.config as functorch_config
    from torch._dynamo.utils import counters

    from gem_ops.model.config import model_config
    from gem_ops.model.features import model_input
    from gem_ops.train.acceleration import compile_model_step
    from gem_ops.train.model_state import seeded_model
    from tests.model_inputs import SPEC, random_batch

    config = model_config("gem", width=width, blocks=blocks,
                          **{"embedding.item_buckets": 1024, "embedding.user_buckets": 1024})
    model = seeded_model(SPEC, config)
    x = model_input(random_batch([3, 1, 12, 0, 70], 0), SPEC, config, with_level_sizes=True)
    compile_model_step(model)
    # The setting compile_model_step makes, taken back for the "without" runs (compiling happens at the first call).
    functorch_config.autograd_cache_allow_custom_autograd_functions = allow_custom_functions
    began = time.perf_counter()
    model.loss(x)[0].backward()
    print(json.dumps({"seconds_to_first_gradient": time.perf_counter() - began,
                      "aot_autograd": dict(counters["aot_autograd"]), "inductor": {
                          k: v for k, v in counters["inductor"].items() if k.startswith("fxgraph_cache")},
                      "torch": torch.__version__}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=float, default=0.5)
    parser.add_argument("--blocks", type=int, default=2)
    parser.add_argument("--child", choices=("with", "without"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child == "with", args.width, args.blocks)
        return
    results = {}
    for setting in ("without", "with"):
        with tempfile.TemporaryDirectory() as cache:
            env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
            runs = []
            for start in ("cold", "warm"):
                done = subprocess.run([sys.executable, "-m", "benchmarks.compile_warm_start", "--child", setting,
                                       "--width", str(args.width), "--blocks", str(args.blocks)],
                                      env=env, capture_output=True, text=True, check=True)
                runs.append({"start": start, **json.loads(done.stdout.strip().splitlines()[-1])})
                print(f"{setting} custom Functions in AOTAutograd's cache, {start}: "
                      f"{runs[-1]['seconds_to_first_gradient']:.1f} s, {runs[-1]['aot_autograd']}", flush=True)
            results[setting] = runs
    path = save("compile_warm_start", vars(args), results)
    print(f"saved {path}")


if __name__ == "__main__":
    main()
