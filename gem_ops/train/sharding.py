"""How a GEM model is spread over the ranks of a job (on one rank, by default, it is not).

Embedding tables: TorchRec DistributedModelParallel (table-wise, row-wise, or the planner's choice)
with the row-wise Adagrad update fused into the backward pass; where TorchRec's sharded kernels are
missing (CUDA without fbgemm's CUDA build) the unsharded TorchRec modules are sharded by FSDP2 like
dense layers, with an ordinary row-wise Adagrad. Dense layers: FSDP2, one unit per layer, on a 1-D
mesh, or a 2-D (replicate x shard) mesh across nodes (HSDP).

Gradients come out averaged over ranks on both paths (FSDP2 reduce-scatters a mean; TorchRec divides
embedding gradients by the world size), so a rank's loss must be scaled to world_size x its share of
the global loss (see distributed.py) for the result to equal one process on the whole batch.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torchrec.distributed.model_parallel import DataParallelWrapper, DistributedModelParallel
from torchrec.distributed.types import ShardedModule
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from torchrec.optim import CombinedOptimizer, RowWiseAdagrad

from gem_ops.train.config import TrainConfig
from gem_ops.train.optimizer import build_optimizer, dense_optimizer, sparse_table_gradients, split_parameters

log = logging.getLogger(__name__)

EmbeddingSharding = Literal["table_wise", "row_wise", "auto", "fsdp", "none"]
# none: one rank trains the plain model (what `auto` picks on one rank: nothing to shard).
EMBEDDING_SHARDINGS = ("table_wise", "row_wise", "auto", "fsdp", "none")
TABLE_MODULES = (EmbeddingBagCollection, EmbeddingCollection)
CONTAINERS = (nn.ModuleList, nn.ModuleDict)
FUSED = "fused"  # fbgemm's TBE kernel with the optimizer step inside the backward
ROWWISE_ADAGRAD_EPS = 1e-8  # fbgemm's default; the unfused optimizer takes the same on the FSDP path


@dataclass
class ShardedModel:
    module: nn.Module  # the model itself, its tables and layers replaced by sharded ones
    optimizer: CombinedOptimizer  # "sparse" (tables) + "dense", keyed by parameter name
    embedding_sharding: str  # what was used: table_wise, row_wise, auto (planner) or fsdp
    fsdp_units: list[nn.Module]  # modules under fully_shard, in model order
    dense_parameters: list[nn.Parameter]  # what gradient clipping covers
    mesh: DeviceMesh | None  # None on one unsharded rank
    dmp: DistributedModelParallel | None = None


def dmp_usable(device: torch.device) -> bool:
    """Whether TorchRec's sharded embedding kernels exist for this device: fbgemm's CPU build has no
    CUDA kernels, and every DistributedModelParallel sharding fails there (KJT permute, TBE)."""
    try:
        import fbgemm_gpu  # noqa: F401  (registers the fbgemm ops)
    except ImportError:
        return False
    key = "CUDA" if device.type == "cuda" else "CPU"
    return all(torch._C._dispatch_has_kernel_for_dispatch_key(op, key)
               for op in ("fbgemm::permute_2D_sparse_data", "fbgemm::asynchronous_complete_cumsum"))


def resolve_embedding_sharding(requested: str, device: torch.device, world_size: int) -> str:
    if requested not in EMBEDDING_SHARDINGS:
        raise ValueError(f"embedding sharding {requested!r} is not one of {EMBEDDING_SHARDINGS}")
    if requested == "none" and world_size > 1:
        raise ValueError(f"embedding sharding 'none' trains one rank; this job has {world_size}: use auto, "
                         "table_wise, row_wise or fsdp")
    if requested in ("none", "auto") and world_size == 1:
        return "none"
    if requested != "fsdp" and not dmp_usable(device):
        log.warning("TorchRec sharded kernels are missing for %s (fbgemm without its %s build): embedding "
                    "tables fall back to FSDP2 instead of %s sharding", device, device.type, requested)
        return "fsdp"
    return requested


def device_mesh(device_type: str, world_size: int, local_world_size: int) -> DeviceMesh:
    """1-D (shard) on one node; (replicate, shard) across nodes: parameters sharded within a node and
    replicated across nodes (HSDP), so the per-step all-gathers stay on the fast intra-node links."""
    if local_world_size < 1 or world_size % local_world_size:
        raise ValueError(f"WORLD_SIZE {world_size} is not a multiple of LOCAL_WORLD_SIZE {local_world_size}")
    nodes = world_size // local_world_size
    if nodes == 1:
        return init_device_mesh(device_type, (world_size,), mesh_dim_names=("shard",))
    return init_device_mesh(device_type, (nodes, local_world_size), mesh_dim_names=("replicate", "shard"))


def fsdp_units(module: nn.Module, tables_sharded_elsewhere: bool) -> list[nn.Module]:
    """The modules to fully_shard, one unit per layer: each maximal submodule that holds no
    TorchRec-sharded table, descending through containers and through modules whose parameters all
    sit in containers (a per-block dispatcher such as a sequence branch runs each block's layers at a
    different time; one unit per block keeps each unit's forward to one call per step)."""
    units: list[nn.Module] = []

    def is_table(m: nn.Module) -> bool:
        return isinstance(m, (*TABLE_MODULES, ShardedModule))

    def holds_tables(m: nn.Module) -> bool:
        return tables_sharded_elsewhere and any(is_table(s) for s in m.modules())

    def dispatches_blocks(m: nn.Module) -> bool:
        children = list(m.children())
        return bool(children) and all(isinstance(c, CONTAINERS) for c in children) \
            and not any(True for _ in m.parameters(recurse=False))

    def visit(m: nn.Module, is_root: bool) -> None:
        own = [name for name, _ in m.named_parameters(recurse=False)]
        if tables_sharded_elsewhere and is_table(m):
            return
        if not is_root and not holds_tables(m) and not isinstance(m, CONTAINERS) and not dispatches_blocks(m):
            if any(True for _ in m.parameters()):
                units.append(m)
            return
        if own:
            raise ValueError(f"{type(m).__name__} holds parameters {own} beside its sub-layers; "
                             "move them into a sub-module so FSDP2 can shard them")
        for child in m.children():
            visit(child, False)

    visit(module, True)
    return units


def shard_dense(units: list[nn.Module], mesh: DeviceMesh) -> None:
    for unit in units:
        fully_shard(unit, mesh=mesh)


class FullyShardDense(DataParallelWrapper):
    """DMP's data-parallel step: FSDP2 on the dense layers instead of DDP on the whole model."""

    def __init__(self, mesh: DeviceMesh):
        self.mesh = mesh
        self.units: list[nn.Module] = []

    def wrap(self, dmp: DistributedModelParallel, env, device: torch.device) -> None:
        self.units = fsdp_units(dmp._dmp_wrapped_module, tables_sharded_elsewhere=True)
        shard_dense(self.units, self.mesh)


@dataclass(frozen=True)
class TableGroup:
    """The tables of one TorchRec collection: rows x dim by name, in the collection's order."""

    pooled: bool  # an EmbeddingBagCollection: its output concatenates the tables in order
    sizes: dict[str, int]


def table_groups(model: nn.Module) -> dict[str, TableGroup]:
    groups = {}
    for path, m in model.named_modules():
        if isinstance(m, EmbeddingBagCollection):
            groups[path] = TableGroup(True, {t.name: t.num_embeddings * t.embedding_dim
                                             for t in m.embedding_bag_configs()})
        elif isinstance(m, EmbeddingCollection):
            groups[path] = TableGroup(False, {t.name: t.num_embeddings * t.embedding_dim
                                              for t in m.embedding_configs()})
    return groups


def table_wise_ranks(groups: dict[str, TableGroup], world_size: int) -> dict[tuple[str, str], int]:
    """Ranks for table-wise sharding, balancing rows x dim. Unpooled tables (their output is keyed by
    feature) go largest first onto the least loaded rank. A sharded EmbeddingBagCollection concatenates
    its output rank by rank while the model reads it in table order, so pooled tables take ranks in
    table order: contiguous runs, each rank filled to about its share of the total."""
    load = [0] * world_size
    placement = {}
    unpooled = sorted(((path, t, n) for path, g in groups.items() if not g.pooled for t, n in g.sizes.items()),
                      key=lambda item: -item[2])
    for path, table, n in unpooled:
        rank = min(range(world_size), key=lambda r: (load[r], r))
        placement[(path, table)] = rank
        load[rank] += n
    for path, group in groups.items():
        if not group.pooled:
            continue
        target = (sum(load) + sum(group.sizes.values())) / world_size
        rank = 0
        for table, n in group.sizes.items():
            if rank < world_size - 1 and load[rank] > 0 and load[rank] + n > target:
                rank += 1
            placement[(path, table)] = rank
            load[rank] += n
    return placement


def keeps_pooled_order(module_plan, group: TableGroup) -> bool:
    """Whether a sharded EmbeddingBagCollection's output surely keeps the table order: every table
    row-wise with one kernel (each rank holds a slice of every table). TorchRec groups the output by
    sharding type, kernel and rank, and more, so any other planner choice is re-placed by hand."""
    return len({(module_plan[t].sharding_type, module_plan[t].compute_kernel) for t in group.sizes}) == 1 \
        and module_plan[next(iter(group.sizes))].sharding_type == "row_wise"


def sharding_plan(model: nn.Module, kind: str, world_size: int, local_world_size: int, device_type: str, sharders):
    """A hand-made table-wise or row-wise plan (TorchRec's planner offers no row-wise on CPU), or the
    planner's, its pooled tables re-placed table-wise in order where it would scramble their order."""
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise, table_wise
    from torchrec.distributed.types import ShardingPlan, ShardingType

    groups = table_groups(model)
    ranks = table_wise_ranks(groups, world_size)

    def hand_made(path: str, how: str):
        per_table = {t: (table_wise(rank=ranks[(path, t)], compute_kernel=FUSED) if how == "table_wise"
                         else row_wise(compute_kernel=FUSED)) for t in groups[path].sizes}
        return construct_module_sharding_plan(model.get_submodule(path), per_table, local_size=local_world_size,
                                              world_size=world_size, device_type=device_type)

    if kind != "auto":
        return ShardingPlan({path: hand_made(path, kind) for path in groups})
    # Data-parallel tables would need DDP's gradient all-reduce, which the FSDP2 wrapper does not give.
    allowed = [t.value for t in (ShardingType.TABLE_WISE, ShardingType.ROW_WISE, ShardingType.COLUMN_WISE,
                                 ShardingType.TABLE_ROW_WISE)]
    constraints = {t: ParameterConstraints(sharding_types=allowed) for g in groups.values() for t in g.sizes}
    topology = Topology(world_size=world_size, local_world_size=local_world_size, compute_device=device_type)
    plan = EmbeddingShardingPlanner(topology=topology, constraints=constraints).collective_plan(
        model, sharders, dist.group.WORLD)
    for path, group in groups.items():
        if group.pooled and not keeps_pooled_order(plan.plan[path], group):
            log.info("%s: the planner's placement may reorder its pooled output; placed table-wise in order", path)
            plan.plan[path] = hand_made(path, "table_wise")
    return plan


def check_pooled_order(module: nn.Module) -> None:
    """A sharded EmbeddingBagCollection must return its tables' embeddings in the unsharded order."""
    for path, m in module.named_modules():
        names = getattr(m, "_embedding_names", None)
        if isinstance(m, ShardedModule) and hasattr(m, "_embedding_bag_configs") and names is not None:
            expected = [f for config in m._embedding_bag_configs for f in config.feature_names]
            if list(names) != expected:
                raise RuntimeError(f"{path}: the sharding plan reorders the pooled embeddings ({list(names)} instead "
                                   f"of {expected}); use --embedding-sharding table_wise or row_wise")


def table_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    return {f"{path}.{name}": p for path, m in model.named_modules() if isinstance(m, TABLE_MODULES)
            for name, p in m.named_parameters()}


def copy_tables_into_shards(sharded: nn.Module, full: dict[str, torch.Tensor]) -> None:
    """Each rank copies its slice of the full (identically seeded) tables into its local shards, so a
    sharded run starts from the same weights as one process."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    state = sharded.state_dict()
    for key, source in full.items():
        target = state[key]
        if not isinstance(target, ShardedTensor):
            raise TypeError(f"{key}: expected a TorchRec-sharded table, got {type(target).__name__}")
        for shard in target.local_shards():
            (r, c), (h, w) = shard.metadata.shard_offsets, shard.metadata.shard_sizes
            shard.tensor.copy_(source[r : r + h, c : c + w])


def shard_model(model: nn.Module, config: TrainConfig, embedding_sharding: str, device: torch.device,
                local_world_size: int) -> ShardedModel:
    """The model, with its (seeded) weights, spread over the job's ranks; the optimizer built to match."""
    world_size = dist.get_world_size()
    kind = resolve_embedding_sharding(embedding_sharding, device, world_size)
    if kind == "none":
        if config.sparse_table_gradients:
            sparse_table_gradients(model)  # the optimizer then touches only the rows each batch looked up
        optimizer = build_optimizer(model, config, eps=ROWWISE_ADAGRAD_EPS)
        return ShardedModel(model, optimizer, kind, [], list(split_parameters(model)[1].values()), None)
    mesh = device_mesh(device.type, world_size, local_world_size)
    if kind == "fsdp":
        units = fsdp_units(model, tables_sharded_elsewhere=False)
        shard_dense(units, mesh)
        optimizer = build_optimizer(model, config, eps=ROWWISE_ADAGRAD_EPS)
        dense = list(split_parameters(model)[1].values())
        return ShardedModel(model, optimizer, kind, units, dense, mesh)

    from torch.distributed.optim import _apply_optimizer_in_backward
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.types import ShardingEnv

    tables = table_parameters(model)
    full_tables = {name: p.detach().clone() for name, p in tables.items()}
    # The table update runs inside the backward pass (fbgemm's fused TBE): no table gradient is kept.
    _apply_optimizer_in_backward(RowWiseAdagrad, tables.values(), {"lr": config.lr_sparse, "eps": ROWWISE_ADAGRAD_EPS})
    sharders = [EmbeddingBagCollectionSharder(), EmbeddingCollectionSharder()]
    plan = sharding_plan(model, kind, world_size, local_world_size, device.type, sharders)
    wrapper = FullyShardDense(mesh)
    dmp = DistributedModelParallel(model, env=ShardingEnv.from_process_group(dist.group.WORLD), device=device,
                                   plan=plan, sharders=sharders, data_parallel_wrapper=wrapper)
    check_pooled_order(dmp.module)
    copy_tables_into_shards(dmp.module, full_tables)
    in_units = {id(p) for unit in wrapper.units for p in unit.parameters()}
    dense = {name: p for name, p in dmp.module.named_parameters() if id(p) in in_units and p.requires_grad}
    optimizer = CombinedOptimizer([("sparse", dmp.fused_optimizer), ("dense", dense_optimizer(dense, config))])
    return ShardedModel(dmp.module, optimizer, kind, wrapper.units, list(dense.values()), mesh, dmp)


def describe_plan(sharded: ShardedModel) -> dict[str, str]:
    """Table -> how it is sharded, for logs and run metadata."""
    if sharded.dmp is None:
        return {name: sharded.embedding_sharding for name in table_parameters(sharded.module)}
    out = {}
    for path, module_plan in sharded.dmp.plan.plan.items():
        for table, ps in module_plan.items():
            out[f"{path}.{table}"] = f"{ps.sharding_type} {ps.compute_kernel} ranks={ps.ranks}"
    return out


def gather_full_state(module: nn.Module) -> dict[str, torch.Tensor] | None:
    """Collective: the model's full (unsharded) state dict on rank 0, on CPU; None on other ranks."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torch.distributed.tensor import DTensor

    rank = dist.get_rank()
    full = {}
    for key, value in module.state_dict().items():
        if isinstance(value, ShardedTensor):
            out = torch.empty(value.size(), dtype=value.dtype) if rank == 0 else None
            value.gather(dst=0, out=out)
            value = out
        elif isinstance(value, DTensor):
            value = value.full_tensor()
        if rank == 0:
            full[key] = value.detach().cpu().clone()
    return full if rank == 0 else None
