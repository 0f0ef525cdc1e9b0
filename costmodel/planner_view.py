"""The cost model as the planner sees it: :class:`CostModel`, the handful of calls the planner makes,
each returning a typed value, so that the planner adds, takes maxima and compares, and never prices.

- :meth:`CostModel.dense_base`: what a mesh's dense part costs whatever the tables and recompute
  (memory every rank holds, the dense step alone);
- :meth:`CostModel.recompute_options`: per layer, what recomputing it costs and frees;
- :meth:`CostModel.shard_options`: every table under one sharding option, per shard, with the
  lookups' kernel launches and table-row-wise NVLink reduction the pricer's aggregates add;
- :meth:`CostModel.aggregate_scale`: seconds of one schedule task per unit of each aggregate;
- :meth:`CostModel.price`: the full pricer (:func:`coplan.costmodel.pricer.price`).

The planner receives a :class:`CostModel` (the default is this one); a test may hand it another.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from coplan.costmodel import flops as F
from coplan.costmodel.compute import imbalance
from coplan.costmodel.context import Context, Options, build_context
from coplan.costmodel.decomposed import dense_fixed_costs, layer_costs, table_option_costs
from coplan.costmodel.memory import communicator_bytes, table_state_bytes
from coplan.costmodel.pricer import emb_group_launches, loader_time, price, with_balance_group, workload_collections
from coplan.costmodel.results import SparseAggregates, StepCost
from coplan.spec import BalancingPlan, Calibration, MeshPlan, Topology, Workload

DENSE_ONLY_KINDS = ("embeddings", "embedding_optimizer", "embedding_io", "recompute_peak")
"""Memory kinds a dense-only pricing leaves out of the base every rank holds (the tables' and the recompute
peak's, which depend on the plan's other choices)."""


@dataclass(frozen=True, slots=True)
class DenseBase:
    """A mesh's dense part priced without tables and recompute."""

    base_bytes: float
    """Memory identical on every rank, without recompute and embeddings."""
    memory_parts: dict[str, float]
    """``base_bytes`` by kind."""
    groups_bytes: float
    """NCCL buffers of the sparse groups the base was priced with."""
    makespan_s: float
    """The dense step alone, without the SM-contention slowdown."""
    compute_s: float
    """Work on the compute stream of the dense part alone, without contention."""


@dataclass(frozen=True, slots=True)
class RecomputeOption:
    """Recompute of one layer."""

    name: str
    recompute_s: float
    """Forward time recomputed in backward (per step), with a MoE layer's dispatch and combine again."""
    saved_bytes: float
    """Activation bytes no longer kept (all but the layer input)."""
    peak_bytes: float
    """Activations rebuilt while the layer's backward runs."""


@dataclass(frozen=True, slots=True)
class ShardOptionCosts:
    """Every table under one sharding option, per shard and per step, as the pricer's aggregates count it."""

    fwd_s: np.ndarray
    """Forward lookups of one shard, its table-row-wise NVLink reduction and (per-table kernels) its launch included."""
    bwd_s: np.ndarray
    send_bytes: np.ndarray
    mem_bytes: np.ndarray
    """Weights, optimizer state and lookup buffers of one shard."""
    recv_bytes: np.ndarray
    allreduce_bytes: np.ndarray
    ids_recv_bytes: np.ndarray
    ids_send_bytes: np.ndarray
    state_bytes: np.ndarray
    """Weights and optimizer state of one shard."""


