"""The attention custom ops' direct dispatch (``--compile layers``): calls that need no gradient skip
``custom_op``'s Python layers and compute the same numbers; calls that need a gradient, or come with
fake or functional tensors (tracing), still take ``custom_op``'s path. Triton interpreter on CPU."""

from __future__ import annotations

import cProfile
import os
import pstats

import pytest
import torch

from coplan.kernels import ops

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs the Triton interpreter on CPU")

H, D = 2, 16


def _inputs(seed: int = 0, grad: bool = False):
    g = torch.Generator().manual_seed(seed)
    offsets = torch.tensor([0, 5, 12, 20], dtype=torch.int32)
    q, k, v = (torch.randn(20, H, D, generator=g, requires_grad=grad) for _ in range(3))
    return q, k, v, offsets


def _gdpa(q, k, v, off):
    return torch.ops.coplan.jagged_gdpa.default(q, k, v, off, off, 8, 8, True, 0.25, 0.125, "silu")


def _took_custom_op_path(fn) -> bool:
    """Whether ``custom_op``'s Python autograd kernel ran the call (its ``forward_no_grad`` or ``Generated``)."""
    prof = cProfile.Profile()
    prof.runcall(fn)
    names = {(f, name) for (f, _, name) in pstats.Stats(prof).stats}
    return any(f.endswith(os.path.join("_library", "autograd.py")) for f, _ in names)


@pytest.fixture
def direct():
    was = ops.direct_dispatch_enabled()
    ops.enable_direct_dispatch()
    yield
    if not was:
        ops.disable_direct_dispatch()


def test_no_grad_calls_skip_the_custom_op_layers_and_match_bit_for_bit(direct):
    q, k, v, off = _inputs()
    g = torch.randn(20, H, D)
    with torch.no_grad():
        assert not _took_custom_op_path(lambda: _gdpa(q, k, v, off))
        fast = _gdpa(q, k, v, off)
        fast_bwd = torch.ops.coplan.jagged_gdpa_backward.default(g, q, k, v, off, off, 8, 8, True, 0.25, 0.125, "silu")
        fast_sm = torch.ops.coplan.jagged_softmax_attention.default(q, k, v, off, off, 8, 8, True, 0.25)
        ops.disable_direct_dispatch()
        assert _took_custom_op_path(lambda: _gdpa(q, k, v, off))
        slow = _gdpa(q, k, v, off)
        slow_bwd = torch.ops.coplan.jagged_gdpa_backward.default(g, q, k, v, off, off, 8, 8, True, 0.25, 0.125, "silu")
        slow_sm = torch.ops.coplan.jagged_softmax_attention.default(q, k, v, off, off, 8, 8, True, 0.25)
    assert torch.equal(fast, slow)
    assert all(torch.equal(a, b) for a, b in zip(fast_bwd, slow_bwd))
    assert all(torch.equal(a, b) for a, b in zip(fast_sm, slow_sm))


def test_calls_that_need_a_gradient_keep_the_autograd_path(direct):
    q, k, v, off = _inputs(1, grad=True)
    assert _took_custom_op_path(lambda: _gdpa(q, k, v, off))
    out = _gdpa(q, k, v, off)
    assert out.grad_fn is not None
    out.square().sum().backward()
    grads = [x.grad.clone() for x in (q, k, v)]
    ops.disable_direct_dispatch()
    q2, k2, v2, _ = _inputs(1, grad=True)
    _gdpa(q2, k2, v2, off).square().sum().backward()
    assert all(torch.equal(a, b.grad) for a, b in zip(grads, (q2, k2, v2)))


def test_compiled_graph_matches_with_and_without_direct_dispatch(direct):
    """AOTAutograd traces the op with fake and functional tensors (the custom op's path), and the
    compiled forward and backward then call it on plain tensors under no_grad (the direct path)."""
    def f(q, k, v, off):
        return torch.nn.functional.silu(_gdpa(q * 2.0, k, v, off)).sum(dim=-1)

    results = []
    for on in (True, False):
        (ops.enable_direct_dispatch if on else ops.disable_direct_dispatch)()
        torch._dynamo.reset()
        q, k, v, off = _inputs(2, grad=True)
        out = torch.compile(f, backend="aot_eager", fullgraph=True)(q, k, v, off)
        out.sum().backward()
        results.append((out.detach(), q.grad, k.grad, v.grad))
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_subclass_tensors_are_not_taken_directly(direct):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode, torch.no_grad():
        q, k, v, off = (mode.from_tensor(x) for x in _inputs(3))
        out = _gdpa(q, k, v, off)  # the fake implementation: no launch on fake tensors
    assert out.shape == (20, H, D)


def test_without_torchs_private_helper_direct_dispatch_stays_off_with_a_warning(monkeypatch):
    """The fallback rests on ``torch._library.autograd.make_autograd_impl`` (private): where a torch lacks
    it, enabling warns and leaves custom_op's dispatch in place, and the ops still compute."""
    import torch._library.autograd as tla

    monkeypatch.setattr(ops, "_DIRECT_LIB", None)
    monkeypatch.setattr(ops, "_DIRECT_ON", False)
    monkeypatch.delattr(tla, "make_autograd_impl")
    with pytest.warns(RuntimeWarning, match="direct dispatch .* unavailable"):
        ops.enable_direct_dispatch()
    assert not ops.direct_dispatch_enabled() and ops._DIRECT_LIB is None
    q, k, v, off = _inputs()
    with torch.no_grad():
        assert torch.isfinite(_gdpa(q, k, v, off)).all()
