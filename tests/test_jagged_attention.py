"""Jagged attention reference against a padded dense computation (the whole batch padded to its maximum)."""

import math

import pytest
import torch
import torch.nn.functional as F

from kernels.jagged_attention import jagged_attention, jagged_attention_packed


def random_offsets(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64)


def padded_dense_attention(q, k, v, q_offsets, kv_offsets, causal, activation, scale):
    """Every sequence padded to the batch maximum, masked, attended with dense ops, and unpadded."""
    B = q_offsets.numel() - 1
    lq, lk = q_offsets.diff(), kv_offsets.diff()
    Lq, Lk = max(int(lq.max()), 1), max(int(lk.max()), 1)
    H, D, Dv = q.shape[1], q.shape[2], v.shape[2]
    pq, pk, pv = q.new_zeros(B, H, Lq, D), k.new_zeros(B, H, Lk, D), v.new_zeros(B, H, Lk, Dv)
    for b in range(B):
        pq[b, :, : lq[b]] = q[q_offsets[b] : q_offsets[b + 1]].transpose(0, 1)
        pk[b, :, : lk[b]] = k[kv_offsets[b] : kv_offsets[b + 1]].transpose(0, 1)
        pv[b, :, : lk[b]] = v[kv_offsets[b] : kv_offsets[b + 1]].transpose(0, 1)
    i = torch.arange(Lq)[:, None]
    j = torch.arange(Lk)[None, :]
    mask = (j[None] < lk[:, None, None]) & (i[None] < lq[:, None, None])
    if causal:
        mask &= j[None] <= i[None] + (lk - lq)[:, None, None]
    mask = mask[:, None]  # [B, 1, Lq, Lk]
    if activation == "softmax":
        scores = (pq @ pk.transpose(-1, -2) * scale).masked_fill(~mask, float("-inf"))
        out = torch.softmax(scores, -1).nan_to_num(0.0) @ pv  # a row with no key attends to nothing
    else:
        weights = F.silu(pq @ pk.transpose(-1, -2) * scale) * mask / lk.clamp(min=1)[:, None, None, None]
        out = weights @ pv
    return torch.cat([out[b, :, : lq[b]].transpose(0, 1) for b in range(B)])


