"""Embedding sharding: the plan's TableShards as a TorchRec ShardingPlan, applied by DistributedModelParallel.

Gradient semantics are made explicit once for the whole trainer: every rank's loss is its share of
the *global* mean (sum over its samples / global batch), and every gradient reduction *sums*. So
TorchRec's own division of embedding gradients by the world size (meant for per-rank mean losses)
is switched off (:func:`torchrec.distributed.comm_ops.set_gradient_division`), and data-parallel
tables, whose lookups TorchRec wraps in DDP (an average, at every backward), are unwrapped and their
gradients summed over the world once per optimizer step (:func:`all_reduce_data_parallel_grads`). This is
what lets a sharded run reproduce the unsharded one step for step, whatever the per-rank counts.

2-D sparse parallelism (``sparse_replicate = R > 1``): each sparse group of ``S`` consecutive ranks holds
one copy of the tables, sharded by the same group-local plan, through TorchRec's 2-D environment
(``ShardingEnv2D``: all-to-alls within the group). A group's embedding gradients hold its own samples
only; each replica's fused optimizer steps with ``R`` times the learning rate, and
:mod:`.replica_sync` averages the replicas (see there for what that means for each optimizer).
Data-parallel tables stay one table over the whole world.
"""

from __future__ import annotations

import math
import os
import types
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd.profiler import record_function
from torchrec.distributed.comm_ops import set_gradient_division
from torchrec.distributed.embedding import EmbeddingCollectionSharder
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.sharding_plan import placement
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
from torchrec.distributed.types import (
    EmbeddingModuleShardingPlan,
    EnumerableShardingSpec,
    ParameterSharding,
    ShardingEnv,
    ShardingEnv2D,
    ShardingPlan,
    ShardMetadata,
)

from coplan.errors import MismatchError
from coplan.spec import Plan
from coplan.spec.plan import TableShard
from coplan.trainer.distributed.layout import node_group_size, table_problem
from coplan.trainer.distributed.mesh import Meshes
from coplan.trainer.model.sparse import SparseArch, init_table_rows


def _emb_optim_type(name: str):
    from fbgemm_gpu.split_embedding_configs import EmbOptimType

    return {
        "rowwise_adagrad": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
        "adagrad": EmbOptimType.EXACT_ADAGRAD,
        "adam": EmbOptimType.ADAM,
        "sgd": EmbOptimType.EXACT_SGD,
    }[name]


SPARSE_EPS = 1e-8
"""Epsilon of the sparse optimizers (fused and data-parallel alike)."""


DMP_COLLECTION_OPTIMIZERS = ("sgd", "adagrad", "rowwise_adagrad")
"""Sparse optimizers whose whole state TorchRec's ``DMPCollection.sync`` averages (it reads each TBE's
``sum`` state only); with another one (Adam) the 2-D tables are built from DMPCollection's parts on every
device and :class:`~coplan.trainer.distributed.replica_sync.ReplicaSync` averages every state tensor."""


def fused_params(plan: Plan, lr_scale: float = 1.0) -> dict[str, Any]:
    """FBGEMM's fused (in-backward) optimizer of the sharded tables, from the workload. ``lr_scale``: the
    number of table replicas (see the module docstring: what makes an averaged 2-D SGD step the 1-D one)."""
    opt = plan.workload.optimizer
    return {"optimizer": _emb_optim_type(opt.sparse), "learning_rate": opt.sparse_lr * lr_scale, "eps": SPARSE_EPS}


class EBCSharder(EmbeddingBagCollectionSharder):
    """TorchRec lists row-wise and table-row-wise sharding for CUDA only; they run on CPU/gloo too
    (the trainer's CPU tests use them), so answer every device as CUDA does."""

    def sharding_types(self, compute_device_type: str) -> list[str]:
        return super().sharding_types("cuda")


class ECSharder(EmbeddingCollectionSharder):
    """As :class:`EBCSharder`, for the sequence tables' EmbeddingCollections."""

    def sharding_types(self, compute_device_type: str) -> list[str]:
        return super().sharding_types("cuda")


