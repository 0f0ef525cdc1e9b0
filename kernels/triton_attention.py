"""Triton kernels for jagged softmax attention and GDPA, forward and backward, and their launchers.

FlashAttention-2 style: a program owns one block of rows of one (sample, head) and streams the
other side's blocks of that sample through on-chip tiles, so nothing of size Lq x Lk reaches
memory. Softmax keeps an online max and sum and saves a base-2 log-sum-exp per row; GDPA needs no
normalisation. The backward is deterministic, without atomics: one kernel computes dQ (and the
softmax row term delta = rowsum(dO * O)), a second computes dK and dV per key block; both recompute
the scores, two matrix products more than one fused kernel adding dQ with atomics. That fused
kernel is not deterministic and was no faster on an H200 (GDPA-SiLU: 972 us against 527 + 375 us
for the pair on shape (a), 225 against 223 us on (b), before its dQ zeroing and cast;
benchmarks/results/attention_h200_atomic.json).

The grid holds one program per real block and head, found from cumulative block counts (no
programs for padding up to max_len). Samples are launched longest first (by q_len x k_len, for
batches up to 1,024 samples), and within a sample the heaviest block starts first (causal:
the query blocks that see the most keys; the dK/dV kernel numbers key blocks from the end of the
sample for the same reason). Autotuning is keyed on powers of two of batch size and maximum
lengths, so it runs once per bucket.
"""

from __future__ import annotations

import math
import operator
import os
import weakref

import torch
import triton
import triton.language as tl

from .common import Activation, next_power_of_2, prev_power_of_2, timed_bench

SOFTMAX = 0
ACTIVATION = 1

LOG2E = math.log2(math.e)


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (tests without a GPU)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


# --------------------------------------------------------------------------------------------
# Elementwise pieces
# --------------------------------------------------------------------------------------------


@triton.jit
def _tanh(x, FAST: tl.constexpr):
    if FAST:
        # One special-function-unit op instead of exp + reciprocal: SiLU and GELU would otherwise
        # take two per score, as many cycles as the two matrix products spend on it at d=128.
        # Its ~5e-4 relative error is under bf16/fp16 rounding of the probabilities fed to tl.dot.
        y = tl.inline_asm_elementwise(
            "tanh.approx.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True, pack=1
        )
    else:
        # tanh saturates to +-1 in fp32 beyond |x| = 9; clamping keeps exp finite.
        y = 1.0 - 2.0 / (tl.exp(2.0 * tl.minimum(tl.maximum(x, -15.0), 15.0)) + 1.0)
    return y


