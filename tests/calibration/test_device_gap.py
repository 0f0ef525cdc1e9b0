"""The device gap: device time no priced op accounts for taken per priced launch (the gaps between dependent
kernels, a replayed CUDA graph's included), the alternative to the device-step factor. Fitted with the host
costs to measured steps (step = max(device + g x device launches, host)), kept where it fits the steps closer
than the factor, written to the Calibration and priced by ``coplan plan`` in every class's launch cost."""

from __future__ import annotations

import numpy as np
import pytest

from coplan.calibration.assemble import calibrate
from coplan.calibration.host_fit import (DEVICE_GAP_RANGE, device_term_loss, fit_gap_terms, fit_host_launch_cost,
                                         fit_step_terms)
from coplan.calibration.step_price import predict_step_time
from coplan.costmodel.efficiency import resolve_efficiencies
from coplan.calibration.runs import CalibrationError
from coplan.errors import SpecError
from coplan.spec import Calibration, dump_spec, load_calibration, parse_spec

from .test_calibrate import _synth_run, _write_step
from .test_host_pricing import DEVICE, _device_and_launches, _plan


def _gapped(rng, n_runs=10, g=4e-6, noise=0.005):
    """Device-bound runs from small steps dense in launches to large ones with few a millisecond, measured at
    device + g x launches."""
    d = np.geomspace(0.008, 0.4, n_runs)
    nd = rng.uniform(800, 3000, n_runs)  # launches per step, unrelated to its length
    n = rng.uniform(20, 60, n_runs)  # host launches (graphed: a few)
    m = (d + g * nd) * np.exp(noise * rng.standard_normal(n_runs))
    return m, d, n, nd


def test_fit_recovers_the_gap_and_fits_closer_than_a_factor():
    rng = np.random.default_rng(11)
    m, d, n, nd = _gapped(rng)
    h, s, g, loss_g = fit_gap_terms(m, d, n, nd)
    assert g == pytest.approx(4e-6, rel=0.05)
    assert h * n.max() < 0.05 * d.min()  # device-bound: no host cost invented
    pred = d + g * nd
    assert np.max(np.abs(pred / m - 1)) < 0.02
    # one factor for all overstates the large steps and understates the small ones
    hf, sf, f = fit_step_terms(m, d, n, None)
    loss_f = device_term_loss(m, d, n, None, None, None, None, None, hf, sf, f)
    assert loss_g < 0.2 * loss_f
    assert np.max(np.abs(f * d / m - 1)) > 0.15


def test_a_factor_stays_a_factor():
    """Steps that are a share over their device time: the gap fits them worse (the form is chosen on the fit)."""
    rng = np.random.default_rng(12)
    d = np.geomspace(0.008, 0.4, 10)
    nd = rng.uniform(800, 3000, 10)
    n = rng.uniform(20, 60, 10)
    m = 1.1 * d * np.exp(0.005 * rng.standard_normal(10))
    hf, sf, f = fit_step_terms(m, d, n, None)
    hg, sg, g, loss_g = fit_gap_terms(m, d, n, nd)
    assert f == pytest.approx(1.1, abs=0.01)
    assert device_term_loss(m, d, n, None, None, None, None, None, hf, sf, f) < loss_g
    assert DEVICE_GAP_RANGE[0] <= g <= DEVICE_GAP_RANGE[1]


def test_pricer_adds_the_gap_per_priced_launch():
    """A calibration's gap adds g x the priced launches to a device-bound step (the launch slope), and the plan's
    notes say how much."""
    from coplan.costmodel.context import build_context
    from coplan.costmodel.pricer import price

    plan = _plan(64, 512, 4)
    d0, n = _device_and_launches(plan)
    from .test_calibrate import synthesised

    gapped = DEVICE.model_copy(update={"device_gap_s": 3e-6})
    assert predict_step_time(synthesised(plan), gapped, seq_chunk=0) == pytest.approx(d0 + 3e-6 * n, rel=1e-6)
    eff = resolve_efficiencies(plan.topology, gapped, force=True)
    assert eff.device_gap_s == 3e-6 and "device_gap" in eff.sources
    ctx = build_context(plan.workload, plan.topology, plan.mesh, gapped, force_calibration=True)
    r = price(ctx, None, plan.layers, plan.balancing, plan.kernels, detail=False)
    assert any("device_gap_s" in note for note in r.notes)


def test_spec_bounds_and_old_files():
    old = DEVICE.model_dump(mode="json")
    old.pop("device_gap_s", None)
    cal = parse_spec(Calibration, old, "old.json")
    assert cal.device_gap_s is None
    assert resolve_efficiencies(_plan(32, 256).topology, cal, force=True).device_gap_s == 0.0
    with pytest.raises(SpecError, match="device_gap_s"):
        parse_spec(Calibration, {**old, "device_gap_s": -1e-6}, "bad.json")


def test_unknown_device_term_is_refused():
    with pytest.raises(CalibrationError, match="device term"):
        fit_host_launch_cost([], None, fit_device_factor=True, device_term="both")


def test_calibrate_writes_the_gap(tmp_path):
    """calibrate(host=True, device_term="best") on device-bound synthetic runs measured at device + 5 us x their
    priced launches, small and large: the gap is written (no factor), round-trips, and prices each step within noise;
    with the default (a factor) the same runs are priced worse."""
    rng = np.random.default_rng(9)
    dirs = []
    plans = [_plan(b, L, n) for b, L, n in ((16, 128, 6), (32, 256, 2), (128, 1024, 2), (256, 1024, 1), (24, 128, 5))]
    for i, p in enumerate(plans):
        d0, n = _device_and_launches(p)
        d = _synth_run(tmp_path, f"r{i}", p, rng, noise=0.01)
        _write_step(d, (d0 + 5e-6 * n) * (1 + 0.003 * rng.standard_normal()))
        dirs.append(d)
    cal, _, runs = calibrate(dirs, host=True, device_term="best")  # (the default fits a factor)
    assert cal.device_step_factor is None
    assert cal.device_gap_s == pytest.approx(5e-6, rel=0.25)  # (the device fit of the noisy traces moves the launch costs)
    assert "device_gap_s" in cal.notes
    out = tmp_path / "cal.json"
    dump_spec(cal, out)
    assert load_calibration(out).device_gap_s == pytest.approx(cal.device_gap_s)
    err = [abs(predict_step_time(r.plan, cal, seq_chunk=r.seq_chunk) / r.result.step_time.p50_s - 1) for r in runs]
    assert max(err) < 0.04
    forced, _, _ = calibrate(dirs, host=True, prepared=runs)
    assert forced.device_gap_s is None and forced.device_step_factor is not None
    err_f = [abs(predict_step_time(r.plan, forced, seq_chunk=r.seq_chunk) / r.result.step_time.p50_s - 1) for r in runs]
    assert max(err_f) > max(err)
    # a base's gap is not carried into the launch costs a new fit starts from
    again, _, _ = calibrate(dirs, host=True, base=cal, force=True, prepared=runs, device_term="gap")
    assert again.device_gap_s == pytest.approx(cal.device_gap_s, rel=0.1)
