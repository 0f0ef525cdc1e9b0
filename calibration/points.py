"""Predicted against measured time of every (op, phase) sample of the runs a calibration was fitted on,
before (the cost model's defaults) and after (the calibration): what the report's calibration figure
draws. Each run's traces are attributed (:func:`~coplan.calibration.runs.run_samples`) and each sample
is priced by the same roofline the fit used (:func:`~coplan.calibration.device_fit.predict`) under the
efficiencies resolved with and without the calibration.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np

from coplan.calibration.device_fit import attention_scale_of, predict
from coplan.calibration.runs import run_samples
from coplan.costmodel.efficiency import resolve_efficiencies
from coplan.errors import CoplanError
from coplan.spec import Calibration, CalibrationPoints


def _resolve_run(path: str, base: Path | None) -> Path | None:
    p = Path(path)
    for cand in ([p] if p.is_absolute() else [p] + ([base / p] if base else [])):
        if cand.is_dir():
            return cand
    return None


def calibration_points(cal: Calibration, *, cal_path: str | Path | None = None, extra_runs: Sequence[Path] = ()) -> CalibrationPoints:
    """Read the calibration's source runs (relative paths: from the working directory, else from the
    calibration file's folder) and price every sample both ways. ``extra_runs`` (the report's ``--run``)
    stand in, flagged as held out, only when none of the source runs can be read: mixing fitted and
    unseen samples in one error figure would blur both."""
    base = Path(cal_path).resolve().parent if cal_path else None
    dirs: list[Path] = []
    skipped: list[str] = []
    for s in cal.source_runs:
        d = _resolve_run(s, base)
        if d is None:
            skipped.append(f"{s}: not found")
        elif d.resolve() not in [x.resolve() for x in dirs]:
            dirs.append(d)
    held_out = False
    if not dirs and extra_runs:
        # none of the runs the fit read is here: show the given run instead, as data the fit never saw
        dirs = list(extra_runs)
        held_out = True
    names: list[str] = []
    cls: list[str] = []
    meas: list[float] = []
    before: list[float] = []
    after: list[float] = []
    runs: list[str] = []
    for d in dirs:
        try:
            rs = run_samples(d, force=True)
        except CoplanError as e:
            skipped.append(f"{d}: {str(e).splitlines()[0]}")
            continue
        topo = rs.plan.topology
        e0 = resolve_efficiencies(topo, default_gap=False)
        e1 = resolve_efficiencies(topo, cal, force=True)
        b = predict(rs.samples, e0.compute, e0.memory, e0.launch_s, e0.lookup_id_s, attention_scale_of(e0))
        a = predict(rs.samples, e1.compute, e1.memory, e1.launch_s, e1.lookup_id_s, attention_scale_of(e1))
        runs.append(rs.run)
        for s, pb, pa in zip(rs.samples, b, a):
            names.append(f"{rs.run}: {s.name} ({s.phase})")
            cls.append(s.op_class)
            meas.append(s.measured_s)
            before.append(float(pb))
            after.append(float(pa))
    return CalibrationPoints(names, cls, np.asarray(meas), np.asarray(before), np.asarray(after), runs, skipped, held_out)


__all__ = ["calibration_points"]
