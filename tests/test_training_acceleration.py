"""Training speed settings on CPU: which layers FP8 takes (the GPU preset's large linear layers, not the
first and last ones), a clear error where FP8 cannot run, FP8 emulated end to end, activation
checkpointing giving the same gradients, and the batch prefetcher keeping order."""

import functools
import re
import time

import pytest
import torch
from torch import nn

from gem_ops.model.config import model_config
from gem_ops.model.features import model_input
from gem_ops.train.acceleration import (
    checkpoint_sequence_layers,
    compile_dense_blocks,
    compile_model_step,
    FP8_LAYERS,
    convert_to_fp8,
    fp8_layer_names,
    fp8_module_filter,
    prepare_for_training,
)
from gem_ops.train.config import TrainConfig
from gem_ops.train.model_state import seeded_model
from gem_ops.train.prefetch import prefetched
from tests.model_inputs import SPEC, random_batch

SMALL_TABLES = {"embedding.item_buckets": 1024, "embedding.user_buckets": 1024}
# The GPU preset at a quarter of its width: sequence width 512 (8 heads), Wukong MLP 1024 wide.
GPU_SMALL = model_config("gem_gpu", width=0.25, **SMALL_TABLES)


def test_fp8_takes_the_large_dense_layers_and_leaves_first_and_last_in_bf16():
    model = seeded_model(SPEC, GPU_SMALL)
    names = set(fp8_layer_names(model))
    branches, blocks = len(GPU_SMALL.sequence.branches), GPU_SMALL.blocks
    expected = {f"branches.{b}.layers.{k}.{layer}" for b in range(branches) for k in range(blocks)
                for layer in ("qkv", "proj", "ffn.0", "ffn.2")}
    expected |= {f"branches.{b}.cross.{k}.kv" for b in range(branches) for k in range(blocks)}
    assert names == expected
    # Kept in bf16: input projections, summary / CLS / cross query and output projections, the Wukong
    # MLPs (one row per example), trunk, towers.
    for name, module in model.named_modules():
        if re.search(r"candidate_proj|dense_proj|summarize|cls_out|cross\.\d+\.(q|out)$|fmb\.mlp|trunk", name):
            assert not fp8_module_filter(module, name), name
    # Widths FP8 cannot take (not multiples of 16) or too small to gain are left out.
    assert not fp8_module_filter(nn.Linear(136, 120), "branches.0.layers.0.qkv")
    assert not fp8_module_filter(nn.Linear(64, 64), "branches.0.layers.0.qkv")


def test_fp8_on_cpu_is_a_clear_error():
    model = seeded_model(SPEC, GPU_SMALL)
    with pytest.raises(ValueError, match="FP8 tensor cores.*cpu"):
        prepare_for_training(model, TrainConfig(precision="fp8"), "cpu")
    with pytest.raises(ValueError, match="precision"):
        TrainConfig(precision="fp16")


def test_emulated_fp8_trains_with_the_same_state_dict_keys():
    model = seeded_model(SPEC, GPU_SMALL)
    keys = set(model.state_dict())
    names = convert_to_fp8(model, "rowwise", emulate=True)
    assert len(names) == 2 * 4 * 5
    modules = dict(model.named_modules())
    assert all(type(modules[n]).__name__ == "Float8Linear" for n in names)
    assert type(modules["trunk.0"]) is nn.Linear
    assert set(model.state_dict()) == keys  # checkpoints load either way
    x = model_input(random_batch([0, 1, 20, 300, 7]), SPEC, GPU_SMALL)
    loss, _, _ = model.loss(x)  # fp32 around the FP8 products
    loss.backward()
    assert torch.isfinite(loss)
    assert modules[names[0]].weight.grad is not None and torch.isfinite(modules[names[0]].weight.grad).all()


