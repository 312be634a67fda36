"""PyTorch reference of the jagged attention kernels' tile lists: the oracle for the Triton build.

A part is (direction, block size): direction 0 lists query blocks (forward, dq), 1 key blocks (dk, dv). Each
part's tiles (sequence, first row) are ordered heaviest first, ties by (sequence, first row), and packed as the
Triton build packs them (see kernels.triton.triton_jagged_attention.TileTable).
"""

from __future__ import annotations

import torch


def pt_tile_table(q_offsets: torch.Tensor, kv_offsets: torch.Tensor, width: int, parts: tuple,
                  causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(tiles [parts, width, 2] int32, index [2, 9, 2] int32). Slots past a part's tile count are never read."""
    device = q_offsets.device
    q_lengths, kv_lengths = q_offsets.diff(), kv_offsets.diff()
    num_seqs = q_lengths.numel()
    sizes = torch.tensor([[size] for _, size in parts], device=device)
    queries_major = torch.tensor([[direction == 0] for direction, _ in parts], device=device)
    own = torch.where(queries_major, q_lengths, kv_lengths)  # [parts, B]
    other = torch.where(queries_major, kv_lengths, q_lengths)
    blocks = (own + sizes - 1) // sizes
    ends = blocks.cumsum(1)
    slot = torch.arange(width, device=device).repeat(len(parts), 1)
    seq = torch.searchsorted(ends, slot, right=True).clamp_(max=num_seqs - 1)
    start = (slot - ends.gather(1, seq) + blocks.gather(1, seq)) * sizes
    count = ends[:, -1:]
    work = tile_work(own.gather(1, seq), other.gather(1, seq), start, sizes, causal, queries_major)
    # Stable: equal work keeps slot order, i.e. (sequence, first row).
    order = torch.where(slot < count, work, -1).sort(dim=1, descending=True, stable=True).indices
    tiles = torch.stack([seq.gather(1, order), start.gather(1, order)], -1).to(torch.int32)
    index = torch.zeros(2, 9, 2, dtype=torch.int32, device=device)
    for p, (direction, size) in enumerate(parts):
        index[direction, size // 16] = torch.stack([torch.tensor(p * width, device=device), count[p, 0]])
    return tiles, index


def tile_work(own_len, other_len, start, block, causal, queries_major):
    """Rows of the other side a tile visits: its place in the heaviest-first order."""
    if not causal:
        return other_len
    # query rows [start, last) see keys < last + (Lk - Lq)
    last = torch.minimum(own_len, start + block)
    queries = (last + other_len - own_len).clamp(min=0).minimum(other_len)
    # key rows from `start` are seen by query rows >= start - (Lk - Lq)
    keys = (other_len - (start - (own_len - other_len)).clamp(min=0)).clamp(min=0)
    return torch.where(queries_major, queries, keys)
