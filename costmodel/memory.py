"""Memory-bound bytes outside the ops: FSDP2's own copies around its collectives
(:func:`fsdp_copy_bytes`), and the state a checkpoint writes (:func:`state_bytes`). The step's
per-rank memory breakdown (:class:`~coplan.costmodel.results.Memory`) is assembled by
:func:`step_memory`."""

from __future__ import annotations

import numpy as np

from coplan.costmodel import flops as F
from coplan.costmodel.context import Context, primary_sequence, shared_cache
from coplan.costmodel.jagged import length_pmf, likely_rows
from coplan.costmodel.results import DenseFixedCosts, Memory


GRAPH_POOL_ACTS = 1.3
"""CUDA graphs' pool per byte of the largest captured bucket's activations (its saved activations and its
backward's working set, which the pool keeps reserved)."""

GRAPH_POOL_INPUTS = 1.0
"""Per byte of every captured bucket's static history inputs (the lookups' outputs, fp32, at the bucket's
padded rows: each bucket keeps its own, and their gradients)."""

GRAPH_POOL_FIXED = 2.5e9
"""Bytes of the pool that do not scale with the buckets (the workspaces, logits and pooled inputs of the
captures)."""

GRAPH_POOL_SOURCE = (
    "fitted to the pools of 26 runs of `coplan train` at defaults (sampler draws of the one-GPU family: 19 on an "
    "H100, 7 on an H200; benchmarks/results/fresh_draws_h100.json, fresh_draws_h100d.json, fresh_draws_h200.json): "
    "priced / measured pool median 1.08, range 0.70-1.79 (7 of 26 under)")
"""Where :func:`graph_pool_bytes`'s coefficients come from and how well they fit."""

EMBEDDING_OUTPUT_BYTES = 4
"""Bytes per element of the sparse arch's outputs as the dense module receives them: TorchRec's fused
TBE writes fp32 unless ``output_dtype`` is set (the trainer does not set it)."""


