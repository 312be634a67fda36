"""Tile lists of the Triton jagged attention kernels, built on the device (the PyTorch reference and fallback is
kernels.pytorch.pt_tile_table), cached per offsets tensor, and the persistent grid that walks them."""

from __future__ import annotations

import collections
import functools

import torch
import triton
import triton.language as tl

from kernels.pytorch.pt_tile_table import pt_tile_table
from kernels.triton.triton_jagged_attention_configs import INTERPRETING, jit_unspecialised

# Persistent programs launched per multiprocessor: those that do not fit resident wait for a slot, and
# as each walks an equal share of the heaviest-first item list, more programs only even out the tail.
PROGRAMS_PER_SM = 4
# Tile slots times sequences up to which the tile lists are built by counting (one launch) rather than sorting.
# The interpreter runs the counting kernel one program at a time (seconds per build), so there the sort builds
# them unless a test asks for the count.
MAX_COUNTED_PAIRS = 0 if INTERPRETING else 1 << 24


class TileTable:
    """Tiles (sequence, first row) of both directions and every block size, packed in one int32 tensor.

    `tiles` [parts, width, 2]: one row of `width` slots per (direction, block size), heaviest tile first (ties
    by sequence, then row), unused slots last. `index` [2, 9, 2] holds (first tile, tile count) of direction d
    (0: query blocks, 1: key blocks) and block size b at [d, b // 16]: each kernel reads the row of its own
    autotuned block size. Built by one kernel launch (tile_table_kernel) from the offsets: counts stay on the
    device, and capacities (upper bounds, sum(ceil(L / b)) <= total / b + B) come from shapes, so building
    needs no device-to-host copy. The kernel counts every tile against every sequence, so past
    MAX_COUNTED_PAIRS (many short sequences) the PyTorch build, a sort in a few dozen small launches, takes
    over; it is also the kernel's oracle (kernels.pytorch.pt_tile_table).
    """

    def __init__(self, q_offsets, kv_offsets, total_q: int, total_kv: int, parts: tuple, causal: bool):
        device, num_seqs = q_offsets.device, q_offsets.numel() - 1
        self.capacity = {part: (total_q if part[0] == 0 else total_kv) // part[1] + num_seqs for part in parts}
        width = max(self.capacity.values())
        if width * num_seqs > MAX_COUNTED_PAIRS:
            self.tiles, self.index = pt_tile_table(q_offsets, kv_offsets, width, parts, causal)
            return
        self.tiles = torch.empty(len(parts), width, 2, dtype=torch.int32, device=device)
        self.index = torch.empty(2, 9, 2, dtype=torch.int32, device=device)
        tile_table_kernel[(num_seqs, len(parts))](
            q_offsets, kv_offsets, part_codes(parts), self.tiles, self.index, num_seqs, len(parts), width,
            CAUSAL=causal, TILES=16, SEQS=128,
        )


PART_BITS = 5  # a part's code: its direction (0 queries, 1 keys) times 16, plus its block size's log2
_PART_BITS, _PART_MASK = tl.constexpr(PART_BITS), tl.constexpr((1 << PART_BITS) - 1)  # globals a kernel may read


def part_codes(parts: tuple) -> int:
    """Every part's (direction, block size) packed into one integer argument. Not a device tensor: one made on a
    first call inside a CUDA graph tree's run would belong to its memory pool and outlive the run."""
    if len(parts) * PART_BITS > 62:
        raise ValueError(f"at most {62 // PART_BITS} tile-table parts, got {len(parts)}")
    codes = 0
    for i, (direction, size) in enumerate(parts):
        if direction not in (0, 1) or size <= 0 or size & (size - 1) or size.bit_length() > 16:
            raise ValueError(f"a tile-table part is (direction 0 or 1, a power-of-two block size), "
                             f"got {(direction, size)}")
        codes |= (16 * direction + size.bit_length() - 1) << (PART_BITS * i)
    return codes


@triton.jit
def _part(part_codes, part):
    """(direction, block size, its log2) of one part from part_codes."""
    code = (part_codes >> (_PART_BITS * part)) & _PART_MASK
    shift = (code & 15).to(tl.int32)
    return (code >> 4).to(tl.int32), tl.full([], 1, tl.int32) << shift, shift


@triton.jit
def _work_of_tiles(own, other, first_row, block, queries_major, CAUSAL: tl.constexpr):
    """Rows of the other side a tile visits (own, other: the lengths along its direction and across)."""
    if CAUSAL:
        # query rows [first_row, last) see keys < last + (Lk - Lq)
        last = tl.minimum(own, first_row + block)
        queries = tl.minimum(tl.maximum(last + other - own, 0), other)
        # key rows from first_row are seen by query rows >= first_row - (Lk - Lq)
        keys = tl.maximum(other - tl.maximum(first_row - (own - other), 0), 0)
        return tl.where(queries_major, queries, keys)
    else:
        return other + 0 * first_row


@triton.jit
def _tiles_above(own, other, count, block, shift, work, queries_major, CAUSAL: tl.constexpr):
    """How many of a sequence's `count` tiles visit more than `work` rows: along query blocks a causal tile's
    work grows with its row, along key blocks it shrinks, so the count has a closed form (block = 1 << shift:
    int32 shifts, not divisions, in the kernel's inner loop)."""
    if CAUSAL:
        past = work - other + own  # query tiles visit more than `work` rows once their last row passes this
        along_queries = tl.where(past < 0, count, tl.maximum(count - (past >> shift), 0))
        along_keys = tl.where(own > work, tl.minimum(count, (own - work + block - 1) >> shift), 0)
        above = tl.where(queries_major, along_queries, along_keys)
        return tl.where(work < 0, count, tl.where(work >= other, 0, above))
    else:
        return tl.where(other > work, count, 0)


@triton.jit
def _lengths(q_offsets_ptr, kv_offsets_ptr, seqs, num_seqs, queries):
    """Query (or key) lengths of sequences `seqs` as int32 (as the attention kernels take them), 0 past the last."""
    ok = seqs < num_seqs
    q_lens = tl.load(q_offsets_ptr + seqs + 1, mask=ok, other=0) - tl.load(q_offsets_ptr + seqs, mask=ok, other=0)
    kv_lens = tl.load(kv_offsets_ptr + seqs + 1, mask=ok, other=0) - tl.load(kv_offsets_ptr + seqs, mask=ok, other=0)
    return tl.where(queries, q_lens, kv_lens).to(tl.int32)




@jit_unspecialised
def tile_table_kernel(q_offsets_ptr, kv_offsets_ptr, part_codes, tiles_ptr, index_ptr, num_seqs, num_parts, width,
                      CAUSAL: tl.constexpr, TILES: tl.constexpr, SEQS: tl.constexpr):
    """One sequence's tiles of one part, each written straight to its slot in the heaviest-first order: its rank
    is the number of tiles (of every sequence) with more work, plus those with equal work earlier in (sequence,
    row) order, counted in closed form per sequence. No sort, no host copy. Program (0, 0) also writes `index`."""
    seq = tl.program_id(0)
    part = tl.program_id(1)
    direction, block, shift = _part(part_codes, part)
    queries_major = direction == 0
    own = _lengths(q_offsets_ptr, kv_offsets_ptr, seq, num_seqs, queries_major)
    other = _lengths(q_offsets_ptr, kv_offsets_ptr, seq, num_seqs, not queries_major)
    count = (own + block - 1) >> shift
    for j0 in range(0, count, TILES):
        j = j0 + tl.arange(0, TILES)
        work = _work_of_tiles(own, other, j * block, block, queries_major, CAUSAL)
        rank = tl.zeros([TILES], dtype=tl.int32)
        for s0 in range(0, num_seqs, SEQS):
            seqs = s0 + tl.arange(0, SEQS)
            owns = _lengths(q_offsets_ptr, kv_offsets_ptr, seqs, num_seqs, queries_major)[None, :]
            others = _lengths(q_offsets_ptr, kv_offsets_ptr, seqs, num_seqs, not queries_major)[None, :]
            counts = (owns + block - 1) >> shift
            above = _tiles_above(owns, others, counts, block, shift, work[:, None], queries_major, CAUSAL)
            at_least = _tiles_above(owns, others, counts, block, shift, work[:, None] - 1, queries_major, CAUSAL)
            earlier = seqs[None, :] < seq
            rank += tl.sum(above + tl.where(earlier, at_least - above, 0), 1)
        # this sequence's own tiles of equal work before tile j: they form one run of consecutive tiles
        if CAUSAL:
            run_start = tl.where(queries_major,
                                 count - _tiles_above(own, other, count, block, shift, work - 1, queries_major,
                                                      CAUSAL),
                                 _tiles_above(own, other, count, block, shift, work, queries_major, CAUSAL))
        else:
            run_start = tl.zeros([TILES], dtype=tl.int32)
        rank += j - run_start
        slot = tiles_ptr + 2 * (part * width + rank)
        ok = j < count
        tl.store(slot, seq + tl.zeros([TILES], dtype=tl.int32), mask=ok)
        tl.store(slot + 1, j * block, mask=ok)
    if seq == 0 and part == 0:
        rows = tl.arange(0, 32)  # index rows: 9 * direction + block // 16, 18 of them
        firsts = tl.zeros([32], dtype=tl.int32)
        totals = tl.zeros([32], dtype=tl.int32)
        for p in range(0, num_parts):
            p_direction, p_block, p_shift = _part(part_codes, p)
            p_queries = p_direction == 0
            blocks = tl.zeros([SEQS], dtype=tl.int32)
            for s0 in range(0, num_seqs, SEQS):
                seqs = s0 + tl.arange(0, SEQS)
                lengths = _lengths(q_offsets_ptr, kv_offsets_ptr, seqs, num_seqs, p_queries)
                blocks += (lengths + p_block - 1) >> p_shift
            row = tl.where(p_queries, 0, 9) + p_block // 16
            firsts = tl.where(rows == row, p * width, firsts)
            totals = tl.where(rows == row, tl.sum(blocks), totals)
        tl.store(index_ptr + 2 * rows, firsts, mask=rows < 18)
        tl.store(index_ptr + 2 * rows + 1, totals, mask=rows < 18)


class _Tiles:
    """Device offsets and tile table of one (q_offsets, kv_offsets) pair."""

    def __init__(self, q_offsets, kv_offsets, device, total_q: int, total_kv: int, parts: tuple, causal: bool):
        self.q_offsets = q_offsets.to(device=device, dtype=torch.int64).contiguous()
        self.kv_offsets = self.q_offsets if kv_offsets is q_offsets else kv_offsets.to(
            device=device, dtype=torch.int64).contiguous()
        empty = self.q_offsets.numel() <= 1 or total_q == 0
        self.table = None if empty else TileTable(self.q_offsets, self.kv_offsets, total_q, total_kv, parts, causal)


class TileCache:
    """Tile tables per offsets tensor, so that the layers of a model step and the backward share one build.

    An entry holds its offsets tensors, so their memory cannot be reused by another tensor while it is
    cached; it is valid while the caller passes those same tensor objects, unmodified (same `_version`
    and storage). Inference tensors carry no version counter and are never cached. Least recently used
    entries go first. Nothing is cached, or served from the cache, while a CUDA graph is being captured, nor at all
    once `enabled` is off: Inductor's CUDA graph trees own every allocation their graphs' warm-up runs make and
    refuse one that outlives the run, as a cached table would.
    """

    def __init__(self, size: int = 16):
        self.size = size
        self.enabled = True
        self._entries: collections.OrderedDict = collections.OrderedDict()

    def get(self, q_offsets, kv_offsets, device, total_q, total_kv, parts, causal) -> _Tiles:
        # Inside a CUDA graph capture the build must be recorded: a replay on other offsets copied into the same
        # tensors builds their tiles on the device. A table built before the capture would be replayed stale.
        capturing = torch.device(device).type == "cuda" and torch.cuda.is_current_stream_capturing()
        if capturing or not self.enabled or q_offsets.is_inference() or kv_offsets.is_inference():
            return _Tiles(q_offsets, kv_offsets, device, total_q, total_kv, parts, causal)
        key = (id(q_offsets), id(kv_offsets), str(device), total_q, total_kv, parts, causal)
        stamp = tuple((x._version, x.data_ptr(), x.shape, x.device, x.dtype) for x in (q_offsets, kv_offsets))
        entry = self._entries.get(key)
        if entry is not None and entry[0] is q_offsets and entry[1] is kv_offsets and entry[2] == stamp:
            self._entries.move_to_end(key)
            return entry[3]
        tiles = _Tiles(q_offsets, kv_offsets, device, total_q, total_kv, parts, causal)
        self._entries[key] = (q_offsets, kv_offsets, stamp, tiles)
        self._entries.move_to_end(key)
        while len(self._entries) > self.size:
            self._entries.popitem(last=False)
        return tiles

    def clear(self) -> None:
        self._entries.clear()


tile_cache = TileCache()


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def persistent_grid(table: TileTable, direction: int, block_name: str, num_heads: int, device: torch.device):
    """Enough programs to fill the GPU, never more than there can be (tile, head) items."""

    def grid(meta):
        items = table.capacity[(direction, meta[block_name])] * num_heads
        programs = 4 if INTERPRETING else _num_sms(device.index or 0) * PROGRAMS_PER_SM
        return (max(1, min(items, programs)),)

    return grid
