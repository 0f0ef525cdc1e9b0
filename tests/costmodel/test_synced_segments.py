"""Issue 8, round 8: the step cut at the host's syncs (``StepCost.segments``), the syncing call's kernels the
device waits through, the host-cost fit over runs priced per step and segment, and a run's median step."""

from __future__ import annotations

import numpy as np
import pytest

from coplan.costmodel import flops as F
from coplan.calibration.host_fit import fit_host_terms, fit_step_terms
from coplan.calibration.runs import CalibrationError, measured_moments
from coplan.calibration.step_price import predict_median_step, predict_step_time
from coplan.costmodel.compute import op_arrays
from coplan.costmodel.context import build_context
from coplan.costmodel.pricer import layer_sets, host_launches, price, sync_exposed, synced_step
from coplan.errors import CoplanError

from .test_reference_host import _cal, _plan


def test_synced_step_waits_through_the_exposed_host_part():
    # a segment: exposed host first, then the rest of the host beside the device
    assert synced_step([3.0], [2.0], [1.0]) == pytest.approx(1.0 + max(2.0, 2.0))
    assert synced_step([3.0, 2.0], [5.0, 1.0], [0.0, 2.0]) == pytest.approx(5.0 + 2.0 + 1.0)
    # exposure beyond the segment's host time is capped at it; none exposed: the sum of maxima
    assert synced_step([1.0], [4.0], [9.0]) == pytest.approx(1.0 + 4.0)
    assert synced_step([3.0, 1.0], [1.0, 4.0], [0.0, 0.0]) == pytest.approx(synced_step([3.0, 1.0], [1.0, 4.0]))
    with pytest.raises(CoplanError, match="one host and one device time per segment"):
        synced_step([1.0, 1.0], [1.0, 1.0], [0.0])


@pytest.mark.parametrize("attention", ["reference", "triton"])
def test_segments_add_up_to_the_launches_and_the_device_step(attention):
    """The segments' launches sum to the host launches, their device times to the device step; the
    reference's segments start (after the first) with the syncing call's kernels before its first matmul."""
    p = _plan(attention, batch=16, mean_len=1024)
    ctx = build_context(p.workload, p.topology, p.mesh, _cal())
    sc = price(ctx, None, p.layers, p.balancing, p.kernels, segments=True)
    segs = np.array(sc.segments)
    rec, fp8 = layer_sets(ctx, p.layers)
    arr = op_arrays(ctx, p.kernels, fp8)
    # the launches are the host's: a dominant host cost prices the step at their sum (plus, where a segment
    # is all exposed host, its device time, which then does not overlap)
    big = price(build_context(p.workload, p.topology, p.mesh, _cal(1.0)), None, p.layers, p.balancing, p.kernels)
    assert segs[:, 0].sum() <= big.step_time_s <= segs[:, 0].sum() + sc.step_time_s
    assert segs[:, 0].sum() >= host_launches(ctx, arr, rec, 0.0)
    assert segs[:, 2].sum() == pytest.approx(sc.step_time_s)
    assert np.all(segs[:, 2] >= -1e-12) and np.all(segs[:, 1] <= segs[:, 0])
    if attention == "triton":
        assert len(segs) == 1 and segs[0, 1] == 0.0
        return
    syncing = [k for k in range(len(ctx.dense_idx)) if arr.fwd_syncs[k] > 0]
    assert len(segs) == 1 + len(syncing) * ctx.micro_batches
    assert segs[0, 1] == 0.0
    # after a sync, the forward launches up to the first backward one are exposed: every forward segment
    # whole, and of the last one its forward part (the backward and the optimizer run ahead)
    assert segs[1:-1, 1] == pytest.approx(segs[1:-1, 0])
    last_fwd = sum(arr.fwd_host_launches[k] for k in range(syncing[-1], len(ctx.dense_idx)))
    assert segs[-1, 1] == pytest.approx(last_fwd) and segs[-1, 1] < segs[-1, 0]
    assert sync_exposed(ctx, arr, rec, 0.0)[1:-1] == pytest.approx(list(segs[1:-1, 0]))
    # a host cost: the pricer's step is the synced form over these segments
    h = 2e-4
    priced = price(build_context(p.workload, p.topology, p.mesh, _cal(h)), None, p.layers, p.balancing, p.kernels).step_time_s
    assert priced == pytest.approx(synced_step(list(segs[:, 0] * h), list(segs[:, 2]), list(segs[:, 1] * h)), rel=1e-9)


