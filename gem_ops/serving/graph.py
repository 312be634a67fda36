"""GEMModel's forward for one serving request, on dense tensors that torch.export can trace.

Training runs many users' jagged histories through kernels.jagged_attention, whose grouping reads lengths on
the host. A request is one user: all N candidates share one history of L events, so the same computation is
dense: history tokens [N, L, d] (the candidate-match features make them differ per candidate), attention
over [summary tokens, history] per candidate, and the pyramid's cut to each level a slice. A branch that
reads a subset of the events ("engaged", "event_type:...") keeps them under a mask instead. A model trained
with retrieved events (sequence.retrieved_events K) puts each candidate's own retrieved events before the
history: [N, K + L] tokens under a per-candidate mask (unused slots, and the oldest recent events beyond the
model's longest history). The weights are the model's own (this module holds the model); outputs equal
GEMModel's (tests/test_serving.py).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from gem_ops.model import features as keys
from gem_ops.model.features import age_bucket, hash_ids, history_features
from gem_ops.model.gem import GEMModel, SequenceBranch
from gem_ops.model.sequence import JaggedCrossAttention, JaggedTransformerLayer
from gem_ops.transfer.sharing import embedding_tables


class ServingGraph(nn.Module):
    """forward(*request tensors in request_inputs(retrieved_events) order) -> probabilities [N, tasks]."""

    def __init__(self, model: GEMModel):
        super().__init__()
        self.model = model.eval()
        self.tables = embedding_tables(model)
        self.retrieved_events = model.config.sequence.retrieved_events

    def forward(self, surface, user_id, item_id, sparse_features, dense_features, history_item_id, history_surface,
                history_event_type, history_action, history_age_seconds, history_item_features, representation,
                retrieved_item_id=None, retrieved_surface=None, retrieved_event_type=None, retrieved_action=None,
                retrieved_age_seconds=None, retrieved_item_features=None, retrieved_count=None):
        model, emb, spec = self.model, self.model.config.embedding, self.model.spec
        n = item_id.shape[0]
        # The most recent events the model reads; a longer history costs nothing more.
        limit = model.config.sequence.max_history_len
        history_item_id, history_surface, history_event_type, history_action, history_age_seconds, \
            history_item_features = (_last(t, 0, limit) for t in (history_item_id, history_surface, history_event_type,
                                                                   history_action, history_age_seconds,
                                                                   history_item_features))
        events = (history_item_id, history_surface, history_event_type, history_action, history_age_seconds,
                  history_item_features)
        history = self._history_tokens(item_id, sparse_features, *events)
        action, event_type, valid = history_action, history_event_type, None
        if self.retrieved_events:
            retrieved = (retrieved_item_id, retrieved_surface, retrieved_event_type, retrieved_action,
                         retrieved_age_seconds, retrieved_item_features)
            history = torch.cat([self._history_tokens(item_id, sparse_features, *retrieved), history], 1)
            action, event_type = (torch.cat([r, h.expand(n, -1)], 1) for r, h in
                                  ((retrieved_action, history_action), (retrieved_event_type, history_event_type)))
            valid = _retrieval_mask(retrieved_count, self.retrieved_events, history_item_id.shape[0], limit)

        pooled_ids = {keys.USER_ID: hash_ids(user_id, emb.user_buckets).expand(n), keys.SURFACE: surface.expand(n)}
        for i, name in enumerate(spec.sparse_features):
            pooled_ids[name] = hash_ids(sparse_features[:, i], emb.sparse_buckets)
        pooled = torch.stack([self._lookup(key, pooled_ids[key]) for key in model.embeddings.pooled_keys], 1)
        candidate = model.candidate_proj(self._lookup(keys.CANDIDATE_ITEM, hash_ids(item_id, emb.item_buckets)))
        history = model.embeddings.history_norm(history)
        tokens = [pooled, candidate.unsqueeze(1)]
        if model.dense_proj is not None:
            dense = torch.sign(dense_features) * torch.log1p(dense_features.abs())
            tokens.append(model.dense_proj(dense).unsqueeze(1))
        if model.teacher_proj is not None:
            tokens.append(model.teacher_proj(representation).expand(n, -1).unsqueeze(1))
        tokens = torch.cat(tokens, 1)
        states = [(history, _both(valid, _branch_mask(branch, action, event_type))) for branch in model.branches]
        # How many masked tokens can lie among a branch's latest events: the unused retrieval slots and the
        # recent events it displaces (at most K together), so a level's cut keeps K tokens more than its size.
        slack = [self.retrieved_events if branch.name == "all" else None for branch in model.branches]
        for block, interaction in enumerate(model.interaction):
            extra = []
            for i, branch in enumerate(model.branches):
                summary, states[i] = _branch_block(branch, block, tokens, candidate, *states[i], slack[i])
                extra.append(summary)
            tokens = interaction(torch.cat([tokens, *extra], 1))
        logits = model.towers(model.trunk(tokens.flatten(1)), surface.expand(n))
        return torch.sigmoid(logits)

    def _lookup(self, key: str, ids: torch.Tensor) -> torch.Tensor:
        embeddings = self.model.embeddings
        return embeddings._at_width(key, F.embedding(ids, self.tables[embeddings.table_of[key]]))

    def _history_tokens(self, item_id, sparse_features, history_item_id, history_surface, history_event_type,
                        history_action, history_age_seconds, history_item_features) -> torch.Tensor:
        """[N, L, d]: the sum of each event's embeddings (item, context, and whether it matches the candidate),
        before the history's norm; of events [L] shared by the candidates, or [N, L] each candidate's own."""
        model, emb, spec = self.model, self.model.config.embedding, self.model.spec
        shared = {  # the same for every candidate: looked up once
            keys.HISTORY_ITEM: hash_ids(history_item_id, emb.item_buckets),
            keys.HISTORY_SURFACE: history_surface,
            keys.HISTORY_EVENT_TYPE: history_event_type,
            keys.HISTORY_ACTION: history_action.clamp(0, spec.n_actions - 1),
            keys.HISTORY_AGE: age_bucket(history_age_seconds, emb.age_buckets),
        }
        rows = (lambda t: t.unsqueeze(0)) if history_item_id.dim() == 1 else (lambda t: t)  # noqa: E731
        per_candidate = {keys.HISTORY_MATCH: (rows(history_item_id) == item_id[:, None]).long()}
        for i, name in enumerate(history_features(spec, model.config)):
            values = history_item_features[..., i]
            shared[f"history_{name}"] = hash_ids(values, emb.sparse_buckets)
            candidate_value = sparse_features[:, spec.sparse_features.index(name)]
            per_candidate[f"history_{name}_match"] = ((rows(values) == candidate_value[:, None])
                                                      & rows(values >= 0)).long()
        tokens = rows(sum(self._lookup(k, ids) for k, ids in shared.items()))
        return tokens + sum(self._flag_lookup(k, flags) for k, flags in per_candidate.items())

    def _flag_lookup(self, key: str, flags: torch.Tensor) -> torch.Tensor:
        """The lookup of a two-row table by a 0/1 flag [N, L] as arithmetic: no [N, L] index, whose reshape
        inside the embedding would pin the history length to more than one event under export."""
        table = self.model.embeddings._at_width(key, self.tables[self.model.embeddings.table_of[key]])
        return table[0] + flags.unsqueeze(-1).to(table.dtype) * (table[1] - table[0])


def _branch_mask(branch: SequenceBranch, action: torch.Tensor, event_type: torch.Tensor) -> torch.Tensor | None:
    """[L] (or [N, L]) the events a branch reads (None: all)."""
    if branch.name == "all":
        return None
    return action != 0 if branch.name == "engaged" else event_type == branch._event_type


def _retrieval_mask(count: torch.Tensor, slots: int, length: int, limit: int) -> torch.Tensor:
    """[N, slots + length]: candidate i reads its first count[i] retrieved slots and its latest limit - count[i]
    recent events (retrieved events take the place of the oldest recent ones within the model's longest history,
    as SequenceLogs.batch gives them)."""
    used = torch.arange(slots, device=count.device).unsqueeze(0) < count.unsqueeze(1)
    from_end = length - torch.arange(length, device=count.device)  # 1 for the latest event
    return torch.cat([used, from_end.unsqueeze(0) <= (limit - count).unsqueeze(1)], 1)


def _both(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
    return b if a is None else a if b is None else a & b


def _branch_block(branch: SequenceBranch, block: int, tokens: torch.Tensor, candidate: torch.Tensor,
                  history: torch.Tensor, mask: torch.Tensor | None, slack: int | None = None):
    """SequenceBranch.forward on [N, L, d] history: (summaries [N, K + 2, d], (history, mask) after the cut)."""
    n, k = tokens.shape[0], branch.k
    prefix = branch.summarize[block](tokens.flatten(1)).view(n, k, history.shape[-1]).to(history.dtype)
    cls, history = _transformer_layer(branch.layers[block], prefix, history, mask)
    attended = _cross_attention(branch.cross[block], torch.stack([candidate, tokens.mean(1)], 1), history, mask)
    history, mask = _keep_last(history, mask, branch.levels[block], slack)
    return torch.cat([branch.cls_out[block](cls), attended], 1), (history, mask)


def _keep_last(history: torch.Tensor, mask: torch.Tensor | None, n: int, slack: int | None = None):
    """The last n events (of those `mask` marks). `slack`: at most that many unmarked tokens lie among a
    candidate's last n marked ones, which are then within the last n + slack positions."""
    if mask is None:  # a contiguous copy: reshaping a strided one would pin the length under export
        return _last(history, 1, n).clone(memory_format=torch.contiguous_format), None
    if slack is not None:
        history = _last(history, 1, n + slack).clone(memory_format=torch.contiguous_format)
        mask = _last(mask, mask.dim() - 1, n + slack)
    from_end = torch.flip(torch.cumsum(torch.flip(mask.long(), [-1]), -1), [-1])  # 1 for the last kept event
    return history, mask & (from_end <= n)


