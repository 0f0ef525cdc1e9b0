"""From the cost model to the solver's figures: one :class:`~coplan.planner.pricing.CandidatePricing`
per mesh candidate, built from ``coplan.costmodel`` (the planner never prices anything itself).

- The dense part of a candidate (dense shard × expert-parallel degree) is the cost model's step with
  no embeddings (``price(..., include_embeddings=False)``): dense compute with the jagged imbalance
  of the balancing policy, exposed FSDP/HSDP/EP communication, optimizer; and its memory.
  Recompute adds each layer's forward again (``layer_costs``) and trades activations for the layer
  input; MoE layers also dispatch and combine again.
- The sparse part depends only on the shard group size: every table's options are priced at once
  (``table_option_costs``), and the output all-to-all's alpha-beta model over the placed group
  converts bytes to seconds. The per-call latencies and kernel launches, identical on every rank,
  join the base time.

Dominated options (no better in any figure, no fewer shards) are dropped before solving.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from coplan.planner.mesh import MeshCandidate
from coplan.planner.pricing import CandidatePricing, LayerOption, ShardOption
from coplan.spec import BalancingPlan, Calibration, MeshPlan, Topology, Workload
from coplan.spec.workload import FixedLength

POLICY_ORDER = ("greedy", "karmarkar_karp", "none")
"""Balancing policies in order of preference when their expected imbalance ties."""


@dataclass(frozen=True, slots=True)
class DenseInfo:
    """The dense part of one (dense shard, expert-parallel) pair."""

    base_time_s: float
    base_bytes: float
    layers: tuple[LayerOption, ...]
    memory_parts: dict[str, float]
    sparse_groups_bytes: float
    """NCCL buffers of the sparse groups the base memory was priced with (swapped per candidate)."""


@dataclass(frozen=True, slots=True)
class SparseInfo:
    """The sparse part of one shard-group size."""

    options: tuple[tuple[ShardOption, ...], ...]
    node_size: int
    a2a_s_per_byte: float
    fixed_time_s: float
    """Per-call latencies of the output all-to-alls and the lookup kernels' launches, per step."""
    dp_s_per_byte: float
    recv_factor: float
    recv_mem_factor: float
    groups_bytes: float
    """NCCL buffers of the sparse shard and replica groups."""


