"""Hand-built plans for tests and development: a valid :class:`~coplan.spec.Plan` without the planner.

The planner (CP-SAT over a cost model) is what chooses plans; these helpers only *write down* a plan
whose choices are given explicitly, so that the trainer can be exercised on every kind of
parallelism it supports (table-wise, row-wise and data-parallel tables, HSDP, expert parallelism,
recompute) before and independently of the planner. Nothing here predicts a cost.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Iterable, Literal, Mapping

from coplan import __version__
from coplan.errors import MismatchError
from coplan.spec import LayerPlan, MeshAxis, MeshPlan, Plan, TableShard, Topology, Workload, spec_sha256
from coplan.spec.plan import BalancingPlan
from coplan.spec.workload import InterFormerBlock, KunlunBlock, MoEBlock, TransformerBlock

TablePolicy = Literal["table_wise", "row_wise", "data_parallel", "mixed"]


def layer_names(workload: Workload) -> list[str]:
    """Every ``<block>.<layer index>`` of the workload's stacked blocks (what a LayerPlan names)."""
    names: list[str] = []
    for b in workload.blocks:
        if isinstance(b, (InterFormerBlock, KunlunBlock, MoEBlock, TransformerBlock)):
            names += [f"{b.name}.{i}" for i in range(b.num_layers)]
    return names


def _axes(topology: Topology, sizes: list[tuple[str, int]]) -> tuple[MeshAxis, ...]:
    """The tiers each axis's groups cross; ``sizes`` are outermost first, ranks innermost-axis-fastest.

    A group of ``n`` ranks ``stride`` apart crosses tier ``i`` when two of its members share one
    unit of tier ``i`` but sit in different units of the tier below: ``stride < below(i + 1)`` and
    ``stride * n > below(i)``.
    """
    out: list[MeshAxis] = []
    stride = 1
    for name, size in reversed(sizes):
        crossed = tuple(
            t.name
            for i, t in enumerate(topology.tiers)
            if stride < topology.gpus_below(i + 1) and stride * size > topology.gpus_below(i)
        )
        out.append(MeshAxis(name=name, size=size, tiers=crossed or (topology.tiers[0].name,)))
        stride *= size
    return tuple(reversed(out))


def make_plan(
    workload: Workload,
    topology: Topology,
    world_size: int,
    *,
    dense_replicate: int = 1,
    expert_parallel: int = 1,
    tables: TablePolicy | Mapping[str, str] = "mixed",
    recompute: Iterable[str] = (),
    balancing: Literal["none", "greedy", "karmarkar_karp"] = "karmarkar_karp",
    attention_backend: Literal["triton", "reference", "flex"] | None = None,
) -> Plan:
    """A plan with the given degrees and table placement.

    ``tables``: one sharding type for every table, ``"mixed"`` (pooled tables cycle table-wise,
    row-wise and data-parallel, sequence tables row-wise and table-wise, so a small workload exercises
    all of them; table-wise tables go round-robin over the ranks), or a ``{table: sharding_type}`` mapping. Row-wise tables span the whole sparse
    group (TorchRec's row-wise sharding puts block ``i`` of the rows on rank ``i``).
    ``recompute``: layer names (``interformer.1``) whose activations are recomputed.
    """
    if world_size < 1 or world_size % dense_replicate:
        raise MismatchError(f"dense_replicate={dense_replicate} must divide world_size={world_size}")
    dense_shard = world_size // dense_replicate
    if dense_shard % expert_parallel:
        raise MismatchError(
            f"expert_parallel={expert_parallel} must divide the FSDP shard degree {dense_shard}: "
            "experts are split over an inner group of the dp_shard ranks"
        )
    sparse_shard = world_size  # one copy of the tables over every rank (sparse_replicate = 1)
    all_tables = workload.all_tables
    if isinstance(tables, str) and tables == "mixed":
        # sequence tables stay sharded: TorchRec's dense (data-parallel) sequence kernel does not run on CPU
        pooled = [t for t in all_tables if t.feature_kind == "pooled"]
        seq = [t for t in all_tables if t.feature_kind == "sequence"]
        kinds = {t.name: ("table_wise", "row_wise", "data_parallel")[i % 3] for i, t in enumerate(pooled)}
        kinds |= {t.name: ("row_wise", "table_wise")[i % 2] for i, t in enumerate(seq)}
    elif isinstance(tables, str):
        kinds = {t.name: tables for t in all_tables}
    else:
        unknown = sorted(set(tables) - {t.name for t in all_tables})
        if unknown:
            raise MismatchError(f"tables {unknown[:5]} are not tables of workload '{workload.name}'")
        missing = [t.name for t in all_tables if t.name not in tables]
        if missing:
            raise MismatchError(f"{len(missing)} tables have no sharding type, e.g. {missing[:5]}")
        kinds = dict(tables)
    shards: list[TableShard] = []
    next_rank = 0
    for t in all_tables:
        kind = kinds[t.name]
        if kind == "table_wise":
            ranks: tuple[int, ...] = (next_rank % sparse_shard,)
            next_rank += 1
        elif kind in ("row_wise", "column_wise"):
            ranks = tuple(range(sparse_shard))
        elif kind == "table_row_wise":
            per_node = min(topology.gpus_per_node, sparse_shard)
            ranks = tuple(range(per_node))
        else:
            ranks = ()
        # replicated tables run TorchRec's dense kernel (FBGEMM's fused one is for sharded tables)
        shards.append(TableShard(table=t.name, sharding_type=kind, ranks=ranks,
                                 compute_kernel="dense" if kind == "data_parallel" else "fused"))
    names = layer_names(workload)
    recompute = set(recompute)
    unknown = sorted(recompute - set(names))
    if unknown:
        raise MismatchError(f"recompute names {unknown} are not layers of '{workload.name}'; layers are {names}")
    layers = tuple(LayerPlan(name=n, recompute=n in recompute) for n in names)
    mesh = MeshPlan(
        dense_shard=dense_shard,
        dense_replicate=dense_replicate,
        expert_parallel=expert_parallel,
        sparse_shard=sparse_shard,
        sparse_replicate=1,
        axes=_axes(topology, [("dp_replicate", dense_replicate), ("dp_shard", dense_shard)]),
    )
    kernels = workload.kernels
    if attention_backend is not None:
        kernels = kernels.model_copy(update={"attention": attention_backend})
    return Plan(
        coplan_version=__version__,
        created_utc=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        topology=topology,
        workload=workload,
        topology_sha256=spec_sha256(topology),
        workload_sha256=spec_sha256(workload),
        world_size=world_size,
        mesh=mesh,
        tables=tuple(shards),
        layers=layers,
        balancing=BalancingPlan(policy=balancing),
        kernels=kernels,
        precision=workload.precision,
    )