CASES = {
    "mixed": [0, 1, 5, 17, 33, 2, 64, 0, 9],
    "all_empty": [0, 0, 0],
    "single": [1],
    "long_tail": [3, 1, 2, 4, 1, 200, 2, 1, 1, 130],
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("activation", ["softmax", "silu"])
def test_self_attention_matches_padded_dense(case, causal, activation):
    torch.manual_seed(0)
    offsets = random_offsets(CASES[case])
    n, H, D = int(offsets[-1]), 2, 8
    q, k, v = (torch.randn(n, H, D, dtype=torch.float64, requires_grad=True) for _ in range(3))
    scale = 1 / math.sqrt(D)
    got = jagged_attention(q, k, v, offsets, causal=causal, activation=activation)
    want = padded_dense_attention(q, k, v, offsets, offsets, causal, activation, scale)
    torch.testing.assert_close(got, want)
    _assert_same_gradients(got, want, (q, k, v))


@pytest.mark.parametrize("activation", ["softmax", "silu"])
def test_cross_attention_with_different_value_width(activation):
    torch.manual_seed(1)
    kv_lengths = [0, 1, 7, 40, 3]
    q_offsets = random_offsets([2] * len(kv_lengths))  # two query tokens per sample
    kv_offsets = random_offsets(kv_lengths)
    H, D, Dv = 3, 4, 6
    q = torch.randn(int(q_offsets[-1]), H, D, dtype=torch.float64, requires_grad=True)
    k = torch.randn(int(kv_offsets[-1]), H, D, dtype=torch.float64, requires_grad=True)
    v = torch.randn(int(kv_offsets[-1]), H, Dv, dtype=torch.float64, requires_grad=True)
    got = jagged_attention(q, k, v, q_offsets, kv_offsets, activation=activation)
    want = padded_dense_attention(q, k, v, q_offsets, kv_offsets, False, activation, 1 / math.sqrt(D))
    assert got.shape == (q.shape[0], H, Dv)
    torch.testing.assert_close(got, want)
    assert torch.all(got[:2] == 0), "a sample with an empty history attends to nothing"
    _assert_same_gradients(got, want, (q, k, v))


def test_groups_larger_than_the_chunk_limit_are_split(monkeypatch):
    import kernels.pytorch.pt_jagged_attention as reference

    torch.manual_seed(2)
    offsets = random_offsets([5, 6, 7, 8, 5, 6])
    q, k, v = (torch.randn(int(offsets[-1]), 1, 4, dtype=torch.float64) for _ in range(3))
    whole = jagged_attention(q, k, v, offsets)
    monkeypatch.setattr(reference, "MAX_SCORE_ELEMENTS", 64)  # one sequence per chunk
    torch.testing.assert_close(jagged_attention(q, k, v, offsets), whole)


def test_bad_arguments_name_the_problem():
    q = torch.randn(4, 2, 8)
    offsets = torch.tensor([0, 4])
    with pytest.raises(ValueError, match="activation"):
        jagged_attention(q, q, q, offsets, activation="relu")
    with pytest.raises(ValueError, match="backend 'nope' unknown"):
        jagged_attention(q, q, q, offsets, backend="nope")
    with pytest.raises(ValueError, match="shape mismatch"):
        jagged_attention(q, torch.randn(4, 3, 8), q, offsets)
    with pytest.raises(ValueError, match=r"packed must be \[tokens, 3 x heads, dim\] \(q, k, v\); got \(4, 4, 8\)"):
        jagged_attention_packed(torch.randn(4, 4, 8), offsets)
    with pytest.raises(ValueError, match="shape mismatch"):  # k, v of 2 heads beside a q of 3
        jagged_attention_packed(torch.randn(4, 4, 8), offsets, q=torch.randn(4, 3, 8))


def _assert_same_gradients(got, want, inputs):
    upstream = torch.randn_like(got)
    grads_got = torch.autograd.grad(got, inputs, upstream, retain_graph=True, allow_unused=True)
    grads_want = torch.autograd.grad(want, inputs, upstream, allow_unused=True)
    for name, a, b in zip("qkv", grads_got, grads_want):
        if b is None:
            continue
        assert a is not None, f"no gradient for {name}"
        assert torch.isfinite(a).all(), f"non-finite gradient for {name}"
        torch.testing.assert_close(a, b, msg=lambda m: f"d{name}: {m}")


@pytest.mark.parametrize("activation", ["softmax", "silu"])
def test_bf16_inputs_give_bf16_outputs_close_to_fp32(activation):
    torch.manual_seed(0)
    offsets = random_offsets(CASES["long_tail"])
    q, k, v = (torch.randn(int(offsets[-1]), 2, 8) for _ in range(3))
    want = jagged_attention(q, k, v, offsets, causal=True, activation=activation, backend="pytorch")
    got = jagged_attention(*(t.bfloat16() for t in (q, k, v)), offsets, causal=True, activation=activation,
                           backend="pytorch")
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)


def nan_stays_in_its_sequence(backend: str, device: str, causal: bool, activation: str, dim: int = 8) -> None:
    """A NaN in one sequence's q, k or v reaches no other sequence's output or gradient, whether the other
    sequences have keys or none (examples in a batch never affect each other)."""
    q_lengths, kv_lengths = [2, 2, 2, 3, 1, 2], [0, 3, 0, 2, 1, 0]
    q_offsets = torch.tensor([0, *torch.tensor(q_lengths).cumsum(0).tolist()], device=device)
    kv_offsets = torch.tensor([0, *torch.tensor(kv_lengths).cumsum(0).tolist()], device=device)
    # Sequence 2 has no keys, sequence 3 has some.
    for which, poisoned in (("q", 2), ("q", 3), ("k", 3), ("v", 3)):
        torch.manual_seed(0)
        q, k, v = (torch.randn(int(o[-1]), 2, dim, device=device) for o in (q_offsets, kv_offsets, kv_offsets))
        target, offsets = {"q": (q, q_offsets), "k": (k, kv_offsets), "v": (v, kv_offsets)}[which]
        target[int(offsets[poisoned])] = float("nan")
        inputs = [x.requires_grad_() for x in (q, k, v)]
        out = jagged_attention(*inputs, q_offsets, kv_offsets, causal=causal, activation=activation, backend=backend)
        grads = torch.autograd.grad(out.sum(), inputs, allow_unused=True)
        for b in range(len(q_lengths)):
            if b == poisoned:
                continue
            rows = slice(int(q_offsets[b]), int(q_offsets[b + 1]))
            keys = slice(int(kv_offsets[b]), int(kv_offsets[b + 1]))
            assert torch.isfinite(out[rows]).all(), f"NaN in {which} of sequence {poisoned} reached sequence {b}"
            assert torch.isfinite(grads[0][rows]).all() and torch.isfinite(grads[1][keys]).all() \
                and torch.isfinite(grads[2][keys]).all(), f"NaN in {which} reached sequence {b}'s gradients"


