"""FP8 written by the kernels that produce the activations (issue 26): LayerNorm and the FFN
activation quantise their own output into the block-wise recipe's operands, forward and backward,
so no separate quantisation pass reads a bf16 copy back from HBM.

The block-wise recipe (:mod:`.fp8_triton`) feeds its GEMM ``A [M, K]`` in 1x128 tiles along K
(``q`` e4m3, row-major, K zero-padded to 128; scales ``s [M, K/128]`` fp32 stored outer-dim-major,
strides ``(1, M)``) and the weight gradient ``Aᵀ`` in 1x128 tiles along the tokens (``qt [K→16,
M→128]``, ``st [K→16, M/128]``, strides ``(1, K→16)``): the layouts of
:func:`~coplan.kernels.fp8_triton.quant_act_dual`, which :func:`~coplan.kernels.fp8_triton.block_mm`
(cuBLAS or :func:`~coplan.kernels.fp8_triton.block_scaled_mm`) takes with no copy. Each producer here
writes exactly those tensors (a :class:`~coplan.kernels.fp8_triton.DualQuant`), with the same
numerics: ``s = max(amax, 1e-12) / fp8_max`` and ``q = clamp(y · (1/s), ±fp8_max)``, both
IEEE-rounded (``tl.math.div_rn``), so a fused producer's ``q`` and ``s`` are bit-equal to
``quant_act_dual`` of the values it computed.

- :func:`layernorm_quant`: one program per block of rows reads x, computes mean and rstd (chunked
  Welford), then normalises each 128-wide chunk (a re-read that hits L1/L2) and writes y's tiles. A
  row block of 128 holds whole 128-token tiles of every column, so yᵀ's tiles (along the tokens, for
  the weight gradient) come out of the same read: the transposed operand costs no extra HBM read,
  only its own 1 byte per element of writes (plus 4 bytes of scale per 128).
- :func:`act_quant`: the FFN activation (SiLU, GELU-tanh, ReLU, ReLU², identity, and the gated
  SwiGLU / GeGLU over ``[gate | up]`` halves, ``chunk(2, -1)``'s order), tile-local, optionally also
  the activation's input in fp8 for the backward (DeepSeek-V3 §3.3.3 stores the SwiGLU inputs so).
- :func:`layernorm_backward_quant`, :func:`act_backward_quant`: the input gradients, optionally with
  a residual gradient added in the kernel, written as e4m3 or e5m2 tiles (and their transpose) for
  the next backward GEMMs, plus LayerNorm's weight and bias gradients (fp32 partial sums per row
  block, reduced after).
- :func:`ln_linear_fp8`, :func:`act_linear_fp8`, :func:`ln_ffn_fp8` (and the module
  :class:`FusedFp8LayerNormLinear`): autograd ops chaining a producer into the block-scaled GEMM.
  :func:`fused_bytes` counts the HBM bytes a chain moves fused and unfused.

Saved for the backward (M tokens, D = LayerNorm width, H = activation width, N = output features):

=====================  =========================================================  ===================================
op                     saved                                                      dtype
=====================  =========================================================  ===================================
``ln_linear_fp8``      x [M, D] (LayerNorm's backward needs x̂ exactly); mean,     x as given; fp32; fp8 e4m3 + fp32
                       rstd [M]; yᵀ tiles [D→16, M→128]; Wᵀ blocks [D→16, N→128]   scales; fp8 e4m3 + fp32 scales
``act_linear_fp8``     h [M, H] (or, ``save_input_fp8``, h in 1x128 tiles); aᵀ     h as given (or e4m3 + scales);
                       tiles [H→16, M→128]; Wᵀ blocks                              e4m3 + scales
``ln_ffn_fp8``         the union of both (x, mean, rstd, yᵀ, W_upᵀ, h, aᵀ,        as above; the hidden gradient dh
                       W_downᵀ)                                                    never exists in bf16
=====================  =========================================================  ===================================

No bf16 y or a is saved: the GEMMs' weight gradients take the fp8 transposed copies, and an FP8
copy replaces x or h only where the backward's math tolerates the rounding (h, opt-in; x̂ in
LayerNorm's backward is not rounded).

What is not fused here, and why: the InterFormer layer's first norm feeds ``qkv`` through a per-sample
FiLM modulation (``x·(1+γ)+β``), which :func:`layernorm_quant` does not apply; the attention output
``a`` is written by the attention kernel (:mod:`.triton_attention`), whose epilogue would have to
quantise it; the incoming gradient of a chain (``d out``) comes from outside it and is quantised
by ``quant_act_dual`` (one read, both copies). A LayerNorm backward writing the residual stream's
gradient in fp8 for the *previous* linear's backward (``residual_grad`` + ``quant``) needs a
composition spanning the whole layer, since autograd hands gradients between ops in high precision.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor, nn

from . import fp8_triton as ft
from .fp8 import Fp8InputError
from .fp8_triton import BLOCK, E4M3, DualQuant, cdiv, interpreting, padded

E5M2 = torch.float8_e5m2
FP8_MAX = {E4M3: 448.0, E5M2: 57344.0}
"""Largest normal of each fp8 format: a tile's amax maps onto it (``s = amax / fp8_max``)."""
AMAX_FLOOR = 1e-12
"""An all-zero tile gets this amax (as in :mod:`.fp8_triton`): a positive scale, and 0 / s stays 0."""
T_ROWS_GRANULE = 16
"""Rows of a transposed copy are padded to 16 (``torch._scaled_mm``'s B operand needs N % 16 == 0),
as :func:`~coplan.kernels.fp8_triton.quant_act_dual` pads them."""
ACT_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# kind -> (code of the elementwise function, gated)
ACTIVATIONS: dict[str, tuple[int, bool]] = {
    "identity": (0, False), "relu": (1, False), "relu2": (2, False), "relu_squared": (2, False),
    "silu": (3, False), "gelu_tanh": (4, False), "swiglu": (3, True), "geglu": (4, True),
}
"""The activations :func:`act_quant` fuses: those of :mod:`coplan.trainer.model` (SiLU in the FFNs,
SwiGLU = ``silu(gate) · up`` in the MoE experts and the decoder, GELU-tanh in the decoder, and the
attention activations). Gated kinds take ``h = [gate | up]`` of width 2H and give width H."""


