"""The full pricer: one plan (mesh context + table placement + per-layer recompute/precision +
balancing policy + kernels) → :class:`~coplan.costmodel.results.StepCost`.

The step of the critical rank is assembled as a two-stream schedule (:mod:`.schedule`), per
micro-batch:

1. embedding forward lookups (the slowest sparse rank: the output all-to-all waits for it), then the
   output all-to-all; only the layers that read embeddings wait for it (dense-feature MLPs do not);
2. dense layers forward, each after its FSDP all-gather, prefetched one layer ahead (issued when the
   previous layer starts); MoE layers dispatch and combine through expert-parallel all-to-alls, with
   shared experts computed under the dispatch;
3. dense layers backward in reverse (recompute first where checkpointed), all-gathers prefetched one
   layer ahead again, reduce-scatter (and the HSDP all-reduce) issued as each layer finishes, every
   micro-batch (FSDP2's default with gradient accumulation);
4. the embedding-gradient all-to-all once the layers that read embeddings are done, then the fused
   embedding backward + optimizer, which hides the tail of the dense reduce-scatters;

then, once per step, the data-parallel tables' gradient all-reduce, the amortised replica sync and the
dense optimizer. With TorchRec's pipelined input distribution the id all-to-all of the next batch is
issued last and only its part the step's compute cannot hide is exposed.

The critical rank runs the dense work of the expected most-loaded rank (``imbalance ×`` the mean,
from :func:`coplan.costmodel.jagged.expected_imbalance` under the balancing policy) and waits for the
slowest embedding shard at each all-to-all, because every collective synchronises the ranks in it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from coplan.costmodel import flops as F
from coplan.costmodel.context import (
    FSDP_COPY_LAUNCHES,
    OPTIMIZER_LAUNCHES,
    Context,
    dense_fixed_costs,
    fsdp_copy_bytes,
    host_work_s,
    imbalance,
    op_arrays,
    table_option_costs,
)
from coplan.costmodel.embedding import DP, SHARDING_CODES, TWRW, TableAssignment
from coplan.costmodel.goodput import goodput as goodput_of
from coplan.costmodel.results import CommCost, Memory, OpCost, Perf, StepCost, StepCut
from coplan.costmodel.schedule import COMPUTE, Schedule
from coplan.errors import CoplanError
from coplan.spec.plan import BalancingPlan, LayerPlan, TableShard
from coplan.spec.workload import Kernels

_CODE_NAMES = {v: k for k, v in SHARDING_CODES.items()}


def table_assignment(ctx: Context, tables) -> TableAssignment:
    """``tables`` (TableShards or an assignment) as a TableAssignment, checked against the sparse group; cached per list."""
    if isinstance(tables, TableAssignment):
        return tables
    key = ("assign", id(tables))
    hit = ctx.cache.get(key)
    if hit is not None and hit[0] is tables:
        return hit[1]
    a = TableAssignment.from_shards(ctx.tables, tables)
    G = ctx.mesh.sparse_shard
    if a.shard_rank.size and int(a.shard_rank.max()) >= G:
        bad = int(a.shard_table[int(np.argmax(a.shard_rank))])
        raise CoplanError(f"table '{ctx.tables.names[bad]}' has a shard on rank {int(a.shard_rank.max())} outside the sparse group of {G} ranks")
    twrw = np.flatnonzero(a.sharding == TWRW)
    if twrw.size:
        gpn = ctx.topology.gpus_per_node
        node = a.shard_rank // gpn
        for t in twrw:
            nodes = np.unique(node[a.shard_table == t])
            if nodes.size > 1:
                raise CoplanError(f"table '{ctx.tables.names[t]}' is table_row_wise across nodes {nodes.tolist()}; its shards must share one node")
    ctx.cache[key] = (tables, a)
    return a


def default_assignment(ctx: Context) -> TableAssignment:
    """Every table table-wise, greedily on the least-loaded rank by lookup time (a placeholder
    placement for pricing before the planner runs)."""
    from coplan.costmodel.embedding import greedy_table_wise

    return greedy_table_wise(ctx)


def embedding_loads(ctx: Context, a: TableAssignment) -> dict[str, np.ndarray | float]:
    """Per sparse-group rank: lookup times, bytes sent/received and memory of an assignment (per step)."""
    G = ctx.mesh.sparse_shard
    ta = ctx.tables
    nt = ta.num
    fields = ("fwd_s", "bwd_s", "send_bytes", "recv_bytes", "ids_send_bytes", "ids_recv_bytes", "intra_node_bytes",
              "allreduce_bytes", "weight_bytes", "optimizer_bytes", "io_bytes")
    per_t = {f: np.zeros(nt) for f in fields}
    for code in np.unique(a.sharding):
        mask = a.sharding == code
        c = table_option_costs(ctx, _CODE_NAMES[int(code)], a.num_shards)
        for f in fields:
            per_t[f][mask] = getattr(c, f)[mask]
    st, sr = a.shard_table, a.shard_rank
    out: dict[str, np.ndarray | float] = {}
    for f in ("fwd_s", "bwd_s", "send_bytes", "ids_recv_bytes", "intra_node_bytes", "weight_bytes", "optimizer_bytes", "io_bytes"):
        out[f] = np.bincount(sr, weights=per_t[f][st], minlength=G) if st.size else np.zeros(G)
    dp = a.dp_tables
    for f in ("fwd_s", "bwd_s", "weight_bytes", "optimizer_bytes", "io_bytes"):
        out[f] = out[f] + float(per_t[f][dp].sum())
    out["dp_state_bytes"] = float(per_t["weight_bytes"][dp].sum() + per_t["optimizer_bytes"][dp].sum())
    nondp = a.sharding != DP
    out["recv_bytes"] = float(per_t["recv_bytes"][nondp].sum())
    out["ids_send_bytes"] = float(per_t["ids_send_bytes"][nondp].sum())
    out["allreduce_bytes"] = float(per_t["allreduce_bytes"][dp].sum())
    holds = np.bincount(sr, minlength=G) if st.size else np.zeros(G)
    out["shards"] = holds + dp.size
    return out


@dataclass(frozen=True, slots=True)
class SparseAggregates:
    """What a table placement adds to the step, as the schedule sees it: per step, on the ranks that
    set each all-to-all's pace. :func:`sparse_aggregates` computes it from a placement; the planner
    computes the same figures from its solution's per-shard options and prices them without building
    shards (equal up to float rounding: tested)."""

    fwd_max_s: float
    """Slowest rank's forward lookups (its table-row-wise NVLink reduction and kernel launches included)."""

    bwd_max_s: float
    """Slowest rank's backward lookups and fused optimizer (likewise)."""

    a2a_bytes: float
    """Output all-to-all volume: the busiest sender's bytes, or ρ × the bytes every rank receives."""

    ids_bytes: float
    """Input (ids) all-to-all volume: the bytes every rank sends, or the busiest receiver's."""

    dp_bytes: float
    """Data-parallel tables' gradient all-reduce bytes."""

    sync_bytes: float
    """Fullest rank's shard weights and optimizer state (what a replica sync all-reduces)."""

    emb_kernels: float
    """Embedding kernels per micro-batch forward on the busiest rank (1 with the fused TBE)."""

    mean_s: float
    """Mean rank's forward + backward lookups."""

    mem_weight_bytes: float
    """Shard weights on the rank whose embeddings take the most memory."""

    mem_optimizer_bytes: float
    """Their optimizer state."""

    mem_io_bytes: float
    """Its lookup buffers (outputs, gradients, ids) of one micro-batch, receive buffers excluded."""

    recv_bytes: float
    """Output bytes every rank receives per step (sharded tables; sizes the receive buffers)."""

    ranks: tuple | None = field(default=None, compare=False)
    """(forward, backward, memory) per rank, when known (for the per-rank figures of a report)."""

    def time_vars(self) -> dict[str, float]:
        """The values of the cut variables (see :class:`StepCut`)."""
        return {"fwd": self.fwd_max_s, "bwd": self.bwd_max_s, "a2a": self.a2a_bytes, "ids": self.ids_bytes,
                "dp": self.dp_bytes, "sync": self.sync_bytes}


