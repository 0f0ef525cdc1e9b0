"""CUDA-graph capture of both ops' forward + backward (GPU only).

A training step under CUDA graphs (or `torch.compile` with cudagraphs) needs every launch of the
forward and backward to be capturable: no host read of device values, no allocation outside the
graph's pool, no autotuning during capture. Capture after eager warm-up calls on a side stream,
replay on new inputs copied into the same buffers, and compare with eager calls on those inputs.

Softmax's capture fails on the H200 since `a57a928` (cudaErrorStreamCaptureInvalidated, with and
without the direct launch; see BENCHMARKS.md, Attention kernels): it is marked as an expected
failure until fixed, non-strict because the cause is not established.
"""

from __future__ import annotations

import pytest
import torch

from coplan.kernels import gdpa, jagged_attention

from ._util import HAS_CUDA, assert_close, jagged

pytestmark = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")

LENGTHS = [37, 1, 200, 64, 0, 129]
HEADS, HEAD_DIM, MAX_LEN = 2, 64, 256


def _softmax(q, k, v, off):
    return jagged_attention(q, k, v, off, causal=True, max_len=MAX_LEN, validate=False)


def _gdpa(q, k, v, off):
    return gdpa(q, k, v, off, activation="silu", causal=True, max_len=MAX_LEN, validate=False)


@pytest.mark.parametrize("op", [
    pytest.param(_softmax, id="softmax", marks=pytest.mark.xfail(strict=False, reason="capture regression since a57a928")),
    pytest.param(_gdpa, id="gdpa"),
])
def test_forward_backward_capture_replays_like_eager(op):
    gen = torch.Generator().manual_seed(0)
    dtype = torch.bfloat16
    q, off = jagged(LENGTHS, HEADS, HEAD_DIM, dtype=dtype, generator=gen)
    k, _ = jagged(LENGTHS, HEADS, HEAD_DIM, dtype=dtype, generator=gen)
    v, _ = jagged(LENGTHS, HEADS, HEAD_DIM, dtype=dtype, generator=gen)
    g = torch.randn(q.shape, generator=gen).to(q.device, dtype)
    q, k, v = (x.requires_grad_(True) for x in (q, k, v))
    out_buf = torch.empty_like(q)

    def step():
        for x in (q, k, v):
            x.grad = None
        out = op(q, k, v, off)
        out.backward(g)
        out_buf.copy_(out.detach())

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    # Setting .grad to None inside a capture would allocate new gradients on every replay: keep
    # them allocated (the captured backward accumulates into them) and zero them before a replay.
    for x in (q, k, v):
        x.grad = torch.zeros_like(x)

    def captured():
        out = op(q, k, v, off)
        out.backward(g)
        out_buf.copy_(out.detach())

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured()

    # New inputs into the same buffers, then replay against eager on those inputs.
    with torch.no_grad():
        for x in (q, k, v):
            x.copy_(torch.randn(x.shape, generator=gen).to(x.device, dtype))
            x.grad.zero_()
    graph.replay()
    torch.cuda.synchronize()
    got = (out_buf.clone(), *(x.grad.clone() for x in (q, k, v)))

    qe, ke, ve = (x.detach().clone().requires_grad_(True) for x in (q, k, v))
    oe = op(qe, ke, ve, off)
    oe.backward(g)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, (oe.detach(), qe.grad, ke.grad, ve.grad)):
        assert_close(name, a.float(), b.float(), 1e-3)