def test_bf16_autocast_keeps_the_sequence_stream_in_bf16():
    """Under mixed precision the history tokens between sequence layers are bf16 (half the bytes in
    every jagged gather and residual add); the loss stays close to fp32's, on CPU too."""
    from gem_ops.model.sequence import JaggedTransformerLayer

    config = model_config("gem", width=0.5, blocks=2, **SMALL_TABLES)
    model = seeded_model(SPEC, config)
    x = model_input(random_batch([0, 1, 40, 9, 70]), SPEC, config)
    fp32_loss = model.loss(x)[0].detach()
    seen = []
    handle = nn.modules.module.register_module_forward_pre_hook(
        lambda module, args: seen.append(args[0].dtype) if isinstance(module, JaggedTransformerLayer) else None)
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model.loss(x)[0]
    finally:
        handle.remove()
    loss.backward()
    assert seen and set(seen) == {torch.bfloat16}
    torch.testing.assert_close(loss.detach(), fp32_loss, rtol=2e-2, atol=0)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_fp8_recipes_set_the_accumulation_of_each_product():
    from gem_ops.train.acceleration import fp8_linear_config

    fast = lambda config: [getattr(config, f"gemm_config_{g}").use_fast_accum  # noqa: E731
                           for g in ("output", "grad_input", "grad_weight")]
    assert fast(fp8_linear_config("tensorwise")) == [True, False, False]
    assert fast(fp8_linear_config("tensorwise_fast_accum")) == [True, True, True]
    assert fp8_linear_config("rowwise").cast_config_input.scaling_granularity.value == "axiswise"
    with pytest.raises(ValueError, match="fp8 recipe must be one of"):
        fp8_linear_config("blockwise")
    model = seeded_model(SPEC, GPU_SMALL)
    names = convert_to_fp8(model, "tensorwise_fast_accum", emulate=True)
    loss, _, _ = model.loss(model_input(random_batch([0, 3, 20]), SPEC, GPU_SMALL))
    loss.backward()
    assert torch.isfinite(loss) and dict(model.named_modules())[names[0]].weight.grad is not None


def test_activation_checkpointing_gives_the_same_gradients():
    config = model_config("gem", width=0.5, blocks=2, **SMALL_TABLES)
    x = model_input(random_batch([0, 1, 40, 9, 70]), SPEC, config)
    grads = []
    for checkpointed in (False, True):
        model = seeded_model(SPEC, config)
        if checkpointed:
            assert len(checkpoint_sequence_layers(model)) == len(config.sequence.branches) * config.blocks
        loss, _, _ = model.loss(x)
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-5, atol=1e-6, msg=name)


def test_prefetched_keeps_order_and_loads_ahead():
    started = []

    def load(step):
        started.append(step)
        time.sleep(0.01)
        return step * 10

    seen = []
    for step, value in prefetched(load, range(5), depth=1):
        assert value == step * 10
        time.sleep(0.02)
        seen.append((step, max(started)))
    assert [s for s, _ in seen] == list(range(5))
    assert all(ahead == min(step + 1, 4) for step, ahead in seen)  # the next step was already loading
    assert list(prefetched(lambda s: s, range(3), depth=0)) == [(0, 0), (1, 1), (2, 2)]


@pytest.mark.slow
def test_compiled_dense_blocks_match_eager():
    """Whole sequence layers compile around the opaque attention, on batches of changing length."""
    def compile_blocks(model):
        names = compile_dense_blocks(model)
        assert {"trunk", "interaction.0", "branches.0.layers.0", "branches.0.cross.0"} <= set(names)

    _compiled_against_eager(model_config("vertical", **SMALL_TABLES), compile_blocks,
                            ([3, 1, 12, 0], [7, 0, 2, 30, 5], [1, 1, 40, 9]))


