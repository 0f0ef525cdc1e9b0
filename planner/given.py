"""Given plans: plans whose every choice the caller writes down (degrees, table shardings, recomputed
layers), for the trainer's tests and the unsharded reference a sharded run must reproduce.

They are made like every other plan, through :func:`coplan.planner.assemble.assemble`: priced by the
cost model's full pricer (so a given plan carries a prediction too), mesh axes mapped to tiers by
:func:`coplan.planner.mesh.mesh_axes`, and marked ``solver.status = "GIVEN"``: nothing was searched.
What a benchmark runs comes from ``coplan plan`` (with ``--pin`` for a fixed layout), not from here;
:func:`with_layers` only fixes, on such a plan, the layer choices no pin expresses.

    python -m coplan.planner.given --workload gem-tiny --topology h200-superpod-1k --world-size 4 \\
        --dense-replicate 2 --expert-parallel 2 -o plan.json
"""

from __future__ import annotations

import argparse
import sys
from typing import Iterable, Literal, Mapping, Sequence

from coplan.costmodel.flops import layer_names, recomputable_layers
from coplan.errors import CoplanError, MismatchError
from coplan.planner.assemble import assemble
from coplan.spec import (BalancingPlan, Calibration, LayerPlan, MeshPlan, Plan, SolverReport, TableShard, Topology, Workload, dump_spec,
                         load_topology, load_workload)

TablePolicy = Literal["table_wise", "row_wise", "data_parallel", "mixed"]
TableChoice = str | tuple[str, Sequence[int]]
"""A table's sharding type, or (sharding type, ranks of the sparse group holding its shards, in order)."""

GIVEN = SolverReport(status="GIVEN")
"""The solver report of a plan whose choices were given, not searched."""


def _table_kinds(workload: Workload, tables: TablePolicy | Mapping[str, TableChoice]) -> dict[str, TableChoice]:
    all_tables = workload.all_tables
    if isinstance(tables, str) and tables == "mixed":
        # Pooled tables cycle through the three shardings so a small workload exercises each. Sequence
        # tables cycle row- and table-wise only: the layouts every test built on this policy was written
        # for (data-parallel sequence tables, which also run on CPU through the trainer's own lookup path,
        # are what tables="data_parallel" exercises).
        pooled = [t for t in all_tables if t.feature_kind == "pooled"]
        seq = [t for t in all_tables if t.feature_kind == "sequence"]
        kinds = {t.name: ("table_wise", "row_wise", "data_parallel")[i % 3] for i, t in enumerate(pooled)}
        return kinds | {t.name: ("row_wise", "table_wise")[i % 2] for i, t in enumerate(seq)}
    if isinstance(tables, str):
        return {t.name: tables for t in all_tables}
    unknown = sorted(set(tables) - {t.name for t in all_tables})
    if unknown:
        raise MismatchError(f"tables {unknown[:5]} are not tables of workload '{workload.name}'")
    missing = [t.name for t in all_tables if t.name not in tables]
    if missing:
        raise MismatchError(f"{len(missing)} tables have no sharding type, e.g. {missing[:5]}")
    return dict(tables)


def _layers(workload: Workload, recompute: Iterable[str], fp8: Iterable[str] = (), also: Iterable[str] = ()) -> tuple[LayerPlan, ...]:
    """A LayerPlan for every layer the trainer can checkpoint (what the planner's plans list), and for
    each layer in ``fp8`` or ``also``, in execution order."""
    may, every = recomputable_layers(workload), layer_names(workload)
    recompute, fp8 = set(recompute), set(fp8)
    unknown = sorted(recompute - set(may))
    if unknown:
        raise MismatchError(f"recompute names {unknown} are not layers of '{workload.name}' the trainer can recompute; "
                            f"those are {list(may)}")
    unknown = sorted(fp8 - set(every))
    if unknown:
        raise MismatchError(f"fp8 names {unknown} are not layers of '{workload.name}'; layers are {list(every)}")
    if fp8 and workload.precision.fp8 == "off":
        raise MismatchError(f"fp8 layers {sorted(fp8)[:4]} given while '{workload.name}' has precision.fp8 'off'")
    keep = set(may) | fp8 | set(also)
    return tuple(LayerPlan(name=n, recompute=n in recompute, precision="fp8" if n in fp8 else "bf16") for n in every if n in keep)


