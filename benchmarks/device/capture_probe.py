"""Which call of an attention op's forward/backward breaks CUDA-graph capture (GPU diagnostic).

Captures, separately, the forward alone and the backward alone (forward run eagerly before it),
for softmax and GDPA-SiLU, after eager warm-up; runs one eager step under
``torch.cuda.set_sync_debug_mode("warn")`` to list host syncs; prints each failure's traceback.
Usage on the device: ``PYTHONPATH=/tmp/pkg:/tmp/site python3 capture_probe.py``.
"""

from __future__ import annotations

import traceback
import warnings

import torch

from coplan.kernels import gdpa, jagged_attention

LENGTHS = [37, 1, 200, 64, 0, 129]
H, D, MAX_LEN = 2, 64, 256


def make():
    g = torch.Generator().manual_seed(0)
    n = sum(LENGTHS)
    off = torch.tensor([0] + list(torch.tensor(LENGTHS).cumsum(0)), dtype=torch.int32, device="cuda")
    q, k, v = (torch.randn(n, H, D, generator=g).to("cuda", torch.bfloat16).requires_grad_(True) for _ in range(3))
    return q, k, v, off, torch.randn(n, H, D, generator=g).to("cuda", torch.bfloat16)


OPS = {
    "softmax": lambda q, k, v, o: jagged_attention(q, k, v, o, causal=True, max_len=MAX_LEN, validate=False),
    "gdpa": lambda q, k, v, o: gdpa(q, k, v, o, activation="silu", causal=True, max_len=MAX_LEN, validate=False),
}


def probe(name, op):
    q, k, v, off, g = make()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            op(q, k, v, off).backward(g)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        op(q, k, v, off).backward(g)
        torch.cuda.set_sync_debug_mode(0)
    print(f"[{name}] eager step host syncs: {len(caught)}")
    for w in caught[:5]:
        print("   ", str(w.message)[:200])
    for x in (q, k, v):
        x.grad = torch.zeros_like(x)
    # forward alone
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = op(q, k, v, off)
        graph.replay()
        torch.cuda.synchronize()
        print(f"[{name}] forward capture: ok")
    except Exception:  # noqa: BLE001
        print(f"[{name}] forward capture: FAILED\n{traceback.format_exc()}")
        torch.cuda.synchronize()
    # backward alone
    try:
        out = op(q, k, v, off)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out.backward(g, retain_graph=True)
        graph.replay()
        torch.cuda.synchronize()
        print(f"[{name}] backward capture: ok")
    except Exception:  # noqa: BLE001
        print(f"[{name}] backward capture: FAILED\n{traceback.format_exc()}")


if __name__ == "__main__":
    print(torch.__version__, torch.cuda.get_device_name())
    for name, op in OPS.items():
        try:
            probe(name, op)
        except Exception:  # noqa: BLE001
            print(f"[{name}] probe crashed\n{traceback.format_exc()}")
