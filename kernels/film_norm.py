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
- backward: persistent. A grid of as many programs as the GPU holds at once (from the compiled kernel's registers;
  a few per SM), each owning a contiguous range of rows of about equal size, walks its range R whole rows at a
  time (``BLOCK_D`` ≥ D columns in registers, :func:`_bwd_shape`). It reads each row of ``dz`` and ``h`` once (plus
  ``mean, rstd, seg`` per row) and writes ``dh`` once: ``x̂`` is recomputed from the saved statistics and the row
  sums ``mean(g·x̂), mean(g)`` (``g = dz·(1+γ)·w``) come from the registers. LayerNorm's weight and bias gradients
  accumulate in registers over the whole range and are written once per program (fp32 ``[programs, D]``
  partials, summed after). Because the rows of a sample are consecutive, the per-sample sums ``Σ dz·x̂`` and ``Σ dz``
  of the current sample also stay in registers (``dγ = w·Σ dz·x̂ + b·Σ dz``, ``dβ = Σ dz``) and go out as one
  vector atomic add (relaxed) to ``dγ, dβ`` (fp32 ``[B, D]``) when the sample ends or the range does; a step whose
  rows are not all of the current sample (a sample boundary, samples shorter than R) takes ``1+γ`` per row and
  does these sums row by row (its rows reloaded from L1/L2), flushing at each change of sample. Only a range's
  first and last sample can be shared with a neighbouring program, so there are about ``B + programs`` vector
  atomics per call, against one pair per 16 rows and 128 columns before (measured on an H100 at 61k rows of
  width 1,024, bf16: 0.16 ms against 1.0 ms, about 2.3 TB/s of the bytes it must move). ``HAS_FILM=False``
  compiles both kernels without ``γ, β`` and ``seg``: a plain LayerNorm (:func:`layer_norm`). What is not asked
  for is not computed: ``dγ, dβ`` (``FILM_GRAD``) and ``dw, db`` (``PARAM_GRAD``) follow ``needs_input_grad``.

The per-sample sums use atomic adds, so ``dγ, dβ`` are not bit-reproducible from run to run (the order of
additions varies); everything else is on a given GPU (``dw, db`` are sums over per-program partials, and the
number of programs depends on the GPU and the compiled kernel). Rows past the last sample (a CUDA graph's
padding, ``segment_ids`` ``padded``) take the last sample's ``γ, β`` as the PyTorch path does; their gradients are
zeros there.

On CPU the kernels run in Triton's interpreter for tests; the trainer uses them on CUDA with the Triton
attention backend, outside ``torch.compile`` (a compiled layer keeps the PyTorch expression, which Inductor
fuses itself). The cost model prices this op as one LayerNorm (``costmodel.flops`` ``film_fused``).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from .fp8_triton import sm_count, cdiv, launch_kernel

