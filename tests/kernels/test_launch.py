"""Direct launches of compiled kernels (`triton_attention._run`): argument order, reuse, and when not to.

A direct launch hands the compiled kernel's launcher every argument in signature order, as
Triton's JIT dispatch does. On CPU there is no compiled kernel, so these tests stand one in: the
"compiled kernel" maps the launcher's flat argument list back to parameter names and runs the
interpreted kernel with them. A wrong order or a missing constexpr then shows up as wrong outputs
or gradients against the reference, not only as a wrong call count.
"""

from __future__ import annotations

import pytest
import torch
from triton.runtime.jit import JITFunction

from coplan.kernels import gdpa, jagged_attention
from coplan.kernels import triton_attention as ta

from ._util import HAS_CUDA, TOLERANCE, assert_close, forward_backward, jagged

pytestmark = pytest.mark.skipif(HAS_CUDA, reason="stands in for compiled kernels with the interpreter")


class _Compiled:
    """What a direct launch reads from a compiled kernel: run, function, packed_metadata."""

    function = "function-handle"
    packed_metadata = "packed-metadata"

    def __init__(self, owner: "_Kernel"):
        self.owner = owner

    def run(self, g0, g1, g2, stream, function, packed, launch_metadata, enter_hook, exit_hook, *flat):
        assert (function, packed, stream) == (self.function, self.packed_metadata, 7)
        assert launch_metadata is None and enter_hook is None and exit_hook is None
        names = [p.name for p in self.owner.params]
        assert len(flat) == len(names), f"{len(flat)} arguments for {len(names)} parameters"
        self.owner.direct += 1
        self.owner.interpreted[(g0, g1, g2)](**dict(zip(names, flat)))


class _Kernel:
    """An interpreted kernel with the parameter list of its JIT twin, counting both kinds of launch."""

    def __init__(self, interpreted):
        self.interpreted = interpreted
        self.params = JITFunction(interpreted.fn, **interpreted.kwargs).params
        self.jit = self.direct = 0

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.jit += 1
            self.interpreted[grid](*args, **kwargs)
            return _Compiled(self)

        return launch


@pytest.fixture
def kernels(monkeypatch):
    fakes = {name: _Kernel(getattr(ta, name)) for name in ("_fwd_kernel", "_bwd_dq_kernel", "_bwd_dkdv_kernel")}
    for name, fake in fakes.items():
        monkeypatch.setattr(ta, name, fake)
    monkeypatch.setattr(ta, "DIRECT_LAUNCH", True)
    monkeypatch.setattr(ta, "_device_and_stream", lambda: (0, 7))
    monkeypatch.setattr(ta, "_launch_hooks_set", lambda: False)
    monkeypatch.setattr(ta, "_COMPILED", {})
    monkeypatch.setattr(ta, "_LAYOUT", {})
    return fakes


def _fn(op, q_offsets, k_offsets, causal, backend):
    if op == "softmax":
        return lambda q, k, v: jagged_attention(q, k, v, q_offsets, k_offsets, causal=causal, max_len=40,
                                                validate=False, backend=backend)
    return lambda q, k, v: gdpa(q, k, v, q_offsets, k_offsets, activation=op, causal=causal, max_len=40,
                                validate=False, backend=backend)


def _check(op, q, k, v, q_offsets, k_offsets, causal):
    out, grads, grad_out = forward_backward(_fn(op, q_offsets, k_offsets, causal, "triton"), q, k, v)
    ref, ref_grads, _ = forward_backward(_fn(op, q_offsets, k_offsets, causal, "reference"), q, k, v, grad_out)
    tol = TOLERANCE[("cpu", torch.float32)]
    assert_close("out", out, ref, tol)
    for name, got, want in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert_close(name, got, want, tol)
    return out, grads


