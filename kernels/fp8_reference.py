"""PyTorch references of the FP8 quantisation and GEMMs, and the CPU emulation of both recipes.

Same layouts and numerics as :mod:`coplan.kernels.fp8_triton` (row-major fp8 copies, K zero-padded,
``s = max(amax, 1e-12) / 448``, ``q = clamp(x · (1/s), ±448)`` rounded to e4m3 by PyTorch's cast),
written with plain tensor ops: the tests compare the Triton kernels against them, and on a machine
without an FP8 GPU the recipes run through them, values really rounded to e4m3 and products taken
in fp32, so a model trains on CPU with the recipe's rounding errors.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
BLOCK = 128
AMAX_FLOOR = 1e-12


def padded(n: int, granule: int) -> int:
    return -(-n // granule) * granule


def scale_of(amax: torch.Tensor) -> torch.Tensor:
    """``max(amax, floor) / 448``, IEEE-rounded on every device: the divisor is a tensor of the
    same device because CUDA PyTorch computes ``tensor / python_scalar`` as a product with the
    scalar's rounded reciprocal (1 ulp off the quotient for ~40% of values); the Triton kernels
    divide with ``tl.math.div_rn``."""
    return amax.clamp_min(AMAX_FLOOR) / torch.full_like(amax, E4M3_MAX)


def _quantise(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    inv = torch.reciprocal(scale)  # IEEE 1 / s, as the kernels' div_rn
    return (x * inv).clamp_(-E4M3_MAX, E4M3_MAX).to(E4M3)


def quant_rows_ref(x: torch.Tensor, granule: int = 16, rows_granule: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of :func:`~coplan.kernels.fp8_triton.quant_rows`."""
    R, C = x.shape
    xf = F.pad(x.float(), (0, padded(C, granule) - C, 0, padded(R, rows_granule) - R))
    amax = xf.abs().amax(dim=1, keepdim=True) if xf.shape[1] else xf.new_zeros(xf.shape[0], 1)
    s = scale_of(amax)
    s[R:] = 1.0
    return _quantise(xf, s), s


def quant_tiles_ref(x: torch.Tensor, square: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of :func:`~coplan.kernels.fp8_triton.quant_tiles`: 1x128 tiles or 128x128 blocks."""
    R, C = x.shape
    c_pad = padded(C, BLOCK)
    r_pad = padded(R, BLOCK) if square else R
    xf = F.pad(x.float(), (0, c_pad - C, 0, r_pad - R))
    kb = c_pad // BLOCK
    if square:
        blocks = xf.view(r_pad // BLOCK, BLOCK, kb, BLOCK)
        s = scale_of(blocks.abs().amax(dim=(1, 3))) if blocks.numel() else xf.new_zeros(r_pad // BLOCK, kb)
        full = s.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)
    else:
        tiles = xf.view(r_pad, kb, BLOCK)
        s = scale_of(tiles.abs().amax(dim=2)) if tiles.numel() else xf.new_zeros(r_pad, kb)
        full = s.repeat_interleave(BLOCK, 1)
    return _quantise(xf, full)[:R], s


def dequant_rows(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return q.float() * s


def dequant_tiles(q: torch.Tensor, s: torch.Tensor, square: bool) -> torch.Tensor:
    full = s.repeat_interleave(BLOCK, 1)
    if square:
        full = full.repeat_interleave(BLOCK, 0)
    return q.float() * full[: q.shape[0], : q.shape[1]]


def rowwise_mm_ref(qa, sa, qb, sb, n: int | None = None) -> torch.Tensor:
    """fp32 ``(qa·sa) @ (qb·sb)ᵀ``, trimmed to ``n`` columns: what ``torch._scaled_mm`` computes
    with row-wise scales (up to its accumulation order)."""
    out = dequant_rows(qa, sa) @ dequant_rows(qb, sb).t()
    return out if n is None else out[:, :n]


def block_scaled_mm_ref(qa, sa, qb, sb, *, b_square: bool, n: int | None = None) -> torch.Tensor:
    """fp32 ``(qa·sa) @ (qb·sb)ᵀ`` with qa in 1x128 tiles and qb in 128x128 blocks or 1x128 tiles."""
    out = dequant_tiles(qa, sa, False) @ dequant_tiles(qb, sb, b_square).t()
    return out if n is None else out[:, :n]


__all__ = [
    "block_scaled_mm_ref", "scale_of", "dequant_rows", "dequant_tiles", "quant_rows_ref", "quant_tiles_ref", "rowwise_mm_ref",
]