def sparse_aggregates(ctx: Context, a: TableAssignment, rho: float, kernels: Kernels) -> SparseAggregates:
    """:class:`SparseAggregates` of a placement (``rho``: the jagged imbalance the receive volume scales by)."""
    M = ctx.micro_batches
    loads = embedding_loads(ctx, a)
    emb_launch = ctx.eff.launch_s.get("embedding", 5e-6)
    nk = np.where(loads["shards"] > 0, 1.0 if kernels.embedding == "fused" else loads["shards"], 0.0)
    t0cap = ctx.topology.tiers[0].bw_bytes_per_s * ctx.eff.collective.get((ctx.topology.tiers[0].name, "all_to_all"), 1.0)
    intra = loads["intra_node_bytes"] / t0cap
    fwd_r = loads["fwd_s"] + intra + nk * emb_launch * M
    bwd_r = loads["bwd_s"] + intra + 2 * nk * emb_launch * M
    mem_r = loads["weight_bytes"] + loads["optimizer_bytes"] + loads["io_bytes"]
    r_mem = int(np.argmax(mem_r))
    return SparseAggregates(
        fwd_max_s=float(fwd_r.max()), bwd_max_s=float(bwd_r.max()),
        a2a_bytes=max(float(loads["send_bytes"].max()), loads["recv_bytes"] * rho),
        ids_bytes=max(loads["ids_send_bytes"], float(loads["ids_recv_bytes"].max())),
        dp_bytes=float(loads["allreduce_bytes"]),
        # replicated (data-parallel) tables stay equal through their gradient all-reduce: no replica sync
        sync_bytes=float((loads["weight_bytes"] + loads["optimizer_bytes"]).max()) - loads["dp_state_bytes"],
        emb_kernels=float(nk.max()), mean_s=float(fwd_r.mean() + bwd_r.mean()),
        mem_weight_bytes=float(loads["weight_bytes"][r_mem]), mem_optimizer_bytes=float(loads["optimizer_bytes"][r_mem]),
        mem_io_bytes=float(loads["io_bytes"][r_mem]), recv_bytes=float(loads["recv_bytes"]),
        ranks=(fwd_r, bwd_r, mem_r),
    )


def _layer_map(ctx: Context, layers: Sequence[LayerPlan] | None) -> tuple[frozenset[str], frozenset[str]]:
    if not layers:
        return frozenset(), frozenset()
    known = set(ctx.layer_names)
    bad = [lp.name for lp in layers if lp.name not in known]
    if bad:
        raise CoplanError(f"layer plan names {bad[:5]} are not layers of workload '{ctx.workload.name}' (layers: {list(ctx.layer_names)[:8]}...)")
    rec = frozenset(lp.name for lp in layers if lp.recompute)
    fp8 = frozenset(lp.name for lp in layers if lp.precision == "fp8")
    return rec, fp8


def priced_launches(ctx: Context, arr, recomputed: frozenset[str] = frozenset(), emb_kernels: float = 0.0) -> float:
    """Kernel launches per step that the pricer charges a launch overhead for: every dense op's forward
    and backward launches per micro-batch (forward again for recomputed layers; for an op that ``arr``
    (:func:`op_arrays`) prices in FP8, its quantisation kernels, as
    :func:`coplan.costmodel.context._price_fp8_quantisation` counts them), the busiest rank's embedding
    kernels (``emb_kernels`` per micro-batch: one forward, two backward), and the dense optimizer's
    launches. The step time is linear in the launch cost with this slope on one GPU (tested); the
    host-bound form prices the host's time per launch on :func:`host_launches`, which is this count
    except for ops whose host issues more kernels than priced (the padded reference)."""
    return _step_launches(ctx, arr, arr.fwd_launches, arr.bwd_launches, recomputed, emb_kernels)


def _fp8_quant_launches(ctx: Context) -> int:
    """Quantisation kernels per priced forward launch of an FP8 op (forward and backward together)."""
    return 3 * math.ceil(ctx.options.fp8_quant_reads_rowwise) + 3 * math.ceil(ctx.options.fp8_quant_reads_colwise)


def _fixed_launches(ctx: Context) -> tuple[float, float, float]:
    """FSDP2's forward and backward copy launches per micro-batch and the optimizer's per step (0 where
    the plan has none of that work)."""
    fixed = dense_fixed_costs(ctx)
    return (FSDP_COPY_LAUNCHES[0] if fixed.fsdp_copy_fwd_s > 0 else 0.0,
            FSDP_COPY_LAUNCHES[1] if fixed.fsdp_copy_bwd_s > 0 else 0.0,
            OPTIMIZER_LAUNCHES if fixed.optimizer_step_s > 0 else 0.0)


def _step_launches(ctx: Context, arr, fwd: np.ndarray, bwd: np.ndarray, recomputed: frozenset[str],
                   emb_kernels: float) -> float:
    """A step's launches with ``fwd`` / ``bwd`` per dense op call (the priced launches, or the host's)."""
    ops = [ctx.ops[int(oi)] for oi in ctx.dense_idx]
    calls = np.array([2.0 if o.layer in recomputed else 1.0 for o in ops])  # forward again when recomputed
    quant = np.array([o.fwd_launches for o in ops], dtype=float) * _fp8_quant_launches(ctx) * (np.asarray(arr.fp8) != 0)
    dense = float((np.asarray(fwd) * calls + np.asarray(bwd) + quant).sum()) if ops else 0.0
    fsdp_f, fsdp_b, opt = _fixed_launches(ctx)
    return float((dense + 3.0 * emb_kernels + fsdp_f + fsdp_b) * ctx.micro_batches + opt)


