"""FP8 written by the producers (issue 26): LayerNorm and activation kernels that write the block-wise
recipe's operands, forward and backward, and the autograd ops that chain them into the block-scaled GEMM.

On CPU the kernels run in Triton's interpreter (tests/kernels/conftest.py sets it before coplan.kernels
is imported). Each producer is checked against PyTorch in two steps, so that a wrong fusion fails:

1. the values it quantises (y, a, dx, dh, returned in fp32 for fp32 inputs) against the fp32 reference
   (F.layer_norm, F.silu, autograd), and, on CPU, the LayerNorm output bit-equal to the reference
   formula evaluated with the kernel's own mean and rstd (which are checked against torch);
2. its fp8 tensors bit-equal to the reference quantisation (:mod:`coplan.kernels.fp8_reference`,
   ``s = max(amax, 1e-12) / fp8_max`` per 1x128 tile) of those values, in exactly
   ``quant_act_dual``'s shapes and strides, padding zero.

The composed ops are checked against an fp32 autograd reference (e4m3's relative rounding error gives
~3-4% on a product of two quantised operands: 0.5% < error < 6%, two GEMMs in series 10%) and
against an emulation that quantises the same tensors with the reference functions and multiplies in
fp32 (tight: only fp8 rounding flips of values a few ulps apart can differ).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
import torch.nn.functional as F
from torch import nn

from coplan.kernels import fp8_fused as ff
from coplan.kernels import fp8_reference as ref
from coplan.kernels import fp8_triton as ft
from coplan.kernels.fp8 import Fp8InputError

from .conftest import DEVICE, gpu

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
ON_CPU = DEVICE == "cpu"
REL_TOL, REL_FLOOR = 0.06, 0.005
CHAIN_TOL = 0.10  # two fp8 GEMMs in series (and fp8 dh), against fp32
EMU_TOL = 2e-3 if ON_CPU else 1e-2  # same quantisation in PyTorch; GPU: fp8 tensor-core accumulation, bf16-free
# The same quantised operands through block_scaled_mm and through its fp32 reference: the interpreter
# accumulates in fp32 (1e-5); Hopper's fp8 tensor cores add products at reduced precision before each
# 128-wide promotion to fp32 (see MM_TOL in test_fp8.py; measured 1.08e-4 on the H100), so 1e-3 on a GPU. A
# wrong scale, a swapped block or a transposed operand errs by O(1), far above both.
MM_TOL = 1e-5 if ON_CPU else 1e-3
GELU = lambda z: F.gelu(z, approximate="tanh")  # noqa: E731
RELU2 = lambda z: F.relu(z).square()  # noqa: E731
ACT_REF = {"identity": lambda z: z, "relu": F.relu, "relu2": RELU2, "relu_squared": RELU2,
           "silu": F.silu, "gelu_tanh": GELU, "swiglu": F.silu, "geglu": GELU}


def randn(*shape, seed=0, scale=1.0, shift=0.0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale + shift).to(device=DEVICE, dtype=dtype)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    assert a.shape == b.shape, (a.shape, b.shape)
    assert torch.isfinite(a).all(), "non-finite values"
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def act_ref(h: torch.Tensor, kind: str) -> torch.Tensor:
    if ff.ACTIVATIONS[kind][1]:
        g, u = h.chunk(2, dim=-1)
        return ACT_REF[kind](g) * u
    return ACT_REF[kind](h)


def quant_ref(x: torch.Tensor, fmt=E4M3):
    """The reference 1x128 quantisation of x [R, C] (rows along C) in e4m3 or e5m2: q [R, C→128], s [R, C/128]."""
    if fmt == E4M3:
        return ref.quant_tiles_ref(x.float().cpu(), square=False)
    R, C = x.shape
    xf = F.pad(x.float().cpu(), (0, ft.padded(C, 128) - C)).view(R, -1, 128)
    amax = xf.abs().amax(dim=2)
    s = amax.clamp_min(ff.AMAX_FLOOR) / torch.full_like(amax, ff.FP8_MAX[E5M2])
    q = (xf * torch.reciprocal(s)[..., None]).clamp(-ff.FP8_MAX[E5M2], ff.FP8_MAX[E5M2]).to(E5M2)
    return q.view(R, -1), s


def assert_same(q: torch.Tensor, s: torch.Tensor, qr: torch.Tensor, sr: torch.Tensor, what: str) -> None:
    q, s = q.cpu(), s.cpu()
    assert q.dtype == qr.dtype, (what, q.dtype, qr.dtype)
    assert q.shape == qr.shape and s.shape == sr.shape, (what, q.shape, qr.shape, s.shape, sr.shape)
    ds, dq = s != sr, q.float() != qr.float()
    assert not ds.any(), (f"{what}: {int(ds.sum())} of {s.numel()} scales differ "
                          f"(e.g. {s[ds][:3].tolist()} vs {sr[ds][:3].tolist()})")
    assert not dq.any(), f"{what}: {int(dq.sum())} of {q.numel()} fp8 values differ"


def assert_operand(d: ft.DualQuant, values: torch.Tensor, fmt=E4M3, with_t: bool = True, what: str = "") -> None:
    """``d`` is the block-wise operand of ``values [M, C]`` in quant_act_dual's layout: q/s bit-equal
    to the reference quantisation, padding zero, scales outer-dim-major; qt/st those of valuesᵀ,
    rows padded to 16 and token columns to 128 with zeros."""
    M, C = values.shape
    qr, sr = quant_ref(values, fmt)
    assert d.s.stride() == (1, M) or M <= 1, (what, d.s.stride())
    assert M == 0 or ft.scaled_mm_scales_ok(d.q.shape[0], d.q.shape[1], d.s, square=False), what
    assert_same(d.q, d.s, qr, sr, f"{what} q")
    assert torch.all(d.q[:, C:].cpu().float() == 0), f"{what}: padded columns are not zero"
    if not with_t:
        assert d.qt is None and d.st is None
        return
    qtr, stres = quant_ref(values.t(), fmt)
    assert d.qt.shape == (ft.padded(C, 16), ft.padded(M, 128)) and d.st.shape == (ft.padded(C, 16), ft.padded(M, 128) // 128)
    assert M == 0 or ft.scaled_mm_scales_ok(d.qt.shape[0], d.qt.shape[1], d.st, square=False), what
    assert_same(d.qt[:C], d.st[:C], qtr, stres, f"{what} qt")
    assert torch.all(d.qt[C:].cpu().float() == 0) and torch.all(d.qt[:, M:].cpu().float() == 0), f"{what}: qt padding not zero"


# ---- LayerNorm forward ----------------------------------------------------------------------


@pytest.mark.parametrize("M,D,affine,with_t", [(96, 192, True, True), (200, 128, False, False), (37, 300, True, True),
                                               (1, 64, True, False)])
def test_layernorm_quant_matches_reference(M, D, affine, with_t):
    x = randn(M, D, seed=1, scale=3.0, shift=1.5)
    w = randn(D, seed=2, scale=0.3, shift=1.0) if affine else None
    b = randn(D, seed=3, scale=0.2) if affine else None
    r = ff.layernorm_quant(x, w, b, 1e-5, with_t=with_t, return_y=True)
    want = F.layer_norm(x, (D,), w, b, 1e-5)
    assert r.y.dtype == x.dtype and r.mean.dtype == r.rstd.dtype == torch.float32
    assert rel(r.y, want) < 1e-6
    assert torch.allclose(r.mean, x.mean(1), rtol=1e-5, atol=1e-6)
    assert torch.allclose(r.rstd, torch.rsqrt(x.var(1, unbiased=False) + 1e-5), rtol=1e-5)
    if ON_CPU:  # the same fp32 operations in the same order (no FMA in the interpreter): bit-equal
        y = (x - r.mean[:, None]) * r.rstd[:, None]
        y = y * w + b if affine else y
        assert torch.equal(r.y, y)
    assert_operand(r.fp8, r.y, with_t=with_t, what="y")
    # the scales are those of the reference output's tiles, up to LayerNorm's own rounding
    _, s_want = quant_ref(want)
    assert torch.allclose(r.fp8.s.cpu(), s_want, rtol=1e-5, atol=0)


@settings(max_examples=10, deadline=None)
@given(M=st.integers(0, 260), D=st.integers(1, 300), with_t=st.booleans(), seed=st.integers(0, 2**16))
def test_layernorm_quant_any_shape(M, D, with_t, seed):
    """Empty, single-row, ragged (not a multiple of the row block or of 128) and narrow (D < 128) inputs."""
    x = randn(M, D, seed=seed, scale=2.0)
    r = ff.layernorm_quant(x, randn(D, seed=seed + 1), randn(D, seed=seed + 2), with_t=with_t, return_y=True)
    if M:
        assert rel(r.y, F.layer_norm(x, (D,), randn(D, seed=seed + 1), randn(D, seed=seed + 2))) < 1e-5
    assert_operand(r.fp8, r.y, with_t=with_t, what=f"{M}x{D}")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_layernorm_quant_half_inputs(dtype):
    """A half-precision x: statistics and y computed in fp32 from it; q quantises the fp32 y (not the
    rounded y it returns), so it is the reference quantisation of the fp32 LayerNorm of x."""
    M, D = 50, 160
    x = randn(M, D, seed=4, scale=2.0, dtype=dtype)
    w, b = randn(D, seed=5, scale=0.2, shift=1.0, dtype=dtype), randn(D, seed=6, scale=0.1, dtype=dtype)
    r = ff.layernorm_quant(x, w, b, 1e-5, with_t=True, return_y=True)
    want = F.layer_norm(x.float(), (D,), w.float(), b.float(), 1e-5)
    assert r.y.dtype == dtype and rel(r.y, want) < (4e-3 if dtype == torch.bfloat16 else 5e-4)
    _, s_want = quant_ref(want)
    assert torch.allclose(r.fp8.s.cpu(), s_want, rtol=1e-5)
    back = ref.dequant_tiles(r.fp8.q.cpu(), r.fp8.s.cpu(), False)[:, :D]
    assert (back - want.cpu()).abs().max() <= (want.abs().cpu() * 2.0**-4 + 1e-3).max()
    assert 0.005 < rel(back, want.cpu()) < 0.05


def test_layernorm_quant_zero_and_constant_rows():
    """Constant rows normalise to zero (then the bias): an all-zero tile gets the floor scale and q = 0,
    never NaN; rows past M in the transposed copy are zero."""
    M, D = 20, 256
    x = randn(M, D, seed=7)
    x[3] = 0.0
    x[5] = 7.0
    r = ff.layernorm_quant(x, randn(D, seed=8), None, with_t=True)
    floor = torch.tensor(ff.AMAX_FLOOR) / torch.tensor(448.0)
    for row in (3, 5):
        assert torch.all(r.fp8.s[row].cpu() == floor) and torch.all(r.fp8.q[row].cpu().float() == 0)
    assert torch.isfinite(r.fp8.q.cpu().float()).all() and torch.isfinite(r.fp8.s).all()
    assert torch.all(r.fp8.qt[:, M:].cpu().float() == 0)


def test_layernorm_quant_e5m2():
    M, D = 40, 200
    x = randn(M, D, seed=9, scale=5.0)
    r = ff.layernorm_quant(x, None, None, with_t=True, return_y=True, fp8_dtype=E5M2)
    assert r.fp8.q.dtype == E5M2 and r.fp8.qt.dtype == E5M2
    assert_operand(r.fp8, r.y, fmt=E5M2, what="y e5m2")
    amax = F.pad(r.y.cpu(), (0, 56)).abs().view(M, 2, 128).amax(-1)
    assert torch.equal(r.fp8.s.cpu(), amax / torch.full_like(amax, 57344.0))  # e5m2's largest normal, not 448


def test_fused_operand_equals_quant_act_dual_and_feeds_the_gemm():
    """The LayerNorm's operand is, tensor for tensor (values, shapes, strides), what quant_act_dual
    writes for the same y; block_scaled_mm on it (forward and weight-gradient forms) equals the
    reference product."""
    M, D, N = 96, 192, 64
    x, w = randn(M, D, seed=10), randn(N, D, seed=11, scale=D**-0.5)
    r = ff.layernorm_quant(x, None, None, with_t=True, return_y=True)
    d = ft.quant_act_dual(r.y, with_t=True)
    for a, b in ((r.fp8.q, d.q), (r.fp8.s, d.s), (r.fp8.qt, d.qt), (r.fp8.st, d.st)):
        assert a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype
        assert torch.equal(a.cpu().float(), b.cpu().float())
    wq = ft.quant_weight_dual(w, with_t=False)
    got = ft.block_scaled_mm(r.fp8.q, r.fp8.s, wq.q, wq.s, n=N, b_square=True, out_dtype=torch.float32)
    want = ref.block_scaled_mm_ref(r.fp8.q.cpu(), r.fp8.s.cpu(), wq.q.cpu(), wq.s.cpu(), b_square=True, n=N)
    assert rel(got.cpu(), want) < MM_TOL
    gq = ft.quant_act_dual(randn(M, N, seed=12), with_t=True)
    dw = ft.block_scaled_mm(gq.qt, gq.st, r.fp8.qt, r.fp8.st, n=D, b_square=False, out_dtype=torch.float32)[:N]
    dw_want = ref.block_scaled_mm_ref(gq.qt.cpu(), gq.st.cpu(), r.fp8.qt.cpu(), r.fp8.st.cpu(), b_square=False, n=D)[:N]
    assert rel(dw.cpu(), dw_want) < MM_TOL


# ---- activations forward ----------------------------------------------------------------------


@pytest.mark.parametrize("kind", list(ff.ACTIVATIONS))
def test_act_quant_matches_reference(kind):
    M, H = 70, 200  # ragged rows, a partial last tile
    gated = ff.ACTIVATIONS[kind][1]
    h = randn(M, 2 * H if gated else H, seed=13, scale=2.0)
    r = ff.act_quant(h, kind, with_t=True, return_a=True, save_input_fp8=True)
    want = act_ref(h, kind)
    assert r.a.shape == (M, H)
    assert rel(r.a, want) < 1e-6
    assert_operand(r.fp8, r.a, with_t=True, what=kind)
    _, s_want = quant_ref(want)
    assert torch.allclose(r.fp8.s.cpu(), s_want, rtol=1e-6, atol=0)
    hq, hs = r.h_fp8
    parts = [h[:, :H], h[:, H:]] if gated else [h]
    for i, part in enumerate(parts):
        qr, sr = quant_ref(part)
        kb = ft.padded(H, 128) // 128
        assert_same(hq[:, i * kb * 128:(i + 1) * kb * 128], hs[:, i * kb:(i + 1) * kb], qr, sr, f"{kind} input part {i}")


def test_act_quant_e5m2_and_no_transpose():
    h = randn(33, 128, seed=14, scale=3.0)
    r = ff.act_quant(h, "gelu_tanh", return_a=True, fp8_dtype=E5M2)
    assert r.fp8.qt is None and r.h_fp8 is None
    assert_operand(r.fp8, r.a, fmt=E5M2, with_t=False, what="gelu e5m2")


# ---- backward producers --------------------------------------------------------------------


@pytest.mark.parametrize("M,D,affine,residual,fmt", [(200, 192, True, True, E4M3), (57, 300, False, False, E5M2),
                                                     (128, 128, True, False, E5M2)])
def test_layernorm_backward_quant_matches_autograd(M, D, affine, residual, fmt):
    x = randn(M, D, seed=15, scale=2.0, shift=-1.0)
    w = randn(D, seed=16, scale=0.3, shift=1.0) if affine else None
    b = randn(D, seed=17, scale=0.1) if affine else None
    dy, rg = randn(M, D, seed=18), (randn(M, D, seed=19) if residual else None)
    st = ff.layernorm_quant(x, w, b)
    g = ff.layernorm_backward_quant(dy, x, w, st.mean, st.rstd, residual_grad=rg, with_t=True, fp8_dtype=fmt)
    xr = x.clone().requires_grad_(True)
    wr = w.clone().requires_grad_(True) if affine else None
    br = b.clone().requires_grad_(True) if affine else None
    F.layer_norm(xr, (D,), wr, br, 1e-5).backward(dy)
    want = xr.grad + (rg if residual else 0)
    assert rel(g.dx, want) < 1e-5
    assert_operand(g.fp8, g.dx, fmt=fmt, what="dx")
    if affine:
        assert rel(g.dweight, wr.grad) < 1e-5 and rel(g.dbias, br.grad) < 1e-5
    else:
        assert rel(g.dbias, dy.sum(0)) < 1e-5  # the bias gradient of an affine-free norm is still Σ dy


@pytest.mark.parametrize("kind", ["silu", "gelu_tanh", "relu2", "swiglu"])
def test_act_backward_quant_matches_autograd(kind):
    M, H = 150, 136
    gated = ff.ACTIVATIONS[kind][1]
    h = randn(M, 2 * H if gated else H, seed=20, scale=2.0)
    da = randn(M, H, seed=21)
    hr = h.clone().requires_grad_(True)
    act_ref(hr, kind).backward(da)
    g = ff.act_backward_quant(da, h, kind, return_dh=True, with_t=True)
    assert g.dh.shape == h.shape and rel(g.dh, hr.grad) < 1e-6
    assert_operand(g.fp8, g.dh, with_t=True, what=f"d{kind}")
    # from the input's fp8 tiles (act_quant's save_input_fp8): the gradient at the dequantised input
    hq, hs = ff.act_quant(h, kind, save_input_fp8=True).h_fp8
    parts = [ref.dequant_tiles(hq[:, i * 256:(i + 1) * 256].cpu(), hs[:, i * 2:(i + 1) * 2].cpu(), False)[:, :H]
             for i in range(2 if gated else 1)]
    hd = torch.cat(parts, 1).to(DEVICE).requires_grad_(True)
    act_ref(hd, kind).backward(da)
    g8 = ff.act_backward_quant(da, None, kind, h_fp8=(hq, hs), return_dh=True, quant=True, fp8_dtype=E5M2,
                               dh_dtype=torch.float32)
    assert rel(g8.dh, hd.grad) < 1e-5
    assert_operand(g8.fp8, g8.dh, fmt=E5M2, with_t=False, what=f"d{kind} from fp8 h")
    assert REL_FLOOR < rel(g8.dh, hr.grad) < REL_TOL  # the input's rounding shows, within e4m3's


# ---- composed ops ----------------------------------------------------------------------------


def _grads(fn, tensors, gy):
    ts = [t.clone().requires_grad_(True) if t is not None else None for t in tensors]
    out = fn(*ts)
    out.backward(gy)
    return [out.detach()] + [t.grad if t is not None else None for t in ts]


def _emulated_ln_linear(x, lw, lb, w, b, gy):
    """ln_linear with every GEMM operand quantised by the reference functions, products in fp32."""
    M, D = x.shape
    N = w.shape[0]
    xr = x.cpu().clone().requires_grad_(True)
    lwr = lw.cpu().clone().requires_grad_(True) if lw is not None else None
    lbr = lb.cpu().clone().requires_grad_(True) if lb is not None else None
    y = F.layer_norm(xr, (D,), lwr, lbr, 1e-5)
    qy, sy = ref.quant_tiles_ref(y.detach(), False)
    qw, sw = ref.quant_tiles_ref(w.cpu(), True)
    out = ref.block_scaled_mm_ref(qy, sy, qw, sw, b_square=True, n=N) + (b.cpu() if b is not None else 0)
    qg, sg = ref.quant_tiles_ref(gy.cpu(), False)
    qwt, swt = ref.quant_tiles_ref(w.cpu().t(), True)
    dy = ref.block_scaled_mm_ref(qg, sg, qwt, swt, b_square=True, n=D)
    qgt, sgt = ref.quant_tiles_ref(gy.cpu().t(), False)
    qyt, syt = ref.quant_tiles_ref(y.detach().t(), False)
    dw = ref.block_scaled_mm_ref(qgt, sgt, qyt, syt, b_square=False, n=D)
    y.backward(dy)
    return [out, xr.grad, lwr.grad if lwr is not None else None, lbr.grad if lbr is not None else None, dw,
            gy.cpu().sum(0) if b is not None else None]


@pytest.mark.parametrize("affine,bias,lead", [(True, True, (96,)), (False, False, (4, 24))])
def test_ln_linear_fp8_forward_and_backward(affine, bias, lead):
    D, N = 192, 64
    x = randn(*lead, D, seed=22, scale=2.0, shift=0.5)
    lw = randn(D, seed=23, scale=0.2, shift=1.0) if affine else None
    lb = randn(D, seed=24, scale=0.1) if affine else None
    w, b = randn(N, D, seed=25, scale=D**-0.5), (randn(N, seed=26, scale=0.1) if bias else None)
    gy = randn(*lead, N, seed=27)
    got = _grads(lambda *t: ff.ln_linear_fp8(*t), [x, lw, lb, w, b], gy)
    want = _grads(lambda x_, lw_, lb_, w_, b_: F.linear(F.layer_norm(x_, (D,), lw_, lb_), w_, b_), [x, lw, lb, w, b], gy)
    emu = _emulated_ln_linear(x.reshape(-1, D), lw, lb, w, b, gy.reshape(-1, N))
    names = ["out", "dx", "d ln_weight", "d ln_bias", "dW", "d bias"]
    assert got[0].shape == (*lead, N) and got[1].shape == x.shape
    for name, g, w_, e in zip(names, got, want, emu):
        if w_ is None:
            assert g is None, name
            continue
        if name == "d bias":
            assert rel(g, w_) < 1e-6
            continue
        assert REL_FLOOR < rel(g, w_) < REL_TOL, (name, rel(g, w_))
        assert rel(g.reshape(e.shape).cpu(), e) < EMU_TOL, (name, rel(g.reshape(e.shape).cpu(), e))


@pytest.mark.parametrize("kind,save_input_fp8", [("silu", False), ("swiglu", True)])
def test_act_linear_fp8_forward_and_backward(kind, save_input_fp8):
    M, H, N = 80, 192, 64
    gated = ff.ACTIVATIONS[kind][1]
    h = randn(M, 2 * H if gated else H, seed=28, scale=2.0)
    w = randn(N, H, seed=29, scale=H**-0.5)
    gy = randn(M, N, seed=30)
    got = _grads(lambda h_, w_: ff.act_linear_fp8(h_, w_, kind=kind, save_input_fp8=save_input_fp8), [h, w], gy)
    want = _grads(lambda h_, w_: F.linear(act_ref(h_, kind), w_), [h, w], gy)
    for name, g, w_ in zip(["out", "dh", "dW"], got, want):
        assert REL_FLOOR < rel(g, w_) < (CHAIN_TOL if save_input_fp8 else REL_TOL), (name, rel(g, w_))
    # emulation of the output and dW (same fp8 operands, fp32 products)
    a = act_ref(h, kind)
    qa, sa = ref.quant_tiles_ref(a.cpu(), False)
    qw, sw = ref.quant_tiles_ref(w.cpu(), True)
    assert rel(got[0].cpu(), ref.block_scaled_mm_ref(qa, sa, qw, sw, b_square=True, n=N)) < EMU_TOL
    qgt, sgt = ref.quant_tiles_ref(gy.cpu().t(), False)
    qat, sat = ref.quant_tiles_ref(a.cpu().t(), False)
    assert rel(got[2].cpu(), ref.block_scaled_mm_ref(qgt, sgt, qat, sat, b_square=False, n=H)) < EMU_TOL


@pytest.mark.parametrize("kind,grad_dtype,save_input_fp8", [("silu", E4M3, False), ("swiglu", E5M2, True)])
def test_ln_ffn_fp8_forward_and_backward(kind, grad_dtype, save_input_fp8):
    """The whole pre-norm FFN, dh straight to fp8: every gradient against fp32 autograd, and the
    up-projection's weight gradient against the emulation built from the kernels' own dh (its fp8
    tiles must be the reference quantisation of the autograd dh at the same fp8 forward)."""
    M, D, H = 96, 192, 128
    gated = ff.ACTIVATIONS[kind][1]
    x = randn(M, D, seed=31, scale=2.0)
    lw, lb = randn(D, seed=32, scale=0.2, shift=1.0), randn(D, seed=33, scale=0.1)
    wu = randn(2 * H if gated else H, D, seed=34, scale=D**-0.5)
    wd = randn(D, H, seed=35, scale=H**-0.5)
    gy = randn(M, D, seed=36)
    got = _grads(lambda *t: ff.ln_ffn_fp8(*t, kind=kind, grad_dtype=grad_dtype, save_input_fp8=save_input_fp8),
                 [x, lw, lb, wu, wd], gy)
    want = _grads(lambda x_, lw_, lb_, wu_, wd_: F.linear(act_ref(F.linear(F.layer_norm(x_, (D,), lw_, lb_), wu_), kind), wd_),
                  [x, lw, lb, wu, wd], gy)
    for name, g, w_ in zip(["out", "dx", "d ln_weight", "d ln_bias", "dW_up", "dW_down"], got, want):
        assert g.shape == w_.shape and g.dtype == w_.dtype, name
        assert REL_FLOOR < rel(g, w_) < CHAIN_TOL, (name, rel(g, w_))


# ---- edge cases and errors -------------------------------------------------------------------


def test_zero_rows():
    D, N = 64, 32
    x = torch.zeros(0, D, device=DEVICE)
    r = ff.layernorm_quant(x, None, None, with_t=True)
    assert r.fp8.q.shape == (0, 128) and r.fp8.qt.shape == (64, 0) and r.mean.shape == (0,)
    assert ff.act_quant(torch.zeros(0, 2 * D, device=DEVICE), "swiglu", with_t=True).fp8.q.shape == (0, 128)
    lw, lb, w = randn(D, seed=37), randn(D, seed=38), randn(N, D, seed=39)
    ts = [t.clone().requires_grad_(True) for t in (x, lw, lb, w)]
    out = ff.ln_linear_fp8(*ts)
    assert out.shape == (0, N)
    out.sum().backward()
    assert ts[0].grad.shape == (0, D) and all(torch.equal(t.grad, torch.zeros_like(t)) for t in ts[1:])
    wd = randn(D, N, seed=40).requires_grad_(True)
    out = ff.ln_ffn_fp8(ts[0], None, None, ts[3], wd)
    out.sum().backward()
    assert out.shape == (0, D) and torch.equal(wd.grad, torch.zeros_like(wd))


def test_forward_only_writes_no_transposed_copies(monkeypatch):
    """Under no_grad the ops skip the backward's transposed fp8 copies, even for leaves that require grad."""
    seen = []
    real = ff.layernorm_quant
    monkeypatch.setattr(ff, "layernorm_quant", lambda *a, **k: seen.append(k.get("with_t")) or real(*a, **k))
    x, w = randn(16, 128).requires_grad_(True), randn(8, 128).requires_grad_(True)
    with torch.no_grad():
        ff.ln_linear_fp8(x, None, None, w)
    ff.ln_linear_fp8(x, None, None, w)
    assert seen == [False, True]