def _compiled_against_eager(config, compile_step, batches, prepare=lambda model: None, size_bucket=0.0) -> None:
    """Loss and every gradient of a compiled model against eager, on batches of changing lengths (their level
    sizes counted on the host, as the engine's batches come; bucketed with `size_bucket`); `prepare` changes both
    models first."""
    eager, compiled = seeded_model(SPEC, config), seeded_model(SPEC, config)
    prepare(eager)
    prepare(compiled)
    compile_step(compiled)
    for seed, lengths in enumerate(batches):
        x = model_input(random_batch(lengths, seed), SPEC, config, with_level_sizes=True, size_bucket=size_bucket)
        losses = [model.loss(x)[0] for model in (eager, compiled)]
        torch.testing.assert_close(losses[1], losses[0], rtol=1e-4, atol=1e-5)
        for model, loss in zip((eager, compiled), losses):
            model.zero_grad()
            loss.backward()
        for (name, p_eager), p_compiled in zip(eager.named_parameters(), compiled.parameters()):
            assert (p_eager.grad is None) == (p_compiled.grad is None), name
            if p_eager.grad is not None:
                torch.testing.assert_close(p_compiled.grad, p_eager.grad, rtol=1e-3, atol=1e-5, msg=name)


# First a warm-up-like batch: 4 examples (as many as the pooled tokens), one engaged event in the second branch.
STEP_BATCHES = ([1, 0, 2, 1], [3, 1, 12, 0, 70], [7, 0, 2, 30, 5, 9], [1, 1, 40, 9, 2, 3, 64], [40] * 12)


def test_gems_step_after_the_lookups_traces_as_one_graph_for_every_batch():
    """compile="model": everything after the embedding lookups, the jagged attention (a custom op) and the
    pyramid's bookkeeping included, is one graph (fullgraph: a break would raise), and the first batch's graph
    serves every later one: no size of it specialised (a recompile costs minutes at the GPU preset)."""
    _one_graph_for_every_batch("aot_eager")


def test_gems_step_on_bucketed_sizes_is_the_same_one_graph_for_every_batch():
    """With TrainConfig.size_bucket's padded inputs (capacities, rows past the last example's): still one graph, no
    break, no recompile, and eager's loss and gradients."""
    _one_graph_for_every_batch("aot_eager", size_bucket=1.3)


@pytest.mark.slow
def test_inductors_compiled_step_matches_eager_in_one_graph_for_every_batch():
    """The same through Inductor's code for the whole step, on CPU: its lowering must not specialise either (a
    level of 1 token, the batch size through a saved activation's stride)."""
    _one_graph_for_every_batch("inductor")


def _fp8_layers(model: nn.Module) -> None:
    """FP8 (tensorwise_triton) in every layer FP8 takes at the GPU preset's widths; these models' are smaller."""
    names = convert_to_fp8(model, "tensorwise_triton", module_filter=lambda module, name: (
        isinstance(module, nn.Linear) and FP8_LAYERS.match(name) is not None
        and module.in_features % 16 == 0 and module.out_features % 16 == 0))
    assert len(names) == 2 * 2 * 5, names


def test_fp8_step_traces_as_one_graph_for_every_batch():
    """compile="model" with precision="fp8": the FP8 layers' casts and weight gradients are custom ops and their
    products torch._scaled_mm (which runs on the CPU too), so the step with FP8 layers is the same one graph and
    gives eager FP8's loss and gradients."""
    _one_graph_for_every_batch("aot_eager", _fp8_layers)