def _rw_sizes(rows: int, parts: int) -> list[int]:
    """TorchRec's row-wise split: blocks of ⌈rows/parts⌉ rows, bucket i on shard i (trailing ones may be short or empty)."""
    block = math.ceil(rows / parts)
    return [max(0, min(block, rows - i * block)) for i in range(parts)]


def parameter_sharding(ts: TableShard, rows: int, dim: int, *, group_size: int, local_size: int, device_type: str,
                       is_sequence: bool, node_size: int | None = None, rank_offset: int = 0) -> ParameterSharding:
    """One table's ParameterSharding. ``ranks`` of the TableShard are ranks of the sparse group; the
    ParameterSharding's are those plus ``rank_offset`` (the group's first global rank, where TorchRec
    wants global ranks). ``node_size``: ranks of one node within the group (table-row-wise; default
    ``local_size``); ``local_size``: the launch's processes per node (CUDA device indices)."""
    kind = ts.sharding_type
    node = node_size or local_size
    problem = table_problem(ts, dim=dim, is_sequence=is_sequence, group_size=group_size, node_size=node)
    if problem:
        raise MismatchError(problem)
    if kind == "data_parallel":
        return ParameterSharding(sharding_type="data_parallel", compute_kernel="dense",
                                 ranks=[rank_offset + r for r in range(group_size)])
    ranks = list(ts.ranks)
    if kind == "table_wise":
        shards = [([rows, dim], [0, 0], ranks[0])]
    elif kind in ("row_wise", "table_row_wise"):
        shards, off = [], 0
        for r, n in zip(ranks, _rw_sizes(rows, len(ranks))):
            shards.append(([n, dim], [off, 0], r))
            off += n
    else:  # column_wise (the spec's Literal is closed; table_problem checked the split)
        w = dim // len(ranks)
        shards = [([rows, w], [0, i * w], r) for i, r in enumerate(ranks)]
    spec = EnumerableShardingSpec([
        ShardMetadata(shard_sizes=size, shard_offsets=off, placement=placement(device_type, rank_offset + r, local_size))
        for size, off, r in shards
    ])
    return ParameterSharding(sharding_type=kind, compute_kernel="fused", ranks=[rank_offset + r for _, _, r in shards],
                             sharding_spec=spec)


def build_sharding_plan(plan: Plan, sparse: SparseArch, *, device_type: str, local_size: int, prefix: str = "sparse",
                        rank_offset: int = 0) -> ShardingPlan:
    """TorchRec ShardingPlan of the model's sparse arch from the plan's table shards, over one sparse group
    (its ranks plus ``rank_offset``: 0 gives the group-local plan that DMPCollection remaps itself)."""
    by_name = {t.table: t for t in plan.tables}
    tables = {t.name: t for t in plan.workload.all_tables}
    if not by_name:
        raise MismatchError("the plan shards no table ('tables' is empty); re-plan with coplan plan")
    group = plan.mesh.sparse_shard
    node = node_group_size(plan)
    out: dict[str, EmbeddingModuleShardingPlan] = {}

    def module_plan(names: list[str], is_sequence: bool) -> EmbeddingModuleShardingPlan:
        mp = EmbeddingModuleShardingPlan()
        for n in names:
            t = tables[n]
            mp[n] = parameter_sharding(by_name[n], t.num_rows, t.dim, group_size=group, local_size=local_size,
                                       device_type=device_type, is_sequence=is_sequence, node_size=node,
                                       rank_offset=rank_offset)
        return mp

    if sparse.ebc is not None:
        names = list(dict.fromkeys(f.table.name for f in sparse.layout.pooled))
        out[f"{prefix}.ebc"] = module_plan(names, False)
    for name, feats in sparse.ec_features.items():
        out[f"{prefix}.ecs.{name}"] = module_plan(feats, True)
    return ShardingPlan(out)


