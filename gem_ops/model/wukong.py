"""Wukong interaction layer (arXiv 2403.02545): a Factorization Machine Block beside a Linear Compress Block."""

from __future__ import annotations

import torch
from torch import nn


class FactorizationMachineBlock(nn.Module):
    """n embeddings -> n_out embeddings through their pairwise interactions.

    The optimized FM computes X·(Xᵀ·Y) with a learned Y [n, k]: O(n·d·k) instead of the n×n·d of X·Xᵀ,
    keeping the interactions of every embedding with k learned mixtures of all of them.
    """

    def __init__(self, n_in: int, n_out: int, dim: int, rank: int, hidden: int):
        super().__init__()
        self.y = nn.Parameter(torch.randn(n_in, rank) / n_in**0.5)
        self.norm = nn.LayerNorm(n_in * rank)
        self.mlp = nn.Sequential(nn.Linear(n_in * rank, hidden), nn.GELU(), nn.Linear(hidden, n_out * dim))
        self.n_out, self.dim = n_out, dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [B, n, d]
        xty = torch.matmul(x.transpose(1, 2), self.y)  # [B, d, k]
        interactions = torch.bmm(x, xty)  # [B, n, k]
        return self.mlp(self.norm(interactions.flatten(1))).view(-1, self.n_out, self.dim)


class LinearCompressBlock(nn.Module):
    """n embeddings -> n_out linear mixtures of them: keeps lower-order information across layers."""

    def __init__(self, n_in: int, n_out: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n_out, n_in) / n_in**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # A bmm with the batch leading in what it saves, the weight broadcast to it (an einsum's bmm saves
        # [1, B·d, n] views whose batch-sized strides a compiled step specialises).
        return torch.bmm(self.weight.expand(x.shape[0], -1, -1), x)


class WukongLayer(nn.Module):
    """LayerNorm(concat(FMB(X), LCB(X)) + residual(X)); the residual is mixed to n_out when n_in differs."""

    def __init__(self, n_in: int, n_fm: int, n_lcb: int, dim: int, rank: int, hidden: int):
        super().__init__()
        self.fmb = FactorizationMachineBlock(n_in, n_fm, dim, rank, hidden)
        self.lcb = LinearCompressBlock(n_in, n_lcb)
        n_out = n_fm + n_lcb
        self.residual = nn.Identity() if n_in == n_out else LinearCompressBlock(n_in, n_out)
        self.norm = nn.LayerNorm(dim)
        self.n_out = n_out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(torch.cat([self.fmb(x), self.lcb(x)], dim=1) + self.residual(x))