@pytest.mark.parametrize("device", [
    pytest.param("cpu", marks=pytest.mark.slow),
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA")]),
])
def test_inductors_fp8_step_is_one_graph_as_close_to_fp32_as_eager_fp8(device):
    """The FP8 step through Inductor: one graph for every batch (the input's transposed FP8 copy is saved flat;
    saved as a 2-D tensor its batch-dependent strides were fixed to the first batch's and the second batch failed
    Inductor's stride check), its loss eager FP8's, and its gradients as close to the fp32 model's as eager FP8's
    (Inductor's fused arithmetic moves values across FP8's rounding steps, so not equal to eager FP8's)."""
    import torch._dynamo.testing

    config = model_config("gem", width=0.5, blocks=2, **SMALL_TABLES)
    reference, eager, compiled = (seeded_model(SPEC, config).to(device) for _ in range(3))
    _fp8_layers(eager)
    _fp8_layers(compiled)
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    compile_model_step(compiled, backend=counter, fullgraph=True)
    frames = []
    for seed, lengths in enumerate(STEP_BATCHES):
        x = model_input(random_batch(lengths, seed), SPEC, config, with_level_sizes=True).to(device)
        losses, gradients = [], []
        for model in (reference, eager, compiled):
            model.zero_grad()
            loss = model.loss(x)[0]
            loss.backward()
            losses.append(loss.detach())
            gradients.append(torch.cat([torch.zeros_like(p).flatten() if p.grad is None else p.grad.flatten()
                                        for p in model.parameters()]))
        frames.append(counter.frame_count)
        torch.testing.assert_close(losses[2], losses[1], rtol=1e-3, atol=1e-5)
        error = [((g - gradients[0]).norm() / gradients[0].norm()).item() for g in gradients[1:]]
        assert error[1] <= 1.5 * error[0] + 0.01, f"batch {seed}: gradient error against fp32 {error[1]:.3f} " \
                                                  f"compiled, {error[0]:.3f} eager"
    assert len(set(frames)) == 1, f"recompiled: frames after each batch {frames}"


def _one_graph_for_every_batch(backend: str, prepare=lambda model: None, size_bucket=0.0) -> None:
    import torch._dynamo.testing

    counter = torch._dynamo.testing.CompileCounterWithBackend(backend)
    frames = []  # compiled frames after each batch

    def compile_step(model):
        compile_model_step(model, backend=counter, fullgraph=True)
        step = model.dense_loss_sums
        model.dense_loss_sums = lambda *args: (step(*args), frames.append(counter.frame_count))[0]

    _compiled_against_eager(model_config("gem", width=0.5, blocks=2, **SMALL_TABLES), compile_step, STEP_BATCHES,
                            prepare, size_bucket)
    assert len(frames) == len(STEP_BATCHES) and len(set(frames)) == 1, f"recompiled: frames after each batch {frames}"


@pytest.mark.slow
def test_a_second_compile_of_the_step_loads_aotautograds_cached_graphs(tmp_path, monkeypatch):
    """A new process (here: after dynamo's reset) loads the step's traced forward and backward from
    AOTAutograd's cache instead of tracing and partitioning them again; the step holds take_rows, a
    torch.autograd.Function, which the cache refuses unless told otherwise."""
    from torch._dynamo.utils import counters

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    config = model_config("gem", width=0.5, blocks=1, **SMALL_TABLES)
    x = model_input(random_batch([3, 1, 12, 0, 70], 0), SPEC, config, with_level_sizes=True)
    losses = []
    for _ in range(2):
        torch._dynamo.reset()
        counters.clear()
        model = seeded_model(SPEC, config)
        compile_model_step(model)
        losses.append(model.loss(x)[0].detach())
    assert counters["aot_autograd"]["autograd_cache_bypass"] == 0, dict(counters["aot_autograd"])
    assert counters["aot_autograd"]["autograd_cache_hit"] >= 1, dict(counters["aot_autograd"])
    torch.testing.assert_close(losses[1], losses[0])


def test_compile_model_wraps_gems_step():
    model = seeded_model(SPEC, model_config("gem", width=0.5, blocks=2, **SMALL_TABLES))
    applied = prepare_for_training(model, TrainConfig(compile="model"), "cpu")
    assert applied["compile"] == ["dense_loss_sums", "embeddings.history_tokens"]
    assert isinstance(model.dense_loss_sums, functools.partial)
    assert isinstance(model.embeddings.history_tokens, functools.partial)


