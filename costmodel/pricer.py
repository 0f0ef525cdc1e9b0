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

import dataclasses
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from coplan.costmodel import flops as F
from coplan.costmodel.compute import HOST_KERNELS_PER_PRICED_LAUNCH, OpArrays, host_work_s, imbalance, op_arrays
from coplan.costmodel.flops import GRAPH_HOST_KERNELS
from coplan.costmodel.context import Context
from coplan.costmodel.decomposed import FSDP_COPY_LAUNCHES, OPTIMIZER_LAUNCHES, dense_fixed_costs, table_option_costs
from coplan.costmodel.embedding import COLLECTION_KERNELS, DP, SHARDING_CODES, TWRW, TableAssignment, greedy_table_wise
from coplan.costmodel.fp8 import fused_ffn_layers
from coplan.costmodel.goodput import goodput as goodput_of
from coplan.costmodel.loader import LoaderTime, loader_step_s, reader_processes
from coplan.costmodel.memory import fsdp_copy_bytes, state_bytes, step_memory
from coplan.costmodel.results import CommCost, DenseFixedCosts, EmbeddingRanks, Memory, OpCost, Perf, SparseAggregates, StepCost, StepCut
from coplan.costmodel.schedule import Schedule
from coplan.costmodel.step_schedule import DenseWork, SparseWork, build_schedule, dense_collectives, dense_work, moe_part, sparse_work
from coplan.errors import CoplanError
from coplan.spec.plan import BalancingPlan, LayerPlan, TableShard
from coplan.spec.workload import Kernels

_CODE_NAMES = {v: k for k, v in SHARDING_CODES.items()}


def assignment_of(ctx: Context, tables) -> TableAssignment:
    """The plan's table shards as a :class:`TableAssignment` (checked against the mesh; cached per shard list)."""
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


def emb_group_launches(fused: bool) -> tuple[float, float]:
    """Priced launches (forward, backward) per micro-batch of one embedding kernel group: a TorchRec
    collection with the fused TBE (its :data:`~coplan.costmodel.embedding.COLLECTION_KERNELS`, in priced
    units: :data:`~coplan.costmodel.compute.HOST_KERNELS_PER_PRICED_LAUNCH` kernels each), or one table's
    own kernel (one forward, two backward)."""
    if fused:
        return COLLECTION_KERNELS[0] / HOST_KERNELS_PER_PRICED_LAUNCH, COLLECTION_KERNELS[1] / HOST_KERNELS_PER_PRICED_LAUNCH
    return 1.0, 2.0


def ctx_emb_launches(ctx: Context) -> tuple[float, float]:
    """:func:`emb_group_launches` for the workload's embedding kernels."""
    return emb_group_launches(ctx.workload.kernels.embedding == "fused")


def collections_held(ctx: Context, a: TableAssignment) -> np.ndarray:
    """Per sparse-group rank, the TorchRec collections it looks up in (each runs its own fused TBE and its
    own input and output distribution: :func:`~coplan.costmodel.embedding.table_collections`): those of
    the tables it holds a shard of, and of every data-parallel table."""
    G = ctx.mesh.sparse_shard
    coll = ctx.tables.collection
    n = int(coll.max()) + 1 if coll.size else 0
    held = np.zeros((G, max(n, 1)), bool)
    if a.shard_table.size:
        held[a.shard_rank, coll[a.shard_table]] = True
    if a.dp_tables.size:
        held[:, coll[a.dp_tables]] = True
    return held.sum(axis=1).astype(float)


def workload_collections(ctx: Context) -> float:
    """The TorchRec collections of the workload's tables (what a rank that holds every table looks up in)."""
    coll = ctx.tables.collection
    return float(np.unique(coll).size) if coll.size else 0.0


def sparse_aggregates(ctx: Context, a: TableAssignment, rho: float, kernels: Kernels) -> SparseAggregates:
    """:class:`SparseAggregates` of a placement (``rho``: the jagged imbalance the receive volume scales by)."""
    M = ctx.micro_batches
    loads = embedding_loads(ctx, a)
    emb_launch = ctx.eff.launch_s.get("embedding", 5e-6)
    fused = kernels.embedding == "fused"
    nk = collections_held(ctx, a) if fused else np.where(loads["shards"] > 0, loads["shards"], 0.0)
    ef, eb = emb_group_launches(fused)
    t0cap = ctx.topology.tiers[0].bw_bytes_per_s * ctx.eff.collective.get((ctx.topology.tiers[0].name, "all_to_all"), 1.0)
    intra = loads["intra_node_bytes"] / t0cap
    fwd_r = loads["fwd_s"] + intra + ef * nk * emb_launch * M
    bwd_r = loads["bwd_s"] + intra + eb * nk * emb_launch * M
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
        ranks=EmbeddingRanks(fwd_r, bwd_r, mem_r, loads["weight_bytes"], loads["optimizer_bytes"], loads["io_bytes"]),
    )


