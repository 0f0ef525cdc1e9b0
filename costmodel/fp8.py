"""FP8 pricing: which GEMMs the FP8 recipe can run (:func:`fp8_capable`, :func:`fp8_guard`,
:func:`fp8_allowed`), the quantisation passes each FP8 GEMM adds to its op's row of
:class:`~coplan.costmodel.compute.OpArrays` (:func:`price_fp8_quantisation`), and, for the
``blockwise-fused`` recipe, which layers' FFNs the fused producer kernels run
(:func:`fused_ffn_layers`) and what that does to the layer's elementwise op
(:func:`fused_norm_act_bytes`)."""

from __future__ import annotations

import math
from typing import Iterable

import numpy as np

from coplan.costmodel import flops as F
from coplan.costmodel.context import Context
from coplan.spec.workload import InterFormerBlock, KunlunBlock, TaskHeads, Workload

FUSED_RECIPE = "blockwise-fused"
FUSED_FFN_BLOCKS = (InterFormerBlock, KunlunBlock)
"""The blocks whose pre-norm FFN (norm2 → ``ffn_up`` → SiLU → ``ffn_down``) ``blockwise-fused`` runs
by the fused kernels (``kernels/fp8_fused.py``'s ``ln_ffn_fp8``); every other fp8 GEMM runs as ``blockwise``."""
FFN_OPS = (".ffn_up", ".ffn_down")


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


def fused_ffn_layers(ops: Iterable[F.Op], workload: Workload, fp8_layers: Iterable[str] | None = None) -> frozenset[str]:
    """The layers whose FFN the ``blockwise-fused`` recipe runs by the fused kernels: InterFormer and
    Kunlun layers (of ``fp8_layers``, when given) whose ``ffn_up`` and ``ffn_down`` are both allowed in
    fp8 (:func:`fp8_allowed`). The trainer fuses the chain only when both GEMMs pass the guard; where one
    stays in the compute dtype the other prices as plain ``blockwise``. Empty for any other recipe."""
    if workload.precision.fp8_recipe != FUSED_RECIPE:
        return frozenset()
    keep = None if fp8_layers is None else frozenset(fp8_layers)
    allowed: dict[str, set[str]] = {}
    for o in ops:
        if not o.name.endswith(FFN_OPS) or (keep is not None and o.layer not in keep):
            continue
        try:
            block = workload.block(o.block)
        except KeyError:
            continue
        if isinstance(block, FUSED_FFN_BLOCKS) and fp8_allowed(o, workload):
            allowed.setdefault(o.layer, set()).add(o.name[len(o.layer):])
    return frozenset(lay for lay, names in allowed.items() if names >= set(FFN_OPS))


def _ffn_dims(o: F.Op, workload: Workload) -> tuple[int, int]:
    """(d, f) of the FFN of the op's InterFormer or Kunlun layer."""
    block = workload.block(o.block)
    return block.model_dim, F.ffn_width(block)


def fused_norm_act_bytes(o: F.Op, workload: Workload, fwd_bytes: float, bwd_bytes: float) -> tuple[float, float]:
    """The ``norm_act`` op's (forward, backward) HBM bytes of a layer in :func:`fused_ffn_layers`.

    The fused producers write the fp8 operands (``q`` and its transposed copy, one byte each) in
    place of their compute-dtype outputs: norm2's ``y`` (d per token) and the activation's ``a`` (f)
    forward, the activation backward's ``dh`` (f) backward. So each of those writes becomes 2 bytes per
    element instead of ``b``: no change in bf16. What the fusion saves (the quantisation passes'
    re-reads of y, a and dh, and their separate writes) is taken off the GEMM rows
    (:func:`price_fp8_quantisation` with ``fused``); the fp8 writes are priced here, with the kernel
    that makes them. Scales (4 bytes per 128 elements per copy) are left out, as for ``blockwise``."""
    d, f = _ffn_dims(o, workload)
    b = F.DTYPE_BYTES[o.dtype]
    tokens = fwd_bytes / (F.layer_norm_act_elems(workload.block(o.block), not F.film_fused(workload)) * b)
    return fwd_bytes + tokens * (2.0 - b) * (d + f), bwd_bytes + tokens * (2.0 - b) * f


