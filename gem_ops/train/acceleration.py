"""Training speed settings (TrainConfig): the autocast dtype of a step, and what is applied to a built
model: FP8 for the large linear layers
(fp8_linear.py's layer, or torchao float8), torch.compile of the dense blocks, activation
checkpointing of the sequence layers.

Applied before sharding: FP8 swaps nn.Linear for an FP8 linear (same parameters, same state_dict
keys), then compilation and checkpointing replace the instance's `forward` (module hooks, FSDP2's and
the profiler scopes' alike, stay outside the compiled code).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import re
from collections.abc import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from gem_ops.train.config import compile_option_values

# torchao's recipes, and tensorwise_triton: tensorwise scaling with this project's casts (fp8_linear.py).
FP8_RECIPES = ("tensorwise", "tensorwise_fast_accum", "rowwise", "tensorwise_triton")
TORCHAO_RECIPES = FP8_RECIPES[:3]
FP8_MIN_FEATURES = 128  # smaller layers gain nothing from FP8 and lose precision
# The large products of the dense blocks, whose rows are history tokens (hundreds of thousands a
# step): the sequence layers' projections and FFN and the cross attention's key/value projection.
# Everything else stays in bf16: the input projections (first layers), the summary and CLS
# projections, the cross attention's few query rows, the Wukong MLPs (one row per example: too few
# for FP8's scaling to pay, 0.78x forward on the H200 at 1024 rows), the trunk and the towers (last
# layers), embeddings and norms.
FP8_LAYERS = re.compile(
    r"^(branches\.\d+\.layers\.\d+\.(qkv|proj|ffn\.0|ffn\.2)"
    r"|branches\.\d+\.cross\.\d+\.kv)$"
)


def autocast_context(device: torch.device, precision: str):
    """bf16 autocast for precision bf16 and fp8 (its other layers), and for auto on CUDA; else none."""
    use_bf16 = precision in ("bf16", "fp8") or (precision == "auto" and device.type == "cuda")
    return torch.autocast(device.type, dtype=torch.bfloat16) if use_bf16 else contextlib.nullcontext()


def fp8_module_filter(module: nn.Module, fqn: str) -> bool:
    """Whether torchao converts this layer to FP8: a large Linear of the dense blocks whose widths
    are multiples of 16 (torch._scaled_mm's requirement)."""
    return (isinstance(module, nn.Linear) and FP8_LAYERS.match(fqn) is not None
            and module.in_features % 16 == 0 and module.out_features % 16 == 0
            and min(module.in_features, module.out_features) >= FP8_MIN_FEATURES)


def fp8_layer_names(model: nn.Module) -> list[str]:
    return [name for name, module in model.named_modules() if fp8_module_filter(module, name)]


def check_fp8_device(device: torch.device) -> None:
    if device.type != "cuda":
        raise ValueError(f"precision='fp8' trains on FP8 tensor cores, which a {device.type} device does not have: "
                         "use a CUDA GPU of compute capability 8.9 or more (H100, H200, L4, ...), or precision "
                         "'bf16' / 'fp32' here")
    capability = torch.cuda.get_device_capability(device)
    if capability < (8, 9):
        raise ValueError(f"precision='fp8' needs FP8 tensor cores (compute capability >= 8.9); "
                         f"{torch.cuda.get_device_name(device)} has {capability[0]}.{capability[1]}: use 'bf16'")


def fp8_linear_config(recipe: str = "tensorwise", *, emulate: bool = False):
    """torchao's Float8LinearConfig for a recipe of FP8_RECIPES (dynamic scaling). torchao accumulates
    the forward product in the tensor cores' fast mode and the two gradient products in the precise
    one; tensorwise_fast_accum takes the fast mode for all three (faster backward, coarser sums)."""
    if recipe not in TORCHAO_RECIPES:
        raise ValueError(f"torchao fp8 recipe must be one of {TORCHAO_RECIPES}, got {recipe!r}")
    try:
        from torchao.float8 import Float8LinearConfig
        from torchao.float8.config import Float8GemmConfig
    except ImportError as error:
        raise ImportError("precision='fp8' needs torchao (pip install torchao)") from error
    config = Float8LinearConfig.from_recipe_name("rowwise" if recipe == "rowwise" else "tensorwise")
    if recipe == "tensorwise_fast_accum":
        fast = Float8GemmConfig(use_fast_accum=True)
        config = dataclasses.replace(config, gemm_config_grad_input=fast, gemm_config_grad_weight=fast)
    # Token counts are whatever the batch holds: the weight gradient's inner dimension is padded to the
    # multiple of 16 that torch._scaled_mm needs.
    return dataclasses.replace(config, emulate=emulate, pad_inner_dim=True)


def convert_to_fp8(model: nn.Module, recipe: str = "tensorwise_triton", *, emulate: bool = False,
                   module_filter: Callable[[nn.Module, str], bool] = fp8_module_filter) -> list[str]:
    """Swaps the layers module_filter picks for FP8 ones: torchao's Float8Linear, or with
    "tensorwise_triton" fp8_linear.Float8TrainingLinear. `emulate` computes torchao's recipes in high
    precision (tests on CPU; tensorwise_triton runs on CPU as it is). Returns their names."""
    if recipe not in FP8_RECIPES:
        raise ValueError(f"fp8 recipe must be one of {FP8_RECIPES}, got {recipe!r}")
    if recipe == "tensorwise_triton":
        from gem_ops.train.fp8_linear import convert_to_float8_linear

        return convert_to_float8_linear(model, module_filter)
    config = fp8_linear_config(recipe, emulate=emulate)
    names = [name for name, module in model.named_modules() if module_filter(module, name)]
    if names:
        from torchao.float8 import convert_to_float8_training

        convert_to_float8_training(model, config=config, module_filter_fn=module_filter)
    return names


def dense_blocks(model: nn.Module) -> dict[str, nn.Module]:
    """The blocks that torch.compile takes one by one: each Wukong layer, the trunk and towers, each
    jagged transformer layer and each cross attention whole. The jagged attention inside the last two
    enters their graphs as a custom op (kernels/jagged_attention_op.py), no graph break; the norms,
    projections, FFN and residual adds around it fuse with their dtype casts."""
    pattern = re.compile(r"interaction\.\d+|trunk|towers|distillation_towers|branches\.\d+\.(layers|cross)\.\d+")
    return {name: module for name, module in model.named_modules() if pattern.fullmatch(name)}


def compile_dense_blocks(model: nn.Module, options: dict | None = None) -> list[str]:
    """torch.compile of each dense block's forward (dynamic in the token dimension after the first
    recompile, as Inductor's automatic dynamic shapes do); `options`: Inductor settings."""
    blocks = dense_blocks(model)
    # Blocks share forward code objects (every layer of a kind): each block gets its own graphs, static
    # then dynamic.
    _allow_recompiles(max(64, 8 * len(blocks)))
    for module in blocks.values():
        module.forward = torch.compile(module.forward, **_compile_settings("inductor", False, options))
    return list(blocks)


def _compile_settings(backend, cuda_graphs: bool, options: dict | None) -> dict:
    """torch.compile's mode or options (it takes one of the two): CUDA graphs are Inductor's "reduce-overhead" mode,
    which is its triton.cudagraphs setting among other options. Options reach Inductor alone."""
    if not options or backend != "inductor":
        return {"mode": "reduce-overhead" if cuda_graphs else None}
    return {"options": {**options, **({"triton.cudagraphs": True} if cuda_graphs else {})}}


def compile_model_step(model: nn.Module, backend: str | Callable = "inductor", fullgraph: bool = False,
                       cuda_graphs: bool = False, options: dict | None = None) -> list[str]:
    """torch.compile of everything in a training step's forward after the embedding lookups
    (GEMModel.dense_loss_sums), as one graph: the jagged attention enters it as a custom op, the jagged
    bookkeeping fuses with the layers around it, and its backward compiles too. Sizes are dynamic from the
    first compile (a batch's size, token counts and the pyramid's level sizes change every step).
    `cuda_graphs`: forward and backward replayed from CUDA graphs (mode "reduce-overhead"), recorded per set of
    sizes; the caller marks each training step's start (torch.compiler.cudagraph_mark_step_begin). `options`:
    Inductor settings."""
    settings = _compile_settings(backend, cuda_graphs, options)
    if not hasattr(model, "dense_loss_sums"):
        raise ValueError(f"TrainConfig.compile='model' compiles GEM's step; {type(model).__name__} has none: "
                         "use compile='dense' or 'none'")
    if cuda_graphs:
        from kernels.triton.triton_jagged_attention import cache_tile_tables

        cache_tile_tables(False)
    # Should a size still specialise (on the CPU, Inductor's C++ code guards on size bands), each variant gets
    # its graph rather than the step falling back to eager past Dynamo's default limit of 8.
    _allow_recompiles(64)
    _cache_custom_autograd_functions()
    compiled = torch.compile(model.dense_loss_sums, dynamic=True, backend=backend, fullgraph=fullgraph, **settings)
    model.dense_loss_sums = functools.partial(_size_oblivious, compiled)
    # The history tokens' sum and norm run inside the embeddings' forward (an FSDP2 unit of its own on some
    # paths, so not within the step's graph): a graph of their own, one kernel for the sum, norm and cast.
    embeddings = model.embeddings
    tokens = torch.compile(embeddings.history_tokens, dynamic=True, backend=backend, fullgraph=True, **settings)
    embeddings.history_tokens = functools.partial(_size_oblivious, tokens)
    return ["dense_loss_sums", "embeddings.history_tokens"]


def _cache_custom_autograd_functions() -> None:
    """Lets AOTAutograd's cache keep graphs that hold a torch.autograd.Function (take_rows, the FP8 linear
    layers): by default it refuses them, and every new process traced and partitioned the whole step's forward
    and backward again (benchmarks/compile_warm_start.py). The traced Function's forward and backward are part
    of the graph the cache key hashes; ours keep no state outside their inputs."""
    import torch._functorch.config as functorch_config

    functorch_config.autograd_cache_allow_custom_autograd_functions = True


def _allow_recompiles(limit: int) -> None:
    import torch._dynamo.config as dynamo_config

    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(dynamo_config, name):
            setattr(dynamo_config, name, max(getattr(dynamo_config, name), limit))


def _size_oblivious(compiled: Callable, *args, **kwargs):
    """Traced with sizes of 0 and 1 unspecialised, no guards from the first batch's sizes (a warm-up batch with
    one engaged event, a fusion decided on a size hint) and no size taken for another that happened to equal it
    (duck sizing: a warm-up batch of 4 examples got the symbol of the 4 pooled tokens, and then a static batch
    size): one graph for every later batch, not a recompile (minutes at the GPU preset) whenever a size crosses
    such a line."""
    import torch.fx.experimental._config as fx_config

    with fx_config.patch(backed_size_oblivious=True, use_duck_shape=False):
        return compiled(*args, **kwargs)


def sequence_layers(model: nn.Module) -> dict[str, nn.Module]:
    return {name: m for name, m in model.named_modules() if re.fullmatch(r"branches\.\d+\.layers\.\d+", name)}


def checkpoint_sequence_layers(model: nn.Module) -> list[str]:
    """Activation checkpointing of each jagged transformer layer: its activations (all history tokens
    x several widths) are recomputed in the backward instead of kept, for about 1/3 more compute."""
    layers = sequence_layers(model)
    for module in layers.values():
        module.forward = functools.partial(_checkpointed, module.forward)
    return list(layers)


def _checkpointed(forward: Callable, *args, **kwargs):
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def prepare_for_training(model: nn.Module, config, device: torch.device | str) -> dict[str, list[str]]:
    """Applies the TrainConfig's precision="fp8", activation_checkpointing and compile settings to the
    model in place; returns what was changed (layer names per setting)."""
    device = torch.device(device)
    applied: dict[str, list[str]] = {}
    if config.precision == "fp8":
        check_fp8_device(device)
        applied["fp8"] = convert_to_fp8(model, config.fp8_recipe)
    # Compiled first, so that a checkpointed layer recomputes its compiled forward.
    if config.compile in ("dense", "model"):
        options = compile_option_values(config.compile_options)
        applied["compile"] = (compile_dense_blocks(model, options) if config.compile == "dense"
                              else compile_model_step(model, cuda_graphs=config.cuda_graphs, options=options))
    if config.activation_checkpointing == "sequence":
        applied["activation_checkpointing"] = checkpoint_sequence_layers(model)
    return applied
