"""``--compile layers``: each layer kind is one graph, with no graph break, compiled once for every
layer of that kind and for every batch's jagged lengths, and computes what the eager layer computes.

Graphs, breaks and recompiles are Dynamo's decisions, made before the backend runs, so the tests use
the ``eager`` backend (Inductor would add a minute of C++ compilation and test nothing more here;
``benchmarks/compile_probe.py`` runs Inductor). The InterFormer layers call the Triton attention
through its custom op, under the interpreter (``tests/conftest.py``), as on the GPU.
"""

from __future__ import annotations

import copy
import os

import numpy as np
import pytest
import torch
from torch._dynamo.utils import counters

from coplan.spec.workload import Attention, InterFormerBlock, KunlunBlock
from coplan.trainer.distributed.compile import compile_layer
from coplan.trainer.model.layers import InterFormerLayer, KunlunLayer

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs the Triton interpreter on CPU")

D, HEADS, HEAD_DIM, CTX, SUMMARY = 16, 2, 8, 12, 2


def _interformer(i: int, backend: str = "triton") -> InterFormerLayer:
    block = InterFormerBlock(sequence="history", num_layers=2, model_dim=D, num_heads=HEADS, head_dim=HEAD_DIM,
                             attention=Attention(kind="gdpa", activation="silu", causal=True, scale="inv_max_len"),
                             ffn_multiplier=2, num_summary_tokens=SUMMARY)
    layer = InterFormerLayer(f"interformer.{i}", block, CTX, max_len=64, backend=backend)
    torch.nn.init.normal_(layer.film.weight, std=0.1)  # (zero at init in the model: give the FiLM path a gradient)
    return layer


def _run(layers, lengths, seed):
    g = torch.Generator().manual_seed(seed)
    b = len(lengths)
    offsets = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int64)
    h = torch.randn(int(sum(lengths)), D, generator=g, requires_grad=True)
    # as in the model, every input of every layer requires grad (a requires_grad flip is a guard failure)
    summary = torch.randn(b, SUMMARY, D, generator=g, requires_grad=True)
    ctx = torch.randn(b, CTX, generator=g, requires_grad=True)
    x = h
    for layer in layers:
        x, summary = layer(x, offsets, summary, ctx)
    (x.square().mean() + summary.square().mean()).backward()
    return x.detach(), h.grad, [p.grad for m in layers for p in m.parameters()]


def test_interformer_layers_are_one_graph_compiled_once():
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    eager = [_interformer(0), _interformer(1)]
    compiled = copy.deepcopy(eager)
    for m in compiled:
        compile_layer(m, backend="eager")
    # the same batch size each step (as in the trainer), lengths (and so the token count) redrawn
    for step, lengths in enumerate(([5, 0, 17, 3], [30, 1, 2, 9], [64, 8, 8, 12], [1, 1, 1, 2])):
        want = _run(eager, lengths, step)
        got = _run(compiled, lengths, step)
        torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-5)
        for a, b in zip(got[2], want[2]):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert dict(counters["graph_break"]) == {}
    # one graph for both layers and all four length sets: no recompilation per layer or per batch
    assert counters["stats"]["unique_graphs"] == 1


@pytest.mark.parametrize("backend", ["reference", "triton"])  # triton: GDPA through the jagged kernel's custom op
def test_kunlun_layers_are_one_graph_compiled_once(backend):
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    block = KunlunBlock(num_layers=2, num_tokens=6, model_dim=D, num_heads=HEADS, head_dim=HEAD_DIM, ffn_multiplier=2)
    layers = [KunlunLayer(f"kunlun.{i}", block, 6, backend=backend) for i in range(2)]
    eager = copy.deepcopy(layers)
    for m in layers:
        compile_layer(m, backend="eager")
    for step in range(3):
        z = torch.randn(4, 6, D, generator=torch.Generator().manual_seed(step))
        a, b = z.clone().requires_grad_(), z.clone().requires_grad_()
        for m in layers:
            a = m(a)
        for m in eager:
            b = m(b)
        torch.testing.assert_close(a, b)
    assert dict(counters["graph_break"]) == {}
    assert counters["stats"]["unique_graphs"] == 1


def test_the_old_all_dynamic_compile_broke_the_layer():
    """The failure the static-by-default compile removes: with ``dynamic=True`` the attention scales
    became symbolic floats and the InterFormer layer broke into several graphs. If this starts
    passing with one graph, ``compile_layer``'s reason is gone (see trainer/distributed/compile.py)."""
    torch._dynamo.reset()
    counters.clear()
    layer = _interformer(0)
    layer.forward = torch.compile(layer.forward, dynamic=True, backend="eager")
    _run([layer], [5, 0, 17, 3], 0)
    assert counters["stats"]["unique_graphs"] > 1 and sum(counters["graph_break"].values()) > 0


def test_cpp_wrapper_mode_compiles_and_matches_eager():
    """``--compile layers-cpp``: Inductor's C++ wrapper around an InterFormer layer (the custom attention op
    called back from the C++ wrapper) computes what the eager layer computes; one real Inductor
    compilation on CPU (~40 s), the only one in the suite."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    eager = [_interformer(0)]
    compiled = copy.deepcopy(eager)
    compile_layer(compiled[0], cpp_wrapper=True)
    (xe, ge, pe), (xc, gc, pc) = _run(eager, [5, 9, 3], 0), _run(compiled, [5, 9, 3], 0)
    torch.testing.assert_close(xc, xe, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gc, ge, rtol=1e-5, atol=1e-6)
    for a, b in zip(pc, pe):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="Inductor option"):
        compile_layer(copy.deepcopy(eager)[0], backend="eager", cpp_wrapper=True)


def test_apply_compile_modes():
    from coplan.trainer.distributed.compile import COMPILE_MODES, apply_compile

    assert COMPILE_MODES == ("off", "layers", "layers-cpp")
    assert apply_compile(torch.nn.Module(), "off") == [] and apply_compile(torch.nn.Module(), False) == []
    with pytest.raises(ValueError, match="compile mode"):
        apply_compile(torch.nn.Module(), "everything")