def test_sync_exposed_is_nothing_without_syncs():
    p = _plan("triton")
    ctx = build_context(p.workload, p.topology, p.mesh, _cal())
    assert sync_exposed(ctx, op_arrays(ctx, p.kernels)) == [0.0]


def _synced_runs(rng, h, f, n_runs=4, steps=9, segs=5, noise=0.01):
    """Synthetic runs that sync: per step and segment launches, exposed launches and device times (the
    device varying with each step's lengths), and their measured p50 under (h, f)."""
    out, meas = [], []
    for _ in range(n_runs):
        N = np.tile(rng.uniform(20, 80, segs), (steps, 1))
        E = N * 0.5
        E[:, 0] = 0.0
        D = rng.uniform(0.002, 0.03, (steps, segs)) * rng.uniform(0.5, 2.0, (steps, 1))
        st = (h * E + np.maximum(h * (N - E), f * D)).sum(axis=1)
        meas.append(float(np.median(st)) * float(np.exp(noise * rng.standard_normal())))
        out.append((N, E, D))
    return out, np.array(meas)


def test_fit_recovers_the_host_cost_from_runs_that_sync():
    """Syncing runs alone identify h (their host time is exposed at every sync), together with device-bound
    runs that set f; the same runs read as one max-form segment each would not."""
    rng = np.random.default_rng(7)
    segs, m_sync = _synced_runs(rng, h=3e-4, f=1.05)
    d_plain = rng.uniform(0.1, 0.3, 4)
    n_plain = rng.uniform(150, 300, 4)
    m_plain = 1.05 * d_plain * np.exp(0.005 * rng.standard_normal(4))
    plain = [(np.array([[n]]), np.zeros((1, 1)), np.array([[d]])) for n, d in zip(n_plain, d_plain)]
    m = np.concatenate([m_sync, m_plain])
    dev = [float(np.median(D.sum(axis=1))) for _, _, D in segs] + list(d_plain)
    nl = [float(N[0].sum()) for N, _, _ in segs] + list(n_plain)
    h, s, f = fit_step_terms(m, dev, nl, None, segments=segs + plain)
    assert h == pytest.approx(3e-4, rel=0.08)
    assert f == pytest.approx(1.05, abs=0.02)
    assert s == 0.0
    # a host term needs two host-bound runs: with one syncing run it is dropped
    h1, _, _ = fit_step_terms(m[[0, 4, 5, 6, 7]], [dev[i] for i in (0, 4, 5, 6, 7)], [nl[i] for i in (0, 4, 5, 6, 7)], None,
                              segments=[(segs + plain)[i] for i in (0, 4, 5, 6, 7)])
    assert h1 == 0.0
    with pytest.raises(CalibrationError, match="one value per step and segment"):
        fit_host_terms(m[:1], dev[:1], nl[:1], segments=[(np.ones((2, 3)), np.zeros((2, 2)), np.ones((2, 3)))])


def test_a_runs_median_step_is_the_median_of_its_steps_prices():
    """Per-step moments from metrics.jsonl (seq_stats, seq_max), priced one by one; the median is the p50's
    counterpart. The padded reference's price grows with each step's longest length."""
    p = _plan("reference", batch=8, mean_len=512)
    rows = [{"step": i, "seq_stats": {"history": [8.0, 8.0 * L / 2, 8.0 * L * L / 3]}, "seq_max": {"history": [L]}}
            for i, L in enumerate((400, 1200, 800, 2000, 600))]
    each = [measured_moments(rows, [i]) for i in range(5)]
    assert each[3]["history@max"] == (2000.0, 4.0e6)
    prices = [predict_step_time(p, None, mo) for mo in each]
    assert prices[3] > prices[1] > prices[2] > prices[4] > prices[0]
    assert predict_median_step(p, None, each) == pytest.approx(prices[2])
    assert predict_median_step(p, None, []) == pytest.approx(predict_step_time(p, None, None))


