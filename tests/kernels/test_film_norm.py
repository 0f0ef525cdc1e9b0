"""The fused FiLM LayerNorm (``coplan.kernels.film_norm``) against PyTorch, forward and backward.

On CPU the kernels run in Triton's interpreter (fp32 and fp16: the interpreter's bf16 is not trusted);
on a GPU also in bf16. Lengths include empty samples, samples shorter than a row block (the per-element
atomic path), samples spanning several blocks, and padded rows past the last sample."""

from __future__ import annotations

import pytest
import torch

from coplan.kernels.film_norm import FilmInputError, film_layer_norm, film_layer_norm_reference

from .conftest import DEVICE, gpu

CASES = [
    ([5, 0, 37, 1, 3, 2, 64], 96, 0),    # short samples inside one block, an empty one, width below a chunk
    ([100, 3, 250], 320, 0),              # blocks spanning samples, width not a multiple of 128
    ([7, 9], 128, 11),                    # padded rows past the last sample
    ([1], 64, 0),
]


def _inputs(lengths, d, pad, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    total = sum(lengths) + pad
    b = len(lengths)
    h = (torch.randn(total, d, generator=g) * 2 + 0.5)
    w = torch.randn(d, generator=g) * 0.5 + 1
    bias = torch.randn(d, generator=g) * 0.1
    gb = torch.randn(b, 2 * d, generator=g) * 0.3
    seg = torch.repeat_interleave(torch.arange(b), torch.tensor(lengths))
    seg = torch.cat([seg, torch.full((pad,), b - 1)])
    to = dict(device=DEVICE, dtype=dtype)
    return (h.to(**to).requires_grad_(), w.to(**to).requires_grad_(), bias.to(**to).requires_grad_(),
            gb.to(**to).requires_grad_(), seg.to(DEVICE))


def _run(fn, h, w, bias, gb, seg, dz):
    gamma, beta = gb.chunk(2, dim=-1)  # non-contiguous halves, as the layer passes them
    out = fn(h, w, bias, gamma, beta, seg)
    grads = torch.autograd.grad(out, (h, w, bias, gb), dz)
    return out, grads


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else []))
@pytest.mark.parametrize("lengths,d,pad", CASES)
def test_matches_pytorch(lengths, d, pad, dtype):
    h, w, bias, gb, seg = _inputs(lengths, d, pad, dtype)
    g = torch.Generator().manual_seed(1)
    dz = torch.randn(h.shape, generator=g).to(device=DEVICE, dtype=dtype)
    if pad:
        dz[sum(lengths):] = 0  # the layer's padded rows get no gradient (mask_rows)
    got, ggot = _run(film_layer_norm, h, w, bias, gb, seg, dz)
    ref_in = [t.detach().float().requires_grad_() for t in (h, w, bias, gb)]
    want, gwant = _run(film_layer_norm_reference, *ref_in, seg, dz.float())
    assert got.dtype == dtype and got.shape == want.shape
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)
    for name, a, b in zip(("dh", "dweight", "dbias", "dgamma_beta"), ggot, gwant):
        scale = max(1.0, float(b.abs().max()))
        torch.testing.assert_close(a.float() / scale, b / scale, rtol=tol, atol=tol, msg=lambda m: f"{name}: {m}")


def test_the_per_sample_sums_see_every_row():
    """Every sample's dγ and dβ, block boundaries wherever they fall (lengths 1..40 over 16-row blocks)."""
    lengths = list(range(1, 41))
    h, w, bias, gb, seg = _inputs(lengths, 32, 0, torch.float32, seed=3)
    dz = torch.ones(h.shape, device=DEVICE)
    _, (_, _, _, dgb) = _run(film_layer_norm, h, w, bias, gb, seg, dz)
    dbeta = dgb[:, 32:]
    assert torch.allclose(dbeta, torch.tensor(lengths, dtype=torch.float32, device=DEVICE)[:, None].expand(-1, 32))