def reset_torchrec_groups() -> None:
    """Forget the node groups TorchRec caches per process (table-row-wise's intra/cross-node groups):
    a process that shards a second plan (``coplan train a.json b.json``) must not reuse the first's."""
    from torchrec.distributed import comm

    comm._INTRA_PG = comm._CROSS_PG = None
    comm._INTRA_PG_2D = comm._CROSS_PG_2D = comm._NODE_GROUP_SIZE_2D = None


@contextmanager
def _node_size_env(size: int):
    """TorchRec's 1-D table-row-wise sharding reads the node size from ``LOCAL_WORLD_SIZE``; a CPU run
    launches every rank on one machine, so the plan's node size is put there while the tables are sharded."""
    old = os.environ.get("LOCAL_WORLD_SIZE")
    os.environ["LOCAL_WORLD_SIZE"] = str(size)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("LOCAL_WORLD_SIZE", None)
        else:
            os.environ["LOCAL_WORLD_SIZE"] = old


def apply_embedding_sharding(model: nn.Module, plan: Plan, *, device: torch.device, local_size: int,
                             group: dist.ProcessGroup | None = None, meshes: Meshes | None = None,
                             use_dmp_collection: bool | None = None) -> DistributedModelParallel:
    """Shard ``model.sparse`` with TorchRec (the dense part is left to FSDP: no DDP wrapping).

    One copy of the tables (``sparse_replicate = 1``): DistributedModelParallel over the world (or
    ``group``). Several (2-D sparse parallelism): each sparse group shards one copy with the same
    group-local plan, TorchRec's 2-D environment (:class:`ShardingEnv2D`: all-to-alls within the group,
    data-parallel tables over the world) -- built by TorchRec's ``DMPCollection`` on CUDA
    (``use_dmp_collection``, default: on CUDA where its sync covers the sparse optimizer's state), and
    from the same parts on CPU, where DMPCollection refuses to run. The replicas' sync is
    :class:`~coplan.trainer.distributed.replica_sync.ReplicaSync`.
    """
    set_gradient_division(False)
    reset_torchrec_groups()
    if getattr(model, "sparse", None) is None:
        # a workload without tables: DMP only wraps the model, so that the loop, the optimizers and the
        # checkpoints see one interface (forward, fused_optimizer (empty), state_dict)
        return DistributedModelParallel(model, env=ShardingEnv.from_process_group(dist.group.WORLD), device=device,
                                        plan=ShardingPlan({}), sharders=[], init_data_parallel=False)
    R = plan.mesh.sparse_replicate
    fp = fused_params(plan, lr_scale=R)
    sharders = [EBCSharder(fused_params=fp), ECSharder(fused_params=fp)]
    node = node_group_size(plan)
    if R == 1:
        sharding_plan = build_sharding_plan(plan, model.sparse, device_type=device.type, local_size=local_size)
        env_ctx = _node_size_env(node) if device.type != "cuda" else nullcontext()
        with env_ctx:
            dmp = DistributedModelParallel(
                model, env=ShardingEnv.from_process_group(group or (meshes.sparse_group if meshes else dist.group.WORLD)),
                device=device, plan=sharding_plan, sharders=sharders, init_data_parallel=False)
    else:
        if meshes is None or meshes.sparse_mesh is None:
            raise ValueError("2-D sparse parallelism needs the sparse mesh (build_meshes)")
        S = plan.mesh.sparse_shard
        if use_dmp_collection is None:
            use_dmp_collection = device.type == "cuda" and plan.workload.optimizer.sparse in DMP_COLLECTION_OPTIMIZERS
        if use_dmp_collection:
            from torchrec.distributed.model_parallel import DMPCollection

            dmp = DMPCollection(
                module=model, device=device,
                plan=build_sharding_plan(plan, model.sparse, device_type=device.type, local_size=local_size),
                world_size=dist.get_world_size(), sharding_group_size=S, global_pg=dist.group.WORLD,
                node_group_size=node, sharders=sharders, init_data_parallel=False, use_inter_host_allreduce=True,
            )
        else:
            group_index = dist.get_rank() // S  # the plan's layout: sparse group g is ranks [g·S, (g+1)·S)
            mesh = meshes.sparse_mesh
            env = ShardingEnv2D(sharding_pg=mesh.get_group("sparse_shard"), replica_pg=mesh.get_group("sparse_replicate"),
                                global_pg=dist.group.WORLD, device_mesh=mesh, node_group_size=node,
                                use_inter_host_allreduce=True)
            sharding_plan = build_sharding_plan(plan, model.sparse, device_type=device.type, local_size=local_size,
                                                rank_offset=group_index * S)
            dmp = DistributedModelParallel(model, env=env, device=device, plan=sharding_plan, sharders=sharders,
                                           init_data_parallel=False)
    # data-parallel tables are replicated on every rank of every group: the optimizers sum their gradients
    # over the world once per step (all_reduce_data_parallel_grads), not TorchRec's DDP at every backward
    changed = unwrap_data_parallel_lookups(dmp)
    if changed == 0 and any(t.sharding_type == "data_parallel" for t in plan.tables) and dist.get_world_size() > 1:
        raise RuntimeError("data-parallel tables but no DDP wrapper found in the sharded modules: TorchRec's internals "
                           "changed, and their gradients might be reduced twice")
    if device.type != "cuda":
        cpu_sequence_lookups(dmp)
    return dmp


