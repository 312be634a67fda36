"""Sequence-arm layers on jagged tokens (values + offsets), attention through kernels.jagged_attention."""

from __future__ import annotations

import torch
from torch import nn

from kernels.jagged_attention import jagged_attention_packed


class JaggedTransformerLayer(nn.Module):
    """Pre-norm self attention over each sequence's tokens, then a feed-forward network."""

    def __init__(self, dim: int, heads: int, ffn_mult: int, activation: str, dropout: float = 0.0, bias: bool = True,
                 qkv_bias: bool = True):
        super().__init__()
        if dim % heads:
            raise ValueError(f"sequence_dim {dim} must be a multiple of heads {heads}")
        self.heads, self.head_dim, self.activation = heads, dim // heads, activation
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=bias and qkv_bias)
        self.proj = nn.Linear(dim, dim, bias=bias)
        self.norm2 = nn.LayerNorm(dim)
        self.ffn = nn.Sequential(nn.Linear(dim, ffn_mult * dim, bias=bias), nn.GELU(),
                                 nn.Linear(ffn_mult * dim, dim, bias=bias))
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:  # x [N, dim]
        # q, k, v packed: compiled, the attention's backward writes the qkv layer's gradient in one piece.
        qkv = self.qkv(self.norm1(x)).view(x.shape[0], 3 * self.heads, self.head_dim)
        attended = jagged_attention_packed(qkv, offsets, activation=self.activation)
        x = x + self.dropout(self.proj(attended.reshape(x.shape[0], self.heads * self.head_dim)))
        return x + self.dropout(self.ffn(self.norm2(x)))


class JaggedCrossAttention(nn.Module):
    """Each sample's query tokens (width query_dim) attend over its jagged history (width kv_dim)."""

    def __init__(self, query_dim: int, kv_dim: int, heads: int, out_dim: int, activation: str, bias: bool = True,
                 kv_bias: bool = True):
        super().__init__()
        if kv_dim % heads:
            raise ValueError(f"sequence_dim {kv_dim} must be a multiple of heads {heads}")
        self.heads, self.head_dim, self.activation = heads, kv_dim // heads, activation
        self.q = nn.Linear(query_dim, kv_dim, bias=bias)
        self.kv = nn.Linear(kv_dim, 2 * kv_dim, bias=bias and kv_bias)
        self.norm = nn.LayerNorm(kv_dim)
        self.out = nn.Linear(kv_dim, out_dim, bias=bias)

    def forward(self, query: torch.Tensor, history: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """query [B, Q, query_dim], history [N, kv_dim] -> [B, Q, out_dim]."""
        B, Q = query.shape[:2]
        q = self.q(query).view(B * Q, self.heads, self.head_dim)
        kv = self.kv(self.norm(history)).view(history.shape[0], 2 * self.heads, self.head_dim)
        q_offsets = torch.arange(0, B * Q + 1, Q, device=offsets.device)
        attended = jagged_attention_packed(kv, q_offsets, offsets, q=q, activation=self.activation)
        return self.out(attended.reshape(B, Q, self.heads * self.head_dim))