def _last(x: torch.Tensor, dim: int, n: int) -> torch.Tensor:
    """The last n entries along `dim` (all, when fewer): a narrow whose size stays symbolic under export,
    where a slice would pin the history length to one side of n."""
    length = x.shape[dim]
    kept = torch.sym_min(length, n)
    return x.narrow(dim, length - kept, kept)


def _transformer_layer(layer: JaggedTransformerLayer, prefix: torch.Tensor, history: torch.Tensor,
                       mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer over [prefix, history] of each candidate, the two parts kept apart (every op but attention
    is per token): no slice of a joint tensor, whose strides would pin the history length under export."""
    parts = [_linear(layer.qkv, layer.norm1(x)).view(x.shape[0], x.shape[1], 3, layer.heads, layer.head_dim).unbind(2)
             for x in (prefix, history)]
    k, v = (torch.cat([parts[0][i], parts[1][i]], 1) for i in (1, 2))
    key_mask = None if mask is None else torch.cat([mask.new_ones(*mask.shape[:-1], prefix.shape[1]), mask], -1)
    out = []
    for x, (q, _, _) in zip((prefix, history), parts):
        attended = _attention(q, k, v, key_mask, layer.activation, summary_keys=True)
        x = x + _linear(layer.proj, attended.reshape(x.shape[0], x.shape[1], layer.heads * layer.head_dim))
        up, activation, down = layer.ffn
        out.append(x + _linear(down, activation(_linear(up, layer.norm2(x)))))
    return out[0], out[1]


def _linear(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """layer(x) for x [N, L, d] as one [N * L, d] product: a 3-D matmul's folding would pin L under export."""
    n, length, width = x.shape
    return F.linear(x.reshape(n * length, width), layer.weight, layer.bias).view(n, length, layer.out_features)


def _cross_attention(cross: JaggedCrossAttention, query: torch.Tensor, history: torch.Tensor,
                     mask: torch.Tensor | None) -> torch.Tensor:
    n, q_len = query.shape[:2]
    q = cross.q(query).view(n, q_len, cross.heads, cross.head_dim)
    k, v = _linear(cross.kv, cross.norm(history)).view(n, history.shape[1], 2, cross.heads, cross.head_dim).unbind(2)
    return cross.out(_attention(q, k, v, mask, cross.activation).reshape(n, q_len, cross.heads * cross.head_dim))


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
               activation: str, summary_keys: bool = False) -> torch.Tensor:
    """q [N, Lq, H, D] over k, v [N, Lk, H, D] with the keys `mask` [Lk] (or [N, Lk]) marks (None: all) ->
    [N, Lq, H, D]. A query with no key returns zeros, as jagged_attention does; `summary_keys`: the keys start
    with the always visible summary tokens (self attention), so every query has one."""
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    scale = q.shape[-1] ** -0.5
    # Over [N, H, Lq, Lk] scores: [1, 1, 1, Lk], or [N, 1, 1, Lk] for a mask per candidate. Four dims: with a
    # 3-D mask the CPU's scaled_dot_product_attention leaves its fused kernel for the math path,
    # which materialises the [N, H, Lq, Lk] scores.
    keys = torch.ones(k.shape[2], dtype=torch.bool, device=k.device) if mask is None else mask
    visible = (keys if keys.dim() == 2 else keys.unsqueeze(0)).unsqueeze(1).unsqueeze(1)
    if activation == "silu":
        weights = (F.silu(torch.matmul(q, k.transpose(-1, -2)) * scale) * visible
                   / visible.sum(-1, keepdim=True).clamp(min=1))
        return torch.matmul(weights, v).transpose(1, 2)
    if summary_keys:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=None if mask is None else visible,
                                              scale=scale).transpose(1, 2)
    # Cross attention: two queries, so the weights are small enough to write out, and a query without any
    # visible key (an empty history) gets exact zeros instead of NaN.
    scores = (torch.matmul(q, k.transpose(-1, -2)) * scale).masked_fill(~visible, -1e30)
    scores = torch.cat([scores, scores.new_full((*scores.shape[:-1], 1), -1e30)], -1)  # one slot: a max exists at L 0
    weights = torch.exp(scores - scores.amax(-1, keepdim=True))[..., :-1] * visible
    return (torch.matmul(weights, v) / weights.sum(-1, keepdim=True).clamp(min=1e-30)).transpose(1, 2)
