"""Which embedding layouts the trainer runs, decided from the plan alone (torch-free).

``coplan train`` calls :func:`check_table_layouts` before torchrun starts its workers, and the workers'
sharding code (:mod:`.embedding`) raises the same messages through :func:`table_problem`, so a plan the
trainer cannot run is refused once, with one message, before any process is spawned.

Every sharding type the planner emits runs on CUDA and on CPU (gloo): table-wise, row-wise, column-wise
and data-parallel for pooled and sequence tables, table-row-wise for pooled tables (TorchRec's
EmbeddingCollection has none, and the planner never offers it for sequence tables). On CPU, FBGEMM's
dense (data-parallel) sequence lookup returns one row per bag instead of one per id, so the trainer
gives those lookups a CPU path of its own (:func:`coplan.trainer.distributed.embedding.cpu_sequence_lookups`).

"Node" means the plan's node, not the launch's: table-row-wise shards span ``node_group_size(plan)``
ranks of the sparse group (the topology's GPUs per node, at most the group), which is what the planner
placed them on, whatever ``--device cpu`` launches on one machine.
"""

from __future__ import annotations

from coplan.errors import MismatchError
from coplan.spec import Plan
from coplan.spec.plan import TableShard


def node_group_size(plan: Plan) -> int:
    """Ranks of one node within a sparse group: table-row-wise shards cover one such block."""
    return max(1, min(plan.topology.gpus_per_node, plan.mesh.sparse_shard))


def table_problem(ts: TableShard, *, dim: int, is_sequence: bool, group_size: int, node_size: int) -> str | None:
    """Why the trainer cannot run this table's sharding (None: it can). ``ranks`` are ranks of the sparse group."""
    kind, ranks = ts.sharding_type, list(ts.ranks)
    where = f"table '{ts.table}'"
    if kind == "data_parallel":
        return None
    if ts.compute_kernel != "fused":
        return (f"{where}: compute_kernel '{ts.compute_kernel}' for a {kind} table; the trainer shards tables with "
                "FBGEMM's fused kernel (dense is for data_parallel tables)")
    bad = [r for r in ranks if r >= group_size]
    if bad:
        return f"{where}: ranks {bad} are outside the sparse group of {group_size}"
    if kind == "row_wise" and ranks != list(range(group_size)):
        return (f"{where}: row-wise shards must cover the sparse group in order (ranks 0..{group_size - 1}: TorchRec "
                f"sends row block i to rank i); got {ranks}")
    if kind == "table_row_wise":
        if is_sequence:
            return f"{where}: table_row_wise for a sequence table (TorchRec's EmbeddingCollection has no table-row-wise sharding)"
        if group_size % node_size:
            return f"{where}: table_row_wise needs nodes of {node_size} ranks to tile the sparse group of {group_size}"
        first = ranks[0] // node_size * node_size
        node = list(range(first, first + node_size))
        if ranks != node:
            return f"{where}: table-row-wise shards must cover one node's ranks in order ({node}); got {ranks}"
    if kind == "column_wise" and dim % len(ranks):
        return f"{where}: dim {dim} does not split evenly over {len(ranks)} column-wise shards"
    return None


def table_problems(plan: Plan) -> list[str]:
    """Every table of the plan the trainer cannot run as sharded, one message each."""
    tables = {t.name: t for t in plan.workload.all_tables}
    if not plan.tables and tables:
        return ["the plan shards no table ('tables' is empty); re-plan with coplan plan"]
    out = []
    for ts in plan.tables:
        t = tables[ts.table]
        p = table_problem(ts, dim=t.dim, is_sequence=t.feature_kind == "sequence", group_size=plan.mesh.sparse_shard,
                          node_size=node_group_size(plan))
        if p:
            out.append(p)
    return out


def check_table_layouts(plan: Plan) -> None:
    problems = table_problems(plan)
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise MismatchError("; ".join(problems[:3]) + more + "; re-plan (or pin another sharding with --pin-table)")


__all__ = ["check_table_layouts", "node_group_size", "table_problem", "table_problems"]
