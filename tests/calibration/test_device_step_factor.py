"""Issue 8, the device-step factor: device work no priced op accounts for, fitted with the host costs to
measured steps (step = max(f x device, host)), written to the Calibration and priced by ``coplan plan``."""

from __future__ import annotations

import numpy as np
import pytest

from coplan.calibration.host_fit import DEVICE_FACTOR_RANGE, fit_host_terms, fit_step_terms
from coplan.calibration.assemble import calibrate
from coplan.calibration.step_price import predict_step_time
from coplan.costmodel.efficiency import resolve_efficiencies
from coplan.errors import SpecError
from coplan.spec import Calibration, dump_spec, load_calibration, parse_spec

from .test_calibrate import _synth_run, _write_step, synthesised
from .test_host_pricing import DEVICE, _device_and_launches, _plan


def _mixed(rng, n_runs=10, f=1.07, h=3e-4, s=2e-4, noise=0.01):
    """Device steps, launches and batches of runs some device-bound and some host-bound at (f, h, s)."""
    d = rng.uniform(0.04, 0.3, n_runs)
    n = rng.uniform(150, 450, n_runs)
    b = rng.choice([16.0, 64.0, 128.0, 256.0], n_runs)
    true = np.maximum(f * d, n * h + b * s)
    return true * np.exp(noise * rng.standard_normal(n_runs)), d, n, b, true


def test_fit_recovers_the_factor_and_the_host_costs():
    """Runs on both sides of the max: the device-bound ones set f, the host-bound ones h and s."""
    rng = np.random.default_rng(3)
    m, d, n, b, _ = _mixed(rng, n_runs=12)
    host_bound = n * 3e-4 + b * 2e-4 > 1.07 * d
    assert 3 <= host_bound.sum() <= 9  # the draw has both kinds
    h, s, f = fit_step_terms(m, d, n, b, per_sample=True)
    assert f == pytest.approx(1.07, abs=0.015)
    assert h == pytest.approx(3e-4, rel=0.15)
    assert s == pytest.approx(2e-4, rel=0.3)
    # the host terms alone (f held at 1) fit the device-bound runs 7% short
    h1, s1 = fit_host_terms(m, d, n, b, per_sample=True)
    pred_fit = np.maximum(f * d, n * h + b * s)
    pred_1 = np.maximum(d, n * h1 + b * s1)
    assert np.median(np.abs(pred_fit / m - 1)) < 0.02 < np.median(np.abs(pred_1 / m - 1))


def test_device_bound_runs_leave_no_invented_host_cost():
    """No run host-bound: f from the runs, and the host cost the smallest that fits (about 0), not a large
    one the runs merely do not contradict (which would price small held-out steps as host-bound)."""
    rng = np.random.default_rng(4)
    d = rng.uniform(0.1, 0.3, 6)
    n = rng.uniform(150, 300, 6)
    m = 1.09 * d * np.exp(0.005 * rng.standard_normal(6))
    h, s, f = fit_step_terms(m, d, n, None)
    assert f == pytest.approx(1.09, abs=0.01)
    assert h * n.max() < 0.05 * d.min()


def test_host_bound_runs_keep_the_factor_at_one():
    """Every run host-bound: the device side says nothing, and the weak prior keeps f at 1."""
    rng = np.random.default_rng(5)
    d = rng.uniform(0.01, 0.02, 6)
    n = rng.uniform(200, 400, 6)
    m = 4e-4 * n * np.exp(0.01 * rng.standard_normal(6))
    h, _, f = fit_step_terms(m, d, n, None)
    assert h == pytest.approx(4e-4, rel=0.03)
    # any f under m/d leaves the loss unchanged; the prior picks 1
    assert f == pytest.approx(1.0, abs=0.02)
    assert DEVICE_FACTOR_RANGE[0] <= f <= DEVICE_FACTOR_RANGE[1]


