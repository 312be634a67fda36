"""Small ops on jagged tensors (values [N, ...] + offsets [B + 1]) in plain torch, so they run
wherever torch does (fbgemm's jagged kernels are missing from some builds)."""

from __future__ import annotations

import torch


def lengths_of(offsets: torch.Tensor) -> torch.Tensor:
    return offsets[1:] - offsets[:-1]


def offsets_of(lengths: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.pad(torch.cumsum(lengths, 0), (1, 0))


def segment_ids(offsets: torch.Tensor, total: int | None = None) -> torch.Tensor:
    """[N] index of the sequence each value belongs to."""
    lengths = lengths_of(offsets)
    return torch.repeat_interleave(torch.arange(lengths.numel(), device=offsets.device), lengths, output_size=total)


def positions_from_end(offsets: torch.Tensor, total: int | None = None) -> torch.Tensor:
    """[N] 0 for each sequence's most recent (last) value, 1 for the one before, ..."""
    seg = segment_ids(offsets, total)
    return offsets[1:][seg] - 1 - torch.arange(seg.numel(), device=offsets.device)


def select(values: torch.Tensor, offsets: torch.Tensor, keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The values where `keep` [N] is true, with their new offsets (order kept)."""
    seg = segment_ids(offsets, values.shape[0])
    lengths = torch.zeros(offsets.numel() - 1, dtype=offsets.dtype, device=offsets.device)
    lengths.index_add_(0, seg[keep], torch.ones_like(seg[keep]))
    return values[keep], offsets_of(lengths)


def keep_last(values: torch.Tensor, offsets: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sequence's most recent n values."""
    if offsets.numel() < 2 or int(lengths_of(offsets).max()) <= n:
        return values, offsets
    return select(values, offsets, positions_from_end(offsets, values.shape[0]) < n)


def prepend(prefix: torch.Tensor, values: torch.Tensor, offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """prefix [B, K, d] placed before each sequence's values: returns values [N + B*K, d] and offsets."""
    B, K = prefix.shape[:2]
    lengths = lengths_of(offsets)
    new_offsets = offsets_of(lengths + K)
    out = values.new_empty(values.shape[0] + B * K, *values.shape[1:])
    prefix_rows = (new_offsets[:-1, None] + torch.arange(K, device=offsets.device)[None, :]).reshape(-1)
    value_rows = torch.arange(values.shape[0], device=offsets.device) + K * (segment_ids(offsets, values.shape[0]) + 1)
    out = out.index_put((prefix_rows,), prefix.reshape(B * K, *prefix.shape[2:]))
    return out.index_put((value_rows,), values), new_offsets


def split_prefix(values: torch.Tensor, offsets: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of prepend: ([B, k, d] prefix, remaining values, their offsets)."""
    B = offsets.numel() - 1
    rows = (offsets[:-1, None] + torch.arange(k, device=offsets.device)[None, :]).reshape(-1)
    keep = torch.ones(values.shape[0], dtype=torch.bool, device=values.device)
    keep[rows] = False
    rest, rest_offsets = select(values, offsets, keep)
    return values[rows].reshape(B, k, *values.shape[1:]), rest, rest_offsets


def segment_mean(values: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """[B, d] mean of each sequence's values; zeros for an empty sequence."""
    B = offsets.numel() - 1
    sums = values.new_zeros(B, *values.shape[1:]).index_add_(0, segment_ids(offsets, values.shape[0]), values)
    return sums / lengths_of(offsets).clamp(min=1).to(values.dtype).view(B, *([1] * (values.dim() - 1)))
