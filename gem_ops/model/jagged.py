"""Small ops on jagged tensors (values [N, ...] + offsets [B + 1]) in plain torch, so they run
wherever torch does (fbgemm's jagged kernels are missing from some builds).

None of them reads a device value on the host when its output size is given (`total`): a GPU step
then runs without waiting on the host. Rows move with `take_rows`, a gather whose rows are distinct, so
its backward writes each gradient row once (index_copy) instead of adding it atomically (index_add, the
backward of index_select, which is slow in bf16); both are free of host reads.

`padded=True`: the sizes given are capacities, at least the values the offsets hold (a batch's sizes rounded up to
a bucket, so that a step replayed from a CUDA graph sees sizes it has met). Rows past the last sequence's end are
no sequence's: they come out zero, and their gradient is never read back into a sequence's rows.
"""

from __future__ import annotations

import itertools

import torch


class _TakeRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, values: torch.Tensor, rows: torch.Tensor, zero_rows: bool) -> torch.Tensor:
        ctx.save_for_backward(rows)
        ctx.source_rows, ctx.zero_rows = values.shape[0], zero_rows
        if not zero_rows:
            return values.index_select(0, rows)
        taken = values.index_select(0, rows.clamp(min=0))
        return taken.masked_fill((rows < 0).view(-1, *([1] * (values.dim() - 1))), 0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (rows,) = ctx.saved_tensors
        if not ctx.zero_rows:
            source = grad.new_zeros((ctx.source_rows, *grad.shape[1:]))
            return source.index_copy_(0, rows, grad.contiguous()), None, None
        # The zero rows' gradients all land in one spare row, dropped: the others are still written once each.
        source = grad.new_zeros((ctx.source_rows + 1, *grad.shape[1:]))
        source.index_copy_(0, torch.where(rows < 0, ctx.source_rows, rows), grad.contiguous())
        return source.narrow(0, 0, ctx.source_rows), None, None


def take_rows(values: torch.Tensor, rows: torch.Tensor, zero_rows: bool = False) -> torch.Tensor:
    """values[rows] for rows that are all distinct (each source row taken at most once); with `zero_rows`, a row of
    -1 gives zeros (any number of them)."""
    return _TakeRows.apply(values, rows, zero_rows)


def starts(offsets: torch.Tensor) -> torch.Tensor:
    """[B] where each sequence begins. narrow, not offsets[:-1]: a slice to an open end leaves torch 2.11's
    compiler an unbacked length under size-oblivious tracing, and Inductor then fails to lower it."""
    return offsets.narrow(0, 0, offsets.shape[0] - 1)


def ends(offsets: torch.Tensor) -> torch.Tensor:
    """[B] where each sequence ends (offsets[1:], narrowed for the same reason)."""
    return offsets.narrow(0, 1, offsets.shape[0] - 1)


def lengths_of(offsets: torch.Tensor) -> torch.Tensor:
    return ends(offsets) - starts(offsets)


def offsets_of(lengths: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.pad(torch.cumsum(lengths, 0), (1, 0))


def segment_ids(offsets: torch.Tensor, total: int | None = None, padded: bool = False) -> torch.Tensor:
    """[N] index of the sequence each value belongs to; padded, B for the rows past the last sequence."""
    lengths = lengths_of(offsets)
    if padded:
        lengths = torch.cat([lengths, total - offsets.narrow(0, offsets.shape[0] - 1, 1)])
    return torch.repeat_interleave(torch.arange(lengths.numel(), device=offsets.device), lengths, output_size=total)


def _with_spare(sequences, padded: bool):
    """Rows for each sequence, and one more for the padding's values (a sum into it is dropped). An int is added,
    not the bool: torch 2.11's tracer adds no bool to a symbolic size."""
    return sequences + 1 if padded else sequences


def _sequence_rows(rows: torch.Tensor, seg: torch.Tensor, sequences: int, padded: bool) -> torch.Tensor:
    """`rows` with -1 (a zero row for take_rows) where the value is no sequence's (padded)."""
    return torch.where(seg == sequences, -1, rows) if padded else rows


def positions_from_end(offsets: torch.Tensor, total: int | None = None) -> torch.Tensor:
    """[N] 0 for each sequence's most recent (last) value, 1 for the one before, ..."""
    seg = segment_ids(offsets, total)
    return ends(offsets)[seg] - 1 - torch.arange(seg.numel(), device=offsets.device)


def kept_lengths(offsets: torch.Tensor, keep: torch.Tensor, padded: bool = False) -> torch.Tensor:
    """[B] how many of each sequence's values `keep` [N] marks."""
    B = offsets.numel() - 1
    lengths = torch.zeros(_with_spare(B, padded), dtype=offsets.dtype, device=offsets.device)
    return lengths.index_add_(0, segment_ids(offsets, keep.numel(), padded), keep.to(offsets.dtype)).narrow(0, 0, B)


def select(values: torch.Tensor, offsets: torch.Tensor, keep: torch.Tensor, total: int | None = None,
           lengths: torch.Tensor | None = None, padded: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The values where `keep` [N] is true, with their new offsets (order kept); `total`: how many,
    `lengths`: kept_lengths(offsets, keep), where the caller has them already."""
    if total is None:
        total = int(keep.sum())
    # Kept value i goes to slot cumsum(keep)[i] - 1; the others to a spare slot past the end.
    slot = torch.where(keep, torch.cumsum(keep, 0) - 1, total)
    # Padded, the slots past the kept values stay -1: zero rows.
    rows = (torch.full((total + 1,), -1, dtype=torch.long, device=values.device) if padded
            else torch.empty(total + 1, dtype=torch.long, device=values.device))
    rows.scatter_(0, slot, torch.arange(keep.numel(), device=values.device))
    lengths = kept_lengths(offsets, keep) if lengths is None else lengths
    # narrow, not rows[:total]: a slice whose end a compiler cannot bound makes its length data-dependent.
    return take_rows(values, rows.narrow(0, 0, total), zero_rows=padded), offsets_of(lengths)


def keep_last(values: torch.Tensor, offsets: torch.Tensor, n: int, total: int | None = None,
              padded: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sequence's most recent n values; `total`: how many that is over the batch."""
    if offsets.numel() < 2:
        return values, offsets
    lengths = lengths_of(offsets)
    kept = lengths.clamp(max=n)
    if total is None:
        total = int(kept.sum())
    # Nothing to cut: the same tensors (a compiled caller takes the gather instead of a guard on the sizes).
    if not torch.compiler.is_compiling() and not padded and total == values.shape[0]:
        return values, offsets
    new_offsets = offsets_of(kept)
    B = lengths.numel()
    seg = segment_ids(new_offsets, total, padded)
    shift = starts(offsets) + lengths - kept - starts(new_offsets)
    rows = torch.arange(total, device=values.device) + shift[seg.clamp(max=B - 1) if padded else seg]
    return take_rows(values, _sequence_rows(rows, seg, B, padded), zero_rows=padded), new_offsets


def level_totals(lengths: torch.Tensor, levels: list[int]) -> list[list[int]]:
    """For each row of sequence lengths [S, B]: the values there are, then left after keep_last(levels[0]),
    keep_last(levels[1]), ...: every output size of S pyramids, read from the device in one go."""
    caps = itertools.accumulate(levels, min)  # on the host: no copy to the device to wait on
    kept = [lengths.clamp(max=cap).sum(1) for cap in caps]
    return torch.stack([lengths.sum(1), *kept], 1).tolist()


def prepend(prefix: torch.Tensor, values: torch.Tensor, offsets: torch.Tensor,
            padded: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """prefix [B, K, d] placed before each sequence's values: returns values [N + B*K, d] and offsets."""
    B, K = prefix.shape[:2]
    N = values.shape[0]
    new_offsets = offsets + K * torch.arange(B + 1, device=offsets.device)
    seg = segment_ids(new_offsets, N + B * K, padded)
    owner = seg.clamp(max=B - 1) if padded else seg
    position = torch.arange(N + B * K, device=offsets.device) - starts(new_offsets)[owner]
    # One gather from [values, prefix rows]: position p < K of sequence b is prefix row b*K + p.
    rows = torch.where(position < K, N + owner * K + position, starts(offsets)[owner] + position - K)
    stacked = torch.cat([values, prefix.reshape(B * K, *prefix.shape[2:]).to(values.dtype)])
    return take_rows(stacked, _sequence_rows(rows, seg, B, padded), zero_rows=padded), new_offsets


def split_prefix(values: torch.Tensor, offsets: torch.Tensor, k: int,
                 padded: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of prepend: ([B, k, d] prefix, remaining values, their offsets)."""
    B = offsets.numel() - 1
    rest_offsets = offsets - k * torch.arange(B + 1, device=offsets.device)
    prefix = take_rows(values, _prefix_rows(offsets, k)).reshape(B, k, *values.shape[1:])
    rest = take_rows(values, _value_rows(rest_offsets, k, values.shape[0] - B * k, padded), zero_rows=padded)
    return prefix, rest, rest_offsets


def _prefix_rows(offsets: torch.Tensor, k: int) -> torch.Tensor:
    """Rows of the k values at the start of each sequence."""
    return (starts(offsets)[:, None] + torch.arange(k, device=offsets.device)[None, :]).reshape(-1)


def _value_rows(offsets: torch.Tensor, k: int, total: int, padded: bool = False) -> torch.Tensor:
    """Where each of `total` values of `offsets` lands once k values are put before every sequence."""
    seg = segment_ids(offsets, total, padded)
    rows = torch.arange(total, device=offsets.device) + k * (seg + 1)
    return _sequence_rows(rows, seg, offsets.numel() - 1, padded)


def segment_mean(values: torch.Tensor, offsets: torch.Tensor, padded: bool = False) -> torch.Tensor:
    """[B, d] mean of each sequence's values; zeros for an empty sequence."""
    B = offsets.numel() - 1
    sums = values.new_zeros(_with_spare(B, padded), *values.shape[1:])
    sums = sums.index_add_(0, segment_ids(offsets, values.shape[0], padded), values).narrow(0, 0, B)
    return sums / lengths_of(offsets).clamp(min=1).to(values.dtype).view(B, *([1] * (values.dim() - 1)))
