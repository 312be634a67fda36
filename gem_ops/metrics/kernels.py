"""Device time by kind of kernel, from a profile's per-kernel rows (mfu_window.top_device_operators): where a
training step's GPU time goes besides the matrix products that MFU counts."""

from __future__ import annotations

# (kind, name fragments), first match wins: the project's attention kernels, cuBLAS / CUTLASS products,
# Inductor's generated kernels (by what they fuse), then eager ATen kernels.
KINDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("attention_backward", ("dkdv_kernel", "dq_kernel", "backward_prologue_kernel")),
    ("attention_forward", ("forward_kernel", "tile_table_kernel")),
    ("gemm", ("nvjet", "gemm", "cutlass", "cublas", "sm90_xmma", "fp8_matmul")),
    ("compiled_norm", ("native_layer_norm",)),
    ("compiled_activation", ("gelu", "silu")),
    ("compiled_other", ("triton_",)),
    ("embedding", ("embedding", "grad_weight", "gather", "index_select", "indexselect", "index_put", "scatter", "sort",
                   "scan", "radix", "segment", "unique")),
    ("optimizer", ("adam", "adagrad", "foreach", "multi_tensor_apply", "addcdiv", "lerp", "sqrt")),
    ("copy_and_fill", ("copy", "fill", "memset", "memcpy", "cat")),
    ("eager_elementwise", ("elementwise",)),
    ("eager_norm", ("layer_norm", "gammabeta")),
    ("eager_reduction", ("reduce_kernel",)),
)


def kind_of(kernel_name: str) -> str:
    name = kernel_name.lower()
    for kind, fragments in KINDS:
        if any(fragment in name for fragment in fragments):
            return kind
    return "other"


def time_by_kind(kernels: list[dict]) -> dict[str, dict[str, float]]:
    """{kind: {"ms": per step, "share": of the listed kernels' time}} from rows {"name", "ms", "calls"}."""
    totals: dict[str, float] = {}
    for row in kernels:
        totals[kind_of(row["name"])] = totals.get(kind_of(row["name"]), 0.0) + row["ms"]
    whole = sum(totals.values()) or 1.0
    return {kind: {"ms": ms, "share": ms / whole} for kind, ms in sorted(totals.items(), key=lambda kv: -kv[1])}
