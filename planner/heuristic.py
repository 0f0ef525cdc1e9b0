"""A simple, explainable plan for pricing before (or without) the CP-SAT planner.

Used by ``coplan simulate`` to choose a reasonable plan per point of a sweep, and by ``coplan plan``
as a baseline its CP-SAT plan must never lose to (the search prices it and returns it if it is
faster). Keep it simple and monotone:

- dense: HSDP with the shard group inside the innermost tier (the NVLink domain) when the dense
  state (parameters, gradients, optimizer: 16 bytes/param with fp32 AdamW) fits in a quarter of HBM
  there, else the smallest power-of-two multiple of it that fits;
- experts: expert parallelism over the largest power of two dividing both the expert count and the
  dense shard group;
- tables: the smallest power-of-two sparse group whose share of all tables (weights + optimizer) fits
  in 40% of HBM; each table table-wise, or row-wise over enough ranks when it alone would take more
  than a quarter of one rank's share; shards placed by longest-processing-time first on
  ``max(share of lookup time, share of memory)``;
- recompute: none, or every layer when the activations do not fit;
- balancing: greedy (LPT) whenever a sequence has variable length.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from coplan.costmodel import build_context, price
from coplan.costmodel import flops as F
from coplan.costmodel.embedding import SHARDING_CODES, TableAssignment, greedy_table_wise
from coplan.planner.mesh import mesh_axes
from coplan.spec.calibration import Calibration
from coplan.spec.plan import BalancingPlan, LayerPlan, MeshPlan, TableShard
from coplan.spec.topology import Topology
from coplan.spec.workload import FixedLength, Workload


@dataclass(frozen=True, slots=True)
class HeuristicPlan:
    """The choices of :func:`heuristic_plan_choices`."""

    mesh: MeshPlan
    tables: TableAssignment | None
    layers: tuple[LayerPlan, ...]
    balancing: BalancingPlan
    reasons: tuple[str, ...]

    def table_shards(self, workload: Workload) -> tuple[TableShard, ...]:
        """The assignment as spec ``TableShard`` values (for a plan file)."""
        if self.tables is None:
            return ()
        names = [t.name for t in workload.all_tables]
        ranks: dict[int, list[int]] = {}
        for t, r in zip(self.tables.shard_table.tolist(), self.tables.shard_rank.tolist()):
            ranks.setdefault(t, []).append(r)
        inv = {v: k for k, v in SHARDING_CODES.items()}
        out = []
        for i, n in enumerate(names):
            st = inv[int(self.tables.sharding[i])]
            out.append(TableShard(table=n, sharding_type=st, ranks=() if st == "data_parallel" else tuple(ranks[i])))
        return tuple(out)


def _pow2_floor(x: int) -> int:
    return 1 << (max(1, x).bit_length() - 1)


def _divisors_pow2(world: int) -> list[int]:
    return [d for d in (1 << k for k in range(world.bit_length())) if world % d == 0]


def choose_mesh(workload: Workload, topology: Topology, world_size: int) -> tuple[MeshPlan, list[str]]:
    reasons: list[str] = []
    hbm = topology.gpu.hbm_bytes
    P, E = F.dense_params(workload)
    per_param = F.DTYPE_BYTES[workload.precision.param_dtype] * 2 + workload.optimizer.dense_state_bytes_per_param
    divs = _divisors_pow2(world_size) if world_size & (world_size - 1) == 0 else [d for d in range(1, world_size + 1) if world_size % d == 0]
    dom = min(world_size, topology.tiers[0].size)
    inside = max([d for d in divs if d <= dom] or [1])  # the largest group that stays in the NVLink domain
    ds = None
    for d in divs:
        if d < inside:
            continue
        if (P + E) * per_param / d <= 0.25 * hbm:
            ds = d
            break
    if ds is None:
        ds = world_size
        reasons.append(f"dense state {(P + E) * per_param / 1e9:.0f} GB needs the whole world as the FSDP group")
    else:
        reasons.append(f"FSDP shard group of {ds} (dense state {(P + E) * per_param / ds / 1e9:.1f} GB/rank), replicated {world_size // ds}×")
    ep = 1
    experts = [b.num_experts for b in workload.blocks if getattr(b, "type", "") == "moe"]
    if experts:
        g = math.gcd(min(experts), ds)
        ep = _pow2_floor(g) if g > 1 else 1
        while ds % ep:
            ep //= 2
        reasons.append(f"expert parallel {ep}")
    emb = sum(t.num_params * F.DTYPE_BYTES[t.dtype] for t in workload.all_tables)
    emb += sum(t.num_rows * (4 if workload.optimizer.sparse == "rowwise_adagrad" else 0) for t in workload.all_tables)
    ss = world_size
    if workload.all_tables:
        for d in divs:
            if emb / d <= 0.4 * hbm:
                ss = d
                break
        reasons.append(f"tables sharded over groups of {ss} ranks ({emb / ss / 1e9:.1f} GB/rank of {emb / 1e12:.2f} TB), {world_size // ss} replicas")
    mesh = MeshPlan(dense_shard=ds, dense_replicate=world_size // ds, expert_parallel=ep, sparse_shard=ss,
                    sparse_replicate=world_size // ss)
    return mesh.model_copy(update={"axes": mesh_axes(topology, mesh)}), reasons


def heuristic_plan_choices(
    workload: Workload, topology: Topology, world_size: int, calibration: Calibration | None = None,
) -> HeuristicPlan:
    """A reasonable plan for ``workload`` on the first ``world_size`` GPUs of ``topology``."""
    mesh, reasons = choose_mesh(workload, topology, world_size)
    varies = any(not isinstance(s.length, FixedLength) for s in workload.sequences)
    balancing = BalancingPlan(policy="greedy" if varies else "none")
    layers: tuple[LayerPlan, ...] = ()

    def attempt(ss: int):
        m = mesh.model_copy(update={"sparse_shard": ss, "sparse_replicate": world_size // ss})
        m = m.model_copy(update={"axes": mesh_axes(topology, m)})
        ctx = build_context(workload, topology, m, calibration)
        tables = greedy_table_wise(ctx) if ctx.tables.num else None
        return m, ctx, tables, price(ctx, tables, layers, balancing, detail=False)

    m, ctx, tables, cost = attempt(mesh.sparse_shard)
    if cost.memory.total - cost.memory.activations - cost.memory.recompute_peak > 0 and not cost.fits:
        full = cost.memory.activations
        layers = tuple(LayerPlan(name=n, recompute=True) for n in F.recomputable_layers(workload))
        m, ctx, tables, cost = attempt(mesh.sparse_shard)
        reasons.append(f"activations {full / 1e9:.1f} GB do not fit: every layer recomputed (now {cost.memory.activations / 1e9:.1f} GB)")
    # sparse group: from the smallest that holds the tables up to the world, keep the fastest that fits
    # (bigger groups reach further in the all-to-all but leave fewer replicas to keep in sync)
    best = ((not cost.fits, cost.step_time_s if cost.fits else cost.memory.total), m, ctx, tables, cost)
    if ctx.tables.num:
        for ss in [d for d in _divisors_pow2(world_size) if d > mesh.sparse_shard]:
            got = attempt(ss)
            c = got[3]
            key = (not c.fits, c.step_time_s if c.fits else c.memory.total)
            if key < best[0]:
                best = (key,) + got
        reasons.append(f"sparse group of {best[1].sparse_shard} ranks: the fastest that fits ({best[1].sparse_replicate} replicas)")
    _, mesh, ctx, tables, cost = best
    balancing = balancing.model_copy(update={"expected_imbalance": max(1.0, cost.imbalance)})
    return HeuristicPlan(mesh, tables, layers, balancing, tuple(reasons))


__all__ = ["HeuristicPlan", "choose_mesh", "heuristic_plan_choices"]
