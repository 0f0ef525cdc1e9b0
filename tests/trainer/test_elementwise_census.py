"""The cost model's elementwise traffic is the trainer's: a census of every elementwise op the dense arch runs.

Why: on one H200 the traced elementwise kernels of fresh sampler draws took 1.4-2.6x what the plans priced
(``benchmarks/results/fresh_draws_h200.json``, ``device_by_class``), the largest miss of any kernel class. This
test counts, on CPU, the elements every non-GEMM op of the dense arch's forward and backward reads and writes
(a ``TorchDispatchMode``; GEMMs are priced by FLOPs and tested in ``test_model.py``, the attention kernels are
opaque here: their traffic is the attention ops' own) and holds it against the elementwise ops of
:func:`coplan.costmodel.flops.workload_ops` at the same lengths. It found unpriced: the InterFormer's FiLM
modulation, its history input assembly (the tables' concatenation, the position embedding and its dense
gradient) and the non-sequence tokens' assembly and read-out (draw 20261205200426 at 64 events a history:
forward census 1.52x the priced elements before, 1.17x after; the seeds here 1.18-1.24x forward, 0.90-1.01x
backward after: a few small per-sample ops stay unpriced).

MoE blocks are left out of the drawn workloads: on CPU their experts run a per-expert loop whose indexing
materialises full-size gradients, where the GPU runs one grouped GEMM.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from coplan.costmodel.flops import DTYPE_BYTES, workload_ops
from coplan.sample import sample_workload
from coplan.trainer.features import feature_layout
from coplan.trainer.model import layers as layers_mod
from coplan.trainer.model.gem import DenseArch

from .test_model import _inputs

_NOT_COUNTED = {
    # GEMMs (their FLOPs are the formulas: test_model.py)
    "mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "einsum",
    # views, metadata and allocation: no traffic
    "view", "_unsafe_view", "t", "transpose", "expand", "as_strided", "detach", "unsqueeze", "squeeze", "permute",
    "slice", "select", "split", "split_with_sizes", "alias", "reshape", "unbind", "empty", "empty_like", "new_empty",
    "zeros", "zeros_like", "lift_fresh", "_reshape_alias", "clone_noop",
}


class _Census(TorchDispatchMode):
    """Elements read + written by each counted op, per phase; ``paused`` > 0 inside an opaque op."""

    def __init__(self) -> None:
        super().__init__()
        self.elems: Counter = Counter()
        self.phase = "fwd"
        self.paused = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.__name__.split(".")[0]
        if self.paused or name in _NOT_COUNTED:
            return out
        if name == "embedding":  # reads the indexed rows and the indices, not the whole table
            idx = args[1]
            self.elems[self.phase] += 2 * out.numel() + idx.numel()
            return out
        tensors = [t for t in tree_flatten((args, kwargs, out))[0] if isinstance(t, torch.Tensor)]
        self.elems[self.phase] += sum(t.numel() for t in tensors)
        return out


def _opaque(census: _Census, fn):
    """``fn(q, k, v, ...)`` whose forward and backward the census does not see (an attention kernel)."""

    class Opaque(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, call):  # type: ignore[override]
            ctx.call = call
            ctx.save_for_backward(q, k, v)
            census.paused += 1
            try:
                with torch.no_grad():
                    return call(q, k, v)
            finally:
                census.paused -= 1

        @staticmethod
        def backward(ctx, g):  # type: ignore[override]
            q, k, v = ctx.saved_tensors
            census.paused += 1
            try:
                with torch.enable_grad():
                    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
                    grads = torch.autograd.grad(ctx.call(*leaves), leaves, g, allow_unused=True)
                return (*grads, None)
            finally:
                census.paused -= 1

    def wrapped(q, k, v, *args, **kwargs):
        return Opaque.apply(q, k, v, lambda q_, k_, v_: fn(q_, k_, v_, *args, **kwargs))

    return wrapped


def _priced_elems(workload, lengths: list[int]) -> tuple[float, float]:
    """The cost model's elementwise elements (forward, backward) at these history lengths."""
    L = np.asarray(lengths, dtype=float)
    fwd = bwd = 0.0
    for op in workload_ops(workload):
        if op.op_class != "elementwise":
            continue
        b = DTYPE_BYTES[op.dtype]
        fwd += op.fixed_fwd_bytes / b
        bwd += op.fixed_bwd_bytes / b
        if op.sequence is None:
            fwd += op.fwd_bytes.const * len(lengths) / b
            bwd += op.bwd_bytes.const * len(lengths) / b
        else:
            fwd += float(np.sum(op.fwd_bytes.at(L))) / b
            bwd += float(np.sum(op.bwd_bytes.at(L))) / b
    return fwd, bwd