def test_compiled_history_tokens_match_eager_and_give_every_part_one_gradient():
    """The sum of each event's embeddings, its norm and the cast to the autocast dtype, compiled as one graph: the
    eager result and gradients, and the parts' gradients one tensor (no copy per part)."""
    config = model_config("gem", width=0.5, blocks=1, **SMALL_TABLES)
    model = seeded_model(SPEC, config)
    eager = model.embeddings.history_tokens
    compile_model_step(model)
    g = torch.Generator().manual_seed(0)
    parts = [torch.randn(37, config.embedding.sequence_dim, generator=g) for _ in model.embeddings.history_keys]
    d_out = torch.randn(37, config.embedding.sequence_dim, generator=g)
    results = []
    for tokens in (eager, model.embeddings.history_tokens):
        # Not leaves, as lookups are not: what reaches each part (a leaf's gradient is a copy of its own)
        inputs = [p.clone().requires_grad_().clone() for p in parts]
        grads = []
        for x in inputs:
            x.register_hook(grads.append)
        with torch.autocast("cpu", torch.bfloat16):
            out = tokens(*inputs)
        assert out.dtype == torch.bfloat16
        out.backward(d_out.to(out.dtype))
        results.append((out.float(), grads))
    (want, want_grads), (got, got_grads) = results
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-3)
    assert len(got_grads) == len(parts) and len({grad.data_ptr() for grad in got_grads}) == 1


def test_compile_model_names_the_setting_for_a_model_without_a_step():
    with pytest.raises(ValueError, match="compile='model'"):
        prepare_for_training(nn.Linear(4, 4), TrainConfig(compile="model"), "cpu")


def test_a_step_replayed_from_cuda_graphs_shares_no_tile_table_between_calls():
    """CUDA graph trees refuse an allocation that outlives a graph's warm-up run, as a cached tile table would."""
    from kernels.triton import triton_tile_table

    config = model_config("gem", width=0.25, blocks=1)
    try:
        compile_model_step(seeded_model(SPEC, config), backend="eager", cuda_graphs=False)
        assert triton_tile_table.tile_cache.enabled
        compile_model_step(seeded_model(SPEC, config), backend="eager", cuda_graphs=True)
        assert not triton_tile_table.tile_cache.enabled
    finally:
        triton_tile_table.tile_cache.enabled = True


def test_a_run_under_cuda_graphs_counts_the_graphs_inductor_ran_without_them_and_why():
    """gem_ops.train.cuda_graph_skips: Inductor's own counter and the reasons its cudagraphs log gives, each once,
    for the steps inside the context only."""
    from torch._inductor.cudagraph_utils import log_cudagraph_skip_and_bump_counter

    from gem_ops.train.cuda_graph_skips import CudaGraphSkips

    log_cudagraph_skip_and_bump_counter("skipping cudagraphs due to an earlier run")  # before: not this run's
    with CudaGraphSkips() as skips:
        assert skips.count == 0 and skips.summary() == "CUDA graphs: every graph of the compiled step was recorded"
        for _ in range(2):
            log_cudagraph_skip_and_bump_counter("skipping cudagraphs due to mutated inputs (1 instances)")
        compiled = torch.compile(lambda x: (2 * x).sin(), mode="reduce-overhead")  # on the CPU: no graph, no reason
        compiled(torch.randn(8, requires_grad=True)).sum().backward()
    after = skips.count
    log_cudagraph_skip_and_bump_counter("skipping cudagraphs due to a later run")
    assert skips.count == after >= 3
    assert skips.reasons == ["skipping cudagraphs due to mutated inputs (1 instances)"]
    assert skips.summary() == (f"CUDA graphs: {after} of the compiled step's graphs ran without them: "
                               "skipping cudagraphs due to mutated inputs (1 instances)")


def test_cuda_graphs_without_the_compiled_step_names_the_setting():
    with pytest.raises(ValueError, match=r"TrainConfig.cuda_graphs .* needs compile='model', got compile='dense'"):
        TrainConfig(compile="dense", cuda_graphs=True)
    assert TrainConfig(compile="model", cuda_graphs=True).cuda_graphs


