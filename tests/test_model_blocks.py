"""GEM blocks one by one: shapes, gradients to every parameter, jagged inputs with empty and length-1
histories, and independence between the examples of a batch."""

from dataclasses import replace

import pytest
import torch

from gem_ops.model import jagged
from gem_ops.model.config import PRESETS, ModelConfig, model_config
from gem_ops.model.embeddings import ITEM_TABLE
from gem_ops.model.features import CANDIDATE_ITEM, HISTORY_ITEM, model_input
from gem_ops.model.gem import GEMModel
from gem_ops.model.heads import DomainTaskTowers, masked_bce_loss
from gem_ops.model.sequence import JaggedCrossAttention, JaggedTransformerLayer
from gem_ops.model.wukong import FactorizationMachineBlock, WukongLayer
from tests.model_inputs import SPEC, random_batch, take

LENGTHS = [0, 1, 5, 0, 12, 3, 1, 30]
SMALL = model_config("vertical", width=0.5, blocks=2,
                     **{"sequence.branches": ("all", "engaged", "event_type:organic_view"),
                        "sequence.first_level_tokens": 8, "sequence.min_level_tokens": 2})


def test_fm_block_uses_the_optimized_form_of_all_pairwise_interactions():
    torch.manual_seed(0)
    fmb = FactorizationMachineBlock(n_in=5, n_out=3, dim=4, rank=2, hidden=8)
    x = torch.randn(6, 5, 4)
    optimized = torch.bmm(x, torch.matmul(x.transpose(1, 2), fmb.y))
    pairwise = torch.bmm(torch.bmm(x, x.transpose(1, 2)), fmb.y.expand(6, -1, -1))  # (X·Xᵀ)·Y
    torch.testing.assert_close(optimized, pairwise)
    assert fmb(x).shape == (6, 3, 4)


def test_wukong_layer_shapes_and_gradients():
    torch.manual_seed(0)
    layer = WukongLayer(n_in=7, n_fm=3, n_lcb=2, dim=8, rank=4, hidden=16)
    out = layer(torch.randn(4, 7, 8))
    assert out.shape == (4, 5, 8)
    out.pow(2).sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in layer.parameters())


def test_jagged_transformer_layer_keeps_sequences_apart():
    torch.manual_seed(0)
    layer = JaggedTransformerLayer(dim=8, heads=2, ffn_mult=2, activation="softmax")
    offsets = torch.tensor([0, 0, 1, 4, 9])
    x = torch.randn(9, 8)
    together = layer(x, offsets)
    alone = torch.cat([layer(x[a:b], torch.tensor([0, b - a])) for a, b in zip(offsets[:-1], offsets[1:])])
    torch.testing.assert_close(together, alone)


def test_compiled_attention_layers_take_the_projections_gradient_whole():
    """Compiled, the self attention's qkv and the cross attention's kv gradients come from the attention's backward
    in one tensor: Inductor's code joins no q, k, v gradients (with q, k, v as three inputs it runs a `cat` kernel
    per layer), and every gradient is eager's."""
    import re

    from torch._inductor.utils import run_and_get_code

    torch.manual_seed(0)
    offsets = torch.tensor([0, 5, 5, 28, 37])
    history, query = torch.randn(37, 32), torch.randn(4, 2, 24)
    layers = (JaggedTransformerLayer(32, 2, 2, "softmax"), JaggedCrossAttention(24, 32, 2, 8, "silu"))
    calls = (lambda layer, x: layer(x[0], offsets), lambda layer, x: layer(x[1], x[0], offsets))
    for layer, call in zip(layers, calls):
        grads = []
        for fn in (layer, torch.compile(layer, backend="inductor", fullgraph=True)):
            layer.zero_grad()
            inputs = [history.clone().requires_grad_(), query.clone().requires_grad_()]
            out, codes = run_and_get_code(lambda: call(fn, inputs).pow(2).sum().backward())
            grads.append([inputs[0].grad, *(p.grad.clone() for p in layer.parameters())])
        assert len(codes) == 2 and not any(re.search(r"\bcat\b|fused_cat|aten\.cat", code) for code in codes)
        for want, got in zip(*grads):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_cross_attention_with_different_widths_and_empty_histories():
    torch.manual_seed(0)
    cross = JaggedCrossAttention(query_dim=12, kv_dim=8, heads=2, out_dim=6, activation="silu")
    offsets = torch.tensor([0, 0, 1, 7])
    out = cross(torch.randn(3, 2, 12), torch.randn(7, 8), offsets)
    assert out.shape == (3, 2, 6)
    torch.testing.assert_close(out[0], cross.out.bias.expand(2, -1))  # nothing to attend to: zeros in
    out.sum().backward()
    assert all(p.grad is not None for p in cross.parameters())


