"""The critical rank's step as a two-stream :class:`~coplan.costmodel.schedule.Schedule`: the pricer's
tasks, in the order the trainer issues them (see :mod:`coplan.costmodel.pricer` for the step they
model). The inputs are the priced pieces: the dense layers' times (:class:`DenseWork`), what the
table placement adds (:class:`SparseWork`) and the dense collectives per call (:class:`Collectives`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from coplan.costmodel import flops as F
from coplan.costmodel.compute import OpArrays
from coplan.costmodel.context import Context
from coplan.costmodel.decomposed import dense_fixed_costs
from coplan.costmodel.results import SparseAggregates
from coplan.costmodel.schedule import COMPUTE, Schedule

MOE_PARTS = {"router": "router", "shared_experts": "shared", "experts": "experts"}
"""A MoE layer's ops by the last part of their name; every other op of the layer is its "post" part."""


def moe_part(op_name: str) -> str:
    return MOE_PARTS.get(op_name.rsplit(".", 1)[-1], "post")


@dataclass(frozen=True, slots=True)
class DenseWork:
    """The dense ops on the critical rank, per micro-batch."""

    arr: OpArrays
    rho: float
    f_op: np.ndarray
    """Forward seconds per dense op (jagged imbalance applied)."""
    b_op: np.ndarray
    f_mean: np.ndarray
    """Forward seconds per dense op on a mean rank."""
    b_mean: np.ndarray
    fl: np.ndarray
    """Forward seconds per layer."""
    bl: np.ndarray
    dense_mean: float
    """Forward + backward of a mean rank, per step."""
    moe_parts: dict[int, dict[str, tuple[float, float]]] = field(default_factory=dict)
    """Per MoE layer: (forward, backward) seconds of its router, shared experts, routed experts and the rest."""


def dense_work(ctx: Context, arr: OpArrays, rho: float) -> DenseWork:
    f_op, b_op = arr.times(rho)
    f_mean, b_mean = arr.times(1.0)
    M = ctx.micro_batches
    nl = len(ctx.layer_names)
    L = ctx.op_layer
    fl = np.bincount(L, weights=f_op, minlength=nl)
    bl = np.bincount(L, weights=b_op, minlength=nl)
    dense_mean = float((f_mean.sum() + b_mean.sum()) * M)
    moe_parts: dict[int, dict[str, tuple[float, float]]] = {}
    if ctx.layer_is_moe.any():
        for k, oi in enumerate(ctx.dense_idx):
            li = int(L[k])
            if not ctx.layer_is_moe[li]:
                continue
            part = moe_part(ctx.ops[oi].name)
            d = moe_parts.setdefault(li, {})
            pf, pb = d.get(part, (0.0, 0.0))
            d[part] = (pf + float(f_op[k]), pb + float(b_op[k]))
    return DenseWork(arr, rho, f_op, b_op, f_mean, b_mean, fl, bl, dense_mean, moe_parts)


@dataclass(frozen=True, slots=True)
class SparseWork:
    """What the table placement adds to each micro-batch (all zero without one)."""

    agg: SparseAggregates | None = None
    emb_fwd: float = 0.0
    """Slowest rank's forward lookups per micro-batch."""
    emb_bwd: float = 0.0
    a2a_bytes: float = 0.0
    """Output all-to-all bytes per micro-batch."""
    ids_bytes: float = 0.0
    dp_bytes: float = 0.0
    """Data-parallel tables' gradient all-reduce bytes per step."""
    sync_bytes: float = 0.0
    """Replica-sync bytes (0 without sparse replicas)."""
    mean_s: float = 0.0


def sparse_work(ctx: Context, agg: SparseAggregates | None) -> SparseWork:
    if agg is None:
        return SparseWork()
    M = ctx.micro_batches
    return SparseWork(agg, agg.fwd_max_s / M, agg.bwd_max_s / M, agg.a2a_bytes / M, agg.ids_bytes / M, agg.dp_bytes,
                      agg.sync_bytes if ctx.mesh.sparse_replicate > 1 else 0.0, agg.mean_s)


@dataclass(frozen=True, slots=True)
class Collectives:
    """The dense collectives per call: per layer, its all-gathers and its reduce-scatters/all-reduces as
    (task name, seconds, (collective, group, bytes)), and the expert-parallel all-to-alls."""

    ag_parts: list
    rs_parts: list
    sm_of: dict[str, bool]
    """Per group: whether its collectives take SMs."""
    ep_bytes: np.ndarray
    """Per layer: bytes of one expert-parallel dispatch (or combine)."""
    ep_t: np.ndarray
    ep_sm: bool


