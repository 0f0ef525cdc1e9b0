"""CUDA-graph capture of both ops' forward + backward (GPU only), and what capture depends on (CPU too).

A training step under CUDA graphs (or `torch.compile` with cudagraphs) needs every launch of the
forward and backward to be capturable: no host read of device values, no allocation outside the
graph's pool, no autotuning during capture. Capture after eager warm-up calls on a side stream,
replay on new inputs copied into the same buffers, and compare with eager calls on those inputs.

The second capture test reproduces the attention benchmark's conditions, where softmax's capture
failed on the H200 while this file's first test passed: autotuning on, the bucket tuned by eager
calls on the default stream before the capture, and sizes like shape (b) (4 heads x 64, bf16, many
short samples) kept small. An autograd graph that outlives its call keeps the AccumulateGrad nodes
of the leaves, whose stream is fixed when they are made; one made by an eager call on the default
stream then turns the captured backward's gradient accumulation into a wait of the default stream
on the capturing one, which invalidates the capture. The last test checks, on CPU as well, that
nothing in the kernel layer keeps a call's graph alive once its output is dropped.
"""

from __future__ import annotations

import gc
import math
import weakref

import pytest
import torch

from coplan.kernels import gdpa, jagged_attention
from coplan.kernels import triton_attention as ta
from coplan.kernels.common import Activation

from ._util import HAS_CUDA, assert_close, jagged

gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")

LENGTHS = [37, 1, 200, 64, 0, 129]
HEADS, HEAD_DIM, MAX_LEN = 2, 64, 256


def _softmax(q, k, v, off, max_len=MAX_LEN):
    return jagged_attention(q, k, v, off, causal=True, max_len=max_len, validate=False, backend="triton")


def _gdpa(q, k, v, off, max_len=MAX_LEN):
    return gdpa(q, k, v, off, activation="silu", causal=True, max_len=max_len, validate=False, backend="triton")


OPS = [pytest.param(_softmax, id="softmax"), pytest.param(_gdpa, id="gdpa")]


def _capture_and_compare(op, q, k, v, off, g, gen, max_len):
    """Warm up on a side stream, capture forward + backward, replay on new inputs, compare with eager."""
    dtype = q.dtype
    out_buf = torch.empty_like(q)

    def step():
        out = op(q, k, v, off, max_len)
        out.backward(g)
        out_buf.copy_(out.detach())

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            for x in (q, k, v):
                x.grad = None
            step()
    torch.cuda.current_stream().wait_stream(side)
    # Setting .grad to None inside a capture would allocate new gradients on every replay: keep
    # them allocated (the captured backward accumulates into them) and zero them before a replay.
    for x in (q, k, v):
        x.grad = torch.zeros_like(x)

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()

    # New inputs into the same buffers, then replay against eager on those inputs.
    with torch.no_grad():
        for x in (q, k, v):
            x.copy_(torch.randn(x.shape, generator=gen).to(x.device, dtype))
            x.grad.zero_()
    graph.replay()
    torch.cuda.synchronize()
    got = (out_buf.clone(), *(x.grad.clone() for x in (q, k, v)))

    qe, ke, ve = (x.detach().clone().requires_grad_(True) for x in (q, k, v))
    oe = op(qe, ke, ve, off, max_len)
    oe.backward(g)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, (oe.detach(), qe.grad, ke.grad, ve.grad)):
        assert_close(name, a.float(), b.float(), 1e-3)


@gpu
@pytest.mark.parametrize("op", OPS)
def test_forward_backward_capture_replays_like_eager(op):
    gen = torch.Generator().manual_seed(0)
    dtype = torch.bfloat16
    q, off = jagged(LENGTHS, HEADS, HEAD_DIM, dtype=dtype, generator=gen)
    k, _ = jagged(LENGTHS, HEADS, HEAD_DIM, dtype=dtype, generator=gen)
    v, _ = jagged(LENGTHS, HEADS, HEAD_DIM, dtype=dtype, generator=gen)
    g = torch.randn(q.shape, generator=gen).to(q.device, dtype)
    q, k, v = (x.requires_grad_(True) for x in (q, k, v))
    _capture_and_compare(op, q, k, v, off, g, gen, MAX_LEN)


