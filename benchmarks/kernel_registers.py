"""Registers, spills and shared memory of the jagged attention kernels as ptxas builds them for Hopper (sm_90a),
per autotune config that the kernels may choose at each head dim on an H200 (launch_configs.choose_configs, by the
shared memory estimate launch_configs.shared_memory_bytes, which each row shows beside the compiler's figure):
compiled on the host, no GPU needed. Bf16, causal softmax, self attention; tensor-descriptor loads where the head dim
is a power of two or two of them (unless --padded), pointer loads otherwise; the backward without atomic dq.

    python -m benchmarks.kernel_registers [--head-dims 16 32 64 96 128 192 256] [--padded --output-name NAME]

Writes benchmarks/results/kernel_registers.json (or --output-name's). The figures are the local Triton's (recorded
in the settings); the GPU machine may run another version.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from benchmarks.common import save
from kernels.triton import triton_jagged_attention as kernel
from kernels.triton import triton_jagged_attention_configs as launch_configs
from kernels.triton import triton_jagged_attention_kernels as device_code

TARGET = GPUTarget("cuda", 90, 32)
# Which descriptor argument holds blocks of which config size.
DESCRIPTOR_BLOCK = {"k_desc": "BLOCK_N", "v_desc": "BLOCK_N", "q_desc": "BLOCK_M", "do_desc": "BLOCK_M",
                    "kb_desc": "BLOCK_N", "vb_desc": "BLOCK_N", "qb_desc": "BLOCK_M", "dob_desc": "BLOCK_M"}
VALUE_DESCRIPTORS = ("v_desc", "do_desc", "vb_desc", "dob_desc")  # blocks of the value dim; the others of the head dim
SECOND_PART_DESCRIPTORS = ("kb_desc", "vb_desc", "qb_desc", "dob_desc")  # a dim's second column part (split dims)
STATS_DESCRIPTORS = ("stats_desc",)  # the dk/dv kernel's one-dimensional logsumexp and delta
POINTER_TYPES = {"stats_ptr": "*fp32", "descale_ptr": "*fp32", "q_offsets_ptr": "*i64",
                 "kv_offsets_ptr": "*i64", "tiles_ptr": "*i32", "tile_index_ptr": "*i32"}


def signature(fn, config: triton.Config, dim: int, value_dim: int | None = None, *, dtype: str = "bf16",
              tma: bool | None = None, causal: bool = True, silu: bool = False, atomic_dq: bool = False,
              split: bool = False) -> tuple[dict, dict]:
    """The argument types and constexprs of one launch of `fn` with `config`: head dim `dim`, value dim `value_dim`
    (default `dim`), inputs of Triton type `dtype`; tensor descriptors where the kernel would take them (tma None:
    where both dims are powers of two, as kernel._use_tma decides), pointers otherwise; atomic_dq: the dk/dv
    kernel adds dq (in fp32, one TMA reduce per block with descriptors); split: dims such as 96 in two column parts
    (kernel.dim_parts), else padded."""
    value_dim = value_dim or dim
    d_pad, d_b = kernel.dim_parts(dim, split, smallest=32 if dtype == "fp8e4nv" else 16)
    dv_pad, dv_b = kernel.dim_parts(value_dim, split)
    tma = (dim == d_pad + d_b and value_dim == dv_pad + dv_b) if tma is None else tma
    constexprs = dict(HEAD_DIM=dim, VALUE_DIM=value_dim, D_PAD=d_pad, DV_PAD=dv_pad, D_B=d_b, DV_B=dv_b, CAUSAL=causal,
                      SILU=silu, TMA=tma, FP8=dtype == "fp8e4nv", ADD_DQ=atomic_dq,
                      DQ_TMA=atomic_dq and tma and not d_b, **config.kwargs)
    constexprs = {name: value for name, value in constexprs.items() if name in fn.arg_names}
    types = {}
    for name in fn.arg_names:
        if name in constexprs:
            types[name] = "constexpr"
        elif tma and name in DESCRIPTOR_BLOCK and (name not in SECOND_PART_DESCRIPTORS or
                                                   (dv_b if name in VALUE_DESCRIPTORS else d_b)):
            first, second = (dv_pad, dv_b) if name in VALUE_DESCRIPTORS else (d_pad, d_b)
            width = second if name in SECOND_PART_DESCRIPTORS else first
            types[name] = f"tensordesc<{dtype}[{config.kwargs[DESCRIPTOR_BLOCK[name]]}, {width}]>"
        elif tma and name in STATS_DESCRIPTORS:
            types[name] = f"tensordesc<fp32[{config.kwargs['BLOCK_M']}]>"
        elif name in STATS_DESCRIPTORS:
            types[name] = "*fp32"
        elif name == "dq_desc" and constexprs.get("DQ_TMA", False):
            types[name] = f"tensordesc<fp32[{config.kwargs['BLOCK_M']}, {dim}]>"
        elif name in ("dq_ptr", "dq_desc") and atomic_dq:
            types[name] = "*fp32"
        elif name.endswith("_ptr") or name.endswith("_desc"):  # dq_desc is the dq tensor itself without atomic dq
            out = "bf16" if dtype == "fp8e4nv" else dtype  # FP8 inputs give a bf16 output
            types[name] = POINTER_TYPES.get(name, f"*{out}" if name == "out_ptr" else f"*{dtype}")
        else:
            types[name] = "fp32" if name == "scale" else "i32"
    return types, constexprs


def compile_for_hopper(fn, config: triton.Config, dim: int, value_dim: int | None = None, **options):
    """`fn` compiled for sm_90a on the host with `config` (see `signature` for the options)."""
    types, constexprs = signature(fn, config, dim, value_dim, **options)
    return triton.compile(ASTSource(fn=fn, signature=types, constexprs=constexprs), target=TARGET,
                          options={"num_warps": config.num_warps, "num_stages": config.num_stages})


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


H200_SHARED_BYTES = 232448  # the opt-in maximum of one program's shared memory
KERNELS = {"forward": device_code.forward_kernel, "dq": device_code.dq_kernel, "dkdv": device_code.dkdv_kernel}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--head-dims", type=int, nargs="+", default=[16, 32, 64, 96, 128, 192, 256])
    parser.add_argument("--padded", action="store_true",
                        help="dims such as 96 padded to the next power of two (JAGGED_ATTENTION_SPLIT_HEAD=0), "
                             "else in two column parts, as the kernels run them by default")
    parser.add_argument("--output-name", default="kernel_registers")
    args = parser.parse_args()
    split = not args.padded
    results = []
    for name, tuner in KERNELS.items():
        for dim in args.head_dims:
            parts = kernel.dim_parts(dim, split)
            width = sum(parts)  # what the kernels compute at, as their pruner sees it: padded, or both parts
            for config in launch_configs.choose_configs(name, tuner.configs, width, width, torch.bfloat16,
                                                        H200_SHARED_BYTES):
                compiled = compile_for_hopper(tuner.fn, config, dim, split=split)
                row = {"kernel": tuner.fn.__name__, "head_dim": dim, "parts": parts, "tma": width == dim,
                       **config.kwargs,
                       "warps": config.num_warps, "stages": config.num_stages, **ptxas_report(compiled),
                       "shared_estimate_bytes": launch_configs.shared_memory_bytes(name, config, width, width,
                                                                                   torch.bfloat16)}
                print(row, flush=True)
                results.append(row)
    save(args.output_name, {"target": "sm_90a", "triton": triton.__version__, "head_dims": args.head_dims,
                            "split": split, "dtype": "bfloat16", "causal": True, "activation": "softmax",
                            "shared_limit_bytes": H200_SHARED_BYTES}, results)


if __name__ == "__main__":
    main()