def test_no_tokens():
    h, w, bias, gb, seg = _inputs([0, 0], 16, 0, torch.float32)
    out, (dh, dw, db, dgb) = _run(film_layer_norm, h, w, bias, gb, seg, torch.zeros(0, 16, device=DEVICE))
    assert out.shape == (0, 16) and dh.shape == (0, 16) and float(dgb.abs().sum()) == 0 and float(dw.abs().sum()) == 0


def test_bad_inputs_are_named():
    h, w, bias, gb, seg = _inputs([3, 4], 16, 0, torch.float32)
    gamma, beta = gb.chunk(2, dim=-1)
    with pytest.raises(FilmInputError, match="seg"):
        film_layer_norm(h, w, bias, gamma, beta, seg[:-1])
    with pytest.raises(FilmInputError, match="gamma"):
        film_layer_norm(h, w, bias, gamma[:, :8], beta, seg)
    with pytest.raises(FilmInputError, match="weight"):
        film_layer_norm(h, w[:8], bias, gamma, beta, seg)
    with pytest.raises(FilmInputError, match=r"h must be \[tokens, width\]"):
        film_layer_norm(h[None], w, bias, gamma, beta, seg)


def test_seg_values_outside_the_samples_are_refused_unless_told_not_to_check():
    h, w, bias, gb, seg = _inputs([3, 4], 16, 0, torch.float32)
    gamma, beta = gb.chunk(2, dim=-1)
    for bad in (seg + 1, seg - 1):  # 2 (only samples 0 and 1 exist), -1
        with pytest.raises(FilmInputError, match=r"seg values must name a sample row of gamma/beta \(0 to 1\)"):
            film_layer_norm(h, w, bias, gamma, beta, bad)
    good = film_layer_norm(h, w, bias, gamma, beta, seg)
    torch.testing.assert_close(film_layer_norm(h, w, bias, gamma, beta, seg, validate=False), good)
    # the check does not ask for sorted rows: the kernels take samples in any order
    perm = torch.tensor([6, 0, 3, 1, 5, 2, 4], device=seg.device)
    torch.testing.assert_close(film_layer_norm(h[perm], w, bias, gamma, beta, seg[perm]), good[perm])


@gpu
def test_bf16_layer_path_matches_pytorch_on_gpu():
    """At a layer's size (4k tokens, width 1024) in bf16: within bf16 rounding of the PyTorch expression."""
    lengths = [int(x) for x in torch.randint(0, 200, (40,), generator=torch.Generator().manual_seed(0))]
    h, w, bias, gb, seg = _inputs(lengths, 1024, 0, torch.bfloat16)
    dz = torch.randn(h.shape, device=DEVICE, dtype=torch.bfloat16)
    got, ggot = _run(film_layer_norm, h, w, bias, gb, seg, dz)
    ref_in = [t.detach().float().requires_grad_() for t in (h, w, bias, gb)]
    want, gwant = _run(film_layer_norm_reference, *ref_in, seg, dz.float())
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)
    for a, b in zip(ggot, gwant):
        scale = max(1.0, float(b.abs().max()))
        torch.testing.assert_close(a.float() / scale, b / scale, rtol=2e-2, atol=2e-2)


