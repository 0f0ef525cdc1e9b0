"""Triton kernels for FP8 (e4m3) training GEMMs: the quantisation passes of both recipes and the
block-scaled GEMM of the DeepSeek-V3-style recipe.

Every GEMM of a linear layer is written here in one "NT" form, ``A[M, K] @ B[N, K]ᵀ``, with both
operands quantised along their contraction axis K: forward ``x · Wᵀ``, input gradient
``dY · (Wᵀ)ᵀ``, weight gradient ``dYᵀ · (Xᵀ)ᵀ``. The quantisation kernels read any strided view (a
transposed operand is read in place, never copied first) and write a row-major fp8 copy whose K is
zero-padded to the kernel's granule, so the GEMM needs no K masks and a padded zero changes neither
an amax nor a product.

- :func:`quant_rows`: one scale per row over all of K (the row-wise recipe, for ``torch._scaled_mm``).
- :func:`quant_tiles`: one scale per 1x128 tile (activations and gradients) or per 128x128 block
  (weights) of the block-wise recipe.
- :func:`block_scaled_mm`: ``A @ Bᵀ`` with A in 1x128 tiles and B in 128x128 blocks or 1x128
  tiles; each 128-wide K step's fp32 product is scaled and added to an fp32 accumulator (the
  "promotion" DeepSeek-V3 does to bound the tensor cores' limited accumulation precision).

Scales are dequantisation scales (``x ≈ q · s``), fp32, ``s = amax / 448`` (e4m3's largest
normal). Autotuning is keyed on the previous power of two of M, and on N and K.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl
import triton.testing

from .common import timed_bench
from .fp8_rules import scaled_mm_block_refusal

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
BLOCK = 128
"""Side of a scaling tile / block, the GEMM's K step."""
# An all-zero row or tile gets this amax so that its scale is positive and 0 / s stays 0.
AMAX_FLOOR = 1e-12


