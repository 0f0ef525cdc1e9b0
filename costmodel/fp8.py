"""FP8 pricing: which GEMMs the FP8 recipe can run (:func:`fp8_capable`, :func:`fp8_guard`,
:func:`fp8_allowed`) and the quantisation passes each FP8 GEMM adds to its op's row of
:class:`~coplan.costmodel.compute.OpArrays` (:func:`price_fp8_quantisation`)."""

from __future__ import annotations

import math

import numpy as np

from coplan.costmodel import flops as F
from coplan.costmodel.context import Context
from coplan.spec.workload import KunlunBlock, TaskHeads, Workload


def fp8_capable(op: F.Op, workload: Workload) -> bool:
    """Whether the FP8 recipe can run the op: a GEMM against its own dense weight (a linear layer).

    GEMMs between activations (DLRM's dot interaction), the routed experts' grouped matmuls and
    Kunlun's block-diagonal input projection (batched einsums, not linear layers) stay in the
    compute dtype: the trainer's recipe swaps ``nn.Linear`` modules and nothing else.
    """
    if op.op_class != "gemm" or op.params <= 0:
        return False
    try:
        block = workload.block(op.block)
    except KeyError:
        return False
    return not (isinstance(block, KunlunBlock) and op.name.endswith(".input_proj"))


def fp8_guard(op: F.Op, workload: Workload) -> str | None:
    """Why the numerics guard keeps a capable op in the compute dtype unless fp8 is forced, or None."""
    try:
        block = workload.block(op.block)
    except KeyError:
        block = None
    if isinstance(block, TaskHeads):
        return "guard: task head"
    if op.min_dim < workload.precision.fp8_min_dim:
        return f"guard: GEMM dim {op.min_dim} < fp8_min_dim {workload.precision.fp8_min_dim}"
    return None


def fp8_allowed(op: F.Op, workload: Workload) -> bool:
    """Capable, and past the numerics guard (or fp8 forced): the op runs in fp8 when its layer does."""
    if not fp8_capable(op, workload):
        return False
    return workload.precision.fp8 == "force" or fp8_guard(op, workload) is None


def price_fp8_quantisation(out: dict[str, np.ndarray], i: int, o: F.Op, act_bytes: float, weight_bytes: float, ctx: Context) -> None:
    """Add the quantisation passes of one FP8 GEMM op (row ``i`` of ``out``).

    A rowwise-scaled FP8 linear layer quantises, in forward, its input ``x`` and its weight ``W``
    (scales along the reduced dimension); in backward, the output gradient ``dY`` for ``dX = dY·W``
    (rowwise), and for ``dW = dYᵀ·x`` the transposed ``dYᵀ`` and ``xᵀ`` (scales along the tokens), and
    ``W`` again along its other dimension. Each pass reads the high-precision tensor ``reads`` times
    (:class:`Options`) and writes one byte per element, at the elementwise HBM bandwidth, one kernel
    per read. ``act_bytes`` (the op's forward bytes) holds ``x`` and ``Y``; they are taken as half each
    (the op does not record ``k`` and ``n`` apart), which is exact in total over forward + backward
    (``x`` is quantised twice, ``dY`` twice) and moves a little time between the two phases.
    The GEMM's own bytes stay those of the compute dtype (it is compute-bound at the sizes that gain).
    """
    b = F.DTYPE_BYTES[o.dtype]
    if ctx.workload.precision.fp8_recipe == "blockwise":
        _price_fp8_quantisation_blockwise(out, i, o, act_bytes / b / 2.0, weight_bytes / b, b, ctx)
        return
    r_row, r_col = ctx.options.fp8_quant_reads_rowwise, ctx.options.fp8_quant_reads_colwise
    per_row, per_col = r_row * b + 1.0, r_col * b + 1.0
    half = act_bytes / b / 2.0
    w_elems = weight_bytes / b
    bw = ctx.topology.gpu.hbm_bw_bytes_per_s * ctx.eff.memory.get("elementwise", 0.85)
    launch = ctx.eff.launch_s.get("elementwise", 2e-6)
    k_row, k_col = math.ceil(r_row), math.ceil(r_col)
    fq, fw = half * per_row, w_elems * per_row
    bq, bwq = half * per_row + 2.0 * half * per_col, w_elems * per_col
    out["fp8"][i] = 1.0
    out["fwd_quant_s"][i] = fq / bw
    out["fwd_quant_fixed_s"][i] = fw / bw
    out["bwd_quant_s"][i] = bq / bw
    out["bwd_quant_fixed_s"][i] = bwq / bw
    # Per call: the kernels' launches (so the step's slope in the launch cost stays the pricer's launch
    # count) plus the measured fixed overhead (which holds them too: a few µs of 0.2-0.8 ms).
    ovh_f, ovh_b = ctx.options.fp8_call_overhead_fwd_s, ctx.options.fp8_call_overhead_bwd_s
    out["fwd_launch_s"][i] += o.fwd_launches * (2 * k_row * launch + ovh_f)
    out["bwd_launch_s"][i] += o.fwd_launches * ((k_row + 3 * k_col) * launch + ovh_b)
    out["fwd_bytes"][i] += fq + fw
    out["bwd_bytes"][i] += bq + bwq


def _price_fp8_quantisation_blockwise(out: dict[str, np.ndarray], i: int, o: F.Op, half: float, w_elems: float, b: float,
                                      ctx: Context) -> None:
    """The ``blockwise`` recipe's passes (``kernels/fp8.py``): its scales are local (1x128 tiles,
    128x128 weight blocks) in both directions, so each tensor is read once and written as both fp8
    copies the layer needs: forward ``x`` (``x`` and ``xᵀ``) and ``W`` (``W`` and ``Wᵀ``), backward
    ``dY`` (``dY`` and ``dYᵀ``); the backward re-reads neither ``x`` nor ``W`` (it saves their fp8
    copies). So ``b + 2`` bytes per element, one kernel per tensor. Memory is left as priced for
    the compute dtype (the saved fp8 ``xᵀ`` is smaller than ``x``: an over-estimate)."""
    bw = ctx.topology.gpu.hbm_bw_bytes_per_s * ctx.eff.memory.get("elementwise", 0.85)
    launch = ctx.eff.launch_s.get("elementwise", 2e-6)
    per = b + 2.0
    fq, fw, bq = half * per, w_elems * per, half * per
    out["fp8"][i] = 1.0
    out["fwd_quant_s"][i] = fq / bw
    out["fwd_quant_fixed_s"][i] = fw / bw
    out["bwd_quant_s"][i] = bq / bw
    out["bwd_quant_fixed_s"][i] = 0.0
    opts = ctx.options
    ovh_f = opts.fp8_blockwise_call_overhead_fwd_s if opts.fp8_blockwise_call_overhead_fwd_s is not None else opts.fp8_call_overhead_fwd_s
    ovh_b = opts.fp8_blockwise_call_overhead_bwd_s if opts.fp8_blockwise_call_overhead_bwd_s is not None else opts.fp8_call_overhead_bwd_s
    out["fwd_launch_s"][i] += o.fwd_launches * (2 * launch + ovh_f)
    out["bwd_launch_s"][i] += o.fwd_launches * (1 * launch + ovh_b)
    out["fwd_bytes"][i] += fq + fw
    out["bwd_bytes"][i] += bq



__all__ = ["fp8_allowed", "fp8_capable", "fp8_guard", "price_fp8_quantisation"]