def test_unfused_ops_stream_at_their_own_memory_efficiency():
    """The padded reference's bytes (matmuls and passes) are priced at ``unfused_memory_efficiency``, a
    calibration field of its own; the fused backend's attention does not read it."""
    from coplan.costmodel.efficiency import UNFUSED_CLASS
    from coplan.costmodel.efficiency import resolve_efficiencies
    from coplan.spec import Calibration

    p = _plan("reference", batch=8, mean_len=1024)
    names = None
    out = {}
    for m in (0.4, 0.8):
        cal = Calibration(device="NVIDIA H200", unfused_memory_efficiency=m)
        assert resolve_efficiencies(p.topology, cal).memory[UNFUSED_CLASS] == m
        for attention in ("reference", "triton"):
            q = _plan(attention, batch=8, mean_len=1024)
            ctx = build_context(q.workload, q.topology, q.mesh, cal)
            arr = op_arrays(ctx, q.kernels)
            names = [ctx.ops[i].name for i in ctx.dense_idx]
            g = names.index("interformer.0.gdpa")
            out[(attention, m)] = (arr.fwd_mem_s[g], arr.fwd_serial_s[g])
    assert out[("reference", 0.4)][0] == pytest.approx(2 * out[("reference", 0.8)][0])
    assert out[("reference", 0.4)][1] == pytest.approx(2 * out[("reference", 0.8)][1]) and out[("reference", 0.8)][1] > 0
    assert out[("triton", 0.4)] == out[("triton", 0.8)]


def test_unfused_ops_pay_a_device_floor_per_extra_kernel():
    """The padded reference runs its call's ATen kernels on the device (84 forward, 28 backward, non-causal
    GDPA): each beyond the priced launch costs ``unfused_kernel_s``; the calibration's sample carries the
    count; the fused backend has none."""
    from coplan.calibration.terms import unit_terms
    from coplan.spec import Calibration

    out = {}
    for ks in (0.0, 1e-5):
        cal = Calibration(device="NVIDIA H200", unfused_kernel_s=ks)
        for attention in ("reference", "triton"):
            q = _plan(attention, batch=8, mean_len=1024)
            ctx = build_context(q.workload, q.topology, q.mesh, cal)
            arr = op_arrays(ctx, q.kernels)
            s = [ctx.ops[i].name for i in ctx.dense_idx].index("interformer.0.summary_attn")
            out[(attention, ks)] = (arr.fwd_launch_s[s], arr.bwd_launch_s[s], arr.fwd_extra_kernels[s], arr.bwd_extra_kernels[s])
    kf, kb = F.reference_kernels("gdpa", False, "silu")
    assert out[("reference", 0.0)][2:] == (kf - 1, kb - 2)
    assert out[("reference", 1e-5)][0] - out[("reference", 0.0)][0] == pytest.approx((kf - 1) * 1e-5)
    assert out[("reference", 1e-5)][1] - out[("reference", 0.0)][1] == pytest.approx((kb - 2) * 1e-5)
    assert out[("triton", 1e-5)] == out[("triton", 0.0)] and out[("triton", 0.0)][2:] == (0.0, 0.0)
    t = {(u.name, u.phase): u for u in unit_terms(_plan("reference", batch=8, mean_len=1024))}
    assert t[("interformer.0.summary_attn", "fwd")].extra_kernels == kf - 1


def test_syncing_runs_are_fitted_step_by_step_when_their_steps_are_known():
    """A syncing run's steps scatter around its line (and its p50 can sit between clusters of repeated
    batches); fitted on every step, h comes out right where the p50 alone bends it."""
    rng = np.random.default_rng(11)
    h_true, f = 2e-4, 1.0
    segs, times, meds = [], [], []
    for _ in range(3):
        steps = 21
        N = np.tile(rng.uniform(20, 60, 6), (steps, 1))
        E = N.copy()
        E[:, 0] = 0.0
        D = rng.uniform(0.001, 0.02, (steps, 6)) * rng.uniform(0.3, 3.0, (steps, 1))
        st = (h_true * E + np.maximum(h_true * (N - E), f * D)).sum(axis=1) * np.exp(0.03 * rng.standard_normal(steps))
        segs.append((N, E, D))
        times.append(st)
        meds.append(float(np.median(st)) * 1.15)  # each p50 read 15% high, as between two clusters
    d = [float(np.median(D.sum(axis=1))) for _, _, D in segs]
    n = [float(N[0].sum()) for N, _, _ in segs]
    h_steps, _ = fit_host_terms(meds, d, n, segments=segs, step_measured=times)
    h_p50, _ = fit_host_terms(meds, d, n, segments=segs)
    assert h_steps == pytest.approx(h_true, rel=0.05)
    assert abs(h_p50 / h_true - 1) > 0.1
