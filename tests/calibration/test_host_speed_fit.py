"""The host-cost fit with each run's host speed (``fit_host_terms``): recovers known parameters from
synthetic measured steps with noise, and shows why the speed matters when it goes with the batch."""

import numpy as np
import pytest

from coplan.calibration.runs import CalibrationError
from coplan.calibration.host_fit import fit_host_terms
from coplan.calibration.host_profile import host_reference_us
from coplan.calibration.host_profile import HostProfile


def _runs(seed: int, h: float, s: float, *, speed_with_batch: bool, noise: float = 0.02):
    rng = np.random.default_rng(seed)
    n_runs = 10
    launches = rng.uniform(150, 400, n_runs)
    batch = rng.choice([16.0, 32.0, 48.0, 64.0], n_runs)
    # the round-4 confound: the big-batch runs happened to meet a slow host
    speed = 0.8 + 0.015 * batch if speed_with_batch else rng.uniform(0.8, 1.9, n_runs)
    device = rng.uniform(0.01, 0.05, n_runs)
    device[:2] = 0.2  # two device-bound runs: their steps say nothing of the host
    meas = np.maximum(device, speed * (h * launches + s * batch)) * np.exp(rng.normal(0, noise, n_runs))
    return meas, device, launches, batch, speed


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("s_true", [0.0, 150e-6])
def test_recovers_known_host_costs_with_speeds(seed, s_true):
    h_true = 200e-6
    meas, dev, n, b, k = _runs(seed, h_true, s_true, speed_with_batch=False)
    h, s = fit_host_terms(meas, dev, n, b, per_sample=True, speed=k)
    # per launch within 10%; per sample within 60 us (it rides on 16-64 samples against ~300 launches)
    assert h == pytest.approx(h_true, rel=0.10)
    assert abs(s - s_true) < 60e-6


def test_speed_going_with_batch_bends_the_fit_without_it():
    h_true, s_true = 200e-6, 0.0
    meas, dev, n, b, k = _runs(3, h_true, s_true, speed_with_batch=True, noise=0.01)
    h_blind, s_blind = fit_host_terms(meas, dev, n, b, per_sample=True)
    h, s = fit_host_terms(meas, dev, n, b, per_sample=True, speed=k)
    assert h == pytest.approx(h_true, rel=0.10) and s < 30e-6
    # blind to the host's speed, the fit reads the slow big-batch runs as a per-sample cost
    assert s_blind > 100e-6


def test_bad_inputs_are_refused():
    with pytest.raises(CalibrationError, match="one value per run"):
        fit_host_terms([0.05, 0.06], [0.01], [200, 300])
    with pytest.raises(CalibrationError, match="positive"):
        fit_host_terms([0.05], [0.01], [200], speed=[0.0])
    with pytest.raises(CalibrationError, match="unknown host form"):
        fit_host_terms([0.05], [0.01], [200], form="sum")


def test_host_reference_is_the_geometric_mean_of_shared_calls():
    def prof(**us):
        return HostProfile(1, 0.05, 0.02, 0.02, 0.01, 100, 100, 10, 0.0, 0.0, 0.0, 0.0, op_median_us=us)

    ref = host_reference_us([prof(**{"aten::mm": 20.0, "aten::add_": 10.0}), prof(**{"aten::mm": 80.0})])
    assert ref == {"aten::mm": pytest.approx(40.0)}