def fsdp_copy_bytes(ctx: Context) -> tuple[float, float]:
    """HBM bytes of FSDP2's own copies per micro-batch on one rank: (forward, backward).

    What FSDP2 (``torch.distributed.fsdp._fully_shard``) runs around its collectives, with the
    trainer's mixed precision (parameters kept in ``param_dtype``, gathered in ``compute_dtype``,
    gradients reduced in ``reduce_dtype``; divide factor 1), for ``N`` dense parameters on the rank
    (routed experts: their ``1/ep`` share) sharded ``ds`` ways:

    - forward: the cast of the local shard to the compute dtype, ``N/ds·(pb+cb)`` (when the dtypes
      differ); on one rank the cast shard is copied into the unsharded parameters, ``N·2cb``; with
      ``ds > 1`` the copy into the all-gather input, ``N/ds·2cb``, and the copy-out of the gathered
      buffer, ``N·2cb``; again in backward for every layer but the last when parameters are resharded
      after forward;
    - backward: the copy of the unsharded gradients into the reduce-scatter input in the reduce dtype
      (``chunk_cat``), ``N·(cb+rb)``; on one rank the reduce-scatter is a divided copy (a division
      pass and a copy, ``2·N·2rb``); the cast of the reduced shard to the parameter dtype,
      ``N/ds·(rb+pb)``, when they differ;
    - the cast of the dense module's floating inputs to the compute dtype (``cast_forward_inputs``:
      the embedding outputs, :data:`EMBEDDING_OUTPUT_BYTES` each, at the workload's expected lengths)
      and of their gradients back.

    One rank whose dense arch runs as CUDA graphs (:attr:`Context.dense_graphs`) has no FSDP2: the graphs
    cast the masters (``N·(pb+cb)``), cast the gradients back (the same) and add them into the gradient
    buffers (``N·3·pb``), and copy each micro-batch's embedding outputs into their captured buffers
    (``elems·2·4``); the input casts stay. (Found on the lent H100, fresh_plans_h100c: FSDP2's one-rank bytes
    priced the graphed draws' copies 1.3-1.5x their traced kernels.)

    Nothing here is fitted: it is bytes, priced like every other memory-bound pass. Without FSDP
    (no dense parameters) both are 0."""
    w = ctx.workload
    cb = ctx.compute_bytes
    pb = F.DTYPE_BYTES[w.precision.param_dtype]
    rb = F.DTYPE_BYTES[w.precision.reduce_dtype]
    ds, ep = ctx.mesh.dense_shard, ctx.mesh.expert_parallel
    P, E = ctx.layer_params, ctx.layer_expert_params
    N = float(P.sum() + E.sum() / ep)
    if N <= 0:
        return 0.0, 0.0
    cast = (pb + cb) if pb != cb else 0.0
    ta = ctx.tables
    vec = (np.where(ta.is_seq, ctx.mb_batch * ta.lookups_per_sample, ctx.mb_batch * ta.features) if ta.num
           else np.zeros(0))
    elems = float((vec * ta.dim).sum()) if ta.num else 0.0
    inputs = elems * (EMBEDDING_OUTPUT_BYTES + cb) if ta.num and cb != EMBEDDING_OUTPUT_BYTES else 0.0
    if ds == 1 and ctx.dense_graphs:
        # no FSDP2: the graphs cast the masters (N·cast) and, in backward, cast the gradients back to the
        # masters' dtype (N·cast) and add them into the gradient buffers (read both, write one: N·3·pb); each
        # micro-batch's inputs are copied into the captured buffers first (elems, read and write)
        fwd = N * cast + inputs + elems * 2 * EMBEDDING_OUTPUT_BYTES
        bwd = N * cast + N * 3 * pb + inputs
        return fwd, bwd
    if ds > 1:
        gather = N / ds * cast + N / ds * 2 * cb + N * 2 * cb
    else:
        gather = N * cast + N * 2 * cb
    fwd = gather
    bwd = N * (cb + rb) + (2 * N * 2 * rb if ds == 1 else 0.0) + (N / ds * (rb + pb) if rb != pb else 0.0)
    if ds > 1 and ctx.options.reshard_after_forward and len(P):
        last = float(P[-1] + E[-1] / ep)
        bwd += gather * (1.0 - last / N)
    return fwd + inputs, bwd + inputs


def table_state_bytes(ctx: Context) -> np.ndarray:
    """Per table: its whole weights and optimizer state (a full copy, as a data-parallel table holds)."""
    ta = ctx.tables
    return ta.rows * ta.dim * ta.wbytes + ta.rows * (ta.state_row_fixed + ta.state_per_elem * ta.dim)


def state_bytes(ctx: Context) -> float:
    """Bytes of the whole training state (dense parameters and optimizer state, every table with its
    optimizer state): what a checkpoint writes."""
    hit = ctx.cache.get("state_bytes")
    if hit is None:
        w = ctx.workload
        pb = F.DTYPE_BYTES[w.precision.param_dtype]
        dense = float(ctx.layer_params.sum() + ctx.layer_expert_params.sum()) * (pb + w.optimizer.dense_state_bytes_per_param)
        emb = float(table_state_bytes(ctx).sum())
        hit = dense + emb
        ctx.cache["state_bytes"] = hit
    return hit


def communicator_bytes(ctx: Context, sparse_groups: bool = True) -> float:
    """NCCL buffers of the sparse shard and replica groups' communicators, when they span several ranks
    (``sparse_groups=False``: 0, as for a dense-only pricing)."""
    per = ctx.options.nccl_bytes_per_communicator
    return per * ((ctx.mesh.sparse_shard > 1) + (ctx.mesh.sparse_replicate > 1)) if sparse_groups else 0.0