def test_all_zero_input_gives_zero_not_nan():
    out = ff.ln_linear_fp8(torch.zeros(8, 160, device=DEVICE), None, None, randn(24, 160, seed=41))
    assert torch.equal(out, torch.zeros_like(out))
    out = ff.act_linear_fp8(torch.zeros(8, 160, device=DEVICE), randn(24, 160, seed=42), kind="gelu_tanh")
    assert torch.equal(out, torch.zeros_like(out))


def test_bad_inputs_are_named():
    x, w = randn(8, 64), randn(4, 64)
    cases = [
        (lambda: ff.layernorm_quant(randn(2, 3, 64), None, None), "2-D"),
        (lambda: ff.layernorm_quant(x.to(torch.int32), None, None), "float32, bfloat16 or float16"),
        (lambda: ff.layernorm_quant(randn(64, 8).t(), None, None), "contiguous rows"),
        (lambda: ff.layernorm_quant(x, randn(63), None), "weight must be a 1-D tensor of 64"),
        (lambda: ff.layernorm_quant(x, None, None, 0.0), "eps"),
        (lambda: ff.layernorm_quant(x, None, None, fp8_dtype=torch.bfloat16), "fp8_dtype"),
        (lambda: ff.layernorm_quant(randn(8, 0), None, None), "no columns"),
        (lambda: ff.layernorm_backward_quant(randn(8, 32), x, None, torch.zeros(8, device=DEVICE),
                                             torch.ones(8, device=DEVICE)), "dy has 32 columns"),
        (lambda: ff.layernorm_backward_quant(x, x, None, torch.zeros(8, device=DEVICE, dtype=torch.float16),
                                             torch.ones(8, device=DEVICE)), "mean must be torch.float32"),
        (lambda: ff.layernorm_backward_quant(x, x, None, torch.zeros(8, device=DEVICE), torch.ones(8, device=DEVICE),
                                             quant=False, with_t=True), "needs quant=True"),
        (lambda: ff.act_quant(x, "tanh"), "kind='tanh'"),
        (lambda: ff.act_quant(randn(8, 65), "swiglu"), "even number of columns"),
        (lambda: ff.act_backward_quant(x, randn(8, 32), "silu"), "h has 32 columns"),
        (lambda: ff.act_backward_quant(x, None, "silu"), "exactly one of h"),
        (lambda: ff.act_backward_quant(x, x, "silu", return_dh=False, quant=False), "nothing to write"),
        (lambda: ff.ln_linear_fp8(x, None, None, randn(4, 32)), "in_features 32"),
        (lambda: ff.ln_linear_fp8(x, None, None, w, randn(5)), "bias must be a 1-D tensor of 4"),
        (lambda: ff.ln_linear_fp8(x, None, None, randn(4, 64, 1)), "2-D"),
        (lambda: ff.act_linear_fp8(randn(8, 64), w, kind="swiglu"), "in_features 64, the input has 32"),
        (lambda: ff.ln_ffn_fp8(x, None, None, randn(32, 64), randn(64, 32), grad_dtype=torch.float16), "fp8_dtype"),
        (lambda: ff.fused_bytes(10, 64, 64, chain="mlp"), "chain='mlp'"),
    ]
    for fn, match in cases:
        with pytest.raises(Fp8InputError, match=match):
            fn()
            pytest.fail(f"no error for the case that expects {match!r}")
    assert issubclass(Fp8InputError, ValueError)
    if ON_CPU and not ft.interpreting():  # pragma: no cover (conftest always sets the interpreter on CPU)
        with pytest.raises(Fp8InputError, match="CUDA"):
            ff.layernorm_quant(x, None, None)