def _short_lengths(n=48, mean=64, cap=256):
    """Shape (b) in miniature: log-normal lengths (sigma 1) at the quantile midpoints, capped."""
    from statistics import NormalDist

    mu = math.log(mean) - 0.5
    return [int(min(max(round(math.exp(mu + NormalDist().inv_cdf((i + 0.5) / n))), 1), cap)) for i in range(n)]


@gpu
@pytest.mark.parametrize("op", OPS)
def test_capture_after_autotuned_eager_calls_on_the_default_stream(op, monkeypatch):
    # Autotuning on, over the first two candidates per kernel (the precompile of the test session
    # has built the first; this keeps the in-test compiles to a few).
    monkeypatch.setenv("COPLAN_KERNELS_AUTOTUNE", "1")
    for kind in ("fwd", "dq", "dkdv"):
        monkeypatch.setitem(ta._CONFIGS[kind], 64, ta._CONFIGS[kind][64][:2])
    gen = torch.Generator().manual_seed(1)
    dtype, heads, cap = torch.bfloat16, 4, 256
    lengths = _short_lengths(cap=cap)
    q, off = jagged(lengths, heads, 64, dtype=dtype, generator=gen)
    k, _ = jagged(lengths, heads, 64, dtype=dtype, generator=gen)
    v, _ = jagged(lengths, heads, 64, dtype=dtype, generator=gen)
    g = torch.randn(q.shape, generator=gen).to(q.device, dtype)
    q, k, v = (x.requires_grad_(True) for x in (q, k, v))

    # As the benchmark does before its capture: the first calls tune the bucket, on the default
    # stream, then a few more go through the tuned configs (direct launches).
    for _ in range(3):
        with torch.no_grad():
            op(q, k, v, off, cap)
        op(q, k, v, off, cap).backward(g)
    torch.cuda.synchronize()
    consts = tuple(ta._consts(None if op is _softmax else Activation.SILU, True, 64, dtype).values())
    tuned = {key[0] for key in ta._CHOSEN if key[4:4 + len(consts)] == consts}
    assert tuned == {"fwd", "dq", "dkdv"}, f"the autotuned path was not taken: {sorted(ta._CHOSEN)}"
    _capture_and_compare(op, q, k, v, off, g, gen, cap)


@pytest.mark.parametrize("op", OPS)
def test_a_call_keeps_no_autograd_graph_alive(op):
    """Once the output is dropped, its graph (and the leaves' AccumulateGrad nodes) is freed
    without waiting for Python's cycle collector: nothing retains a tensor that carries grad_fn."""
    gen = torch.Generator().manual_seed(2)
    dtype = torch.bfloat16 if HAS_CUDA else torch.float32
    lengths = [5, 1, 19, 0, 12]  # small: the CPU runs it through Triton's interpreter
    q, off = jagged(lengths, HEADS, 16, dtype=dtype, generator=gen)
    k, _ = jagged(lengths, HEADS, 16, dtype=dtype, generator=gen)
    v, _ = jagged(lengths, HEADS, 16, dtype=dtype, generator=gen)
    q, k, v = (x.requires_grad_(True) for x in (q, k, v))
    enabled = gc.isenabled()
    gc.disable()  # a graph freed only by the cycle collector would count as kept
    try:
        for _ in range(2):  # the first call may compile and tune; the second runs the cached path
            out = op(q, k, v, off)
            out.backward(torch.ones_like(out))
            node = weakref.ref(out.grad_fn)
            del out
            assert node() is None, "the autograd graph of a finished call is still referenced"
    finally:
        if enabled:
            gc.enable()
