"""gem_ops.train.fp8_linear: the tensorwise_triton FP8 layer. Its outputs and gradients against the
same products computed in fp32 from the same FP8 operands (tight: this checks layouts, scales and
padding), against the full-precision layer (loose: FP8's own error), and under torch.compile."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gem_ops.train.acceleration import convert_to_fp8, fp8_layer_names
from gem_ops.train.fp8_linear import Float8TrainingLinear, convert_to_float8_linear
from kernels.fp8_cast import cast_to_fp8
from kernels.pytorch.pt_fp8_cast import pt_cast_to_fp8

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _dequantized(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    t8, _, inverse, _ = pt_cast_to_fp8(t.detach(), dtype, False, False)
    return t8.float() * inverse


def _layer(in_features=64, out_features=48, bias=True, seed=0):
    torch.manual_seed(seed)
    layer = nn.Linear(in_features, out_features, bias=bias)
    convert_to_float8_linear(layer, lambda m, name: True)
    assert type(layer) is Float8TrainingLinear
    return layer


DEVICES = [pytest.param("cpu"), pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rows", [1, 37, 64])
@pytest.mark.parametrize("bias", [True, False])
def test_products_are_the_fp8_operands_products(device, rows, bias):
    _check_products(device, rows, 64, 48, bias, torch.bfloat16)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("rows", "in_features", "out_features"), [(74, 64, 32), (96, 64, 32), (74, 32, 64),
                                                                    (96, 32, 96), (37, 32, 32), (74, 128, 256),
                                                                    (300, 256, 128)])
@pytest.mark.parametrize("autocast_dtype", [torch.bfloat16, None], ids=["bf16", "fp32"])
def test_products_at_a_small_models_shapes_with_and_without_autocast(device, rows, in_features, out_features,
                                                                     autocast_dtype):
    """The shapes of a narrow GEM's FFN, projection and QKV layers, and two at FP8's 128-feature minimum. Without
    autocast the layer's input and output gradient are fp32 (the model tests' eager FP8 model), which gave NaN
    weight and input gradients on the H200 while the same model under bf16 autocast trained."""
    _check_products(device, rows, in_features, out_features, True, autocast_dtype)


def _check_products(device: str, rows: int, in_features: int, out_features: int, bias: bool,
                    autocast_dtype: torch.dtype | None) -> None:
    layer = _layer(in_features, out_features, bias=bias).to(device)
    x = torch.randn(rows, in_features, device=device, requires_grad=True)
    g = torch.randn(rows, out_features, device=device)
    with torch.autocast(device, dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None):
        out = layer(x)
    out.backward(g)
    out_dtype = autocast_dtype or torch.float32
    g_cast = g.to(out_dtype)
    # Under autocast the layer rounds its fp32 input to autocast's dtype before the FP8 cast, as nn.Linear would.
    xq, wq, gq = _dequantized(x.to(out_dtype), E4M3), _dequantized(layer.weight, E4M3), _dequantized(g_cast, E5M2)
    expected = xq @ wq.t() + (layer.bias.to(out_dtype).float() if bias else 0)
    assert out.dtype == out_dtype
    for name, tensor in (("output", out), ("input gradient", x.grad), ("weight gradient", layer.weight.grad)):
        assert torch.isfinite(tensor).all(), f"{name}: non-finite values"
    torch.testing.assert_close(out.float(), expected, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(x.grad.float(), gq @ wq, rtol=1e-2, atol=1e-2)
    # Summed over every row: on the GPU the tensor cores' fast accumulation rounds the partial sums (by up to 0.03
    # at 300 rows on the H200); a lost or wrong byte errs by the size of an entry.
    expected_w = (gq.double().t() @ xq.double()).float()
    tight = 1e-4 if device == "cpu" else 3e-3 * float(expected_w.abs().max())
    torch.testing.assert_close(layer.weight.grad, expected_w, rtol=1e-2 if device != "cpu" else 1e-4, atol=tight)
    assert layer.weight.grad.dtype == layer.weight.dtype
    if bias:  # the bias gradient is exact: the output gradient's sums, not an FP8 product
        torch.testing.assert_close(layer.bias.grad, g_cast.float().sum(0), rtol=1e-5, atol=1e-5)


def test_a_converted_block_trains_like_the_full_precision_one():
    torch.manual_seed(1)
    ref = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
    fp8 = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
    fp8.load_state_dict(ref.state_dict())
    assert convert_to_float8_linear(fp8, lambda m, name: True) == ["0", "2"]
    assert fp8.state_dict().keys() == ref.state_dict().keys()
    x = torch.randn(3, 41, 64)
    outs = []
    for model in (ref, fp8):
        xi = x.clone().requires_grad_()
        y = model(xi)
        y.float().square().mean().backward()
        outs.append((y.float(), xi.grad.float(), [p.grad for p in model.parameters()]))
    rel = lambda a, b: ((a - b).norm() / b.norm()).item()  # noqa: E731
    assert outs[1][0].shape == (3, 41, 64)
    assert rel(outs[1][0], outs[0][0]) < 0.08
    assert rel(outs[1][1], outs[0][1]) < 0.15
    for got, want in zip(outs[1][2], outs[0][2]):
        assert rel(got, want) < 0.15


def test_output_dtype_follows_autocast_and_empty_inputs_pass():
    layer = _layer()
    x = torch.randn(7, 64)
    full = layer(x)
    assert full.dtype == torch.float32  # as nn.Linear, outside autocast
    with torch.autocast("cpu", dtype=torch.bfloat16):
        half = layer(x)
        assert half.dtype == torch.bfloat16
        torch.testing.assert_close(half.float(), full, rtol=2e-2, atol=2e-2)  # the same FP8 product, rounded
        empty = torch.zeros(0, 3, 64, requires_grad=True)
        out = layer(empty)
    assert out.shape == (0, 3, 48) and out.dtype == torch.bfloat16
    out.sum().backward()
    assert empty.grad.shape == empty.shape and not layer.weight.grad.any()


def test_autocast_rounds_an_fp32_input_to_its_dtype_before_the_fp8_cast(monkeypatch):
    """An fp32 activation under bf16 autocast (a LayerNorm's output) reaches the FP8 cast as bf16, as it reaches an
    nn.Linear's product: half the bytes to read, and the cast's fused transposed copy (16-bit tiles only on the
    H200) instead of a separate transpose; the fp32 weight is cast as it is."""
    import gem_ops.train.fp8_linear as fp8_linear

    seen = []

    def recording_cast(t, dtype, **kwargs):
        seen.append(t.dtype)
        return cast_to_fp8(t, dtype, **kwargs)

    monkeypatch.setattr(fp8_linear, "cast_to_fp8", recording_cast)
    layer = _layer()
    x = torch.randn(9, 64, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(x)
    out.float().sum().backward()
    assert seen == [torch.bfloat16, torch.float32, torch.bfloat16]  # input, weight, output gradient
    assert x.grad.dtype == torch.float32
    seen.clear()
    layer(x)  # outside autocast the input keeps its dtype
    assert seen == [torch.float32, torch.float32]


def test_frozen_weights_and_inference_skip_the_gradient_layouts():
    layer = _layer()
    layer.weight.requires_grad_(False)
    x = torch.randn(20, 64, requires_grad=True)
    layer(x).sum().backward()
    assert x.grad is not None and layer.weight.grad is None and layer.bias.grad is not None
    with torch.no_grad():
        assert layer(torch.randn(5, 64)).shape == (5, 48)


def test_compiled_matches_eager_with_changing_row_counts():
    layer = _layer()
    compiled = torch.compile(layer, dynamic=True)
    for rows in (19, 64, 131):
        x = torch.randn(rows, 64)
        grads = []
        for run in (layer, compiled):
            xi = x.clone().requires_grad_()
            layer.zero_grad(set_to_none=True)
            run(xi).float().sum().backward()
            grads.append((xi.grad, layer.weight.grad.clone()))
        torch.testing.assert_close(grads[1][0], grads[0][0])
        torch.testing.assert_close(grads[1][1], grads[0][1])


def test_recipe_converts_the_models_fp8_layers_and_trains_on_cpu():
    from gem_ops.model.config import model_config
    from gem_ops.model.features import model_input
    from gem_ops.train.model_state import seeded_model
    from tests.model_inputs import SPEC, random_batch

    # Small: FP8 products are emulated slowly on a CPU (seconds for a few hundred rows on some).
    config = model_config("gem_gpu", depth=0.25, width=0.125, **{"embedding.item_buckets": 1024,
                                                                 "embedding.user_buckets": 1024})
    model = seeded_model(SPEC, config)
    keys, expected = set(model.state_dict()), fp8_layer_names(model)
    assert convert_to_fp8(model, "tensorwise_triton") == expected and expected
    assert [n for n, m in model.named_modules() if isinstance(m, Float8TrainingLinear)] == expected
    assert set(model.state_dict()) == keys
    x = model_input(random_batch([0, 1, 9, 3]), SPEC, config)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model.loss(x)[0]
    loss.backward()
    assert torch.isfinite(loss)
    grads = [dict(model.named_modules())[n].weight.grad for n in expected]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