def test_module_shares_the_parameters():
    norm, lin = nn.LayerNorm(192).to(DEVICE), nn.Linear(192, 48).to(DEVICE)
    m = ff.FusedFp8LayerNormLinear(norm, lin)
    assert m.norm.weight is norm.weight and m.linear.weight is lin.weight
    assert set(m.state_dict()) == {"norm.weight", "norm.bias", "linear.weight", "linear.bias"}
    x = randn(16, 192, seed=43)
    assert REL_FLOOR < rel(m(x), lin(norm(x))) < REL_TOL
    with pytest.raises(Fp8InputError, match="in_features"):
        ff.FusedFp8LayerNormLinear(nn.LayerNorm(64), lin)


# ---- bytes -----------------------------------------------------------------------------------


def test_fused_bytes():
    M, D, N = 61000, 1024, 4096
    b = ff.fused_bytes(M, D, N)
    # the fusion removes y's bf16 write and its re-read by the quantisation pass, nothing else
    assert b.saved_bytes == 2 * 2 * M * D
    assert b.fused.quant_pass_bytes < b.unfused.quant_pass_bytes
    assert "quant_act" in b.unfused.by_kernel() and "quant_act" not in b.fused.by_kernel()
    assert (b.fused + b.unfused).hbm_bytes == b.fused.hbm_bytes + b.unfused.hbm_bytes
    a = ff.fused_bytes(M, N, D, chain="act_linear")
    assert a.saved_bytes == 2 * 2 * M * N
    f = ff.fused_bytes(M, D, N, chain="ln_ffn")
    assert f.saved_bytes == 2 * 2 * (M * D + M * N + M * N)  # y, a and dh: no bf16 write, no re-read
    g = ff.fused_bytes(M, D, N, chain="ln_ffn", gated=True)
    assert g.saved_bytes == 2 * 2 * (M * D + M * N + 2 * M * N)
    assert ff.fused_bytes(0, D, N).saved_bytes == 0