@dataclass(slots=True)
class Pricer:
    """Builds and caches candidate pricings for one (workload, topology, world size, calibration)."""

    workload: Workload
    topology: Topology
    world_size: int
    calibration: Calibration | None = None
    min_cw_dim: int = 32
    """Narrowest column-wise shard (TorchRec's default enumerator stops at 128; FBGEMM takes any multiple of 4)."""
    max_dp_fraction: float = 0.02
    """Data-parallel only for tables whose copy takes at most this share of HBM."""
    policy: str | None = None
    """Balancing policy; None: the one of least expected imbalance."""
    table_pins: dict[str, str] = field(default_factory=dict)
    """Table name -> the sharding it must take (``--pin-table``): a sharding type, or
    ``column_wise/N`` for N column shards."""
    rho: float = 1.0
    _dense: dict = field(default_factory=dict)
    _sparse: dict = field(default_factory=dict)
    _ctx: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.policy is None:
            self.policy, self.rho = self._choose_policy()
        else:
            self.rho = self._rho(self.policy)

    # ------------------------------------------------------------------ contexts
    def mesh_plan(self, c: MeshCandidate) -> MeshPlan:
        from coplan.costmodel.heuristic import mesh_axes

        m = MeshPlan(dense_shard=c.dense_shard, dense_replicate=c.dense_replicate, expert_parallel=c.expert_parallel,
                     sparse_shard=c.sparse_shard, sparse_replicate=c.sparse_replicate, micro_batches=c.micro_batches)
        return m.model_copy(update={"axes": mesh_axes(self.topology, m)})

    def context(self, c: MeshCandidate):
        from coplan.costmodel import build_context

        ctx = self._ctx.get(c)
        if ctx is None:
            ctx = build_context(self.workload, self.topology, self.mesh_plan(c), self.calibration)
            if len(self._ctx) > 256:
                self._ctx.clear()
            self._ctx[c] = ctx
        return ctx

    def _rho(self, policy: str) -> float:
        from coplan.costmodel import imbalance

        ctx = self.context(MeshCandidate(self.world_size, self.world_size, 1, self.world_size, self._mb0))
        return float(imbalance(ctx, policy))

    @property
    def _mb0(self) -> int:
        from coplan.planner.mesh import micro_batch_counts

        return micro_batch_counts(self.workload, self.world_size)[0]

    def _choose_policy(self) -> tuple[str, float]:
        varies = any(not isinstance(s.length, FixedLength) for s in self.workload.sequences)
        if not varies:
            return "none", 1.0
        rhos = {p: self._rho(p) for p in POLICY_ORDER}
        best = min(rhos.values())
        for p in POLICY_ORDER:  # the first within 0.01% of the best
            if rhos[p] <= best * (1 + 1e-4):
                return p, rhos[p]
        return "greedy", rhos["greedy"]  # pragma: no cover

    @property
    def balancing(self) -> BalancingPlan:
        return BalancingPlan(policy=self.policy, expected_imbalance=max(1.0, self.rho))  # type: ignore[arg-type]

    # ------------------------------------------------------------------ dense
    def _groups_bytes(self, c: MeshCandidate) -> float:
        from coplan.costmodel import Options

        per = Options().nccl_bytes_per_communicator
        return per * ((c.sparse_shard > 1) + (c.sparse_replicate > 1))

    def dense(self, c: MeshCandidate) -> DenseInfo:
        """Dense figures of the candidate's (dense shard, expert-parallel) pair (cached)."""
        from coplan.costmodel import layer_costs, price

        key = (c.dense_shard, c.expert_parallel, c.micro_batches)
        hit = self._dense.get(key)
        if hit is not None:
            return hit
        ctx = self.context(c)
        cost = price(ctx, (), (), self.balancing, detail=False, include_embeddings=False) if ctx.tables.num else \
            price(ctx, None, (), self.balancing, detail=False)
        mem = cost.memory.as_dict()
        for k in ("embeddings", "embedding_optimizer", "embedding_io", "recompute_peak"):
            mem.pop(k, None)
        base_bytes = float(sum(mem.values()))
        lcs = layer_costs(ctx, policy=self.policy)
        ep = {}
        if c.expert_parallel > 1:
            from coplan.costmodel import dense_fixed_costs

            fixed = dense_fixed_costs(ctx)
            ep = {n: float(x) / 2 for n, x in zip(fixed.layers, fixed.ep_all_to_all_s)}  # a forward pair of the four
        layers = tuple(
            LayerOption(lc.name, lc.recompute_s + ep.get(lc.name, 0.0), max(0.0, lc.activation_bytes - lc.recomputed_activation_bytes), lc.activation_bytes)
            for lc in lcs
        )
        info = DenseInfo(float(cost.step_time_s), base_bytes, layers, mem, self._groups_bytes(c))
        self._dense[key] = info
        return info

    # ------------------------------------------------------------------ sparse
    def sparse(self, c: MeshCandidate) -> SparseInfo:
        """Every table's options for the candidate's shard group size (cached per size)."""
        from coplan.costmodel import table_option_costs

        S = c.sparse_shard
        hit = self._sparse.get((S, c.micro_batches))
        if hit is not None:
            return hit
        ctx = self.context(MeshCandidate(self.world_size, self.world_size, 1, S, c.micro_batches))
        ta = ctx.tables
        n = ta.num
        M = ctx.micro_batches
        hbm = self.topology.gpu.hbm_bytes
        gpn = self.topology.gpus_per_node
        g = min(gpn, S)
        t0 = self.topology.tiers[0]
        t0cap = t0.bw_bytes_per_s * ctx.eff.collective.get((t0.name, "all_to_all"), 1.0)
        a2a = ctx.model("sparse_shard", "all_to_all")
        world_ar = ctx.model("world", "all_reduce")
        launch = ctx.eff.launch_s.get("embedding", 5e-6)
        fused = self.workload.kernels.embedding == "fused"
        opts: list[list[ShardOption]] = [[] for _ in range(n)]

        def add(kind: str, k: int, mask: np.ndarray) -> None:
            cc = table_option_costs(ctx, kind, k)
            intra = cc.intra_node_bytes / t0cap
            mem = cc.weight_bytes + cc.optimizer_bytes + cc.io_bytes
            for i in np.flatnonzero(mask):
                opts[i].append(ShardOption(
                    kind, int(k if kind not in ("row_wise", "data_parallel") else S), float(cc.fwd_s[i] + intra[i]), float(cc.bwd_s[i] + intra[i]),
                    float(cc.send_bytes[i]), float(mem[i]), float(cc.recv_bytes[i]), float(cc.allreduce_bytes[i]),
                ))

        everything = np.ones(n, dtype=bool)
        add("table_wise", 1, everything)
        k = 2
        while k <= S:
            ok = (ta.dim % k == 0) & (ta.dim / k >= self.min_cw_dim)
            if not ok.any():
                break
            add("column_wise", k, ok)
            k *= 2
        if S > 1:
            add("row_wise", S, everything)
        if S > g > 1 and S % g == 0:
            add("table_row_wise", g, ~ta.is_seq)  # TorchRec's EmbeddingCollection has no table-row-wise
        dp_mem = (ta.rows * ta.dim * ta.wbytes + ta.rows * (ta.state_row_fixed + ta.state_per_elem * ta.dim))
        add("data_parallel", 1, dp_mem <= self.max_dp_fraction * hbm)
        if self.table_pins:
            opts = self._apply_pins(opts, S)
        options = tuple(tuple(_prune(o)) for o in opts)
        info = SparseInfo(
            options=options, node_size=g if S % g == 0 else 0,
            a2a_s_per_byte=2.0 * a2a.s_per_byte,  # forward and backward, each moving A/M per micro-batch, M times
            fixed_time_s=(2 * M * a2a.latency_s if S > 1 else 0.0) + (3 * M * launch if fused else 0.0),
            dp_s_per_byte=world_ar.s_per_byte, recv_factor=self.rho, recv_mem_factor=2.0 * self.rho / M,
            groups_bytes=self._groups_bytes(c),
        )
        self._sparse[(S, c.micro_batches)] = info
        return info

    def _apply_pins(self, opts: list[list[ShardOption]], S: int) -> list[list[ShardOption]]:
        """Keep only the pinned sharding of each pinned table; a pin no option of this group size
        satisfies leaves the table with no option (the candidate is then infeasible, and the search says
        which pin no candidate could take)."""
        idx = {t.name: i for i, t in enumerate(self.workload.all_tables)}
        out = list(opts)
        for name, want in self.table_pins.items():
            i = idx[name]
            kind, _, k = want.partition("/")
            out[i] = [o for o in opts[i] if o.sharding_type == kind and (not k or o.num_shards == int(k))]
        return out

    # ------------------------------------------------------------------ candidates
    def candidate(self, c: MeshCandidate) -> CandidatePricing:
        from coplan.costmodel import Options

        d = self.dense(c)
        s = self.sparse(c)
        # a data-parallel table adds the world all-reduce's communicator; reserve it whenever one may be chosen
        dp_comm = Options().nccl_bytes_per_communicator if any(o.sharding_type == "data_parallel" for opts in s.options for o in opts) else 0.0
        return CandidatePricing(
            mesh=c, node_size=s.node_size, base_time_s=d.base_time_s + s.fixed_time_s,
            base_bytes=d.base_bytes - d.sparse_groups_bytes + s.groups_bytes + dp_comm,
            capacity_bytes=self.topology.gpu.usable_hbm_bytes, layers=d.layers, options=s.options,
            table_names=tuple(t.name for t in self.workload.all_tables),
            a2a_s_per_byte=s.a2a_s_per_byte, recv_factor=s.recv_factor, recv_mem_factor=s.recv_mem_factor,
            dp_s_per_byte=s.dp_s_per_byte, memory_parts=dict(d.memory_parts),
        )


def _dominates(a: ShardOption, b: ShardOption, group: int) -> bool:
    ca = a.num_shards
    cb = b.num_shards
    if not (a.placement == b.placement or a.placement == "rank"):
        return False
    return (ca <= cb and a.fwd_s <= b.fwd_s and a.bwd_s <= b.bwd_s and a.send_bytes <= b.send_bytes and a.mem_bytes <= b.mem_bytes
            and a.recv_bytes <= b.recv_bytes and a.allreduce_bytes <= b.allreduce_bytes)


def _prune(opts: list[ShardOption]) -> list[ShardOption]:
    """Drop options another option beats or equals in every figure (the first of equals stays)."""
    keep = []
    for i, b in enumerate(opts):
        dominated = False
        for j, a in enumerate(opts):
            if i == j:
                continue
            if _dominates(a, b, 0) and (not _dominates(b, a, 0) or j < i):
                dominated = True
                break
        if not dominated:
            keep.append(b)
    return keep