def layer_sets(ctx: Context, layers: Sequence[LayerPlan] | None) -> tuple[frozenset[str], frozenset[str]]:
    """(recomputed layers, fp8 layers) of a layer plan, checked against the workload's layers."""
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
    :func:`coplan.costmodel.fp8.price_fp8_quantisation` counts them), the busiest rank's embedding
    kernel groups (``emb_kernels`` per micro-batch, each :func:`emb_group_launches`), and the dense optimizer's
    launches. The step time is linear in the launch cost with this slope on one GPU (tested); the
    host-bound form prices the host's time per launch on :func:`host_launches`, which is this count
    except for ops whose host issues more kernels than priced (the padded reference)."""
    return _step_launches(ctx, arr, arr.fwd_launches, arr.bwd_launches, recomputed, emb_kernels)


def _graphed(ctx: Context, arr) -> bool:
    """Whether the trainer runs this step's dense arch as CUDA graphs: where they apply to the plan
    (:attr:`Context.dense_graphs`), with no FP8 layer and no attention that syncs with the host (the
    trainer's conditions, ``coplan.trainer.graphs.graphs_unavailable``)."""
    return ctx.dense_graphs and not np.any(arr.fwd_syncs) and not np.any(arr.fp8)


def _fixed_launches(ctx: Context, graphed: bool = False) -> tuple[float, float, float]:
    """FSDP2's forward and backward copy launches per micro-batch and the optimizer's per step (0 where
    the plan has none of that work)."""
    fixed = dense_fixed_costs(ctx)
    # (no FSDP2 under CUDA graphs: the graphs cast the masters themselves)
    return (FSDP_COPY_LAUNCHES[0] if fixed.fsdp_copy_fwd_s > 0 and not graphed else 0.0,
            FSDP_COPY_LAUNCHES[1] if fixed.fsdp_copy_bwd_s > 0 and not graphed else 0.0,
            OPTIMIZER_LAUNCHES if fixed.optimizer_step_s > 0 else 0.0)


def _step_launches(ctx: Context, arr, fwd: np.ndarray, bwd: np.ndarray, recomputed: frozenset[str],
                   emb_kernels: float, host: bool = False) -> float:
    """A step's launches with ``fwd`` / ``bwd`` per dense op call (the priced launches, or the host's).
    ``host``: the host's count, which CUDA graphs cut to a few per micro-batch (:func:`_graphed`; the device
    still runs every kernel, and the graphs' casts and gradient sums stand where FSDP2's copies do)."""
    ops = [ctx.ops[int(oi)] for oi in ctx.dense_idx]
    graphed = host and _graphed(ctx, arr)
    if graphed:
        # CUDA graphs: the dense forward and backward (recompute included) are two replays and a few copies
        dense = GRAPH_HOST_KERNELS / HOST_KERNELS_PER_PRICED_LAUNCH if ops else 0.0
    else:
        calls = np.array([2.0 if o.layer in recomputed else 1.0 for o in ops])  # forward again when recomputed
        quant = np.array([o.fwd_launches for o in ops], dtype=float) * np.asarray(arr.quant_launches)
        dense = float((np.asarray(fwd) * calls + np.asarray(bwd) + quant).sum()) if ops else 0.0
    fsdp_f, fsdp_b, opt = _fixed_launches(ctx, graphed)
    ef, eb = ctx_emb_launches(ctx)
    return float((dense + (ef + eb) * emb_kernels + fsdp_f + fsdp_b) * ctx.micro_batches + opt)


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
    runs ahead of the device as without syncs. Measured: on the H200 (six runs of
    the padded reference at 12-15 samples, longest lengths 1,000-4,096) each step is linear in
    batch × padded length² with a slope equal to the priced attention's device time (0.86-0.89 ms per
    10^6 across all six runs) and an intercept of 50-71 ms: host and device add up, they do not overlap."""
    return _walk_segments(ctx, arr, recomputed, emb_kernels)[2]


def _walk_segments(ctx: Context, arr, recomputed: frozenset[str], emb_kernels: float
                   ) -> tuple[list[float], list[tuple[int, int, str]], list[float]]:
    if not np.any(arr.fwd_syncs):
        # no sync: one segment (the planner's inner loop prices many plans; no per-call walk needed)
        return [_step_launches(ctx, arr, arr.fwd_host_launches, arr.bwd_host_launches, recomputed, emb_kernels, host=True)], [], [0.0]
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

    ef, eb = ctx_emb_launches(ctx)
    for m in range(ctx.micro_batches):
        fwd(ef * emb_kernels + fsdp_f)
        for i in range(nl):
            for k in by_layer.get(i, ()):
                o = ctx.ops[int(ctx.dense_idx[k])]
                call(m, k, "fwd", float(arr.fwd_host_launches[k]) + o.fwd_launches * float(arr.quant_launches[k]))
        for i in range(nl - 1, -1, -1):
            if ctx.layer_names[i] in recomputed:
                for k in by_layer.get(i, ()):
                    call(m, k, "recompute", float(arr.fwd_host_launches[k]))
            bwd(float(sum(arr.bwd_host_launches[k] for k in by_layer.get(i, ()))))
        bwd(fsdp_b + eb * emb_kernels)
    bwd(opt)
    return segs, syncs, exposed


def host_launches(ctx: Context, arr, recomputed: frozenset[str] = frozenset(), emb_kernels: float = 0.0) -> float:
    """Launches per step the host side charges ``host_launch_s`` for: :func:`priced_launches`, except that
    an op whose host issues more kernels than the pricer charges the device for (the padded reference)
    counts those, in priced units (:data:`coplan.costmodel.compute.HOST_KERNELS_PER_PRICED_LAUNCH`).
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
    per-op rows, the schedule and the launches per class (the planner's inner loop);
    ``include_embeddings=False`` prices the dense part alone (no lookups, all-to-alls or embedding
    memory), the rank-independent base a placement adds to; ``segments=True`` fills
    :attr:`StepCost.segments` even without a host cost (the calibration's fit of it).

    ``aggregates`` prices a table placement given only by what it adds to the step
    (:class:`SparseAggregates`: the planner's solutions, priced without building shards); ``tables`` is
    then ignored. ``cuts=True`` fills :attr:`StepCost.cuts`: the step as a linear function of the
    aggregates and the recompute set along the schedule's critical path, and each stream's serial
    work (see :class:`StepCut`). ``contention=False`` prices without the SM-contention slowdown (a
    lower bound of the step: the planner's floor and probe points).

    The stages: the dense ops' times (:func:`~coplan.costmodel.step_schedule.dense_work`), what the
    placement adds (:func:`_placement`), the schedule of the step (:mod:`.step_schedule`), run; then its
    device and host time (:func:`_step_time`), cuts, per-op rows (:func:`_op_rows`), memory
    (:func:`~coplan.costmodel.memory.step_memory`) and the sampled ranks (:func:`_sampled_ranks`)."""
    kernels = kernels or ctx.workload.kernels
    balancing = balancing or BalancingPlan()
    ctx = with_balance_group(ctx, balancing.group_ranks)
    recomputed, fp8_layers = layer_sets(ctx, layers)
    notes = _notes(ctx, kernels, fp8_layers)
    rho = imbalance(ctx, balancing.policy, kernels)
    d = dense_work(ctx, op_arrays(ctx, kernels, fp8_layers), rho)
    sp = sparse_work(ctx, _placement(ctx, tables, aggregates, include_embeddings, rho, kernels))
    cols = dense_collectives(ctx, d.moe_parts)
    b = build_schedule(ctx, d, sp, cols, recomputed, cuts)
    S = b.S
    before = [t.duration for t in S.tasks]
    S.run(ctx.sm_contention if contention else 0.0)

    br = _breakdown(S, before, detail)
    t = _step_time(ctx, S, before, b.sync_task, d, sp, recomputed, kernels, segments, notes)
    step_cuts: tuple[StepCut, ...] = ()
    if cuts:
        step_cuts = (_path_cut(S, t.factor),) + _stream_cuts(S, t.factor) + _through_cuts(S, t.factor)
        if _host_priced(ctx):
            step_cuts += (_host_cut(ctx, d.arr, recomputed, t.host_s),)
        if t.loader_s > 0:
            step_cuts += (StepCut(t.loader_s, {}, {}, "loader"),)
    ops_out, comms_out = _op_rows(ctx, d, sp, b.fixed, recomputed, br) if detail else ((), ())
    M = ctx.micro_batches
    emb = (sp.agg.mem_weight_bytes, sp.agg.mem_optimizer_bytes, sp.agg.mem_io_bytes + 2.0 * sp.agg.recv_bytes * rho / M) \
        if sp.agg is not None else (0.0, 0.0, 0.0)
    mem = step_memory(ctx, d.arr.act_bytes, rho, recomputed, b.fixed, emb, sp.dp_bytes > 0, cols.ep_bytes,
                      graphed=_graphed(ctx, d.arr))
    ids, rank_time, rank_mem = _sampled_ranks(br.perf, mem, sp, M)
    hbm = ctx.topology.gpu.hbm_bytes
    # a calibrated device-step factor below 1 (the device ran the priced work faster than its ops price it):
    # the step's parts shrink with it, so that no part is longer than the step
    perf = br.perf if t.factor >= 1.0 else Perf(*(t.factor * getattr(br.perf, f.name) for f in dataclasses.fields(Perf)))
    return StepCost(
        step_time_s=t.step, perf=perf, compute_mean_s=d.dense_mean + sp.mean_s, imbalance=rho,
        imbalance_s=max(0.0, (rho - 1.0) * float((d.f_mean.sum() + d.b_mean.sum()) * M)),
        model_flops=_model_flops(ctx), world_size=ctx.world, peak_flops_per_s=ctx.topology.dense_peak_flops_per_s,
        memory=mem, hbm_capacity_bytes=hbm, hbm_reserve_bytes=hbm * ctx.topology.gpu.hbm_reserve_fraction, ops=tuple(ops_out),
        comms=tuple(comms_out), layers=br.layers,
        rank_ids=tuple(int(r) for r in ids), rank_time_s=rank_time, rank_memory_bytes=rank_mem,
        goodput=goodput_of(ctx.topology, state_bytes(ctx), ctx.world,
                           **({} if ctx.options.step_jitter_cv is None else {"jitter_cv": ctx.options.step_jitter_cv})),
        notes=tuple(notes),
        unpriced_device_s=max(0.0, t.device_step - S.makespan) if t.step <= t.device_step else 0.0,
        host_s=t.host_s, loader_s=t.loader_s, device_s=t.device_step,
        segments=t.segments, cuts=step_cuts,
        schedule=S if detail else None, embedding=sp.agg.ranks if sp.agg is not None else None,
        **(_launches_by_class(ctx, d.arr) if detail else {}),
    )


def _notes(ctx: Context, kernels: Kernels, fp8_layers: frozenset[str]) -> list[str]:
    """What the pricing approximates for these kernels and fp8 layers."""
    notes: list[str] = []
    if fp8_layers and ctx.workload.precision.fp8 == "off":
        notes.append("fp8 layers requested while the workload's precision.fp8 is 'off'; priced as asked")
    if fp8_layers:
        notes.append("fp8 GEMMs priced at the fp8 peak plus their quantisation passes (memory-bound casts of inputs, "
                     "output gradients and weights, kept apart from the GEMM); memory unchanged (activations saved in the compute dtype)")
        fused = fused_ffn_layers(ctx.ops, ctx.workload, fp8_layers)
        if fused:
            notes.append(f"blockwise-fused: the FFN of {len(fused)} InterFormer/Kunlun layer(s) priced with norm2, SiLU and "
                         "SiLU's backward writing the fp8 operands (no quantisation pass for them), the per-call overhead "
                         "as measured for blockwise (the fused kernels are not timed on a GPU yet)")
    if kernels.attention == "reference" and any(o.op_class == "attention" and o.sequence for o in ctx.ops):
        notes.append("attention backend 'reference' pads each micro-batch to its expected longest sequence")
    if kernels.attention == "flex":
        notes.append("attention backend 'flex' priced with 128-token tile rounding and 0.8× the fused kernel's efficiency")
    return notes


def _placement(ctx: Context, tables, aggregates: SparseAggregates | None, include_embeddings: bool, rho: float,
               kernels: Kernels) -> SparseAggregates | None:
    """What the table placement adds: the given aggregates, or those of the given (or default) placement;
    None without tables or embeddings."""
    if not include_embeddings or not ctx.tables.num:
        return None
    if aggregates is not None:
        return aggregates
    a = assignment_of(ctx, tables) if tables is not None else default_assignment(ctx)
    return sparse_aggregates(ctx, a, rho, kernels)


@dataclass(frozen=True, slots=True)
class _Breakdown:
    """The run schedule read back: phase totals, per layer, and what the per-op rows need."""

    perf: Perf
    layers: dict[str, Perf]
    factor_num: dict[str, float]
    """Per layer: its compute tasks' durations after the SM-contention slowdown ..."""
    factor_den: dict[str, float]
    """... and before it (the ratio stretches each op's row)."""
    comm: dict[tuple[str, str], list]
    """(name, phase) -> [collective, group, bytes, seconds, exposed seconds, calls] (with ``detail``)."""


def _breakdown(S: Schedule, before: list[float], detail: bool) -> _Breakdown:
    perf_by_layer: dict[str, list[float]] = {}
    ph_compute = {"fwd": 0.0, "bwd": 0.0, "recompute": 0.0, "optimizer": 0.0}
    ph_comm = {"fwd": 0.0, "bwd": 0.0}
    ph_exp = {"fwd": 0.0, "bwd": 0.0}
    num: dict[str, float] = {}
    den: dict[str, float] = {}
    comm_acc: dict[tuple[str, str], list] = {}
    for i, t in enumerate(S.tasks):
        acc = perf_by_layer.setdefault(t.layer, [0.0] * 8)
        if t.is_compute:
            ph_compute[t.phase] += t.duration
            slot = {"fwd": 0, "bwd": 1, "recompute": 2, "optimizer": 3}[t.phase]
            acc[slot] += t.duration
            num[t.layer] = num.get(t.layer, 0.0) + t.duration
            den[t.layer] = den.get(t.layer, 0.0) + before[i]
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
    return _Breakdown(perf, {k: Perf(*v) for k, v in perf_by_layer.items()}, num, den, comm_acc)


def _host_priced(ctx: Context) -> bool:
    """Whether the calibration gives the host a cost (the step is then the longer of host and device)."""
    return ctx.eff.host_launch_s > 0 or ctx.eff.host_sample_s > 0 or ctx.eff.host_launch_graphed_s > 0


def host_launch_cost(ctx: Context, arr) -> float:
    """Host seconds per priced launch of this step: the calibration's graphed cost where the trainer replays
    the dense arch as CUDA graphs (:func:`_graphed`) and the calibration has one, else ``host_launch_s``."""
    if ctx.eff.host_launch_graphed_s > 0 and _graphed(ctx, arr):
        return ctx.eff.host_launch_graphed_s
    return ctx.eff.host_launch_s


@dataclass(frozen=True, slots=True)
class _StepTime:
    step: float
    device_step: float
    factor: float
    """The calibrated device-step factor."""
    host_s: float
    """The host's time (0 unless the host is priced)."""
    segments: tuple[tuple[float, float, float], ...]
    loader_s: float = 0.0
    """The data loader's time per step (:func:`loader_time`)."""


def _step_time(ctx: Context, S: Schedule, before: list[float], sync_task: dict, d: DenseWork, sp: SparseWork,
               recomputed: frozenset[str], kernels: Kernels, segments: bool, notes: list[str]) -> _StepTime:
    """The step: the device's (the schedule's makespan times the calibrated factor) or, when the host
    is priced, the longer of it and the host's (summed over the segments between syncs, with syncs)."""
    factor = ctx.eff.device_step_factor
    step = device_step = S.makespan * factor
    if factor != 1.0:
        notes.append(f"device step {S.makespan * 1e3:.2f} ms x {factor:.3f} (calibrated device_step_factor: device work "
                     f"the ops do not price) = {device_step * 1e3:.2f} ms")
    if ctx.eff.device_gap_s:
        n_dev = priced_launches(ctx, d.arr, recomputed, sp.agg.emb_kernels if sp.agg is not None else 0.0)
        kind = "calibrated device_gap_s" if ctx.eff.sources.get("device_gap", "").startswith("calibration") else "uncalibrated default"
        notes.append(f"device gaps: {ctx.eff.device_gap_s * 1e6:.2f} us per priced launch ({kind}: "
                     f"device time between kernels) x {n_dev:,.0f} launches = {ctx.eff.device_gap_s * n_dev * 1e3:.2f} ms "
                     f"of the {device_step * 1e3:.2f} ms device step, in the ops' launch costs")
    seg_out: tuple[tuple[float, float, float], ...] = ()
    host_s = 0.0
    if segments or _host_priced(ctx):
        segs, syncs, exposed = _walk_segments(ctx, d.arr, recomputed, sp.agg.emb_kernels if sp.agg is not None else 0.0)
        if syncs:
            offsets = _layer_offsets(ctx, d.moe_parts, d.f_op)
            dev_at = [factor * _device_position(ctx, S, before, sync_task, d.moe_parts, offsets, m, k, ph) for m, k, ph in syncs]
            dev_seg = np.diff(np.concatenate(([0.0], dev_at, [step])))
        else:
            dev_seg = np.array([step])
        seg_out = tuple((float(n), float(e), float(dv)) for n, e, dv in zip(segs, exposed, dev_seg))
    if _host_priced(ctx):
        # host-bound steps (calibrated max form): the host issues every priced launch at a fitted cost and
        # does its per-sample work, concurrently with the device; the step is the longer of the two
        # (without syncs; with them, the sum over the segments between syncs, below)
        work_s = host_work_s(ctx)
        h = host_launch_cost(ctx, d.arr)
        host_s = h * sum(segs) + work_s
        if host_s > step:
            graphed = " under CUDA graphs" if h != ctx.eff.host_launch_s else ""
            notes.append(f"host-bound: {host_s * 1e3:.2f} ms of host time (priced launches{graphed} at {h * 1e6:.1f} us "
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
    lt = loader_time(ctx)
    if lt.step_s > step:
        notes.append(f"loader-bound: the data loader needs {lt.step_s * 1e3:.2f} ms per step ({lt.processes} reader processes, "
                     f"{lt.values_per_sample:,.0f} values per sample, {lt.group_ranks} rank(s)' rows decoded by each) against "
                     f"{step * 1e3:.2f} ms of {'host' if host_s >= device_step and host_s > 0 else 'device'} time; step priced at the loader's")
    step = max(step, lt.step_s)
    return _StepTime(step, device_step, factor, host_s, seg_out, lt.step_s)


def with_balance_group(ctx: Context, group: int | None) -> Context:
    """``ctx`` with the plan's balance group (:attr:`~coplan.spec.BalancingPlan.group_ranks`) when it differs from
    the context's: a shallow copy sharing its caches (the imbalance's cache key holds the group)."""
    if group is None or min(ctx.world, max(1, group)) == ctx.balance_group:
        return ctx
    return dataclasses.replace(ctx, options=dataclasses.replace(ctx.options, balance_group_ranks=int(group)))


def loader_time(ctx: Context) -> LoaderTime:
    """One rank's data loader per step (:mod:`coplan.costmodel.loader`): it decodes its balance group's rows
    (:attr:`Context.balance_group`), with the processes the trainer starts on the topology's hosts, scaled by
    a calibration's ``loader_scale``."""
    topo = ctx.topology
    procs = reader_processes(topo.cpu_cores_per_node, min(ctx.world, topo.gpus_per_node))
    lt = loader_step_s(ctx.workload, ctx.local_batch, ctx.micro_batches, ctx.balance_group, procs)
    k = ctx.eff.loader_scale
    return LoaderTime(lt.step_s * k, lt.process_s * k, lt.processes, lt.group_ranks, lt.values_per_sample) if k != 1.0 else lt


def _op_rows(ctx: Context, d: DenseWork, sp: SparseWork, fixed: DenseFixedCosts, recomputed: frozenset[str], br: _Breakdown
             ) -> tuple[list[OpCost], list[CommCost]]:
    """Per-op rows (each stretched by its layer's SM-contention slowdown) and per-collective rows."""
    M, arr, rho = ctx.micro_batches, d.arr, d.rho
    ops_out: list[OpCost] = []
    comms_out: list[CommCost] = []
    num, den = br.factor_num, br.factor_den
    for k, oi in enumerate(ctx.dense_idx):
        o = ctx.ops[oi]
        fac = num.get(o.layer, 1.0) / max(den.get(o.layer, 1.0), 1e-300)
        ops_out.append(OpCost(o.name, o.op_class, "fwd", float(d.f_op[k]) * M * fac, float(arr.fwd_flops[k] * rho * M), float(arr.fwd_bytes[k] * M), o.layer))
        ops_out.append(OpCost(o.name, o.op_class, "bwd", float(d.b_op[k]) * M * fac, float(arr.bwd_flops[k] * rho * M), float(arr.bwd_bytes[k] * M), o.layer))
        if o.layer in recomputed:
            ops_out.append(OpCost(o.name, o.op_class, "recompute", float(d.f_op[k]) * M * fac, float(arr.fwd_flops[k] * rho * M), float(arr.fwd_bytes[k] * M), o.layer))
    fac = lambda layer: num.get(layer, 1.0) / max(den.get(layer, 1.0), 1e-300)  # noqa: E731
    if sp.agg is not None:
        ops_out.append(OpCost("sparse.tbe", "embedding", "fwd", sp.emb_fwd * M * fac("sparse"), 0.0, 0.0, "sparse"))
        ops_out.append(OpCost("sparse.tbe", "embedding", "bwd", sp.emb_bwd * M * fac("sparse"), 0.0, 0.0, "sparse"))
    if fixed.optimizer_step_s > 0:
        ops_out.append(OpCost("optimizer.step", "elementwise", "optimizer", fixed.optimizer_step_s * fac("optimizer"), 0.0, 0.0, "optimizer"))
    if fixed.fsdp_copy_fwd_s > 0 or fixed.fsdp_copy_bwd_s > 0:
        cf, cbk = fsdp_copy_bytes(ctx)
        ops_out.append(OpCost("fsdp.hooks", "elementwise", "fwd", fixed.fsdp_copy_fwd_s * M * fac("fsdp"), 0.0, cf * M, "fsdp"))
        ops_out.append(OpCost("fsdp.hooks", "elementwise", "bwd", fixed.fsdp_copy_bwd_s * M * fac("fsdp"), 0.0, cbk * M, "fsdp"))
    for (name, ph), (kind, group, nbytes, t, e, calls) in br.comm.items():
        g = ctx.groups[group]
        comms_out.append(CommCost(name, kind, g.size, g.tiers, float(nbytes), t, e, ph, calls))
    return ops_out, comms_out


def _sampled_ranks(perf: Perf, mem: Memory, sp: SparseWork, M: int) -> tuple[list[int], tuple[float, ...], tuple[float, ...]]:
    """The ranks at the extremes of the embedding load (slowest, fastest, fullest) with their busy time
    and memory: the critical rank's less its lookups plus each rank's own."""
    er = sp.agg.ranks if sp.agg is not None else None
    if er is None:
        return [0], (perf.total,), (mem.total,)
    fwd_r, bwd_r, emb_tot = er.fwd_s, er.bwd_s, er.memory_bytes
    r_mem = int(np.argmax(emb_tot))
    tot = fwd_r + bwd_r
    r_hi, r_lo = int(np.argmax(tot)), int(np.argmin(tot))
    ids = [r_hi] if r_hi == r_lo else [r_hi, r_lo]
    if r_mem not in ids:
        ids.append(r_mem)
    base = perf.total - (sp.emb_fwd + sp.emb_bwd) * M
    return ids, tuple(float(base + fwd_r[r] + bwd_r[r]) for r in ids), tuple(float(mem.total - (emb_tot[r_mem] - emb_tot[r])) for r in ids)


def _launches_by_class(ctx: Context, arr: OpArrays) -> dict[str, dict[str, float]]:
    """:attr:`StepCost.launches` and :attr:`StepCost.launch_s`: the dense ops' forward and backward
    launches per step, and their overhead, per op class."""
    M = ctx.micro_batches
    n: dict[str, float] = {}
    s: dict[str, float] = {}
    for k, i in enumerate(ctx.dense_idx):
        c = ctx.ops[int(i)].op_class
        n[c] = n.get(c, 0.0) + float(arr.fwd_launches[k] + arr.bwd_launches[k]) * M
        s[c] = s.get(c, 0.0) + float(arr.fwd_launch_s[k] + arr.bwd_launch_s[k]) * M
    return {"launches": n, "launch_s": s}


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
    sync of no bytes, say), the chain through it says what the step would pay once it grows. A chain
    that several kinds share gives one cut (in the order of the first task of each chain)."""
    nxt, firsts = _longest_per_kind(S)
    # one cut per chain: a deep block's recompute tasks (a kind per layer) mostly lie on a few chains, and a
    # cut per kind would walk the whole schedule once per layer (quadratic in depth) to repeat the same cut
    chain_of = S.chain_ids(nxt)
    done: set[int] = set()
    out = []
    for i in firsts:
        if chain_of[i] not in done:
            done.add(chain_of[i])
            out.append(_chain_cut(S, S.path_through(i, nxt), factor, "chain"))
    return tuple(out)


def _longest_per_kind(S: Schedule) -> tuple[list[int], list[int]]:
    """The schedule's successor on each task's longest tail (:meth:`Schedule.tail_paths`), and for each kind of
    decision-dependent task (the aggregates and recomputed layers its form names) the task of that kind on the
    longest chain, the first such task where chains tie; these in task order."""
    tail, nxt = S.tail_paths()
    best: dict[tuple, tuple[float, int]] = {}
    for i, t in enumerate(S.tasks):
        if t.form is None:
            continue
        key = tuple(sorted(v for v, _ in t.form[1]))
        length = S.start[i] + t.duration + tail[i]
        if key not in best or length > best[key][0]:
            best[key] = (length, i)
    return nxt, sorted(i for _, i in best.values())


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
    if not _graphed(ctx, arr):  # (under CUDA graphs recompute costs the host nothing)
        np.add.at(per, ctx.op_layer, np.asarray(arr.fwd_host_launches, dtype=float))
    h = {n: float(ctx.eff.host_launch_s * M * per[i]) for i, n in enumerate(ctx.layer_names)}
    const = host_s - sum(v for n, v in h.items() if n in recomputed)  # in layer order (a set's order varies by process)
    return StepCut(const, {}, h, "host")


def _device_position(ctx: Context, S: Schedule, before: list[float], sync_task: dict, moe_parts: dict,
                     offsets: tuple[list[float], list[float]], m: int, k: int, phase: str) -> float:
    """When the compute stream finishes the work queued before dense op ``k``'s ``phase`` call in
    micro-batch ``m``: its layer task's start plus the layer's ops before it (in the task's part: a MoE
    layer's forward runs the ops after the experts as one "post" task; ``offsets``: :func:`_layer_offsets`),
    scaled as the schedule stretched that task."""
    i = int(ctx.op_layer[k])
    t = sync_task[(m, i, phase)]
    off = offsets[1][k] if (i in moe_parts and phase == "fwd") else offsets[0][k]
    stretch = S.tasks[t].duration / before[t] if before[t] > 0 else 1.0
    return S.start[t] + off * stretch


def _layer_offsets(ctx: Context, moe_parts: dict, f_op: np.ndarray) -> tuple[list[float], list[float]]:
    """Per dense op ``k``, the forward time of the ops before it in its layer, and (in a MoE layer) of those
    before it in its part of the layer (:func:`moe_part`), each summed in op order: one pass over the ops,
    where a sum per sync would walk them all for each sync (quadratic in depth)."""
    n = len(ctx.dense_idx)
    in_layer = [0.0] * n
    in_part = [0.0] * n
    acc_layer: dict[int, float] = {}
    acc_part: dict[tuple[int, str], float] = {}
    for j in range(n):
        i = int(ctx.op_layer[j])
        x = float(f_op[j])
        in_layer[j] = acc_layer.get(i, 0.0)
        acc_layer[i] = in_layer[j] + x
        if i in moe_parts:
            key = (i, _moe_part(ctx, j))
            in_part[j] = acc_part.get(key, 0.0)
            acc_part[key] = in_part[j] + x
    return in_layer, in_part


def _moe_part(ctx: Context, k: int) -> str:
    return moe_part(ctx.ops[int(ctx.dense_idx[k])].name)


def _model_flops(ctx: Context) -> float:
    hit = ctx.cache.get("model_flops")
    if hit is None:
        hit = F.model_flops(ctx.workload, batch_size=ctx.global_batch).total
        ctx.cache["model_flops"] = hit
    return hit


__all__ = [
    "SparseAggregates", "assignment_of", "default_assignment", "embedding_loads", "host_launches", "host_segments", "layer_sets", "price",
    "priced_launches", "sparse_aggregates", "sync_exposed", "synced_step",
]
