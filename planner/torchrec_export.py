"""Export the sparse half of a Plan as TorchRec's ``ShardingPlan``, so TorchRec users can take it alone.

Each table becomes a ``ParameterSharding`` (sharding type, compute kernel, ranks, and an
``EnumerableShardingSpec`` of ``ShardMetadata`` with the shard sizes, offsets and placements), grouped
in one ``EmbeddingModuleShardingPlan`` per module: pooled tables in one ``EmbeddingBagCollection``,
sequence tables in one ``EmbeddingCollection`` per embedding dimension (an EmbeddingCollection holds
one dimension only), at the module paths coplan's trainer uses (``sparse.ebc``, ``sparse.ecs.ec_d<dim>``;
arguments, for other models).

Ranks: a Plan names ranks within its sparse shard group (``0 .. sparse_shard-1``). With
``replica=None`` the export keeps them so: that is the plan TorchRec's ``DMPCollection`` takes
("created for sharding group world size"); with ``sparse_replicate == 1`` it is also the plan of a
plain ``DistributedModelParallel``. With ``replica=k`` ranks become global, ``group rank + k ×
sparse_shard``, because shard groups are contiguous rank ranges (``DMPCollection``'s
``use_inter_host_allreduce=True`` layout). Shard sizes follow TorchRec's own rules (row-wise blocks
of ``ceil(rows / shards)``, the last ones possibly short or empty), so TorchRec reads them unchanged.

torch and torchrec are imported here lazily, only when a ShardingPlan is built or read; the layout
arithmetic (:func:`shard_layout`) is torch-free.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from coplan.errors import CoplanError
from coplan.spec import Plan, TableShard
from coplan.spec.workload import EmbeddingTable

POOLED_MODULE = "sparse.ebc"
"""Module path of the EmbeddingBagCollection holding pooled tables (the trainer's name for it)."""

SEQUENCE_MODULE = "sparse.ecs.ec_d{dim}"
"""Module path of the EmbeddingCollection holding the sequence tables of one dimension (``{dim}`` is filled in)."""


def row_blocks(rows: int, shards: int) -> list[int]:
    """Rows per shard as TorchRec splits them: blocks of ceil(rows / shards), the tail short or empty."""
    block = math.ceil(rows / shards)
    out = []
    left = rows
    for _ in range(shards):
        take = min(block, max(left, 0))
        out.append(take)
        left -= take
    return out


def shard_layout(table: EmbeddingTable, shard: TableShard, group_size: int) -> list[tuple[list[int], list[int], int]]:
    """``(shard_sizes, shard_offsets, group_rank)`` of every shard of a table, in TorchRec's layout."""
    rows, dim = table.num_rows, table.dim
    st, ranks = shard.sharding_type, list(shard.ranks)
    if st == "data_parallel":
        return [([rows, dim], [0, 0], r) for r in range(group_size)]
    if st == "table_wise":
        return [([rows, dim], [0, 0], ranks[0])]
    if st == "column_wise":
        n = len(ranks)
        if dim % n:
            raise CoplanError(f"table '{table.name}': {n} column-wise shards do not divide dim {dim}")
        w = dim // n
        return [([rows, w], [0, i * w], r) for i, r in enumerate(ranks)]
    if st in ("row_wise", "table_row_wise"):
        out, offset = [], 0
        for r, n_rows in zip(ranks, row_blocks(rows, len(ranks))):
            out.append(([n_rows, dim], [offset, 0], r))
            offset += n_rows
        return out
    raise CoplanError(f"table '{table.name}': unknown sharding type {st!r}")


def _kernel(shard: TableShard) -> str:
    # TorchRec's data-parallel tables are plain modules replicated by DDP ("dense" kernel); the rest
    # use FBGEMM's fused table-batched embedding with the optimizer fused into backward.
    return "dense" if shard.sharding_type == "data_parallel" or shard.compute_kernel == "dense" else "fused"


def to_torchrec(
    plan: Plan,
    *,
    replica: int | None = None,
    pooled_module: str = POOLED_MODULE,
    sequence_module: str = SEQUENCE_MODULE,
    compute_device: str = "cuda",
):
    """TorchRec ``ShardingPlan`` of the plan's tables (see the module docstring for ranks)."""
    # torchrec (and torch) are the [train] extra: imported only when a TorchRec plan is built
    from torchrec.distributed.sharding_plan import placement
    from torchrec.distributed.types import EmbeddingModuleShardingPlan, EnumerableShardingSpec, ParameterSharding, ShardingPlan, ShardMetadata

    group = plan.mesh.sparse_shard
    if replica is not None and not 0 <= replica < plan.mesh.sparse_replicate:
        raise CoplanError(f"replica {replica} is outside 0..{plan.mesh.sparse_replicate - 1}")
    offset = 0 if replica is None else replica * group
    local = plan.topology.gpus_per_node
    tables = {t.name: t for t in plan.workload.all_tables}
    modules: dict[str, Any] = {}
    for shard in plan.tables:
        table = tables[shard.table]
        layout = shard_layout(table, shard, group)
        ranks = [r + offset for _, _, r in layout]
        spec = None
        if shard.sharding_type != "data_parallel":
            spec = EnumerableShardingSpec(
                [ShardMetadata(shard_offsets=off, shard_sizes=size, placement=placement(compute_device, r, local)) for (size, off, _), r in zip(layout, ranks)]
            )
        path = sequence_module.format(dim=table.dim) if table.feature_kind == "sequence" else pooled_module
        modules.setdefault(path, EmbeddingModuleShardingPlan())[table.name] = ParameterSharding(
            sharding_type=shard.sharding_type,
            compute_kernel=_kernel(shard),
            ranks=ranks,
            sharding_spec=spec,
        )
    return ShardingPlan(modules)


def from_torchrec(sharding_plan, plan: Plan, *, replica: int | None = None) -> tuple[TableShard, ...]:
    """Read a TorchRec ``ShardingPlan`` back into TableShards (ranks in the shard group), to round-trip."""
    group = plan.mesh.sparse_shard
    offset = 0 if replica is None else replica * group
    out = []
    for module_plan in sharding_plan.plan.values():
        for name, ps in module_plan.items():
            if ps.sharding_type == "data_parallel":
                ranks: tuple[int, ...] = ()
            else:
                ranks = tuple(int(r) - offset for r in ps.ranks)
            out.append(TableShard(table=name, sharding_type=ps.sharding_type, ranks=ranks, compute_kernel="dense" if ps.compute_kernel == "dense" else "fused"))
    order = {t.name: i for i, t in enumerate(plan.workload.all_tables)}
    return tuple(sorted(out, key=lambda s: order[s.table]))


def as_json(sharding_plan) -> dict:
    """A plain-JSON rendering of a ShardingPlan (for reading and diffing; TorchRec loads the .pt)."""
    out: dict[str, dict] = {}
    for path, module_plan in sharding_plan.plan.items():
        mod = out.setdefault(path, {})
        for name, ps in module_plan.items():
            shards = None
            if ps.sharding_spec is not None:
                shards = [
                    {"sizes": list(m.shard_sizes), "offsets": list(m.shard_offsets), "placement": str(m.placement)}
                    for m in ps.sharding_spec.shards
                ]
            mod[name] = {"sharding_type": ps.sharding_type, "compute_kernel": ps.compute_kernel, "ranks": list(ps.ranks or []), "shards": shards}
    return out


def write_torchrec(plan: Plan, path: str | Path, *, replica: int | None = None) -> list[Path]:
    """Write ``<path>`` (``torch.save`` of the ShardingPlan) and ``<path>.json`` beside it; returns both."""
    try:
        import torch  # the [train] extra, as in to_torchrec
    except ImportError:  # pragma: no cover - depends on the install
        raise CoplanError("--export-torchrec needs torch and torchrec (pip install 'coplan[train]')") from None
    sp = to_torchrec(plan, replica=replica)
    p = Path(path)
    torch.save(sp, p)
    j = p.with_suffix(p.suffix + ".json")
    j.write_text(json.dumps(as_json(sp), indent=1) + "\n")
    return [p, j]