def test_compile_options_read_as_inductor_settings_and_name_a_bad_one():
    from gem_ops.train.config import compile_option_values

    assert compile_option_values("cpp_wrapper=true, combo_kernels=1,max_autotune_gemm_backends=ATEN") == {
        "cpp_wrapper": True, "combo_kernels": 1, "max_autotune_gemm_backends": "ATEN"}
    assert TrainConfig(compile="model", compile_options="triton.cudagraph_trees=false").compile_options
    with pytest.raises(ValueError, match=r"compile_options: 'cpp_wraper' is not an Inductor setting"):
        TrainConfig(compile="model", compile_options="cpp_wraper=true")
    with pytest.raises(ValueError, match="NAME=VALUE"):
        TrainConfig(compile="dense", compile_options="cpp_wrapper")
    with pytest.raises(ValueError, match="need compile='dense' or 'model', got compile='none'"):
        TrainConfig(compile_options="cpp_wrapper=true")


def test_compile_options_reach_inductor():
    """cpp_wrapper=true: the compiled block's wrapper is C++ (Inductor's generated code says so); without it the
    wrapper is Python."""
    from torch._inductor.utils import run_and_get_code

    def wrapper_code(options):
        torch._dynamo.reset()
        model = nn.Module()
        model.trunk = nn.Sequential(nn.Linear(8, 8), nn.GELU())
        prepare_for_training(model, TrainConfig(compile="dense", compile_options=options), "cpu")
        return run_and_get_code(model.trunk, torch.randn(4, 8))[1][0]

    assert "CppWrapperCodeCache" in wrapper_code("cpp_wrapper=true")
    assert "CppWrapperCodeCache" not in wrapper_code("")


def test_cuda_graphs_join_inductors_options_as_its_cudagraphs_setting():
    """torch.compile takes a mode or options, not both: with options, CUDA graphs are the setting that
    "reduce-overhead" stands for."""
    from gem_ops.train.acceleration import _compile_settings

    assert _compile_settings("inductor", True, {}) == {"mode": "reduce-overhead"}
    assert _compile_settings("inductor", True, {"cpp_wrapper": True}) == {
        "options": {"cpp_wrapper": True, "triton.cudagraphs": True}}
    assert _compile_settings("inductor", False, {"cpp_wrapper": True}) == {"options": {"cpp_wrapper": True}}
    assert _compile_settings("eager", False, {"cpp_wrapper": True}) == {"mode": None}


@pytest.mark.slow
def test_checkpointed_compiled_layers_give_eager_gradients():
    """prepare_for_training compiles first, then checkpoints: a checkpointed layer recomputes its
    compiled forward."""
    config = model_config("gem", width=0.5, blocks=2, **SMALL_TABLES)
    x = model_input(random_batch([0, 1, 40, 9, 70]), SPEC, config)
    grads = []
    for settings in ({}, {"compile": "dense", "activation_checkpointing": "sequence"}):
        model = seeded_model(SPEC, config)
        applied = prepare_for_training(model, TrainConfig(**settings), "cpu")
        assert len(applied.get("activation_checkpointing", [])) == (len(config.sequence.branches) * config.blocks
                                                                    if settings else 0)
        model.loss(x)[0].backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-3, atol=1e-5, msg=name)


@pytest.mark.gpu
@pytest.mark.parametrize("compile_setting", ["dense", "model"])
def test_fp8_training_twice_against_one_inductor_cache_keeps_finite_gradients(tmp_path, compile_setting):
    """The second process loads the first one's compiled FP8 graphs from Inductor's caches and must train as it
    did: with the cast kernel's faulty transposed fp32 copies (fixed in kernels/fp8_cast.py), warm caches gave NaN
    gradients at the first step."""
    import json
    import os
    import subprocess
    import sys

    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    runs = []
    for _ in range(2):
        done = subprocess.run([sys.executable, "-m", "tests.fp8_compiled_steps", compile_setting], env=env,
                              capture_output=True, text=True, timeout=280,
                              cwd=os.path.dirname(os.path.dirname(__file__)))
        assert done.returncode == 0, done.stderr[-4000:]
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    assert all(run["finite"] for run in runs), runs
    assert runs[1]["losses"] == pytest.approx(runs[0]["losses"], rel=1e-2)
