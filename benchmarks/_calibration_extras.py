"""Readings of the host fit that only the calibration benchmark reports (``calibration_h200.py``): the
per-phase form of the host cost, step = Σ over phases of max(device_p, launches_p · h), for comparison
with the max form the cost model prices (:mod:`coplan.calibration.host_fit`)."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from coplan.calibration.device_fit import FitResult
from coplan.calibration.host_fit import HOST_SYNCING_BACKENDS, refine_on_grid
from coplan.calibration.runs import RunSamples
from coplan.calibration.step_price import device_calibration, priced_step
from coplan.spec import Plan

PHASES = ("fwd", "bwd", "optimizer")


def step_phases(plan: Plan, res: FitResult, moments: dict[str, tuple[float, float]] | None = None, *,
                seq_chunk: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Per phase (forward, backward with recompute, optimizer): the pricer's device time under the device
    fit (compute plus the communication it did not hide) and the launches it charges there (each phase's
    slope in the launch cost, read off numerically as :func:`coplan.calibration.step_price.step_launches` does for the step); they sum
    to the step and to :func:`coplan.costmodel.pricer.priced_launches`. For the per-phase host reading."""
    def phases(extra: float) -> np.ndarray:
        p = priced_step(plan, device_calibration(plan, res, extra), moments, seq_chunk).perf
        return np.array([p.fwd_compute_s + p.fwd_exposed_s, p.bwd_compute_s + p.recompute_s + p.bwd_exposed_s, p.optimizer_s])

    delta = 1e-6
    d0 = phases(0.0)
    return d0, np.maximum(0.0, (phases(delta) - d0) / delta)


def fit_host_phase_form(runs: Sequence[RunSamples], res: FitResult) -> tuple[float, dict[str, tuple[np.ndarray, np.ndarray]]]:
    """``h`` of the per-phase reading, step = Σ over phases of max(device_p, launches_p · h), fitted like
    the max form's (log ratios, host-syncing backends left out; see :func:`coplan.calibration.host_fit.fit_host_launch_cost`).
    Returns (h, per fitted run: its phase arrays). A reading only: it holds where the host cannot run
    ahead of the device across a phase boundary (a sync at each boundary), which the trainer does not do."""
    plain = [r for r in runs if r.plan.kernels.attention not in HOST_SYNCING_BACKENDS]
    per: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    meas = []
    for r in plain or runs:
        st = r.result.step_time if r.result else None
        if st is None or not st.p50_s:
            continue
        per[r.run] = step_phases(r.plan, res, r.step_moments or r.moments or None, seq_chunk=r.seq_chunk)
        meas.append(float(st.p50_s))
    if not per:
        return 0.0, per
    m = np.array(meas)
    D = np.array([v[0] for v in per.values()])
    N = np.array([v[1] for v in per.values()])

    def loss(h: float) -> float:
        return float(np.sum(np.log(np.maximum(D, h * N).sum(axis=1) / m) ** 2))

    hi = float(max(1e-9, np.max(m / np.maximum(N.sum(axis=1), 1.0)) * 2))
    grid = np.concatenate(([0.0], np.geomspace(hi * 1e-4, hi, 400)))
    return refine_on_grid(loss, grid, [loss(float(g)) for g in grid], 1e-10)[0], per
