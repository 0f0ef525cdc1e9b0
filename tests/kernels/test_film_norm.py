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
    layer.film_fused = True
    monkeypatch.setattr(L, "film_kernel_applies", lambda h: True)
    got = run()
    torch.testing.assert_close(got[0], want[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got[1], want[1], rtol=1e-4, atol=1e-4)
    for a, b in zip(got[2], want[2]):
        if b is None:
            assert a is None
            continue
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3)