# --------------------------------------------------------------------------------------------
# Triton pieces
# --------------------------------------------------------------------------------------------


@triton.jit
def _tanh(x):
    # tanh saturates to ±1 in fp32 beyond |x| = 9; clamping keeps exp finite.
    return 1.0 - 2.0 / (tl.exp(2.0 * tl.minimum(tl.maximum(x, -15.0), 15.0)) + 1.0)


@triton.jit
def _sigmoid(x):
    # exp of -|x| only: no overflow (the interpreter's numpy warns on it), exact for both signs.
    z = tl.exp(-tl.abs(x))
    return tl.where(x >= 0, 1.0 / (1.0 + z), z / (1.0 + z))


@triton.jit
def _act(x, ACT: tl.constexpr):
    """act(x) for the codes of :data:`ACTIVATIONS` (full-precision exp, not tanh.approx: the result
    is quantised, and its error must stay under the reference comparison's 1e-6)."""
    if ACT == 0:
        y = x
    elif ACT == 1:
        y = tl.maximum(x, 0.0)
    elif ACT == 2:
        r = tl.maximum(x, 0.0)
        y = r * r
    elif ACT == 3:
        y = x * _sigmoid(x)
    else:
        y = 0.5 * x * (1.0 + _tanh(x * (0.7978845608028654 + 0.035677408136300125 * x * x)))
    return y


@triton.jit
def _act_and_grad(x, ACT: tl.constexpr):
    """(act(x), act'(x))."""
    if ACT == 0:
        y = x
        dy = tl.full(x.shape, 1.0, tl.float32)
    elif ACT == 1:
        y = tl.maximum(x, 0.0)
        dy = tl.where(x > 0.0, 1.0, 0.0)
    elif ACT == 2:
        r = tl.maximum(x, 0.0)
        y = r * r
        dy = 2.0 * r
    elif ACT == 3:
        sg = _sigmoid(x)
        y = x * sg
        dy = sg * (1.0 + x * (1.0 - sg))
    else:
        x2 = x * x
        t = _tanh(x * (0.7978845608028654 + 0.035677408136300125 * x2))
        y = 0.5 * x * (1.0 + t)
        dy = 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * (0.7978845608028654 + 0.10703222440890037 * x2)
    return y, dy


