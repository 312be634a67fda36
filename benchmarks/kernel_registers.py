"""Registers and spills of the jagged attention kernels as ptxas builds them for Hopper (sm_90a), per
autotune config: compiled on the host, no GPU needed. Bf16, causal softmax, tensor-descriptor loads, the
backward without atomic dq.

    python -m benchmarks.kernel_registers [--head-dims 64 128]

Writes benchmarks/results/kernel_registers.json. The figures are the local Triton's (recorded in the
settings); the GPU machine may run another version.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from benchmarks.common import save
from kernels.triton import triton_jagged_attention as kernel

TARGET = GPUTarget("cuda", 90, 32)
# Which descriptor argument holds blocks of which config size.
DESCRIPTOR_BLOCK = {"k_desc": "BLOCK_N", "v_desc": "BLOCK_N", "q_desc": "BLOCK_M", "do_desc": "BLOCK_M"}
STATS_DESCRIPTORS = ("stats_desc",)  # the dk/dv kernel's one-dimensional logsumexp and delta
POINTER_TYPES = {"stats_ptr": "*fp32", "descale_ptr": "*fp32", "q_offsets_ptr": "*i64",
                 "kv_offsets_ptr": "*i64", "tiles_ptr": "*i32", "tile_index_ptr": "*i32"}


def signature(fn, config: triton.Config, dim: int) -> tuple[dict, dict]:
    constexprs = dict(HEAD_DIM=dim, VALUE_DIM=dim, D_PAD=dim, DV_PAD=dim, CAUSAL=True, SILU=False, TMA=True,
                      FP8=False, ADD_DQ=False, DQ_TMA=False, **config.kwargs)
    constexprs = {name: value for name, value in constexprs.items() if name in fn.arg_names}
    types = {}
    for name in fn.arg_names:
        if name in constexprs:
            types[name] = "constexpr"
        elif name in DESCRIPTOR_BLOCK:
            types[name] = f"tensordesc<bf16[{config.kwargs[DESCRIPTOR_BLOCK[name]]}, {dim}]>"
        elif name in STATS_DESCRIPTORS:
            types[name] = f"tensordesc<fp32[{config.kwargs['BLOCK_M']}]>"
        elif name.endswith("_ptr") or name == "dq_desc":  # dq_desc is the dq tensor itself without atomic dq
            types[name] = POINTER_TYPES.get(name, "*bf16")
        else:
            types[name] = "fp32" if name == "scale" else "i32"
    return types, constexprs


def ptxas_report(compiled) -> dict:
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.TemporaryDirectory() as tmp:
        ptx = os.path.join(tmp, "kernel.ptx")
        with open(ptx, "w") as f:
            f.write(compiled.asm["ptx"])
        log = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", ptx, "-o", os.path.join(tmp, "kernel.cubin")],
                             capture_output=True, text=True, check=True).stderr
    registers = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    return {"registers": int(registers.group(1)), "spill_store_bytes": int(spills.group(1)),
            "spill_load_bytes": int(spills.group(2)), "shared_bytes": compiled.metadata.shared}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    args = parser.parse_args()
    results = []
    for tuner in (kernel._forward_kernel, kernel._dq_kernel, kernel._dkdv_kernel):
        for dim in args.head_dims:
            for config in tuner.configs:
                types, constexprs = signature(tuner.fn, config, dim)
                compiled = triton.compile(ASTSource(fn=tuner.fn, signature=types, constexprs=constexprs), target=TARGET,
                                          options={"num_warps": config.num_warps, "num_stages": config.num_stages})
                row = {"kernel": tuner.fn.__name__, "head_dim": dim, **config.kwargs, "warps": config.num_warps,
                       "stages": config.num_stages, **ptxas_report(compiled)}
                print(row, flush=True)
                results.append(row)
    save("kernel_registers", {"target": "sm_90a", "triton": triton.__version__, "head_dims": args.head_dims,
                              "dtype": "bfloat16", "causal": True, "activation": "softmax", "tma": True}, results)


if __name__ == "__main__":
    main()