@triton.jit
def _log2(x, FAST: tl.constexpr):
    if FAST:
        # One special-function-unit op instead of libdevice's ~25-instruction log2f, per row in
        # the softmax epilogue (short samples run only a few key tiles per program). Its absolute
        # error (~2^-22) is far below what the backward's exp2(s - lse) can see; x = l >= 1 here
        # (the running max's own key contributes exp2(0) = 1), so no denormals.
        y = tl.inline_asm_elementwise("lg2.approx.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True, pack=1)
    else:
        y = tl.math.log2(x)
    return y


@triton.jit
def _activation(s, scale, ACT: tl.constexpr, FAST: tl.constexpr):
    """act(x) with x = scale * s, for the codes of `Activation.code`; the scale folds into the first multiply."""
    x = s * scale
    if ACT == 0:
        y = x
    elif ACT == 1:
        y = tl.maximum(x, 0.0)
    elif ACT == 2:
        r = tl.maximum(x, 0.0)
        y = r * r
    elif ACT == 3:
        # silu(x) = x * sigmoid(x) = h + h * tanh(h), h = x / 2
        h = s * (0.5 * scale)
        y = h + h * _tanh(h, FAST)
    else:
        # gelu_tanh(x) = h * (1 + tanh(sqrt(2/pi) * (x + 0.044715 x^3))), h = x / 2
        h = 0.5 * x
        u = x * (0.7978845608028654 + 0.035677408136300125 * x * x)
        y = h + h * _tanh(u, FAST)
    return y


@triton.jit
def _activation_and_grad(s, scale, ACT: tl.constexpr, FAST: tl.constexpr):
    """(act(x), act'(x)) with x = scale * s, sharing the one tanh both need."""
    x = s * scale
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
        h = s * (0.5 * scale)
        t = _tanh(h, FAST)
        y = h + h * t
        # sigmoid = (1 + t) / 2 and sigmoid * (1 - sigmoid) = (1 - t^2) / 4
        dy = 0.5 + 0.5 * t + 0.5 * h * (1.0 - t * t)
    else:
        h = 0.5 * x
        x2 = x * x
        t = _tanh(x * (0.7978845608028654 + 0.035677408136300125 * x2), FAST)
        y = h + h * t
        du = 0.7978845608028654 + 0.10703222440890037 * x2
        dy = 0.5 + 0.5 * t + h * (1.0 - t * t) * du
    return y, dy


# --------------------------------------------------------------------------------------------
# Program -> (sample, head, block)
# --------------------------------------------------------------------------------------------


@triton.jit
def _block_counts_kernel(q_offsets, k_offsets, CUM_Q, CUM_K, batch, CHUNK: tl.constexpr, SORT: tl.constexpr):
    """CUM[j, p] = blocks of 16 << j rows in the samples at positions 0..p-1 of the launch order, for
    queries and keys (j = 0..3); CUM[4, p] = the sample at position p (both tables hold it).

    One program: the tables are [5, batch + 1] and feed a binary search in every attention program.
    The launch order: with SORT (batch <= CHUNK), samples by descending q_len * k_len (ties by index),
    so that the longest-running blocks start in the first waves and the short ones fill the tail
    (longest-processing-time-first list scheduling); otherwise the batch order.
    """
    order_q = CUM_Q + 4 * (batch + 1)
    order_k = CUM_K + 4 * (batch + 1)
    if SORT:  # one chunk holds the whole batch
        idx = tl.arange(0, CHUNK)
        ok = idx < batch
        # (names of their own: a name assigned here and again in the counting loop below would be a
        #  loop-carried variable to the compiler, which refuses its change of type; the interpreter does not)
        rows_q = tl.load(q_offsets + idx + 1, mask=ok, other=0).to(tl.int64) - tl.load(q_offsets + idx, mask=ok, other=0).to(tl.int64)
        rows_k = tl.load(k_offsets + idx + 1, mask=ok, other=0).to(tl.int64) - tl.load(k_offsets + idx, mask=ok, other=0).to(tl.int64)
        # one int64 key per sample: its work in the high bits, (CHUNK - 1 - index) in the low 20
        key = tl.where(ok, (rows_q * rows_k) * 1048576 + (CHUNK - 1 - idx.to(tl.int64)), -1)
        key = tl.sort(key, 0, descending=True)
        order = tl.where(ok, (CHUNK - 1 - (key % 1048576)).to(tl.int32), 0)
        tl.store(order_q + idx, order, mask=idx <= batch)
        tl.store(order_k + idx, order, mask=idx <= batch)
    else:
        for start in range(0, batch + 1, CHUNK):
            idx = start + tl.arange(0, CHUNK)
            tl.store(order_q + idx, tl.where(idx < batch, idx, 0), mask=idx <= batch)
            tl.store(order_k + idx, tl.where(idx < batch, idx, 0), mask=idx <= batch)
    for j in tl.static_range(4):
        size = 16 << j
        row_q = CUM_Q + j * (batch + 1)
        row_k = CUM_K + j * (batch + 1)
        tl.store(row_q, 0)
        tl.store(row_k, 0)
        carry_q = tl.sum(tl.zeros([CHUNK], dtype=tl.int32), 0)
        carry_k = tl.sum(tl.zeros([CHUNK], dtype=tl.int32), 0)
        for start in range(0, batch, CHUNK):
            idx = start + tl.arange(0, CHUNK)
            ok = idx < batch
            if SORT:
                sample = order
            else:
                sample = idx
            q_len = (tl.load(q_offsets + sample + 1, mask=ok, other=0) - tl.load(q_offsets + sample, mask=ok, other=0)).to(tl.int32)
            k_len = (tl.load(k_offsets + sample + 1, mask=ok, other=0) - tl.load(k_offsets + sample, mask=ok, other=0)).to(tl.int32)
            n_q = (q_len + size - 1) // size
            n_k = (k_len + size - 1) // size
            tl.store(row_q + idx + 1, carry_q + tl.cumsum(n_q, 0), mask=ok)
            tl.store(row_k + idx + 1, carry_k + tl.cumsum(n_k, 0), mask=ok)
            carry_q += tl.sum(n_q, 0)
            carry_k += tl.sum(n_k, 0)


@triton.jit
def _locate(CUM, batch, num_heads, q_offsets, k_offsets, BLOCK: tl.constexpr):
    """This program's head, sample, block rank (rank < 0: no work) and the sample's offsets.

    The grid covers every real block of every sample once per head, from the cumulative block
    counts, so no program is launched for the padding up to max_len (a batch of short samples
    under a long cap would otherwise be mostly empty programs). Heads of one block are adjacent,
    and a sample's blocks run heaviest first (rank = n_blocks - 1 first), so that the blocks of one
    (sample, head) share its keys in L2 and its longest-running block starts early.
    """
    if BLOCK == 16:
        row = 0
    elif BLOCK == 32:
        row = 1
    elif BLOCK == 64:
        row = 2
    else:
        row = 3
    cum = CUM + row * (batch + 1)
    pid = tl.program_id(0)
    h = pid % num_heads
    i = pid // num_heads
    # Largest position p with cum[p] <= i: the sample at p owns block i (empty samples own none).
    lo = pid * 0
    hi = lo + batch
    while hi - lo > 1:
        mid = (lo + hi) // 2
        right = tl.load(cum + mid) <= i
        lo = tl.where(right, mid, lo)
        hi = tl.where(right, hi, mid)
    rank = tl.load(cum + lo + 1) - 1 - i  # n_blocks - 1 - (i - cum[p]); < 0 past the last block
    b = tl.load(CUM + 4 * (batch + 1) + lo, mask=rank >= 0, other=0)  # the sample at that position
    q_start = tl.load(q_offsets + b).to(tl.int64)
    q_len = (tl.load(q_offsets + b + 1) - q_start).to(tl.int32)
    k_start = tl.load(k_offsets + b).to(tl.int64)
    k_len = (tl.load(k_offsets + b + 1) - k_start).to(tl.int32)
    return rank, h, q_start, q_len, k_start, k_len


@triton.jit
def _key_range(m0, q_len, k_len, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """For query rows [m0, m0 + BLOCK_M): keys [0, full_end) every row sees, and the end of all seen.

    Bottom-right causal alignment: query i sees key j iff j <= i + (k_len - q_len).
    """
    if CAUSAL:
        diag = k_len - q_len
        hi = tl.minimum(k_len, m0 + BLOCK_M + diag)
        full_end = tl.minimum(k_len, m0 + diag + 1)
    else:
        hi = k_len
        full_end = k_len
    hi = tl.maximum(hi, 0)
    full_end = tl.maximum(full_end, 0) // BLOCK_N * BLOCK_N
    return full_end, hi


# --------------------------------------------------------------------------------------------
# Forward
# --------------------------------------------------------------------------------------------


@triton.jit
def _load_tile(ptrs, rows_ok, d_ok, ROWS: tl.constexpr, PAD_D: tl.constexpr):
    """A [rows, HEAD_DIM] tile: rows past ``rows_ok`` (ROWS) and columns past the real head dim (PAD_D,
    ``d_ok``) read as zeros, which leave every score and product unchanged: a head dim that is not a power of
    two runs without padded copies of its tensors."""
    if ROWS:
        if PAD_D:
            x = tl.load(ptrs, mask=rows_ok[:, None] & d_ok[None, :], other=0.0)
        else:
            x = tl.load(ptrs, mask=rows_ok[:, None], other=0.0)
    else:
        if PAD_D:
            x = tl.load(ptrs, mask=d_ok[None, :], other=0.0)
        else:
            x = tl.load(ptrs)
    return x


@triton.jit
def _store_tile(ptrs, x, rows_ok, d_ok, PAD_D: tl.constexpr):
    """Store a [rows, HEAD_DIM] tile's rows ``rows_ok`` and, with PAD_D, only the real head dim's columns."""
    if PAD_D:
        tl.store(ptrs, x, mask=rows_ok[:, None] & d_ok[None, :])
    else:
        tl.store(ptrs, x, mask=rows_ok[:, None])


@triton.jit
def _fwd_tiles(
    acc, m_i, l_i, q, k_base, v_base, stride_kt, stride_vt, offs_m, offs_d, d_ok, lo, hi, k_len, diag, qk_scale,
    MODE: tl.constexpr, ACT: tl.constexpr, CAUSAL: tl.constexpr, MASKED: tl.constexpr,
    FAST: tl.constexpr, PRECISION: tl.constexpr, BLOCK_N: tl.constexpr, PAD_D: tl.constexpr,
):
    """Key tiles [lo, hi), every one masked (MASKED) or none."""
    arange_n = tl.arange(0, BLOCK_N)
    for start in range(lo, hi, BLOCK_N):
        start = tl.multiple_of(start, BLOCK_N)
        offs_n = start + arange_n
        k_ptrs = k_base + offs_n[:, None] * stride_kt + offs_d[None, :]
        v_ptrs = v_base + offs_n[:, None] * stride_vt + offs_d[None, :]
        in_sample = offs_n < k_len
        k = _load_tile(k_ptrs, in_sample, d_ok, MASKED, PAD_D)
        v = _load_tile(v_ptrs, in_sample, d_ok, MASKED, PAD_D)
        if MASKED:
            if CAUSAL:
                # A query row of the sample (i < q_len) sees j <= i + k_len - q_len < k_len, so the
                # causal test alone also excludes keys past the sample; rows past q_len are never
                # stored (their keys load as zeros: finite scores). One compare per score, not two.
                mask = offs_n[None, :] <= offs_m[:, None] + diag
            else:
                mask = in_sample[None, :]
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        if MODE == 0:
            if MASKED:
                s = tl.where(mask, s, float("-inf"))
            # The running max is kept in scaled base-2 units; the scale (> 0) then folds into the
            # exponent's fused multiply-add below instead of a separate multiply per score.
            m_tile = tl.max(s, 1) * qk_scale
            m_new = tl.maximum(m_i, m_tile)
            if MASKED:
                # A row with no key seen yet keeps m = -inf; subtracting 0 instead keeps exp2 at 0.
                m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
            else:
                m_ref = m_new
            p = tl.math.exp2(s * qk_scale - m_ref[:, None])
            alpha = tl.math.exp2(m_i - m_ref)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None]
            m_i = m_new
        else:
            p = _activation(s, qk_scale, ACT, FAST)
            if MASKED:
                p = tl.where(mask, p, 0.0)
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=PRECISION)
    return acc, m_i, l_i


