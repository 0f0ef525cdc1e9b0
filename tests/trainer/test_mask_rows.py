"""Padded jagged rows (the CUDA graphs' buckets): an InterFormer layer that masks each tensor only in the
direction its other side reads gives the unpadded layer's outputs and gradients, even when the attention
kernels leave whatever memory held in the padded rows of their outputs and input gradients (as the Triton
kernels do; simulated here around the reference kernel)."""

from __future__ import annotations

import pytest
import torch

from coplan.spec.workload import Attention, InterFormerBlock
from coplan.trainer.model import layers
from coplan.trainer.model.layers import InterFormerLayer, mask_rows

from .test_graphs import _Poison  # NaN in the rows past an end, forward and backward


def _garbage_attention(real: int):
    inner = layers.jagged_attention

    def attention(q, k, v, q_offsets, k_offsets, **kw):
        nq = real if k_offsets is None else q.shape[0]
        # the kernel sees q, k, v as they come, and runs on the samples' rows only
        q_ = _Poison.apply(q, nq)
        k_, v_ = _Poison.apply(k, real), _Poison.apply(v, real)
        out = inner(q_[:nq] if k_offsets is None else q_, k_[:real], v_[:real], q_offsets, k_offsets, **kw)
        if k_offsets is None:  # self-attention: the output has the padded rows too, left as garbage
            out = torch.cat([out, torch.full((q.shape[0] - nq, *out.shape[1:]), float("nan"), dtype=out.dtype)])
        return _Poison.apply(out, nq) if k_offsets is None else out

    return attention


@pytest.mark.parametrize("kind", ["gdpa", "softmax"])
def test_padded_rows_never_reach_outputs_or_gradients(monkeypatch, kind):
    torch.manual_seed(0)
    block = InterFormerBlock(sequence="history", num_layers=1, model_dim=16, num_heads=2, head_dim=8, num_summary_tokens=2,
                             attention=Attention(kind=kind, activation="silu", causal=True))
    layer = InterFormerLayer("interformer.0", block, ctx_dim=16, max_len=8, backend="reference")
    with torch.no_grad():  # FiLM starts at zero: give it weight so its path is exercised
        layer.film.weight.normal_(0, 0.1)
    lengths = torch.tensor([3, 5, 2])
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    real, pad = int(offsets[-1]), 4
    h = torch.randn(real, 16, dtype=torch.float32)
    ctx = torch.randn(3, 16, dtype=torch.float32)
    summary = torch.randn(3, 2, 16, dtype=torch.float32)

    def run(padded: bool):
        layer.zero_grad()
        hin = torch.cat([h, torch.zeros(pad, 16, dtype=h.dtype)]) if padded else h
        valid = torch.arange(hin.shape[0]) < real if padded else None
        out, s = layer(hin, offsets, summary, ctx, valid)
        loss = (mask_rows(out, valid)[:real] ** 2).sum() + (s ** 2).sum()
        loss.backward()
        return out[:real].detach(), s.detach(), {n: p.grad.clone() for n, p in layer.named_parameters()}

    want = run(False)
    monkeypatch.setattr(layers, "jagged_attention", _garbage_attention(real))
    got = run(True)
    torch.testing.assert_close(got[0], want[0])
    torch.testing.assert_close(got[1], want[1])
    for n, g in want[2].items():
        assert torch.isfinite(got[2][n]).all(), n
        torch.testing.assert_close(got[2][n], g, msg=n)


def test_one_direction_masks():
    x = torch.arange(12.0).view(4, 3).requires_grad_()
    valid = torch.tensor([True, True, False, False])
    y = mask_rows(x, valid, backward=False)
    assert (y[2:] == 0).all() and torch.equal(y[:2], x[:2].detach())
    y.backward(torch.ones_like(y))
    assert (x.grad == 1).all()  # passed through as it came
    x.grad = None
    z = mask_rows(x, valid, forward=False)
    assert torch.equal(z, x.detach())
    z.backward(torch.ones_like(z))
    assert (x.grad[2:] == 0).all() and (x.grad[:2] == 1).all()
    assert mask_rows(x, None, forward=False) is x
