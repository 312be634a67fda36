"""The jagged attention kernels' tile lists: the one-launch counting build against the PyTorch sort, side by side.

A model step with a new batch builds them once (every later layer and the backward reuse them), so their cost
is paid per step; it is host-bound (launch latency), which is what this times: median ms per build of both
directions and every block size the kernels may use (`_parts()`), causal, for the length mixes of
benchmarks/jagged_attention.py plus many short sequences. Also checks the two builds agree.

    python -m benchmarks.tile_lists [--tokens 32768]

Writes benchmarks/results/tile_lists.json.
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.common import save
from benchmarks.jagged_attention import long_tail_lengths, timed, uniform_lengths
from kernels.pytorch.pt_tile_table import pt_tile_table
from kernels.triton import triton_jagged_attention as kernel
from kernels.triton import triton_tile_table as tile_lists


def mixes(tokens: int) -> list[tuple[str, list[int]]]:
    cases = [(f"long_tail L<={n}", long_tail_lengths(tokens, n, seed=n)) for n in (512, 2048, 8192)]
    cases += [(f"uniform L={n}", uniform_lengths(tokens, n)) for n in (512, 8192)]
    return cases + [("short L=16", uniform_lengths(tokens, 16))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=32768)
    args = parser.parse_args()
    parts, results = kernel._parts(), []
    for name, lengths in mixes(args.tokens):
        offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device="cuda")
        total = int(offsets[-1])
        table = tile_lists.TileTable(offsets, offsets, total, total, parts, True)
        width = table.tiles.shape[1]
        tiles, index = pt_tile_table(offsets, offsets, width, parts, True)
        counts = [int(index[d, s // 16, 1]) for d, s in parts]
        agree = torch.equal(table.index, index) and all(
            torch.equal(table.tiles[p, :n], tiles[p, :n]) for p, n in enumerate(counts))
        row = {"mix": name, "sequences": len(lengths), "tokens": total, "slots_x_sequences": width * len(lengths),
               "counted": width * len(lengths) <= tile_lists.MAX_COUNTED_PAIRS, "agree": agree,
               "counting_ms": timed(lambda: tile_lists.TileTable(offsets, offsets, total, total, parts, True)),
               "sorting_ms": timed(lambda: pt_tile_table(offsets, offsets, width, parts, True))}
        row["speedup"] = row["sorting_ms"] / row["counting_ms"]
        print(row, flush=True)
        results.append(row)
    save("tile_lists", {"tokens": args.tokens, "parts": parts, "causal": True, "max_counted_pairs":
                        tile_lists.MAX_COUNTED_PAIRS, "gpu": torch.cuda.get_device_name()}, results)


if __name__ == "__main__":
    main()