def test_jagged_helpers_round_trip():
    values = torch.arange(10.0).view(10, 1)
    offsets = torch.tensor([0, 0, 1, 4, 10])
    prefix = -torch.ones(4, 2, 1)
    joined, joined_offsets = jagged.prepend(prefix, values, offsets)
    assert joined_offsets.tolist() == [0, 2, 5, 10, 18]
    back_prefix, back, back_offsets = jagged.split_prefix(joined, joined_offsets, 2)
    assert torch.equal(back, values) and torch.equal(back_offsets, offsets) and torch.equal(back_prefix, prefix)
    last, last_offsets = jagged.keep_last(values, offsets, 2)
    assert last.flatten().tolist() == [0, 2, 3, 8, 9] and last_offsets.tolist() == [0, 0, 1, 3, 5]
    assert jagged.segment_mean(values, offsets).flatten().tolist() == [0.0, 0.0, 2.0, 6.5]


def _random_jagged(seed: int, device: str = "cpu"):
    """Lengths with empties, ones, a long tail; values [N, 3] that need gradients."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.cat([torch.tensor([0, 1, 0]), torch.randint(0, 9, (6,), generator=g), torch.tensor([40])])
    values = torch.randn(int(lengths.sum()), 3, generator=g).to(device).requires_grad_()
    return values, jagged.offsets_of(lengths).to(device), lengths


def _per_sequence(values, lengths):
    return list(torch.split(values, lengths.tolist()))


@pytest.mark.parametrize("seed", range(3))
def test_jagged_ops_match_a_per_sequence_loop(seed):
    values, offsets, lengths = _random_jagged(seed)
    prefix = torch.randn(len(lengths), 2, 3, requires_grad=True)
    joined, joined_offsets = jagged.prepend(prefix, values, offsets)
    expected = torch.cat([torch.cat([p, s]) for p, s in zip(prefix, _per_sequence(values, lengths))])
    assert torch.equal(joined, expected) and torch.equal(joined_offsets, jagged.offsets_of(lengths + 2))
    back_prefix, back, back_offsets = jagged.split_prefix(joined * 2, joined_offsets, 2)
    assert torch.equal(back, values * 2) and torch.equal(back_prefix, prefix * 2) and torch.equal(back_offsets, offsets)
    (back.sum() + back_prefix.sum()).backward()
    assert torch.equal(values.grad, torch.full_like(values, 2)) and torch.equal(prefix.grad, torch.full_like(prefix, 2))

    keep = torch.rand(values.shape[0], generator=torch.Generator().manual_seed(seed)) < 0.5
    chosen, chosen_offsets = jagged.select(values, offsets, keep, int(keep.sum()))
    parts = [s[k] for s, k in zip(_per_sequence(values, lengths), _per_sequence(keep, lengths))]
    assert torch.equal(chosen, torch.cat(parts))
    assert torch.equal(chosen_offsets, jagged.offsets_of(torch.tensor([len(p) for p in parts])))
    for n in (1, 3, 100):
        total = int(lengths.clamp(max=n).sum())
        last, last_offsets = jagged.keep_last(values, offsets, n, total)
        assert torch.equal(last, torch.cat([s[-n:] for s in _per_sequence(values, lengths)]))
        assert torch.equal(last_offsets, jagged.offsets_of(lengths.clamp(max=n)))


def _padded(values: torch.Tensor, extra: int) -> torch.Tensor:
    """values with `extra` rows past the last sequence (finite, no sequence's), as a padded step holds them."""
    tail = torch.full((extra, *values.shape[1:]), 7.0)
    return torch.cat([values, tail]).detach().requires_grad_()


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("extra", [0, 5])
def test_padded_jagged_ops_give_the_exact_ops_rows_and_zeros_past_them(seed, extra):
    """padded=True with capacities above the sizes (a bucketed step): every sequence's rows and their gradients as
    the exact ops give them, zeros in the rows past the last sequence, no gradient into the input's spare rows."""
    values, offsets, lengths = _random_jagged(seed)
    n = values.shape[0]
    padded = _padded(values, extra)
    prefix = torch.randn(len(lengths), 2, 3)

    def check(exact, got, capacity):
        assert got.shape[0] == capacity and torch.equal(got[: exact.shape[0]], exact)
        assert not got[exact.shape[0]:].any()

    joined, joined_offsets = jagged.prepend(prefix, values, offsets)
    joined_p, joined_offsets_p = jagged.prepend(prefix, padded, offsets, padded=True)
    check(joined, joined_p, n + extra + 2 * len(lengths))
    assert torch.equal(joined_offsets_p, joined_offsets)
    _, rest, _ = jagged.split_prefix(joined, joined_offsets, 2)
    prefix_p, rest_p, rest_offsets_p = jagged.split_prefix(joined_p, joined_offsets_p, 2, padded=True)
    check(rest, rest_p, n + extra)
    assert torch.equal(prefix_p, prefix) and torch.equal(rest_offsets_p, offsets)

    keep = torch.rand(n, generator=torch.Generator().manual_seed(seed)) < 0.5
    chosen, _ = jagged.select(values, offsets, keep, int(keep.sum()))
    chosen_p, _ = jagged.select(padded, offsets, keep, int(keep.sum()) + extra + 1, padded=True)
    check(chosen, chosen_p, int(keep.sum()) + extra + 1)
    for cap in (1, 3, 100):
        total = int(lengths.clamp(max=cap).sum())
        last, last_offsets = jagged.keep_last(values, offsets, cap, total)
        last_p, last_offsets_p = jagged.keep_last(padded, offsets, cap, total + extra, padded=True)
        check(last, last_p, total + extra)
        assert torch.equal(last_offsets_p, last_offsets)
    torch.testing.assert_close(jagged.segment_mean(padded, offsets, padded=True), jagged.segment_mean(values, offsets))

    # Gradients: through every op at once, the sequences' rows as exact, none into the spare rows.
    weights = torch.randn(n + extra + 1, 3, generator=torch.Generator().manual_seed(seed + 10))
    for x, pad in ((values, False), (padded, True)):
        t = jagged.keep_last(jagged.select(x, offsets, keep, int(keep.sum()) + (extra + 1) * pad, padded=pad)[0],
                             jagged.offsets_of(jagged.kept_lengths(offsets, keep)), 2,
                             int(jagged.kept_lengths(offsets, keep).clamp(max=2).sum()) + extra * pad, padded=pad)[0]
        (t * weights[: t.shape[0]]).sum().backward()
    torch.testing.assert_close(padded.grad[:n], values.grad)
    assert not padded.grad[n:].any()


def test_take_rows_gives_zeros_for_rows_of_minus_one_and_their_gradient_to_none():
    values = torch.arange(12.0).view(6, 2).requires_grad_()
    rows = torch.tensor([4, -1, 0, -1, 2])
    taken = jagged.take_rows(values, rows, zero_rows=True)
    assert taken.tolist() == [[8, 9], [0, 0], [0, 1], [0, 0], [4, 5]]
    (taken * torch.arange(1.0, 11.0).view(5, 2)).sum().backward()
    assert values.grad.tolist() == [[5, 6], [0, 0], [9, 10], [0, 0], [1, 2], [0, 0]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_take_rows_backward_writes_each_row_once(dtype):
    """take_rows' backward (index_copy into zeros) equals index_select's (index_add) for distinct rows."""
    g = torch.Generator().manual_seed(0)
    values = torch.randn(50, 4, generator=g).to(dtype).requires_grad_()
    rows = torch.randperm(50, generator=g)[:31]
    upstream = torch.randn(31, 4, generator=g).to(dtype)
    (jagged.take_rows(values, rows) * upstream).sum().backward()
    ours, values.grad = values.grad, None
    (values.index_select(0, rows) * upstream).sum().backward()
    assert torch.equal(ours, values.grad)
    assert torch.equal(ours[rows], upstream) and not ours[~torch.isin(torch.arange(50), rows)].any()


def test_level_totals_are_every_pyramid_size():
    lengths = torch.tensor([[0, 1, 7, 40], [0, 0, 3, 9]])
    assert jagged.level_totals(lengths, [8, 2, 4]) == [[48, 16, 5, 5], [12, 11, 4, 4]]


@pytest.mark.gpu
def test_jagged_ops_never_wait_on_the_gpu_once_sizes_are_known():
    values, offsets, lengths = _random_jagged(0, "cuda")
    keep = (torch.arange(values.shape[0], device="cuda") % 3) == 0
    n_kept = int(keep.sum())
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        joined, joined_offsets = jagged.prepend(torch.randn(len(lengths), 2, 3, device="cuda"), values, offsets)
        _, rest, rest_offsets = jagged.split_prefix(joined, joined_offsets, 2)
        chosen, _ = jagged.select(rest, rest_offsets, keep, n_kept)
        last, _ = jagged.keep_last(rest, rest_offsets, 3, int(lengths.clamp(max=3).sum()))
        (chosen.sum() + last.sum()).backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_towers_route_each_example_to_its_domain():
    torch.manual_seed(0)
    towers = DomainTaskTowers(in_dim=6, domains=3, tasks=2, hidden=4, layers=1)
    trunk, domain = torch.randn(5, 6), torch.tensor([0, 1, 2, 1, 0])
    before = towers(trunk, domain)
    with torch.no_grad():  # change domain 2's towers only
        for w in towers.weights:
            w.view(3, 2, *w.shape[1:])[2] += 1.0
    after = towers(trunk, domain)
    changed = (before - after).abs().sum(1) > 0
    assert changed.tolist() == [False, False, True, False, False]


def test_masked_loss_ignores_unlabelled_tasks():
    logits = torch.zeros(4, 2, requires_grad=True)
    labels = torch.tensor([[1.0, 0.0], [0.0, 0.0], [1.0, 1.0], [0.0, 0.0]])
    mask = torch.tensor([[True, False], [True, False], [True, False], [True, False]])
    total, per_task = masked_bce_loss(logits, labels, mask)
    assert per_task[1] == 0 and per_task[0] == pytest.approx(torch.log(torch.tensor(2.0)).item())
    total.backward()
    assert torch.all(logits.grad[:, 1] == 0)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return GEMModel(SPEC, SMALL)


def test_model_output_and_gradients_reach_every_parameter(model):
    x = model_input(random_batch(LENGTHS), SPEC, SMALL)
    model.zero_grad()
    loss, per_task, logits = model.loss(x)
    assert logits.shape == (len(LENGTHS), len(SPEC.objectives)) and per_task.shape == (2,)
    loss.backward()
    missing = [name for name, p in model.named_parameters() if p.grad is None or not torch.isfinite(p.grad).all()]
    assert missing == []
    dead = [name for name, p in model.named_parameters() if p.grad.abs().sum() == 0]
    assert dead == []


def test_examples_do_not_leak_into_each_other(model):
    model.eval()
    batch = random_batch(LENGTHS, seed=1)
    together = model(model_input(batch, SPEC, SMALL))
    for rows in ([0], [1, 4], [7, 3]):  # an empty, a length-1 and a long history among them
        alone = model(model_input(take(batch, rows), SPEC, SMALL))
        torch.testing.assert_close(alone, together[rows], rtol=1e-4, atol=1e-5)
    model.train()


def test_level_sizes_counted_on_the_host_spare_the_forward_its_device_read(model, monkeypatch):
    """Inputs built with their pyramid's level sizes (as the engine's loader builds them, off the GPU's path) give
    the same loss and gradients, and the forward no longer counts them itself (on a GPU: no wait for the device)."""
    batch = random_batch(LENGTHS, seed=2)
    plain, counted = (model_input(batch, SPEC, SMALL, with_level_sizes=flag) for flag in (False, True))
    assert plain.level_sizes is None and len(counted.level_sizes) == len(SMALL.sequence.branches)
    assert counted.to("cpu").level_sizes == counted.level_sizes
    results = []
    for x in (plain, counted):
        model.zero_grad()
        loss = model.loss(x)[0]
        loss.backward()
        results.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
        monkeypatch.setattr(jagged, "level_totals", lambda *a: pytest.fail("the forward counted the level sizes"))
    (want, want_grads), (got, got_grads) = results
    assert torch.equal(got, want) and all(torch.equal(a, b) for a, b in zip(got_grads, want_grads))
    # the counts are what the model's own branches select: three branches, blocks + 1 sizes each
    assert [len(sizes) for sizes in counted.level_sizes] == [SMALL.blocks + 1] * 3
    assert counted.level_sizes[0][0] == sum(LENGTHS)


def test_candidate_and_history_items_share_one_table(model):
    tables = model.embeddings.sequence.embedding_configs()
    item = [t for t in tables if t.name == ITEM_TABLE]
    assert len(item) == 1 and item[0].feature_names == [CANDIDATE_ITEM, HISTORY_ITEM]
    assert sum(HISTORY_ITEM in t.feature_names for t in tables) == 1


def test_without_sequence_arm_is_a_baseline_with_no_sequence_parameters():
    config = model_config("vertical", use_sequence=False)
    baseline = GEMModel(SPEC, config)
    assert len(baseline.branches) == 0
    logits = baseline(model_input(random_batch(LENGTHS), SPEC, config))
    assert logits.shape == (len(LENGTHS), 2)


def test_presets_scale_from_the_config_alone():
    base = model_config("gem")
    scaled = model_config("gem", depth=2.0, width=2.0)
    assert scaled.blocks == 2 * base.blocks
    assert scaled.embedding.dim == 2 * base.embedding.dim and scaled.trunk_hidden == 2 * base.trunk_hidden
    assert scaled.embedding.sequence_dim % scaled.sequence.heads == 0
    small, large = GEMModel(SPEC, model_config("vertical")), GEMModel(SPEC, model_config("vertical", width=2.0))
    count = lambda m: sum(p.numel() for n, p in m.named_parameters() if "embedding" not in n)  # noqa: E731
    assert count(large) > 2 * count(small)
    assert ModelConfig.from_dict(scaled.to_dict()) == scaled


@pytest.mark.parametrize("width, heads, sequence_dim", [(0.5, 8, 1024), (0.25, 4, 512), (1.5, 24, 3072)])
def test_the_gpu_preset_keeps_its_head_dim_when_scaled(width, heads, sequence_dim):
    """gem_gpu scales its number of heads, never its head dim (128)."""
    config = model_config("gem_gpu", width=width)
    assert (config.sequence.heads, config.embedding.sequence_dim) == (heads, sequence_dim)


def test_keep_head_dim_names_a_width_that_heads_do_not_divide():
    with pytest.raises(ValueError, match=r"embedding.sequence_dim \(2048\) to be a multiple of sequence.heads \(3\)"):
        replace(PRESETS["gem_gpu"], sequence=replace(PRESETS["gem_gpu"].sequence, heads=3)).scaled(width=0.5)


def test_without_keep_head_dim_heads_scale_by_the_square_root_of_width():
    preset = PRESETS["gem_gpu"]
    sqrt_rule = replace(preset, sequence=replace(preset.sequence, keep_head_dim=False)).scaled(width=0.5)
    assert (sqrt_rule.sequence.heads, sqrt_rule.embedding.sequence_dim) == (11, 1056)  # 11 heads of 96


def test_sequence_layers_without_biases():
    config = model_config("vertical", **{"sequence.bias": False})
    model, with_biases = GEMModel(SPEC, config), GEMModel(SPEC, model_config("vertical"))
    layer_biases = lambda m: [n for n, p in m.named_parameters()  # noqa: E731
                              if n.startswith("branches.") and n.endswith(".bias") and ".norm" not in n]
    assert layer_biases(model) == [n for n in layer_biases(with_biases) if ".summarize." in n or ".cls_out." in n]
    assert len(layer_biases(with_biases)) > len(layer_biases(model)) > 0
    model(model_input(random_batch(LENGTHS), SPEC, config)).sum().backward()


def test_without_qkv_biases_the_other_sequence_biases_stay():
    config = model_config("vertical", **{"sequence.qkv_bias": False})
    names = [n for n, _ in GEMModel(SPEC, config).named_parameters() if n.startswith("branches.")]
    assert not [n for n in names if n.endswith((".qkv.bias", ".kv.bias"))]
    assert [n for n in names if n.endswith(".proj.bias")] and [n for n in names if n.endswith(".cross.0.q.bias")]


def _self_attention_without_qkv_bias(biased: JaggedTransformerLayer) -> dict[str, torch.Tensor]:
    """The key bias dropped, the query bias moved into the norm's shift (through the query map), the value
    bias (less what that shift adds to the values) into the output map's bias."""
    (wq, _, wv), (bq, _, bv) = biased.qkv.weight.chunk(3), biased.qkv.bias.chunk(3)
    shift = torch.linalg.solve(wq, bq)
    state = {k: v for k, v in biased.state_dict().items() if k != "qkv.bias"}
    state["norm1.bias"] = biased.norm1.bias + shift
    state["proj.bias"] = biased.proj.bias + biased.proj.weight @ (bv - wv @ shift)
    return state


def _cross_attention_without_kv_bias(biased: JaggedCrossAttention) -> dict[str, torch.Tensor]:
    state = {k: v for k, v in biased.state_dict().items() if k != "kv.bias"}
    state["out.bias"] = biased.out.bias + biased.out.weight @ biased.kv.bias.chunk(2)[1]
    return state


@pytest.mark.parametrize("activation", ["softmax", "silu"])
def test_qkv_biases_are_redundant_under_softmax(activation):
    """What the self attention's qkv biases and the cross attention's kv biases compute, the layers' other
    parameters compute without them, under softmax (and only there: silu's scores are not shift-invariant,
    nor its weights a sum of one)."""
    torch.manual_seed(0)
    dim, heads, lengths = 8, 2, [1, 5, 7, 3]
    x = torch.randn(sum(lengths), dim, dtype=torch.float64)
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    query = torch.randn(len(lengths), 2, 6, dtype=torch.float64)
    biased_layer = JaggedTransformerLayer(dim, heads, 2, activation).double()
    plain_layer = JaggedTransformerLayer(dim, heads, 2, activation, qkv_bias=False).double()
    biased_cross = JaggedCrossAttention(6, dim, heads, 6, activation).double()
    plain_cross = JaggedCrossAttention(6, dim, heads, 6, activation, kv_bias=False).double()
    with torch.no_grad():
        for p in [*biased_layer.parameters(), *biased_cross.parameters()]:
            p.normal_()
        plain_layer.load_state_dict(_self_attention_without_qkv_bias(biased_layer))
        plain_cross.load_state_dict(_cross_attention_without_kv_bias(biased_cross))
        same_layer = torch.allclose(plain_layer(x, offsets), biased_layer(x, offsets))
        same_cross = torch.allclose(plain_cross(query, x, offsets), biased_cross(query, x, offsets))
    assert (same_layer, same_cross) == ((True, True) if activation == "softmax" else (False, False))


def test_bad_settings_are_named():
    with pytest.raises(ValueError, match="unknown model preset 'huge'"):
        model_config("huge")
    with pytest.raises(ValueError, match="unknown model setting 'sequence.nope'"):
        model_config("gem", **{"sequence.nope": 1})
    with pytest.raises(ValueError, match="unknown sequence branch 'clicks'"):
        GEMModel(SPEC, model_config("vertical", **{"sequence.branches": ("clicks",)}))


@pytest.mark.parametrize("preset", ["gem", "vertical"])
def test_a_nan_in_one_example_leaves_the_others_of_its_batch_alone(preset):
    """Two examples with a NaN dense feature (what a bad row would carry past a careless reader) give NaN
    outputs for those two alone: nothing in the model mixes examples, however their histories differ."""
    from gem_ops.model import build_model

    torch.manual_seed(0)
    lengths = [0, 5, 1, 0, 9, 2, 0, 30, 3, 0, 1, 4] * 4
    config = model_config(preset, **{"sequence.max_history_len": 32})
    model = build_model(SPEC, config).eval()
    x = model_input(random_batch(lengths), SPEC, config)
    poisoned = [3, 7]  # one without history, one with the longest
    x.dense[poisoned] = float("nan")
    with torch.no_grad():
        out = model(x)
    bad = torch.isnan(out.reshape(out.shape[0], -1)).any(1).nonzero().flatten().tolist()
    assert bad == poisoned


def _per_table_history(embeddings, x) -> torch.Tensor:
    """The history tokens from every table's own TorchRec lookup (what the context tables' stacked lookup replaces)."""
    seq = embeddings.sequence(x.sequence)
    return embeddings.history_norm(sum(seq[key].values() for key in embeddings.history_keys))


@pytest.mark.parametrize("device,compiled", [
    ("cpu", False), ("cpu", True),
    pytest.param("cuda", True, marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                            reason="CUDA")])])