@triton.jit
def _quant_store(
    y, rows, cols, kb, rb, q_ptr, s_ptr, qt_ptr, st_ptr, M, Q_COLS, QT_ROWS, QT_COLS,
    stride_sm, stride_sk, stride_stm, stride_stk,
    WITH_T: tl.constexpr, FP8_MAX: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Write one [BLOCK_M, BLOCK_K] fp32 tile ``y`` (zero outside the operand) as q's 1x128 tiles
    (scale per row of the tile; column tile ``kb``) and, WITH_T (BLOCK_M = 128), as qt's: the
    transpose, a scale per column of the tile (row block ``rb`` of 128 tokens). Same arithmetic as
    ``fp8_triton._quant_dual_kernel``'s 1x128 path, so the copies are bit-equal to quant_act_dual's."""
    a = tl.abs(y)
    s_row = tl.math.div_rn(tl.maximum(tl.max(a, axis=1), 1e-12), tl.full([BLOCK_M], FP8_MAX, tl.float32))
    q = tl.minimum(tl.maximum(y * tl.math.div_rn(tl.full([BLOCK_M], 1.0, tl.float32), s_row)[:, None], -FP8_MAX), FP8_MAX)
    rmask = rows < M
    tl.store(s_ptr + rows * stride_sm + kb * stride_sk, s_row, mask=rmask)
    tl.store(q_ptr + rows[:, None] * Q_COLS + cols[None, :], q.to(q_ptr.dtype.element_ty),
             mask=rmask[:, None] & (cols[None, :] < Q_COLS))
    if WITH_T:
        s_col = tl.math.div_rn(tl.maximum(tl.max(a, axis=0), 1e-12), tl.full([BLOCK_K], FP8_MAX, tl.float32))
        qt = tl.minimum(tl.maximum(y * tl.math.div_rn(tl.full([BLOCK_K], 1.0, tl.float32), s_col)[None, :], -FP8_MAX), FP8_MAX)
        tl.store(st_ptr + cols * stride_stm + rb * stride_stk, s_col, mask=cols < QT_ROWS)
        tl.store(qt_ptr + cols[:, None] * QT_COLS + rows[None, :], tl.trans(qt).to(qt_ptr.dtype.element_ty),
                 mask=(cols[:, None] < QT_ROWS) & (rows[None, :] < QT_COLS))


@triton.jit
def _ln_fwd_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, mean_ptr, rstd_ptr, q_ptr, s_ptr, qt_ptr, st_ptr,
    M, D, D_PAD, QT_ROWS, M_PAD, stride_xm, stride_ym, stride_sm, stride_sk, stride_stm, stride_stk, eps,
    HAS_W: tl.constexpr, HAS_B: tl.constexpr, WITH_Y: tl.constexpr, WITH_T: tl.constexpr,
    FP8_MAX: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Rows [pid·BLOCK_M, +BLOCK_M): mean and rstd over D (chunks merged by Chan's formula: no
    E[x²] − E[x]² cancellation), then y = (x − mean)·rstd·w + b chunk by chunk, each chunk written
    as fp8 tiles (and, WITH_T, transposed tiles) and, WITH_Y, in y's dtype."""
    pid = tl.program_id(0)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < M
    mean = tl.zeros([BLOCK_M], dtype=tl.float32)
    m2 = tl.zeros([BLOCK_M], dtype=tl.float32)
    for c0 in range(0, D, BLOCK_K):
        cols = c0 + tl.arange(0, BLOCK_K)
        cmask = cols < D
        v = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=rmask[:, None] & cmask[None, :], other=0.0).to(tl.float32)
        n_c = tl.minimum(D - c0, BLOCK_K) * 1.0
        n_a = c0 * 1.0
        c_mean = tl.sum(v, axis=1) / n_c
        dev = tl.where(cmask[None, :], v - c_mean[:, None], 0.0)
        delta = c_mean - mean
        mean = mean + delta * (n_c / (n_a + n_c))
        m2 = m2 + tl.sum(dev * dev, axis=1) + delta * delta * (n_a * n_c / (n_a + n_c))
    rstd = 1.0 / tl.sqrt_rn(m2 / D + eps)
    tl.store(mean_ptr + rows, mean, mask=rmask)
    tl.store(rstd_ptr + rows, rstd, mask=rmask)
    for c0 in range(0, D_PAD, BLOCK_K):
        cols = c0 + tl.arange(0, BLOCK_K)
        cmask = cols < D
        m = rmask[:, None] & cmask[None, :]
        v = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=m, other=0.0).to(tl.float32)
        y = (v - mean[:, None]) * rstd[:, None]
        if HAS_W:
            y = y * tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
        if HAS_B:
            y = y + tl.load(b_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
        y = tl.where(m, y, 0.0)  # padded columns and rows past M are zeros: no amax, no product
        if WITH_Y:
            tl.store(y_ptr + rows[:, None] * stride_ym + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=m)
        _quant_store(y, rows, cols, c0 // BLOCK_K, pid, q_ptr, s_ptr, qt_ptr, st_ptr, M, D_PAD, QT_ROWS, M_PAD,
                     stride_sm, stride_sk, stride_stm, stride_stk, WITH_T, FP8_MAX, BLOCK_M, BLOCK_K)


@triton.jit
def _ln_bwd_kernel(
    dy_ptr, x_ptr, w_ptr, mean_ptr, rstd_ptr, r_ptr, dx_ptr, pw_ptr, pb_ptr, q_ptr, s_ptr, qt_ptr, st_ptr,
    M, D, D_PAD, QT_ROWS, M_PAD, stride_dym, stride_xm, stride_rm, stride_dxm,
    stride_sm, stride_sk, stride_stm, stride_stk,
    HAS_W: tl.constexpr, HAS_R: tl.constexpr, WITH_DX: tl.constexpr, PARTIALS: tl.constexpr,
    QUANT: tl.constexpr, WITH_T: tl.constexpr, FP8_MAX: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """LayerNorm's input gradient over rows [pid·BLOCK_M, +BLOCK_M):
    dx = rstd · (g − mean(g) − x̂ · mean(g·x̂)) (+ the residual gradient), g = dy·w, x̂ = (x − mean)·rstd.
    The first sweep takes the two row means and the block's partial sums of dy·x̂ and dy (the
    weight and bias gradients) into pw/pb[pid, :]; the second writes dx and/or its fp8 tiles."""
    pid = tl.program_id(0)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < M
    mean = tl.load(mean_ptr + rows, mask=rmask, other=0.0)
    rstd = tl.load(rstd_ptr + rows, mask=rmask, other=0.0)
    c1 = tl.zeros([BLOCK_M], dtype=tl.float32)
    c2 = tl.zeros([BLOCK_M], dtype=tl.float32)
    for c0 in range(0, D, BLOCK_K):
        cols = c0 + tl.arange(0, BLOCK_K)
        cmask = cols < D
        m = rmask[:, None] & cmask[None, :]
        x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=m, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + rows[:, None] * stride_dym + cols[None, :], mask=m, other=0.0).to(tl.float32)
        xhat = tl.where(m, (x - mean[:, None]) * rstd[:, None], 0.0)
        g = dy
        if HAS_W:
            g = dy * tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
        c1 += tl.sum(g * xhat, axis=1)
        c2 += tl.sum(g, axis=1)
        if PARTIALS:
            tl.store(pw_ptr + pid * D + cols, tl.sum(dy * xhat, axis=0), mask=cmask)
            tl.store(pb_ptr + pid * D + cols, tl.sum(dy, axis=0), mask=cmask)
    c1 = c1 / D
    c2 = c2 / D
    if WITH_DX or QUANT:
        for c0 in range(0, D_PAD, BLOCK_K):
            cols = c0 + tl.arange(0, BLOCK_K)
            cmask = cols < D
            m = rmask[:, None] & cmask[None, :]
            x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=m, other=0.0).to(tl.float32)
            dy = tl.load(dy_ptr + rows[:, None] * stride_dym + cols[None, :], mask=m, other=0.0).to(tl.float32)
            xhat = (x - mean[:, None]) * rstd[:, None]
            g = dy
            if HAS_W:
                g = dy * tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
            dx = (g - xhat * c1[:, None] - c2[:, None]) * rstd[:, None]
            if HAS_R:
                dx += tl.load(r_ptr + rows[:, None] * stride_rm + cols[None, :], mask=m, other=0.0).to(tl.float32)
            dx = tl.where(m, dx, 0.0)
            if WITH_DX:
                tl.store(dx_ptr + rows[:, None] * stride_dxm + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=m)
            if QUANT:
                _quant_store(dx, rows, cols, c0 // BLOCK_K, pid, q_ptr, s_ptr, qt_ptr, st_ptr, M, D_PAD, QT_ROWS, M_PAD,
                             stride_sm, stride_sk, stride_stm, stride_stk, WITH_T, FP8_MAX, BLOCK_M, BLOCK_K)


