"""The InterFormer layer's FiLM-modulated LayerNorm as one Triton kernel each way.

``out[t] = LayerNorm(h[t]) · (1 + γ[s(t)]) + β[s(t)]``, where ``s(t)`` is the sample of history row ``t``
and ``γ, β [B, D]`` come from the sample's non-sequence context (``trainer/model/layers.py``
``InterFormerLayer``). In PyTorch that is five kernels forward (two gathers that write ``β`` and ``1+γ``
out to every token, the LayerNorm, the ``addcmul``) and, backward, the ``addcmul``'s two products, two
per-sample sums of ``[T, D]`` gradients (one-hot GEMMs) and LayerNorm's two kernels: about eight passes over
``[T, D]`` forward and thirteen backward. On the H100 (``benchmarks/results/fresh_draws_h100e.json``) that chain
was the largest elementwise item of every held-out draw: a fifth to a third of the device step in a layer's
``norm_act`` range together with ``norm2`` and the SiLU.

Here:

- forward: a program per block of rows reads ``h`` (statistics in 128-wide chunks merged by Chan's
  formula, then a second read of the same rows, which L2 holds), gathers its rows' ``γ, β`` from the small
  ``[B, D]`` tables and writes ``out``; it saves ``mean, rstd`` (fp32 per row) and no ``[T, D]`` tensor of its own;
- backward: a program per block of rows reads ``dz`` and ``h`` twice (the row sums, then the input gradient),
  writes ``dh``, and sums ``dz·y`` and ``dz`` per sample into ``dγ, dβ`` (fp32): the rows of a block belong to
  few samples (they are consecutive), so the block adds one vector for the sample of its first row, one for its
  last, and single elements for rows of any sample wholly inside it (short histories); LayerNorm's weight and
  bias gradients are per-block partial sums, reduced after.

The per-sample sums use atomic adds, so ``dγ, dβ`` are not bit-reproducible from run to run (the order of
additions varies); everything else is. Rows past the last sample (a CUDA graph's padding, ``segment_ids``
``padded``) take the last sample's ``γ, β`` as the PyTorch path does; their gradients are zeros there.

On CPU the kernels run in Triton's interpreter for tests; the trainer uses them on CUDA with the Triton
attention backend, outside ``torch.compile`` (a compiled layer keeps the PyTorch expression, which Inductor
fuses itself). The cost model prices this op as one LayerNorm (``costmodel.flops`` ``film_fused``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .fp8_triton import cdiv, launch_kernel

BLOCK_M = 16
"""Rows per program."""
BLOCK_K = 128
"""Columns per chunk."""
NUM_WARPS = 4


@triton.jit
def _stats(h_ptr, rows, rmask, D, stride_h, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """Mean and rstd's variance term (m2) of each row, over 128-wide chunks merged by Chan's formula."""
    mean = tl.zeros([BLOCK_M], dtype=tl.float32)
    m2 = tl.zeros([BLOCK_M], dtype=tl.float32)
    for c0 in range(0, D, BLOCK_K):
        cols = c0 + tl.arange(0, BLOCK_K)
        cmask = cols < D
        v = tl.load(h_ptr + rows[:, None] * stride_h + cols[None, :], mask=rmask[:, None] & cmask[None, :],
                    other=0.0).to(tl.float32)
        n_c = tl.minimum(D - c0, BLOCK_K) * 1.0
        n_a = c0 * 1.0
        c_mean = tl.sum(v, axis=1) / n_c
        dev = tl.where(cmask[None, :], v - c_mean[:, None], 0.0)
        delta = c_mean - mean
        mean = mean + delta * (n_c / (n_a + n_c))
        m2 = m2 + tl.sum(dev * dev, axis=1) + delta * delta * (n_a * n_c / (n_a + n_c))
    return mean, m2


@triton.jit
def _film_ln_fwd_kernel(
    h_ptr, w_ptr, b_ptr, g_ptr, be_ptr, seg_ptr, out_ptr, mean_ptr, rstd_ptr,
    M, D, stride_h, stride_o, stride_g, stride_be, eps,
    HAS_W: tl.constexpr, HAS_B: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = (pid * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    rmask = rows < M
    mean, m2 = _stats(h_ptr, rows, rmask, D, stride_h, BLOCK_M, BLOCK_K)
    rstd = 1.0 / tl.sqrt_rn(m2 / D + eps)
    tl.store(mean_ptr + rows, mean, mask=rmask)
    tl.store(rstd_ptr + rows, rstd, mask=rmask)
    s = tl.load(seg_ptr + rows, mask=rmask, other=0).to(tl.int64)
    for c0 in range(0, D, BLOCK_K):
        cols = c0 + tl.arange(0, BLOCK_K)
        cmask = cols < D
        m = rmask[:, None] & cmask[None, :]
        v = tl.load(h_ptr + rows[:, None] * stride_h + cols[None, :], mask=m, other=0.0).to(tl.float32)
        y = (v - mean[:, None]) * rstd[:, None]
        if HAS_W:
            y = y * tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
        if HAS_B:
            y = y + tl.load(b_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
        gam = tl.load(g_ptr + s[:, None] * stride_g + cols[None, :], mask=m, other=0.0).to(tl.float32)
        bet = tl.load(be_ptr + s[:, None] * stride_be + cols[None, :], mask=m, other=0.0).to(tl.float32)
        out = y * (1.0 + gam) + bet
        tl.store(out_ptr + rows[:, None] * stride_o + cols[None, :], out.to(out_ptr.dtype.element_ty), mask=m)


@triton.jit
def _film_ln_bwd_kernel(
    dz_ptr, h_ptr, w_ptr, b_ptr, g_ptr, seg_ptr, mean_ptr, rstd_ptr, dh_ptr, pw_ptr, pb_ptr, dg_ptr, dbe_ptr,
    M, D, stride_dz, stride_h, stride_dh, stride_g,
    HAS_W: tl.constexpr, HAS_B: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """y = x̂·w + b, out = y·(1+γ) + β. dβ[s] += Σ dz, dγ[s] += Σ dz·y; dy = dz·(1+γ);
    dw, db partials Σ dy·x̂, Σ dy; dh = rstd·(g − x̂·mean(g·x̂) − mean(g)), g = dy·w."""
    pid = tl.program_id(0)
    first_row = pid * BLOCK_M
    rows = (first_row + tl.arange(0, BLOCK_M)).to(tl.int64)
    rmask = rows < M
    mean = tl.load(mean_ptr + rows, mask=rmask, other=0.0)
    rstd = tl.load(rstd_ptr + rows, mask=rmask, other=0.0)
    s = tl.load(seg_ptr + rows, mask=rmask, other=0).to(tl.int64)
    s0 = tl.load(seg_ptr + first_row).to(tl.int64)
    s1 = tl.load(seg_ptr + tl.minimum(first_row + BLOCK_M, M) - 1).to(tl.int64)
    in_first = rmask & (s == s0)
    in_last = rmask & (s == s1) & (s1 != s0)
    in_mid = rmask & (s != s0) & (s != s1)
    c1 = tl.zeros([BLOCK_M], dtype=tl.float32)
    c2 = tl.zeros([BLOCK_M], dtype=tl.float32)
    for c0 in range(0, D, BLOCK_K):
        cols = c0 + tl.arange(0, BLOCK_K)
        cmask = cols < D
        m = rmask[:, None] & cmask[None, :]
        x = tl.load(h_ptr + rows[:, None] * stride_h + cols[None, :], mask=m, other=0.0).to(tl.float32)
        dz = tl.load(dz_ptr + rows[:, None] * stride_dz + cols[None, :], mask=m, other=0.0).to(tl.float32)
        xhat = tl.where(m, (x - mean[:, None]) * rstd[:, None], 0.0)
        y = xhat
        w = tl.full([BLOCK_K], 1.0, tl.float32)
        if HAS_W:
            w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
            y = y * w[None, :]
        if HAS_B:
            y = y + tl.load(b_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
        gam = tl.load(g_ptr + s[:, None] * stride_g + cols[None, :], mask=m, other=0.0).to(tl.float32)
        dy = dz * (1.0 + gam)
        g = dy * w[None, :]
        c1 += tl.sum(g * xhat, axis=1)
        c2 += tl.sum(g, axis=1)
        tl.store(pw_ptr + pid * D + cols, tl.sum(dy * xhat, axis=0), mask=cmask)
        tl.store(pb_ptr + pid * D + cols, tl.sum(dy, axis=0), mask=cmask)
        dzy = tl.where(m, dz * y, 0.0)
        # the per-sample sums: one vector for the first row's sample, one for the last row's, elements for the rest
        tl.atomic_add(dg_ptr + s0 * D + cols, tl.sum(tl.where(in_first[:, None], dzy, 0.0), axis=0), mask=cmask)
        tl.atomic_add(dbe_ptr + s0 * D + cols, tl.sum(tl.where(in_first[:, None], dz, 0.0), axis=0), mask=cmask)
        tl.atomic_add(dg_ptr + s1 * D + cols, tl.sum(tl.where(in_last[:, None], dzy, 0.0), axis=0), mask=cmask & (s1 != s0))
        tl.atomic_add(dbe_ptr + s1 * D + cols, tl.sum(tl.where(in_last[:, None], dz, 0.0), axis=0), mask=cmask & (s1 != s0))
        mid = in_mid[:, None] & cmask[None, :]
        tl.atomic_add(dg_ptr + s[:, None] * D + cols[None, :], dzy, mask=mid)
        tl.atomic_add(dbe_ptr + s[:, None] * D + cols[None, :], dz, mask=mid)
    c1 = c1 / D
    c2 = c2 / D
    for c0 in range(0, D, BLOCK_K):
        cols = c0 + tl.arange(0, BLOCK_K)
        cmask = cols < D
        m = rmask[:, None] & cmask[None, :]
        x = tl.load(h_ptr + rows[:, None] * stride_h + cols[None, :], mask=m, other=0.0).to(tl.float32)
        dz = tl.load(dz_ptr + rows[:, None] * stride_dz + cols[None, :], mask=m, other=0.0).to(tl.float32)
        xhat = (x - mean[:, None]) * rstd[:, None]
        gam = tl.load(g_ptr + s[:, None] * stride_g + cols[None, :], mask=m, other=0.0).to(tl.float32)
        g = dz * (1.0 + gam)
        if HAS_W:
            g = g * tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
        dh = (g - xhat * c1[:, None] - c2[:, None]) * rstd[:, None]
        tl.store(dh_ptr + rows[:, None] * stride_dh + cols[None, :], dh.to(dh_ptr.dtype.element_ty), mask=m)


class FilmInputError(ValueError):
    """An input of :func:`film_layer_norm` is malformed: the message names it and the fix."""


def _check(h: Tensor, weight: Tensor | None, bias: Tensor | None, gamma: Tensor, beta: Tensor, seg: Tensor) -> None:
    if h.dim() != 2:
        raise FilmInputError(f"film_layer_norm: h must be [tokens, width], got shape {tuple(h.shape)}")
    M, D = h.shape
    for name, t in (("gamma", gamma), ("beta", beta)):
        if t.dim() != 2 or t.shape[1] != D or t.stride(1) != 1:
            raise FilmInputError(f"film_layer_norm: {name} must be [samples, {D}] with unit column stride, "
                                 f"got shape {tuple(t.shape)} strides {t.stride()}")
    if gamma.shape[0] != beta.shape[0]:
        raise FilmInputError(f"film_layer_norm: gamma has {gamma.shape[0]} samples, beta {beta.shape[0]}")
    if M and gamma.shape[0] == 0:
        raise FilmInputError("film_layer_norm: tokens but no sample rows in gamma/beta")
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and (t.dim() != 1 or t.numel() != D):
            raise FilmInputError(f"film_layer_norm: {name} must have {D} elements, got shape {tuple(t.shape)}")
    if seg.dim() != 1 or seg.numel() != M or seg.dtype not in (torch.int32, torch.int64):
        raise FilmInputError(f"film_layer_norm: seg must be int32/int64 [{M}] (each row's sample), got "
                             f"{seg.dtype} shape {tuple(seg.shape)}")
    devices = {t.device for t in (h, gamma, beta, seg, weight, bias) if t is not None}
    if len(devices) != 1:
        raise FilmInputError(f"film_layer_norm: inputs on several devices {sorted(map(str, devices))}")


class _FilmLayerNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, bias, gamma, beta, seg, eps):  # type: ignore[override]
        h = h.contiguous()
        seg = seg.contiguous()
        M, D = h.shape
        out = torch.empty_like(h)
        mean = torch.empty(M, device=h.device, dtype=torch.float32)
        rstd = torch.empty(M, device=h.device, dtype=torch.float32)
        if M:
            launch_kernel(_film_ln_fwd_kernel, (cdiv(M, BLOCK_M),),
                          (h, weight if weight is not None else h, bias if bias is not None else h, gamma, beta, seg,
                           out, mean, rstd, M, D, h.stride(0), out.stride(0), gamma.stride(0), beta.stride(0), float(eps)),
                          dict(HAS_W=weight is not None, HAS_B=bias is not None, BLOCK_M=BLOCK_M, BLOCK_K=BLOCK_K),
                          NUM_WARPS)
        ctx.save_for_backward(h, weight, bias, gamma, seg, mean, rstd)
        ctx.beta_dtype = beta.dtype
        return out

    @staticmethod
    def backward(ctx, dz):  # type: ignore[override]
        h, weight, bias, gamma, seg, mean, rstd = ctx.saved_tensors
        dz = dz.contiguous()
        M, D = h.shape
        B = gamma.shape[0]
        dh = torch.empty_like(h)
        n_blocks = cdiv(M, BLOCK_M)
        pw = torch.empty(n_blocks, D, device=h.device, dtype=torch.float32)
        pb = torch.empty(n_blocks, D, device=h.device, dtype=torch.float32)
        dg = torch.zeros(B, D, device=h.device, dtype=torch.float32)
        dbe = torch.zeros(B, D, device=h.device, dtype=torch.float32)
        if M:
            launch_kernel(_film_ln_bwd_kernel, (n_blocks,),
                          (dz, h, weight if weight is not None else h, bias if bias is not None else h, gamma, seg,
                           mean, rstd, dh, pw, pb, dg, dbe, M, D, dz.stride(0), h.stride(0), dh.stride(0), gamma.stride(0)),
                          dict(HAS_W=weight is not None, HAS_B=bias is not None, BLOCK_M=BLOCK_M, BLOCK_K=BLOCK_K),
                          NUM_WARPS)
        dw = pw.sum(0).to(weight.dtype) if weight is not None and ctx.needs_input_grad[1] else None
        db = pb.sum(0).to(bias.dtype) if bias is not None and ctx.needs_input_grad[2] else None
        return dh, dw, db, dg.to(gamma.dtype), dbe.to(ctx.beta_dtype), None, None


def film_layer_norm(h: Tensor, weight: Tensor | None, bias: Tensor | None, gamma: Tensor, beta: Tensor, seg: Tensor,
                    eps: float = 1e-5) -> Tensor:
    """``F.layer_norm(h, (D,), weight, bias, eps) * (1 + gamma[seg]) + beta[seg]`` for ``h [T, D]``, per-sample
    ``gamma, beta [B, D]`` (row stride free: ``chunk``'s halves are fine) and ``seg [T]``, each row's sample
    (sorted, as :func:`coplan.trainer.model.layers.segment_ids` gives), in one Triton kernel forward and one
    backward. Differentiable in ``h``, ``weight``, ``bias``, ``gamma`` and ``beta``; output in ``h``'s dtype
    (computed in fp32, rounded once)."""
    _check(h, weight, bias, gamma, beta, seg)
    return _FilmLayerNorm.apply(h, weight, bias, gamma, beta, seg, eps)


def film_layer_norm_reference(h: Tensor, weight: Tensor | None, bias: Tensor | None, gamma: Tensor, beta: Tensor,
                              seg: Tensor, eps: float = 1e-5) -> Tensor:
    """The same in PyTorch (fp32 throughout, for tests)."""
    y = torch.nn.functional.layer_norm(h.float(), (h.shape[1],), None if weight is None else weight.float(),
                                       None if bias is None else bias.float(), eps)
    return y * (1.0 + gamma.float()[seg]) + beta.float()[seg]


__all__ = ["FilmInputError", "film_layer_norm", "film_layer_norm_reference"]