def test_context_tables_looked_up_together_match_their_own_lookups(device, compiled):
    """Surface, event type, action, age and the match flags are summed from one stacked table, and its gradient
    (one product over the batch) gives every table the rows its own embedding backward would."""
    from gem_ops.train.acceleration import compile_model_step

    config = model_config("vertical", width=0.5, blocks=1)
    model = GEMModel(SPEC, config).to(device)
    embeddings = model.embeddings
    assert {"history_surface", "history_age", "history_match"} <= set(embeddings.context_keys)
    assert HISTORY_ITEM not in embeddings.context_keys
    assert embeddings._context_tables() is not None  # the stacked lookup is what embeddings(x) runs below
    x = model_input(random_batch(LENGTHS), SPEC, config).to(device)
    if compiled:
        compile_model_step(model)
    d_out = torch.randn(sum(LENGTHS), config.embedding.sequence_dim, generator=torch.Generator().manual_seed(1))
    d_out = d_out.to(device)
    results = []
    for history in (lambda: _per_table_history(embeddings, x), lambda: embeddings(x)[2]):
        embeddings.zero_grad()
        out = history()
        out.backward(d_out)
        results.append((out.detach(), {n: p.grad.clone() for n, p in embeddings.sequence.named_parameters()}))
    (want, want_grads), (got, got_grads) = results
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert want_grads.keys() == got_grads.keys()
    for name in want_grads:
        torch.testing.assert_close(got_grads[name], want_grads[name], rtol=1e-5, atol=1e-5, msg=name)


