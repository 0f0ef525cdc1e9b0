"""Host-path details of the eager attention call that results alone would not show.

- dK and dV in one allocation (``attention_backward(..., dkdv_one_buffer=True)``): the gradients
  are bitwise those of separate buffers, autograd's accumulation into leaves takes them without a
  copy (one storage of exactly dK's and dV's bytes), and the default keeps them apart (the custom
  ops' outputs may not alias).
- Launch grids are sized on the host without ``triton.cdiv`` (a JIT-level function since Triton 3.6).
"""

from __future__ import annotations

import functools

import pytest
import torch
import triton

from coplan.kernels import jagged_attention, ops
from coplan.kernels import triton_attention as ta

from ._util import DEVICE, jagged


def _leaves(q, k, v):
    return [t.detach().clone().requires_grad_() for t in (q, k, v)]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("op", ["softmax", "silu"])
def test_one_dkdv_buffer_is_stolen_by_autograd_and_changes_no_bit(monkeypatch, op):
    q, offsets = jagged([13, 0, 21], 2, 16, device=DEVICE)
    k, v, g = torch.randn_like(q), torch.randn_like(q), torch.randn_like(q)

    def run():
        xs = _leaves(q, k, v)
        if op == "softmax":
            out = jagged_attention(*xs, offsets, causal=True, max_len=32, validate=False, backend="triton")
        else:
            from coplan.kernels import gdpa

            out = gdpa(*xs, offsets, activation=op, causal=True, max_len=32, validate=False, backend="triton")
        out.backward(g)
        return [x.grad for x in xs]

    separate = run()
    assert separate[1].untyped_storage().data_ptr() != separate[2].untyped_storage().data_ptr()
    monkeypatch.setattr(ops, "attention_backward", functools.partial(ta.attention_backward, dkdv_one_buffer=True))
    shared = run()
    for a, b in zip(separate, shared):
        assert torch.equal(a, b)
    dk, dv = shared[1], shared[2]
    # Stolen, not copied: both gradients still live in the backward's one buffer, which holds
    # exactly their bytes, and each is laid out like its leaf.
    assert dk.untyped_storage().data_ptr() == dv.untyped_storage().data_ptr()
    assert dk.untyped_storage().nbytes() == 2 * k.numel() * k.element_size()
    assert dv.data_ptr() - dk.data_ptr() == k.numel() * k.element_size()
    assert dk.stride() == k.stride() and dv.stride() == v.stride()


def test_default_backward_keeps_dk_and_dv_apart():
    """The custom ops call attention_backward with its default: their outputs must not alias."""
    q, offsets = jagged([5, 9], 1, 16, device=DEVICE)
    k, v, g = torch.randn_like(q), torch.randn_like(q), torch.randn_like(q)
    dq, dk, dv = torch.ops.coplan.jagged_gdpa_backward(g, q, k, v, offsets, offsets, 16, 16, True, 0.25, 1.0, "silu")
    storages = {t.untyped_storage().data_ptr() for t in (dq, dk, dv)}
    assert len(storages) == 3


def test_launch_grid_does_not_call_triton_cdiv(monkeypatch):
    def refuse(*_a, **_k):
        raise AssertionError("triton.cdiv called on the host launch path")

    monkeypatch.setattr(triton, "cdiv", refuse)
    seen = []
    monkeypatch.setattr(ta, "_run", lambda kind, plain, grid0, *a: seen.append((kind, grid0)))
    monkeypatch.setattr(ta, "_fixed_config", lambda kind, d: (64, 32, 4, 1))
    consts = dict(HEAD_DIM=64)
    ta._launch("fwd", None, None, 129, 3, 4, [], consts, ())
    ta._launch("dkdv", None, None, 64, 3, 4, [], consts, ())
    # fwd: cdiv(129, BLOCK_M=64) + batch = 6 blocks per head; dkdv: cdiv(64, BLOCK_N=32) + 3 = 5.
    assert seen == [("fwd", 24), ("dkdv", 20)]
    assert ta._cdiv(0, 16) == 0 and ta._cdiv(1, 16) == 1 and ta._cdiv(32, 16) == 2 and ta._cdiv(33, 16) == 3