def test_an_interformer_layer_gives_the_same_with_the_kernel(monkeypatch):
    """A whole InterFormer layer (fp32, padded rows included) with the fused FiLM LayerNorm against the same
    layer with PyTorch's: same output, same gradients of every parameter and input."""
    from coplan.sample import sample_workload
    from coplan.trainer.model import layers as L

    w = sample_workload("h200-1gpu", 0)
    block = next(b for b in w.blocks if b.type == "interformer")
    torch.manual_seed(0)
    layer = L.InterFormerLayer("interformer.0", block, 24, 64, "reference").to(DEVICE)
    torch.nn.init.normal_(layer.film.weight, std=0.3)  # (zero at init: make the modulation count)
    d = block.model_dim
    lengths = [5, 0, 19, 1]
    offsets = torch.tensor([0, 5, 5, 24, 25], device=DEVICE)
    total = 25 + 3  # three padded rows
    valid = torch.arange(total, device=DEVICE) < 25
    g = torch.Generator().manual_seed(2)
    h0 = torch.randn(total, d, generator=g).to(DEVICE)
    s0 = torch.randn(len(lengths), block.num_summary_tokens, d, generator=g).to(DEVICE)
    ctx = torch.randn(len(lengths), 24, generator=g).to(DEVICE)

    def run():
        h, s = h0.clone().requires_grad_(), s0.clone().requires_grad_()
        out_h, out_s = layer(h, offsets, s, ctx, valid)
        loss = (out_h[valid] ** 2).sum() + (out_s ** 2).sum()
        params = [p for p in layer.parameters()]
        grads = torch.autograd.grad(loss, [h, s, *params], allow_unused=True)
        return out_h[valid].detach(), out_s.detach(), grads

    want = run()
    layer.film_fused = layer.norm_fused = True  # the FiLM kernel and the plain LayerNorms (norm2, summary_norm)
    monkeypatch.setattr(L, "film_kernel_applies", lambda h: True)
    monkeypatch.setattr(L, "FUSED_NORM_MIN_ROWS", 0)  # (the test's few rows: take the kernels anyway)
    got = run()
    torch.testing.assert_close(got[0], want[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got[1], want[1], rtol=1e-4, atol=1e-4)
    for a, b in zip(got[2], want[2]):
        if b is None:
            assert a is None
            continue
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3)


# --------------------------------------------------------------------------------------------
# The persistent backward: program ranges, R-row steps and samples against each other
# --------------------------------------------------------------------------------------------


def _check_film(lengths, d, pad=0, dtype=torch.float32, seed=0):
    h, w, bias, gb, seg = _inputs(lengths, d, pad, dtype, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    dz = torch.randn(h.shape, generator=g).to(device=DEVICE, dtype=dtype)
    if pad:
        dz[sum(lengths):] = 0
    got, ggot = _run(film_layer_norm, h, w, bias, gb, seg, dz)
    ref_in = [t.detach().float().requires_grad_() for t in (h, w, bias, gb)]
    want, gwant = _run(film_layer_norm_reference, *ref_in, seg, dz.float())
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)
    for name, a, b in zip(("dh", "dweight", "dbias", "dgamma_beta"), ggot, gwant):
        scale = max(1.0, float(b.abs().max()))
        torch.testing.assert_close(a.float() / scale, b / scale, rtol=tol, atol=tol, msg=lambda m: f"{name}: {m}")


def test_program_ranges_start_and_end_mid_sample():
    """Width 96: BLOCK_D 128, one warp, R = 32 elements a thread · 32 threads / 128 = 8 rows a step. 277 rows:
    cdiv(277, 8) = 35 steps over the interpreter's 4 programs: cdiv(35, 4) = 9 steps, 72 rows a program,
    cdiv(277, 72) = 4 programs, rows [0, 72), [72, 144), [144, 216), [216, 277). Sample ends (cumulative lengths)
    45, 47, 50, 51, 55, 55, 62, 212, 217, 277:
    - steps 40-47 and 48-55 hold several samples each: the end of 0, samples 1 (2 rows), 2 (3 rows, across the
      two steps), 3 (1 row) and 4 (4 rows) whole inside one step, 5 empty, the start of 6;
    - sample 7 (rows 62-211, 150 rows) is longer than a program's range: it ends program 0, fills program 1
      entirely and takes most of program 2;
    - sample 8 (rows 212-216) starts in program 2's last step and ends in program 3's first (row 216), which
      also starts sample 9."""
    lengths = [45, 2, 3, 1, 4, 0, 7, 150, 5, 60]
    if DEVICE == "cpu":
        from coplan.kernels import film_norm as fn

        assert fn._bwd_plan(sum(lengths), 96, torch.device("cpu")) == (128, 8, 1, 4, 72)
    _check_film(lengths, 96, seed=5)
    _check_film(lengths, 96, dtype=torch.float16, seed=6)


