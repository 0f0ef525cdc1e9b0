"""Probe of the second dense-graph capture after an eager pass (tests/trainer/test_graphs.py [off]):
PROBE=mode:<thread_local|global|relaxed>,noeager,sync picks the variant; prints what failed."""
import os
import sys
import traceback

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.getcwd(), "tests", "trainer"))
from test_graphs import _inputs, gpu_arch  # noqa: E402

from coplan.trainer import graphs as G  # noqa: E402

opts = dict(kv.split(":", 1) if ":" in kv else (kv, "1") for kv in os.environ.get("PROBE", "").split(",") if kv)
mode = opts.get("mode")
if mode:
    real = torch.cuda.graph

    class forced(real):  # noqa: N801
        def __init__(self, g, pool=None, stream=None, capture_error_mode="global"):
            super().__init__(g, pool=pool, stream=stream, capture_error_mode=mode)
    G.torch.cuda.graph = forced  # (the module's torch is the same object: patched for all)
dev = torch.device("cuda")
w, arch = gpu_arch(dev)
runner = G.DenseGraphs(arch, torch.bfloat16, dev)
rng = np.random.default_rng(0)
for step in range(4):
    lengths = rng.integers(0, 200, size=8).tolist()
    pooled, keys, widths, seq, offsets, dense = _inputs(w, lengths, seed=step, device=dev)
    if "sync" in opts:
        torch.cuda.synchronize()
    runner.begin_step()
    got = runner(pooled, keys, widths, seq, offsets, dense, 8)
    got.float().sum().backward()
    for p in runner.params:
        p.grad = None
    if "noeager" not in opts:
        try:
            eager = runner._forward(pooled, keys, widths, seq, offsets, dense, 8, None)
            eager.float().sum().backward()
        except Exception:
            traceback.print_exc()
    print(f"PROBE {opts} step {step}: {runner.stats.captured} captured, {runner.stats.replayed} replayed, "
          f"disabled={runner.stats.disabled}", flush=True)