def test_candidate_and_history_items_build_one_gradient_of_their_table():
    """The item table's dense gradient is built once for the candidate and the history items (one table_gradient over
    both): no table-sized buffer per key and their sum, no copy of both parts' gradients into one tensor first; the
    rows and the table gradient of TorchRec's lookup per key."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.append(func)
            return func(*args, **(kwargs or {}))

    config = model_config("vertical", width=0.5, blocks=1)
    embeddings = GEMModel(SPEC, config).embeddings
    assert embeddings._context_tables() is not None  # the path that reads the tables itself
    x = model_input(random_batch(LENGTHS), SPEC, config)
    item = embeddings.sequence.embeddings[ITEM_TABLE]
    rows = embeddings._sequence_lookups(x.sequence, looked_up_here=True)
    loss = rows[CANDIDATE_ITEM].sum() + rows[HISTORY_ITEM].sum()
    with Ops() as ops:
        loss.backward()
    assert ops.seen.count(torch.ops.gem.table_gradient.default) == 1
    assert torch.ops.aten.embedding_dense_backward.default not in ops.seen
    assert torch.ops.aten.cat.default not in ops.seen and torch.ops.aten.add.Tensor not in ops.seen

    def per_key():
        seq = embeddings.sequence(x.sequence)
        return seq[CANDIDATE_ITEM].values(), seq[HISTORY_ITEM].values()

    def together():
        rows = embeddings._sequence_lookups(x.sequence, looked_up_here=True)
        return rows[CANDIDATE_ITEM], rows[HISTORY_ITEM]

    generator = torch.Generator().manual_seed(0)
    d_candidate = torch.randn(len(LENGTHS), config.embedding.sequence_dim, generator=generator)
    d_history = torch.randn(sum(LENGTHS), config.embedding.sequence_dim, generator=generator)
    results = []
    for lookups in (per_key, together):
        item.zero_grad()
        candidate, history = lookups()
        ((candidate * d_candidate).sum() + (history * d_history).sum()).backward()
        results.append((candidate.detach(), history.detach(), item.weight.grad.clone()))
    for want, got in zip(*results):
        torch.testing.assert_close(got, want)


def test_the_item_tables_gradient_is_built_once_in_the_compiled_backward():
    """In the backward graph that torch.compile traces, one table-sized gradient of the item table, the candidates'
    and the history items' rows summed into it by one op (two lookups through the module build two, then add
    them)."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    config = model_config("vertical", width=0.5, blocks=1)
    embeddings = GEMModel(SPEC, config).embeddings
    x = model_input(random_batch(LENGTHS), SPEC, config)
    graphs = []

    def keep(graph, _):
        graphs.append(graph)
        return make_boxed_func(graph.forward)

    step = torch.compile(lambda x: sum(t.sum() for t in embeddings(x)), backend=aot_autograd(fw_compiler=keep,
                                                                                              bw_compiler=keep))
    step(x).backward()
    table = tuple(embeddings.sequence.embeddings[ITEM_TABLE].weight.shape)
    # Every graph: torch 2.11 breaks this step into more of them than 2.13, the tables' backward not the last.
    table_sized = [node for graph in graphs for node in graph.graph.nodes if node.op == "call_function"
                   and tuple(getattr(node.meta.get("val"), "shape", ())) == table]
    assert [node.target for node in table_sized] == [torch.ops.gem.table_gradient.default], table_sized