def test_pricer_scales_the_device_step():
    """A calibration's factor multiplies a device-bound step, and says so in the plan's notes."""
    from coplan.costmodel.context import build_context
    from coplan.costmodel.pricer import price

    plan = _plan(64, 512, 4)
    base = predict_step_time(plan, DEVICE, seq_chunk=0)
    scaled = DEVICE.model_copy(update={"device_step_factor": 1.12})
    assert predict_step_time(plan, scaled, seq_chunk=0) == pytest.approx(1.12 * base, rel=1e-9)
    ctx = build_context(plan.workload, plan.topology, plan.mesh, scaled, force_calibration=True)
    r = price(ctx, None, plan.layers, plan.balancing, plan.kernels, detail=False)
    assert any("device_step_factor" in note for note in r.notes)
    # with host costs too: max(f x device, host), here the device side
    d0, n = _device_and_launches(plan)
    both = scaled.model_copy(update={"host_launch_s": 0.5 * d0 / n, "host_sample_s": 1e-9})
    assert predict_step_time(synthesised(plan), both, seq_chunk=0) == pytest.approx(1.12 * d0, rel=1e-6)


def test_spec_bounds_and_old_files(tmp_path):
    """The field is optional (files written before it load with f = 1) and bounded with a clear error."""
    old = DEVICE.model_dump(mode="json")
    old.pop("device_step_factor", None)
    cal = parse_spec(Calibration, old, "old.json")
    assert cal.device_step_factor is None
    assert resolve_efficiencies(_plan(32, 256).topology, cal).device_step_factor == 1.0
    with pytest.raises(SpecError, match="device_step_factor"):
        parse_spec(Calibration, {**old, "device_step_factor": 7.0}, "bad.json")


def test_calibrate_writes_the_factor(tmp_path):
    """calibrate(host=True) on device-bound synthetic runs whose measured steps are 8% over their device
    time: the factor is written, round-trips through the file, and the steps are priced within noise."""

    rng = np.random.default_rng(8)
    dirs, plans = [], [_plan(b, 512, n) for b, n in ((64, 2), (96, 4), (128, 3), (48, 6))]
    for i, p in enumerate(plans):
        d0, _ = _device_and_launches(p)
        step = 1.08 * d0 * (1 + 0.005 * rng.standard_normal())
        d = _synth_run(tmp_path, f"r{i}", p, rng, noise=0.01)
        _write_step(d, step)
        dirs.append(d)
    cal, _, runs = calibrate(dirs, host=True)
    assert cal.device_step_factor == pytest.approx(1.08, abs=0.03)
    assert "device_step_factor" in cal.notes and "not identified" in cal.notes
    out = tmp_path / "cal.json"
    dump_spec(cal, out)
    assert load_calibration(out).device_step_factor == pytest.approx(cal.device_step_factor)
    for r in runs:
        assert predict_step_time(r.plan, cal, seq_chunk=r.seq_chunk) == pytest.approx(r.result.step_time.p50_s, rel=0.04)


def test_report_ledger_names_the_factor():
    """The report's step ledger shows the factor's share as its own loss, not as unattributed time."""
    from coplan.costmodel.context import build_context
    from coplan.costmodel.pricer import price
    from coplan.reports.ledger import build_ledger

    plan = _plan(64, 512, 4)
    preds = {}
    for f in (None, 1.12):
        cal = DEVICE.model_copy(update={"device_step_factor": f})
        ctx = build_context(plan.workload, plan.topology, plan.mesh, cal, force_calibration=True)
        preds[f] = price(ctx, None, plan.layers, plan.balancing, plan.kernels).to_prediction()
    assert preds[None].unpriced_device_s == 0.0
    extra = preds[1.12].unpriced_device_s
    assert extra == pytest.approx(preds[1.12].step_time_s - preds[None].step_time_s, rel=1e-9)
    ledger = build_ledger(plan, preds[1.12])
    [loss] = [x for x in ledger.losses if x.key == "unpriced_device"]
    assert loss.seconds == pytest.approx(extra)
    assert not any(x.key == "unpriced_device" for x in build_ledger(plan, preds[None]).losses)
