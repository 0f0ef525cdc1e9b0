"""Why a ``--pin-table NAME=SHARDING`` cannot hold, in words: the table, the pin, the reason and the fix.

The shardings a table can take are the pricer's (:meth:`coplan.planner.costs.Pricer.sparse`): column-wise in a power
of two of shards that divides the table's dim, each at least ``min_cw_dim`` columns wide, no more shards than the
sparse group has ranks; row-wise over a sparse group of more than one rank; table-row-wise over a sparse group of
whole nodes, more than one, for a pooled table; data-parallel for a table whose full copy takes at most
``max_dp_fraction`` of a GPU's HBM. :func:`table_pin_problem` refuses what the table alone rules out, before any
pricing; :func:`table_pin_miss` explains a pin no mesh candidate offers, and lists what the candidates offer the
table instead (asked of the pricer itself, so the list is never a guess).
"""

from __future__ import annotations

from coplan.planner.costs import Pricer, column_wise_fits
from coplan.planner.mesh import MeshCandidate
from coplan.spec.plan import SHARDING_TYPES
from coplan.units import human_bytes


def _shard_counts(dim: int, min_cw_dim: int) -> list[int]:
    """The column-wise shard counts a table of ``dim`` columns takes (any sparse group large enough)."""
    out, k = [], 2
    while column_wise_fits(dim, k, min_cw_dim):
        out.append(k)
        k *= 2
    return out


def _takes(name: str, dim: int, counts: list[int], min_cw_dim: int) -> str:
    """What the table takes column-wise, as the fix."""
    if counts:
        return f"'{name}' (dim {dim}) takes {', '.join(f'column_wise/{k}' for k in counts)}"
    half = "its columns do not split in two" if dim % 2 else f"even 2 shards would be {dim // 2} columns wide"
    return (f"'{name}' (dim {dim}) takes no column-wise split ({half}, under the narrowest column-wise shard of "
            f"{min_cw_dim} columns): pin another sharding")


def table_pin_problem(name: str, dim: int, want: str, min_cw_dim: int) -> str | None:
    """Why ``--pin-table name=want`` cannot hold whatever the mesh (an unknown sharding, a shard count that is not one,
    or that the table's dim rules out), or None."""
    kind, slash, n = want.partition("/")
    kinds = ", ".join(SHARDING_TYPES)
    if kind not in SHARDING_TYPES:
        return f"'{kind}' is not a sharding; give one of {kinds} (or column_wise/N for N column shards)"
    if slash and kind != "column_wise":
        return (f"only column_wise takes a shard count (/N); {kind} shards over the whole sparse group: give "
                f"'{name}={kind}'")
    if kind != "column_wise":
        return None
    counts = _shard_counts(dim, min_cw_dim)
    if not slash:
        return None if counts else _takes(name, dim, counts, min_cw_dim)
    if not n.isascii() or not n.isdigit() or int(n) < 2:
        why = "the shard count N of column_wise/N is a whole number of at least 2 (one shard is table_wise)"
    elif int(n) & (int(n) - 1):
        why = "column-wise shard counts are powers of two"
    elif dim % int(n):
        why = f"the table's {dim} columns do not split into {n} equal shards"
    elif dim // int(n) < min_cw_dim:
        why = (f"{n} shards of the table's {dim} columns are {dim // int(n)} wide, under the narrowest column-wise shard "
               f"({min_cw_dim} columns)")
    else:
        return None
    return f"{why}; {_takes(name, dim, counts, min_cw_dim)}"


def table_pin_miss(pricer: Pricer, cands: list[MeshCandidate], name: str, want: str) -> str:
    """The refusal of ``--pin-table name=want`` that no mesh candidate in ``cands`` offers: why, and the shardings the
    candidates offer the table instead."""
    tables = pricer.workload.all_tables
    i = next(j for j, t in enumerate(tables) if t.name == name)
    dim = int(tables[i].dim)
    free = Pricer(pricer.workload, pricer.topology, pricer.world_size, pricer.calibration, min_cw_dim=pricer.min_cw_dim,
                  max_dp_fraction=pricer.max_dp_fraction, policy=pricer.policy)
    by_group = {c.sparse_shard: c for c in cands}  # the options depend on the sparse group, not on the micro-batches
    offered: dict[str, None] = {}
    for c in by_group.values():
        for o in free.sparse(c).options[i]:
            offered[f"column_wise/{o.num_shards}" if o.sharding_type == "column_wise" else o.sharding_type] = None
    groups = sorted(by_group)
    largest, node = groups[-1], pricer.topology.gpus_per_node
    shown = ", ".join(str(g) for g in groups[:8]) + (", ..." if len(groups) > 8 else "")
    more = "plan on more GPUs (--gpus) or let the sparse group grow (a --pin on sparse_shard or sparse_replicate)"
    kind, _, n = want.partition("/")
    if kind == "column_wise" and n and int(n) > largest:
        why = f"{n} column shards need a sparse group of at least {n} ranks, and the largest here has {largest}: {more}"
    elif kind == "column_wise" and largest < 2:
        why = f"column-wise shards need a sparse group of at least 2 ranks, and every sparse group here has 1: {more}"
    elif kind == "row_wise" and largest < 2:
        why = f"row_wise needs a sparse group of more than one rank, and every sparse group here has 1: {more}"
    elif kind == "table_row_wise" and node == 1:
        why = (f"table_row_wise splits a table within a node and across nodes, and '{pricer.topology.name}' has one GPU per "
               "node")
    elif kind == "table_row_wise" and not any(g > node and g % node == 0 for g in groups):
        why = (f"table_row_wise needs a sparse group of whole nodes, more than one ({node} GPUs each on "
               f"'{pricer.topology.name}'), and the sparse groups here have {shown} rank(s): {more}")
    elif kind == "table_row_wise":
        why = f"'{name}' is a sequence table, which TorchRec's EmbeddingCollection does not shard table-row-wise"
    elif kind == "data_parallel":
        c = next(iter(by_group.values()))
        ctx = free.context(MeshCandidate(free.world_size, free.world_size, 1, c.sparse_shard, c.micro_batches))
        copy = float(free.model.table_state_bytes(ctx)[i])
        cap = free.max_dp_fraction * free.topology.gpu.hbm_bytes
        why = (f"a full copy of '{name}' (weights and optimizer state, {human_bytes(copy)}) is over the "
               f"{human_bytes(cap)} ({free.max_dp_fraction:.0%} of a GPU's HBM) a data-parallel table may take")
    else:
        why = f"no mesh candidate offers it (sparse groups of {shown} rank(s))"
    fix = (f"pin one of the shardings '{name}' (dim {dim}) can take here: {', '.join(offered)}, or drop the pin" if offered
           else "drop the pin")
    return f"--pin-table {name}={want}: {why}; {fix}"


__all__ = ["table_pin_miss", "table_pin_problem"]
