"""The analytic FLOP count (gem_ops.metrics.flops) against torch.utils.flop_counter.FlopCounterMode on
the real model, on jagged batches with empty, length-1 and long histories.

FlopCounterMode counts matrix products at the aten level. The attention goes through the jagged
attention reference, which pads each group of similar lengths and calls SDPA (not counted by the
counter on CPU, and padded where it would be): for an honest comparison the model's attention is
swapped here for a per-sequence, unpadded computation (q_i·k_iᵀ, softmax, ·v_i), whose products
the counter sees exactly. Everything else is the model as it trains."""

import re

import numpy as np
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import gem_ops.model.sequence as sequence_module
from gem_ops.metrics.flops import MODULES, attention_pairs, batch_flops, branch_lengths
from gem_ops.model.config import model_config
from gem_ops.model.features import model_input
from gem_ops.train.model_state import seeded_model
from kernels.jagged_attention_op import split_packed
from tests.model_inputs import SPEC, random_batch

LENGTHS = [0, 1, 7, 30, 90, 3, 64, 12]


def unpadded_attention(q, k, v, q_offsets, kv_offsets=None, *, causal=False, activation="softmax", scale=None,
                       backend="auto"):
    """Exactly the visible pairs' products, one sequence at a time (test oracle; slow)."""
    kv_offsets = q_offsets if kv_offsets is None else kv_offsets
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    out = []
    for b in range(q_offsets.numel() - 1):
        qs = q[q_offsets[b] : q_offsets[b + 1]].transpose(0, 1)  # [H, Lq, D]
        ks = k[kv_offsets[b] : kv_offsets[b + 1]].transpose(0, 1)
        vs = v[kv_offsets[b] : kv_offsets[b + 1]].transpose(0, 1)
        if ks.shape[1] == 0:
            out.append(q.new_zeros(qs.shape[1], q.shape[1], v.shape[2]))
            continue
        scores = torch.matmul(qs, ks.transpose(-1, -2)) * scale
        weights = scores.softmax(-1) if activation == "softmax" else torch.nn.functional.silu(scores) / ks.shape[1]
        out.append(torch.matmul(weights, vs).transpose(0, 1))
    return torch.cat(out)


def unpadded_attention_packed(packed, q_offsets, kv_offsets=None, *, q=None, **settings):
    return unpadded_attention(*split_packed(packed, q), q_offsets, kv_offsets, **settings)


