"""PyTorch reference of jagged attention: the CPU default and the oracle for the Triton kernel.

Sequences are grouped by (query length, key length) rounded up to powers of two, and each group is
padded only to its own longest sequence, so padding costs at most about 4x the real pairs and never
the batch maximum. Autograd runs through the gathers, so the backward pass comes for free.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# A group whose padded score tensor would exceed this many elements is split into chunks.
MAX_SCORE_ELEMENTS = 1 << 25


def pt_jagged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_offsets: torch.Tensor,
    kv_offsets: torch.Tensor,
    causal: bool,
    activation: str,
    scale: float,
    descale: torch.Tensor | None = None,
) -> torch.Tensor:
    """See kernels.jagged_attention.jagged_attention for the contract. With `descale` (FP8 inputs): the
    dequantized inputs in fp32, returned in bf16."""
    if descale is not None:
        q, k, v = (x.float() * d for x, d in zip((q, k, v), descale.float()))
        return pt_jagged_attention(q, k, v, q_offsets, kv_offsets, causal, activation, scale).to(torch.bfloat16)
    out = q.new_zeros(q.shape[0], q.shape[1], v.shape[2])
    q_lengths = (q_offsets[1:] - q_offsets[:-1]).cpu()
    kv_lengths = (kv_offsets[1:] - kv_offsets[:-1]).cpu()
    # A sequence without keys returns zeros and is left out: padded to another sequence's keys, a NaN
    # there would reach it (examples never affect each other, NaN included).
    active = torch.nonzero((q_lengths > 0) & (kv_lengths > 0)).flatten()
    if active.numel() == 0:
        return out + q[:0].sum() + k[:0].sum() + v[:0].sum()  # keeps the graph, adds exact zeros

    positions, values = [], []
    group_key = _pow2_ceil(q_lengths[active]) * (1 << 32) + _pow2_ceil(kv_lengths[active])
    for key in torch.unique(group_key).tolist():
        members = active[group_key == key]
        max_q = int(q_lengths[members].max())
        max_kv = int(kv_lengths[members].max())
        per_sequence = q.shape[1] * max_q * max(max_kv, 1)
        chunk = max(1, MAX_SCORE_ELEMENTS // per_sequence)
        for start in range(0, members.numel(), chunk):
            seqs = members[start : start + chunk]  # on the CPU, like the lengths it indexes
            seq_kv_lengths = kv_lengths[seqs].to(q.device)
            on_device = seqs.to(q.device)
            rows, row_valid = _padded_index(q_offsets[on_device], q_lengths[seqs].to(q.device), max_q)
            cols, col_valid = _padded_index(kv_offsets[on_device], seq_kv_lengths, max_kv)
            attended = _dense_attention(
                q[rows], k[cols], v[cols], row_valid, col_valid, seq_kv_lengths, causal, activation, scale,
            )
            positions.append(rows[row_valid])
            values.append(attended[row_valid])
    # One scatter at the end: writing each group into `out` as it comes would copy all of it per group.
    return out.index_put((torch.cat(positions),), torch.cat(values))


def _pow2_ceil(x: torch.Tensor) -> torch.Tensor:
    return torch.where(x <= 1, x, 2 ** torch.ceil(torch.log2(x.double())).long())


def _padded_index(starts: torch.Tensor, lengths: torch.Tensor, width: int):
    """[b, width] flat token positions of each sequence (clamped where padded) and their validity."""
    position = torch.arange(width, device=starts.device)
    valid = position[None, :] < lengths[:, None]
    index = torch.where(valid, starts[:, None] + position[None, :], starts[:, None].clamp(min=0))
    return index, valid


def _dense_attention(q, k, v, row_valid, col_valid, kv_lengths, causal, activation, scale):
    """q [b, Lq, H, D], k [b, Lk, H, D], v [b, Lk, H, Dv] -> [b, Lq, H, Dv] on padded tensors."""
    out_dtype = v.dtype
    compute = torch.promote_types(q.dtype, torch.float32)  # low-precision inputs accumulate in fp32
    q, k, v = (t.to(compute).transpose(1, 2) for t in (q, k, v))  # [b, H, L, D]
    allowed = col_valid[:, None, :] & row_valid[:, :, None]  # [b, Lq, Lk]
    if causal:
        # Aligned to the end: query i of a sequence sees keys j <= i + (Lk - Lq).
        shift = (kv_lengths - row_valid.sum(1))[:, None, None]
        qi = torch.arange(q.shape[2], device=q.device)[None, :, None]
        kj = torch.arange(k.shape[2], device=q.device)[None, None, :]
        allowed = allowed & (kj <= qi + shift)
    if activation == "softmax":
        # A row with no visible key would be NaN: let it see everything, then zero its output.
        has_key = allowed.any(-1, keepdim=True)
        mask = (allowed | ~has_key)[:, None]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale) * has_key[:, None]
    else:
        scores = torch.matmul(q, k.transpose(-1, -2)) * scale
        weights = F.silu(scores) * (allowed / kv_lengths.clamp(min=1)[:, None, None])[:, None]
        out = torch.matmul(weights, v)
    return out.transpose(1, 2).to(out_dtype)
