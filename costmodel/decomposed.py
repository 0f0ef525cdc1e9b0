"""The decomposed costs the planner's CP-SAT model reads, each a typed value from one context:
per-table option costs (:func:`table_option_costs`, :func:`table_option_cost`, with the sequence
lookups' latency floor :func:`seq_lookup_floor_s`), per-layer compute and activations
(:func:`layer_costs`) and the dense costs that depend on neither (:func:`dense_fixed_costs`). The
full pricer (:mod:`.pricer`) reads the same figures."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from coplan.costmodel import flops as F
from coplan.costmodel.compute import expected_max_moments, imbalance, op_arrays
from coplan.costmodel.context import Context, shared_cache
from coplan.costmodel.embedding import SHARDING_CODES, TableOptionCosts, option_costs
from coplan.costmodel.jagged import length_pmf
from coplan.costmodel.memory import fsdp_copy_bytes
from coplan.costmodel.results import DenseFixedCosts
from coplan.errors import CoplanError
from coplan.spec.workload import Kernels


def seq_lookup_floor_s(ctx: "Context", samples_per_micro_batch: float, shards=1.0) -> np.ndarray:
    """Per table, seconds per step: the latency-bound floor of FBGEMM's no-bag (sequence) lookup forward,
    0 for pooled tables. The lookup of a table is priced at max(its bytes / TBE bandwidth, this floor).

    The kernel gives each bag one warp, which walks the bag's ids one after another (each id: load
    the index, then the row: dependent loads, ``lookup_id_s`` apart at low occupancy). One kernel runs
    the bags of all sequence tables of one dim (TorchRec groups them so: the trainer's ``ec_d<dim>``);
    its warps run in ``ceil(non-empty bags / resident warps)`` waves, each as long as its longest bag:

        floor_group = micro-batches × waves × (ids in the longest bag) × lookup_id_s

    With whole histories as bags (``seq_chunk = 0``) there are as many bags as samples × tables, far
    fewer than the 8,448 resident warps of an H200, in one wave as long as the batch's longest history
    (E[max L], the same for every table of a sequence): latency-bound (H200 runs with whole histories: 64-320
    warps, ~1.3-3 ms per call). With bags of at most ``c`` ids the longest bag is ``c`` and the waves
    are ``samples × tables × E[ceil(L / c)] / resident warps``: a few waves of ``c`` ids, under the
    bytes' time (bandwidth-bound). The group's floor is split among its tables by their bytes (exact
    when the group's tables sit on one rank, as on one GPU; with table-wise sharding across ranks it
    under-prices a rank holding part of a group). ``shards`` (scalar or per table): a row-wise shard
    walks 1/k of each bag's ids.
    """
    ta = ctx.tables
    out = np.zeros(ta.num)
    t_id = ctx.eff.lookup_id_s
    if not ta.num or t_id <= 0 or not ta.is_seq.any():
        return out
    chunk = int(ctx.options.seq_chunk)
    resident = float(ctx.topology.gpu.num_sms * ctx.options.lookup_warps_per_sm)
    S = float(samples_per_micro_batch)
    k = np.broadcast_to(np.asarray(shards, dtype=float), ta.rows.shape)
    seq_bytes = ta.features * ta.dim * ta.wbytes  # split of a group's floor: bytes per id of each table
    seqs = {sq for sq, is_s in zip(ta.sequence, ta.is_seq) if is_s and sq is not None}
    for sq in seqs:
        dist = ctx.workload.sequence(sq).length
        e_max = (ctx.padded_moments.get(sq) or expected_max_moments(dist, max(1.0, S)))[0]
        if chunk > 0:
            try:
                vals, probs = length_pmf(dist)
                bags_per_sample = float((probs * np.ceil(vals.astype(np.float64) / chunk)).sum())
            except ValueError:
                bags_per_sample = ctx.moments.get(sq, (e_max, 0.0))[0] / chunk + 0.5
            longest = min(float(chunk), e_max)
        else:
            bags_per_sample, longest = 1.0, e_max
        for dim in sorted({float(d) for d, sq2, is_s in zip(ta.dim, ta.sequence, ta.is_seq) if is_s and sq2 == sq}):
            idx = np.flatnonzero(ta.is_seq & (ta.dim == dim) & np.array([x == sq for x in ta.sequence]))
            bags = S * float(ta.features[idx].sum()) * bags_per_sample
            waves = math.ceil(bags / resident) if bags > 0 else 0
            floor = ctx.micro_batches * waves * longest * t_id
            share = seq_bytes[idx] / seq_bytes[idx].sum()
            out[idx] = floor * share / k[idx]
    return out



@dataclass(frozen=True, slots=True)
class LayerCost:
    """One dense layer on the critical rank, per step (all micro-batches)."""

    name: str
    fwd_s: float
    bwd_s: float
    """Backward compute (without recompute)."""
    recompute_s: float
    """Extra time when the layer is recomputed (its forward again)."""
    activation_bytes: float
    """Saved activations of one micro-batch when not recomputed."""
    recomputed_activation_bytes: float
    """Kept when recomputed: the layer input of one micro-batch."""
    params: float
    expert_params: float
    fp8_fwd_s: float
    """Forward time with the layer's eligible GEMMs in fp8."""
    fp8_bwd_s: float


def layer_costs(ctx: Context, *, policy: str = "greedy", kernels: Kernels | None = None) -> tuple[LayerCost, ...]:
    """Per-layer compute and activation figures (critical rank, jagged imbalance of ``policy`` applied)."""
    rho = imbalance(ctx, policy, kernels)
    arr = op_arrays(ctx, kernels)
    f, b = arr.times(rho)
    all_fp8 = frozenset(ctx.layer_names)
    arr8 = op_arrays(ctx, kernels, all_fp8)
    f8, b8 = arr8.times(rho)
    nl = len(ctx.layer_names)
    M = ctx.micro_batches
    fl = np.bincount(ctx.op_layer, weights=f, minlength=nl) * M
    bl = np.bincount(ctx.op_layer, weights=b, minlength=nl) * M
    fl8 = np.bincount(ctx.op_layer, weights=f8, minlength=nl) * M
    bl8 = np.bincount(ctx.op_layer, weights=b8, minlength=nl) * M
    act = np.bincount(ctx.op_layer, weights=arr.act_bytes, minlength=nl) * rho
    inp = ctx.layer_input_bytes * ctx.mb_batch * rho
    return tuple(
        LayerCost(n, float(fl[i]), float(bl[i]), float(fl[i]), float(act[i]), float(min(inp[i], act[i])),
                  float(ctx.layer_params[i]), float(ctx.layer_expert_params[i]), float(fl8[i]), float(bl8[i]))
        for i, n in enumerate(ctx.layer_names)
    )


def dense_fixed_costs(ctx: Context) -> DenseFixedCosts:
    hit = ctx.cache.get("dense_fixed")
    if hit is not None:
        return hit
    w = ctx.workload
    cb = ctx.compute_bytes
    pb = F.DTYPE_BYTES[w.precision.param_dtype]
    rb = F.DTYPE_BYTES[w.precision.reduce_dtype]
    ds, ep = ctx.mesh.dense_shard, ctx.mesh.expert_parallel
    es = ctx.expert_shard
    M = ctx.micro_batches
    P = ctx.layer_params
    E = ctx.layer_expert_params
    nl = len(P)
    ag = ctx.model("dense_shard", "all_gather")
    rs = ctx.model("dense_shard", "reduce_scatter")
    ar = ctx.model("dense_replicate", "all_reduce")
    eag = ctx.model("expert_shard", "all_gather")
    ers = ctx.model("expert_shard", "reduce_scatter")
    ear = ctx.model("expert_replicate", "all_reduce")
    a2a = ctx.model("expert", "all_to_all")
    ag_f = (ag.time(P * cb) + eag.time(E / ep * cb)) * M
    re = np.ones(nl)
    if nl:
        re[-1] = 0.0  # the last layer keeps its parameters for backward
    ag_b = ag_f * re if ctx.options.reshard_after_forward else np.zeros(nl)
    rs_s = (rs.time(P * rb) + ers.time(E / ep * rb)) * M
    if ds > 1:
        rep = ar.time(P / ds * rb) + ear.time(E / ep / es * rb)
    else:
        rep = ar.time(P * rb) + ear.time(E / ep / es * rb)
    rep = rep * M
    ep_s = np.zeros(nl)
    for i, name in enumerate(ctx.layer_names):
        b = ctx.moe_blocks.get(name)
        if b is not None and ep > 1:
            S = ctx.mb_batch * b.tokens_per_sample * b.top_k * b.model_dim * cb * b.capacity_factor
            ep_s[i] = 4 * a2a.time(S) * M
    n_local = P.sum() / ds + E.sum() / (ep * es)
    params_b = n_local * pb
    grads_b = n_local * pb  # FSDP2 keeps sharded gradients in the parameter dtype
    opt_b = n_local * w.optimizer.dense_state_bytes_per_param
    if (ds > 1 or ep > 1) and not ctx.options.reshard_after_forward:
        # unsharded compute-dtype weights of every layer stay from forward to backward
        mx = float((P + E / ep).max()) if nl else 0.0
        fsdp_buf = float((P + E / ep).sum()) * cb + mx * rb
    elif ds > 1 or ep > 1:
        # the current and the prefetched layer's unsharded weights, one layer's unsharded gradients
        mx = float((P + E / ep).max()) if nl else 0.0
        fsdp_buf = 2.0 * mx * cb + mx * rb
    else:
        fsdp_buf = float((P + E).sum()) * cb  # compute-dtype copies of all weights kept for backward
    # optimizer: read/write params and state, read grads (fused multi-tensor kernels); plus the trainer's
    # per-step gradient norm (its non-finite check, one foreach norm: the gradients read once, as
    # gradient clipping would), which runs just before the optimizer
    st = w.optimizer.dense_state_bytes_per_param
    opt_bytes = n_local * (2 * pb + rb + 2 * st) + n_local * rb
    bw = ctx.topology.gpu.hbm_bw_bytes_per_s * ctx.eff.memory.get("elementwise", 0.85)
    launch = ctx.eff.launch_s.get("elementwise", 2e-6)
    opt_s = opt_bytes / bw + OPTIMIZER_LAUNCHES * launch if n_local else 0.0
    cf, cbk = fsdp_copy_bytes(ctx)
    cp_f = cf / bw + FSDP_COPY_LAUNCHES[0] * launch if cf > 0 else 0.0
    cp_b = cbk / bw + FSDP_COPY_LAUNCHES[1] * launch if cbk > 0 else 0.0
    out = DenseFixedCosts(ctx.layer_names, ag_f, ag_b, rs_s, rep, ep_s, params_b, grads_b, opt_b, fsdp_buf, opt_s, cp_f, cp_b)
    ctx.cache["dense_fixed"] = out
    return out


OPTIMIZER_LAUNCHES = 20.0
"""Launches the pricer charges the dense optimizer step (fused multi-tensor kernels and the gradient norm)."""

FSDP_COPY_LAUNCHES = (2.0, 3.0)
"""Launches the pricer charges FSDP2's copies per micro-batch (forward: the parameter cast and the
copy into the gathered buffer; backward: the gradient copy-in, the divided copy, the cast), as if each
pass were one multi-tensor kernel. (On one rank FSDP2 launches the forward passes per parameter
tensor, ~2 per tensor; the cost model does not know tensor counts, and ``h`` is per *priced* launch.)"""

def table_option_costs(ctx: Context, sharding_type: str, num_shards=1, *, kernel: str | None = None) -> TableOptionCosts:
    """All tables under one option, vectorised (see :mod:`coplan.costmodel.embedding`)."""
    kernel = kernel or ctx.workload.kernels.embedding
    if sharding_type not in SHARDING_CODES:
        raise CoplanError(f"unknown sharding type '{sharding_type}'; expected one of {sorted(SHARDING_CODES)}")
    key = ("topt", sharding_type, kernel, np.asarray(num_shards).tobytes() if np.ndim(num_shards) else num_shards)
    hit = ctx.cache.get(key)
    if hit is not None:
        return hit
    # the sequence lookups' latency floor: a table-wise (or sharded) table sees the sparse group's samples
    dp = sharding_type == "data_parallel"
    S = ctx.local_batch * (1 if dp else ctx.mesh.sparse_shard) / ctx.micro_batches
    k = num_shards if sharding_type in ("row_wise", "table_row_wise") else 1.0
    floor = seq_lookup_floor_s(ctx, S, k)
    out = shared_cache(ctx.workload, key + (ctx.mesh.sparse_shard, ctx.local_batch, ctx.micro_batches, ctx.emb_bw, floor.tobytes()),
                  lambda: option_costs(ctx.tables, sharding_type, num_shards, ctx.mesh.sparse_shard, ctx.local_batch,
                                       ctx.micro_batches, ctx.compute_bytes, ctx.emb_bw, kernel=kernel, fwd_floor_s=floor))
    if len(ctx.cache) < 4096:
        ctx.cache[key] = out
    return out


@dataclass(frozen=True, slots=True)
class TableOptionCost:
    """One table under one sharding option: per shard and per step (all micro-batches)."""

    table: str
    sharding_type: str
    num_shards: int
    fwd_s: float
    """Forward lookup time of one shard on its rank."""
    bwd_s: float
    """Backward + fused optimizer time of one shard."""
    memory_bytes: float
    """Weights + optimizer state of one shard."""
    weight_bytes: float
    optimizer_bytes: float
    a2a_send_bytes: float
    """Output all-to-all bytes the shard's rank sends forward (the same come back backward)."""
    a2a_recv_bytes_per_rank: float
    """Output all-to-all bytes every rank of the sparse group receives for this table."""
    ids_bytes_per_rank: float
    """Id bytes every rank sends forward."""
    ids_recv_bytes: float
    """Id bytes the shard's rank receives."""
    allreduce_bytes: float
    """data_parallel: gradient all-reduce bytes per rank (world group)."""


def table_option_cost(ctx: Context, table: str, sharding_type: str, num_shards: int = 1, *, kernel: str | None = None) -> TableOptionCost:
    """The cost of one table under one option (see :func:`table_option_costs` for all tables at once)."""
    i = ctx.tables.index.get(table)
    if i is None:
        raise CoplanError(f"'{table}' is not a table of workload '{ctx.workload.name}'")
    c = table_option_costs(ctx, sharding_type, num_shards, kernel=kernel)
    return TableOptionCost(
        table, sharding_type, int(c.num_shards[i]), float(c.fwd_s[i]), float(c.bwd_s[i]), float(c.memory_bytes[i]),
        float(c.weight_bytes[i]), float(c.optimizer_bytes[i]), float(c.send_bytes[i]), float(c.recv_bytes[i]),
        float(c.ids_send_bytes[i]), float(c.ids_recv_bytes[i]), float(c.allreduce_bytes[i]),
    )




__all__ = [
    "DenseFixedCosts", "FSDP_COPY_LAUNCHES", "LayerCost", "OPTIMIZER_LAUNCHES", "TableOptionCost", "dense_fixed_costs", "layer_costs",
    "seq_lookup_floor_s", "table_option_cost", "table_option_costs",
]