def given_plan(
    workload: Workload,
    topology: Topology,
    world_size: int,
    *,
    dense_replicate: int = 1,
    expert_parallel: int = 1,
    sparse_replicate: int = 1,
    tables: TablePolicy | Mapping[str, TableChoice] = "mixed",
    recompute: Iterable[str] = (),
    balancing: Literal["none", "greedy", "karmarkar_karp"] = "karmarkar_karp",
    attention_backend: Literal["triton", "reference", "flex"] | None = None,
    calibration: Calibration | None = None,
) -> Plan:
    """A plan with the given degrees and table placement, priced.

    ``sparse_replicate``: copies of the tables (each over a sparse group of ``world_size /
    sparse_replicate`` ranks). ``tables``: one sharding type for every table, ``"mixed"`` (pooled
    tables cycle table-wise, row-wise and data-parallel, sequence tables row-wise and table-wise;
    table-wise tables go round-robin over the group's ranks), or a ``{table: sharding_type}`` or
    ``{table: (sharding_type, ranks)}`` mapping. Without ranks, row- and column-wise tables span the
    whole sparse group (TorchRec's row-wise sharding puts block ``i`` of the rows on rank ``i``),
    table-row-wise tables the group's first node. ``recompute``: layer names (``interformer.1``) whose
    activations are recomputed, among the layers the trainer can checkpoint.
    """
    if world_size < 1 or world_size % dense_replicate:
        raise MismatchError(f"dense_replicate={dense_replicate} must divide world_size={world_size}")
    dense_shard = world_size // dense_replicate
    if dense_shard % expert_parallel:
        raise MismatchError(
            f"expert_parallel={expert_parallel} must divide the FSDP shard degree {dense_shard}: "
            "experts are split over an inner group of the dp_shard ranks"
        )
    if sparse_replicate < 1 or world_size % sparse_replicate:
        raise MismatchError(f"sparse_replicate={sparse_replicate} must divide world_size={world_size}")
    sparse_shard = world_size // sparse_replicate
    kinds = _table_kinds(workload, tables)
    shards: list[TableShard] = []
    next_rank = 0
    for t in workload.all_tables:
        kind = kinds[t.name]
        ranks: tuple[int, ...] = ()
        if not isinstance(kind, str):
            kind, ranks = kind[0], tuple(kind[1])
        elif kind == "table_wise":
            ranks = (next_rank % sparse_shard,)
            next_rank += 1
        elif kind in ("row_wise", "column_wise"):
            ranks = tuple(range(sparse_shard))
        elif kind == "table_row_wise":
            ranks = tuple(range(min(topology.gpus_per_node, sparse_shard)))
        # replicated tables run TorchRec's dense kernel (FBGEMM's fused one is for sharded tables)
        shards.append(TableShard(table=t.name, sharding_type=kind, ranks=ranks,
                                 compute_kernel="dense" if kind == "data_parallel" else "fused"))
    mesh = MeshPlan(dense_shard=dense_shard, dense_replicate=dense_replicate, expert_parallel=expert_parallel,
                    sparse_shard=sparse_shard, sparse_replicate=sparse_replicate)
    kernels = workload.kernels
    if attention_backend is not None:
        kernels = kernels.model_copy(update={"attention": attention_backend})
    return _assemble(workload, topology, mesh, tuple(shards), _layers(workload, recompute), BalancingPlan(policy=balancing),
                     kernels, calibration)


def _assemble(workload, topology, mesh, tables, layers, balancing, kernels, calibration, **kw) -> Plan:
    return assemble(workload, topology, mesh=mesh, tables=tables, layers=layers, balancing=balancing, calibration=calibration,
                    kernels=kernels, solver=GIVEN, **kw)


def single_process_plan(workload: Workload, topology: Topology, **kw) -> Plan:
    """World size 1: every table table-wise on rank 0 (fused TBE), no recompute."""
    kw.setdefault("tables", "table_wise")
    return given_plan(workload, topology, 1, **kw)