# Ints that change with every batch are not specialised on (== 1, divisible by 16), so that a new
# batch reuses the compiled kernel.
@triton.jit(do_not_specialize=["stride_lse_h", "batch", "BATCH_BUCKET", "MAX_Q_BUCKET", "MAX_K_BUCKET"])
def _fwd_kernel(
    Q, K, V, O, LSE, q_offsets, k_offsets, CUM_Q,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh, stride_lse_h,
    batch, num_heads, qk_scale, out_scale,
    BATCH_BUCKET, MAX_Q_BUCKET, MAX_K_BUCKET,  # autotune keys only
    MODE: tl.constexpr, ACT: tl.constexpr, CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, DIM: tl.constexpr, PAD_D: tl.constexpr,
    FAST: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    rank, h, q_start, q_len, k_start, k_len = _locate(CUM_Q, batch, num_heads, q_offsets, k_offsets, BLOCK_M)
    if rank < 0:
        return
    m0 = rank * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    d_ok = offs_d < DIM
    row_ok = offs_m < q_len
    q = _load_tile(Q + (q_start + offs_m[:, None]) * stride_qt + h * stride_qh + offs_d[None, :], row_ok, d_ok, True, PAD_D)
    k_base = K + k_start * stride_kt + h * stride_kh
    v_base = V + k_start * stride_vt + h * stride_vh

    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    diag = k_len - q_len
    full_end, hi = _key_range(m0, q_len, k_len, CAUSAL, BLOCK_M, BLOCK_N)
    # Two loops, so that the tiles every row sees in full skip the masks; the second masks the
    # causal diagonal and the sample's end.
    acc, m_i, l_i = _fwd_tiles(acc, m_i, l_i, q, k_base, v_base, stride_kt, stride_vt, offs_m, offs_d, d_ok, 0, full_end,
                               k_len, diag, qk_scale, MODE, ACT, CAUSAL, False, FAST, PRECISION, BLOCK_N, PAD_D)
    acc, m_i, l_i = _fwd_tiles(acc, m_i, l_i, q, k_base, v_base, stride_kt, stride_vt, offs_m, offs_d, d_ok, full_end, hi,
                               k_len, diag, qk_scale, MODE, ACT, CAUSAL, True, FAST, PRECISION, BLOCK_N, PAD_D)
    if MODE == 0:
        empty = l_i == 0.0
        l_safe = tl.where(empty, 1.0, l_i)
        # One division per row, then a multiply per element: a division per element is a
        # multi-instruction sequence, as many as one or two key tiles take on short samples.
        acc = acc * (1.0 / l_safe)[:, None]
        # +inf for a row that saw no key: the backward's exp2(s - lse) is then 0, not inf.
        lse = tl.where(empty, float("inf"), m_i + _log2(l_safe, FAST))
        tl.store(LSE + h * stride_lse_h + q_start + offs_m, lse, mask=row_ok)
    else:
        acc = acc * out_scale
    o_ptrs = O + (q_start + offs_m[:, None]) * stride_ot + h * stride_oh + offs_d[None, :]
    _store_tile(o_ptrs, acc.to(O.dtype.element_ty), row_ok, d_ok, PAD_D)


# --------------------------------------------------------------------------------------------
# Backward: dQ (and delta)
# --------------------------------------------------------------------------------------------


@triton.jit
def _dq_tiles(
    dq, q, do, lse, delta, k_base, v_base, stride_kt, stride_vt, offs_m, offs_d, d_ok, lo, hi, k_len, diag, qk_scale,
    MODE: tl.constexpr, ACT: tl.constexpr, CAUSAL: tl.constexpr, MASKED: tl.constexpr,
    FAST: tl.constexpr, PRECISION: tl.constexpr, BLOCK_N: tl.constexpr, PAD_D: tl.constexpr,
):
    arange_n = tl.arange(0, BLOCK_N)
    for start in range(lo, hi, BLOCK_N):
        start = tl.multiple_of(start, BLOCK_N)
        offs_n = start + arange_n
        k_ptrs = k_base + offs_n[:, None] * stride_kt + offs_d[None, :]
        v_ptrs = v_base + offs_n[:, None] * stride_vt + offs_d[None, :]
        in_sample = offs_n < k_len
        k = _load_tile(k_ptrs, in_sample, d_ok, MASKED, PAD_D)
        v = _load_tile(v_ptrs, in_sample, d_ok, MASKED, PAD_D)
        if MASKED:
            mask = in_sample[None, :]
            if CAUSAL:
                mask = mask & (offs_n[None, :] <= offs_m[:, None] + diag)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        if MODE == 0:
            p = tl.math.exp2(s * qk_scale - lse[:, None])
            if MASKED:
                p = tl.where(mask, p, 0.0)
            ds = p * (dp - delta[:, None])
        else:
            _, da = _activation_and_grad(s, qk_scale, ACT, FAST)
            ds = dp * da
            if MASKED:
                ds = tl.where(mask, ds, 0.0)
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=PRECISION)
    return dq