@pytest.mark.timeout(300)
@pytest.mark.parametrize("op, cross", [("softmax", False), ("silu", True)])
def test_second_call_launches_directly_with_the_same_results(kernels, op, cross):
    q, q_offsets = jagged([21, 0, 9], 2, 16)
    if cross:
        k, k_offsets = jagged([5, 30, 2], 2, 16)
    else:
        k, k_offsets = torch.randn_like(q), None
    v = torch.randn_like(k)
    first = _check(op, q, k, v, q_offsets, k_offsets, True)
    assert [f.jit for f in kernels.values()] == [1, 1, 1] and [f.direct for f in kernels.values()] == [0, 0, 0]
    second = _check(op, q, k, v, q_offsets, k_offsets, True)
    assert [f.jit for f in kernels.values()] == [1, 1, 1] and [f.direct for f in kernels.values()] == [1, 1, 1]
    assert torch.equal(first[0], second[0])
    # Another batch of the same layer (new lengths, same strides and heads) reuses the kernels too.
    q2, q2_offsets = jagged([3, 40], 2, 16)
    k2, k2_offsets = (jagged([7, 11], 2, 16) if cross else (torch.randn_like(q2), None))
    _check(op, q2, k2, torch.randn_like(k2), q2_offsets, k2_offsets, True)
    assert [f.direct for f in kernels.values()] == [2, 2, 2]


@pytest.mark.timeout(300)
def test_what_changes_the_specialisation_goes_through_triton(kernels):
    q, offsets = jagged([13, 6], 2, 16)
    k, v = torch.randn_like(q), torch.randn_like(q)
    _check("silu", q, k, v, offsets, None, False)
    fwd = kernels["_fwd_kernel"]
    # A tensor off a 16-byte boundary: Triton compiled the kernel for aligned pointers.
    q_off = torch.randn(q.numel() + 1)[1:].view_as(q)
    q_off.copy_(q)
    assert q_off.data_ptr() % 16 != 0
    with torch.no_grad():
        got = _fn("silu", offsets, None, False, "triton")(q_off, k, v)
        want = _fn("silu", offsets, None, False, "reference")(q, k, v)
    assert_close("out", got, want, TOLERANCE[("cpu", torch.float32)])
    assert (fwd.jit, fwd.direct) == (2, 0)
    # One head instead of two: Triton specialises an int argument equal to 1.
    q1, k1, v1 = (x[:, :1].contiguous() for x in (q, k, v))
    _check("silu", q1, k1, v1, offsets, None, False)
    assert (fwd.jit, fwd.direct) == (3, 0)
    # Another compile-time constant (causal) is another kernel.
    _check("silu", q, k, v, offsets, None, True)
    assert (fwd.jit, fwd.direct) == (4, 0)
    _check("silu", q, k, v, offsets, None, True)
    assert (fwd.jit, fwd.direct) == (4, 1)


@pytest.mark.timeout(300)
def test_launch_hooks_and_the_switch_keep_triton_dispatch(kernels, monkeypatch):
    q, offsets = jagged([9, 4], 1, 16)
    k, v = torch.randn_like(q), torch.randn_like(q)
    fn = _fn("relu", offsets, None, True, "triton")
    with torch.no_grad():
        fn(q, k, v)
        monkeypatch.setattr(ta, "_launch_hooks_set", lambda: True)
        fn(q, k, v)
        monkeypatch.setattr(ta, "_launch_hooks_set", lambda: False)
        monkeypatch.setattr(ta, "DIRECT_LAUNCH", False)
        fn(q, k, v)
        monkeypatch.setattr(ta, "DIRECT_LAUNCH", True)
        fn(q, k, v)
    fwd = kernels["_fwd_kernel"]
    assert (fwd.jit, fwd.direct) == (3, 1)


def test_an_unexpected_kernel_object_turns_direct_launches_off(monkeypatch):
    """A Triton whose launch returns something else than a compiled kernel: the JIT path, for good."""
    monkeypatch.setattr(ta, "DIRECT_LAUNCH", True)
    monkeypatch.setattr(ta, "_device_and_stream", lambda: (0, 7))
    monkeypatch.setattr(ta, "_COMPILED", {})
    monkeypatch.setattr(ta, "_LAYOUT", {})
    calls = []

    class Odd:
        params = _Kernel(ta._fwd_kernel).params

        def __getitem__(self, grid):
            return lambda *a, **kw: calls.append(grid)  # returns None, not a compiled kernel

    args = [torch.empty(0)] * 8 + [16] * 8 + [0, 1, 2, 1.0, 1.0, 1, 1, 1]
    consts = dict(MODE=0, ACT=0, CAUSAL=True, HEAD_DIM=16, FAST=False, PRECISION="ieee")
    ta._run("fwd", Odd(), 3, args, consts, (16, 16, 4, 1), (torch.float32,), True)
    assert calls == [(3,)] and ta.DIRECT_LAUNCH is False