# ---- GPU (bf16, cuBLAS / compiled kernels) ---------------------------------------------------


@gpu
def test_gpu_ln_linear_bf16_against_fp32():
    M, D, N = 1000, 1024, 512
    x = randn(M, D, seed=44, scale=2.0, dtype=torch.bfloat16)
    lw, lb = randn(D, seed=45, scale=0.1, shift=1.0, dtype=torch.bfloat16), randn(D, seed=46, scale=0.1, dtype=torch.bfloat16)
    w = randn(N, D, seed=47, scale=D**-0.5, dtype=torch.bfloat16)
    gy = randn(M, N, seed=48, dtype=torch.bfloat16)
    got = _grads(lambda *t: ff.ln_linear_fp8(*t), [x, lw, lb, w], gy)
    want = _grads(lambda x_, lw_, lb_, w_: F.linear(F.layer_norm(x_, (D,), lw_, lb_), w_),
                  [t.float() for t in (x, lw, lb, w)], gy.float())
    for name, g, w_ in zip(["out", "dx", "d ln_weight", "d ln_bias", "dW"], got, want):
        assert g.dtype == torch.bfloat16 and REL_FLOOR < rel(g, w_) < REL_TOL, (name, rel(g, w_))


@gpu
@pytest.mark.parametrize("kind,grad_dtype", [("silu", E4M3), ("swiglu", E5M2)])
def test_gpu_ln_ffn_bf16_against_fp32(kind, grad_dtype):
    M, D, H = 700, 1024, 512
    gated = ff.ACTIVATIONS[kind][1]
    x = randn(M, D, seed=49, dtype=torch.bfloat16)
    wu = randn(2 * H if gated else H, D, seed=50, scale=D**-0.5, dtype=torch.bfloat16)
    wd = randn(D, H, seed=51, scale=H**-0.5, dtype=torch.bfloat16)
    gy = randn(M, D, seed=52, dtype=torch.bfloat16)
    got = _grads(lambda *t: ff.ln_ffn_fp8(t[0], None, None, t[1], t[2], kind=kind, grad_dtype=grad_dtype), [x, wu, wd], gy)
    want = _grads(lambda x_, wu_, wd_: F.linear(act_ref(F.linear(F.layer_norm(x_, (D,)), wu_), kind), wd_),
                  [t.float() for t in (x, wu, wd)], gy.float())
    for name, g, w_ in zip(["out", "dx", "dW_up", "dW_down"], got, want):
        assert REL_FLOOR < rel(g, w_) < CHAIN_TOL, (name, rel(g, w_))


@gpu
def test_gpu_producers_bit_equal_to_quant_act_dual():
    """Compiled kernels (fp8 stored by Triton's own conversion, not PyTorch's): the fused operand
    equals quant_act_dual of the fp32 values the producer returns."""
    M, D = 3000, 1216
    x = randn(M, D, seed=53, scale=3.0)
    r = ff.layernorm_quant(x, randn(D, seed=54), randn(D, seed=55), with_t=True, return_y=True)
    d = ft.quant_act_dual(r.y, with_t=True)
    for a, b in ((r.fp8.q, d.q), (r.fp8.s, d.s), (r.fp8.qt, d.qt), (r.fp8.st, d.st)):
        assert torch.equal(a.view(torch.uint8) if a.dtype == E4M3 else a, b.view(torch.uint8) if b.dtype == E4M3 else b)
    a = ff.act_quant(randn(M, 2 * 1000, seed=56), "swiglu", with_t=True, return_a=True)
    d = ft.quant_act_dual(a.a, with_t=True)
    for p, q_ in ((a.fp8.q, d.q), (a.fp8.qt, d.qt)):
        assert torch.equal(p.view(torch.uint8), q_.view(torch.uint8))