SMALL_TABLES = {"embedding.item_buckets": 2048, "embedding.user_buckets": 2048}  # lookups cost no FLOPs
CONFIGS = {
    "vertical": model_config("vertical", **SMALL_TABLES),
    "domain_fm": model_config("domain_fm", width=0.5, **SMALL_TABLES),
    # Three branches (one selecting by event type), SiLU attention, the pyramid cutting long histories.
    "gem": model_config("gem", width=0.5, **SMALL_TABLES, **{
        "sequence.branches": ["all", "engaged", "event_type:organic_view"], "sequence.first_level_tokens": 32,
        "sequence.activation": "silu", "blocks": 2}),
    "no_sequence": model_config("gem", width=0.5, use_sequence=False, **SMALL_TABLES),
    # A student reading a teacher's wider tables through projections (parameter sharing).
    "shared_tables": model_config("vertical", **SMALL_TABLES,
                                  **{"embedding.table_widths": [["item", 64], ["user_id", 48]]}),
    # TorchRec's DLRM and DLRM-DCN baselines.
    "dlrm": model_config("dlrm", **SMALL_TABLES),
    "dcn": model_config("dcn", **SMALL_TABLES),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_analytic_count_matches_flop_counter(name, monkeypatch):
    monkeypatch.setattr(sequence_module, "jagged_attention_packed", unpadded_attention_packed)
    config = CONFIGS[name]
    batch = random_batch(LENGTHS, seed=3)
    model = seeded_model(SPEC, config)
    x = model_input(batch, SPEC, config)
    analytic = batch_flops(batch, SPEC, config)

    with FlopCounterMode(display=False) as forward:
        model.loss(x)
    assert forward.get_total_flops() == pytest.approx(analytic.forward, rel=1e-6)

    # Per module. The counter names a module by its path from the outermost module called (GEMModel when
    # the model is called, else the module's class, all instances together).
    counts = forward.get_flop_counts()
    counted = lambda pattern: sum(sum(v.values()) for k, v in counts.items() if re.fullmatch(pattern, k))  # noqa: E731
    wukong = sum(v for k, v in analytic.forward_by_module.items() if k.startswith("wukong."))
    assert counted(r"WukongLayer|GEMModel\.interaction\.\d+") == pytest.approx(wukong, rel=1e-6)
    assert counted(r"DomainTaskTowers|GEMModel\.towers") == pytest.approx(analytic.forward_by_module["towers"],
                                                                          rel=1e-6)
    sequence_arm = sum(v for k, v in analytic.forward_by_module.items() if k.startswith(("sequence.", "cross.")))
    assert counted(r"SequenceBranch|GEMModel\.branches\.\d+") == pytest.approx(sequence_arm, rel=1e-6)

    # Forward + backward: 3x the forward within a few percent (the dense-feature projection's input
    # needs no gradient, so its backward is one product, not two). The context tables' gradient is a product
    # too, of a lookup that has no model FLOPs: taken out.
    with FlopCounterMode(display=False) as training:
        loss, _, _ = model.loss(x)
        loss.backward()
    assert training.get_total_flops() - context_gradient_flops(model, x) == pytest.approx(analytic.training, rel=0.02)


def context_gradient_flops(model, x) -> int:
    """The [rows, tokens] x [tokens, d] product that gives the stacked context tables their gradient
    (GEMEmbeddings.summed_rows), where the model's history tokens reach its loss."""
    embeddings = getattr(model, "embeddings", None)
    tables = embeddings._context_tables() if model.config.use_sequence and hasattr(embeddings, "context_keys") else None
    if not tables:
        return 0
    rows = sum(table.shape[0] for table in tables)
    return 2 * rows * int(x.history_offsets[-1]) * model.config.embedding.sequence_dim


def test_branch_lengths_follow_the_branch_selection():
    config = CONFIGS["gem"]
    batch = random_batch(LENGTHS, seed=5)
    lengths = branch_lengths(config, SPEC, batch.history_offsets, batch.history_action, batch.history_event_type)
    offsets = batch.history_offsets.tolist()
    for b, L in enumerate(LENGTHS):
        rows = slice(offsets[b], offsets[b + 1])
        assert lengths["all"][b] == L
        assert lengths["engaged"][b] == int((batch.history_action[rows] != 0).sum())
        organic = SPEC.event_types.index("organic_view")
        assert lengths["event_type:organic_view"][b] == int((batch.history_event_type[rows] == organic).sum())


def test_count_grows_with_lengths_and_the_pyramid_caps_later_levels():
    config = model_config("gem", width=0.5, **{"sequence.branches": ["all"], "sequence.first_level_tokens": 16})
    short, long_ = (batch_flops(random_batch([n] * 4), SPEC, config) for n in (16, 64))
    assert long_.forward > short.forward
    # Attention grows with L²: at level 0 (4x the length) about 16x, later levels are capped at 16, 4, ...
    assert long_.forward_by_module["sequence.attention"] > 4 * short.forward_by_module["sequence.attention"]
    assert set(long_.forward_by_module) == set(MODULES)
    assert long_.forward_by_module["embeddings"] == 0.0
    assert long_.training == pytest.approx(3 * long_.forward)


@pytest.mark.parametrize("lq, lk", [(5, 5), (1, 9), (9, 3), (0, 4), (4, 0), (1, 1)])
def test_causal_pairs_count_the_visible_half(lq, lk):
    i = np.arange(lq)[:, None]
    j = np.arange(lk)[None, :]
    visible = int((j <= i + (lk - lq)).sum())  # the kernels' end-aligned causal mask
    assert attention_pairs(np.array([lq]), np.array([lk]), causal=True) == visible
    assert attention_pairs(np.array([lq]), np.array([lk])) == lq * lk
    if lq == lk:
        assert visible == lq * (lq + 1) // 2