@triton.jit(do_not_specialize=["stride_lse_h", "batch", "BATCH_BUCKET", "MAX_Q_BUCKET", "MAX_K_BUCKET"])
def _bwd_dq_kernel(
    Q, K, V, O, DO, DQ, LSE, DELTA, q_offsets, k_offsets, CUM_Q,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    stride_dot, stride_doh, stride_dqt, stride_dqh, stride_lse_h,
    batch, num_heads, qk_scale, ds_scale,
    BATCH_BUCKET, MAX_Q_BUCKET, MAX_K_BUCKET,  # autotune keys only
    MODE: tl.constexpr, ACT: tl.constexpr, CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, DIM: tl.constexpr, PAD_D: tl.constexpr,
    FAST: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    rank, h, q_start, q_len, k_start, k_len = _locate(CUM_Q, batch, num_heads, q_offsets, k_offsets, BLOCK_M)
    if rank < 0:
        return
    m0 = rank * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    d_ok = offs_d < DIM
    row_ok = offs_m < q_len
    rows = q_start + offs_m
    q = _load_tile(Q + rows[:, None] * stride_qt + h * stride_qh + offs_d[None, :], row_ok, d_ok, True, PAD_D)
    do = _load_tile(DO + rows[:, None] * stride_dot + h * stride_doh + offs_d[None, :], row_ok, d_ok, True, PAD_D)
    if MODE == 0:
        o = _load_tile(O + rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :], row_ok, d_ok, True, PAD_D)
        delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
        # The dK/dV kernel, launched next, reads delta for every query block it visits.
        tl.store(DELTA + h * stride_lse_h + rows, delta, mask=row_ok)
        lse = tl.load(LSE + h * stride_lse_h + rows, mask=row_ok, other=float("inf"))
    else:
        delta = tl.zeros([BLOCK_M], dtype=tl.float32)
        lse = delta
    k_base = K + k_start * stride_kt + h * stride_kh
    v_base = V + k_start * stride_vt + h * stride_vh
    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    diag = k_len - q_len
    full_end, hi = _key_range(m0, q_len, k_len, CAUSAL, BLOCK_M, BLOCK_N)
    dq = _dq_tiles(dq, q, do, lse, delta, k_base, v_base, stride_kt, stride_vt, offs_m, offs_d, d_ok, 0, full_end,
                   k_len, diag, qk_scale, MODE, ACT, CAUSAL, False, FAST, PRECISION, BLOCK_N, PAD_D)
    dq = _dq_tiles(dq, q, do, lse, delta, k_base, v_base, stride_kt, stride_vt, offs_m, offs_d, d_ok, full_end, hi,
                   k_len, diag, qk_scale, MODE, ACT, CAUSAL, True, FAST, PRECISION, BLOCK_N, PAD_D)
    dq = dq * ds_scale
    _store_tile(DQ + rows[:, None] * stride_dqt + h * stride_dqh + offs_d[None, :], dq.to(DQ.dtype.element_ty), row_ok, d_ok,
                PAD_D)


# --------------------------------------------------------------------------------------------
# Backward: dK, dV
# --------------------------------------------------------------------------------------------


@triton.jit
def _dkdv_tiles(
    dk, dv, k, v, q_base, do_base, lse_base, delta_base, stride_qt, stride_dot, offs_n, offs_d, d_ok,
    t_lo, t_hi, q_len, diag, qk_scale,
    MODE: tl.constexpr, ACT: tl.constexpr, CAUSAL: tl.constexpr, MASKED: tl.constexpr,
    FAST: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, PAD_D: tl.constexpr,
):
    """Query blocks [t_lo, t_hi) against this program's key block."""
    arange_m = tl.arange(0, BLOCK_M)
    for t in range(t_lo, t_hi):
        # Query blocks are numbered from the end of the sample: block t holds rows
        # [q_len - (t + 1) * BLOCK_M, q_len - t * BLOCK_M), so the diagonal of a self-attention
        # falls on block edges and only the block at the sample's start can be partial.
        offs_m = q_len - (t + 1) * BLOCK_M + arange_m
        q_ptrs = q_base + offs_m[:, None] * stride_qt + offs_d[None, :]
        do_ptrs = do_base + offs_m[:, None] * stride_dot + offs_d[None, :]
        row_ok = offs_m >= 0
        q = _load_tile(q_ptrs, row_ok, d_ok, MASKED, PAD_D)
        do = _load_tile(do_ptrs, row_ok, d_ok, MASKED, PAD_D)
        if MASKED:
            maskT = row_ok[None, :]
            if CAUSAL:
                maskT = maskT & (offs_n[:, None] <= offs_m[None, :] + diag)
        sT = tl.dot(k, tl.trans(q), input_precision=PRECISION)
        dpT = tl.dot(v, tl.trans(do), input_precision=PRECISION)
        if MODE == 0:
            if MASKED:
                lse = tl.load(lse_base + offs_m, mask=row_ok, other=float("inf"))
                delta = tl.load(delta_base + offs_m, mask=row_ok, other=0.0)
            else:
                lse = tl.load(lse_base + offs_m)
                delta = tl.load(delta_base + offs_m)
            pT = tl.math.exp2(sT * qk_scale - lse[None, :])
            if MASKED:
                pT = tl.where(maskT, pT, 0.0)
            dsT = pT * (dpT - delta[None, :])
        else:
            pT, daT = _activation_and_grad(sT, qk_scale, ACT, FAST)
            if MASKED:
                pT = tl.where(maskT, pT, 0.0)
                daT = tl.where(maskT, daT, 0.0)
            dsT = dpT * daT
        dv = tl.dot(pT.to(do.dtype), do, dv, input_precision=PRECISION)
        dk = tl.dot(dsT.to(q.dtype), q, dk, input_precision=PRECISION)
    return dk, dv