def _dense_sequence_forward(self, features: KeyedJaggedTensor) -> torch.Tensor:
    """One row per id, in input order, from the data-parallel tables' flat weights (autograd-tracked)."""
    emb = self._emb_module
    ids = features.values().long()
    outs = []
    for f, part in enumerate(torch.split(ids, features.length_per_key())):
        t = self._feature_table_map[f]
        rows, dim = emb.embedding_specs[t][:2]
        off = int(emb.weights_physical_offsets[t])
        outs.append(emb.weights[off : off + rows * dim].view(rows, dim)[part])
    return torch.cat(outs).float() if outs else emb.weights.new_zeros(0, emb.max_D, dtype=torch.float32)


def cpu_sequence_lookups(dmp: nn.Module) -> int:
    """The CPU path of data-parallel sequence tables: FBGEMM's dense no-bag lookup on CPU returns one
    row per bag instead of one per id, so TorchRec's sequence lookup of those tables would fail on a
    shape mismatch. Their lookup modules get a forward that indexes the same weights (one row per id,
    autograd to the same flat parameter that DDP and the dense-kernel optimizer hold); returns how many."""
    from torchrec.distributed.batched_embedding_kernel import BatchedDenseEmbedding

    n = 0
    for m in dmp.modules():
        for lookup in [m, *getattr(m, "_lookups", [])]:
            for k in lookup.modules():
                if isinstance(k, BatchedDenseEmbedding) and getattr(k.forward, "__func__", None) is not _dense_sequence_forward:
                    k.forward = types.MethodType(_dense_sequence_forward, k)
                    n += 1
    return n


def sparse_state(dmp: nn.Module, prefix: str = "sparse.") -> dict[str, Any]:
    """The sharded tables' state (ShardedTensors for sharded tables, plain tensors for data-parallel ones)."""
    return {k: v for k, v in dmp.state_dict().items() if k.startswith(prefix)}


def _table_of(key: str) -> str:
    return key.rsplit(".", 2)[-2]  # ...embedding_bags.<table>.weight / ...embeddings.<table>.weight


def local_shards(v: Any) -> list[tuple[torch.Tensor, tuple[int, int]]]:
    """This rank's pieces of one table's state entry, each with its (row, column) offset in the table:
    a ShardedTensor's local shards (one copy of the tables), a DTensor's (2-D sparse parallelism: TorchRec
    then describes the shards as DTensors over the ``(sparse_replicate, sparse_shard)`` mesh, their local
    part a LocalShardsWrapper), or a whole replicated tensor (data-parallel tables)."""
    from torch.distributed.tensor import DTensor

    if hasattr(v, "local_shards") and not isinstance(v, DTensor):  # ShardedTensor
        return [(s.tensor, tuple(s.metadata.shard_offsets)) for s in v.local_shards()]
    if isinstance(v, DTensor):
        loc = v._local_tensor
        if hasattr(loc, "local_shards"):  # LocalShardsWrapper
            return [(t, tuple(o)) for t, o in zip(loc.local_shards(), loc.local_offsets())]
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        _, off = compute_local_shape_and_global_offset(v.shape, v.device_mesh, v.placements)
        return [(loc, tuple(off))] if loc.numel() else []
    return [(v, (0, 0))]