def host_segments(ctx: Context, arr, recomputed: frozenset[str] = frozenset(), emb_kernels: float = 0.0
                  ) -> tuple[list[float], list[tuple[int, int, str]]]:
    """The step's host launches in the order the host issues them, cut at its syncs with the device.

    Returns (launches, syncs): ``syncs[j]`` = (micro-batch, dense op index, ``"fwd"`` or
    ``"recompute"``) of the j-th forward call that reads a device value back before its kernels
    (:attr:`OpArrays.fwd_syncs`, the padded reference); ``launches[j]`` the priced launches the host
    issues before it since the previous sync, and the last entry those after the last sync. The order
    is the trainer's: per micro-batch the embedding lookups, FSDP2's forward copies, the layers'
    forward calls, then per layer in reverse its recompute and backward, FSDP2's backward copies and
    the embedding backward; the optimizer once at the end. Each op counts its host launches
    (:attr:`OpArrays.fwd_host_launches`: the priced launches, or the kernels of an op whose host
    issues more, in priced units), so the launches add up to :func:`host_launches`."""
    segs, syncs, _ = _walk_segments(ctx, arr, recomputed, emb_kernels)
    return segs, syncs


def sync_exposed(ctx: Context, arr, recomputed: frozenset[str] = frozenset(), emb_kernels: float = 0.0) -> list[float]:
    """Per segment of :func:`host_segments`, the host launches (priced units) the device waits through:
    none before the first sync; after each, every forward (or recompute) launch up to the segment's first
    backward one. At a sync the device drains, and in the forward that follows the host issues each op's
    kernels about as the device runs them (the reference's own calls are ~84 host-heavy kernels each), so
    the host's forward after a sync is not hidden under device work; the backward, which never syncs,
    runs ahead of the device as without syncs. Measured: on the H200 (calibration rounds 8-9, six runs of
    the padded reference at 12-15 samples, longest lengths 1,000-4,096) each step is linear in
    batch × padded length² with a slope equal to the priced attention's device time (0.86-0.89 ms per
    10^6 across all six runs) and an intercept of 50-71 ms: host and device add up, they do not overlap."""
    return _walk_segments(ctx, arr, recomputed, emb_kernels)[2]


def _walk_segments(ctx: Context, arr, recomputed: frozenset[str], emb_kernels: float
                   ) -> tuple[list[float], list[tuple[int, int, str]], list[float]]:
    if not np.any(arr.fwd_syncs):
        # no sync: one segment (the planner's inner loop prices many plans; no per-call walk needed)
        return [_step_launches(ctx, arr, arr.fwd_host_launches, arr.bwd_host_launches, recomputed, emb_kernels)], [], [0.0]
    quant = _fp8_quant_launches(ctx)
    fsdp_f, fsdp_b, opt = _fixed_launches(ctx)
    by_layer: dict[int, list[int]] = {}
    for k in range(len(ctx.dense_idx)):
        by_layer.setdefault(int(ctx.op_layer[k]), []).append(k)
    nl = len(ctx.layer_names)
    segs: list[float] = [0.0]
    exposed: list[float] = [0.0]
    syncs: list[tuple[int, int, str]] = []
    exposing = False  # after a sync, until the first backward launch

    def fwd(n: float) -> None:
        segs[-1] += n
        if exposing:
            exposed[-1] += n

    def bwd(n: float) -> None:
        nonlocal exposing
        segs[-1] += n
        exposing = exposing and n <= 0

    def call(m: int, k: int, phase: str, n: float) -> None:
        nonlocal exposing
        if arr.fwd_syncs[k] > 0:
            syncs.append((m, k, phase))
            segs.append(0.0)
            exposed.append(0.0)
            exposing = True
        fwd(n)

    for m in range(ctx.micro_batches):
        fwd(emb_kernels + fsdp_f)
        for i in range(nl):
            for k in by_layer.get(i, ()):
                o = ctx.ops[int(ctx.dense_idx[k])]
                call(m, k, "fwd", float(arr.fwd_host_launches[k]) + (o.fwd_launches * quant if arr.fp8[k] else 0.0))
        for i in range(nl - 1, -1, -1):
            if ctx.layer_names[i] in recomputed:
                for k in by_layer.get(i, ()):
                    call(m, k, "recompute", float(arr.fwd_host_launches[k]))
            bwd(float(sum(arr.bwd_host_launches[k] for k in by_layer.get(i, ()))))
        bwd(fsdp_b + 2.0 * emb_kernels)
    bwd(opt)
    return segs, syncs, exposed


def host_launches(ctx: Context, arr, recomputed: frozenset[str] = frozenset(), emb_kernels: float = 0.0) -> float:
    """Launches per step the host side charges ``host_launch_s`` for: :func:`priced_launches`, except that
    an op whose host issues more kernels than the pricer charges the device for (the padded reference)
    counts those, in priced units (:data:`coplan.costmodel.context.HOST_KERNELS_PER_PRICED_LAUNCH`).
    Equal to :func:`priced_launches` when no op does (every Triton/flex plan)."""
    return float(sum(host_segments(ctx, arr, recomputed, emb_kernels)[0]))


def synced_step(host_s: Sequence[float], device_s: Sequence[float], exposed_s: Sequence[float] | None = None) -> float:
    """The step of a host and a device that meet at syncs: between two syncs the host issues its
    segment's work while the device runs what it queued, and at a sync the host waits for the device
    to finish everything queued, so neither runs ahead across it; each segment lasts the longer of its
    host and device times, and the step is their sum. ``host_s[j]``, ``device_s[j]``: the j-th
    segment's times (one segment, no sync: ``max(host, device)``, the max form). ``exposed_s[j]``: the
    part of ``host_s[j]`` the device waits through at the segment's start (after the sync, before the
    host has issued work that keeps the device busy): segment = exposed + max(host − exposed, device)."""
    if len(host_s) != len(device_s) or not len(host_s) or (exposed_s is not None and len(exposed_s) != len(host_s)):
        raise CoplanError(f"synced_step needs one host and one device time per segment; got {len(host_s)} and {len(device_s)}")
    ex = exposed_s if exposed_s is not None else [0.0] * len(host_s)
    return float(sum(min(e, h) + max(h - min(e, h), d, 0.0) for h, d, e in zip(host_s, device_s, ex)))


