"""The GEM model: InterFormer blocks that interleave a Wukong interaction arm with a pyramid of
jagged sequence layers (one branch per sequence), then per-domain per-task towers.

Block b, for each sequence branch:
  1. the interaction tokens X_b are summarised into K tokens prepended to the branch's history;
  2. a jagged transformer layer runs over [summary tokens, history];
  3. the K summary positions come back out as the branch's CLS tokens;
  4. two query tokens (the candidate item and the mean of X_b) attend over the history (cross
     attention, query width dim, key/value width sequence_dim);
  5. the history keeps its most recent level_tokens(b) tokens for the next block (the pyramid).
Then a Wukong layer maps [X_b, CLS tokens, cross-attention outputs] to X_{b+1}.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from gem_ops.model import jagged
from gem_ops.model.config import FeatureSpec, ModelConfig, check_retrieval_key
from gem_ops.model.embeddings import GEMEmbeddings
from gem_ops.model.features import ModelInput, branch_lengths, check_branch
from gem_ops.model.heads import DomainTaskTowers, LossSums, loss_from_sums, masked_bce_sums
from gem_ops.model.sequence import JaggedCrossAttention, JaggedTransformerLayer
from gem_ops.model.wukong import WukongLayer

CROSS_QUERIES = 2  # the candidate item and the mean interaction token


class SequenceBranch(nn.Module):
    """One sequence's layers across all blocks."""

    def __init__(self, name: str, spec: FeatureSpec, config: ModelConfig, n_tokens: list[int]):
        super().__init__()
        seq, d, ds = config.sequence, config.embedding.dim, config.embedding.sequence_dim
        self.name, self.k = name, seq.summary_tokens
        self.levels = [seq.level_tokens(b) for b in range(config.blocks)]
        check_branch(name, spec)
        self.summarize = nn.ModuleList(nn.Linear(n * d, self.k * ds) for n in n_tokens)
        self.layers = nn.ModuleList(
            JaggedTransformerLayer(ds, seq.heads, seq.ffn_mult, seq.activation, config.dropout, seq.bias, seq.qkv_bias)
            for _ in n_tokens
        )
        self.cls_out = nn.ModuleList(nn.Linear(ds, d) for _ in n_tokens)
        self.cross = nn.ModuleList(JaggedCrossAttention(d, ds, seq.heads, d, seq.activation, seq.bias, seq.qkv_bias)
                                   for _ in n_tokens)

    def select(self, history: torch.Tensor, x: ModelInput, keep: torch.Tensor | None, total: int,
               lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if keep is None:
            return history, x.history_offsets
        return jagged.select(history, x.history_offsets, keep, total, lengths, x.padded)

    def forward(self, block: int, tokens: torch.Tensor, candidate: torch.Tensor, history: torch.Tensor,
                offsets: torch.Tensor, kept: int, padded: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """tokens [B, n, d] -> (summaries [B, K + 2, d], history after this level, its offsets); `kept`:
        the history tokens left after this level's cut (`padded`: its capacity, jagged.py)."""
        B = tokens.shape[0]
        prefix = self.summarize[block](tokens.flatten(1)).view(B, self.k, -1)
        values, with_prefix = jagged.prepend(prefix, history, offsets, padded)
        values = self.layers[block](values, with_prefix)
        cls, history, offsets = jagged.split_prefix(values, with_prefix, self.k, padded)
        # The candidate reads the whole level before the pyramid cuts it: a match far back still counts.
        queries = torch.stack([candidate, tokens.mean(1)], dim=1)
        attended = self.cross[block](queries, history, offsets)
        history, offsets = jagged.keep_last(history, offsets, self.levels[block], kept, padded)
        return torch.cat([self.cls_out[block](cls), attended], dim=1), history, offsets


class GEMModel(nn.Module):
    def __init__(self, spec: FeatureSpec, config: ModelConfig, device: torch.device | None = None):
        super().__init__()
        self.spec, self.config = spec, config
        check_retrieval_key(config, spec)
        d, ds = config.embedding.dim, config.embedding.sequence_dim
        self.embeddings = GEMEmbeddings(spec, config, device=device)
        self.candidate_proj = nn.Linear(ds, d)
        self.dense_proj = nn.Linear(len(spec.dense_features), d) if spec.dense_features else None
        rep = config.teacher_representation_dim
        self.teacher_proj = nn.Sequential(nn.LayerNorm(rep), nn.Linear(rep, d)) if rep else None
        if rep:
            # Zero at the start: the student begins as it would without the representation and takes from
            # it only what lowers its loss.
            nn.init.zeros_(self.teacher_proj[1].weight)
            nn.init.zeros_(self.teacher_proj[1].bias)
        n = self.embeddings.n_pooled + 1 + (1 if spec.dense_features else 0) + (1 if rep else 0)
        wk = config.wukong
        n_out = wk.n_fm + wk.n_lcb
        branches = config.sequence.branches if config.use_sequence else ()
        per_block_extra = len(branches) * (config.sequence.summary_tokens + CROSS_QUERIES)
        n_tokens = [n] + [n_out] * (config.blocks - 1)
        self.branches = nn.ModuleList(SequenceBranch(name, spec, config, n_tokens) for name in branches)
        self.interaction = nn.ModuleList(
            WukongLayer(n_in + per_block_extra, wk.n_fm, wk.n_lcb, d, wk.fm_rank, wk.mlp_hidden) for n_in in n_tokens
        )
        self.trunk = nn.Sequential(nn.Linear(n_out * d, config.trunk_hidden), nn.GELU(),
                                   nn.LayerNorm(config.trunk_hidden))
        self.objectives = config.objectives(spec)
        towers = lambda: DomainTaskTowers(config.trunk_hidden, len(spec.surfaces), len(self.objectives),  # noqa: E731
                                          config.tower_hidden, config.tower_layers)
        self.towers = towers()
        # Distillation on an auxiliary head: teacher targets train their own head on the shared trunk, so
        # the serving head stays calibrated to the true labels while the trunk takes up the teacher's knowledge
        # (distillation_head "serving": the serving head learns the teacher's targets beside the labels).
        auxiliary = config.distillation_weight > 0 and config.distillation_head == "auxiliary"
        self.distillation_towers = towers() if auxiliary else None
        if device is not None:
            self.to(device)

    @property
    def output_calibration(self):
        """The serving towers' calibration (gem_ops.train.calibration fits it)."""
        return self.towers.output

    def init_output_bias(self, logits: torch.Tensor) -> None:
        """logits [domains, tasks]: the towers' (and a distillation head's) output before any learning."""
        for towers in (self.towers, self.distillation_towers):
            if towers is not None:
                towers.init_output_bias(logits)

    def encode(self, x: ModelInput) -> torch.Tensor:
        """The shared trunk's representation [B, trunk_hidden] (what knowledge transfer reuses)."""
        return self._encode(x)[0]

    def user_summary(self, x: ModelInput) -> torch.Tensor:
        """[B, trunk_hidden + branches x sequence_dim]: the trunk's output beside the mean of each branch's
        last pyramid level (the user's most recent events after every sequence layer), which under a
        neutral request is what the sequence arm knows of the user before any candidate is named."""
        trunk, states = self._encode(x)
        return torch.cat([trunk, *(jagged.segment_mean(h, offsets, x.padded).to(trunk.dtype) for h, offsets in states)],
                         dim=1)

    def _encode(self, x: ModelInput) -> tuple[torch.Tensor, list]:
        """(the trunk's output, each branch's (history, offsets) after its last level)."""
        return self._encode_embedded(x, *self.embeddings(x))

    def _encode_embedded(self, x: ModelInput, pooled: torch.Tensor, candidate: torch.Tensor,
                         history: torch.Tensor) -> tuple[torch.Tensor, list]:
        candidate = self.candidate_proj(candidate)
        tokens = [pooled, candidate.unsqueeze(1)]
        if self.dense_proj is not None:
            tokens.append(self.dense_proj(x.dense).unsqueeze(1))
        if self.teacher_proj is not None:
            rep = F.dropout(x.teacher_representation, self.config.teacher_representation_dropout, self.training)
            tokens.append(self.teacher_proj(rep).unsqueeze(1))
        tokens = torch.cat(tokens, dim=1)
        states, sizes = self._branch_histories(history, x)
        for block, interaction in enumerate(self.interaction):
            extra = []
            for i, branch in enumerate(self.branches):
                summary, *states[i] = branch(block, tokens, candidate, *states[i], sizes[i][block + 1], x.padded)
                extra.append(summary)
            tokens = interaction(torch.cat([tokens, *extra], dim=1))
        return self.trunk(tokens.flatten(1)), states

    def _branch_histories(self, history: torch.Tensor, x: ModelInput) -> tuple[list, list[list[int]]]:
        """Each branch's (history, offsets), and its token count at every level of its pyramid: the
        one read from the device a forward needs, so that the jagged ops after it never wait."""
        if not self.branches:
            return [], []
        if torch.is_autocast_enabled(history.device.type):
            # Under mixed precision the history tokens (the residual stream of every sequence layer)
            # are kept in the autocast dtype: half the bytes in every gather, add and norm over them.
            history = history.to(torch.get_autocast_dtype(history.device.type))
        keeps, lengths = branch_lengths(x, self.spec, [branch.name for branch in self.branches])
        # Counted where the batch was built when it came with them; else read back here (one wait on the device).
        sizes = x.level_sizes if x.level_sizes is not None else jagged.level_totals(lengths, self.branches[0].levels)
        states = [list(branch.select(history, x, keep, n[0], kept))
                  for branch, keep, n, kept in zip(self.branches, keeps, sizes, lengths)]
        return states, sizes

    def forward(self, x: ModelInput) -> torch.Tensor:
        """Logits [B, tasks], each example through its own domain's towers."""
        return self.towers(self.encode(x), x.surface)

    def loss_sums(self, x: ModelInput) -> LossSums:
        """Per task, the training loss summed over this batch's labelled examples, and their count.

        With teacher logits in the input, a task's sum adds distillation_weight x the log loss of the
        distillation head (the auxiliary one, or the serving head itself) against the teacher's probabilities
        on the same labelled examples. Sums (not means) let a training job of several ranks normalise by the
        global batch's counts."""
        return self.dense_loss_sums(x, *self.embeddings(x))

    def dense_loss_sums(self, x: ModelInput, pooled: torch.Tensor, candidate: torch.Tensor,
                        history: torch.Tensor) -> LossSums:
        """loss_sums from the embedding lookups on: every layer of a training step but the tables, what
        TrainConfig.compile="model" compiles as one graph (the attention a custom op inside it)."""
        trunk = self._encode_embedded(x, pooled, candidate, history)[0]
        logits = self.towers(trunk, x.surface)
        labelled, counts = masked_bce_sums(logits, x.labels, x.label_mask)
        total = labelled
        if self.config.distillation_weight > 0 and x.teacher_logits is not None:
            soft = torch.sigmoid(x.teacher_logits.float())
            head = self.distillation_towers(trunk, x.surface) if self.distillation_towers is not None else logits
            distilled, _ = masked_bce_sums(head, soft, x.label_mask)
            total = labelled + self.config.distillation_weight * distilled
        return LossSums(total, labelled.detach(), counts, logits)

    def loss(self, x: ModelInput) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(this batch's training loss: the sum over tasks of each task's mean, per-task losses on the true
        labels, serving logits)."""
        return loss_from_sums(self.loss_sums(x))