# Read once: `triton.jit` reads TRITON_INTERPRET when this module's kernels are decorated, so a
# later change of the variable would not change how they run anyway; and reading os.environ on
# every call cost ~70 µs of host time per fp8 linear forward + backward (18 calls).
_INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (tests without a GPU)."""
    return _INTERPRETING


def cdiv(a: int, b: int) -> int:
    """Ceiling division on the host: ``triton.cdiv`` is a JIT function in Triton 3.6+, whose Python
    call costs ~10 µs, several times per fp8 linear call."""
    return -(-a // b)


def prev_power_of_2(n: int) -> int:
    return 1 << (max(int(n), 1).bit_length() - 1)


def padded(n: int, granule: int) -> int:
    return -(-n // granule) * granule


# --------------------------------------------------------------------------------------------
# Quantisation
# --------------------------------------------------------------------------------------------


@triton.jit
def _quant_rows_kernel(
    x_ptr, q_ptr, s_ptr, R, C, C_PAD, stride_xr, stride_xc,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """Rows [pid·BLOCK_R, +BLOCK_R) of x: amax over all C, then q = x / s written with zero padding
    up to C_PAD. Two reads of the rows: a row of a GEMM operand (K ≤ tens of thousands) does not
    fit in registers, and a second read hits L2 for the row block just read. One program per row
    block: used where there are enough row blocks to fill the GPU (see :func:`quant_rows`)."""
    pid = tl.program_id(0)
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < R
    amax = tl.zeros([BLOCK_R], dtype=tl.float32)
    for c0 in range(0, C, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        m = rmask[:, None] & (cols[None, :] < C)
        v = tl.load(x_ptr + rows[:, None] * stride_xr + cols[None, :] * stride_xc, mask=m, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.max(tl.abs(v), axis=1))
    # IEEE-rounded divisions: Triton's fp32 `/` is the approximate (2-ulp) `div.full.f32` on NVIDIA
    # GPUs (triton-lang/triton#10661), which made the scale differ from PyTorch's `amax / 448` in
    # the last bit (and q with it); the interpreter's `/` is IEEE, so only the GPU showed it.
    scale = tl.math.div_rn(tl.maximum(amax, 1e-12), tl.full([BLOCK_R], 448.0, tl.float32))
    inv = tl.math.div_rn(tl.full([BLOCK_R], 1.0, tl.float32), scale)
    tl.store(s_ptr + rows, scale, mask=rmask)
    for c0 in range(0, C_PAD, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        m = rmask[:, None] & (cols[None, :] < C)
        v = tl.load(x_ptr + rows[:, None] * stride_xr + cols[None, :] * stride_xc, mask=m, other=0.0).to(tl.float32)
        q = tl.minimum(tl.maximum(v * inv[:, None], -448.0), 448.0)
        tl.store(q_ptr + rows[:, None] * C_PAD + cols[None, :], q.to(q_ptr.dtype.element_ty),
                 mask=rmask[:, None] & (cols[None, :] < C_PAD))


@triton.jit
def _amax_rows_partial_kernel(
    x_ptr, p_ptr, R, C, stride_xr, stride_xc,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, STEPS: tl.constexpr,
):
    """Partial row amax of x over columns [pid_c·STEPS·BLOCK_C, +STEPS·BLOCK_C) into p[pid_c, rows]:
    the first pass of the split row-wise quantisation (a 2-D grid, so that a long K, e.g. the
    tokens of the weight gradient's operands, is spread over the whole GPU)."""
    pid_c = tl.program_id(0)  # the long axis on the grid's first dimension (no 65,535 limit)
    pid_r = tl.program_id(1)
    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < R
    amax = tl.zeros([BLOCK_R], dtype=tl.float32)
    for i in range(STEPS):
        cols = (pid_c * STEPS + i) * BLOCK_C + tl.arange(0, BLOCK_C)
        m = rmask[:, None] & (cols[None, :] < C)
        v = tl.load(x_ptr + rows[:, None] * stride_xr + cols[None, :] * stride_xc, mask=m, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.max(tl.abs(v), axis=1))
    tl.store(p_ptr + pid_c * R + rows, amax, mask=rmask)


@triton.jit
def _rows_scale_kernel(p_ptr, s_ptr, inv_ptr, R, N_C, BLOCK_R: tl.constexpr):
    """Max of the partial amaxes p[:, rows], then s = max(amax, floor) / 448 and 1 / s, IEEE-rounded."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < R
    amax = tl.zeros([BLOCK_R], dtype=tl.float32)
    for c in range(0, N_C):
        amax = tl.maximum(amax, tl.load(p_ptr + c * R + rows, mask=rmask, other=0.0))
    scale = tl.math.div_rn(tl.maximum(amax, 1e-12), tl.full([BLOCK_R], 448.0, tl.float32))
    tl.store(s_ptr + rows, scale, mask=rmask)
    tl.store(inv_ptr + rows, tl.math.div_rn(tl.full([BLOCK_R], 1.0, tl.float32), scale), mask=rmask)


@triton.jit
def _quant_rows_apply_kernel(
    x_ptr, q_ptr, inv_ptr, R, C, C_PAD, stride_xr, stride_xc,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """One [BLOCK_R, BLOCK_C] tile of q = clamp(x · inv_row, ±448), zero past C up to C_PAD: the
    second pass of the split row-wise quantisation."""
    pid_c = tl.program_id(0)
    pid_r = tl.program_id(1)
    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    rmask = rows < R
    inv = tl.load(inv_ptr + rows, mask=rmask, other=0.0)
    m = rmask[:, None] & (cols[None, :] < C)
    v = tl.load(x_ptr + rows[:, None] * stride_xr + cols[None, :] * stride_xc, mask=m, other=0.0).to(tl.float32)
    q = tl.minimum(tl.maximum(v * inv[:, None], -448.0), 448.0)
    tl.store(q_ptr + rows[:, None] * C_PAD + cols[None, :], q.to(q_ptr.dtype.element_ty),
             mask=rmask[:, None] & (cols[None, :] < C_PAD))


@triton.jit
def _quant_tiles_kernel(
    x_ptr, q_ptr, s_ptr, R, C, C_PAD, stride_xr, stride_xc, stride_sr,
    BLOCK_R: tl.constexpr, GROUP: tl.constexpr, SQUARE: tl.constexpr,
):
    """One [BLOCK_R, GROUP] tile of x: a scale per row of the tile (SQUARE=False, 1xGROUP tiles) or
    one for the whole tile (SQUARE=True, BLOCK_R = GROUP, GROUPxGROUP blocks)."""
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = pid_c * GROUP + tl.arange(0, GROUP)
    rmask = rows < R
    m = rmask[:, None] & (cols[None, :] < C)
    v = tl.load(x_ptr + rows[:, None] * stride_xr + cols[None, :] * stride_xc, mask=m, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(v), axis=1)
    if SQUARE:
        scale = tl.math.div_rn(tl.maximum(tl.max(amax, axis=0), 1e-12), 448.0)  # IEEE, as PyTorch
        q = tl.minimum(tl.maximum(v * tl.math.div_rn(1.0, scale), -448.0), 448.0)
        tl.store(s_ptr + pid_r * stride_sr + pid_c, scale)
    else:
        scale = tl.math.div_rn(tl.maximum(amax, 1e-12), tl.full([BLOCK_R], 448.0, tl.float32))
        q = tl.minimum(tl.maximum(v * tl.math.div_rn(tl.full([BLOCK_R], 1.0, tl.float32), scale)[:, None], -448.0), 448.0)
        tl.store(s_ptr + rows * stride_sr + pid_c, scale, mask=rmask)
    tl.store(q_ptr + rows[:, None] * C_PAD + cols[None, :], q.to(q_ptr.dtype.element_ty), mask=rmask[:, None])


@triton.jit
def _quant_dual_kernel(
    x_ptr, q_ptr, s_ptr, qt_ptr, st_ptr,
    R, C, Q_ROWS, QT_ROWS, C_PAD, R_PAD, stride_xr, stride_xc,
    stride_sr, stride_sk, stride_str, stride_stk,
    SQUARE: tl.constexpr, WITH_T: tl.constexpr, BLOCK: tl.constexpr,
):
    """One BLOCK x BLOCK tile of x [R, C], read once, written as up to two fp8 copies:

    - q [Q_ROWS, C_PAD] row-major, quantised along C: a scale per row of the tile (1 x BLOCK tiles)
      or, SQUARE, one scale for the whole tile (BLOCK x BLOCK blocks);
    - if WITH_T, qt [QT_ROWS, R_PAD] row-major = the transpose, quantised along R: a scale per
      column of the tile (its 1 x BLOCK tiles along R) or, SQUARE, the same block scale.

    The block-wise recipe's operands are local in both directions, so the weight gradient's
    operands (dYᵀ, xᵀ, tiled along the tokens) come out of the same read as the forward's / the input
    gradient's, with no global column amax. Rows/columns past R/C (up to the copies' padding) are
    zeros with a positive scale, so a padded row or K step adds nothing to a product."""
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    rows = pid_r * BLOCK + tl.arange(0, BLOCK)
    cols = pid_c * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(x_ptr + rows[:, None] * stride_xr + cols[None, :] * stride_xc,
                mask=(rows[:, None] < R) & (cols[None, :] < C), other=0.0).to(tl.float32)
    a = tl.abs(v)
    q_mask = (rows[:, None] < Q_ROWS) & (cols[None, :] < C_PAD)
    qt_mask = (cols[:, None] < QT_ROWS) & (rows[None, :] < R_PAD)
    if SQUARE:
        scale = tl.math.div_rn(tl.maximum(tl.max(tl.max(a, axis=1), axis=0), 1e-12), 448.0)  # IEEE, as PyTorch
        q = tl.minimum(tl.maximum(v * tl.math.div_rn(1.0, scale), -448.0), 448.0)
        tl.store(s_ptr + pid_r * stride_sr + pid_c * stride_sk, scale)
        tl.store(q_ptr + rows[:, None] * C_PAD + cols[None, :], q.to(q_ptr.dtype.element_ty), mask=q_mask)
        if WITH_T:
            # Wᵀ from a transposed re-read of the tile (cache-hot), not from tl.trans(q): compiled
            # by Triton 3.6 on the H200, storing tl.trans of the tile whose fp8 copy is also stored
            # wrote wrong values into Wᵀ (rows of one repeated value; the interpreter was right),
            # and every block-wise input gradient with it. A plain load/scale/store has no
            # layout conversion to get wrong; the weight is small, so the second read is cheap.
            vt = tl.load(x_ptr + cols[:, None] * stride_xc + rows[None, :] * stride_xr,
                         mask=(cols[:, None] < C) & (rows[None, :] < R), other=0.0).to(tl.float32)
            qt = tl.minimum(tl.maximum(vt * tl.math.div_rn(1.0, scale), -448.0), 448.0)
            tl.store(st_ptr + pid_c * stride_str + pid_r * stride_stk, scale)
            tl.store(qt_ptr + cols[:, None] * R_PAD + rows[None, :], qt.to(qt_ptr.dtype.element_ty), mask=qt_mask)
    else:
        s_row = tl.math.div_rn(tl.maximum(tl.max(a, axis=1), 1e-12), tl.full([BLOCK], 448.0, tl.float32))
        q = tl.minimum(tl.maximum(v * tl.math.div_rn(tl.full([BLOCK], 1.0, tl.float32), s_row)[:, None], -448.0), 448.0)
        tl.store(s_ptr + rows * stride_sr + pid_c * stride_sk, s_row, mask=rows < Q_ROWS)
        tl.store(q_ptr + rows[:, None] * C_PAD + cols[None, :], q.to(q_ptr.dtype.element_ty), mask=q_mask)
        if WITH_T:
            s_col = tl.math.div_rn(tl.maximum(tl.max(a, axis=0), 1e-12), tl.full([BLOCK], 448.0, tl.float32))
            qt = tl.minimum(tl.maximum(v * tl.math.div_rn(tl.full([BLOCK], 1.0, tl.float32), s_col)[None, :], -448.0), 448.0)
            tl.store(st_ptr + cols * stride_str + pid_r * stride_stk, s_col, mask=cols < QT_ROWS)
            tl.store(qt_ptr + cols[:, None] * R_PAD + rows[None, :], tl.trans(qt).to(qt_ptr.dtype.element_ty), mask=qt_mask)


# --------------------------------------------------------------------------------------------
# Direct launches
# --------------------------------------------------------------------------------------------
#
# `kernel[grid](...)` runs Triton's JIT dispatch on every call: it binds the arguments, computes
# their specialisation, builds a cache key from it and the options, and checks the kernel's
# globals; an fp8 linear layer launches 4-12 of these kernels per forward + backward, so on a
# device-bound step (the 17:12 H200 run: fp8 step 85 ms against 72 ms of kernel time) that host
# work shows. As in kernels/triton_attention.py, the compiled kernel the JIT path returned is kept
# and later calls with the same specialisation call its launcher directly. The key here is the
# specialisation *class* of every argument, the same that Triton computes (an int: 1, or i32/i64
# and whether it is a multiple of 16; a tensor: dtype and 16-byte alignment; checked against
# Triton's own specialisation by a test), not the exact values: the token count changes every
# step, and a key on values would miss every time. Profiler launch hooks, the interpreter or
# COPLAN_FP8_DIRECT_LAUNCH=0 take the JIT path.

DIRECT_LAUNCH = not interpreting() and os.environ.get("COPLAN_FP8_DIRECT_LAUNCH", "1") != "0"
_DIRECT: dict[tuple, tuple] = {}
_DIRECT_LIMIT = 256
DIRECT_STATS = {"direct": 0, "jit": 0}
"""Launches by path since import (benchmarks report them)."""


def spec_class(a):
    """What Triton specialises a kernel argument on (see the comment above)."""
    if isinstance(a, torch.Tensor):
        return (a.dtype, a.data_ptr() % 16 == 0)
    if isinstance(a, bool):
        return ("b", a)
    if isinstance(a, int):
        return 1 if a == 1 else (-(2**31) <= a < 2**31, a % 16 == 0)
    if isinstance(a, float):
        return "f"
    raise TypeError(f"no direct launch for an argument of type {type(a).__name__}")


def _device_and_stream(t: torch.Tensor) -> tuple[int, int]:
    device = t.device.index if t.device.index is not None else torch.cuda.current_device()
    try:
        return device, torch._C._cuda_getCurrentRawStream(device)
    except AttributeError:  # private name gone in another torch
        return device, torch.cuda.current_stream(device).cuda_stream


def _launch_hooks_set() -> bool:
    runtime = triton.knobs.runtime
    return any(getattr(h, "calls", h) for h in (runtime.launch_enter_hook, runtime.launch_exit_hook))


def launch_kernel(kernel, grid: tuple, args: tuple, consts: dict, num_warps: int) -> None:
    """``kernel[grid](*args, **consts, num_warps=num_warps)``, directly where a compiled kernel of
    the same specialisation is known. ``args``: every non-constexpr argument, in signature order;
    ``consts``: every constexpr one (they follow the others in these kernels' signatures)."""
    global DIRECT_LAUNCH
    key = None
    if DIRECT_LAUNCH and args[0].is_cuda:
        try:
            device, stream = _device_and_stream(args[0])
            key = (id(kernel), device, num_warps, tuple(consts.items()), tuple(spec_class(a) for a in args))
        except Exception:  # noqa: BLE001  (an unexpected argument: this call takes the JIT path)
            key = None
        hit = _DIRECT.get(key) if key is not None else None
        if hit is not None and not _launch_hooks_set():
            ck, tail = hit
            g1 = grid[1] if len(grid) > 1 else 1
            g2 = grid[2] if len(grid) > 2 else 1
            ck.run(grid[0], g1, g2, stream, ck.function, ck.packed_metadata, None, None, None, *args, *tail)
            DIRECT_STATS["direct"] += 1
            return
    ck = kernel[grid](*args, **consts, num_warps=num_warps)
    DIRECT_STATS["jit"] += 1
    if key is not None and ck is not None:
        try:
            tail = tuple(consts[p.name] for p in kernel.params[len(args):])
            ck.function, ck.packed_metadata, ck.run  # noqa: B018  (the attributes a direct launch uses)
            if len(_DIRECT) >= _DIRECT_LIMIT:
                _DIRECT.clear()
            _DIRECT[key] = (ck, tail)
        except Exception:  # noqa: BLE001  (another Triton's kernel object: keep the JIT path)
            DIRECT_LAUNCH = False


def store_dtype(out_dtype: torch.dtype) -> torch.dtype:
    """What the quantisation kernels store. Triton's CPU interpreter rounds fp32 -> e4m3 wrongly
    when the rounding carries into the exponent (124.3 -> 64 instead of 128), so under the
    interpreter the kernels store the scaled, clamped values in fp32 and PyTorch's cast rounds them
    (`.to(e4m3)` below is a no-op on the GPU, where the kernels store e4m3 directly)."""
    return torch.float32 if interpreting() else out_dtype


INT32_LIMIT = 2**31


def check_2d(x: torch.Tensor, name: str) -> None:
    if x.dim() != 2:
        raise ValueError(f"{name}: expected a 2-D tensor, got shape {tuple(x.shape)}")
    # The kernels compute element offsets in int32 (row x stride): past 2^31 they would wrap and
    # read or write the wrong elements silently. Padded copies add < 128 per dimension.
    R, C = x.shape
    reach = (R + BLOCK) * max(abs(x.stride(0)), 1) + (C + BLOCK) * max(abs(x.stride(1)), 1)
    if max(reach, (R + BLOCK) * (C + BLOCK)) >= INT32_LIMIT:
        raise ValueError(f"{name}: a {R} x {C} operand (strides {tuple(x.stride())}) has offsets past 2^31, which the "
                         f"fp8 kernels' int32 offsets cannot address; split the tokens into smaller batches")


_SMS: dict[int, int] = {}


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device, read once (get_device_properties is per call)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    n = _SMS.get(index)
    if n is None:
        n = _SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return n


def _split_rows(x: torch.Tensor, R: int, C: int) -> bool:
    """Whether the row-wise quantisation takes the split (two-pass, 2-D grid) path: when one program
    per row block would leave most SMs idle while each walks a long row. That is the weight
    gradient's operands dYᵀ and Xᵀ (R = features, C = tokens): with one program per 64 rows, a
    4096 x 61,000 operand ran on 64 programs, each reading 8 MB twice with one 8 KB tile in flight
    (latency-bound): 88 ms of `_quant_rows_kernel` per gem-h200 step on the H200, the whole
    slowdown of the fp8 arm. Also the input gradient's transposed weight (e.g. 1024 x 4096 on 16
    programs). The split costs a few small extra launches (~20 µs of host), so short rows keep the
    single pass."""
    if interpreting() or not x.is_cuda:
        return False
    block_r = 4 if x.stride(1) == 1 else 64
    sms = sm_count(x.device)
    return cdiv(R, block_r) < 2 * sms and C >= 2048


def _quant_rows_split(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, R: int, C: int, c_pad: int) -> None:
    """Row-wise quantisation in two passes over a 2-D grid: partial amax per column chunk (Triton),
    their max and the scale in PyTorch (the same IEEE ``amax / 448`` and ``1 / s`` as the
    reference), then the quantisation of every tile (Triton)."""
    if x.stride(1) == 1 and not interpreting():
        block_r, block_c = 8, 256
    else:  # a transposed view (rows contiguous) or the interpreter: square-ish tiles
        block_r, block_c = (16, 32) if interpreting() else (64, 64)
    steps = 1 if interpreting() else 8
    n_c = cdiv(C, block_c * steps)
    part = torch.empty(n_c, R, device=x.device, dtype=torch.float32)
    launch_kernel(_amax_rows_partial_kernel, (n_c, cdiv(R, block_r)), (x, part, R, C, x.stride(0), x.stride(1)),
            dict(BLOCK_R=block_r, BLOCK_C=block_c, STEPS=steps), 4)
    # The scale in a kernel, not in PyTorch: on CUDA, PyTorch's `tensor / 448.0` multiplies by the
    # rounded reciprocal of the Python scalar (amax · (1/448)), 1 ulp off the IEEE quotient in ~40%
    # of rows (the H200 run failed here); the reference and every kernel divide, IEEE-rounded.
    inv = torch.empty(R, device=x.device, dtype=torch.float32)
    launch_kernel(_rows_scale_kernel, (cdiv(R, 128),), (part, s, inv, R, n_c), dict(BLOCK_R=128), 4)
    launch_kernel(_quant_rows_apply_kernel, (cdiv(c_pad, block_c), cdiv(R, block_r)),
            (x, q, inv, R, C, c_pad, x.stride(0), x.stride(1)), dict(BLOCK_R=block_r, BLOCK_C=block_c), 4)


def quant_rows(
    x: torch.Tensor, granule: int = 16, rows_granule: int = 1, out_dtype: torch.dtype = E4M3,
    split: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Row-wise e4m3 quantisation of a 2-D view (any strides): ``q [R, C]`` row-major and fp32 scales
    ``[R, 1]``, with C zero-padded to ``granule`` and R to ``rows_granule`` (padding rows: q = 0,
    s = 1). ``granule=16`` is ``torch._scaled_mm``'s alignment of K (and of N, for the B operand).
    ``split``: force (True) or forbid (False) the two-pass path for long rows; None picks it on the
    GPU where a program per row block would underfill the GPU (see :func:`_split_rows`)."""
    check_2d(x, "quant_rows")
    R, C = x.shape
    c_pad, r_pad = padded(C, granule), padded(R, rows_granule)
    q = torch.empty(r_pad, c_pad, device=x.device, dtype=store_dtype(out_dtype))
    s = torch.empty(r_pad, 1, device=x.device, dtype=torch.float32)
    if r_pad > R:
        q[R:].view(torch.uint8).zero_()
        s[R:] = 1.0
    if R == 0:
        return q.to(out_dtype), s
    if split is None:
        split = _split_rows(x, R, C)
    if split:
        _quant_rows_split(x, q, s, R, C, c_pad)
        return q.to(out_dtype), s
    if interpreting():
        block_r, block_c = 16, 32
    elif x.stride(1) == 1:
        block_r, block_c = 4, 512
    else:  # a transposed view: tall tiles so that each column's read is a contiguous run
        block_r, block_c = 64, 64
    launch_kernel(_quant_rows_kernel, (cdiv(R, block_r),), (x, q, s, R, C, c_pad, x.stride(0), x.stride(1)),
            dict(BLOCK_R=block_r, BLOCK_C=block_c), 4)
    return q.to(out_dtype), s


def quant_tiles(x: torch.Tensor, square: bool, out_dtype: torch.dtype = E4M3) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-wise e4m3 quantisation of a 2-D view (any strides) into ``q [R, C padded to 128]``
    row-major and fp32 scales: ``[R, C/128]`` for 1x128 tiles (``square=False``) or
    ``[R/128, C/128]`` (rounded up) for 128x128 blocks (``square=True``)."""
    check_2d(x, "quant_tiles")
    R, C = x.shape
    c_pad = padded(C, BLOCK)
    kb = c_pad // BLOCK
    q = torch.empty(R, c_pad, device=x.device, dtype=store_dtype(out_dtype))
    s_rows = cdiv(R, BLOCK) if square else R
    s = torch.empty(s_rows, kb, device=x.device, dtype=torch.float32)
    if R == 0:
        return q.to(out_dtype), s
    block_r = BLOCK if square else (16 if interpreting() else (32 if x.stride(1) == 1 else 64))
    grid = (cdiv(R, block_r), kb)
    launch_kernel(_quant_tiles_kernel, grid, (x, q, s, R, C, c_pad, x.stride(0), x.stride(1), s.stride(0)),
            dict(BLOCK_R=block_r, GROUP=BLOCK, SQUARE=square), 8 if square else 4)
    return q.to(out_dtype), s


class DualQuant(NamedTuple):
    """The fp8 copies of one operand of the block-wise recipe (see :func:`quant_act_dual`,
    :func:`quant_weight_dual`); ``qt`` / ``st`` are None when the transpose was not asked for."""

    q: torch.Tensor
    s: torch.Tensor
    qt: torch.Tensor | None
    st: torch.Tensor | None


def _dual(x: torch.Tensor, square: bool, with_t: bool, q_rows: int, qt_rows: int,
          s: torch.Tensor, st: torch.Tensor | None) -> DualQuant:
    R, C = x.shape
    c_pad, r_pad = padded(C, BLOCK), padded(R, BLOCK)
    dt = store_dtype(E4M3)
    q = torch.empty(q_rows, c_pad, device=x.device, dtype=dt)
    qt = torch.empty(qt_rows, r_pad, device=x.device, dtype=dt) if with_t else None
    if r_pad and c_pad and x.device.type != "meta":  # meta: shapes and layouts only (tests)
        st_arg = st if st is not None else s
        launch_kernel(_quant_dual_kernel, (r_pad // BLOCK, c_pad // BLOCK),
                (x, q, s, qt if qt is not None else q, st_arg, R, C, q_rows, qt_rows, c_pad, r_pad,
                 x.stride(0), x.stride(1), s.stride(0), s.stride(1), st_arg.stride(0), st_arg.stride(1)),
                dict(SQUARE=square, WITH_T=with_t, BLOCK=BLOCK), 8)
    return DualQuant(q.to(E4M3), s, qt.to(E4M3) if qt is not None else None, st)


def quant_act_dual(x: torch.Tensor, with_t: bool, t_rows_granule: int = 16) -> DualQuant:
    """An activation or output gradient ``x [R, C]`` (any strides) in 1x128 tiles, in one read:
    ``q [R, C→128]`` with scales ``s [R, C/128]``, and (``with_t``) its transpose ``qt [C→16, R→128]``
    with scales ``st [C→16, R/128]`` (tiles along R: the tokens, for the weight gradient).

    Scales are stored "outer-dim-major" (``s.stride() == (1, R)``), the layout ``torch._scaled_mm``'s
    block-wise path takes for a 1x128 operand; ``qt``'s rows are padded to ``t_rows_granule``
    (``_scaled_mm`` needs the B operand's N a multiple of 16) with zeros."""
    check_2d(x, "quant_act_dual")
    R, C = x.shape
    kb, rb = padded(C, BLOCK) // BLOCK, padded(R, BLOCK) // BLOCK
    qt_rows = padded(C, t_rows_granule)
    s = torch.empty(kb, R, device=x.device, dtype=torch.float32).t()
    st = torch.empty(rb, qt_rows, device=x.device, dtype=torch.float32).t() if with_t else None
    return _dual(x, False, with_t, R, qt_rows, s, st)


def quant_weight_dual(w: torch.Tensor, with_t: bool, rows_granule: int = 16) -> DualQuant:
    """A weight ``w [N, K]`` (any strides) in 128x128 blocks, in one read: ``q [N→16, K→128]`` and
    (``with_t``) ``qt = wᵀ`` as ``[K→16, N→128]``; one block scale serves both (``s [N/128, K/128]``,
    ``st = sᵀ``). Both scale tensors are contiguous: ``torch._scaled_mm`` checks a 128x128
    operand's scales for strides ``(K/128, 1)`` exactly (its error message's "16-byte aligned
    strides" notwithstanding): the round-1 buffers, padded to 4 columns, were rejected at every K
    that is not a multiple of 512 (K = 1216, 256, ...) on the H200."""
    check_2d(w, "quant_weight_dual")
    N, K = w.shape
    nb, kb = padded(N, BLOCK) // BLOCK, padded(K, BLOCK) // BLOCK
    s = torch.empty(nb, kb, device=w.device, dtype=torch.float32)
    st = torch.empty(kb, nb, device=w.device, dtype=torch.float32) if with_t else None
    return _dual(w, True, with_t, padded(N, rows_granule), padded(K, rows_granule), s, st)


# --------------------------------------------------------------------------------------------
# Block-scaled GEMM
# --------------------------------------------------------------------------------------------


def _gemm_configs() -> list[triton.Config]:
    if interpreting():
        return [triton.Config({"BLOCK_M": 16, "BLOCK_N": 32}, num_warps=4, num_stages=1)]
    # The K step is pinned to the 128-wide scaling granule; tiles and pipelining vary.
    return [
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=warps, num_stages=stages)
        for bm, bn, warps, stages in [
            (128, 128, 8, 3), (128, 128, 4, 4), (64, 128, 4, 4), (128, 256, 8, 3), (64, 64, 4, 4),
        ]
    ]


def _prune(configs, named_args, **kwargs):
    """Tiles far larger than the problem only add masked work: keep those that fit M and N (or the smallest)."""
    m, n = named_args["M"], named_args["N"]
    kept = [c for c in configs if c.kwargs["BLOCK_M"] <= max(64, m) and c.kwargs["BLOCK_N"] <= max(64, n)]
    return kept or configs[-1:]


def _quick_bench(kernel_call, quantiles):
    # Autotuning runs once per (M bucket, N, K) and the default 25 + 100 ms per config would
    # dominate a short run; a 20 ms window ranks tile configs well enough.
    return triton.testing.do_bench(kernel_call, warmup=5, rep=20, quantiles=quantiles)


@triton.autotune(configs=_gemm_configs(), key=["M_BUCKET", "N", "K_PAD", "B_SQUARE", "HAS_BIAS"],
                 prune_configs_by={"early_config_prune": _prune}, do_bench=timed_bench(_quick_bench), cache_results=True)
@triton.jit
def _block_scaled_mm_kernel(
    a_ptr, b_ptr, c_ptr, as_ptr, bs_ptr, bias_ptr,
    M, N, K_PAD, M_BUCKET,  # M_BUCKET: autotune key only
    stride_am, stride_bn, stride_cm, stride_asm, stride_ask, stride_bsn, stride_bsk,
    B_SQUARE: tl.constexpr, HAS_BIAS: tl.constexpr, GROUP_M: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # Programs go down GROUP_M row blocks before moving to the next column block, so that the
    # B tiles (and A rows) a wave of programs reads stay in L2.
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mmask = offs_m < M
    nmask = offs_n < N
    a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :]
    # B is [N, K] row-major; its tile is read as [BLOCK_K, BLOCK_N] with K contiguous (K-major),
    # the operand layout Hopper's fp8 tensor-core instructions take.
    b_ptrs = b_ptr + offs_n[None, :] * stride_bn + offs_k[:, None]
    as_ptrs = as_ptr + offs_m * stride_asm
    if B_SQUARE:
        bs_ptrs = bs_ptr + (offs_n // BLOCK_K) * stride_bsn
    else:
        bs_ptrs = bs_ptr + offs_n * stride_bsn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for kb in range(0, K_PAD // BLOCK_K):
        a = tl.load(a_ptrs, mask=mmask[:, None], other=0.0)
        b = tl.load(b_ptrs, mask=nmask[None, :], other=0.0)
        sa = tl.load(as_ptrs + kb * stride_ask, mask=mmask, other=0.0)
        sb = tl.load(bs_ptrs + kb * stride_bsk, mask=nmask, other=0.0)
        acc += tl.dot(a, b) * sa[:, None] * sb[None, :]
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=nmask, other=0.0).to(tl.float32)[None, :]
    c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mmask[:, None] & nmask[None, :])


def block_scaled_mm(
    qa: torch.Tensor, sa: torch.Tensor, qb: torch.Tensor, sb: torch.Tensor, *, n: int | None = None,
    b_square: bool, bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """``(qa·sa) @ (qb·sb)ᵀ`` → ``[M, n]`` in ``out_dtype``: qa ``[M, Kp]`` with 1x128 scales ``sa [M, Kp/128]``;
    qb ``[N, Kp]`` with 128x128 scales ``sb [N/128, Kp/128]`` (``b_square``) or 1x128 ``[N, Kp/128]``.
    ``n`` trims B's rows (default: all)."""
    M, k_pad = qa.shape
    N = qb.shape[0] if n is None else n
    if qb.shape[1] != k_pad or k_pad % BLOCK:
        raise ValueError(f"block_scaled_mm: K of A {k_pad} and of B {qb.shape[1]} must agree and be a multiple of {BLOCK}")
    c = torch.empty(M, N, device=qa.device, dtype=out_dtype)
    if M == 0 or N == 0:
        return c
    if k_pad == 0:
        return c.zero_() if bias is None else c.copy_(bias.to(out_dtype).expand(M, N))

    def grid(meta):
        return (cdiv(M, meta["BLOCK_M"]) * cdiv(N, meta["BLOCK_N"]),)

    _block_scaled_mm_kernel[grid](
        qa, qb, c, sa, sb, bias if bias is not None else c,
        M, N, k_pad, prev_power_of_2(M),
        qa.stride(0), qb.stride(0), c.stride(0), sa.stride(0), sa.stride(1), sb.stride(0), sb.stride(1),
        B_SQUARE=b_square, HAS_BIAS=bias is not None, GROUP_M=8, BLOCK_K=BLOCK)
    return c


# --------------------------------------------------------------------------------------------
# Block-scaled GEMM through torch._scaled_mm (cuBLAS), where this PyTorch has it
# --------------------------------------------------------------------------------------------

# (kind, out dtype) -> 0: torch._scaled_mm's block-wise path works here; -1: it raised on first
# use (a build or GPU without it), use the Triton GEMM. The scales are always handed over in the
# layouts PyTorch's check asks for (scaled_mm_scales_ok), so a later failure is a real error.
_SCALED_MM_BLOCK: dict[tuple[str, torch.dtype], int] = {}
SCALED_MM_BLOCK_ERRORS: dict[tuple[str, torch.dtype], str] = {}
"""Why ``torch._scaled_mm`` was not used for a (kind, out dtype), for benchmarks to report."""


def scaled_mm_scales_ok(rows: int, cols: int, scale: torch.Tensor, square: bool) -> bool:
    """Whether ``scale`` is laid out as ``torch._scaled_mm``'s block-wise path checks it for an
    operand of ``rows x cols`` (quantised along cols), as PyTorch 2.9-2.13 test it: 1x128 tiles
    ``[rows, cols/128]`` with strides ``(1, rows)`` (outer-dim-major); 128x128 blocks
    ``[rows/128, cols/128]`` with strides ``(cols/128, 1)`` exactly (contiguous). A dimension of
    size 1 may have any stride. For B, PyTorch checks ``scale_b.t()`` against ``b.t()``."""
    kb = -(-cols // BLOCK)
    want = ((-(-rows // BLOCK), kb), (kb, 1)) if square else ((rows, kb), (1, rows))
    (shape, strides) = want
    if tuple(scale.shape) != shape:
        return False
    return all(n <= 1 or st == w for n, st, w in zip(scale.shape, scale.stride(), strides))


def _cublas_scales(qa: torch.Tensor, sa: torch.Tensor, qb: torch.Tensor, sb: torch.Tensor, b_square: bool):
    """``scale_a`` and ``scale_b`` for ``torch._scaled_mm(qa, qb.t(), ...)``: this module's own
    buffers as they are (quant_act_dual / quant_weight_dual write them in cuBLAS's layouts, so no
    copy per call), else a copy in that layout (e.g. the scales of :func:`quant_tiles`)."""
    if not scaled_mm_scales_ok(qa.shape[0], qa.shape[1], sa, square=False):
        sa = sa.t().contiguous().t()
    if not scaled_mm_scales_ok(qb.shape[0], qb.shape[1], sb, square=b_square):
        sb = sb.contiguous() if b_square else sb.t().contiguous().t()
    return sa, sb.t()


def scaled_mm_block_kind(b_square: bool) -> str:
    return "1x128_128x128" if b_square else "1x128_1x128"


def block_mm(
    qa: torch.Tensor, sa: torch.Tensor, qb: torch.Tensor, sb: torch.Tensor, *, n: int, b_square: bool,
    out_dtype: torch.dtype, use_scaled_mm: bool = True,
) -> torch.Tensor:
    """``(qa·sa) @ (qb·sb)ᵀ`` → ``[M, n]``: by ``torch._scaled_mm``'s block-wise path (cuBLAS;
    1,274 TFLOP/s at 8192³ on the H200 against 654 for :func:`block_scaled_mm`) where this PyTorch
    and GPU take it and the shapes pass :func:`coplan.kernels.fp8_rules.scaled_mm_block_refusal`, else by
    the Triton kernel. ``qb``'s rows past ``n`` are padding (zeros)."""
    kind = (scaled_mm_block_kind(b_square), out_dtype)
    state = _SCALED_MM_BLOCK.get(kind)
    if use_scaled_mm and scaled_mm_block_refusal(qa.shape[0], qa.shape[1], qb.shape[0], b_square) is not None:
        use_scaled_mm = False  # cuBLAS would refuse it or, for 128x128 B, read the scales wrongly
    if use_scaled_mm and qa.is_cuda and state != -1 and qa.shape[0] > 0:
        a_s, b_s = _cublas_scales(qa, sa, qb, sb, b_square)
        try:
            out = torch._scaled_mm(qa, qb.t(), scale_a=a_s, scale_b=b_s, out_dtype=out_dtype)
        except (RuntimeError, ValueError, TypeError) as e:
            if state is not None:  # this path worked before with the same layouts: a real error
                raise
            # first call of this kind: this PyTorch/GPU lacks the path; the Triton GEMM from now on
            SCALED_MM_BLOCK_ERRORS[kind] = f"{type(e).__name__}: {str(e)[:300]}"
            _SCALED_MM_BLOCK[kind] = -1
        else:
            _SCALED_MM_BLOCK[kind] = 0
            # trimmed N padding copied, so that the op's output is not a view (FSDP2 warns on views)
            return out if out.shape[1] == n else out[:, :n].contiguous()
    return block_scaled_mm(qa, sa, qb, sb, n=n, b_square=b_square,
                           out_dtype=out_dtype if out_dtype != torch.float16 else torch.float32).to(out_dtype)


def block_mm_backend(b_square: bool, out_dtype: torch.dtype) -> str:
    """Which GEMM :func:`block_mm` used so far for this kind: 'scaled_mm', 'triton' or 'unprobed'."""
    v = _SCALED_MM_BLOCK.get((scaled_mm_block_kind(b_square), out_dtype))
    return "unprobed" if v is None else ("scaled_mm" if v >= 0 else "triton")


__all__ = [
    "BLOCK", "E4M3", "E4M3_MAX", "DualQuant", "block_mm", "block_mm_backend", "block_scaled_mm", "padded",
    "quant_act_dual", "quant_rows", "quant_tiles", "quant_weight_dual", "scaled_mm_scales_ok",
]