def price(
    ctx: Context,
    tables: Sequence[TableShard] | TableAssignment | None = None,
    layers: Sequence[LayerPlan] | None = None,
    balancing: BalancingPlan | None = None,
    kernels: Kernels | None = None,
    *,
    detail: bool = True,
    include_embeddings: bool = True,
    segments: bool = False,
    aggregates: SparseAggregates | None = None,
    cuts: bool = False,
    contention: bool = True,
) -> StepCost:
    """Price one plan. ``tables=None`` prices a greedy table-wise placement; ``detail=False`` skips the
    per-op rows (the planner's inner loop); ``include_embeddings=False`` prices the dense part alone
    (no lookups, all-to-alls or embedding memory), the rank-independent base a placement adds to;
    ``segments=True`` fills :attr:`StepCost.segments` even without a host cost (the calibration's fit of it).

    ``aggregates`` prices a table placement given only by what it adds to the step
    (:class:`SparseAggregates`: the planner's solutions, priced without building shards); ``tables`` is
    then ignored. ``cuts=True`` fills :attr:`StepCost.cuts`: the step as a linear function of the
    aggregates and the recompute set along the schedule's critical path, and each stream's serial
    work (see :class:`StepCut`). ``contention=False`` prices without the SM-contention slowdown (a
    lower bound of the step: the planner's floor and probe points)."""
    w = ctx.workload
    kernels = kernels or w.kernels
    balancing = balancing or BalancingPlan()
    recomputed, fp8_layers = _layer_map(ctx, layers)
    notes: list[str] = []
    if fp8_layers and w.precision.fp8 == "off":
        notes.append("fp8 layers requested while the workload's precision.fp8 is 'off'; priced as asked")
    if fp8_layers:
        notes.append("fp8 GEMMs priced at the fp8 peak plus their quantisation passes (memory-bound casts of inputs, "
                     "output gradients and weights, kept apart from the GEMM); memory unchanged (activations saved in the compute dtype)")
    if kernels.attention == "reference" and any(o.op_class == "attention" and o.sequence for o in ctx.ops):
        notes.append("attention backend 'reference' pads each micro-batch to its expected longest sequence")
    if kernels.attention == "flex":
        notes.append("attention backend 'flex' priced with 128-token tile rounding and 0.8× the fused kernel's efficiency")
    rho = imbalance(ctx, balancing.policy, kernels)
    arr = op_arrays(ctx, kernels, fp8_layers)
    f_op, b_op = arr.times(rho)
    f_mean, b_mean = arr.times(1.0)
    M = ctx.micro_batches
    nl = len(ctx.layer_names)
    L = ctx.op_layer
    fl = np.bincount(L, weights=f_op, minlength=nl)
    bl = np.bincount(L, weights=b_op, minlength=nl)
    dense_mean = float((f_mean.sum() + b_mean.sum()) * M)

    # MoE layers: split into router | shared experts | routed experts | the rest, forward and backward
    moe_parts: dict[int, dict[str, tuple[float, float]]] = {}
    if ctx.layer_is_moe.any():
        for k, oi in enumerate(ctx.dense_idx):
            li = int(L[k])
            if not ctx.layer_is_moe[li]:
                continue
            suffix = ctx.ops[oi].name.rsplit(".", 1)[-1]
            part = {"router": "router", "shared_experts": "shared", "experts": "experts"}.get(suffix, "post")
            d = moe_parts.setdefault(li, {})
            pf, pb = d.get(part, (0.0, 0.0))
            d[part] = (pf + float(f_op[k]), pb + float(b_op[k]))

    # ---------------------------------------------------------------- embeddings
    if not include_embeddings or not ctx.tables.num or aggregates is not None:
        a = None
    else:
        a = table_assignment(ctx, tables) if tables is not None else default_assignment(ctx)
    sparse_model = ctx.model("sparse_shard", "all_to_all")
    if aggregates is not None and include_embeddings and ctx.tables.num:
        a = None
        agg = aggregates
    elif a is not None:
        agg = sparse_aggregates(ctx, a, rho, kernels)
    else:
        agg = None
    loads = agg
    if agg is not None:
        emb_fwd = agg.fwd_max_s / M
        emb_bwd = agg.bwd_max_s / M
        a2a_bytes = agg.a2a_bytes / M
        ids_bytes = agg.ids_bytes / M
        dp_ar = agg.dp_bytes
        rsync = agg.sync_bytes if ctx.mesh.sparse_replicate > 1 else 0.0
        emb_mean = agg.mean_s
    else:
        emb_fwd = emb_bwd = a2a_bytes = ids_bytes = dp_ar = rsync = 0.0
        emb_mean = 0.0
    a2a_t = sparse_model.time(a2a_bytes)
    ids_t = sparse_model.time(ids_bytes)

    # ---------------------------------------------------------------- dense collectives per call
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
    ep_bytes = np.zeros(nl)
    for li in moe_parts:
        b = ctx.moe_blocks[ctx.layer_names[li]]
        ep_bytes[li] = ctx.mb_batch * b.tokens_per_sample * b.top_k * b.model_dim * cb * b.capacity_factor if ep > 1 else 0.0
    ep_t = a2a_ep.time(ep_bytes)
    reshard = ctx.options.reshard_after_forward

    # ---------------------------------------------------------------- schedule
    S = Schedule()

    streams: dict[tuple[str, str], str] = {}

    def affine(model, nbytes: float, var: str, per: float) -> tuple:
        """A collective's time as (constant, ((var, seconds per unit of var),)): latency + bytes × s/byte,
        the bytes being ``per ×`` the variable (0 for one rank)."""
        if model.trivial:
            return (0.0, ())
        return (model.latency_s if nbytes > 0 else 0.0, ((var, model.s_per_byte * per),))

    a2a_form = affine(sparse_model, a2a_bytes, "a2a", 1.0 / M)
    ids_form = affine(sparse_model, ids_bytes, "ids", 1.0 / M)

    def comm_add(name: str, dur: float, deps=(), *, meta, **kw) -> int:
        # one stream per bottleneck link: collectives that share links queue, others run side by side
        key = (meta[1], meta[0])
        st = streams.get(key)
        if st is None:
            st = streams[key] = "net:" + (ctx.model(meta[1], meta[0]).bottleneck or ctx.topology.tiers[0].name)
        return S.add(name, st, dur, deps, meta=meta, **kw)

    names = ctx.layer_names
    needs = ctx.layer_needs_embeddings
    first_need = int(np.flatnonzero(needs)[0]) if needs.any() else -1
    last_rs: list[int] = []
    sparse_sm = not sparse_model.sm_free
    fixed = dense_fixed_costs(ctx)
    sync_task: dict[tuple[int, int, str], int] = {}
    for m in range(M):
        ids_task = None
        if loads is not None and not ctx.options.pipeline_input_dist:
            ids_task = comm_add("sparse.ids_all_to_all", ids_t, phase="fwd", layer="sparse", sm=sparse_sm, meta=("all_to_all", "sparse_shard", ids_bytes),
                                form=ids_form)
        emb_f = S.add("sparse.tbe", COMPUTE, emb_fwd, (ids_task,), phase="fwd", layer="sparse",
                      form=(0.0, (("fwd", 1.0 / M),))) if loads is not None else None
        out_a2a = comm_add("sparse.all_to_all_fwd", a2a_t, (emb_f,), phase="fwd", layer="sparse", sm=sparse_sm,
                        meta=("all_to_all", "sparse_shard", a2a_bytes), form=a2a_form) if loads is not None else None
        # forward
        fwd_task: list[int] = [-1] * nl
        ag_task: list[int | None] = [None] * nl
        def gather(j: int, dep, phase: str):
            last = None
            for name, dur, meta in ag_parts[j]:
                last = comm_add(name, dur, (dep,), phase=phase, layer=names[j], sm=sm_of[meta[1]], meta=meta)
            return last

        if nl:
            ag_task[0] = gather(0, None, "fwd")
        if fixed.fsdp_copy_fwd_s > 0:
            # FSDP2's parameter casts and copies (and the inputs' cast) run before the first layer on
            # the compute stream: memory-bound kernels of their own, not hidden under any op
            S.add("fsdp.hooks", COMPUTE, fixed.fsdp_copy_fwd_s, (ag_task[0] if nl else None,), phase="fwd", layer="fsdp")
        for i in range(nl):
            if i + 1 < nl:
                ag_task[i + 1] = gather(i + 1, fwd_task[i - 1] if i >= 1 else None, "fwd")
            deps = [ag_task[i]]
            if needs[i]:
                deps.append(out_a2a)
            if i in moe_parts:
                p = moe_parts[i]
                r = S.add(f"{names[i]}.router", COMPUTE, p.get("router", (0, 0))[0], deps, phase="fwd", layer=names[i])
                disp = comm_add(f"{names[i]}.ep_dispatch", ep_t[i], (r,), phase="fwd", layer=names[i], sm=not a2a_ep.sm_free,
                             meta=("all_to_all", "expert", ep_bytes[i]))
                S.add(f"{names[i]}.shared", COMPUTE, p.get("shared", (0, 0))[0], (r,), phase="fwd", layer=names[i])
                ex = S.add(f"{names[i]}.experts", COMPUTE, p.get("experts", (0, 0))[0], (disp,), phase="fwd", layer=names[i])
                comb = comm_add(f"{names[i]}.ep_combine", ep_t[i], (ex,), phase="fwd", layer=names[i], sm=not a2a_ep.sm_free,
                             meta=("all_to_all", "expert", ep_bytes[i]))
                fwd_task[i] = S.add(f"{names[i]}.post", COMPUTE, p.get("post", (0, 0))[0], (comb,), phase="fwd", layer=names[i])
            else:
                fwd_task[i] = S.add(f"{names[i]}.fwd", COMPUTE, fl[i], deps, phase="fwd", layer=names[i])
            sync_task[(m, i, "fwd")] = fwd_task[i]
        # backward: the last layer keeps its parameters; layer i-1 is gathered as layer i starts
        bwd_task: list[int] = [-1] * nl
        agb: list[int | None] = [None] * nl
        grad_a2a = None
        for i in range(nl - 1, -1, -1):
            j = i - 1
            if reshard and j >= 0:
                agb[j] = gather(j, bwd_task[i + 1] if i + 1 < nl else fwd_task[nl - 1], "bwd")
            deps = (agb[i],)
            if names[i] in recomputed:
                rc = S.add(f"{names[i]}.recompute", COMPUTE, fl[i], deps, phase="recompute", layer=names[i],
                           form=(0.0, ((f"rc:{names[i]}", float(fl[i])),)))
                sync_task[(m, i, "recompute")] = rc
                if i in moe_parts and ep_t[i] > 0:  # recomputing a MoE layer dispatches and combines again
                    deps = (comm_add(f"{names[i]}.ep_recompute", 2 * ep_t[i], (rc,), phase="bwd", layer=names[i],
                                  sm=not a2a_ep.sm_free, meta=("all_to_all", "expert", ep_bytes[i]),
                                  form=(0.0, ((f"rc:{names[i]}", float(2 * ep_t[i])),))),)
            elif cuts:
                # not recomputed: a task of no duration in the recompute's place changes nothing in the
                # schedule, and lets a critical path through it price what recomputing this layer would add
                S.add(f"{names[i]}.recompute", COMPUTE, 0.0, deps, phase="recompute", layer=names[i],
                      form=(0.0, ((f"rc:{names[i]}", float(fl[i])),)))
            if i in moe_parts:
                p = moe_parts[i]
                post = S.add(f"{names[i]}.post_bwd", COMPUTE, p.get("post", (0, 0))[1], deps, phase="bwd", layer=names[i])
                cb_t = comm_add(f"{names[i]}.ep_combine", ep_t[i], (post,), phase="bwd", layer=names[i], sm=not a2a_ep.sm_free,
                             meta=("all_to_all", "expert", ep_bytes[i]))
                exb = S.add(f"{names[i]}.experts_bwd", COMPUTE, p.get("experts", (0, 0))[1], (cb_t,), phase="bwd", layer=names[i])
                dsp = comm_add(f"{names[i]}.ep_dispatch", ep_t[i], (exb,), phase="bwd", layer=names[i], sm=not a2a_ep.sm_free,
                            meta=("all_to_all", "expert", ep_bytes[i]))
                S.add(f"{names[i]}.shared_bwd", COMPUTE, p.get("shared", (0, 0))[1], (post,), phase="bwd", layer=names[i])
                bwd_task[i] = S.add(f"{names[i]}.router_bwd", COMPUTE, p.get("router", (0, 0))[1], (dsp,), phase="bwd", layer=names[i])
            else:
                bwd_task[i] = S.add(f"{names[i]}.bwd", COMPUTE, bl[i], deps, phase="bwd", layer=names[i])
            for name, dur, meta in rs_parts[i]:
                last_rs.append(comm_add(name, dur, (bwd_task[i],), phase="bwd", layer=names[i], sm=sm_of[meta[1]], meta=meta))
            if i == first_need and loads is not None:
                grad_a2a = comm_add("sparse.all_to_all_bwd", a2a_t, (bwd_task[i],), phase="bwd", layer="sparse", sm=sparse_sm,
                                 meta=("all_to_all", "sparse_shard", a2a_bytes), form=a2a_form)
        if fixed.fsdp_copy_bwd_s > 0:
            # the gradients' copy-in, the one-rank divided copy and casts: after the layers' backward
            S.add("fsdp.hooks", COMPUTE, fixed.fsdp_copy_bwd_s, (bwd_task[0] if nl else None,), phase="bwd", layer="fsdp")
        if loads is not None:
            if grad_a2a is None:
                grad_a2a = comm_add("sparse.all_to_all_bwd", a2a_t, (), phase="bwd", layer="sparse", sm=sparse_sm,
                                 meta=("all_to_all", "sparse_shard", a2a_bytes), form=a2a_form)
            S.add("sparse.tbe_bwd", COMPUTE, emb_bwd, (grad_a2a,), phase="bwd", layer="sparse", form=(0.0, (("bwd", 1.0 / M),)))
    # once per step
    world_ar = ctx.model("world", "all_reduce")
    if dp_ar > 0:
        last_rs.append(comm_add("sparse.dp_all_reduce", world_ar.time(dp_ar), (), phase="bwd", layer="sparse",
                             sm=not world_ar.sm_free, meta=("all_reduce", "world", dp_ar), form=affine(world_ar, dp_ar, "dp", 1.0)))
    elif cuts and loads is not None and not world_ar.trivial:
        # no data-parallel table: a task of no duration in the all-reduce's place (nothing waits on it, so
        # the schedule is unchanged) lets the stream's cut price what one would add
        comm_add("sparse.dp_all_reduce", 0.0, (), phase="bwd", layer="sparse", sm=False, meta=("all_reduce", "world", 0.0),
                 form=(world_ar.latency_s, (("dp", world_ar.s_per_byte),)))
    rm = ctx.model("sparse_replicate", "all_reduce")
    every = w.optimizer.sparse_sync_interval_steps
    if rsync > 0:
        c0, terms = affine(rm, rsync, "sync", 1.0 / every)
        comm_add("sparse.replica_sync", rm.time(rsync) / every, (), phase="bwd", layer="sparse",
              sm=not rm.sm_free, meta=("all_reduce", "sparse_replicate", rsync), form=(c0 / every, terms))
    elif cuts and loads is not None and not rm.trivial:
        comm_add("sparse.replica_sync", 0.0, (), phase="bwd", layer="sparse", sm=False, meta=("all_reduce", "sparse_replicate", 0.0),
                 form=(rm.latency_s / every, (("sync", rm.s_per_byte / every),)))
    if fixed.optimizer_step_s > 0:
        S.add("optimizer.step", COMPUTE, fixed.optimizer_step_s, tuple(last_rs), phase="optimizer", layer="optimizer")
    if loads is not None and ctx.options.pipeline_input_dist:
        for _ in range(M):
            comm_add("sparse.ids_all_to_all", ids_t, (), phase="fwd", layer="sparse", sm=sparse_sm, meta=("all_to_all", "sparse_shard", ids_bytes),
                     form=ids_form)
    before = [t.duration for t in S.tasks]
    S.run(ctx.sm_contention if contention else 0.0)

    # ---------------------------------------------------------------- breakdowns
    perf_by_layer: dict[str, list[float]] = {}
    ph_compute = {"fwd": 0.0, "bwd": 0.0, "recompute": 0.0, "optimizer": 0.0}
    ph_comm = {"fwd": 0.0, "bwd": 0.0}
    ph_exp = {"fwd": 0.0, "bwd": 0.0}
    layer_factor_num: dict[str, float] = {}
    layer_factor_den: dict[str, float] = {}
    comm_acc: dict[tuple[str, str], list] = {}
    for i, t in enumerate(S.tasks):
        acc = perf_by_layer.setdefault(t.layer, [0.0] * 8)
        if t.is_compute:
            ph_compute[t.phase] += t.duration
            slot = {"fwd": 0, "bwd": 1, "recompute": 2, "optimizer": 3}[t.phase]
            acc[slot] += t.duration
            layer_factor_num[t.layer] = layer_factor_num.get(t.layer, 0.0) + t.duration
            layer_factor_den[t.layer] = layer_factor_den.get(t.layer, 0.0) + before[i]
        else:
            ph = "fwd" if t.phase == "fwd" else "bwd"
            ph_comm[ph] += t.duration
            ph_exp[ph] += S.exposed[i]
            acc[4 if ph == "fwd" else 5] += t.duration
            acc[6 if ph == "fwd" else 7] += S.exposed[i]
            if detail and t.duration > 0:
                kind, group, nbytes = t.meta
                c = comm_acc.setdefault((t.name, ph), [kind, group, nbytes, 0.0, 0.0, 0])
                c[3] += t.duration
                c[4] += S.exposed[i]
                c[5] += 1
    perf = Perf(ph_compute["fwd"], ph_compute["bwd"], ph_compute["recompute"], ph_compute["optimizer"],
                ph_comm["fwd"], ph_comm["bwd"], ph_exp["fwd"], ph_exp["bwd"])
    # calibrated: device work no priced op accounts for, as a share of the priced device step
    factor = ctx.eff.device_step_factor
    step = device_step = S.makespan * factor
    if factor != 1.0:
        notes.append(f"device step {S.makespan * 1e3:.2f} ms x {factor:.3f} (calibrated device_step_factor: device work "
                     f"the ops do not price) = {device_step * 1e3:.2f} ms")
    seg_out: tuple[tuple[float, float, float], ...] = ()
    if segments or ctx.eff.host_launch_s > 0 or ctx.eff.host_sample_s > 0:
        segs, syncs, exposed = _walk_segments(ctx, arr, recomputed, agg.emb_kernels if agg is not None else 0.0)
        if syncs:
            dev_at = [factor * _device_position(ctx, S, before, sync_task, moe_parts, f_op, m, k, ph) for m, k, ph in syncs]
            dev_seg = np.diff(np.concatenate(([0.0], dev_at, [step])))
        else:
            dev_seg = np.array([step])
        seg_out = tuple((float(n), float(e), float(d)) for n, e, d in zip(segs, exposed, dev_seg))
    if ctx.eff.host_launch_s > 0 or ctx.eff.host_sample_s > 0:
        # host-bound steps (calibrated max form): the host issues every priced launch at a fitted cost and
        # does its per-sample work, concurrently with the device; the step is the longer of the two
        # (without syncs; with them, the sum over the segments between syncs, below)
        work_s = host_work_s(ctx)
        host_s = ctx.eff.host_launch_s * sum(segs) + work_s
        if host_s > step:
            notes.append(f"host-bound: {host_s * 1e3:.2f} ms of host time (kernel launches at {ctx.eff.host_launch_s * 1e6:.1f} us "
                         f"each, {work_s * 1e3:.2f} ms per-sample work) exceed the device's {step * 1e3:.2f} ms; "
                         "step priced at the host's time")
        if syncs:
            # at each sync the host waits for the device's queued work: the host's forward after it is exposed
            # (sync_exposed), the rest overlaps the device within the segment; the step sums the segments
            per_launch = host_s / max(sum(segs), 1e-300)  # the per-sample host work spread with the launches
            synced = synced_step([n * per_launch for n in segs], dev_seg.tolist(), [e * per_launch for e in exposed])
            notes.append(f"the host syncs with the device {len(syncs)} times per step (attention backend '{kernels.attention}' "
                         f"reads the longest length back): step priced as the sum over the {len(syncs) + 1} segments between "
                         f"syncs of the host's exposed forward ({sum(exposed) * per_launch * 1e3:.2f} ms in all) plus max(the "
                         f"rest of the host, device), {synced * 1e3:.2f} ms against max(host {host_s * 1e3:.2f}, "
                         f"device {step * 1e3:.2f}) ms")
            host_s = synced
        step = max(step, host_s)
    step_cuts: tuple[StepCut, ...] = ()
    if cuts:
        step_cuts = (_path_cut(S, factor),) + _stream_cuts(S, factor) + _through_cuts(S, factor)
        if ctx.eff.host_launch_s > 0 or ctx.eff.host_sample_s > 0:
            step_cuts += (_host_cut(ctx, arr, recomputed, host_s),)
    layers_perf = {k: Perf(*v) for k, v in perf_by_layer.items()}

    ops_out: list[OpCost] = []
    comms_out: list[CommCost] = []
    if detail:
        for k, oi in enumerate(ctx.dense_idx):
            o = ctx.ops[oi]
            fac = layer_factor_num.get(o.layer, 1.0) / max(layer_factor_den.get(o.layer, 1.0), 1e-300)
            ops_out.append(OpCost(o.name, o.op_class, "fwd", float(f_op[k]) * M * fac, float(arr.fwd_flops[k] * rho * M), float(arr.fwd_bytes[k] * M), o.layer))
            ops_out.append(OpCost(o.name, o.op_class, "bwd", float(b_op[k]) * M * fac, float(arr.bwd_flops[k] * rho * M), float(arr.bwd_bytes[k] * M), o.layer))
            if o.layer in recomputed:
                ops_out.append(OpCost(o.name, o.op_class, "recompute", float(f_op[k]) * M * fac, float(arr.fwd_flops[k] * rho * M), float(arr.fwd_bytes[k] * M), o.layer))
        fac = lambda layer: layer_factor_num.get(layer, 1.0) / max(layer_factor_den.get(layer, 1.0), 1e-300)  # noqa: E731
        if loads is not None:
            ops_out.append(OpCost("sparse.tbe", "embedding", "fwd", emb_fwd * M * fac("sparse"), 0.0, 0.0, "sparse"))
            ops_out.append(OpCost("sparse.tbe", "embedding", "bwd", emb_bwd * M * fac("sparse"), 0.0, 0.0, "sparse"))
        if fixed.optimizer_step_s > 0:
            ops_out.append(OpCost("optimizer.step", "elementwise", "optimizer", fixed.optimizer_step_s * fac("optimizer"), 0.0, 0.0, "optimizer"))
        if fixed.fsdp_copy_fwd_s > 0 or fixed.fsdp_copy_bwd_s > 0:
            cf, cbk = fsdp_copy_bytes(ctx)
            ops_out.append(OpCost("fsdp.hooks", "elementwise", "fwd", fixed.fsdp_copy_fwd_s * M * fac("fsdp"), 0.0, cf * M, "fsdp"))
            ops_out.append(OpCost("fsdp.hooks", "elementwise", "bwd", fixed.fsdp_copy_bwd_s * M * fac("fsdp"), 0.0, cbk * M, "fsdp"))
        for (name, ph), (kind, group, nbytes, t, e, calls) in comm_acc.items():
            g = ctx.groups[group]
            comms_out.append(CommCost(name, kind, g.size, g.tiers, float(nbytes), t, e, ph, calls))

    # ---------------------------------------------------------------- memory
    act = np.bincount(L, weights=arr.act_bytes, minlength=nl) * rho
    inp = ctx.layer_input_bytes * ctx.mb_batch * rho
    rec_mask = np.array([n in recomputed for n in names], dtype=bool) if nl else np.zeros(0, dtype=bool)
    acts = float(np.where(rec_mask, np.minimum(inp, act), act).sum())
    rpeak = float(act[rec_mask].max()) if rec_mask.any() else 0.0
    n_comm = sum(1 for k, g in ctx.groups.items() if g.size > 1 and k != "world") + (1 if dp_ar > 0 else 0)
    ep_stage = 2.0 * float(ep_bytes.max()) if nl else 0.0
    hbm = ctx.topology.gpu.hbm_bytes
    if agg is not None:
        emb_w, emb_o = agg.mem_weight_bytes, agg.mem_optimizer_bytes
        emb_io = agg.mem_io_bytes + 2.0 * agg.recv_bytes * rho / M
    else:
        emb_w, emb_o, emb_io = 0.0, 0.0, 0.0
    mem = Memory(
        parameters=fixed.params_bytes, gradients=fixed.grads_bytes, optimizer=fixed.optimizer_bytes,
        fsdp_buffers=fixed.fsdp_buffer_bytes, activations=acts, recompute_peak=rpeak,
        embeddings=emb_w, embedding_optimizer=emb_o, embedding_io=emb_io,
        comm_buffers=n_comm * ctx.options.nccl_bytes_per_communicator + ep_stage,
    )

    # ---------------------------------------------------------------- ranks, flops, goodput
    if agg is not None and agg.ranks is not None:
        fwd_r, bwd_r, emb_tot = agg.ranks
        r_mem = int(np.argmax(emb_tot))
        tot = fwd_r + bwd_r
        r_hi, r_lo = int(np.argmax(tot)), int(np.argmin(tot))
        ids = [r_hi] if r_hi == r_lo else [r_hi, r_lo]
        if r_mem not in ids:
            ids.append(r_mem)
        base = perf.total - (emb_fwd + emb_bwd) * M
        rank_time = tuple(float(base + fwd_r[r] + bwd_r[r]) for r in ids)
        rank_mem = tuple(float(mem.total - (emb_tot[r_mem] - emb_tot[r])) for r in ids)
    else:
        ids, rank_time, rank_mem = [0], (perf.total,), (mem.total,)
    mflops = _model_flops(ctx)
    gp = goodput_of(ctx.topology, _state_bytes(ctx), ctx.world)
    compute_mean = dense_mean + emb_mean
    return StepCost(
        step_time_s=step, perf=perf, compute_mean_s=compute_mean, imbalance=rho,
        imbalance_s=max(0.0, (rho - 1.0) * float((f_mean.sum() + b_mean.sum()) * M)),
        model_flops=mflops, world_size=ctx.world, peak_flops_per_s=ctx.topology.dense_peak_flops_per_s,
        memory=mem, hbm_capacity_bytes=hbm, hbm_reserve_bytes=hbm * ctx.topology.gpu.hbm_reserve_fraction, ops=tuple(ops_out), comms=tuple(comms_out), layers=layers_perf,
        rank_ids=tuple(int(r) for r in ids), rank_time_s=rank_time, rank_memory_bytes=rank_mem, goodput=gp, notes=tuple(notes),
        unpriced_device_s=max(0.0, device_step - S.makespan) if step <= device_step else 0.0,
        segments=seg_out, cuts=step_cuts,
    )