@pytest.mark.parametrize("programs", [1, 3, 7])
def test_many_samples_shorter_than_a_step(programs, monkeypatch):
    """80 samples of 0-9 rows at width 96 (R = 8 rows a step): most are shorter than a step, so nearly every step
    holds several whole samples and its neighbours' ends; 1, 3 and 7 programs move the range boundaries about.
    Padded rows at the end."""
    from coplan.kernels import film_norm as fn

    monkeypatch.setattr(fn, "INTERPRET_PROGRAMS", programs)
    lengths = [int(x) for x in torch.randint(0, 10, (80,), generator=torch.Generator().manual_seed(programs))]
    _check_film(lengths, 96, pad=9, seed=programs)


@pytest.mark.parametrize("lengths,d", [
    ([3, 0, 2], 96),          # fewer rows than a step (T = 5 < R = 8)
    ([9, 1, 0, 30], 5),       # width below 16 (BLOCK_D 16, R 64: one step)
    ([700, 1], 24),           # BLOCK_D 32, R 32: 701 rows, 22 steps, 4 programs of 192 rows (the last 125)
    ([40, 200, 13], 1000),    # BLOCK_D 1024, four warps, R 4: the layer's widths
    ([30, 1, 2, 90], 320),    # BLOCK_D 512, two warps, R 4
])
def test_odd_shapes(lengths, d):
    _check_film(lengths, d, seed=d)


def _spy_launches(monkeypatch):
    from coplan.kernels import film_norm as fn

    seen = []
    real = fn.launch_kernel

    def spy(kernel, grid, args, consts, num_warps):
        seen.append((kernel, dict(consts)))
        return real(kernel, grid, args, consts, num_warps)

    monkeypatch.setattr(fn, "launch_kernel", spy)
    return fn, seen


