"""Memory-bound bytes outside the ops: FSDP2's own copies around its collectives
(:func:`fsdp_copy_bytes`), and the state a checkpoint writes (:func:`state_bytes`). The step's
per-rank memory breakdown (:class:`~coplan.costmodel.results.Memory`) is assembled by
:func:`step_memory`."""

from __future__ import annotations

import numpy as np

from coplan.costmodel import flops as F
from coplan.costmodel.context import Context


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
    if ds > 1:
        gather = N / ds * cast + N / ds * 2 * cb + N * 2 * cb
    else:
        gather = N * cast + N * 2 * cb
    fwd = gather
    bwd = N * (cb + rb) + (2 * N * 2 * rb if ds == 1 else 0.0) + (N / ds * (rb + pb) if rb != pb else 0.0)
    if ds > 1 and ctx.options.reshard_after_forward and len(P):
        last = float(P[-1] + E[-1] / ep)
        bwd += gather * (1.0 - last / N)
    ta = ctx.tables
    if ta.num and cb != EMBEDDING_OUTPUT_BYTES:
        vec = np.where(ta.is_seq, ctx.mb_batch * ta.lookups_per_sample, ctx.mb_batch * ta.features)
        elems = float((vec * ta.dim).sum())
        fwd += elems * (EMBEDDING_OUTPUT_BYTES + cb)
        bwd += elems * (cb + EMBEDDING_OUTPUT_BYTES)
    return fwd, bwd