def dense_collectives(ctx: Context, moe_layers) -> Collectives:
    w = ctx.workload
    cb = ctx.compute_bytes
    rb = F.DTYPE_BYTES[w.precision.reduce_dtype]
    ds, ep = ctx.mesh.dense_shard, ctx.mesh.expert_parallel
    es = ctx.expert_shard
    P, E = ctx.layer_params, ctx.layer_expert_params
    ag_m, rs_m = ctx.model("dense_shard", "all_gather"), ctx.model("dense_shard", "reduce_scatter")
    ar_m = ctx.model("dense_replicate", "all_reduce")
    eag_m, ers_m = ctx.model("expert_shard", "all_gather"), ctx.model("expert_shard", "reduce_scatter")
    ear_m = ctx.model("expert_replicate", "all_reduce")
    a2a_ep = ctx.model("expert", "all_to_all")
    # per layer: the dense parameters' collectives, then the experts' (own groups), as (name, seconds, meta)
    rep_bytes = (P / ds if ds > 1 else P) * rb
    eb = E / ep
    cols = [
        ("fsdp_all_gather", "all_gather", "dense_shard", ag_m, P * cb),
        ("expert_all_gather", "all_gather", "expert_shard", eag_m, eb * cb),
        ("fsdp_reduce_scatter", "reduce_scatter", "dense_shard", rs_m, P * rb),
        ("expert_reduce_scatter", "reduce_scatter", "expert_shard", ers_m, eb * rb),
        ("replicate_all_reduce", "all_reduce", "dense_replicate", ar_m, rep_bytes),
        ("expert_replicate_all_reduce", "all_reduce", "expert_replicate", ear_m, eb / es * rb),
    ]
    timed = [(suffix, kind, grp, np.asarray(m.time(b), dtype=float).tolist(), np.asarray(b, dtype=float).tolist())
             for suffix, kind, grp, m, b in cols]
    ag_parts = [[(f"{n}.{sx}", t[i], (k, g, b[i])) for sx, k, g, t, b in timed[:2]] for i, n in enumerate(ctx.layer_names)]
    rs_parts = [[(f"{n}.{sx}", t[i], (k, g, b[i])) for sx, k, g, t, b in timed[2:]] for i, n in enumerate(ctx.layer_names)]
    ag_parts = [[p for p in parts if p[1] > 0] for parts in ag_parts]
    rs_parts = [[p for p in parts if p[1] > 0] for parts in rs_parts]
    sm_of = {"dense_shard": not ag_m.sm_free, "expert_shard": not eag_m.sm_free, "dense_replicate": not ar_m.sm_free,
             "expert_replicate": not ear_m.sm_free}
    ep_bytes = np.zeros(len(ctx.layer_names))
    for li in moe_layers:
        b = ctx.moe_blocks[ctx.layer_names[li]]
        ep_bytes[li] = ctx.mb_batch * b.tokens_per_sample * b.top_k * b.model_dim * cb * b.capacity_factor if ep > 1 else 0.0
    return Collectives(ag_parts, rs_parts, sm_of, ep_bytes, a2a_ep.time(ep_bytes), not a2a_ep.sm_free)


def affine(model, nbytes: float, var: str, per: float) -> tuple:
    """A collective's time as (constant, ((var, seconds per unit of var),)): latency + bytes × s/byte,
    the bytes being ``per ×`` the variable (0 for one rank)."""
    if model.trivial:
        return (0.0, ())
    return (model.latency_s if nbytes > 0 else 0.0, ((var, model.s_per_byte * per),))