def test_film_gradients_only_where_asked(monkeypatch):
    """γ, β that need no gradient get none and cost no work (FILM_GRAD off); likewise weight and bias (PARAM_GRAD);
    dh is still right. Only one of γ, β asked for: the other's gradient is None."""
    fn, seen = _spy_launches(monkeypatch)
    lengths, d = [20, 1, 50], 96
    h, w, bias, gb, seg = _inputs(lengths, d, 0, torch.float32, seed=9)
    gamma, beta = (t.detach().contiguous() for t in gb.chunk(2, dim=-1))
    dz = torch.randn(h.shape, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    ref_h = h.detach().float().requires_grad_()
    ref_out = film_layer_norm_reference(ref_h, w.detach(), bias.detach(), gamma, beta, seg)
    (want,) = torch.autograd.grad(ref_out, ref_h, dz)

    out = film_layer_norm(h, w.detach(), bias.detach(), gamma, beta, seg)
    (got,) = torch.autograd.grad(out, h, dz)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    bwd = [c for k, c in seen if k is fn._film_ln_bwd_kernel]
    assert [(c["HAS_FILM"], c["FILM_GRAD"], c["PARAM_GRAD"]) for c in bwd] == [(True, False, False)]

    # the Function's own answer: None for what is not asked
    g2, b2 = gamma.clone().requires_grad_(), beta.clone()
    out = film_layer_norm(h, w, bias, g2, b2, seg)
    node = out.grad_fn
    assert node.needs_input_grad[3] and not node.needs_input_grad[4]
    grads = node.apply(dz)
    assert grads[3] is not None and grads[4] is None and all(g is not None for g in grads[:3])
    (dg2,) = torch.autograd.grad(out, g2, dz)
    ref_g = gamma.clone().requires_grad_()
    (want_g,) = torch.autograd.grad(film_layer_norm_reference(h.detach(), w.detach(), bias.detach(), ref_g, beta, seg),
                                    ref_g, dz)
    torch.testing.assert_close(dg2, want_g, rtol=1e-4, atol=1e-4)


# --------------------------------------------------------------------------------------------
# layer_norm: the same kernels without FiLM
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else []))
@pytest.mark.parametrize("shape,affine", [
    # (without FiLM a thread holds 16 elements of a step: R = 16 · 32 · warps / BLOCK_D)
    ((300, 96), True),         # R = 4: cdiv(300, 4) = 75 steps, 4 programs of 76 rows (the last 72)
    ((2, 37, 200), True),      # leading dimensions; width not a power of two (BLOCK_D 256, R 2)
    ((50, 5), True),           # width below 16 (BLOCK_D 16, R 32: 2 steps, 2 programs, the second of 18 rows)
    ((129, 48), False),        # no weight, no bias
    ((7, 1000), True),         # R = 2: 4 steps, 4 programs, the last of one row; 1,000 of 1,024 columns
])
def test_layer_norm_matches_pytorch(shape, affine, dtype):
    from coplan.kernels.film_norm import layer_norm

    g = torch.Generator().manual_seed(sum(shape))
    d = shape[-1]
    to = dict(device=DEVICE, dtype=dtype)
    x = (torch.randn(shape, generator=g) * 3 - 1).to(**to).requires_grad_()
    w = (torch.randn(d, generator=g) * 0.5 + 1).to(**to).requires_grad_() if affine else None
    b = (torch.randn(d, generator=g) * 0.2).to(**to).requires_grad_() if affine else None
    dz = torch.randn(shape, generator=g).to(**to)
    leaves = [t for t in (x, w, b) if t is not None]
    got = layer_norm(x, w, b, 1e-5)
    ggot = torch.autograd.grad(got, leaves, dz)
    ref = [t.detach().float().requires_grad_() for t in leaves]
    want = torch.nn.functional.layer_norm(ref[0], (d,), *(ref[1:] if affine else (None, None)), 1e-5)
    gwant = torch.autograd.grad(want, ref, dz.float())
    assert got.shape == x.shape and got.dtype == dtype
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)
    for name, a, r in zip(("dh", "dweight", "dbias"), ggot, gwant):
        assert a.dtype == dtype
        scale = max(1.0, float(r.abs().max()))
        torch.testing.assert_close(a.float() / scale, r / scale, rtol=tol, atol=tol, msg=lambda m: f"{name}: {m}")


def test_layer_norm_runs_the_kernels_without_film(monkeypatch):
    from coplan.kernels.film_norm import layer_norm

    fn, seen = _spy_launches(monkeypatch)
    x = torch.randn(40, 64, device=DEVICE, requires_grad=True)
    w = torch.ones(64, device=DEVICE)  # needs no gradient: dw's partials are skipped
    b = torch.zeros(64, device=DEVICE, requires_grad=True)
    layer_norm(x, w, b).sum().backward()
    assert [c["HAS_FILM"] for _, c in seen] == [False, False]
    assert seen[1][1]["PARAM_GRAD"] and not seen[1][1]["FILM_GRAD"]
    assert w.grad is None and b.grad is not None and x.grad is not None


def test_layer_norm_edge_cases():
    from coplan.kernels.film_norm import layer_norm

    x = torch.zeros(0, 3, 16, device=DEVICE, requires_grad=True)
    w = torch.ones(16, device=DEVICE, requires_grad=True)
    out = layer_norm(x, w, None)
    (dx, dw) = torch.autograd.grad(out, (x, w), torch.zeros_like(out))
    assert out.shape == (0, 3, 16) and dx.shape == x.shape and float(dw.abs().sum()) == 0
    one = torch.randn(16, device=DEVICE)  # a single row, no leading dimension
    torch.testing.assert_close(layer_norm(one, None, None), torch.nn.functional.layer_norm(one, (16,)),
                               rtol=1e-5, atol=1e-5)
    with pytest.raises(FilmInputError, match="weight must have 16 elements"):
        layer_norm(one, torch.ones(8, device=DEVICE), None)
    with pytest.raises(FilmInputError, match=r"h must be \[\.\.\., width\]"):
        layer_norm(torch.tensor(1.0, device=DEVICE), None, None)