def graph_pool_bytes(ctx: Context, acts: float) -> float:
    """Bytes the trainer's CUDA-graph pool holds on one rank for the run, ``acts`` being one micro-batch's
    saved activations as priced (at the mean history length): the trainer captures at the first step
    every bucket a micro-batch falls in with 99% probability (:func:`coplan.costmodel.jagged.likely_rows`),
    largest first, into one pool. The pool keeps the largest bucket's activations (``acts`` scaled to its
    padded rows) and each bucket's history inputs, plus a fixed part (:data:`GRAPH_POOL_SOURCE`)."""
    w = ctx.workload
    seq = primary_sequence(w)
    if seq is None:
        return GRAPH_POOL_ACTS * acts + GRAPH_POOL_FIXED
    samples = int(ctx.mb_batch)
    spec = next(s for s in w.sequences if s.name == seq)

    def make():
        # (once per workload and micro-batch: the planner prices many plans of each)
        values, probs = length_pmf(spec.length)
        rows = likely_rows(values, probs, samples)
        mean = float((values * probs).sum() / probs.sum()) * samples
        ta = ctx.tables
        in_row = float((ta.dim * ta.features)[ta.is_seq & (np.asarray(ta.sequence, dtype=object) == seq)].sum())
        return (max(rows) / mean if rows and mean > 0 else 1.0), float(sum(rows)) * in_row * EMBEDDING_OUTPUT_BYTES

    scale, inputs = shared_cache(w, ("graph_pool", seq, samples), make)
    return GRAPH_POOL_ACTS * acts * max(scale, 1.0) + GRAPH_POOL_INPUTS * inputs + GRAPH_POOL_FIXED


def step_memory(ctx: Context, act_bytes: np.ndarray, rho: float, recomputed: frozenset[str], fixed: DenseFixedCosts,
                embedding: tuple[float, float, float], dp_all_reduce: bool, ep_bytes: np.ndarray,
                graphed: bool = False) -> Memory:
    """The fullest rank's memory: dense state and FSDP buffers (``fixed``), one micro-batch's saved
    activations (``act_bytes`` per dense op, scaled by the jagged imbalance ``rho``; only the layer
    input where recomputed, plus the largest recomputed layer's activations while it runs), the
    embedding shards' (weights, optimizer state, lookup buffers), and the NCCL communicators' buffers
    (one per group of several ranks, the world's when a data-parallel table all-reduces) with the
    expert-parallel all-to-all's staging. ``graphed``: the dense arch runs as CUDA graphs, whose pool
    (:func:`graph_pool_bytes`) stays for the whole run beside the eager profiled steps' activations (on an
    80 GB H100 two sampler draws planned without it ran out of memory, and a third with a pool priced at
    1.125x the activations, where the trainer's pools measured 1.3-7x)."""
    nl = len(ctx.layer_names)
    act = np.bincount(ctx.op_layer, weights=act_bytes, minlength=nl) * rho
    inp = ctx.layer_input_bytes * ctx.mb_batch * rho
    rec_mask = np.array([n in recomputed for n in ctx.layer_names], dtype=bool) if nl else np.zeros(0, dtype=bool)
    acts = float(np.where(rec_mask, np.minimum(inp, act), act).sum())
    rpeak = float(act[rec_mask].max()) if rec_mask.any() else 0.0
    n_comm = sum(1 for k, g in ctx.groups.items() if g.size > 1 and k != "world") + (1 if dp_all_reduce else 0)
    ep_stage = 2.0 * float(ep_bytes.max()) if nl else 0.0
    emb_w, emb_o, emb_io = embedding
    return Memory(
        parameters=fixed.params_bytes, gradients=fixed.grads_bytes, optimizer=fixed.optimizer_bytes,
        fsdp_buffers=fixed.fsdp_buffer_bytes, activations=acts, recompute_peak=rpeak,
        embeddings=emb_w, embedding_optimizer=emb_o, embedding_io=emb_io,
        comm_buffers=n_comm * ctx.options.nccl_bytes_per_communicator + ep_stage,
        graph_pool=graph_pool_bytes(ctx, acts + rpeak) if graphed else 0.0,
    )


__all__ = ["EMBEDDING_OUTPUT_BYTES", "GRAPH_POOL_ACTS", "GRAPH_POOL_FIXED", "GRAPH_POOL_INPUTS", "GRAPH_POOL_SOURCE", "graph_pool_bytes", "communicator_bytes", "fsdp_copy_bytes", "state_bytes", "step_memory", "table_state_bytes"]