def _without_moe(w):
    return w.model_copy(update={"blocks": tuple(b for b in w.blocks if b.type != "moe")})


def _as_on_cpu(w):
    """``w`` as the census runs it: the PyTorch FiLM (the fused kernel runs on CUDA only)."""
    return w.model_copy(update={"kernels": w.kernels.model_copy(update={"film": "eager"})})


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_trainers_elementwise_traffic_is_priced(seed, monkeypatch):
    w = _without_moe(sample_workload("h200-1gpu", seed))
    torch.manual_seed(0)
    arch = DenseArch(w, feature_layout(w), "reference")
    census = _Census()
    for name in ("jagged_attention", "dense_attention"):
        monkeypatch.setattr(layers_mod, name, _opaque(census, getattr(layers_mod, name)))
    lengths = [48, 5, 0, 31]
    with census:
        loss = arch(*_inputs(w, lengths)).float().sum()
        census.phase = "bwd"
        loss.backward()
    fwd, bwd = _priced_elems(_as_on_cpu(w), lengths)
    ratio_f, ratio_b = census.elems["fwd"] / fwd, census.elems["bwd"] / bwd
    # the census may exceed the price a little (small per-sample ops are not priced), never fall below it much
    print(f"seed {seed}: forward census / priced {ratio_f:.2f}, backward {ratio_b:.2f}")
    assert 0.85 <= ratio_f <= 1.35, f"forward: census {census.elems['fwd']:.3g} elements, priced {fwd:.3g} ({ratio_f:.2f}x)"
    assert 0.85 <= ratio_b <= 1.35, f"backward: census {census.elems['bwd']:.3g} elements, priced {bwd:.3g} ({ratio_b:.2f}x)"


def test_the_census_sees_an_unpriced_pass(monkeypatch):
    """The census is not blind: one more elementwise pass per InterFormer layer shows in its count."""
    w = _without_moe(sample_workload("h200-1gpu", 0))
    torch.manual_seed(0)
    arch = DenseArch(w, feature_layout(w), "reference")
    lengths = [48, 5, 0, 31]

    def count() -> float:
        census = _Census()
        with census:
            loss = arch(*_inputs(w, lengths)).float().sum()
            census.phase = "bwd"
            loss.backward()
        return census.elems["fwd"]

    base = count()
    norm = layers_mod.InterFormerLayer.forward

    def doubled(self, h, *a, **k):
        return norm(self, h * 1.0, *a, **k)  # one extra read + write of the history per layer

    monkeypatch.setattr(layers_mod.InterFormerLayer, "forward", doubled)
    tokens = sum(lengths)
    extra = sum(2 * tokens * b.model_dim * b.num_layers for b in w.blocks if b.type == "interformer")
    assert count() - base == pytest.approx(extra, rel=1e-6)


def test_the_fused_film_drops_exactly_its_own_traffic():
    """Priced with the fused FiLM LayerNorm (``kernels.film`` fused, Triton attention), an InterFormer layer's
    ``norm_act`` moves ``FILM_ELEMS x d`` fewer elements per token forward (twice that backward) than the PyTorch
    FiLM, keeps ``FILM_SAVED x d`` fewer, and launches ``FILM_LAUNCHES`` fewer kernels each way."""
    from coplan.costmodel.flops import FILM_ELEMS, FILM_LAUNCHES, FILM_SAVED, film_fused

    w = _without_moe(sample_workload("h200-1gpu", 0))
    assert film_fused(w) and not film_fused(_as_on_cpu(w))
    fused = {o.name: o for o in workload_ops(w)}
    eager = {o.name: o for o in workload_ops(_as_on_cpu(w))}
    seen = 0
    for b in w.blocks:
        if b.type != "interformer":
            continue
        for i in range(b.num_layers):
            f, e = fused[f"{b.name}.{i}.norm_act"], eager[f"{b.name}.{i}.norm_act"]
            bs = DTYPE_BYTES[f.dtype]
            L = np.asarray([1.0, 100.0])
            assert np.allclose(e.fwd_bytes.at(L) - f.fwd_bytes.at(L), FILM_ELEMS * b.model_dim * bs * L)
            assert np.allclose(e.bwd_bytes.at(L) - f.bwd_bytes.at(L), 2 * FILM_ELEMS * b.model_dim * bs * L)
            assert np.allclose(e.act_bytes.at(L) - f.act_bytes.at(L), FILM_SAVED * b.model_dim * bs * L)
            assert e.fwd_launches - f.fwd_launches == FILM_LAUNCHES == e.bwd_launches - f.bwd_launches
            seen += 1
    assert seen
    others = [n for n in fused if not n.endswith("norm_act") or not any(n.startswith(b.name + ".") for b in w.blocks
                                                                        if b.type == "interformer")]
    assert all(fused[n] == eager[n] for n in others)