@pytest.mark.parametrize("activation", ["softmax", "silu"])
@pytest.mark.parametrize("causal", [False, True])
def test_a_nan_in_one_sequence_never_reaches_another(causal, activation):
    nan_stays_in_its_sequence("pytorch", "cpu", causal, activation)


@pytest.mark.parametrize("activation", ["softmax", "silu"])
def test_compiled_callers_get_one_graph_and_the_eager_gradients(activation):
    """Under torch.compile the attention is a custom op with a known output shape: the caller compiles whole
    (fullgraph: a graph break would raise), through fake tensors and AOT autograd, on batches of new lengths."""

    def layer(x, w, offsets):
        q, k, v = (x @ w).view(x.shape[0], 3, 2, 4).unbind(1)
        return (jagged_attention(q, k, v, offsets, causal=True, activation=activation).flatten(1) * x).sum()

    _check_compiled_against_eager(layer)


def _check_compiled_against_eager(layer, *others) -> None:
    """`layer(x [N, 8], w [8, 24], offsets) -> loss` compiled whole (aot_eager), on batches of new lengths: eager's
    loss and gradients (and those of `others`, the same computation written otherwise), in one dynamic graph."""
    import torch._dynamo.testing

    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(layer, backend=counter, fullgraph=True)
    torch.manual_seed(0)
    w = torch.randn(8, 24, dtype=torch.float64)
    for lengths in ([3, 0, 7, 1], [5, 2, 9, 4, 1], [1, 30, 2]):
        offsets = random_offsets(lengths)
        x = torch.randn(int(offsets[-1]), 8, dtype=torch.float64)
        results = []
        for fn in (layer, compiled, *others):
            xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
            loss = fn(xs, ws, offsets)
            results.append((loss.detach(), *torch.autograd.grad(loss, (xs, ws))))
        for want, *got in zip(*results):
            for g in got:
                torch.testing.assert_close(g, want)
    assert counter.frame_count <= 2  # the first shapes, then one dynamic graph for every later batch


@pytest.mark.parametrize("cross", [False, True])
def test_compiled_packed_callers_get_one_graph_and_the_eager_gradients(cross):
    """q, k, v handed over as one fused projection (or k, v beside their own q): eager, the same result as three
    tensors; compiled whole on batches of new lengths, one dynamic graph with eager's loss and gradients."""

    def layer(x, w, offsets):
        if not cross:
            out = jagged_attention_packed((x @ w).view(x.shape[0], 6, 4), offsets, causal=True)
            return (out.flatten(1) * x).sum()
        q_offsets = torch.arange(0, 2 * (offsets.numel() - 1) + 1, 2)
        q = x[:1].expand(2 * (offsets.numel() - 1), 8).reshape(-1, 2, 4)
        return jagged_attention_packed((x @ w[:, 8:]).view(x.shape[0], 4, 4), q_offsets, offsets, q=q).sum()

    def three_tensors(x, w, offsets):
        q, k, v = (x @ w).view(x.shape[0], 3, 2, 4).unbind(1)
        return (jagged_attention(q, k, v, offsets, causal=True).flatten(1) * x).sum()

    _check_compiled_against_eager(layer, *(() if cross else (three_tensors,)))


def test_every_op_backend_hands_its_saved_tensor_over_flat():
    """A compiled step saves it for the backward; strides that depend on a batch's sizes get fixed to the first
    batch's there, failing the next batch's stride check (seen on the H200 with the Triton statistics)."""
    from kernels.jagged_attention_op import _OP_BACKENDS

    assert "triton" in _OP_BACKENDS
    for name, backend in _OP_BACKENDS.items():
        for activation in ("softmax", "silu"):
            assert len(backend.saved_shape(100, 4, 7, activation)) == 1, (name, activation)