def as_single_process(plan: Plan) -> Plan:
    """The same choices on one process: the unsharded reference a sharded run must reproduce.

    Table sharding types are kept (a data-parallel table stays a dense-kernel table with the same
    optimizer; table- and row-wise tables become one fused shard on rank 0), recompute and
    numerics are kept, every degree becomes 1.
    """
    kinds = {t.table: t.sharding_type for t in plan.tables}
    return given_plan(
        plan.workload,
        plan.topology,
        1,
        tables={k: ("data_parallel" if v == "data_parallel" else "table_wise") for k, v in kinds.items()} or "table_wise",
        recompute=[layer.name for layer in plan.layers if layer.recompute],
        balancing=plan.balancing.policy,
        attention_backend=plan.kernels.attention,
        calibration=plan.calibration,
    )


def with_layers(plan: Plan, *, recompute: Iterable[str] | None = None, fp8: Iterable[str] | None = None) -> Plan:
    """``plan`` (e.g. one ``coplan plan`` made) with its recomputed or fp8 layers replaced, every other
    choice kept, re-priced; for a measurement that fixes a layer choice no ``--pin`` expresses. The
    plan says so: its solver status becomes GIVEN and a note names what was fixed."""
    rec = [lp.name for lp in plan.layers if lp.recompute] if recompute is None else list(recompute)
    low = [lp.name for lp in plan.layers if lp.precision == "fp8"] if fp8 is None else list(fp8)
    layers = _layers(plan.workload, rec, low, also=[lp.name for lp in plan.layers])
    fixed = (["recompute " + (", ".join(rec) or "none")] if recompute is not None else []) + \
            (["fp8 " + (", ".join(low) or "none")] if fp8 is not None else [])
    return _assemble(plan.workload, plan.topology, plan.mesh, plan.tables, layers, plan.balancing, plan.kernels, plan.calibration,
                     precision_report=plan.precision_report if fp8 is None else None,
                     notes=(f"layers given, not planned: {'; '.join(fixed)}",) if fixed else ())


def main(argv: list[str] | None = None) -> int:
    """``python -m coplan.planner.given``: write a given plan (development and tests)."""
    p = argparse.ArgumentParser(prog="python -m coplan.planner.given", description=main.__doc__)
    p.add_argument("--workload", required=True, help="workload preset or file")
    p.add_argument("--topology", required=True, help="topology preset or file")
    p.add_argument("--world-size", type=int, default=1)
    p.add_argument("--dense-replicate", type=int, default=1)
    p.add_argument("--expert-parallel", type=int, default=1)
    p.add_argument("--sparse-replicate", type=int, default=1, help="copies of the tables (2-D sparse parallelism)")
    p.add_argument("--tables", default="mixed", choices=["table_wise", "row_wise", "data_parallel", "mixed"])
    p.add_argument("--recompute", nargs="*", default=[], help="layer names, e.g. interformer.1")
    p.add_argument("--balancing", default="karmarkar_karp", choices=["none", "greedy", "karmarkar_karp"])
    p.add_argument("--attention", default=None, choices=["triton", "reference", "flex"])
    p.add_argument("-o", "--output", required=True)
    a = p.parse_args(argv)
    try:
        plan = given_plan(
            load_workload(a.workload), load_topology(a.topology), a.world_size,
            dense_replicate=a.dense_replicate, expert_parallel=a.expert_parallel, sparse_replicate=a.sparse_replicate, tables=a.tables,
            recompute=a.recompute, balancing=a.balancing, attention_backend=a.attention,
        )
        dump_spec(plan, a.output)
    except CoplanError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {a.output}: {plan.world_size} ranks, mesh {plan.mesh.dense_replicate}x{plan.mesh.dense_shard}, "
          f"EP {plan.mesh.expert_parallel}, {len(plan.tables)} tables; predicted step {plan.predicted.step_time_s * 1e3:,.3f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


__all__ = ["as_single_process", "given_plan", "single_process_plan", "with_layers"]