class CostModel:
    """The cost model's calls the planner makes (see the module docstring)."""

    def build_context(self, workload: Workload, topology: Topology, mesh: MeshPlan, calibration: Calibration | None = None,
                      *, balance_group: int | None = None) -> Context:
        return build_context(workload, topology, mesh, calibration,
                             options=Options(balance_group_ranks=balance_group) if balance_group is not None else None)

    def imbalance(self, ctx: Context, policy: str) -> float:
        return float(imbalance(ctx, policy))

    def with_balance_group(self, ctx: Context, group: int) -> Context:
        """``ctx`` balancing in groups of ``group`` ranks (sharing its caches)."""
        return with_balance_group(ctx, group)

    def loader_s(self, ctx: Context) -> float:
        """The data loader's seconds per step (its balance group's rows, the trainer's reader processes)."""
        return loader_time(ctx).step_s

    def price(self, ctx: Context, tables=None, layers=None, balancing: BalancingPlan | None = None, kernels=None, **kw) -> StepCost:
        return price(ctx, tables, layers, balancing, kernels, **kw)

    def aggregates_at(self, x: dict[str, float], *, mem_bytes: float = 0.0, recv_bytes: float = 0.0, kernels: float = 1.0
                      ) -> SparseAggregates:
        return SparseAggregates.at(x, mem_bytes=mem_bytes, recv_bytes=recv_bytes, kernels=kernels)

    def communicator_bytes(self, ctx: Context | None = None) -> float:
        """NCCL buffers of one communicator (``ctx``'s options, else the defaults)."""
        return (ctx.options if ctx is not None else Options()).nccl_bytes_per_communicator

    def sparse_groups_bytes(self, ctx: Context) -> float:
        """NCCL buffers of the sparse shard and replica groups' communicators."""
        return communicator_bytes(ctx)

    def table_state_bytes(self, ctx: Context) -> np.ndarray:
        return table_state_bytes(ctx)

    def dense_base(self, ctx: Context, balancing: BalancingPlan) -> DenseBase:
        cost = price(ctx, (), (), balancing, detail=False, include_embeddings=False, contention=False) if ctx.tables.num else \
            price(ctx, None, (), balancing, detail=False, contention=False)
        mem = cost.memory.as_dict()
        for k in DENSE_ONLY_KINDS:
            mem.pop(k, None)
        return DenseBase(float(sum(mem.values())), mem, communicator_bytes(ctx), float(cost.step_time_s), float(cost.perf.compute_s))

    def recompute_options(self, ctx: Context, policy: str) -> tuple[RecomputeOption, ...]:
        """The layers that may be recomputed (:func:`coplan.costmodel.flops.recomputable_layers`)."""
        lcs = layer_costs(ctx, policy=policy)
        ep = {}
        if ctx.mesh.expert_parallel > 1:
            fixed = dense_fixed_costs(ctx)
            ep = {n: float(x) / 2 for n, x in zip(fixed.layers, fixed.ep_all_to_all_s)}  # a forward pair of the four
        may = set(F.recomputable_layers(ctx.workload))
        return tuple(
            RecomputeOption(lc.name, lc.recompute_s + ep.get(lc.name, 0.0), max(0.0, lc.activation_bytes - lc.recomputed_activation_bytes),
                            lc.activation_bytes)
            for lc in lcs if lc.name in may
        )

    def lookup_kernels(self, ctx: Context) -> float:
        """Embedding kernel groups of a rank that holds shards, as the planner prices them
        (:attr:`SparseAggregates.emb_kernels`): with the fused kernel, the workload's TorchRec collections
        (exact on one sparse rank; above, a rank may look up in fewer); with per-table kernels one (their
        launches are in each shard's time)."""
        return workload_collections(ctx) if ctx.workload.kernels.embedding == "fused" else 1.0

    def lookup_launch_s(self, ctx: Context) -> tuple[float, float]:
        """(forward, backward) launch seconds per step of one rank's lookups with the fused kernel (each
        TorchRec collection's kernels, :func:`~coplan.costmodel.pricer.emb_group_launches`, for all its
        shards; 0 without tables or with per-table kernels, whose launches are in each shard's time)."""
        launch = ctx.eff.launch_s.get("embedding", 5e-6)
        M = ctx.micro_batches
        if ctx.workload.kernels.embedding != "fused" or not ctx.tables.num:
            return (0.0, 0.0)
        ef, eb = emb_group_launches(True)
        n = self.lookup_kernels(ctx)
        return (ef * n * launch * M, eb * n * launch * M)

    def shard_options(self, ctx: Context, kind: str, k: int) -> ShardOptionCosts:
        cc = table_option_costs(ctx, kind, k)
        t0 = ctx.topology.tiers[0]
        t0cap = t0.bw_bytes_per_s * ctx.eff.collective.get((t0.name, "all_to_all"), 1.0)
        launch = ctx.eff.launch_s.get("embedding", 5e-6)
        per_shard = 0.0 if ctx.workload.kernels.embedding == "fused" else launch * ctx.micro_batches  # each shard launches its own
        intra = cc.intra_node_bytes / t0cap
        return ShardOptionCosts(
            fwd_s=cc.fwd_s + intra + per_shard, bwd_s=cc.bwd_s + intra + 2 * per_shard, send_bytes=cc.send_bytes,
            mem_bytes=cc.weight_bytes + cc.optimizer_bytes + cc.io_bytes, recv_bytes=cc.recv_bytes, allreduce_bytes=cc.allreduce_bytes,
            ids_recv_bytes=cc.ids_recv_bytes, ids_send_bytes=cc.ids_send_bytes, state_bytes=cc.weight_bytes + cc.optimizer_bytes,
        )

    def aggregate_scale(self, ctx: Context) -> dict[str, float]:
        """Seconds of one schedule task per raw unit of each aggregate (1/M for lookups; the all-to-all's
        seconds per byte over M, ...); 0 where the collective is trivial."""
        M = ctx.micro_batches
        a2a = ctx.model("sparse_shard", "all_to_all")
        world_ar = ctx.model("world", "all_reduce")
        rep = ctx.model("sparse_replicate", "all_reduce")
        every = ctx.workload.optimizer.sparse_sync_interval_steps
        return {"fwd": 1.0 / M, "bwd": 1.0 / M, "a2a": 0.0 if a2a.trivial else a2a.s_per_byte / M,
                "ids": 0.0 if a2a.trivial else a2a.s_per_byte / M, "dp": 0.0 if world_ar.trivial else world_ar.s_per_byte,
                "sync": 0.0 if rep.trivial else rep.s_per_byte / every}

    def aggregates_of_ranks(self, fwd_s: np.ndarray, bwd_s: np.ndarray, loads: np.ndarray, memory_bytes: np.ndarray, *,
                            recv_bytes: float, recv_factor: float, ids_send_bytes: float, dp_bytes: float, held: bool,
                            kernels: float = 1.0) -> SparseAggregates:
        """The aggregates of a placement given per rank: its lookups (launches included), ``loads`` (ranks ×
        (fwd, bwd, send bytes, id bytes received, sync bytes)) and shard memory, and what every rank
        receives and sends."""
        return SparseAggregates.of_ranks(fwd_s, bwd_s, loads, memory_bytes, recv_bytes=recv_bytes, recv_factor=recv_factor,
                                         ids_send_bytes=ids_send_bytes, dp_bytes=dp_bytes, held=held, kernels=kernels)


COST_MODEL = CostModel()
"""The installed cost model."""


__all__ = ["COST_MODEL", "CostModel", "DenseBase", "RecomputeOption", "ShardOptionCosts"]