def single_process_plan(workload: Workload, topology: Topology, **kw) -> Plan:
    """World size 1: every table table-wise on rank 0 (fused TBE), no recompute."""
    kw.setdefault("tables", "table_wise")
    return make_plan(workload, topology, 1, **kw)


def as_single_process(plan: Plan) -> Plan:
    """The same choices on one process: the unsharded reference a sharded run must reproduce.

    Table sharding types are kept (a data-parallel table stays a dense-kernel table with the same
    optimizer; table- and row-wise tables become one fused shard on rank 0), recompute and
    numerics are kept, every degree becomes 1.
    """
    kinds = {t.table: t.sharding_type for t in plan.tables}
    return make_plan(
        plan.workload,
        plan.topology,
        1,
        tables={k: ("data_parallel" if v == "data_parallel" else "table_wise") for k, v in kinds.items()} or "table_wise",
        recompute=[layer.name for layer in plan.layers if layer.recompute],
        balancing=plan.balancing.policy,
        attention_backend=plan.kernels.attention,
    )


def main(argv: list[str] | None = None) -> int:
    """``python -m coplan.trainer.plans``: write a hand-built plan (development and tests)."""
    import argparse

    from coplan.spec import dump_spec, load_topology, load_workload

    p = argparse.ArgumentParser(prog="python -m coplan.trainer.plans", description=main.__doc__)
    p.add_argument("--workload", required=True, help="workload preset or file")
    p.add_argument("--topology", required=True, help="topology preset or file")
    p.add_argument("--world-size", type=int, default=1)
    p.add_argument("--dense-replicate", type=int, default=1)
    p.add_argument("--expert-parallel", type=int, default=1)
    p.add_argument("--tables", default="mixed", choices=["table_wise", "row_wise", "data_parallel", "mixed"])
    p.add_argument("--recompute", nargs="*", default=[], help="layer names, e.g. interformer.1")
    p.add_argument("--balancing", default="karmarkar_karp", choices=["none", "greedy", "karmarkar_karp"])
    p.add_argument("--attention", default=None, choices=["triton", "reference", "flex"])
    p.add_argument("-o", "--output", required=True)
    a = p.parse_args(argv)
    plan = make_plan(
        load_workload(a.workload), load_topology(a.topology), a.world_size,
        dense_replicate=a.dense_replicate, expert_parallel=a.expert_parallel, tables=a.tables,
        recompute=a.recompute, balancing=a.balancing, attention_backend=a.attention,
    )
    dump_spec(plan, a.output)
    print(f"wrote {a.output}: {plan.world_size} ranks, mesh {plan.mesh.dense_replicate}x{plan.mesh.dense_shard}, "
          f"EP {plan.mesh.expert_parallel}, {len(plan.tables)} tables")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


__all__ = ["as_single_process", "layer_names", "make_plan", "single_process_plan"]
