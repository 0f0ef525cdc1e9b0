"""Embedding sharding: the plan's TableShards as a TorchRec ShardingPlan, applied by DistributedModelParallel.

Gradient semantics are made explicit once for the whole trainer: every rank's loss is its share of
the *global* mean (sum over its samples / global batch), and every gradient reduction *sums*. So
TorchRec's own division of embedding gradients by the world size (meant for per-rank mean losses)
is switched off (:func:`torchrec.distributed.comm_ops.set_gradient_division`), and data-parallel
tables, whose lookups TorchRec wraps in DDP (an average), get a DDP comm hook that sums instead. This is
what lets a sharded run reproduce the unsharded one step for step, whatever the per-rank counts.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed.comm_ops import set_gradient_division
from torchrec.distributed.embedding import EmbeddingCollectionSharder
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.sharding_plan import placement
from torchrec.distributed.types import (
    EmbeddingModuleShardingPlan,
    EnumerableShardingSpec,
    ParameterSharding,
    ShardingEnv,
    ShardingPlan,
    ShardMetadata,
)

from coplan.errors import MismatchError
from coplan.spec import Plan
from coplan.spec.plan import TableShard
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


def fused_params(plan: Plan) -> dict[str, Any]:
    """FBGEMM's fused (in-backward) optimizer of the sharded tables, from the workload."""
    opt = plan.workload.optimizer
    return {"optimizer": _emb_optim_type(opt.sparse), "learning_rate": opt.sparse_lr, "eps": SPARSE_EPS}


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
                       is_sequence: bool) -> ParameterSharding:
    """One table's ParameterSharding; ``ranks`` are ranks of the sparse group (global when it is the world)."""
    kind = ts.sharding_type
    where = f"table '{ts.table}'"
    if kind == "data_parallel":
        if is_sequence and device_type != "cuda":
            raise MismatchError(
                f"{where}: data-parallel sequence tables need CUDA (TorchRec's dense sequence kernel returns wrongly "
                "shaped lookups on CPU); use table_wise or row_wise for it on CPU"
            )
        return ParameterSharding(sharding_type="data_parallel", compute_kernel="dense", ranks=list(range(group_size)))
    if ts.compute_kernel != "fused":
        raise MismatchError(f"{where}: compute_kernel '{ts.compute_kernel}' for a {kind} table; the trainer shards "
                            "tables with FBGEMM's fused kernel (dense is for data_parallel tables)")
    ranks = list(ts.ranks)
    if kind == "table_wise":
        shards = [([rows, dim], [0, 0], ranks[0])]
    elif kind == "row_wise":
        if ranks != list(range(group_size)):
            raise MismatchError(f"{where}: row-wise shards must cover the sparse group in order (ranks 0..{group_size - 1}: "
                                f"TorchRec sends row block i to rank i); got {ranks}")
        shards, off = [], 0
        for r, n in zip(ranks, _rw_sizes(rows, group_size)):
            shards.append(([n, dim], [off, 0], r))
            off += n
    elif kind == "table_row_wise":
        host = ranks[0] // local_size
        node = list(range(host * local_size, min((host + 1) * local_size, group_size)))
        if ranks != node:
            raise MismatchError(f"{where}: table-row-wise shards must cover one node's ranks in order ({node}); got {ranks}")
        shards, off = [], 0
        for r, n in zip(ranks, _rw_sizes(rows, local_size)):
            shards.append(([n, dim], [off, 0], r))
            off += n
    elif kind == "column_wise":
        if dim % len(ranks):
            raise MismatchError(f"{where}: dim {dim} does not split evenly over {len(ranks)} column-wise shards")
        w = dim // len(ranks)
        shards = [([rows, w], [0, i * w], r) for i, r in enumerate(ranks)]
    else:  # pragma: no cover - the spec's Literal is closed
        raise MismatchError(f"{where}: unknown sharding type {kind}")
    for _, _, r in shards:
        if r >= group_size:
            raise MismatchError(f"{where}: rank {r} is outside the sparse group of {group_size}")
    spec = EnumerableShardingSpec(
        [ShardMetadata(shard_sizes=size, shard_offsets=off, placement=placement(device_type, r, local_size)) for size, off, r in shards]
    )
    return ParameterSharding(sharding_type=kind, compute_kernel="fused", ranks=[r for _, _, r in shards], sharding_spec=spec)