@torch.no_grad()
def init_sharded_tables(dmp: nn.Module, seed: int, dims: dict[str, int]) -> None:
    """Fill every local shard with its rows of the seeded full table (see :func:`init_table_rows`)."""
    for key, v in sparse_state(dmp).items():
        table = _table_of(key)
        for t, (row, col) in local_shards(v):
            init_table_rows(t, seed, table, dims[table], row, col)


def data_parallel_tables(dmp: nn.Module, plan: Plan, prefix: str = "sparse.") -> list[tuple[str, nn.Parameter]]:
    """(name, weight) of the data-parallel tables: replicated, trained by the dense-kernel optimizer."""
    dp = {t.table for t in plan.tables if t.sharding_type == "data_parallel"}
    return [(n, p) for n, p in dmp.named_parameters() if n.startswith(prefix) and _table_of(n) in dp]


def unwrap_data_parallel_lookups(dmp: nn.Module) -> int:
    """Take TorchRec's DDP off the data-parallel tables' lookups (returns how many); the trainer sums
    their gradients itself, once per optimizer step (:func:`all_reduce_data_parallel_grads`).

    Why not DDP: it all-reduces at every backward, so with gradient accumulation an earlier micro-batch's
    already-summed gradient would be summed again; it averages (the trainer sums); and TorchRec builds it
    with ``static_graph=True``, whose first-iteration bookkeeping fails (an internal assert in the reducer)
    when a micro-batch leaves a table unused. One all-reduce per step is also what the cost model prices
    (``sparse.dp_all_reduce``). The tables start equal on every rank without DDP's initial broadcast:
    :func:`init_sharded_tables` fills them from the seed."""
    from torch.nn.parallel import DistributedDataParallel

    n = 0
    for m in dmp.modules():
        lookups = getattr(m, "_lookups", None)  # TorchRec keeps the lookups in a plain list (not a ModuleList)
        if not isinstance(lookups, list):
            continue
        for i, lookup in enumerate(lookups):
            if isinstance(lookup, DistributedDataParallel):
                lookups[i] = lookup.module
                n += 1
    return n


DP_ALL_REDUCE_RANGE = "sparse.dp_all_reduce"
"""The ``record_function`` name of the data-parallel tables' gradient all-reduce (the cost model's op name)."""


@torch.no_grad()
def all_reduce_data_parallel_grads(params: list[nn.Parameter], group: dist.ProcessGroup | None = None) -> None:
    """Sum the data-parallel tables' gradients over every rank (of every sparse group), in place, in one
    flattened buffer per dtype. A table no sample of this rank looked up has no gradient here: it takes
    part with zeros, and gets the others' sum."""
    if not params or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    with record_function(DP_ALL_REDUCE_RANGE):
        by_dtype: dict[torch.dtype, list[nn.Parameter]] = {}
        for p in params:
            by_dtype.setdefault(p.dtype, []).append(p)
        for ps in by_dtype.values():
            flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in ps])
            dist.all_reduce(flat, group=group)
            off = 0
            for p in ps:
                n = p.numel()
                g = flat[off : off + n].view_as(p)
                if p.grad is None:
                    p.grad = g.clone()
                else:
                    p.grad.copy_(g)
                off += n


__all__ = [
    "EBCSharder", "ECSharder", "SPARSE_EPS", "apply_embedding_sharding", "build_sharding_plan", "data_parallel_tables",
    "DP_ALL_REDUCE_RANGE", "all_reduce_data_parallel_grads", "fused_params", "init_sharded_tables", "local_shards",
    "parameter_sharding", "reset_torchrec_groups", "sparse_state", "unwrap_data_parallel_lookups", "cpu_sequence_lookups",
]