@triton.jit
def _load_h(h_ptr, hs_ptr, rows, j, m, stride_hm, stride_hs, H_FP8: tl.constexpr, BLOCK_K: tl.constexpr):
    """The activation's input at columns j: from h, or dequantised from its fp8 1x128 tiles."""
    v = tl.load(h_ptr + rows[:, None] * stride_hm + j, mask=m, other=0.0).to(tl.float32)
    if H_FP8:
        v = v * tl.load(hs_ptr + rows[:, None] * stride_hs + j // BLOCK_K, mask=m, other=0.0)
    return v


@triton.jit
def _act_fwd_kernel(
    h_ptr, a_ptr, q_ptr, s_ptr, qt_ptr, st_ptr, hq_ptr, hs_ptr,
    M, H, H_PAD, QT_ROWS, M_PAD, HQ_COLS, stride_hm, stride_am, stride_sm, stride_sk, stride_stm, stride_stk, stride_hs,
    ACT: tl.constexpr, GATED: tl.constexpr, WITH_A: tl.constexpr, WITH_T: tl.constexpr, WITH_HQ: tl.constexpr,
    FP8_MAX: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """One [BLOCK_M, 128] tile of a = act(h) (gated: act(h[:, :H]) · h[:, H:]): fp8 tiles (and,
    WITH_T, transposed tiles), WITH_A a in a's dtype, WITH_HQ the input's own e4m3 1x128 tiles
    (gated: gate tiles in columns [0, H_PAD), up tiles in [H_PAD, 2·H_PAD))."""
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    rmask = rows < M
    m = rmask[:, None] & (cols[None, :] < H)
    g = tl.load(h_ptr + rows[:, None] * stride_hm + cols[None, :], mask=m, other=0.0).to(tl.float32)
    a = _act(g, ACT)
    if GATED:
        u = tl.load(h_ptr + rows[:, None] * stride_hm + H + cols[None, :], mask=m, other=0.0).to(tl.float32)
        a = a * u
    a = tl.where(m, a, 0.0)
    if WITH_A:
        tl.store(a_ptr + rows[:, None] * stride_am + cols[None, :], a.to(a_ptr.dtype.element_ty), mask=m)
    _quant_store(a, rows, cols, pid_k, pid_m, q_ptr, s_ptr, qt_ptr, st_ptr, M, H_PAD, QT_ROWS, M_PAD,
                 stride_sm, stride_sk, stride_stm, stride_stk, WITH_T, FP8_MAX, BLOCK_M, BLOCK_K)
    if WITH_HQ:
        # the input's own e4m3 tiles, scales row-major [M, tiles]: only this module's backward reads them
        _quant_store(g, rows, cols, pid_k, pid_m, hq_ptr, hs_ptr, hq_ptr, hs_ptr, M, HQ_COLS, 0, 0,
                     stride_hs, 1, 0, 0, False, 448.0, BLOCK_M, BLOCK_K)
        if GATED:
            _quant_store(u, rows, H_PAD + cols, H_PAD // BLOCK_K + pid_k, pid_m, hq_ptr, hs_ptr, hq_ptr, hs_ptr, M,
                         HQ_COLS, 0, 0, stride_hs, 1, 0, 0, False, 448.0, BLOCK_M, BLOCK_K)


@triton.jit
def _act_bwd_kernel(
    da_ptr, h_ptr, hs_ptr, dh_ptr, q_ptr, s_ptr, qt_ptr, st_ptr,
    M, H, C, C_PAD, UP_OFF, QT_ROWS, M_PAD, stride_dam, stride_hm, stride_hs, stride_dhm,
    stride_sm, stride_sk, stride_stm, stride_stk,
    ACT: tl.constexpr, GATED: tl.constexpr, H_FP8: tl.constexpr, WITH_DH: tl.constexpr, QUANT: tl.constexpr,
    WITH_T: tl.constexpr, FP8_MAX: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """One [BLOCK_M, 128] tile of dh = da · act'(h) over dh's C columns (gated, C = 2H:
    [da · up · act'(gate) | da · act(gate)], each column reading its gate/up pair, so a tile may
    straddle the halves when H is not a multiple of 128). UP_OFF: where the up half starts in h's
    columns (H in h itself, H_PAD in its fp8 copy)."""
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    rmask = rows < M
    m = rmask[:, None] & (cols[None, :] < C)
    if GATED:
        is_gate = cols < H
        j = tl.where(is_gate, cols, cols - H)
    else:
        j = cols
    da = tl.load(da_ptr + rows[:, None] * stride_dam + j[None, :], mask=m, other=0.0).to(tl.float32)
    x = _load_h(h_ptr, hs_ptr, rows, j[None, :], m, stride_hm, stride_hs, H_FP8, BLOCK_K)
    y, dydx = _act_and_grad(x, ACT)
    if GATED:
        u = _load_h(h_ptr, hs_ptr, rows, UP_OFF + j[None, :], m, stride_hm, stride_hs, H_FP8, BLOCK_K)
        dh = tl.where(is_gate[None, :], da * u * dydx, da * y)
    else:
        dh = da * dydx
    dh = tl.where(m, dh, 0.0)
    if WITH_DH:
        tl.store(dh_ptr + rows[:, None] * stride_dhm + cols[None, :], dh.to(dh_ptr.dtype.element_ty), mask=m)
    if QUANT:
        _quant_store(dh, rows, cols, pid_k, pid_m, q_ptr, s_ptr, qt_ptr, st_ptr, M, C_PAD, QT_ROWS, M_PAD,
                     stride_sm, stride_sk, stride_stm, stride_stk, WITH_T, FP8_MAX, BLOCK_M, BLOCK_K)


# --------------------------------------------------------------------------------------------
# Inputs, buffers, launches
# --------------------------------------------------------------------------------------------


def _err(msg: str) -> Fp8InputError:
    return Fp8InputError(msg)


def _check_runnable(t: Tensor, name: str) -> None:
    if not (t.is_cuda or interpreting()):
        raise _err(f"{name}: the fused fp8 kernels run on CUDA tensors (or on CPU under TRITON_INTERPRET=1, for "
                   f"tests); got a tensor on {t.device}")


def _check_rows(t: Tensor, name: str, fn: str, *, width: int | None = None, rows: int | None = None,
                device: torch.device | None = None) -> None:
    """A 2-D floating operand [rows, width] (fp32/bf16/fp16) with unit column stride."""
    if not isinstance(t, Tensor):
        raise _err(f"{fn}: {name} must be a tensor, got {type(t).__name__}")
    if t.dim() != 2:
        raise _err(f"{fn}: {name} must be 2-D [tokens, features], got shape {tuple(t.shape)} (reshape(-1, features) first)")
    if t.dtype not in ACT_FLOAT_DTYPES:
        raise _err(f"{fn}: {name} must be float32, bfloat16 or float16, got {t.dtype}")
    if width is not None and t.shape[1] != width:
        raise _err(f"{fn}: {name} has {t.shape[1]} columns, expected {width} (shape {tuple(t.shape)})")
    if rows is not None and t.shape[0] != rows:
        raise _err(f"{fn}: {name} has {t.shape[0]} rows, expected {rows} (shape {tuple(t.shape)})")
    if t.shape[1] == 0:
        raise _err(f"{fn}: {name} has no columns (shape {tuple(t.shape)})")
    if t.shape[0] > 1 and t.stride(1) != 1:
        raise _err(f"{fn}: {name} must have contiguous rows (stride along features 1), got strides {tuple(t.stride())}; "
                   "pass .contiguous()")
    if device is not None and t.device != device:
        raise _err(f"{fn}: {name} is on {t.device}, the other operands on {device}")
    _check_runnable(t, f"{fn}: {name}")
    try:
        ft._check_2d(t, fn)
    except ValueError as e:
        raise _err(str(e)) from None


def _check_vec(t: Tensor | None, name: str, fn: str, n: int, device: torch.device, dtype: torch.dtype | None = None) -> None:
    if t is None:
        return
    if not isinstance(t, Tensor) or t.dim() != 1 or t.shape[0] != n:
        shape = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
        raise _err(f"{fn}: {name} must be a 1-D tensor of {n} elements, got {shape}")
    if dtype is not None and t.dtype != dtype:
        raise _err(f"{fn}: {name} must be {dtype}, got {t.dtype}")
    if not t.is_floating_point():
        raise _err(f"{fn}: {name} must be floating point, got {t.dtype}")
    if n > 1 and t.stride(0) != 1:
        raise _err(f"{fn}: {name} must be contiguous, got stride {t.stride(0)}; pass .contiguous()")
    if t.device != device:
        raise _err(f"{fn}: {name} is on {t.device}, the operand on {device}")


def _check_fp8_dtype(fp8_dtype, fn: str) -> float:
    if fp8_dtype not in FP8_MAX:
        raise _err(f"{fn}: fp8_dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {fp8_dtype}")
    return FP8_MAX[fp8_dtype]


def _check_kind(kind: str, fn: str) -> tuple[int, bool]:
    hit = ACTIVATIONS.get(kind) if isinstance(kind, str) else None
    if hit is None:
        raise _err(f"{fn}: kind={kind!r} is not a fused activation; choose one of {', '.join(map(repr, ACTIVATIONS))}")
    return hit


class _Fp8Out(NamedTuple):
    q: Tensor
    s: Tensor
    qt: Tensor | None
    st: Tensor | None
    kw: dict


def _fp8_buffers(M: int, C: int, with_t: bool, fp8_dtype: torch.dtype, device) -> _Fp8Out:
    """Empty copies in quant_act_dual's layouts: q [M, C→128], s [M, C/128] strides (1, M); with_t,
    qt [C→16, M→128], st [C→16, M/128] strides (1, C→16). Under the interpreter q is fp32 (its
    fp32 → fp8 rounding is wrong; PyTorch casts after: fp8_triton._store_dtype)."""
    c_pad, kb = padded(C, BLOCK), padded(C, BLOCK) // BLOCK
    store = ft._store_dtype(fp8_dtype)
    q = torch.empty(M, c_pad, device=device, dtype=store)
    s = torch.empty(kb, M, device=device, dtype=torch.float32).t()
    qt = st = None
    if with_t:
        qt_rows, m_pad = padded(C, T_ROWS_GRANULE), padded(M, BLOCK)
        qt = torch.empty(qt_rows, m_pad, device=device, dtype=store)
        st = torch.empty(m_pad // BLOCK, qt_rows, device=device, dtype=torch.float32).t()
    kw = dict(q=q, s=s, qt=qt if qt is not None else q, st=st if st is not None else s,
              qt_rows=qt.shape[0] if qt is not None else 0, m_pad=qt.shape[1] if qt is not None else 0)
    return _Fp8Out(q, s, qt, st, kw)


def _finish(b: _Fp8Out, fp8_dtype: torch.dtype) -> DualQuant:
    return DualQuant(b.q.to(fp8_dtype), b.s, b.qt.to(fp8_dtype) if b.qt is not None else None, b.st)


def _block_rows(with_t: bool) -> tuple[int, int]:
    """(rows per program, warps): a transposed copy needs whole 128-token tiles in one program."""
    if with_t:
        return BLOCK, 8
    return (32, 4) if interpreting() else (16, 4)


# --------------------------------------------------------------------------------------------
# LayerNorm
# --------------------------------------------------------------------------------------------


class LayerNormQuant(NamedTuple):
    """What :func:`layernorm_quant` writes: the fp8 operand (``fp8.qt``/``fp8.st`` with ``with_t``),
    the row statistics for the backward (fp32 [M]), and y in x's dtype if asked."""

    fp8: DualQuant
    mean: Tensor
    rstd: Tensor
    y: Tensor | None


def layernorm_quant(
    x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float = 1e-5, *, with_t: bool = False,
    return_y: bool = False, fp8_dtype: torch.dtype = E4M3,
) -> LayerNormQuant:
    """``F.layer_norm(x, (D,), weight, bias, eps)`` of ``x [M, D]`` written as the block-wise A operand
    in one read of x: ``fp8.q [M, D→128]`` + 1x128 scales, and (``with_t``) ``fp8.qt [D→16, M→128]``
    + scales along the tokens, the weight gradient's operand; ``mean``/``rstd`` fp32 [M] for the
    backward; ``y`` in x's dtype when ``return_y`` (a residual user; costs its own write)."""
    fn = "layernorm_quant"
    _check_rows(x, "x", fn)
    M, D = x.shape
    _check_vec(weight, "weight", fn, D, x.device)
    _check_vec(bias, "bias", fn, D, x.device)
    fp8_max = _check_fp8_dtype(fp8_dtype, fn)
    if not (isinstance(eps, (int, float)) and eps > 0):
        raise _err(f"{fn}: eps must be a positive number, got {eps!r}")
    b = _fp8_buffers(M, D, with_t, fp8_dtype, x.device)
    mean = torch.empty(M, device=x.device, dtype=torch.float32)
    rstd = torch.empty(M, device=x.device, dtype=torch.float32)
    y = torch.empty(M, D, device=x.device, dtype=x.dtype) if return_y else None
    if M:
        block_m, warps = _block_rows(with_t)
        k = b.kw
        ft._launch(_ln_fwd_kernel, (cdiv(M, block_m),),
                   (x, weight if weight is not None else x, bias if bias is not None else x, y if y is not None else x,
                    mean, rstd, k["q"], k["s"], k["qt"], k["st"],
                    M, D, padded(D, BLOCK), k["qt_rows"], k["m_pad"], x.stride(0), y.stride(0) if y is not None else 0,
                    k["s"].stride(0), k["s"].stride(1), k["st"].stride(0), k["st"].stride(1), float(eps)),
                   dict(HAS_W=weight is not None, HAS_B=bias is not None, WITH_Y=return_y, WITH_T=with_t,
                        FP8_MAX=fp8_max, BLOCK_M=block_m, BLOCK_K=BLOCK), warps)
    return LayerNormQuant(_finish(b, fp8_dtype), mean, rstd, y)


class LayerNormGrad(NamedTuple):
    """What :func:`layernorm_backward_quant` writes: dx in high precision (if asked), its fp8
    operand (if asked), and the weight / bias gradients (fp32 sums, in the parameters' dtype)."""

    dx: Tensor | None
    fp8: DualQuant | None
    dweight: Tensor | None
    dbias: Tensor | None


def layernorm_backward_quant(
    dy: Tensor, x: Tensor, weight: Tensor | None, mean: Tensor, rstd: Tensor, *, residual_grad: Tensor | None = None,
    return_dx: bool = True, quant: bool = True, with_t: bool = False, fp8_dtype: torch.dtype = E4M3,
    weight_grads: bool = True, dx_dtype: torch.dtype | None = None,
) -> LayerNormGrad:
    """LayerNorm's backward from :func:`layernorm_quant`'s ``mean``/``rstd``: ``dx`` (+ ``residual_grad``,
    the residual stream's gradient added in the kernel) in ``dx_dtype`` (default x's) when
    ``return_dx``; its fp8 tiles (e4m3 or e5m2) when ``quant`` (and the transposed tiles with
    ``with_t``) for the previous linear's backward GEMMs; and, ``weight_grads``, ``dweight = Σ dy·x̂``
    and ``dbias = Σ dy`` over the tokens (fp32 partial sums per row block, then summed)."""
    fn = "layernorm_backward_quant"
    _check_rows(x, "x", fn)
    M, D = x.shape
    _check_rows(dy, "dy", fn, width=D, rows=M, device=x.device)
    if residual_grad is not None:
        _check_rows(residual_grad, "residual_grad", fn, width=D, rows=M, device=x.device)
    _check_vec(weight, "weight", fn, D, x.device)
    _check_vec(mean, "mean", fn, M, x.device, torch.float32)
    _check_vec(rstd, "rstd", fn, M, x.device, torch.float32)
    fp8_max = _check_fp8_dtype(fp8_dtype, fn)
    if with_t and not quant:
        raise _err(f"{fn}: with_t=True writes the transposed fp8 copy, which needs quant=True")
    if dx_dtype is not None and dx_dtype not in ACT_FLOAT_DTYPES:
        raise _err(f"{fn}: dx_dtype must be float32, bfloat16 or float16, got {dx_dtype}")
    dx = torch.empty(M, D, device=x.device, dtype=dx_dtype or x.dtype) if return_dx else None
    b = _fp8_buffers(M, D, with_t, fp8_dtype, x.device) if quant else None
    block_m, warps = _block_rows(with_t)
    n_blocks = cdiv(M, block_m)
    pw = torch.empty(n_blocks, D, device=x.device, dtype=torch.float32) if weight_grads else None
    pb = torch.empty(n_blocks, D, device=x.device, dtype=torch.float32) if weight_grads else None
    if M and (return_dx or quant or weight_grads):
        k = b.kw if b is not None else dict(q=x, s=mean, qt=x, st=mean, qt_rows=0, m_pad=0)
        s, st = k["s"], k["st"]
        ft._launch(_ln_bwd_kernel, (n_blocks,),
                   (dy, x, weight if weight is not None else x, mean, rstd,
                    residual_grad if residual_grad is not None else x, dx if dx is not None else x,
                    pw if pw is not None else mean, pb if pb is not None else mean, k["q"], s, k["qt"], st,
                    M, D, padded(D, BLOCK), k["qt_rows"], k["m_pad"], dy.stride(0), x.stride(0),
                    residual_grad.stride(0) if residual_grad is not None else 0, dx.stride(0) if dx is not None else 0,
                    s.stride(0) if s.dim() == 2 else 0, s.stride(1) if s.dim() == 2 else 0,
                    st.stride(0) if st.dim() == 2 else 0, st.stride(1) if st.dim() == 2 else 0),
                   dict(HAS_W=weight is not None, HAS_R=residual_grad is not None, WITH_DX=return_dx,
                        PARTIALS=weight_grads, QUANT=quant, WITH_T=with_t, FP8_MAX=fp8_max, BLOCK_M=block_m,
                        BLOCK_K=BLOCK), warps)
    dweight = dbias = None
    if weight_grads:
        pdt = weight.dtype if weight is not None else x.dtype
        dweight = pw.sum(0).to(pdt) if M else torch.zeros(D, device=x.device, dtype=pdt)
        dbias = pb.sum(0).to(pdt) if M else torch.zeros(D, device=x.device, dtype=pdt)
    return LayerNormGrad(dx, _finish(b, fp8_dtype) if b is not None else None, dweight, dbias)


# --------------------------------------------------------------------------------------------
# Activations
# --------------------------------------------------------------------------------------------


class ActQuant(NamedTuple):
    """What :func:`act_quant` writes: the fp8 operand of act(h), act(h) in h's dtype if asked, and
    (``save_input_fp8``) h's own e4m3 1x128 tiles ``(hq, hs)`` for :func:`act_backward_quant`."""

    fp8: DualQuant
    a: Tensor | None
    h_fp8: tuple[Tensor, Tensor] | None


def act_width(h_cols: int, kind: str) -> int:
    """Width of act(h) for an ``h`` of ``h_cols`` columns (gated kinds halve it)."""
    return h_cols // 2 if ACTIVATIONS[kind][1] else h_cols


def act_quant(
    h: Tensor, kind: str = "silu", *, with_t: bool = False, return_a: bool = False, save_input_fp8: bool = False,
    fp8_dtype: torch.dtype = E4M3,
) -> ActQuant:
    """``a = act(h)`` of ``h [M, H]`` (gated kinds: ``h [M, 2H] = [gate | up]``, ``a = act(gate)·up``)
    written as the block-wise A operand: ``fp8.q [M, H→128]`` + 1x128 scales and (``with_t``) the
    transposed tiles for the weight gradient; ``a`` in h's dtype when ``return_a``; h's own e4m3 tiles
    when ``save_input_fp8`` (``hq [M, parts·H→128]``, ``hs [M, parts·H/128]``, parts = 2 gated)."""
    fn = "act_quant"
    act, gated = _check_kind(kind, fn)
    _check_rows(h, "h", fn)
    M, C = h.shape
    if gated and C % 2:
        raise _err(f"{fn}: kind={kind!r} takes h = [gate | up] with an even number of columns, got {C}")
    H = act_width(C, kind)
    fp8_max = _check_fp8_dtype(fp8_dtype, fn)
    b = _fp8_buffers(M, H, with_t, fp8_dtype, h.device)
    a = torch.empty(M, H, device=h.device, dtype=h.dtype) if return_a else None
    h_pad, parts = padded(H, BLOCK), 2 if gated else 1
    hq = hs = None
    if save_input_fp8:
        hq = torch.empty(M, parts * h_pad, device=h.device, dtype=ft._store_dtype(E4M3))
        hs = torch.empty(M, parts * h_pad // BLOCK, device=h.device, dtype=torch.float32)
    if M:
        block_m, warps = _block_rows(with_t)
        k = b.kw
        ft._launch(_act_fwd_kernel, (cdiv(M, block_m), h_pad // BLOCK),
                   (h, a if a is not None else h, k["q"], k["s"], k["qt"], k["st"], hq if hq is not None else h,
                    hs if hs is not None else k["s"], M, H, h_pad, k["qt_rows"], k["m_pad"],
                    hq.shape[1] if hq is not None else 0, h.stride(0), a.stride(0) if a is not None else 0,
                    k["s"].stride(0), k["s"].stride(1), k["st"].stride(0), k["st"].stride(1),
                    hs.stride(0) if hs is not None else 0),
                   dict(ACT=act, GATED=gated, WITH_A=return_a, WITH_T=with_t, WITH_HQ=save_input_fp8, FP8_MAX=fp8_max,
                        BLOCK_M=block_m, BLOCK_K=BLOCK), warps)
    h_fp8 = (hq.to(E4M3), hs) if hq is not None else None
    return ActQuant(_finish(b, fp8_dtype), a, h_fp8)


class ActGrad(NamedTuple):
    """What :func:`act_backward_quant` writes: dh in high precision (if asked) and its fp8 operand (if asked)."""

    dh: Tensor | None
    fp8: DualQuant | None


def act_backward_quant(
    da: Tensor, h: Tensor | None, kind: str = "silu", *, h_fp8: tuple[Tensor, Tensor] | None = None,
    return_dh: bool = False, quant: bool = True, with_t: bool = False, fp8_dtype: torch.dtype = E4M3,
    dh_dtype: torch.dtype | None = None,
) -> ActGrad:
    """``dh = da · act'(h)`` (gated: ``[da·up·act'(gate) | da·act(gate)]``) from the activation's
    input ``h`` or, instead, its fp8 tiles ``h_fp8`` from :func:`act_quant` (then ``dh_dtype`` is
    needed for ``return_dh``). Written as the block-wise A operand (e4m3 or e5m2, ``quant``; the
    transposed tiles with ``with_t``) for the producing linear's backward GEMMs, and/or in
    ``dh_dtype`` (default h's) when ``return_dh``."""
    fn = "act_backward_quant"
    act, gated = _check_kind(kind, fn)
    if (h is None) == (h_fp8 is None):
        raise _err(f"{fn}: pass exactly one of h (the activation's input) and h_fp8 (its fp8 tiles from act_quant)")
    fp8_max = _check_fp8_dtype(fp8_dtype, fn)
    if with_t and not quant:
        raise _err(f"{fn}: with_t=True writes the transposed fp8 copy, which needs quant=True")
    if not (return_dh or quant):
        raise _err(f"{fn}: nothing to write: set return_dh and/or quant")
    _check_rows(da, "da", fn)
    M, H = da.shape
    C = 2 * H if gated else H
    h_pad, parts = padded(H, BLOCK), 2 if gated else 1
    if h is not None:
        _check_rows(h, "h", fn, width=C, rows=M, device=da.device)
        src, hs, up_off, stride_h = h, None, H, h.stride(0)
    else:
        if not (isinstance(h_fp8, tuple) and len(h_fp8) == 2 and all(isinstance(t, Tensor) for t in h_fp8)):
            raise _err(f"{fn}: h_fp8 must be the (hq, hs) pair act_quant(save_input_fp8=True) returned")
        hq, hs = h_fp8
        if hq.dtype != E4M3 or tuple(hq.shape) != (M, parts * h_pad) or hq.stride(1) != 1:
            raise _err(f"{fn}: h_fp8's tiles must be e4m3 [{M}, {parts * h_pad}] row-major for da {tuple(da.shape)} "
                       f"and kind={kind!r}, got {hq.dtype} {tuple(hq.shape)}")
        if hs.dtype != torch.float32 or tuple(hs.shape) != (M, parts * h_pad // BLOCK) or hs.stride(1) != 1:
            raise _err(f"{fn}: h_fp8's scales must be float32 [{M}, {parts * h_pad // BLOCK}] row-major, got "
                       f"{hs.dtype} {tuple(hs.shape)}")
        if hq.device != da.device or hs.device != da.device:
            raise _err(f"{fn}: h_fp8 is on {hq.device}, da on {da.device}")
        if return_dh and dh_dtype is None:
            raise _err(f"{fn}: with h_fp8, name dh_dtype for return_dh (there is no h to take it from)")
        src, up_off, stride_h = hq, h_pad, hq.stride(0)
    out_dtype = dh_dtype or (h.dtype if h is not None else da.dtype)
    if out_dtype not in ACT_FLOAT_DTYPES:
        raise _err(f"{fn}: dh_dtype must be float32, bfloat16 or float16, got {out_dtype}")
    dh = torch.empty(M, C, device=da.device, dtype=out_dtype) if return_dh else None
    b = _fp8_buffers(M, C, with_t, fp8_dtype, da.device) if quant else None
    c_pad = padded(C, BLOCK)
    if M:
        block_m, warps = _block_rows(with_t)
        k = b.kw if b is not None else dict(q=da, s=da, qt=da, st=da, qt_rows=0, m_pad=0)
        s, st = k["s"], k["st"]
        ft._launch(_act_bwd_kernel, (cdiv(M, block_m), c_pad // BLOCK),
                   (da, src, hs if hs is not None else da, dh if dh is not None else da, k["q"], s, k["qt"], st,
                    M, H, C, c_pad, up_off, k["qt_rows"], k["m_pad"], da.stride(0), stride_h,
                    hs.stride(0) if hs is not None else 0, dh.stride(0) if dh is not None else 0,
                    s.stride(0), s.stride(1), st.stride(0), st.stride(1)),
                   dict(ACT=act, GATED=gated, H_FP8=h_fp8 is not None, WITH_DH=return_dh, QUANT=quant, WITH_T=with_t,
                        FP8_MAX=fp8_max, BLOCK_M=block_m, BLOCK_K=BLOCK), warps)
    return ActGrad(dh, _finish(b, fp8_dtype) if b is not None else None)
