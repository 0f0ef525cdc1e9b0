"""The padded reference attention's host side: the kernels it issues (counted from its code) and the
step form of a host that syncs with the device once per call (issue 8, H8)."""

from __future__ import annotations

import collections

import numpy as np
import pytest

from coplan.costmodel import flops as F
from coplan.costmodel.compute import HOST_KERNELS_PER_PRICED_LAUNCH, op_arrays
from coplan.costmodel.context import build_context
from coplan.costmodel.pricer import (assignment_of, collections_held, layer_sets, host_launches, host_segments, price, priced_launches,
                                     synced_step)
from coplan.errors import CoplanError
from coplan.spec import Calibration, LayerPlan, OpClassCalibration, Plan

from .helpers import gem_h200_plan


def _plan(attention: str, batch: int = 8, mean_len: int = 512) -> Plan:
    return gem_h200_plan(batch, mean_len, attention)


def _cal(h: float | None = None) -> Calibration:
    return Calibration(device="NVIDIA H200", host_launch_s=h,
                       op_classes={c: OpClassCalibration(launch_overhead_s=2e-6) for c in ("gemm", "attention", "elementwise", "embedding")})


# ------------------------------------------------------------------ the kernels it issues


def _count_calls(fn, *, summary: bool, causal: bool, **kw) -> tuple[int, int]:
    """ATen calls that make a tensor (not views, not bare allocations, not the host read of a scalar) in
    one forward and one backward of a reference function on CPU: each is one kernel on a GPU."""
    torch = pytest.importorskip("torch")
    from torch.utils._python_dispatch import TorchDispatchMode

    skip = {"empty.memory_format", "empty_strided.default", "detach.default", "_local_scalar_dense.default"}

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.n = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            view = any(r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns)
            if not view and func.__name__ not in skip:
                self.n[func.__name__] += 1
            return out

    g = torch.Generator().manual_seed(0)
    lens = torch.tensor([5, 9, 3, 7, 12, 1, 4, 8])
    off = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)])
    total, heads, dim = int(off[-1]), 2, 16

    def leaf(n):
        return torch.randn(n, heads, dim, generator=g).to(torch.bfloat16).requires_grad_()

    k, v = leaf(total), leaf(total)
    q, q_off = (leaf(2 * 8), torch.arange(9) * 2) if summary else (leaf(total), off)
    fwd = Count()
    with fwd:
        out = fn(q, k, v, q_off, off, causal=causal, scale=0.1, **kw)
    grad = torch.randn(out.shape, generator=g).to(out.dtype)
    bwd = Count()
    with bwd:
        out.backward(grad)
    return sum(fwd.n.values()), sum(bwd.n.values())


@pytest.mark.parametrize("kind,activation", [("gdpa", "silu"), ("gdpa", "identity"), ("softmax", "silu")])
@pytest.mark.parametrize("summary,causal", [(False, True), (True, False)])
def test_reference_kernels_are_what_the_reference_code_calls(kind, activation, summary, causal):
    """flops.reference_kernels is the reference's own count: its ATen calls per forward and backward
    (the H200 traces of gem-h200 show 88 forward / 29 backward per causal GDPA call)."""
    pytest.importorskip("torch")
    from coplan.kernels.common import Activation
    from coplan.kernels.reference import gdpa_reference, jagged_attention_reference

    if kind == "gdpa":
        got = _count_calls(gdpa_reference, summary=summary, causal=causal, activation=Activation(activation), out_scale=0.5)
    else:
        got = _count_calls(jagged_attention_reference, summary=summary, causal=causal)
    want = F.reference_kernels(kind, causal, activation)
    assert abs(got[0] - want[0]) <= 2 and abs(got[1] - want[1]) <= 2, (got, want)


def test_reference_op_carries_its_kernels_and_its_sync():
    """The padded op keeps the fused op's device launches (1, 2) and carries the host's kernels and sync;
    the summary cross-attention is non-causal, the self-attention follows the block."""
    w = _plan("reference").workload
    ops = {o.name: o for o in F.workload_ops(w)}
    gdpa = F.padded_reference_attention(ops["interformer.0.gdpa"], w, 0.5)
    summ = F.padded_reference_attention(ops["interformer.0.summary_attn"], w, 0.5)
    assert (gdpa.fwd_launches, gdpa.bwd_launches) == (1, 2) and gdpa.host_sync and summ.host_sync
    assert (gdpa.fwd_host_kernels, gdpa.bwd_host_kernels) == F.reference_kernels("gdpa", True, "silu") == (88, 28)
    assert (summ.fwd_host_kernels, summ.bwd_host_kernels) == F.reference_kernels("gdpa", False, "silu") == (84, 28)
    # an op that is not jagged attention is untouched: no host kernels, no sync
    other = F.padded_reference_attention(ops["interformer.0.qkv"], w)
    assert other.fwd_host_kernels == 0 and not other.host_sync