def _chain_cut(S: Schedule, chain, factor: float, source: str) -> StepCut:
    """A chain of tasks as a :class:`StepCut`: each task's duration in the planner's variables where it
    has a form (its SM-contention lengthening kept as a constant, and as slack), else its duration; times
    the calibrated device-step factor. Tasks of a chain run one after another, so the chain's length is
    at most the makespan wherever the placement moves."""
    const = slack = 0.0
    coef: dict[str, float] = {}
    rc: dict[str, float] = {}
    on: dict[str, float] = {}
    for i in chain:
        t = S.tasks[i]
        slack += t.duration - S.base[i]
        if t.form is None:
            const += t.duration
            continue
        c0, terms = t.form
        const += t.duration - S.base[i]
        if c0 and len(terms) == 1 and not terms[0][0].startswith("rc:"):
            on[terms[0][0]] = on.get(terms[0][0], 0.0) + c0  # a latency: paid only when bytes move
        else:
            const += c0
        for var, k in terms:
            if var.startswith("rc:"):
                rc[var[3:]] = rc.get(var[3:], 0.0) + k
            else:
                coef[var] = coef.get(var, 0.0) + k
    return StepCut(const * factor, {k: v * factor for k, v in coef.items()}, {k: v * factor for k, v in rc.items()}, source,
                   {k: v * factor for k, v in on.items()}, slack * factor)