def test_context_tables_gradient_is_one_product_in_the_autocast_dtype_under_autocast():
    """Under bf16 autocast the stacked tables' gradient is a bf16 product (a tensor-core GEMM on a GPU, where fp32
    ran as a SIMT one), as a linear layer's weight gradient is, and matches the fp32 per-table gradient to bf16's
    precision, its rows padded to a multiple of 8 (the alignment those kernels read); without autocast it stays
    fp32 and unpadded."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Products(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.dtypes = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten.mm.default:
                self.dtypes.append((args[0].dtype, args[1].dtype, args[0].shape[0]))
            return func(*args, **(kwargs or {}))

    config = model_config("vertical", width=0.5, blocks=1)
    embeddings = GEMModel(SPEC, config).embeddings
    x = model_input(random_batch(LENGTHS), SPEC, config)
    d_out = torch.randn(sum(LENGTHS), config.embedding.sequence_dim, generator=torch.Generator().manual_seed(1))
    rows = sum(embeddings.sequence.embeddings[embeddings.table_of[key]].num_embeddings
               for key in embeddings.context_keys)
    assert rows % 8, rows  # else padding would change nothing
    grads = {}
    for mode in ("fp32 per table", "fp32", "bf16"):
        embeddings.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "bf16"):
            out = _per_table_history(embeddings, x) if mode == "fp32 per table" else embeddings(x)[2]
        products = Products()
        with products:
            out.float().backward(d_out)
        grads[mode] = {n: p.grad.clone() for n, p in embeddings.sequence.named_parameters() if p.grad is not None}
        if mode != "fp32 per table":
            dtype = torch.bfloat16 if mode == "bf16" else torch.float32
            padded = -(-rows // 8) * 8 if mode == "bf16" else rows
            assert products.dtypes == [(dtype, dtype, padded)], mode  # the one product: the stacked tables'
    for name, want in grads["fp32 per table"].items():
        torch.testing.assert_close(grads["fp32"][name], want, rtol=1e-5, atol=1e-5, msg=name)
        torch.testing.assert_close(grads["bf16"][name], want, rtol=2e-2, atol=1e-2 * want.abs().max().item(), msg=name)
    assert len(grads["bf16"]) == len(grads["fp32 per table"]) > len(embeddings.context_keys)


def test_context_tables_are_left_to_their_collection_when_gradients_are_sparse():
    from gem_ops.train.optimizer import sparse_table_gradients

    model = GEMModel(SPEC, model_config("vertical", width=0.5, blocks=1))
    assert model.embeddings._context_tables() is not None
    sparse_table_gradients(model)
    assert model.embeddings._context_tables() is None
    x = model_input(random_batch(LENGTHS), SPEC, model.config)
    model.embeddings(x)[2].sum().backward()
    assert model.embeddings.sequence.embeddings["history_surface"].weight.grad.is_sparse


@pytest.mark.parametrize(("ratio", "collections"), [(1.3, False), (2.0, False), (1.3, True)])
def test_a_step_on_bucketed_sizes_gives_the_exact_steps_loss_and_gradients(ratio, collections):
    """model_input(size_bucket=...): every size the step after the lookups sees rounded up to a bucket (capacities,
    rows past the last example's no example's); the loss, every gradient and the user summary as with exact sizes,
    the history looked up from the tables directly (ids padded) or through TorchRec's collections (rows padded)."""
    from gem_ops.model.features import bucketed
    from gem_ops.model.heads import loss_from_sums
    from gem_ops.train.optimizer import sparse_table_gradients

    config = model_config("gem", width=0.5, blocks=2, **{"embedding.item_buckets": 1024,
                                                         "embedding.user_buckets": 1024})
    batch = random_batch([3, 1, 40, 9, 70, 0, 12, 5, 33, 2], seed=3)
    exact = model_input(batch, SPEC, config, with_level_sizes=True)
    padded = model_input(batch, SPEC, config, with_level_sizes=True, size_bucket=ratio)
    assert padded.padded and padded.history_action.numel() == bucketed(int(batch.history_offsets[-1]), ratio)
    assert all(p >= e for ps, es in zip(padded.level_sizes, exact.level_sizes) for p, e in zip(ps, es))
    assert padded.level_sizes != exact.level_sizes
    results = []
    for x in (exact, padded):
        torch.manual_seed(0)
        model = GEMModel(SPEC, config)
        if collections:  # sparse table gradients: the embeddings look up through the collections
            sparse_table_gradients(model)
            assert model.embeddings._context_tables() is None
        loss = loss_from_sums(model.loss_sums(x))[0]
        loss.backward()
        with torch.no_grad():
            summary = model.eval().user_summary(x)
        results.append((loss.detach(), summary, {n: p.grad.to_dense() for n, p in model.named_parameters()
                                                 if p.grad is not None}))
    (loss, summary, grads), (padded_loss, padded_summary, padded_grads) = results
    torch.testing.assert_close(padded_loss, loss, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(padded_summary, summary, rtol=1e-5, atol=1e-6)
    assert grads.keys() == padded_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(padded_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_bucketed_sizes_are_few_and_name_a_bad_ratio():
    from gem_ops.model.features import bucketed

    sizes = {bucketed(n, 1.05) for n in range(130_000, 280_000, 97)}
    assert 10 <= len(sizes) <= 20 and all(s % 64 == 0 for s in sizes)
    assert bucketed(1, 1.05) == 64 and bucketed(64, 1.05) == 64 and bucketed(65, 1.05) == 128
    assert bucketed(1000, 1.0001) == 1024  # a ratio near 1 climbs a quantum at a time
    with pytest.raises(ValueError, match="ratio must be > 1"):
        bucketed(10, 1.0)
