"""From the cost model to the solver's figures: one :class:`~coplan.planner.pricing.CandidatePricing`
per mesh candidate, built from ``coplan.costmodel`` (the planner never prices anything itself).

- The sparse part depends only on the shard group size and the micro-batch count: every table's
  options are priced at once (``table_option_costs``) as per-shard loads (lookup seconds, bytes sent
  and received, replicated state) and memory.
- The dense part (dense shard × expert-parallel × micro-batches) gives the memory every rank holds
  and the recompute options: each layer's forward again (``layer_costs``), traded for its activations.
- The step is the cost model's full pricer: :meth:`Pricer.price` prices a solution by the aggregates
  it adds (``price(..., aggregates=...)``), and every pricing returns the critical path of the
  schedule as a cut (:class:`~coplan.costmodel.results.StepCut`). A candidate starts with the cut of
  its floor point (every aggregate at the least any solution can give it), which also bounds it from
  below; the search adds the cut of each solution it prices.

Dominated options (no better in any figure, no fewer shards) are dropped before solving. Every figure
comes from the :class:`~coplan.costmodel.CostModel` the :class:`Pricer` is given (the installed one by default).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from coplan.costmodel import COST_MODEL, CostModel, SparseAggregates, StepCost
from coplan.costmodel.context import Context
from coplan.planner.mesh import MeshCandidate, mesh_axes, micro_batch_counts
from coplan.planner.pricing import LOADS, Assignment, CandidatePricing, LayerOption, ShardOption, copies, loads
from coplan.spec import BalancingPlan, Calibration, LayerPlan, MeshPlan, Topology, Workload
from coplan.spec.workload import FixedLength

POLICY_ORDER = ("greedy", "karmarkar_karp", "none")
"""Balancing policies in order of preference when their expected imbalance ties."""


def column_wise_fits(dim, k: int, min_cw_dim: int):
    """Whether ``k`` column-wise shards fit a table of ``dim`` columns (elementwise over an array of dims): the
    columns split into ``k`` equal shards, each at least ``min_cw_dim`` wide. The planner offers ``k`` = 2, 4, 8, ...
    while some table fits (:meth:`Pricer.sparse`); ``--pin-table`` refusals list the same counts
    (:mod:`coplan.planner.pins`)."""
    return (dim % k == 0) & (dim / k >= min_cw_dim)


@dataclass(frozen=True, slots=True)
class DenseInfo:
    """The dense part of one (dense shard, expert-parallel, micro-batches) triple."""

    base_bytes: float
    layers: tuple[LayerOption, ...]
    memory_parts: dict[str, float]
    sparse_groups_bytes: float
    """NCCL buffers of the sparse groups the base memory was priced with (swapped per candidate)."""
    makespan_s: float = 0.0
    """The dense part's step alone, without the SM-contention slowdown: every plan of these dense degrees
    takes at least this (adding the tables' tasks to the schedule only delays it)."""
    compute_s: float = 0.0
    """Work on the compute stream of the dense part alone, without contention (the tables' lookups add to it)."""


@dataclass(frozen=True, slots=True)
class SparseInfo:
    """The sparse part of one (shard-group size, micro-batches) pair."""

    options: tuple[tuple[ShardOption, ...], ...]
    node_size: int
    recv_factor: float
    recv_mem_factor: float
    launch_s: tuple[float, float]
    groups_bytes: float
    """NCCL buffers of the sparse shard and replica groups."""


@dataclass(frozen=True, slots=True)
class Floor:
    """A candidate's floor point: every aggregate at the least any solution can give it."""

    x: dict[str, float]
    mem_bytes: float
    """Least shard memory per rank (average, or the largest single shard)."""
    recv_bytes: float
    """Least bytes every rank receives."""


LOADER_MARGIN = 2.0
"""The balance group is chosen as if the data loader took this many times its price: the loader's coefficients come
from one CPU (``coplan.costmodel.loader``), and the trainer's reads inside runs on the H200's host were several times
slower than that CPU's alone (``benchmarks/results/fresh_draws_h200.json``), so a group that keeps the loader within
half the step stays hidden where the price is off by that much."""


@dataclass(slots=True)
class Pricer:
    """Builds and caches candidate pricings for one (workload, topology, world size, calibration), and
    prices solutions with the cost model's pricer."""

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
    group: int | None = None
    """Ranks that balance together (:meth:`_choose_group`; None: the world, on one node)."""
    model: CostModel = field(default=COST_MODEL, repr=False)
    """The cost model every figure comes from."""
    _dense: dict = field(default_factory=dict)
    _sparse: dict = field(default_factory=dict)
    _ctx: dict = field(default_factory=dict)
    _mb0: int = 1

    def __post_init__(self) -> None:
        self._mb0 = micro_batch_counts(self.workload, self.world_size)[0]
        if self.policy is None:
            self.policy, self.rho = self._choose_policy()
        else:
            self.rho = self._rho(self.policy)
        self.group, self.rho = self._choose_group()
        self._ctx.clear()  # contexts from here on balance in the chosen groups

    def _choose_group(self) -> tuple[int | None, float]:
        """The balance group: ranks that balance a slice of the global batch together, each decoding the slice's rows.
        Candidates: a node's ranks, doubled up to the world. A larger group balances the jagged work better (less
        spread between the groups' shares) and reads more rows per rank; each is priced (the imbalance, and the data
        loader's time per step, with :data:`LOADER_MARGIN`) against the dense compute of one rank, and the fastest
        kept (the smallest on a tie).
        None on one node (the group is the world)."""
        node = self.topology.gpus_per_node
        if self.world_size <= node or self.policy == "none":
            return None, self.rho
        ctx = self.context(MeshCandidate(self.world_size, self.world_size, 1, self.world_size, self._mb0))
        groups, g = [], node
        while g < self.world_size:
            if self.world_size % g == 0:
                groups.append(g)
            g *= 2
        groups.append(self.world_size)
        world_ctx = self.model.with_balance_group(ctx, self.world_size)
        compute = self.model.dense_base(world_ctx, BalancingPlan(policy=self.policy, group_ranks=self.world_size)).compute_s
        rho_world = self.model.imbalance(world_ctx, self.policy)
        best: tuple[float, int, float] | None = None
        for g in groups:
            c = self.model.with_balance_group(ctx, g)
            rho = self.model.imbalance(c, self.policy)
            est = max(LOADER_MARGIN * self.model.loader_s(c), compute * rho / max(rho_world, 1e-12))
            if best is None or est < best[0] * (1 - 1e-6):
                best = (est, g, rho)
        assert best is not None
        return best[1], best[2]

    # ------------------------------------------------------------------ contexts
    def mesh_plan(self, c: MeshCandidate) -> MeshPlan:
        m = MeshPlan(dense_shard=c.dense_shard, dense_replicate=c.dense_replicate, expert_parallel=c.expert_parallel,
                     sparse_shard=c.sparse_shard, sparse_replicate=c.sparse_replicate, micro_batches=c.micro_batches)
        return m.model_copy(update={"axes": mesh_axes(self.topology, m)})

    def context(self, c: MeshCandidate) -> Context:
        ctx = self._ctx.get(c)
        if ctx is None:
            ctx = self.model.build_context(self.workload, self.topology, self.mesh_plan(c), self.calibration,
                                           balance_group=getattr(self, "group", None))
            if len(self._ctx) > 256:
                self._ctx.clear()
            self._ctx[c] = ctx
        return ctx

    def _rho(self, policy: str) -> float:
        ctx = self.context(MeshCandidate(self.world_size, self.world_size, 1, self.world_size, self._mb0))
        return self.model.imbalance(ctx, policy)

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
        return BalancingPlan(policy=self.policy, expected_imbalance=max(1.0, self.rho), group_ranks=self.group)  # type: ignore[arg-type]

    # ------------------------------------------------------------------ dense
    def dense(self, c: MeshCandidate) -> DenseInfo:
        """Dense figures of the candidate's (dense shard, expert-parallel, micro-batches) (cached)."""
        key = (c.dense_shard, c.expert_parallel, c.micro_batches)
        hit = self._dense.get(key)
        if hit is not None:
            return hit
        ctx = self.context(c)
        base = self.model.dense_base(ctx, self.balancing)
        layers = tuple(LayerOption(o.name, o.recompute_s, o.saved_bytes, o.peak_bytes) for o in self.model.recompute_options(ctx, self.policy))
        info = DenseInfo(base.base_bytes, layers, base.memory_parts, base.groups_bytes, base.makespan_s, base.compute_s)
        self._dense[key] = info
        return info

    # ------------------------------------------------------------------ sparse
    def sparse(self, c: MeshCandidate) -> SparseInfo:
        """Every table's options for the candidate's shard group size and micro-batches (cached)."""
        S = c.sparse_shard
        hit = self._sparse.get((S, c.micro_batches))
        if hit is not None:
            return hit
        ctx = self.context(MeshCandidate(self.world_size, self.world_size, 1, S, c.micro_batches))
        ta = ctx.tables
        n = ta.num
        hbm = self.topology.gpu.hbm_bytes
        g = min(self.topology.gpus_per_node, S)
        opts: list[list[ShardOption]] = [[] for _ in range(n)]

        def add(kind: str, k: int, mask: np.ndarray) -> None:
            cc = self.model.shard_options(ctx, kind, k)
            dp = kind == "data_parallel"
            for i in np.flatnonzero(mask):
                opts[i].append(ShardOption(
                    kind, int(k if kind not in ("row_wise", "data_parallel") else S),
                    float(cc.fwd_s[i]), float(cc.bwd_s[i]), float(cc.send_bytes[i]), float(cc.mem_bytes[i]),
                    0.0 if dp else float(cc.recv_bytes[i]), float(cc.allreduce_bytes[i]),
                    0.0 if dp else float(cc.ids_recv_bytes[i]), 0.0 if dp else float(cc.ids_send_bytes[i]),
                    0.0 if dp else float(cc.state_bytes[i]),
                ))

        everything = np.ones(n, dtype=bool)
        add("table_wise", 1, everything)
        k = 2
        while k <= S:
            ok = column_wise_fits(ta.dim, k, self.min_cw_dim)
            if not ok.any():
                break
            add("column_wise", k, ok)
            k *= 2
        if S > 1:
            add("row_wise", S, everything)
        if S > g > 1 and S % g == 0:
            add("table_row_wise", g, ~ta.is_seq)  # TorchRec's EmbeddingCollection has no table-row-wise
        add("data_parallel", 1, self.model.table_state_bytes(ctx) <= self.max_dp_fraction * hbm)
        if self.table_pins:
            opts = self._apply_pins(opts, S)
        options = tuple(tuple(_prune(o)) for o in opts)
        info = SparseInfo(options=options, node_size=g if S % g == 0 else 0, recv_factor=self.rho,
                          recv_mem_factor=2.0 * self.rho / ctx.micro_batches, launch_s=self.model.lookup_launch_s(ctx),
                          groups_bytes=self.model.sparse_groups_bytes(ctx))
        self._sparse[(S, c.micro_batches)] = info
        return info

    def _apply_pins(self, opts: list[list[ShardOption]], S: int) -> list[list[ShardOption]]:
        """Keep only the pinned sharding of each pinned table; a pin no option of this group size
        satisfies leaves the table with no option (the candidate is then left out, and the search says
        which pin no candidate could take)."""
        idx = {t.name: i for i, t in enumerate(self.workload.all_tables)}
        out = list(opts)
        for name, want in self.table_pins.items():
            i = idx[name]
            kind, _, k = want.partition("/")
            out[i] = [o for o in opts[i] if o.sharding_type == kind and (not k or o.num_shards == int(k))]
        return out

    # ------------------------------------------------------------------ candidates
    def scale(self, c: MeshCandidate) -> dict[str, float]:
        """Seconds of one schedule task per raw unit of each aggregate (see CandidatePricing.scale); the
        groups these collectives run on depend only on the shard-group size and the world."""
        key = ("scale", c.sparse_shard, c.micro_batches)
        hit = self._sparse.get(key)
        if hit is not None:
            return hit
        out = self.model.aggregate_scale(self.context(MeshCandidate(self.world_size, self.world_size, 1, c.sparse_shard, c.micro_batches)))
        self._sparse[key] = out
        return out

    def quick_bound(self, p: CandidatePricing) -> float:
        """A lower bound of the candidate's step without pricing it: the dense part's own step, and the
        compute stream's dense work plus the least lookups any placement leaves on the slowest rank."""
        d = self.dense(p.mesh)
        f = self.floor(p)
        return max(d.makespan_s, d.compute_s + (f.x["fwd"] + f.x["bwd"] if p.options else 0.0))

    def candidate(self, c: MeshCandidate, *, with_cut: bool = True) -> CandidatePricing:
        """The candidate's figures; ``with_cut``: with the cut of its floor point (one pricing)."""
        d = self.dense(c)
        s = self.sparse(c)
        # a data-parallel table adds the world all-reduce's communicator; reserve it whenever one may be chosen
        dp_comm = self.model.communicator_bytes() if any(o.sharding_type == "data_parallel" for opts in s.options for o in opts) else 0.0
        p = CandidatePricing(
            mesh=c, node_size=s.node_size,
            base_bytes=d.base_bytes - d.sparse_groups_bytes + s.groups_bytes, dp_comm_bytes=dp_comm,
            capacity_bytes=self.topology.gpu.usable_hbm_bytes, layers=d.layers, options=s.options,
            table_names=tuple(t.name for t in self.workload.all_tables), scale=self.scale(c), launch_s=s.launch_s,
            recv_factor=s.recv_factor, recv_mem_factor=s.recv_mem_factor, memory_parts=dict(d.memory_parts),
        )
        if with_cut and all(p.options):
            for cut in self.floor_cost(p).cuts:
                p = p.with_cut(cut)
        return p

    def floor(self, p: CandidatePricing) -> Floor:
        """The candidate's floor point. Each aggregate is at least what the average rank carries when
        every table takes its least share, and at least the largest shard some table cannot avoid;
        the all-to-alls move at least the bytes every rank receives or sends; memory likewise. Depends
        only on the options (cached per shard-group size and micro-batches)."""
        key = ("floor", p.group_size, p.mesh.micro_batches)
        hit = self._sparse.get(key)
        if hit is not None:
            return hit
        if not p.options:
            f = Floor({"fwd": 0.0, "bwd": 0.0, "a2a": 0.0, "ids": 0.0, "dp": 0.0, "sync": 0.0}, 0.0, 0.0)
            self._sparse[key] = f
            return f
        s = p.group_size
        flat = [(t, o) for t, opts in enumerate(p.options) for o in opts]
        tid = np.array([t for t, _ in flat])
        vec = np.array([o.load() for _, o in flat])
        share = np.array([1.0 if o.placement == "all" else copies(o) / s for _, o in flat])
        extra = np.array([(o.mem_bytes, o.recv_bytes, o.ids_send_bytes, o.allreduce_bytes) for _, o in flat])
        n = len(p.options)

        def per_table_min(v: np.ndarray) -> np.ndarray:
            out = np.full((n,) + v.shape[1:], np.inf)
            np.minimum.at(out, tid, v)
            return out

        avg = per_table_min(vec * share[:, None]).sum(axis=0)
        lump = per_table_min(vec).max(axis=0)
        mem_avg = per_table_min(extra[:, 0] * share).sum()
        mem_lump = per_table_min(extra[:, 0]).max()
        recv, ids, dp = (per_table_min(extra[:, k]).sum() for k in (1, 2, 3))
        lo = np.maximum(avg, lump)
        x = {"fwd": float(lo[0]) + p.launch_s[0], "bwd": float(lo[1]) + p.launch_s[1],
             "a2a": max(float(lo[2]), p.recv_factor * float(recv)), "ids": max(float(lo[3]), float(ids)), "dp": float(dp), "sync": float(lo[4])}
        f = Floor(x, float(max(mem_avg, mem_lump)), float(recv))
        self._sparse[key] = f
        return f

    def probe_cuts(self, p: CandidatePricing) -> CandidatePricing:
        """The candidate with the cuts of probe points: the floor point with one aggregate at the most
        any solution can give it (every table's largest shard on one rank, or its largest bytes),
        with nothing and with everything recomputed. Each prices a path through the tasks that
        aggregate sets, so the first solve already sees what each aggregate costs where the floor's
        path does not cross it (six pricings per candidate solved)."""
        if not p.options:
            rc_all = tuple(l.saved_bytes > 0 for l in p.layers)
            if any(rc_all):
                for c in self._price_x(p, self.floor(p).x, rc_all).cuts:
                    p = p.with_cut(c)
            return p
        f = self.floor(p)
        arr_max = np.zeros(len(LOADS))
        recv = ids = dp = 0.0
        for opts in p.options:
            arr_max += np.max([o.load() for o in opts], axis=0)
            recv = recv + max(o.recv_bytes for o in opts)
            ids = ids + max(o.ids_send_bytes for o in opts)
            dp = dp + max(o.allreduce_bytes for o in opts)
        high = {"fwd": arr_max[0] + p.launch_s[0], "bwd": arr_max[1] + p.launch_s[1],
                "a2a": max(arr_max[2], p.recv_factor * recv), "ids": max(arr_max[3], ids), "dp": dp, "sync": arr_max[4]}
        out = p
        rc_none = (False,) * len(p.layers)
        rc_all = tuple(l.saved_bytes > 0 for l in p.layers)
        for v in ("fwd", "bwd", "a2a", "ids", "dp", "sync"):
            if high[v] <= f.x[v] * (1 + 1e-9):
                continue
            for c in self._price_x(p, {**f.x, v: high[v]}, rc_none, mem_bytes=f.mem_bytes, recv_bytes=f.recv_bytes).cuts:
                out = out.with_cut(c)
        if any(rc_all):
            for c in self._price_x(p, f.x, rc_all, mem_bytes=f.mem_bytes, recv_bytes=f.recv_bytes).cuts:
                out = out.with_cut(c)
        return out

    def floor_cost(self, p: CandidatePricing):
        """The pricer's step at the candidate's floor point with nothing recomputed (with its cut)."""
        f = self.floor(p)
        return self._price_x(p, f.x, (False,) * len(p.layers), mem_bytes=f.mem_bytes, recv_bytes=f.recv_bytes)

    # ------------------------------------------------------------------ pricing solutions
    def aggregates(self, p: CandidatePricing, a: Assignment) -> SparseAggregates:
        """The :class:`~coplan.costmodel.SparseAggregates` of a solution, as the pricer computes them from
        the same placement written as shards (the fullest rank's shard memory as one figure: the pricer of
        the final plan splits it by kind)."""
        ld = loads(p, a)
        tot = ld.per_rank + ld.uniform
        lf, lb = p.launch_s
        uni_state = sum(p.options[t][oi].mem_bytes for t, oi in enumerate(a.choice) if p.options[t][oi].placement == "all")
        return self.model.aggregates_of_ranks(tot[:, 0] + lf * ld.holds, tot[:, 1] + lb * ld.holds, tot, ld.mem + uni_state,
                                              recv_bytes=ld.recv, recv_factor=p.recv_factor, ids_send_bytes=ld.ids_send,
                                              dp_bytes=ld.dp, held=bool(ld.holds.any()), kernels=self.model.lookup_kernels(self.context(p.mesh)))

    def layer_plans(self, p: CandidatePricing, recompute) -> tuple[LayerPlan, ...]:
        return tuple(LayerPlan(name=l.name, recompute=bool(on)) for l, on in zip(p.layers, recompute))

    def price(self, p: CandidatePricing, a: Assignment, *, detail: bool = False) -> StepCost:
        """The cost model's full pricing of a solution (its cuts included)."""
        agg = self.aggregates(p, a) if p.options else None
        return self.model.price(self.context(p.mesh), None, self.layer_plans(p, a.recompute), self.balancing, self.workload.kernels,
                     detail=detail, aggregates=agg, cuts=True, include_embeddings=bool(p.options))

    def _price_x(self, p: CandidatePricing, x: dict[str, float], recompute, *, mem_bytes: float = 0.0, recv_bytes: float = 0.0,
                 contention: bool = False) -> StepCost:
        """The pricer's step at aggregates ``x`` (without the SM-contention slowdown by default: the floor
        and probe points give cuts that are lower bounds everywhere, not just where they were priced)."""
        ctx = self.context(p.mesh)
        layers = self.layer_plans(p, recompute)
        if not ctx.tables.num:
            return self.model.price(ctx, None, layers, self.balancing, self.workload.kernels, detail=False, cuts=True, contention=contention)
        agg = self.model.aggregates_at(x, mem_bytes=mem_bytes, recv_bytes=recv_bytes, kernels=self.model.lookup_kernels(ctx))
        return self.model.price(ctx, None, layers, self.balancing, self.workload.kernels, detail=False, aggregates=agg, cuts=True,
                     contention=contention)


def _dominates(a: ShardOption, b: ShardOption) -> bool:
    if not (a.placement == b.placement or a.placement == "rank"):
        return False
    return (a.num_shards <= b.num_shards and a.fwd_s <= b.fwd_s and a.bwd_s <= b.bwd_s and a.send_bytes <= b.send_bytes
            and a.mem_bytes <= b.mem_bytes and a.recv_bytes <= b.recv_bytes and a.allreduce_bytes <= b.allreduce_bytes
            and a.ids_recv_bytes <= b.ids_recv_bytes and a.ids_send_bytes <= b.ids_send_bytes and a.sync_bytes <= b.sync_bytes)


def _prune(opts: list[ShardOption]) -> list[ShardOption]:
    """Drop options another option beats or equals in every figure (the first of equals stays)."""
    keep = []
    for i, b in enumerate(opts):
        dominated = False
        for j, a in enumerate(opts):
            if i == j:
                continue
            if _dominates(a, b) and (not _dominates(b, a) or j < i):
                dominated = True
                break
        if not dominated:
            keep.append(b)
    return keep