def _path_cut(S: Schedule, factor: float) -> StepCut:
    """The schedule's critical path as a :class:`StepCut` (see :func:`_chain_cut`): exact at the plan
    priced, its chain adding up to the makespan."""
    return _chain_cut(S, S.critical_path(), factor, "device")


def _through_cuts(S: Schedule, factor: float) -> tuple[StepCut, ...]:
    """For each kind of decision-dependent task (each aggregate, each recomputed layer), the longest
    chain through one of its tasks, as a cut: where the critical path does not cross a task (a replica
    sync of no bytes, say), the chain through it says what the step would pay once it grows."""
    tail, nxt = S.tail_paths()
    best: dict[tuple, tuple[float, int]] = {}
    for i, t in enumerate(S.tasks):
        if t.form is None:
            continue
        key = tuple(sorted(v for v, _ in t.form[1]))
        length = S.start[i] + t.duration + tail[i]
        if key not in best or length > best[key][0]:
            best[key] = (length, i)
    return tuple(_chain_cut(S, S.path_through(i, nxt), factor, "chain") for _, i in sorted(best.values(), key=lambda x: x[1]))


def _stream_cuts(S: Schedule, factor: float) -> tuple[StepCut, ...]:
    """One cut per stream whose work a decision moves: a stream's tasks run one after another, so
    their durations add up to a lower bound of the makespan."""
    by: dict[str, list[int]] = {}
    for i, t in enumerate(S.tasks):
        by.setdefault(t.stream, []).append(i)
    return tuple(_chain_cut(S, idx, factor, f"stream:{stream}") for stream, idx in sorted(by.items())
                 if any(S.tasks[i].form is not None for i in idx))