class StepSchedule:
    """Builds the step's schedule: :meth:`micro_batch` for each micro-batch, then :meth:`step_end`.

    ``recomputed``: the layers recomputed in backward; ``cuts``: also add tasks of no duration where a
    decision could add work (a recompute not chosen, an all-reduce of no bytes), so that a path through
    them prices what that work would add."""

    def __init__(self, ctx: Context, dense: DenseWork, sparse: SparseWork, cols: Collectives, recomputed: frozenset[str],
                 cuts: bool) -> None:
        self.ctx, self.d, self.sp, self.c = ctx, dense, sparse, cols
        self.recomputed, self.cuts = recomputed, cuts
        self.S = Schedule()
        self.streams: dict[tuple[str, str], str] = {}
        self.sync_task: dict[tuple[int, int, str], int] = {}
        """(micro-batch, layer, "fwd" or "recompute") -> the compute task that runs it."""
        self.last_rs: list[int] = []
        self.fixed = dense_fixed_costs(ctx)
        M = ctx.micro_batches
        self.sparse_model = ctx.model("sparse_shard", "all_to_all")
        self.sparse_sm = not self.sparse_model.sm_free
        self.a2a_t = self.sparse_model.time(sparse.a2a_bytes)
        self.ids_t = self.sparse_model.time(sparse.ids_bytes)
        self.a2a_form = affine(self.sparse_model, sparse.a2a_bytes, "a2a", 1.0 / M)
        self.ids_form = affine(self.sparse_model, sparse.ids_bytes, "ids", 1.0 / M)
        needs = ctx.layer_needs_embeddings
        self.first_need = int(np.flatnonzero(needs)[0]) if needs.any() else -1
        self.has_tables = sparse.agg is not None

    def comm(self, name: str, dur: float, deps=(), *, meta, **kw) -> int:
        # one stream per bottleneck link: collectives that share links queue, others run side by side
        key = (meta[1], meta[0])
        st = self.streams.get(key)
        if st is None:
            st = self.streams[key] = "net:" + (self.ctx.model(meta[1], meta[0]).bottleneck or self.ctx.topology.tiers[0].name)
        return self.S.add(name, st, dur, deps, meta=meta, **kw)

    def _gather(self, j: int, dep, phase: str):
        last = None
        for name, dur, meta in self.c.ag_parts[j]:
            last = self.comm(name, dur, (dep,), phase=phase, layer=self.ctx.layer_names[j], sm=self.c.sm_of[meta[1]], meta=meta)
        return last

    def _a2a(self, name: str, deps, phase: str) -> int:
        return self.comm(name, self.a2a_t, deps, phase=phase, layer="sparse", sm=self.sparse_sm,
                         meta=("all_to_all", "sparse_shard", self.sp.a2a_bytes), form=self.a2a_form)

    def _ids(self) -> int:
        return self.comm("sparse.ids_all_to_all", self.ids_t, (), phase="fwd", layer="sparse", sm=self.sparse_sm,
                         meta=("all_to_all", "sparse_shard", self.sp.ids_bytes), form=self.ids_form)

    def micro_batch(self, m: int) -> None:
        """Lookups and their all-to-all, the layers forward, then backward (in reverse), for micro-batch ``m``."""
        S, M = self.S, self.ctx.micro_batches
        out_a2a = None
        if self.has_tables:
            ids_task = self._ids() if not self.ctx.options.pipeline_input_dist else None
            emb_f = S.add("sparse.tbe", COMPUTE, self.sp.emb_fwd, (ids_task,), phase="fwd", layer="sparse", form=(0.0, (("fwd", 1.0 / M),)))
            out_a2a = self._a2a("sparse.all_to_all_fwd", (emb_f,), "fwd")
        fwd_task = self._forward(m, out_a2a)
        self._backward(m, fwd_task)

    def _forward(self, m: int, out_a2a) -> list[int]:
        S, names, nl = self.S, self.ctx.layer_names, len(self.ctx.layer_names)
        needs = self.ctx.layer_needs_embeddings
        fwd_task: list[int] = [-1] * nl
        ag_task: list[int | None] = [None] * nl
        if nl:
            ag_task[0] = self._gather(0, None, "fwd")
        if self.fixed.fsdp_copy_fwd_s > 0:
            # FSDP2's parameter casts and copies (and the inputs' cast) run before the first layer on
            # the compute stream: memory-bound kernels of their own, not hidden under any op
            S.add("fsdp.hooks", COMPUTE, self.fixed.fsdp_copy_fwd_s, (ag_task[0] if nl else None,), phase="fwd", layer="fsdp")
        for i in range(nl):
            if i + 1 < nl:
                ag_task[i + 1] = self._gather(i + 1, fwd_task[i - 1] if i >= 1 else None, "fwd")
            deps = [ag_task[i]]
            if needs[i]:
                deps.append(out_a2a)
            if i in self.d.moe_parts:
                fwd_task[i] = self._moe_forward(i, deps)
            else:
                fwd_task[i] = S.add(f"{names[i]}.fwd", COMPUTE, self.d.fl[i], deps, phase="fwd", layer=names[i])
            self.sync_task[(m, i, "fwd")] = fwd_task[i]
        return fwd_task

    def _ep(self, name: str, i: int, dep, phase: str, dur: float | None = None, form=None) -> int:
        kw = {"form": form} if form is not None else {}
        return self.comm(name, self.c.ep_t[i] if dur is None else dur, (dep,), phase=phase, layer=self.ctx.layer_names[i],
                         sm=self.c.ep_sm, meta=("all_to_all", "expert", self.c.ep_bytes[i]), **kw)

    def _moe_forward(self, i: int, deps) -> int:
        S, n, p = self.S, self.ctx.layer_names[i], self.d.moe_parts[i]
        r = S.add(f"{n}.router", COMPUTE, p.get("router", (0, 0))[0], deps, phase="fwd", layer=n)
        disp = self._ep(f"{n}.ep_dispatch", i, r, "fwd")
        S.add(f"{n}.shared", COMPUTE, p.get("shared", (0, 0))[0], (r,), phase="fwd", layer=n)
        ex = S.add(f"{n}.experts", COMPUTE, p.get("experts", (0, 0))[0], (disp,), phase="fwd", layer=n)
        comb = self._ep(f"{n}.ep_combine", i, ex, "fwd")
        return S.add(f"{n}.post", COMPUTE, p.get("post", (0, 0))[0], (comb,), phase="fwd", layer=n)

    def _moe_backward(self, i: int, deps) -> int:
        S, n, p = self.S, self.ctx.layer_names[i], self.d.moe_parts[i]
        post = S.add(f"{n}.post_bwd", COMPUTE, p.get("post", (0, 0))[1], deps, phase="bwd", layer=n)
        cb_t = self._ep(f"{n}.ep_combine", i, post, "bwd")
        exb = S.add(f"{n}.experts_bwd", COMPUTE, p.get("experts", (0, 0))[1], (cb_t,), phase="bwd", layer=n)
        dsp = self._ep(f"{n}.ep_dispatch", i, exb, "bwd")
        S.add(f"{n}.shared_bwd", COMPUTE, p.get("shared", (0, 0))[1], (post,), phase="bwd", layer=n)
        return S.add(f"{n}.router_bwd", COMPUTE, p.get("router", (0, 0))[1], (dsp,), phase="bwd", layer=n)

    def _recompute(self, m: int, i: int, deps: tuple) -> tuple:
        """The layer's recompute before its backward (or, with cuts, a task of no duration in its place:
        it changes nothing in the schedule, and lets a critical path through it price what recomputing
        this layer would add); returns the backward's dependencies."""
        S, n, fl = self.S, self.ctx.layer_names[i], self.d.fl
        if n in self.recomputed:
            rc = S.add(f"{n}.recompute", COMPUTE, fl[i], deps, phase="recompute", layer=n, form=(0.0, ((f"rc:{n}", float(fl[i])),)))
            self.sync_task[(m, i, "recompute")] = rc
            ep_t = self.c.ep_t
            if i in self.d.moe_parts and ep_t[i] > 0:  # recomputing a MoE layer dispatches and combines again
                deps = (self._ep(f"{n}.ep_recompute", i, rc, "bwd", 2 * ep_t[i], form=(0.0, ((f"rc:{n}", float(2 * ep_t[i])),))),)
        elif self.cuts:
            S.add(f"{n}.recompute", COMPUTE, 0.0, deps, phase="recompute", layer=n, form=(0.0, ((f"rc:{n}", float(fl[i])),)))
        return deps

    def _backward(self, m: int, fwd_task: list[int]) -> None:
        # the last layer keeps its parameters; layer i-1 is gathered as layer i starts
        S, names, nl = self.S, self.ctx.layer_names, len(self.ctx.layer_names)
        reshard = self.ctx.options.reshard_after_forward
        bwd_task: list[int] = [-1] * nl
        agb: list[int | None] = [None] * nl
        grad_a2a = None
        for i in range(nl - 1, -1, -1):
            j = i - 1
            if reshard and j >= 0:
                agb[j] = self._gather(j, bwd_task[i + 1] if i + 1 < nl else fwd_task[nl - 1], "bwd")
            deps = self._recompute(m, i, (agb[i],))
            if i in self.d.moe_parts:
                bwd_task[i] = self._moe_backward(i, deps)
            else:
                bwd_task[i] = S.add(f"{names[i]}.bwd", COMPUTE, self.d.bl[i], deps, phase="bwd", layer=names[i])
            for name, dur, meta in self.c.rs_parts[i]:
                self.last_rs.append(self.comm(name, dur, (bwd_task[i],), phase="bwd", layer=names[i], sm=self.c.sm_of[meta[1]], meta=meta))
            if i == self.first_need and self.has_tables:
                grad_a2a = self._a2a("sparse.all_to_all_bwd", (bwd_task[i],), "bwd")
        if self.fixed.fsdp_copy_bwd_s > 0:
            # the gradients' copy-in, the one-rank divided copy and casts: after the layers' backward
            S.add("fsdp.hooks", COMPUTE, self.fixed.fsdp_copy_bwd_s, (bwd_task[0] if nl else None,), phase="bwd", layer="fsdp")
        if self.has_tables:
            if grad_a2a is None:
                grad_a2a = self._a2a("sparse.all_to_all_bwd", (), "bwd")
            S.add("sparse.tbe_bwd", COMPUTE, self.sp.emb_bwd, (grad_a2a,), phase="bwd", layer="sparse",
                  form=(0.0, (("bwd", 1.0 / self.ctx.micro_batches),)))

    def step_end(self) -> None:
        """Once per step: the data-parallel tables' all-reduce, the replica sync, the dense optimizer,
        and (pipelined) the next batch's id all-to-alls."""
        ctx, S, sp = self.ctx, self.S, self.sp
        world_ar = ctx.model("world", "all_reduce")
        dp_ar = sp.dp_bytes
        if dp_ar > 0:
            self.last_rs.append(self.comm("sparse.dp_all_reduce", world_ar.time(dp_ar), (), phase="bwd", layer="sparse",
                                          sm=not world_ar.sm_free, meta=("all_reduce", "world", dp_ar), form=affine(world_ar, dp_ar, "dp", 1.0)))
        elif self.cuts and self.has_tables and not world_ar.trivial:
            # no data-parallel table: a task of no duration in the all-reduce's place (nothing waits on it, so
            # the schedule is unchanged) lets the stream's cut price what one would add
            self.comm("sparse.dp_all_reduce", 0.0, (), phase="bwd", layer="sparse", sm=False, meta=("all_reduce", "world", 0.0),
                      form=(world_ar.latency_s, (("dp", world_ar.s_per_byte),)))
        rm = ctx.model("sparse_replicate", "all_reduce")
        every = ctx.workload.optimizer.sparse_sync_interval_steps
        rsync = sp.sync_bytes
        if rsync > 0:
            c0, terms = affine(rm, rsync, "sync", 1.0 / every)
            self.comm("sparse.replica_sync", rm.time(rsync) / every, (), phase="bwd", layer="sparse",
                      sm=not rm.sm_free, meta=("all_reduce", "sparse_replicate", rsync), form=(c0 / every, terms))
        elif self.cuts and self.has_tables and not rm.trivial:
            self.comm("sparse.replica_sync", 0.0, (), phase="bwd", layer="sparse", sm=False, meta=("all_reduce", "sparse_replicate", 0.0),
                      form=(rm.latency_s / every, (("sync", rm.s_per_byte / every),)))
        if self.fixed.optimizer_step_s > 0:
            S.add("optimizer.step", COMPUTE, self.fixed.optimizer_step_s, tuple(self.last_rs), phase="optimizer", layer="optimizer")
        if self.has_tables and ctx.options.pipeline_input_dist:
            for _ in range(ctx.micro_batches):
                self._ids()


def build_schedule(ctx: Context, dense: DenseWork, sparse: SparseWork, cols: Collectives, recomputed: frozenset[str],
                   cuts: bool) -> StepSchedule:
    """The step's tasks, not yet run."""
    b = StepSchedule(ctx, dense, sparse, cols, recomputed, cuts)
    for m in range(ctx.micro_batches):
        b.micro_batch(m)
    b.step_end()
    return b


__all__ = ["Collectives", "DenseWork", "SparseWork", "StepSchedule", "affine", "build_schedule", "dense_collectives", "dense_work",
           "moe_part", "sparse_work"]