def price_fp8_quantisation(out: dict[str, np.ndarray], i: int, o: F.Op, act_bytes: float, weight_bytes: float, ctx: Context,
                           *, fused: bool = False) -> None:
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
    ``out["quant_launches"]`` gets the op's quantisation kernels per call (forward + backward), which
    the pricer's launch count takes. ``blockwise`` and ``blockwise-fused`` have their own passes
    (:func:`_price_fp8_quantisation_blockwise`); ``fused``: the op is ``ffn_up`` or ``ffn_down`` of a
    layer in :func:`fused_ffn_layers` (ignored for any other op).
    """
    b = F.DTYPE_BYTES[o.dtype]
    recipe = ctx.workload.precision.fp8_recipe
    if recipe in ("blockwise", FUSED_RECIPE):
        if fused and recipe == FUSED_RECIPE and o.name.endswith(FFN_OPS):
            _price_fp8_quantisation_fused_ffn(out, i, o, act_bytes / b, weight_bytes / b, b, ctx)
        else:
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
    out["quant_launches"][i] = 3 * k_row + 3 * k_col
    out["fwd_bytes"][i] += fq + fw
    out["bwd_bytes"][i] += bq + bwq


def _price_fp8_quantisation_blockwise(out: dict[str, np.ndarray], i: int, o: F.Op, half: float, w_elems: float, b: float,
                                      ctx: Context) -> None:
    """The ``blockwise`` recipe's passes (``kernels/fp8.py``): its scales are local (1x128 tiles,
    128x128 weight blocks) in both directions, so each tensor is read once and written as both fp8
    copies the layer needs: forward ``x`` (``x`` and ``xᵀ``) and ``W`` (``W`` and ``Wᵀ``), backward
    ``dY`` (``dY`` and ``dYᵀ``); the backward re-reads neither ``x`` nor ``W`` (it saves their fp8
    copies). So ``b + 2`` bytes per element, one kernel per tensor (scales left out).

    Memory is left as priced for the compute dtype. What the recipe really saves differs both ways:
    the fp8 ``xᵀ`` (1 byte per element + 4 per 128) instead of ``x`` (``b`` bytes: an over-estimate of
    the activations), and the fp8 ``Wᵀ`` of every fp8 layer from its forward to its backward (not
    priced: an under-estimate of about a byte per parameter of those layers). Kept so, precision
    changes no memory the plan is priced with, and the planner chooses it after the memory solve
    (``coplan.planner.precision``). ``blockwise-fused`` saves the same tensors (the FFN's ``yᵀ`` and
    ``aᵀ`` are ``ffn_up``'s and ``ffn_down``'s ``xᵀ``), so its memory is priced the same."""
    per = b + 2.0
    _set_blockwise_passes(out, i, o, half * per, w_elems * per, half * per, 2, 1, ctx)


def _price_fp8_quantisation_fused_ffn(out: dict[str, np.ndarray], i: int, o: F.Op, elems: float, w_elems: float, b: float,
                                      ctx: Context) -> None:
    """``ffn_up`` or ``ffn_down`` of a fused FFN (``blockwise-fused``, :func:`fused_ffn_layers`).

    As ``blockwise``, except for the activation operands the fused producers write: ``ffn_up``'s input
    ``y`` (norm2's output) and its output gradient ``dh`` (the activation backward's output), and
    ``ffn_down``'s input ``a`` (the activation's output). Those need no quantisation pass: no
    ``b``-byte re-read and no separate kernel; their fp8 writes are priced on the ``norm_act`` op that
    now makes them (:func:`fused_norm_act_bytes`). Left here: each weight's pass (``W`` → ``W``, ``Wᵀ``)
    and ``ffn_down``'s incoming gradient ``dY`` (from outside the chain: one read, both copies, in
    backward). So the quantisation kernels per call are 1 (``ffn_up``: W) and 2 (``ffn_down``: W, dY)
    against 3 each unfused. ``elems`` is ``tokens·(k + n)`` (the op's forward elements); ``k`` and ``n``
    come from the block (``d → f`` up, ``f → d`` down), so ``dY`` is priced exactly, not as the half
    the unfused pricing takes.

    Over the chain this removes ``2·b·tokens·(d + 2f)`` bytes against ``blockwise`` (the re-reads, and
    the ``b``-byte writes turned into the fp8 writes the quantisation passes made anyway), the
    ``saved_bytes`` of ``kernels/fp8_fused.py``'s ``fused_bytes(..., chain="ln_ffn")``. The per-call
    overhead stays the measured ``blockwise`` figure: the fused op has not been timed on a GPU yet."""
    d, f = _ffn_dims(o, ctx.workload)
    tokens = elems / (d + f)
    per = b + 2.0
    if o.name.endswith(".ffn_up"):
        _set_blockwise_passes(out, i, o, 0.0, w_elems * per, 0.0, 1, 0, ctx)
    else:
        _set_blockwise_passes(out, i, o, 0.0, w_elems * per, tokens * d * per, 1, 1, ctx)


def _set_blockwise_passes(out: dict[str, np.ndarray], i: int, o: F.Op, fq: float, fw: float, bq: float, k_fwd: int, k_bwd: int,
                          ctx: Context) -> None:
    """Row ``i``'s block-wise passes: ``fq`` activation and ``fw`` weight bytes forward, ``bq`` backward,
    ``k_fwd`` + ``k_bwd`` quantisation kernels per call, plus the measured per-call overhead."""
    bw = ctx.topology.gpu.hbm_bw_bytes_per_s * ctx.eff.memory.get("elementwise", 0.85)
    launch = ctx.eff.launch_s.get("elementwise", 2e-6)
    out["fp8"][i] = 1.0
    out["fwd_quant_s"][i] = fq / bw
    out["fwd_quant_fixed_s"][i] = fw / bw
    out["bwd_quant_s"][i] = bq / bw
    out["bwd_quant_fixed_s"][i] = 0.0
    opts = ctx.options
    ovh_f = opts.fp8_blockwise_call_overhead_fwd_s if opts.fp8_blockwise_call_overhead_fwd_s is not None else opts.fp8_call_overhead_fwd_s
    ovh_b = opts.fp8_blockwise_call_overhead_bwd_s if opts.fp8_blockwise_call_overhead_bwd_s is not None else opts.fp8_call_overhead_bwd_s
    out["fwd_launch_s"][i] += o.fwd_launches * (k_fwd * launch + ovh_f)
    out["bwd_launch_s"][i] += o.fwd_launches * (k_bwd * launch + ovh_b)
    out["quant_launches"][i] = k_fwd + k_bwd
    out["fwd_bytes"][i] += fq + fw
    out["bwd_bytes"][i] += bq


__all__ = [
    "FFN_OPS", "FUSED_FFN_BLOCKS", "FUSED_RECIPE", "fp8_allowed", "fp8_capable", "fp8_guard", "fused_ffn_layers",
    "fused_norm_act_bytes", "price_fp8_quantisation",
]