def _host_cut(ctx: Context, arr, recomputed: frozenset[str], host_s: float) -> StepCut:
    """The host's time (calibrated host-bound form) as a :class:`StepCut`: constant in the placement,
    plus each recomputed layer's forward launches again."""
    M = ctx.micro_batches
    per = np.zeros(len(ctx.layer_names))
    np.add.at(per, ctx.op_layer, np.asarray(arr.fwd_host_launches, dtype=float))
    h = {n: float(ctx.eff.host_launch_s * M * per[i]) for i, n in enumerate(ctx.layer_names)}
    const = host_s - sum(h[n] for n in recomputed if n in h)
    return StepCut(const, {}, h, "host")


def _device_position(ctx: Context, S: Schedule, before: list[float], sync_task: dict, moe_parts: dict, f_op: np.ndarray,
                     m: int, k: int, phase: str) -> float:
    """When the compute stream finishes the work queued before dense op ``k``'s ``phase`` call in
    micro-batch ``m``: its layer task's start plus the layer's ops before it (in the task's part: a MoE
    layer's forward runs the ops after the experts as one "post" task), scaled as the schedule
    stretched that task."""
    i = int(ctx.op_layer[k])
    t = sync_task[(m, i, phase)]
    part = _moe_part(ctx, k) if (i in moe_parts and phase == "fwd") else None
    off = 0.0
    for j in range(len(ctx.dense_idx)):
        if j == k:
            break
        if int(ctx.op_layer[j]) == i and (part is None or _moe_part(ctx, j) == part):
            off += float(f_op[j])
    stretch = S.tasks[t].duration / before[t] if before[t] > 0 else 1.0
    return S.start[t] + off * stretch


