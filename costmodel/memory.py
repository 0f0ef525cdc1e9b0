"""Memory-bound bytes outside the ops: FSDP2's own copies around its collectives
(:func:`fsdp_copy_bytes`), and the state a checkpoint writes (:func:`state_bytes`). The step's
per-rank memory breakdown (:class:`~coplan.costmodel.results.Memory`) is assembled by
:func:`step_memory`."""

from __future__ import annotations

import numpy as np

from coplan.costmodel import flops as F
from coplan.costmodel.context import Context
from coplan.costmodel.results import DenseFixedCosts, Memory


GRAPH_BUCKET_PAD = 1.125
"""A CUDA-graph bucket holds up to 1/8 more history rows than the batch it replays
(``coplan.trainer.graphs.BUCKET_STEPS_PER_OCTAVE``): the pool is priced at the activations times this."""

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


def step_memory(ctx: Context, act_bytes: np.ndarray, rho: float, recomputed: frozenset[str], fixed: DenseFixedCosts,
                embedding: tuple[float, float, float], dp_all_reduce: bool, ep_bytes: np.ndarray,
                graphed: bool = False) -> Memory:
    """The fullest rank's memory: dense state and FSDP buffers (``fixed``), one micro-batch's saved
    activations (``act_bytes`` per dense op, scaled by the jagged imbalance ``rho``; only the layer
    input where recomputed, plus the largest recomputed layer's activations while it runs), the
    embedding shards' (weights, optimizer state, lookup buffers), and the NCCL communicators' buffers
    (one per group of several ranks, the world's when a data-parallel table all-reduces) with the
    expert-parallel all-to-all's staging. ``graphed``: the dense arch runs as CUDA graphs, whose pool keeps
    a padded bucket's activations for the whole run (:data:`GRAPH_BUCKET_PAD`), beside those of the eager
    profiled steps (on an 80 GB H100 two sampler draws planned without this ran out of memory)."""
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
        graph_pool=GRAPH_BUCKET_PAD * (acts + rpeak) if graphed else 0.0,
    )


__all__ = ["EMBEDDING_OUTPUT_BYTES", "GRAPH_BUCKET_PAD", "communicator_bytes", "fsdp_copy_bytes", "state_bytes", "step_memory", "table_state_bytes"]