BLOCK_M = 16
"""Forward: rows per program."""
BLOCK_K = 128
"""Forward: columns per chunk."""
NUM_WARPS = 4
"""Forward: warps per program."""
BWD_ELEMENTS_PER_THREAD = {True: 32, False: 16}
"""Backward, with FiLM and without: elements of each [R, BLOCK_D] tile a thread holds (R = this · 32 · num_warps /
BLOCK_D rows a step)."""
BWD_PROGRAMS_PER_SM = 0
"""Backward: persistent programs per streaming multiprocessor on CUDA; 0: as many as fit at once (from the compiled
kernel's registers, warps and shared memory), so that every program starts in the first wave."""
INTERPRET_PROGRAMS = 4
"""Backward: programs in Triton's interpreter (few, so that small tests cross program boundaries)."""


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
    HAS_W: tl.constexpr, HAS_B: tl.constexpr, HAS_FILM: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """out = x̂·w + b, then (HAS_FILM) ·(1+γ[seg]) + β[seg]; saves mean, rstd per row."""
    pid = tl.program_id(0)
    rows = (pid * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    rmask = rows < M
    mean, m2 = _stats(h_ptr, rows, rmask, D, stride_h, BLOCK_M, BLOCK_K)
    rstd = 1.0 / tl.sqrt_rn(m2 / D + eps)
    tl.store(mean_ptr + rows, mean, mask=rmask)
    tl.store(rstd_ptr + rows, rstd, mask=rmask)
    if HAS_FILM:
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
        if HAS_FILM:
            gam = tl.load(g_ptr + s[:, None] * stride_g + cols[None, :], mask=m, other=0.0).to(tl.float32)
            bet = tl.load(be_ptr + s[:, None] * stride_be + cols[None, :], mask=m, other=0.0).to(tl.float32)
            y = y * (1.0 + gam) + bet
        tl.store(out_ptr + rows[:, None] * stride_o + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=m)


@triton.jit
def _film_ln_bwd_kernel(
    dz_ptr, h_ptr, w_ptr, b_ptr, g_ptr, seg_ptr, mean_ptr, rstd_ptr, dh_ptr, pw_ptr, pb_ptr, dg_ptr, dbe_ptr,
    M, D, rows_per_prog, stride_dz, stride_h, stride_dh, stride_g,
    HAS_W: tl.constexpr, HAS_B: tl.constexpr, HAS_FILM: tl.constexpr, FILM_GRAD: tl.constexpr,
    PARAM_GRAD: tl.constexpr, BLOCK_D: tl.constexpr, R: tl.constexpr,
):
    """Persistent: rows [pid·rows_per_prog, +rows_per_prog) ∩ [0, M), R whole rows (BLOCK_D ≥ D columns) a step.

    y = x̂·w + b, out = y·(1+γ) + β (without HAS_FILM: out = y, γ = 0). dy = dz·(1+γ), g = dy·w;
    dh = rstd·(g − x̂·mean(g·x̂) − mean(g)); dw, db: Σ dy·x̂, Σ dy over the program's rows (PARAM_GRAD), one
    partial row per program; dγ[s] += Σ dz·y = w·Σ dz·x̂ + b·Σ dz, dβ[s] += Σ dz (FILM_GRAD): Σ dz·x̂ and Σ dz are
    accumulated in registers while the rows stay in the current sample ``cur`` (within it 1+γ is one vector, so
    dw, db take (1+γ)·Σ dz·x̂, (1+γ)·Σ dz) and added atomically when the sample changes and at the end. A step that
    is not all of sample ``cur`` ("mixed") gathers 1+γ per row for dh and does the sums row by row after dh is
    stored (its [R, BLOCK_D] values dead by then: fewer live registers)."""
    pid = tl.program_id(0)
    row_start = pid * rows_per_prog
    row_end = tl.minimum(row_start + rows_per_prog, M)
    cols = tl.arange(0, BLOCK_D)
    cmask = cols < D
    if HAS_W:
        w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    else:
        w = tl.where(cmask, 1.0, 0.0)
    if HAS_B:
        b = tl.load(b_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    else:
        b = tl.zeros([BLOCK_D], dtype=tl.float32)
    acc_w = tl.zeros([BLOCK_D], dtype=tl.float32)  # Σ dy·x̂ over the program's rows
    acc_b = tl.zeros([BLOCK_D], dtype=tl.float32)  # Σ dy
    # Σ dz·x̂ and Σ dz over the rows of sample cur since its last flush: dγ[cur] += w·s1 + b·s0, dβ[cur] += s0
    acc_s1 = tl.zeros([BLOCK_D], dtype=tl.float32)
    acc_s0 = tl.zeros([BLOCK_D], dtype=tl.float32)
    if HAS_FILM:
        cur = tl.load(seg_ptr + row_start).to(tl.int64)  # the current sample (programs start at a row < M)
        opg = 1.0 + tl.load(g_ptr + cur * stride_g + cols, mask=cmask, other=0.0).to(tl.float32)  # its 1 + γ
    for r0 in range(row_start, row_end, R):
        rows = r0 + tl.arange(0, R)
        rmask = rows < row_end
        rows = rows.to(tl.int64)
        m = rmask[:, None] & cmask[None, :]
        x = tl.load(h_ptr + rows[:, None] * stride_h + cols[None, :], mask=m, other=0.0).to(tl.float32)
        dz = tl.load(dz_ptr + rows[:, None] * stride_dz + cols[None, :], mask=m, other=0.0).to(tl.float32)
        mean = tl.load(mean_ptr + rows, mask=rmask, other=0.0)
        rstd = tl.load(rstd_ptr + rows, mask=rmask, other=0.0)
        xhat = tl.where(m, (x - mean[:, None]) * rstd[:, None], 0.0)
        if HAS_FILM:
            s = tl.load(seg_ptr + rows, mask=rmask, other=0).to(tl.int64)
            mixed = tl.sum((rmask & (s != cur)).to(tl.int32), axis=0) != 0
            if mixed:
                # the step meets other samples: 1 + γ per row here, the sums row by row below
                gam = tl.load(g_ptr + s[:, None] * stride_g + cols[None, :], mask=m, other=0.0).to(tl.float32)
                g = dz * (1.0 + gam) * w[None, :]
            else:
                # every row of the step is of sample cur (the common case: samples are long): 1 + γ is one vector
                g = dz * (opg * w)[None, :]
                if PARAM_GRAD or FILM_GRAD:
                    s1 = tl.sum(dz * xhat, axis=0)
                    s0 = tl.sum(dz, axis=0)
                    if PARAM_GRAD:
                        acc_w += opg * s1
                        acc_b += opg * s0
                    if FILM_GRAD:
                        acc_s1 += s1
                        acc_s0 += s0
        else:
            g = dz * w[None, :]
            if PARAM_GRAD:
                acc_w += tl.sum(dz * xhat, axis=0)
                acc_b += tl.sum(dz, axis=0)
        c1 = tl.sum(g * xhat, axis=1) / D
        c2 = tl.sum(g, axis=1) / D
        dh = (g - xhat * c1[:, None] - c2[:, None]) * rstd[:, None]
        tl.store(dh_ptr + rows[:, None] * stride_dh + cols[None, :], dh.to(dh_ptr.dtype.element_ty), mask=m)
        if HAS_FILM:
            if mixed:
                if PARAM_GRAD or FILM_GRAD:
                    # a mixed step's sums row by row (the rows reloaded: L1/L2 hits, and rare), after its tile is
                    # done with; the sample accumulators are flushed wherever the sample changes
                    for row in range(r0, tl.minimum(r0 + R, row_end)):
                        s_row = tl.load(seg_ptr + row).to(tl.int64)
                        if s_row != cur:
                            if FILM_GRAD:
                                tl.atomic_add(dg_ptr + cur * D + cols, w * acc_s1 + b * acc_s0, mask=cmask,
                                              sem="relaxed")
                                tl.atomic_add(dbe_ptr + cur * D + cols, acc_s0, mask=cmask, sem="relaxed")
                                acc_s1 = tl.zeros([BLOCK_D], dtype=tl.float32)
                                acc_s0 = tl.zeros([BLOCK_D], dtype=tl.float32)
                            cur = s_row
                            opg = 1.0 + tl.load(g_ptr + cur * stride_g + cols, mask=cmask, other=0.0).to(tl.float32)
                        row64 = tl.cast(row, tl.int64)
                        dz_r = tl.load(dz_ptr + row64 * stride_dz + cols, mask=cmask, other=0.0).to(tl.float32)
                        x_r = tl.load(h_ptr + row64 * stride_h + cols, mask=cmask, other=0.0).to(tl.float32)
                        xhat_r = (x_r - tl.load(mean_ptr + row64)) * tl.load(rstd_ptr + row64)
                        s1_r = dz_r * tl.where(cmask, xhat_r, 0.0)
                        if PARAM_GRAD:
                            acc_w += opg * s1_r
                            acc_b += opg * dz_r
                        if FILM_GRAD:
                            acc_s1 += s1_r
                            acc_s0 += dz_r
                else:
                    cur = tl.load(seg_ptr + tl.minimum(r0 + R, row_end) - 1).to(tl.int64)
                    opg = 1.0 + tl.load(g_ptr + cur * stride_g + cols, mask=cmask, other=0.0).to(tl.float32)
    if PARAM_GRAD:
        tl.store(pw_ptr + pid * D + cols, acc_w, mask=cmask)
        tl.store(pb_ptr + pid * D + cols, acc_b, mask=cmask)
    if FILM_GRAD:
        tl.atomic_add(dg_ptr + cur * D + cols, w * acc_s1 + b * acc_s0, mask=cmask, sem="relaxed")
        tl.atomic_add(dbe_ptr + cur * D + cols, acc_s0, mask=cmask, sem="relaxed")


class FilmInputError(ValueError):
    """An input of :func:`film_layer_norm` or :func:`layer_norm` is malformed: the message names it and the fix."""


def _check_affine(fn: str, D: int, weight: Tensor | None, bias: Tensor | None) -> None:
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and (t.dim() != 1 or t.numel() != D):
            raise FilmInputError(f"{fn}: {name} must have {D} elements, got shape {tuple(t.shape)}")


def _check_devices(fn: str, *tensors: Tensor | None) -> None:
    devices = {t.device for t in tensors if t is not None}
    if len(devices) != 1:
        raise FilmInputError(f"{fn}: inputs on several devices {sorted(map(str, devices))}")


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
    _check_affine("film_layer_norm", D, weight, bias)
    if seg.dim() != 1 or seg.numel() != M or seg.dtype not in (torch.int32, torch.int64):
        raise FilmInputError(f"film_layer_norm: seg must be int32/int64 [{M}] (each row's sample), got "
                             f"{seg.dtype} shape {tuple(seg.shape)}")
    _check_devices("film_layer_norm", h, gamma, beta, seg, weight, bias)


def _next_power_of_2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def _bwd_shape(D: int, film: bool = True) -> tuple[int, int, int]:
    """``(BLOCK_D, R, num_warps)`` of the backward at width ``D``: whole rows (``BLOCK_D``, the next power of two
    ≥ D, at least 16), a warp per 256 columns (8 consecutive columns of a row per thread: 16-byte bf16 accesses;
    1 to 16 warps) and R rows a step such that a thread holds ``BWD_ELEMENTS_PER_THREAD[film]`` elements of a tile
    (with FiLM R = 4 from 256 to 2,048 columns, more below; without, half that; 1 from 4,096). Measured on an H100
    (bf16, 20-260k rows, widths 96-4,096): two warps at 512 columns ran 1.8x faster than four; 32 elements a
    thread with FiLM and 16 without were best or within a few per cent of the best of 16, 32 and 64."""
    block_d = max(16, _next_power_of_2(D))
    warps = min(16, max(1, block_d // 256))
    # from 4,096 columns one row a step: 16 warps leave 128 registers a thread, which R = 2 overflows with FiLM
    r = 1 if block_d >= 4096 else max(1, BWD_ELEMENTS_PER_THREAD[film] * 32 * warps // block_d)
    return block_d, r, warps


def _bwd_ranges(M: int, r: int, programs: int) -> tuple[int, int]:
    """At most ``programs`` contiguous row ranges of about equal size, a multiple of ``r`` rows (the last may be
    shorter), none empty: ``(programs, rows_per_program)``."""
    steps = max(1, cdiv(M, r))
    per = cdiv(steps, max(1, min(programs, steps))) * r
    return cdiv(M, per), per


def _bwd_plan(M: int, D: int, device: torch.device, per_sm: int | None = None,
              film: bool = True) -> tuple[int, int, int, int, int]:
    """The backward's launch for ``M ≥ 1`` rows of width ``D``: ``(BLOCK_D, R, num_warps, programs,
    rows_per_program)`` (:func:`_bwd_shape`, :func:`_bwd_ranges`); ``per_sm`` programs per SM on CUDA (default
    ``BWD_PROGRAMS_PER_SM``, else 2), ``INTERPRET_PROGRAMS`` elsewhere."""
    block_d, r, warps = _bwd_shape(D, film)
    if device.type == "cuda":
        want = (per_sm or BWD_PROGRAMS_PER_SM or 2) * sm_count(device)
    else:
        want = INTERPRET_PROGRAMS
    return (block_d, r, warps, *_bwd_ranges(M, r, want))


_RESIDENT: dict[tuple, int] = {}


def _resident_programs(args: tuple, consts: dict, warps: int, device: torch.device) -> int:
    """How many programs of the backward kernel (this specialisation) an SM holds at once: registers, warps and
    shared memory of the compiled kernel against the SM's. Compiles it ahead on first use (cached); 2 if Triton's
    compiled-kernel attributes are not what this expects. A persistent grid of more programs than fit runs a
    second, partial wave (measured on an H100: ~20% slower at 3 programs per SM where 2 fit)."""
    key = (device.index, warps, tuple(sorted(consts.items())), tuple(a.dtype if isinstance(a, Tensor) else None
                                                                        for a in args))
    n = _RESIDENT.get(key)
    if n is None:
        n = 2
        try:
            ck = _film_ln_bwd_kernel.warmup(*args, grid=(1,), **consts, num_warps=warps)
            ck._init_handles()
            props = torch.cuda.get_device_properties(device)
            regs = getattr(props, "regs_per_multiprocessor", 65536)
            max_warps = getattr(props, "max_threads_per_multi_processor", 2048) // 32
            smem = getattr(props, "shared_memory_per_multiprocessor", 233472)
            per_warp = -(-max(int(ck.n_regs), 1) * 32 // 256) * 256  # registers are allocated per warp, by 256
            by_smem = smem // (int(ck.metadata.shared) + 1024)  # (1 KiB a block reserved by CUDA)
            n = max(1, min(regs // (per_warp * warps), max_warps // warps, by_smem, 32))
        except Exception:  # noqa: BLE001  (an older/newer Triton: keep the default)
            pass
        _RESIDENT[key] = n
    return n


class _FilmLayerNorm(torch.autograd.Function):
    """``h [T, D]`` contiguous-able; ``gamma, beta, seg`` all ``None`` for a plain LayerNorm."""

    @staticmethod
    def forward(ctx, h, weight, bias, gamma, beta, seg, eps):  # type: ignore[override]
        film = gamma is not None
        h = h.contiguous()
        weight = weight.contiguous() if weight is not None else None
        bias = bias.contiguous() if bias is not None else None
        if film:
            seg = seg.contiguous()
        M, D = h.shape
        out = torch.empty_like(h)
        mean = torch.empty(M, device=h.device, dtype=torch.float32)
        rstd = torch.empty(M, device=h.device, dtype=torch.float32)
        if M:
            launch_kernel(_film_ln_fwd_kernel, (cdiv(M, BLOCK_M),),
                          (h, weight if weight is not None else h, bias if bias is not None else h,
                           gamma if film else h, beta if film else h, seg if film else h,
                           out, mean, rstd, M, D, h.stride(0), out.stride(0),
                           gamma.stride(0) if film else 0, beta.stride(0) if film else 0, float(eps)),
                          dict(HAS_W=weight is not None, HAS_B=bias is not None, HAS_FILM=film, BLOCK_M=BLOCK_M,
                               BLOCK_K=BLOCK_K),
                          NUM_WARPS)
        ctx.save_for_backward(h, weight, bias, gamma, seg, mean, rstd)
        ctx.beta_dtype = beta.dtype if film else None
        return out

    @staticmethod
    def backward(ctx, dz):  # type: ignore[override]
        h, weight, bias, gamma, seg, mean, rstd = ctx.saved_tensors
        need = ctx.needs_input_grad
        film = gamma is not None
        film_grad = film and (need[3] or need[4])
        want_w = weight is not None and need[1]
        want_b = bias is not None and need[2]
        dz = dz.contiguous()
        M, D = h.shape
        dh = torch.empty_like(h)
        f32 = dict(device=h.device, dtype=torch.float32)
        param_grad = want_w or want_b
        if M:
            block_d, r, warps = _bwd_shape(D, film)
            consts = dict(HAS_W=weight is not None, HAS_B=bias is not None, HAS_FILM=film, FILM_GRAD=film_grad,
                          PARAM_GRAD=param_grad, BLOCK_D=block_d, R=r)
            per_sm = BWD_PROGRAMS_PER_SM
            if h.is_cuda and not per_sm:
                probe = (dz, h, weight if weight is not None else h, bias if bias is not None else h,
                         gamma if film else h, seg if film else h, mean, rstd, dh, mean, mean, mean, mean,
                         M, D, r, dz.stride(0), h.stride(0), dh.stride(0), gamma.stride(0) if film else 0)
                per_sm = _resident_programs(probe, consts, warps, h.device)
            programs, per = _bwd_plan(M, D, h.device, per_sm, film)[3:]
        else:
            programs = 0
        # dw, db: fp32 partial sums [programs, D] each, summed here; dγ, dβ: fp32 [B, D] the kernel adds into
        parts = torch.empty(2, programs, D, **f32) if param_grad else None
        dg = torch.zeros(gamma.shape[0], D, **f32) if film_grad else None
        dbe = torch.zeros(gamma.shape[0], D, **f32) if film_grad else None
        if M:
            launch_kernel(_film_ln_bwd_kernel, (programs,),
                          (dz, h, weight if weight is not None else h, bias if bias is not None else h,
                           gamma if film else h, seg if film else h, mean, rstd, dh,
                           parts[0] if param_grad else mean, parts[1] if param_grad else mean,  # (fp32 placeholders)
                           dg if film_grad else mean, dbe if film_grad else mean,
                           M, D, per, dz.stride(0), h.stride(0), dh.stride(0), gamma.stride(0) if film else 0),
                          consts, warps)
        dw = parts[0].sum(0).to(weight.dtype) if want_w else None
        db = parts[1].sum(0).to(bias.dtype) if want_b else None
        dgamma = dg.to(gamma.dtype) if film_grad and need[3] else None
        dbeta = dbe.to(ctx.beta_dtype) if film_grad and need[4] else None
        return dh if need[0] else None, dw, db, dgamma, dbeta, None, None


def film_layer_norm(h: Tensor, weight: Tensor | None, bias: Tensor | None, gamma: Tensor, beta: Tensor, seg: Tensor,
                    eps: float = 1e-5, *, validate: bool = True) -> Tensor:
    """``F.layer_norm(h, (D,), weight, bias, eps) * (1 + gamma[seg]) + beta[seg]`` for ``h [T, D]``, per-sample
    ``gamma, beta [B, D]`` (row stride free: ``chunk``'s halves are fine) and ``seg [T]``, each row's sample
    (sorted, as :func:`coplan.trainer.model.layers.segment_ids` gives), in one Triton kernel forward and one
    backward. Differentiable in ``h``, ``weight``, ``bias``, ``gamma`` and ``beta``; output in ``h``'s dtype
    (computed in fp32, rounded once).

    ``validate``: also check that every ``seg`` value names a row of ``gamma`` (``0 <= seg < B``; the kernels index
    ``gamma`` and ``beta`` by it unchecked), which reads ``seg``'s extremes back to the host: one device sync. Skipped
    while a CUDA graph is captured or under ``torch.compile``; the trainer, whose ``seg`` comes from
    :func:`coplan.trainer.model.layers.segment_ids`, passes False."""
    _check(h, weight, bias, gamma, beta, seg)
    if validate and seg.numel() and not torch.compiler.is_compiling() and not (
            seg.is_cuda and torch.cuda.is_current_stream_capturing()):
        lo, hi = (int(v) for v in torch.aminmax(seg))
        if lo < 0 or hi >= gamma.shape[0]:
            raise FilmInputError(f"film_layer_norm: seg values must name a sample row of gamma/beta (0 to "
                                 f"{gamma.shape[0] - 1}); got values from {lo} to {hi}. seg is each row's sample index, "
                                 "as segment_ids(offsets, tokens) gives")
    return _FilmLayerNorm.apply(h, weight, bias, gamma, beta, seg, eps)


def layer_norm(h: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float = 1e-5) -> Tensor:
    """``F.layer_norm(h, (D,), weight, bias, eps)`` over the last dimension of ``h [..., D]`` (leading dimensions
    flattened into rows), with the same kernels as :func:`film_layer_norm` without the modulation: one Triton
    kernel forward, one backward. Differentiable in ``h``, ``weight`` and ``bias``; output in ``h``'s dtype
    (computed in fp32, rounded once)."""
    if h.dim() < 1:
        raise FilmInputError("layer_norm: h must be [..., width], got a 0-d tensor; give it a width dimension")
    D = h.shape[-1]
    _check_affine("layer_norm", D, weight, bias)
    _check_devices("layer_norm", h, weight, bias)
    out = _FilmLayerNorm.apply(h.reshape(math.prod(h.shape[:-1]), D), weight, bias, None, None, None, eps)
    return out.view(h.shape)


def film_layer_norm_reference(h: Tensor, weight: Tensor | None, bias: Tensor | None, gamma: Tensor, beta: Tensor,
                              seg: Tensor, eps: float = 1e-5) -> Tensor:
    """The same in PyTorch (fp32 throughout, for tests)."""
    y = torch.nn.functional.layer_norm(h.float(), (h.shape[1],), None if weight is None else weight.float(),
                                       None if bias is None else bias.float(), eps)
    return y * (1.0 + gamma.float()[seg]) + beta.float()[seg]


__all__ = ["FilmInputError", "film_layer_norm", "film_layer_norm_reference", "layer_norm"]