@triton.jit(do_not_specialize=["stride_lse_h", "batch", "BATCH_BUCKET", "MAX_Q_BUCKET", "MAX_K_BUCKET"])
def _bwd_dkdv_kernel(
    Q, K, V, DO, DK, DV, LSE, DELTA, q_offsets, k_offsets, CUM_K,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_dot, stride_doh, stride_dkt, stride_dkh, stride_dvt, stride_dvh, stride_lse_h,
    batch, num_heads, qk_scale, dk_scale, dv_scale,
    BATCH_BUCKET, MAX_Q_BUCKET, MAX_K_BUCKET,  # autotune keys only
    MODE: tl.constexpr, ACT: tl.constexpr, CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, DIM: tl.constexpr, PAD_D: tl.constexpr,
    FAST: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    rank, h, q_start, q_len, k_start, k_len = _locate(CUM_K, batch, num_heads, q_offsets, k_offsets, BLOCK_N)
    if rank < 0:
        return
    # Key blocks are numbered from the end of the sample (rank 0 = last keys); under a causal
    # mask the first keys are seen by the most queries, so the heaviest blocks launch first.
    n_end = k_len - rank * BLOCK_N
    offs_n = n_end - BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    d_ok = offs_d < DIM
    key_ok = offs_n >= 0
    rows = k_start + offs_n
    k = _load_tile(K + rows[:, None] * stride_kt + h * stride_kh + offs_d[None, :], key_ok, d_ok, True, PAD_D)
    v = _load_tile(V + rows[:, None] * stride_vt + h * stride_vh + offs_d[None, :], key_ok, d_ok, True, PAD_D)

    # In positions counted from the end (i' = q_len-1-i, j' = k_len-1-j) the bottom-right causal
    # rule j <= i + diag reads i' <= j': this block holds j' in [rank*BN, (rank+1)*BN).
    n_q_blocks = tl.cdiv(q_len, BLOCK_M)
    if CAUSAL:
        t_hi = tl.minimum(n_q_blocks, ((rank + 1) * BLOCK_N - 1) // BLOCK_M + 1)
        t_full = tl.minimum((rank * BLOCK_N + 1) // BLOCK_M, q_len // BLOCK_M)
    else:
        t_hi = n_q_blocks
        t_full = q_len // BLOCK_M
    t_full = tl.minimum(t_full, t_hi)
    diag = k_len - q_len
    q_base = Q + q_start * stride_qt + h * stride_qh
    do_base = DO + q_start * stride_dot + h * stride_doh
    lse_base = LSE + h * stride_lse_h + q_start
    delta_base = DELTA + h * stride_lse_h + q_start
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dk, dv = _dkdv_tiles(dk, dv, k, v, q_base, do_base, lse_base, delta_base, stride_qt, stride_dot, offs_n, offs_d, d_ok,
                         0, t_full, q_len, diag, qk_scale, MODE, ACT, CAUSAL, False, FAST, PRECISION, BLOCK_M, PAD_D)
    dk, dv = _dkdv_tiles(dk, dv, k, v, q_base, do_base, lse_base, delta_base, stride_qt, stride_dot, offs_n, offs_d, d_ok,
                         t_full, t_hi, q_len, diag, qk_scale, MODE, ACT, CAUSAL, True, FAST, PRECISION, BLOCK_M, PAD_D)
    dk = dk * dk_scale
    dv = dv * dv_scale
    _store_tile(DK + rows[:, None] * stride_dkt + h * stride_dkh + offs_d[None, :], dk.to(DK.dtype.element_ty), key_ok, d_ok, PAD_D)
    _store_tile(DV + rows[:, None] * stride_dvt + h * stride_dvh + offs_d[None, :], dv.to(DV.dtype.element_ty), key_ok, d_ok, PAD_D)


# --------------------------------------------------------------------------------------------
# Autotuning
# --------------------------------------------------------------------------------------------

_AUTOTUNE_KEY = ["BATCH_BUCKET", "MAX_Q_BUCKET", "MAX_K_BUCKET", "MODE", "ACT", "CAUSAL", "HEAD_DIM", "DIM"]

# (BLOCK_M, BLOCK_N, warps, stages) per kernel and head-dim bucket; BLOCK_M is always the query
# block. Chosen from the sm_90 compiler's register and shared-memory report: configs that spilled
# (e.g. 4 warps on 128x64 tiles at d=128, or 64x128 dK/dV tiles at d=128 with 3 stages) are left
# out, and a d=256 tile must fit in 227 KiB of shared memory.
_CONFIG_TABLE = {
    "fwd": {
        # 64-row query blocks suit batches of short samples (a sample's last block is mostly
        # padding at 128 rows); fewer stages leave shared memory for two programs per SM.
        # (128, 64, 8, 4), (64, 64, 4, 4), (64, 128, 4, 3): deeper pipelines for softmax at d = 64 on
        # shape (b) of benchmarks/attention.py; the autotuner decides.
        # 32-row query blocks (32x64 at 2 and 4 warps, 32x32 at 2) took 0.166-0.184 ms against 0.090
        # for 64x64 on shape (b) on an H200, so they are not candidates.
        64: [(128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 4, 3), (64, 64, 4, 3), (128, 32, 4, 4), (64, 32, 4, 3),
             (64, 64, 4, 2), (64, 128, 4, 2), (128, 64, 8, 4), (64, 64, 4, 4), (64, 128, 4, 3)],
        128: [(128, 64, 8, 3), (128, 64, 8, 2), (128, 128, 8, 2), (64, 64, 4, 3), (64, 64, 4, 4), (64, 128, 4, 3),
              (64, 32, 4, 2)],
        256: [(64, 64, 4, 2), (64, 32, 4, 2), (128, 32, 8, 2)],
    },
    "dq": {
        64: [(128, 64, 8, 3), (128, 32, 8, 3), (64, 64, 4, 3), (128, 128, 8, 2), (64, 32, 4, 2), (64, 32, 4, 3)],
        128: [(128, 64, 8, 3), (128, 64, 8, 2), (128, 32, 8, 3), (64, 64, 4, 3), (64, 32, 4, 2)],
        256: [(64, 32, 4, 2), (64, 64, 8, 2)],
    },
    "dkdv": {
        64: [(64, 128, 8, 3), (32, 128, 8, 3), (64, 64, 4, 3), (32, 64, 4, 3), (128, 128, 8, 2), (16, 64, 4, 3)],
        128: [(32, 128, 8, 3), (32, 128, 8, 2), (64, 128, 8, 2), (64, 64, 8, 3), (32, 64, 4, 2)],
        256: [(32, 64, 8, 2), (16, 64, 4, 2)],
    },
}
_CONFIGS = {
    kind: {d: [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=st) for m, n, w, st in rows]
           for d, rows in table.items()}
    for kind, table in _CONFIG_TABLE.items()
}


def _dim_bucket(head_dim: int) -> int:
    return 64 if head_dim <= 64 else 128 if head_dim <= 128 else 256


def configs_for(kind: str, head_dim: int) -> list[triton.Config]:
    """The autotuner's candidates for one kernel ("fwd", "dq", "dkdv") at this (padded) head dim."""
    return _CONFIGS[kind][_dim_bucket(head_dim)]


def fit_lengths(configs: list[triton.Config], max_q: int | None, max_k: int | None) -> list[triton.Config]:
    """The candidates whose tiles are no longer than the (power-of-two bucket of the) longest sample's queries
    (``BLOCK_M``) and keys (``BLOCK_N``), the shortest tiles kept where none is: a longer tile only adds masked
    rows, and every candidate dropped is one compile and one timing fewer in a run's first step (Kunlun's
    20-70 tokens, the 16 summary queries, against candidates of up to 128 rows)."""
    out = configs
    if max_q:
        lo = min(c.kwargs["BLOCK_M"] for c in out)
        out = [c for c in out if c.kwargs["BLOCK_M"] <= max(max_q, lo)]
    if max_k:
        lo = min(c.kwargs["BLOCK_N"] for c in out)
        out = [c for c in out if c.kwargs["BLOCK_N"] <= max(max_k, lo)]
    return out


def _tuned(kind: str, kernel):
    def prune(configs, named_args, **kwargs):
        d = kwargs.get("HEAD_DIM", named_args.get("HEAD_DIM"))
        return fit_lengths(configs_for(kind, d), named_args.get("MAX_Q_BUCKET"), named_args.get("MAX_K_BUCKET"))

    everything = [c for rows in _CONFIGS[kind].values() for c in rows]
    # cache_results: the choice is kept in Triton's cache folder, so a later run of the same shapes skips the benchmarks
    return triton.autotune(everything, key=_AUTOTUNE_KEY, prune_configs_by={"early_config_prune": prune},
                           cache_results=True, do_bench=timed_bench(_default_bench))(kernel)


def _default_bench(kernel_call, quantiles):
    # Triton's default window (25 ms warm-up + 100 ms per candidate) made autotuning most of a short run's
    # first step (25-45 s on fresh H200 draws); a 5 + 20 ms window ranks these tiles as well.
    return triton.testing.do_bench(kernel_call, warmup=5, rep=20, quantiles=quantiles)


_fwd_tuned = _tuned("fwd", _fwd_kernel)
_dq_tuned = _tuned("dq", _bwd_dq_kernel)
_dkdv_tuned = _tuned("dkdv", _bwd_dkdv_kernel)

# Triton reads TRITON_INTERPRET when a kernel is decorated, so whether these kernels are
# interpreted is fixed at import: read it once here, not on every call.
INTERPRETED = type(_fwd_kernel).__name__ == "InterpretedFunction"

# Without autotuning each kernel runs one fixed config: under the interpreter (nothing to time;
# small blocks so that tests of a few dozen tokens cross several blocks, with both block-size
# orders), or when COPLAN_KERNELS_AUTOTUNE=0 (GPU tests, which would otherwise tune every
# specialisation they touch: there the first candidate, unless UNTUNED_CONFIGS names one).
# Tests may swap these. (BLOCK_M, BLOCK_N, warps, stages).
INTERPRETER_CONFIGS = {"fwd": (16, 16, 4, 1), "dq": (16, 16, 4, 1), "dkdv": (16, 32, 4, 1)}
UNTUNED_CONFIGS: dict[str, tuple[int, int, int, int]] = {}


def _fixed_config(kind: str, head_dim: int) -> tuple[int, int, int, int] | None:
    if INTERPRETED:
        return INTERPRETER_CONFIGS[kind]
    if os.environ.get("COPLAN_KERNELS_AUTOTUNE", "1") == "0":
        if kind in UNTUNED_CONFIGS:
            return UNTUNED_CONFIGS[kind]
        c = configs_for(kind, head_dim)[0]
        return c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages
    return None


# The autotuner's choice per (kernel, bucket, compile-time constants, dtypes), read back after its
# first run: later calls launch the plain kernel with that config and skip the autotuner's
# per-call argument hashing. Its own cache still decides (and is the one tests count).
_CHOSEN: dict[tuple, dict] = {}

# ---- direct launches -------------------------------------------------------------------------
#
# `kernel[grid](...)` goes through Triton's JIT dispatch on every call: it binds ~35 arguments,
# computes their specialisation (dtype, 16-byte alignment, ints equal to 1 or divisible by 16),
# stringifies the options into a cache key and checks the kernel's globals. On a short batch that
# host work is a sizeable part of a call (three launches per forward + backward). Here the
# compiled kernel that the JIT path returned is kept, keyed by everything that decides Triton's
# specialisation for these launchers: the config and constants, the device, the dtypes, the exact
# values of every specialised int argument (strides, heads), and the alignment of every tensor,
# launches with unaligned tensors always take the JIT path. The next call with the same key
# calls the kernel's launcher directly, with the arguments in signature order as the JIT path
# passes them. Any surprise (another Triton API, a launch hook set by a profiler) falls back to
# the JIT path for good. COPLAN_KERNELS_DIRECT_LAUNCH=0 turns it off.

DIRECT_LAUNCH = not INTERPRETED and os.environ.get("COPLAN_KERNELS_DIRECT_LAUNCH", "1") != "0"
_COMPILED: dict[tuple, tuple] = {}
"""key -> (compiled kernel, constexpr values in signature order)."""
_LAYOUT: dict[int, tuple] = {}
"""id(kernel) -> (getter of the specialised int arguments, names of the constexpr parameters)."""
_COMPILED_LIMIT = 512  # distinct keys kept; past it the table starts over (only JIT calls again)


def _device_and_stream() -> tuple[int, int]:
    """The current CUDA device and the raw handle of its current stream, as Triton's own launch reads them."""
    try:
        device = torch._C._cuda_getDevice()
        return device, torch._C._cuda_getCurrentRawStream(device)
    except AttributeError:  # private names gone in another torch: the public (slower) spelling
        device = torch.cuda.current_device()
        return device, torch.cuda.current_stream(device).cuda_stream


def _launch_hooks_set() -> bool:
    """Whether a profiler (e.g. Proton) asked Triton to call hooks around launches: then launch through Triton.

    Triton 3.6/3.7 keep the hooks as a chain with a ``calls`` list; older ones as None or a function.
    """
    runtime = triton.knobs.runtime
    enter, leave = runtime.launch_enter_hook, runtime.launch_exit_hook  # unrolled: no generator per launch
    return bool(getattr(enter, "calls", enter) or getattr(leave, "calls", leave))


def _layout(plain, args: list) -> tuple:
    """Which positional arguments Triton specialises on by value (ints not in do_not_specialize),
    and the names of the constexpr parameters that follow them, read from the kernel's own
    parameter list once per kernel."""
    hit = _LAYOUT.get(id(plain))
    if hit is None:
        params = plain.params
        spec = tuple(i for i, (p, a) in enumerate(zip(params, args))
                     if not p.is_constexpr and not p.do_not_specialize and isinstance(a, int))
        tail = tuple(p.name for p in params[len(args):])
        if any(not p.is_constexpr for p in params[len(args):]):
            raise TypeError("a non-constexpr parameter is passed by keyword")
        getter = operator.itemgetter(*spec) if len(spec) > 1 else (lambda a, i=spec[0]: (a[i],))
        hit = _LAYOUT[id(plain)] = (getter, tail)
    return hit


def _direct_key(kind: str, plain, args: list, consts: tuple, cfg: tuple, dtypes: tuple, aligned: bool):
    if not (DIRECT_LAUNCH and aligned):
        return None
    getter, _ = _layout(plain, args)
    device, stream = _device_and_stream()
    return (kind, id(plain), device, cfg, consts, dtypes, getter(args)), device, stream


def _run(kind: str, plain, grid0: int, args: list, consts: dict, cfg: tuple, dtypes: tuple, aligned: bool) -> None:
    """Launch ``plain`` on ``grid0`` programs with config ``cfg`` = (BLOCK_M, BLOCK_N, warps, stages)."""
    global DIRECT_LAUNCH
    try:
        found = _direct_key(kind, plain, args, tuple(consts.values()), cfg, dtypes, aligned)
    except Exception:  # noqa: BLE001  (an unexpected kernel object: never try again)
        DIRECT_LAUNCH = False
        found = None
    if found is not None:
        key, device, stream = found
        hit = _COMPILED.get(key)
        if hit is not None and not _launch_hooks_set():
            # (launcher, function handle, packed metadata, constexpr tail), read off the compiled
            # kernel once when it was stored: no property or attribute lookups per launch.
            run, function, packed, tail = hit
            run(grid0, 1, 1, stream, function, packed, None, None, None, *args, *tail)
            return
    bm, bn, warps, stages = cfg
    kernel = plain[(grid0,)](*args, **consts, BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages)
    if found is not None:
        try:
            _, tail_names = _layout(plain, args)
            every = dict(consts, BLOCK_M=bm, BLOCK_N=bn)
            tail = tuple(every[n] for n in tail_names)
            # The JIT call above ran the kernel, so its handles are loaded and `run` is the launcher.
            entry = (kernel.run, kernel.function, kernel.packed_metadata, tail)
            if len(_COMPILED) >= _COMPILED_LIMIT:
                _COMPILED.clear()
            _COMPILED[found[0]] = entry
        except Exception:  # noqa: BLE001  (another Triton's kernel object: keep the JIT path)
            DIRECT_LAUNCH = False


def _cdiv(a: int, b: int) -> int:
    """Ceiling division on the host. Not ``triton.cdiv``: since Triton 3.6 that is a
    ``constexpr_function``, whose ``__call__`` (unwrapping every argument, an import per call)
    cost ~3 us a launch on the host; it was the "jit.py __call__" of the H200 profiles."""
    return -(-a // b)


def _launch(kind: str, tuned, plain, rows: int, batch: int, heads: int, args: list, consts: dict, dtypes: tuple,
            aligned: bool = False) -> None:
    """Launch one kernel over every block of ``rows`` jagged rows: at most cdiv(rows, block) + batch
    blocks per head (a sample's last block may be partial); programs past the real count exit.

    ``aligned``: every tensor in ``args`` starts on a 16-byte boundary (the condition for a direct launch).
    """
    cfg = _fixed_config(kind, consts["HEAD_DIM"])
    per_key = kind == "dkdv"  # one program per key block; the others, per query block
    if cfg is None:
        key = (kind, *args[-3:], *consts.values(), *dtypes)
        cfg = _CHOSEN.get(key)
        if cfg is None:
            block = "BLOCK_N" if per_key else "BLOCK_M"
            tuned[lambda meta: ((_cdiv(rows, meta[block]) + batch) * heads,)](*args, **consts)
            best = tuned.best_config
            _CHOSEN[key] = (best.kwargs["BLOCK_M"], best.kwargs["BLOCK_N"], best.num_warps, best.num_stages)
            return
    _run(kind, plain, (_cdiv(rows, cfg[1] if per_key else cfg[0]) + batch) * heads, args, consts, cfg, dtypes, aligned)


# --------------------------------------------------------------------------------------------
# Launchers (called by the custom ops in ops.py; inputs are already checked there)
# --------------------------------------------------------------------------------------------


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs get fp32 products, not tf32: a caller passing fp32 expects fp32 results, and a
    # discontinuous activation (ReLU) turns tf32 rounding of scores near 0 into gradient errors.
    # For bf16/fp16 this is the default and changes nothing.
    return "ieee" if dtype == torch.float32 else "tf32"


def _head_dim_padded(d: int) -> int:
    """The tiles' head dim for a head dim of ``d``: ``tl.dot`` and ``tl.arange`` need a power of two (at least 16);
    the columns past ``d`` are masked in the kernels (read as zeros, never stored)."""
    return max(16, next_power_of_2(d))

_EMPTY: dict[torch.device, torch.Tensor] = {}


def _unused_f32(device: torch.device) -> torch.Tensor:
    """An empty fp32 tensor standing for a row-statistics argument that GDPA never reads (no allocation per call)."""
    t = _EMPTY.get(device)
    if t is None:
        t = _EMPTY[device] = torch.empty((0, 0), dtype=torch.float32, device=device)
    return t


def _unit(x: torch.Tensor) -> torch.Tensor:
    """``x`` with unit stride along the head dim, which the kernels' tiles assume (a copy only where it is not)."""
    return x if x.stride(-1) == 1 else x.contiguous()


# Samples launched longest first (see _block_counts_kernel) when one sort of this many holds the
# batch; larger batches keep the batch order.
_COUNT_CHUNK = 1024


def block_counts(q_offsets: torch.Tensor, k_offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Cumulative block counts [5, batch + 1] of queries and keys for blocks of 16, 32, 64, 128 rows
    (rows 0-3) in the launch order of the samples, and that order (row 4).

    Kept on ``q_offsets`` (keyed by ``k_offsets`` and both version counters) so that the layers of a
    model called on one batch launch the counting kernel once. Not while a CUDA graph is captured:
    a graph's replays may see new offsets copied into the same tensor, so the count must be in it.
    Writes that bypass the version counter (through ``.data``) are not seen.
    """
    capturing = q_offsets.is_cuda and torch.cuda.is_current_stream_capturing()
    if not capturing:
        hit = getattr(q_offsets, "_coplan_block_counts", None)
        if hit is not None and hit[0]() is k_offsets and hit[1] == q_offsets._version and hit[2] == k_offsets._version:
            return hit[3], hit[4]
    batch = q_offsets.numel() - 1
    # one buffer, the key table starting on a 16-byte boundary (an unaligned tensor would send every
    # launch that takes it through Triton's JIT path instead of the direct launch)
    n = 5 * (batch + 1)
    stride = (n + 3) // 4 * 4
    buf = torch.empty(2 * stride, dtype=torch.int32, device=q_offsets.device)
    cum = (buf[:n].view(5, batch + 1), buf[stride:stride + n].view(5, batch + 1))
    sort = batch <= _COUNT_CHUNK
    # sorting: one block of the next power of two (a few specialisations; a 1,024-wide sort for every
    # batch would cost the small ones, and seconds per call under the interpreter)
    chunk = max(16, 1 << max(0, batch - 1).bit_length()) if sort else _COUNT_CHUNK
    _block_counts_kernel[(1,)](q_offsets, k_offsets, cum[0], cum[1], batch, CHUNK=chunk, SORT=sort)
    if not capturing:
        # A weak reference: q_offsets must not keep k_offsets (or, for self-attention, itself) alive.
        q_offsets._coplan_block_counts = (weakref.ref(k_offsets), q_offsets._version, k_offsets._version, cum[0], cum[1])
    return cum[0], cum[1]


_KEYS: dict[tuple[int, int, int], tuple[int, int, int]] = {}


def _keys(batch: int, max_q_len: int, max_k_len: int) -> tuple[int, int, int]:
    """Autotune buckets: previous power of two of the batch, next powers of two of the maximum lengths."""
    hit = _KEYS.get((batch, max_q_len, max_k_len))
    if hit is None:
        if len(_KEYS) > 4096:
            _KEYS.clear()
        hit = _KEYS[(batch, max_q_len, max_k_len)] = (prev_power_of_2(batch), next_power_of_2(max_q_len),
                                                      next_power_of_2(max_k_len))
    return hit


_CONSTS: dict[tuple, dict] = {}


def _consts(activation: Activation | None, causal: bool, d: int, dtype: torch.dtype) -> dict:
    """The kernels' compile-time constants for one call at head dim ``d``, built once per combination (they are
    only read, never changed, by the launchers): ``HEAD_DIM`` the tiles' (padded) width, ``DIM`` = ``d``."""
    key = (activation, causal, d, dtype)
    hit = _CONSTS.get(key)
    if hit is None:
        softmax = activation is None
        d_pad = _head_dim_padded(d)
        hit = _CONSTS[key] = dict(MODE=SOFTMAX if softmax else ACTIVATION, ACT=0 if softmax else activation.code,
                                  CAUSAL=bool(causal), HEAD_DIM=d_pad, DIM=d, PAD_D=d_pad != d, FAST=not INTERPRETED,
                                  PRECISION=_dot_precision(dtype))
    return hit


_I32_MAX = 2**31 - 1


def _aligned(*tensors: torch.Tensor) -> bool:
    """Every tensor starts on a 16-byte boundary (what Triton specialises pointers on)."""
    bits = 0
    for t in tensors:
        bits |= t.data_ptr()
    return bits & 15 == 0


def attention_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_offsets: torch.Tensor, k_offsets: torch.Tensor,
    *, max_q_len: int, max_k_len: int, causal: bool, scale: float,
    activation: Activation | None, out_scale: float = 1.0, counts: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Output [total_q, H, D] and, for softmax (``activation is None``), the base-2 log-sum-exp [H, total_q].

    ``counts``: the :func:`block_counts` of these offsets, when the caller already has them.
    """
    total_q, heads, d = q.shape
    batch = q_offsets.numel() - 1
    softmax = activation is None
    device = q.device
    # Sizes as separate ints: torch.empty parses them faster than a tuple or a torch.Size.
    out = torch.empty(total_q, heads, d, dtype=q.dtype, device=device)
    lse = torch.empty(heads, total_q, dtype=torch.float32, device=device) if softmax else _unused_f32(device)
    if total_q == 0 or batch == 0 or max_q_len == 0:
        return out, lse
    (sqt, sqh, sqd), (skt, skh, skd), (svt, svh, svd) = q.stride(), k.stride(), v.stride()
    if sqd == 1 and skd == 1 and svd == 1:
        qp, kp, vp = q, k, v  # the common case: nothing to copy (any head dim: the kernels mask the padded columns)
    else:
        qp, kp, vp = _unit(q), _unit(k), _unit(v)
        (sqt, sqh, _), (skt, skh, _), (svt, svh, _) = qp.stride(), kp.stride(), vp.stride()
    op = out
    cum_q, _ = counts if counts is not None else block_counts(q_offsets, k_offsets)
    sot, soh, _ = op.stride()
    tensors = (qp, kp, vp, op, lse, q_offsets, k_offsets, cum_q)
    args = [
        *tensors, sqt, sqh, skt, skh, svt, svh, sot, soh,
        total_q, batch, heads, float(scale * LOG2E if softmax else scale), float(out_scale),
        *_keys(batch, max_q_len, max_k_len),
    ]
    consts = _consts(activation, causal, d, q.dtype)
    dtypes = (q.dtype, q_offsets.dtype, k_offsets.dtype)
    aligned = DIRECT_LAUNCH and total_q <= _I32_MAX and _aligned(*tensors)
    _launch("fwd", _fwd_tuned, _fwd_kernel, total_q, batch, heads, args, consts, dtypes, aligned)
    return out, lse


def attention_backward(
    do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor | None, lse: torch.Tensor | None,
    q_offsets: torch.Tensor, k_offsets: torch.Tensor,
    *, max_q_len: int, max_k_len: int, causal: bool, scale: float,
    activation: Activation | None, out_scale: float = 1.0, counts: tuple[torch.Tensor, torch.Tensor] | None = None,
    dkdv_one_buffer: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dQ, dK, dV. Softmax needs the forward's output ``o`` and ``lse``; GDPA needs neither.

    ``dkdv_one_buffer``: dK and dV are the two halves of one allocation (one trip through the
    device allocator instead of two). Only for callers whose outputs may alias each other, such as
    an ``autograd.Function``'s backward: a custom op's outputs may not (``torch.library`` refuses
    them), so the default keeps them apart.

    Two launches: dQ (which for softmax also computes delta = rowsum(dO * O) from the tiles of dO
    and O it loads anyway, and stores it for the next kernel), then dK/dV, which reads delta.
    Deterministic.
    """
    total_q, heads, d = q.shape
    total_k = k.shape[0]
    batch = q_offsets.numel() - 1
    softmax = activation is None
    if total_q == 0 or total_k == 0 or batch == 0 or max_q_len == 0 or max_k_len == 0:
        # No query sees any key: every gradient is zero.
        return (torch.zeros(q.shape, dtype=q.dtype, device=q.device), torch.zeros(k.shape, dtype=k.dtype, device=k.device),
                torch.zeros(v.shape, dtype=v.dtype, device=v.device))
    device = q.device
    # Each stride() call builds a tuple: read every input's once.
    (sqt, sqh, sqd), (skt, skh, skd), (svt, svh, svd), (sdot, sdoh, sdod) = q.stride(), k.stride(), v.stride(), do.stride()
    if sqd == 1 and skd == 1 and svd == 1 and sdod == 1:
        qp, kp, vp, dop = q, k, v, do  # the common case: nothing to copy (any head dim: the kernels mask the padding)
    else:
        qp, kp, vp, dop = _unit(q), _unit(k), _unit(v), _unit(do)
        (sqt, sqh, _), (skt, skh, _), (svt, svh, _), (sdot, sdoh, _) = qp.stride(), kp.stride(), vp.stride(), dop.stride()
    dq = torch.empty(total_q, heads, d, dtype=q.dtype, device=device)
    if dkdv_one_buffer:
        # Two contiguous halves of one allocation (k and v have one dtype and shape), each laid out
        # as a fresh [total_k, H, d] tensor: autograd's gradient accumulation still takes them as
        # they are (no copy), and the buffer, exactly dK's and dV's bytes, is freed once both are.
        dk, dv = torch.empty(2, total_k, heads, d, dtype=k.dtype, device=device).unbind(0)
    else:
        dk = torch.empty(total_k, heads, d, dtype=k.dtype, device=device)
        dv = torch.empty(total_k, heads, d, dtype=v.dtype, device=device)
    if softmax:
        op = _unit(o)
        delta = torch.empty(heads, total_q, dtype=torch.float32, device=device)
        lse_t = lse
    else:
        op = qp  # unread when MODE is ACTIVATION
        delta = lse_t = _unused_f32(device)
    cum_q, cum_k = counts if counts is not None else block_counts(q_offsets, k_offsets)
    keys = _keys(batch, max_q_len, max_k_len)
    consts = _consts(activation, causal, d, q.dtype)
    qk_scale = float(scale * LOG2E if softmax else scale)
    ds_scale = float(scale if softmax else scale * out_scale)
    # dq, dk and dv are fresh contiguous [rows, H, d] tensors: one pair of strides serves all three.
    sot, soh, _ = op.stride()
    sgt, sgh = heads * d, d
    dtypes = (q.dtype, do.dtype, q_offsets.dtype, k_offsets.dtype)
    aligned = (DIRECT_LAUNCH and max(total_q, total_k) <= _I32_MAX
               and _aligned(qp, kp, vp, op, dop, lse_t, q_offsets, k_offsets, cum_q, cum_k))
    dq_args = [
        qp, kp, vp, op, dop, dq, lse_t, delta, q_offsets, k_offsets, cum_q,
        sqt, sqh, skt, skh, svt, svh, sot, soh, sdot, sdoh, sgt, sgh, total_q,
        batch, heads, qk_scale, ds_scale, *keys,
    ]
    _launch("dq", _dq_tuned, _bwd_dq_kernel, total_q, batch, heads, dq_args, consts, dtypes, aligned)
    dkdv_args = [
        qp, kp, vp, dop, dk, dv, lse_t, delta, q_offsets, k_offsets, cum_k,
        sqt, sqh, skt, skh, svt, svh, sdot, sdoh, sgt, sgh, sgt, sgh, total_q,
        batch, heads, qk_scale, ds_scale, float(1.0 if softmax else out_scale), *keys,
    ]
    _launch("dkdv", _dkdv_tuned, _bwd_dkdv_kernel, total_k, batch, heads, dkdv_args, consts, dtypes, aligned)
    return dq, dk, dv