def _moe_part(ctx: Context, k: int) -> str:
    suffix = ctx.ops[int(ctx.dense_idx[k])].name.rsplit(".", 1)[-1]
    return {"router": "router", "shared_experts": "shared", "experts": "experts"}.get(suffix, "post")


def _model_flops(ctx: Context) -> float:
    hit = ctx.cache.get("model_flops")
    if hit is None:
        hit = F.model_flops(ctx.workload, batch_size=ctx.global_batch).total
        ctx.cache["model_flops"] = hit
    return hit


def _state_bytes(ctx: Context) -> float:
    hit = ctx.cache.get("state_bytes")
    if hit is None:
        w = ctx.workload
        pb = F.DTYPE_BYTES[w.precision.param_dtype]
        dense = float(ctx.layer_params.sum() + ctx.layer_expert_params.sum()) * (pb + w.optimizer.dense_state_bytes_per_param)
        ta = ctx.tables
        emb = float((ta.rows * ta.dim * ta.wbytes + ta.rows * (ta.state_row_fixed + ta.state_per_elem * ta.dim)).sum())
        hit = dense + emb
        ctx.cache["state_bytes"] = hit
    return hit


__all__ = ["SparseAggregates", "default_assignment", "embedding_loads", "host_launches", "sparse_aggregates", "host_segments", "price", "sync_exposed", "synced_step"]
