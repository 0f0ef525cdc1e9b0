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

- :func:`layernorm_quant`: one program per block of rows reads x, computes mean and rstd (128-wide
  chunks merged by Chan's formula), then normalises each 128-wide chunk (a re-read that hits L1/L2) and writes y's tiles. A
  row block of 128 holds whole 128-token tiles of every column, so yᵀ's tiles (along the tokens, for
  the weight gradient) come out of the same read: the transposed operand costs no extra HBM read,
  only its own 1 byte per element of writes (plus 4 bytes of scale per 128). The price is
  parallelism: with the transpose, a program owns 128 rows, so M = 61,000 tokens give 477 programs
  (enough for 132 SMs) but M = 512 summary tokens only 4. Where that underfills the GPU, a stats
  kernel (one read of x) followed by a 2-D grid of tiles (a second read, ``2·M·D`` bytes more in
  bf16) would trade bytes for SMs; not written, as nothing measured it yet.
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

Status: checked against PyTorch in Triton's CPU interpreter (tests/kernels/test_fp8_fused.py); the
compiled kernels, their bf16 tests and ``benchmarks/fp8_fused_h200.py`` have not run on a GPU yet.

What is not fused here, and why: the InterFormer layer's first norm feeds ``qkv`` through a per-sample
FiLM modulation (``x·(1+γ)+β``), which :func:`layernorm_quant` does not apply; the attention output
``a`` is written by the attention kernel (:mod:`.triton_attention`), whose epilogue would have to
quantise it; the incoming gradient of a chain (``d out``) comes from outside it and is quantised
by ``quant_act_dual`` (one read, both copies). A LayerNorm backward writing the residual stream's
gradient in fp8 for the *previous* linear's backward (``residual_grad`` + ``quant``) needs a
composition spanning the whole layer, since autograd hands gradients between ops in high precision.
"""

from __future__ import annotations

import contextlib
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
        v = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=rmask[:, None] & cmask[None, :],
                    other=0.0).to(tl.float32)
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
        ft.check_2d(t, fn)
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
    fp32 → fp8 rounding is wrong; PyTorch casts after: fp8_triton.store_dtype)."""
    c_pad, kb = padded(C, BLOCK), padded(C, BLOCK) // BLOCK
    store = ft.store_dtype(fp8_dtype)
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
        ft.launch_kernel(_ln_fwd_kernel, (cdiv(M, block_m),),
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
        ft.launch_kernel(_ln_bwd_kernel, (n_blocks,),
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
        hq = torch.empty(M, parts * h_pad, device=h.device, dtype=ft.store_dtype(E4M3))
        hs = torch.empty(M, parts * h_pad // BLOCK, device=h.device, dtype=torch.float32)
    if M:
        block_m, warps = _block_rows(with_t)
        k = b.kw
        ft.launch_kernel(_act_fwd_kernel, (cdiv(M, block_m), h_pad // BLOCK),
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
        ft.launch_kernel(_act_bwd_kernel, (cdiv(M, block_m), c_pad // BLOCK),
                   (da, src, hs if hs is not None else da, dh if dh is not None else da, k["q"], s, k["qt"], st,
                    M, H, C, c_pad, up_off, k["qt_rows"], k["m_pad"], da.stride(0), stride_h,
                    hs.stride(0) if hs is not None else 0, dh.stride(0) if dh is not None else 0,
                    s.stride(0), s.stride(1), st.stride(0), st.stride(1)),
                   dict(ACT=act, GATED=gated, H_FP8=h_fp8 is not None, WITH_DH=return_dh, QUANT=quant, WITH_T=with_t,
                        FP8_MAX=fp8_max, BLOCK_M=block_m, BLOCK_K=BLOCK), warps)
    return ActGrad(dh, _finish(b, fp8_dtype) if b is not None else None)


# --------------------------------------------------------------------------------------------
# Autograd compositions: producer → block-scaled GEMM
# --------------------------------------------------------------------------------------------


def _mm(qa: Tensor, sa: Tensor, qb: Tensor, sb: Tensor, *, n: int, b_square: bool, out_dtype: torch.dtype) -> Tensor:
    """``(qa·sa) @ (qb·sb)ᵀ`` → ``[M, n]``: :func:`~coplan.kernels.fp8_triton.block_mm` (cuBLAS where it
    takes the shapes) for e4m3 operands; the Triton GEMM where one is e5m2 (cuBLAS's block-wise path is
    e4m3 only, and a refused first call would turn block_mm's cuBLAS path off for every later e4m3 call)."""
    if qa.dtype == E4M3 and qb.dtype == E4M3:
        return ft.block_mm(qa, sa, qb, sb, n=n, b_square=b_square, out_dtype=out_dtype)
    out = ft.block_scaled_mm(qa, sa, qb, sb, n=n, b_square=b_square,
                             out_dtype=out_dtype if out_dtype != torch.float16 else torch.float32)
    return out.to(out_dtype)


def _rows(t: Tensor, n: int) -> Tensor:
    """A weight gradient trimmed to its n rows (the transposed operand's rows are padded to 16)."""
    return t if t.shape[0] == n else t[:n].contiguous()


def _opt(t: Tensor | None) -> Tensor:
    return t if t is not None else torch.empty(0)


def _grad_out_quant(gout: Tensor, with_t: bool) -> DualQuant:
    # The chain's incoming gradient is produced outside it: one read, both copies (quant_act_dual).
    return ft.quant_act_dual(gout.contiguous(), with_t=with_t)


class _LnLinearFp8(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, ln_w, ln_b, weight, bias, eps):  # type: ignore[override]
        need = ctx.needs_input_grad
        need_dy, need_dw = need[0] or need[1] or need[2], need[3]
        M, D = x.shape
        N = weight.shape[0]
        ctx.shape = (M, D, N)
        ctx.dtypes = (x.dtype, weight.dtype, ln_w.dtype if ln_w is not None else None,
                      ln_b.dtype if ln_b is not None else None, bias.dtype if bias is not None else None)
        ln = layernorm_quant(x, ln_w, ln_b, eps, with_t=need_dw)
        wq = ft.quant_weight_dual(weight, with_t=need_dy)
        out = _mm(ln.fp8.q, ln.fp8.s, wq.q, wq.s, n=N, b_square=True, out_dtype=x.dtype) if M else x.new_zeros(0, N)
        if bias is not None:
            out = out + bias.to(out.dtype)
        ctx.save_for_backward(x, ln_w, ln.mean, ln.rstd, _opt(ln.fp8.qt), _opt(ln.fp8.st), _opt(wq.qt), _opt(wq.st))
        return out

    @staticmethod
    def backward(ctx, gout):  # type: ignore[override]
        x, ln_w, mean, rstd, yqt, yst, wqt, wst = ctx.saved_tensors
        M, D, N = ctx.shape
        x_dt, w_dt, lnw_dt, lnb_dt, b_dt = ctx.dtypes
        need = ctx.needs_input_grad
        need_dy = need[0] or need[1] or need[2]
        dx = dlnw = dlnb = dw = db = None
        if M == 0:
            dx = x.new_zeros(0, D) if need[0] else None
            dlnw = torch.zeros(D, device=x.device, dtype=lnw_dt) if need[1] else None
            dlnb = torch.zeros(D, device=x.device, dtype=lnb_dt) if need[2] else None
            dw = torch.zeros(N, D, device=x.device, dtype=w_dt) if need[3] else None
            db = torch.zeros(N, device=x.device, dtype=b_dt) if need[4] else None
            return dx, dlnw, dlnb, dw, db, None
        dq = _grad_out_quant(gout, with_t=need[3])
        if need[3]:
            dw = _rows(_mm(dq.qt, dq.st, yqt, yst, n=D, b_square=False, out_dtype=w_dt), N)
        if need_dy:
            dy = _mm(dq.q, dq.s, wqt, wst, n=D, b_square=True, out_dtype=x_dt)
            g = layernorm_backward_quant(dy, x, ln_w, mean, rstd, return_dx=need[0], quant=False,
                                         weight_grads=need[1] or need[2])
            dx = g.dx
            dlnw = g.dweight.to(lnw_dt) if need[1] else None
            dlnb = g.dbias.to(lnb_dt) if need[2] else None
        if need[4]:
            db = gout.sum(0, dtype=torch.float32).to(b_dt)
        return dx, dlnw, dlnb, dw, db, None


class _ActLinearFp8(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, bias, kind, save_input_fp8):  # type: ignore[override]
        need_dh, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        M, C = h.shape
        H, N = act_width(C, kind), weight.shape[0]
        ctx.shape, ctx.kind = (M, C, H, N), kind
        ctx.dtypes = (h.dtype, weight.dtype, bias.dtype if bias is not None else None)
        aq = act_quant(h, kind, with_t=need_dw, save_input_fp8=save_input_fp8 and need_dh)
        wq = ft.quant_weight_dual(weight, with_t=need_dh)
        out = _mm(aq.fp8.q, aq.fp8.s, wq.q, wq.s, n=N, b_square=True, out_dtype=h.dtype) if M else h.new_zeros(0, N)
        if bias is not None:
            out = out + bias.to(out.dtype)
        hq, hs = aq.h_fp8 if aq.h_fp8 is not None else (None, None)
        keep_h = h if need_dh and hq is None else None
        ctx.save_for_backward(keep_h, _opt(hq), _opt(hs), _opt(aq.fp8.qt), _opt(aq.fp8.st), _opt(wq.qt), _opt(wq.st))
        ctx.h_fp8 = hq is not None
        return out

    @staticmethod
    def backward(ctx, gout):  # type: ignore[override]
        h, hq, hs, aqt, ast, wqt, wst = ctx.saved_tensors
        M, C, H, N = ctx.shape
        h_dt, w_dt, b_dt = ctx.dtypes
        need = ctx.needs_input_grad
        dh = dw = db = None
        if M == 0:
            dev = gout.device
            return (torch.zeros(0, C, device=dev, dtype=h_dt) if need[0] else None,
                    torch.zeros(N, H, device=dev, dtype=w_dt) if need[1] else None,
                    torch.zeros(N, device=dev, dtype=b_dt) if need[2] else None, None, None)
        dq = _grad_out_quant(gout, with_t=need[1])
        if need[1]:
            dw = _rows(_mm(dq.qt, dq.st, aqt, ast, n=H, b_square=False, out_dtype=w_dt), N)
        if need[0]:
            da = _mm(dq.q, dq.s, wqt, wst, n=H, b_square=True, out_dtype=h_dt)
            dh = act_backward_quant(da, h, ctx.kind, h_fp8=(hq, hs) if ctx.h_fp8 else None, return_dh=True,
                                    quant=False, dh_dtype=h_dt).dh
        if need[2]:
            db = gout.sum(0, dtype=torch.float32).to(b_dt)
        return dh, dw, db, None, None


class _LnFfnFp8(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, ln_w, ln_b, w_up, w_down, eps, kind, save_input_fp8, grad_dtype):  # type: ignore[override]
        need = ctx.needs_input_grad
        need_dy = need[0] or need[1] or need[2]
        need_dh = need_dy or need[3]
        M, D = x.shape
        C, Dout = w_up.shape[0], w_down.shape[0]
        H = act_width(C, kind)
        ctx.shape, ctx.kind, ctx.grad_dtype = (M, D, C, H, Dout), kind, grad_dtype
        ctx.dtypes = (x.dtype, ln_w.dtype if ln_w is not None else None, ln_b.dtype if ln_b is not None else None,
                      w_up.dtype, w_down.dtype)
        ln = layernorm_quant(x, ln_w, ln_b, eps, with_t=need[3])
        wu = ft.quant_weight_dual(w_up, with_t=need_dy)
        wd = ft.quant_weight_dual(w_down, with_t=need_dh)
        if M:
            h = _mm(ln.fp8.q, ln.fp8.s, wu.q, wu.s, n=C, b_square=True, out_dtype=x.dtype)
            aq = act_quant(h, kind, with_t=need[4], save_input_fp8=save_input_fp8 and need_dh)
            out = _mm(aq.fp8.q, aq.fp8.s, wd.q, wd.s, n=Dout, b_square=True, out_dtype=x.dtype)
        else:
            h, aq = None, None
            out = x.new_zeros(0, Dout)
        hq, hs = aq.h_fp8 if aq is not None and aq.h_fp8 is not None else (None, None)
        keep_h = h if need_dh and hq is None else None
        ctx.h_fp8 = hq is not None
        ctx.save_for_backward(x, ln_w, ln.mean, ln.rstd, _opt(ln.fp8.qt), _opt(ln.fp8.st), _opt(wu.qt), _opt(wu.st),
                              keep_h, _opt(hq), _opt(hs), _opt(aq.fp8.qt if aq else None), _opt(aq.fp8.st if aq else None),
                              _opt(wd.qt), _opt(wd.st))
        return out

    @staticmethod
    def backward(ctx, gout):  # type: ignore[override]
        x, ln_w, mean, rstd, yqt, yst, wut, wust, h, hq, hs, aqt, ast, wdt, wdst = ctx.saved_tensors
        M, D, C, H, Dout = ctx.shape
        x_dt, lnw_dt, lnb_dt, wu_dt, wd_dt = ctx.dtypes
        need = ctx.needs_input_grad
        need_dy = need[0] or need[1] or need[2]
        dx = dlnw = dlnb = dwu = dwd = None
        if M == 0:
            dev = gout.device
            return (x.new_zeros(0, D) if need[0] else None,
                    torch.zeros(D, device=dev, dtype=lnw_dt) if need[1] else None,
                    torch.zeros(D, device=dev, dtype=lnb_dt) if need[2] else None,
                    torch.zeros(C, D, device=dev, dtype=wu_dt) if need[3] else None,
                    torch.zeros(Dout, H, device=dev, dtype=wd_dt) if need[4] else None, None, None, None, None)
        dq = _grad_out_quant(gout, with_t=need[4])
        if need[4]:
            dwd = _rows(_mm(dq.qt, dq.st, aqt, ast, n=H, b_square=False, out_dtype=wd_dt), Dout)
        if need_dy or need[3]:
            da = _mm(dq.q, dq.s, wdt, wdst, n=H, b_square=True, out_dtype=x_dt)
            # dh goes straight to fp8 (both copies): it never exists in bf16
            g = act_backward_quant(da, h if not ctx.h_fp8 else None, ctx.kind, h_fp8=(hq, hs) if ctx.h_fp8 else None,
                                   quant=True, with_t=need[3], fp8_dtype=ctx.grad_dtype)
            if need[3]:
                dwu = _rows(_mm(g.fp8.qt, g.fp8.st, yqt, yst, n=D, b_square=False, out_dtype=wu_dt), C)
            if need_dy:
                dy = _mm(g.fp8.q, g.fp8.s, wut, wust, n=D, b_square=True, out_dtype=x_dt)
                lg = layernorm_backward_quant(dy, x, ln_w, mean, rstd, return_dx=need[0], quant=False,
                                              weight_grads=need[1] or need[2])
                dx = lg.dx
                dlnw = lg.dweight.to(lnw_dt) if need[1] else None
                dlnb = lg.dbias.to(lnb_dt) if need[2] else None
        return dx, dlnw, dlnb, dwu, dwd, None, None, None, None


def _check_weight(w: Tensor, name: str, fn: str, in_features: int, device: torch.device) -> None:
    if not isinstance(w, Tensor) or w.dim() != 2:
        shape = tuple(w.shape) if isinstance(w, Tensor) else type(w).__name__
        raise _err(f"{fn}: {name} must be a 2-D [out_features, in_features] tensor, got {shape}")
    if not w.is_floating_point() or w.dtype not in ACT_FLOAT_DTYPES:
        raise _err(f"{fn}: {name} must be float32, bfloat16 or float16, got {w.dtype}")
    if w.shape[1] != in_features:
        raise _err(f"{fn}: {name} has in_features {w.shape[1]}, the input has {in_features} features "
                   f"({name} shape {tuple(w.shape)})")
    if w.shape[0] == 0:
        raise _err(f"{fn}: {name} has no output features (shape {tuple(w.shape)})")
    if w.device != device:
        raise _err(f"{fn}: {name} is on {w.device}, the input on {device}")


def _flatten(x: Tensor, fn: str) -> Tensor:
    if not isinstance(x, Tensor) or x.dim() < 1:
        got = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
        raise _err(f"{fn}: x must be a tensor [..., features], got {got}")
    return x.reshape(-1, x.shape[-1])


def _inference(*ts):
    """The tensors detached when no graph is recorded (``torch.no_grad``): inside the op's forward the
    grad mode is always off, and ``needs_input_grad`` still follows ``requires_grad``, so without this
    a forward-only call would write the transposed fp8 copies a backward needs."""
    if torch.is_grad_enabled():
        return ts
    return tuple(t.detach() if isinstance(t, Tensor) else t for t in ts)


def _autocast_dtype(x: Tensor) -> torch.dtype | None:
    dev = x.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else None


def ln_linear_fp8(
    x: Tensor, ln_weight: Tensor | None, ln_bias: Tensor | None, weight: Tensor, bias: Tensor | None = None, *,
    eps: float = 1e-5,
) -> Tensor:
    """``F.linear(F.layer_norm(x, (D,), ln_weight, ln_bias, eps), weight, bias)`` with LayerNorm
    writing the GEMM's e4m3 operand (:func:`layernorm_quant`, y's transposed tiles too when the
    weight needs a gradient) and every GEMM block-scaled fp8. The backward runs dY = dOut·W and
    dW = dOutᵀ·y on fp8 operands and LayerNorm's backward in one kernel (dx, dγ, dβ). Saved: x,
    mean/rstd, fp8 yᵀ and Wᵀ (no bf16 y). Output in x's dtype (the autocast dtype under autocast)."""
    fn = "ln_linear_fp8"
    x2d = _flatten(x, fn)
    D = x2d.shape[1]
    _check_weight(weight, "weight", fn, D, x.device)
    _check_vec(bias, "bias", fn, weight.shape[0], x.device)
    cast = _autocast_dtype(x)
    if cast is not None:
        x2d = x2d.to(cast)
    _check_rows(x2d, "x", fn)
    _check_vec(ln_weight, "ln_weight", fn, D, x.device)
    _check_vec(ln_bias, "ln_bias", fn, D, x.device)
    if not (isinstance(eps, (int, float)) and eps > 0):
        raise _err(f"{fn}: eps must be a positive number, got {eps!r}")
    with torch.autocast(x.device.type, enabled=False) if cast is not None else contextlib.nullcontext():
        out = _LnLinearFp8.apply(*_inference(x2d, ln_weight, ln_bias, weight, bias), float(eps))
    return out if x.dim() == 2 else out.reshape(*x.shape[:-1], weight.shape[0])


def act_linear_fp8(
    h: Tensor, weight: Tensor, bias: Tensor | None = None, *, kind: str = "silu", save_input_fp8: bool = False,
) -> Tensor:
    """``F.linear(act(h), weight, bias)`` with the activation writing the GEMM's e4m3 operand
    (:func:`act_quant`); gated kinds take ``h = [gate | up]``. The backward computes
    ``dh = (dOut·W) · act'(h)`` in one elementwise kernel and returns it in h's dtype (the producing
    linear is outside this op: :func:`ln_ffn_fp8` keeps dh in fp8). Saved: h (``save_input_fp8``:
    its e4m3 1x128 tiles instead, half the bytes of bf16, the DeepSeek-V3 choice for SwiGLU inputs),
    fp8 aᵀ and Wᵀ."""
    fn = "act_linear_fp8"
    _check_kind(kind, fn)
    h2d = _flatten(h, fn)
    cast = _autocast_dtype(h)
    if cast is not None:
        h2d = h2d.to(cast)
    _check_rows(h2d, "h", fn)
    _check_weight(weight, "weight", fn, act_width(h2d.shape[1], kind), h.device)
    if ACTIVATIONS[kind][1] and h2d.shape[1] % 2:
        raise _err(f"{fn}: kind={kind!r} takes h = [gate | up] with an even number of columns, got {h2d.shape[1]}")
    _check_vec(bias, "bias", fn, weight.shape[0], h.device)
    with torch.autocast(h.device.type, enabled=False) if cast is not None else contextlib.nullcontext():
        out = _ActLinearFp8.apply(*_inference(h2d, weight, bias), kind, bool(save_input_fp8))
    return out if h.dim() == 2 else out.reshape(*h.shape[:-1], weight.shape[0])


def ln_ffn_fp8(
    x: Tensor, ln_weight: Tensor | None, ln_bias: Tensor | None, w_up: Tensor, w_down: Tensor, *, kind: str = "silu",
    eps: float = 1e-5, save_input_fp8: bool = False, grad_dtype: torch.dtype = E4M3,
) -> Tensor:
    """The pre-norm FFN ``F.linear(act(F.linear(F.layer_norm(x), w_up)), w_down)`` (no biases, as in
    :class:`coplan.trainer.model.layers.FFN`), every producer writing fp8: LayerNorm (y and yᵀ tiles),
    the activation (a and aᵀ tiles) and, in the backward, the activation's gradient (dh and dhᵀ
    tiles, ``grad_dtype`` e4m3 or e5m2), which never exists in high precision. Gated kinds: ``w_up``
    is ``[2H, D]`` (``[gate | up]`` rows), ``w_down`` ``[Dout, H]``."""
    fn = "ln_ffn_fp8"
    _check_kind(kind, fn)
    _check_fp8_dtype(grad_dtype, fn)
    x2d = _flatten(x, fn)
    D = x2d.shape[1]
    cast = _autocast_dtype(x)
    if cast is not None:
        x2d = x2d.to(cast)
    _check_rows(x2d, "x", fn)
    _check_vec(ln_weight, "ln_weight", fn, D, x.device)
    _check_vec(ln_bias, "ln_bias", fn, D, x.device)
    _check_weight(w_up, "w_up", fn, D, x.device)
    if ACTIVATIONS[kind][1] and w_up.shape[0] % 2:
        raise _err(f"{fn}: kind={kind!r} needs w_up = [gate | up] with an even number of rows, got {w_up.shape[0]}")
    _check_weight(w_down, "w_down", fn, act_width(w_up.shape[0], kind), x.device)
    if not (isinstance(eps, (int, float)) and eps > 0):
        raise _err(f"{fn}: eps must be a positive number, got {eps!r}")
    with torch.autocast(x.device.type, enabled=False) if cast is not None else contextlib.nullcontext():
        out = _LnFfnFp8.apply(*_inference(x2d, ln_weight, ln_bias, w_up, w_down), float(eps), kind, bool(save_input_fp8),
                              grad_dtype)
    return out if x.dim() == 2 else out.reshape(*x.shape[:-1], w_down.shape[0])


class FusedFp8LayerNormLinear(nn.Module):
    """``linear(norm(x))`` through :func:`ln_linear_fp8`, holding the given ``nn.LayerNorm`` and
    ``nn.Linear`` (their parameter objects, so FSDP2 and an optimizer built on them see the same
    parameters; ``state_dict`` keys ``norm.*``, ``linear.*``)."""

    def __init__(self, norm: nn.LayerNorm, linear: nn.Linear) -> None:
        super().__init__()
        if not isinstance(norm, nn.LayerNorm) or not isinstance(linear, nn.Linear):
            raise _err(f"FusedFp8LayerNormLinear: expected an nn.LayerNorm and an nn.Linear, got "
                       f"{type(norm).__name__} and {type(linear).__name__}")
        if len(norm.normalized_shape) != 1 or norm.normalized_shape[0] != linear.in_features:
            raise _err(f"FusedFp8LayerNormLinear: the norm's shape {tuple(norm.normalized_shape)} must be "
                       f"({linear.in_features},), the linear's in_features")
        self.norm, self.linear = norm, linear

    def forward(self, x: Tensor) -> Tensor:
        return ln_linear_fp8(x, self.norm.weight, self.norm.bias, self.linear.weight, self.linear.bias, eps=self.norm.eps)


# --------------------------------------------------------------------------------------------
# HBM bytes of a chain, fused and unfused
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ChainBytes:
    """HBM bytes one producer → fp8 GEMM chain moves in a forward + backward, per kernel (reads +
    writes, each operand read once per GEMM: the traffic floor, not a cache simulation). Additive."""

    parts: tuple[tuple[str, int], ...]
    """(kernel, bytes), in execution order; a kernel that runs twice (two GEMMs) appears twice."""

    @property
    def hbm_bytes(self) -> int:
        return sum(b for _, b in self.parts)

    @property
    def quant_pass_bytes(self) -> int:
        """Bytes of the stand-alone quantisation passes (``quant_*`` kernels)."""
        return sum(b for k, b in self.parts if k.startswith("quant_"))

    def by_kernel(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for k, b in self.parts:
            out[k] = out.get(k, 0) + b
        return out

    def __add__(self, other: "ChainBytes") -> "ChainBytes":
        return ChainBytes(self.parts + other.parts)


@dataclass(frozen=True, slots=True)
class FusedBytes:
    """A chain's bytes with its producers writing fp8 (this module) and unfused (nn.LayerNorm /
    F.silu writing bf16, then ``quant_act_dual`` reading it back: the ``blockwise`` recipe of
    :mod:`.fp8` today). Both run the same GEMMs on the same fp8 operands."""

    chain: str
    """'ln_linear', 'act_linear' or 'ln_ffn'."""
    M: int
    D: int
    N: int
    fused: ChainBytes
    unfused: ChainBytes

    @property
    def saved_bytes(self) -> int:
        return self.unfused.hbm_bytes - self.fused.hbm_bytes


CHAINS = ("ln_linear", "act_linear", "ln_ffn")


def _tiles(m: int, c: int) -> int:
    """An operand [m, c] in 1x128 tiles: q [m, c→128] e4m3 + fp32 scales."""
    return m * padded(c, BLOCK) + 4 * m * (padded(c, BLOCK) // BLOCK)


def _tiles_t(m: int, c: int) -> int:
    """Its transposed copy [c→16, m→128] + scales along the tokens."""
    return padded(c, T_ROWS_GRANULE) * padded(m, BLOCK) + 4 * padded(c, T_ROWS_GRANULE) * (padded(m, BLOCK) // BLOCK)


def _blocks(n: int, k: int) -> int:
    """A weight [n, k] in 128x128 blocks (rows padded to 16) + block scales."""
    return padded(n, T_ROWS_GRANULE) * padded(k, BLOCK) + 4 * (padded(n, BLOCK) // BLOCK) * (padded(k, BLOCK) // BLOCK)


def _linear_parts(M: int, K: int, N: int, e: int, wb: int, *, dgrad: bool = True) -> tuple[list, list]:
    """(forward, backward) kernels of one block-scaled linear [M, K] → [M, N] past its A operand's
    producer: the weight's quantisation, the three GEMMs and the incoming gradient's quantisation."""
    w = ("quant_weight", wb * N * K + _blocks(N, K) + _blocks(K, N))
    fwd = [w, ("gemm_fwd", _tiles(M, K) + _blocks(N, K) + e * M * N)]
    bwd = []
    bwd.append(("gemm_wgrad", _tiles_t(M, N) + _tiles_t(M, K) + wb * N * K))
    if dgrad:
        bwd.append(("gemm_dgrad", _tiles(M, N) + _blocks(K, N) + e * M * K))
    return fwd, bwd


def fused_bytes(M: int, D: int, N: int, *, chain: str = "ln_linear", act_bytes: int = 2, weight_bytes: int = 2,
                gated: bool = False) -> FusedBytes:
    """HBM bytes of one chain's forward + backward, fused vs unfused (:class:`FusedBytes`).

    - ``ln_linear``: LayerNorm over ``x [M, D]`` → linear ``D → N`` (:func:`ln_linear_fp8`). Fusion
      saves y's bf16 write and its re-read by the quantisation pass: ``2·act_bytes·M·D``.
    - ``act_linear``: activation of ``h [M, D]`` (``[M, 2D]`` gated) → linear ``D → N``
      (:func:`act_linear_fp8`): saves a's bf16 write and re-read.
    - ``ln_ffn``: LayerNorm → up ``D → N`` (``2N`` gated) → activation → down ``N → D``
      (:func:`ln_ffn_fp8`, ``N`` the hidden width): also the hidden gradient dh's bf16 write and
      re-read, which goes straight to fp8.

    What stays a separate pass in both: the weights' quantisation and the chain's incoming gradient
    (made outside the chain). ``act_bytes``: bytes of a high-precision activation (bf16: 2);
    ``weight_bytes``: of the weight as the op reads it and of its gradient."""
    if chain not in CHAINS:
        raise _err(f"fused_bytes: chain={chain!r}; choose one of {', '.join(map(repr, CHAINS))}")
    if min(M, D, N) < 0 or min(D, N) == 0:
        raise _err(f"fused_bytes: M, D, N must be non-negative with D, N > 0, got {M}, {D}, {N}")
    e, wb = act_bytes, weight_bytes
    stats = 8 * M  # mean and rstd, fp32
    ln_bwd = ("ln_bwd", 3 * e * M * D + stats + 2 * 2 * 4 * D * cdiv(M, 16))  # dy, x → dx; dγ/dβ partials out and in

    def grad_out(rows: int, cols: int) -> tuple[str, int]:
        return ("quant_grad_out", e * rows * cols + _tiles(rows, cols) + _tiles_t(rows, cols))

    if chain == "ln_linear":
        fwd, bwd = _linear_parts(M, D, N, e, wb)
        fused = [("ln_fwd", e * M * D + stats + _tiles(M, D) + _tiles_t(M, D)), *fwd, grad_out(M, N), *bwd, ln_bwd]
        unfused = [("ln_fwd", e * M * D + stats + e * M * D), ("quant_act", e * M * D + _tiles(M, D) + _tiles_t(M, D)),
                   *fwd, grad_out(M, N), *bwd, ln_bwd]
    elif chain == "act_linear":
        cin = 2 * D if gated else D
        fwd, bwd = _linear_parts(M, D, N, e, wb)
        act_bwd = ("act_bwd", e * M * D + 2 * e * M * cin)  # da, h → dh (high precision: the op returns it)
        fused = [("act_fwd", e * M * cin + _tiles(M, D) + _tiles_t(M, D)), *fwd, grad_out(M, N), *bwd, act_bwd]
        unfused = [("act_fwd", e * M * cin + e * M * D), ("quant_act", e * M * D + _tiles(M, D) + _tiles_t(M, D)),
                   *fwd, grad_out(M, N), *bwd, act_bwd]
    else:
        H, C = N, (2 * N if gated else N)
        up_f, up_b = _linear_parts(M, D, C, e, wb)
        dn_f, dn_b = _linear_parts(M, H, D, e, wb)
        ln_f = ("ln_fwd", e * M * D + stats + _tiles(M, D) + _tiles_t(M, D))
        act_f = ("act_fwd", e * M * C + _tiles(M, H) + _tiles_t(M, H))
        act_b = ("act_bwd", e * M * H + e * M * C + _tiles(M, C) + _tiles_t(M, C))  # da, h → dh tiles
        fused = [ln_f, *up_f, act_f, *dn_f, grad_out(M, D), *dn_b, act_b, *up_b, ln_bwd]
        unfused = [("ln_fwd", e * M * D + stats + e * M * D), ("quant_act", e * M * D + _tiles(M, D) + _tiles_t(M, D)),
                   *up_f, ("act_fwd", e * M * C + e * M * H), ("quant_act", e * M * H + _tiles(M, H) + _tiles_t(M, H)),
                   *dn_f, grad_out(M, D), *dn_b, ("act_bwd", e * M * H + 2 * e * M * C),
                   ("quant_grad_hidden", e * M * C + _tiles(M, C) + _tiles_t(M, C)), *up_b, ln_bwd]
    return FusedBytes(chain, M, D, N, ChainBytes(tuple(fused)), ChainBytes(tuple(unfused)))


__all__ = [
    "ACTIVATIONS", "AMAX_FLOOR", "CHAINS", "E5M2", "FP8_MAX", "ActGrad", "ActQuant", "ChainBytes", "FusedBytes",
    "FusedFp8LayerNormLinear", "LayerNormGrad", "LayerNormQuant", "act_backward_quant", "act_linear_fp8", "act_quant",
    "act_width", "fused_bytes", "layernorm_backward_quant", "layernorm_quant", "ln_ffn_fp8", "ln_linear_fp8",
]