@pytest.mark.parametrize("recompute", [False, True])
def test_host_launches_count_the_reference_kernels_in_priced_units(recompute):
    """The host charges each reference call its kernels / HOST_KERNELS_PER_PRICED_LAUNCH instead of the
    fused op's 1 + 2 launches (a recomputed layer's forward again); Triton plans are unchanged."""
    tri, ref = _plan("triton"), _plan("reference")
    ctx = build_context(ref.workload, ref.topology, ref.mesh)
    layers = (LayerPlan(name="interformer.1", recompute=True),) if recompute else ()
    rec, fp8 = layer_sets(ctx, layers)
    arr_t, arr_r = op_arrays(ctx, tri.kernels, fp8), op_arrays(ctx, ref.kernels, fp8)
    assert host_launches(ctx, arr_t, rec, 1.0) == pytest.approx(priced_launches(ctx, arr_t, rec, 1.0))
    assert priced_launches(ctx, arr_r, rec, 1.0) == pytest.approx(priced_launches(ctx, arr_t, rec, 1.0))
    r = HOST_KERNELS_PER_PRICED_LAUNCH
    n_layers = sum(1 for n in ctx.layer_names if n.startswith("interformer."))
    per_layer = (88 / r - 1) + (84 / r - 1) + 2 * (28 / r - 2)
    extra = per_layer * n_layers + (88 / r + 84 / r - 2 if recompute else 0.0)
    got = host_launches(ctx, arr_r, rec, 1.0) - priced_launches(ctx, arr_r, rec, 1.0)
    assert got == pytest.approx(extra * ctx.micro_batches)
    segs, syncs = host_segments(ctx, arr_r, rec, 1.0)
    assert len(syncs) == (2 * n_layers + (2 if recompute else 0)) * ctx.micro_batches == len(segs) - 1
    assert [p for _, _, p in syncs].count("recompute") == (2 if recompute else 0)
    assert host_segments(ctx, arr_t, rec, 1.0)[1] == []


# ------------------------------------------------------------------ the step form of a syncing host


def test_synced_step_is_a_sum_of_segment_maxima():
    # host-heavy and device-heavy segments cannot hide each other across a sync
    assert synced_step([3.0, 1.0, 2.0], [1.0, 4.0, 1.0]) == pytest.approx(9.0)
    assert max(sum([3.0, 1.0, 2.0]), sum([1.0, 4.0, 1.0])) == pytest.approx(6.0)  # the max form's figure
    assert synced_step([5.0], [2.0]) == pytest.approx(5.0)  # no sync: the max form
    assert synced_step([1.0, 1.0], [0.5, 0.5]) == pytest.approx(2.0)  # host-bound throughout: the host's sum
    with pytest.raises(CoplanError, match="one host and one device time per segment"):
        synced_step([1.0], [1.0, 2.0])


def test_pricer_sums_segments_for_a_syncing_backend_and_keeps_the_max_form_otherwise():
    """With host and device time comparable, the reference plan's step exceeds max(host, device) (its
    syncs cut the overlap) and says so; the Triton plan's step stays exactly max(host, device). Far from
    balance both reduce to the max form: a negligible host cost gives the device step, a dominant one
    the host's."""
    for name, expect_sync in (("reference", True), ("triton", False)):
        p = _plan(name, batch=16, mean_len=1024)
        dev = price(build_context(p.workload, p.topology, p.mesh, _cal()), None, p.layers, p.balancing, p.kernels).step_time_s
        ctx = build_context(p.workload, p.topology, p.mesh, _cal(1.0))
        rec, fp8 = layer_sets(ctx, p.layers)
        groups = float(collections_held(ctx, assignment_of(ctx, p.tables)).max())  # the plan's TorchRec collections
        n = host_launches(ctx, op_arrays(ctx, p.kernels, fp8), rec, groups)
        h = dev / n  # host time = device time: the max form would overlap them completely
        sc = price(build_context(p.workload, p.topology, p.mesh, _cal(h)), None, p.layers, p.balancing, p.kernels)
        if expect_sync:
            assert sc.step_time_s > dev * 1.05 and any("syncs with the device" in x for x in sc.notes)
            assert sc.step_time_s <= 2 * dev * (1 + 1e-9)  # never more than host + device
        else:
            assert sc.step_time_s == pytest.approx(dev) and not any("syncs" in x for x in sc.notes)
        tiny = price(build_context(p.workload, p.topology, p.mesh, _cal(h * 1e-6)), None, p.layers, p.balancing, p.kernels)
        assert tiny.step_time_s == pytest.approx(dev, rel=1e-5)
        big = price(build_context(p.workload, p.topology, p.mesh, _cal(h * 1e3)), None, p.layers, p.balancing, p.kernels)
        assert big.step_time_s == pytest.approx(n * h * 1e3, rel=1e-3)
    assert np.isfinite(dev)


def test_host_segments_without_syncs_match_the_walk_with_recompute_and_fp8():
    """The no-sync shortcut counts what the per-call walk counts (recompute and FP8 layers included)."""
    import dataclasses

    p = _plan("triton")
    ctx = build_context(p.workload, p.topology, p.mesh)
    layers = (LayerPlan(name="interformer.1", recompute=True), LayerPlan(name="interformer.2", precision="fp8"))
    rec, fp8 = layer_sets(ctx, layers)
    arr = op_arrays(ctx, p.kernels, fp8)
    assert np.any(arr.fp8)
    fast = host_segments(ctx, arr, rec, 2.0)
    # a sync flag on the first op forces the per-call walk; a sync splits the launches, never changes them
    probe = np.zeros_like(arr.fwd_syncs)
    probe[0] = 1.0
    walked = host_segments(ctx, dataclasses.replace(arr, fwd_syncs=probe), rec, 2.0)
    assert fast[1] == [] and sum(walked[0]) == pytest.approx(fast[0][0]) == pytest.approx(priced_launches(ctx, arr, rec, 2.0))