def build_sharding_plan(plan: Plan, sparse: SparseArch, *, device_type: str, local_size: int, prefix: str = "sparse") -> ShardingPlan:
    """TorchRec ShardingPlan of the model's sparse arch from the plan's table shards."""
    by_name = {t.table: t for t in plan.tables}
    tables = {t.name: t for t in plan.workload.all_tables}
    if not by_name:
        raise MismatchError("the plan shards no table ('tables' is empty); re-plan, or build one with coplan.trainer.plans")
    group = plan.mesh.sparse_shard
    out: dict[str, EmbeddingModuleShardingPlan] = {}

    def module_plan(names: list[str], is_sequence: bool) -> EmbeddingModuleShardingPlan:
        mp = EmbeddingModuleShardingPlan()
        for n in names:
            t = tables[n]
            mp[n] = parameter_sharding(by_name[n], t.num_rows, t.dim, group_size=group, local_size=local_size,
                                       device_type=device_type, is_sequence=is_sequence)
        return mp

    if sparse.ebc is not None:
        names = list(dict.fromkeys(f.table.name for f in sparse.layout.pooled))
        out[f"{prefix}.ebc"] = module_plan(names, False)
    for name, feats in sparse.ec_features.items():
        out[f"{prefix}.ecs.{name}"] = module_plan(feats, True)
    return ShardingPlan(out)


def apply_embedding_sharding(model: nn.Module, plan: Plan, *, device: torch.device, group: dist.ProcessGroup,
                             local_size: int) -> DistributedModelParallel:
    """Shard ``model.sparse`` with TorchRec DMP (the dense part is left to FSDP: no DDP wrapping)."""
    set_gradient_division(False)
    sharding_plan = build_sharding_plan(plan, model.sparse, device_type=device.type, local_size=local_size)
    fp = fused_params(plan)
    dmp = DistributedModelParallel(
        model,
        env=ShardingEnv.from_process_group(group),
        device=device,
        plan=sharding_plan,
        sharders=[EBCSharder(fused_params=fp), ECSharder(fused_params=fp)],
        init_data_parallel=False,
    )
    changed = sum_data_parallel_grads(dmp, group)
    if changed == 0 and any(t.sharding_type == "data_parallel" for t in plan.tables):
        raise RuntimeError("data-parallel tables but no DDP wrapper found in the sharded modules: TorchRec's internals "
                           "changed, and their gradients would be averaged instead of summed")
    return dmp


def sparse_state(dmp: nn.Module, prefix: str = "sparse.") -> dict[str, Any]:
    """The sharded tables' state (ShardedTensors for sharded tables, plain tensors for data-parallel ones)."""
    return {k: v for k, v in dmp.state_dict().items() if k.startswith(prefix)}


def _table_of(key: str) -> str:
    return key.rsplit(".", 2)[-2]  # ...embedding_bags.<table>.weight / ...embeddings.<table>.weight


@torch.no_grad()
def init_sharded_tables(dmp: nn.Module, seed: int, dims: dict[str, int]) -> None:
    """Fill every local shard with its rows of the seeded full table (see :func:`init_table_rows`)."""
    for key, v in sparse_state(dmp).items():
        table = _table_of(key)
        if hasattr(v, "local_shards"):
            for shard in v.local_shards():
                row, col = shard.metadata.shard_offsets
                init_table_rows(shard.tensor, seed, table, dims[table], row, col)
        else:
            init_table_rows(v, seed, table, dims[table], 0, 0)


def data_parallel_tables(dmp: nn.Module, plan: Plan, prefix: str = "sparse.") -> list[tuple[str, nn.Parameter]]:
    """(name, weight) of the data-parallel tables: replicated, trained by the dense-kernel optimizer."""
    dp = {t.table for t in plan.tables if t.sharding_type == "data_parallel"}
    return [(n, p) for n, p in dmp.named_parameters() if n.startswith(prefix) and _table_of(n) in dp]


def _allreduce_sum_hook(group, bucket):  # unannotated: DDP rejects string annotations (future import)
    fut = dist.all_reduce(bucket.buffer(), group=group, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


def sum_data_parallel_grads(dmp: nn.Module, group: dist.ProcessGroup) -> int:
    """Make the DDP that TorchRec wraps around data-parallel table lookups *sum* gradients (DDP's
    default averages); returns how many DDP wrappers were changed."""
    from torch.nn.parallel import DistributedDataParallel

    n = 0
    for m in dmp.modules():
        # TorchRec keeps the lookups in a plain list (not a ModuleList), so look there too
        for lookup in [m, *getattr(m, "_lookups", [])]:
            if isinstance(lookup, DistributedDataParallel):
                lookup.register_comm_hook(group, _allreduce_sum_hook)
                n += 1
    return n


__all__ = [
    "EBCSharder", "ECSharder", "SPARSE_EPS", "apply_embedding_sharding", "build_sharding_plan", "data_parallel_tables",
    "fused_params", "init_sharded_tables", "parameter_sharding", "sparse_state", "sum_data_parallel_grads",
]
