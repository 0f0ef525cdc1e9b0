"""Calibration figure (``coplan report --calibration c.json``): predicted against measured time of every
(op, phase) sample of the runs the calibration was fitted on, before (the cost model's defaults) and
after (the calibration), with the error per op class.

Samples, measured times and predictions all come from :mod:`coplan.calibration`: each run's
traces are attributed (:func:`~coplan.calibration.runs.run_samples`) and each sample is priced by
the same roofline the fit used (:func:`~coplan.calibration.device_fit.predict`) under the efficiencies
resolved with and without the calibration. When none of the source runs can be read, the figure falls
back to the per-class errors the calibration file itself reports.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import plotly.graph_objects as go

from coplan.errors import CoplanError
from coplan.reports.layout import base_layout, fmt_s
from coplan.reports.palette import op_class_colour
from coplan.spec import Calibration

CLASSES = ("gemm", "attention", "embedding", "elementwise")


@dataclass(frozen=True, slots=True)
class CalibrationPoints:
    """Samples of the source runs with their measured and predicted seconds (per micro-batch)."""

    names: list[str]
    """'<run>: <op> (<phase>)'."""
    op_class: list[str]
    measured: np.ndarray
    before: np.ndarray
    """Predicted with the cost model's default efficiencies."""
    after: np.ndarray
    """Predicted with the calibration."""
    runs: list[str]
    skipped: list[str]
    """Source runs that could not be read, with the reason."""
    held_out: bool = False
    """The samples come from a run the calibration was not fitted on (none of its source runs was readable)."""

    def class_error(self, which: str) -> dict[str, float]:
        """|Σ predicted − Σ measured| / Σ measured per class (the calibration's own definition)."""
        pred = self.after if which == "after" else self.before
        out = {}
        for c in sorted(set(self.op_class)):
            idx = [i for i, k in enumerate(self.op_class) if k == c]
            m = float(self.measured[idx].sum())
            out[c] = abs(float(pred[idx].sum()) - m) / m if m > 0 else 0.0
        return out

    def median_error(self, which: str) -> float:
        pred = self.after if which == "after" else self.before
        return float(np.median(np.abs(pred - self.measured) / self.measured)) if self.measured.size else 0.0


def _resolve_run(path: str, base: Path | None) -> Path | None:
    p = Path(path)
    for cand in ([p] if p.is_absolute() else [p] + ([base / p] if base else [])):
        if cand.is_dir():
            return cand
    return None


def calibration_points(cal: Calibration, *, cal_path: str | Path | None = None, extra_runs: list[Path] = ()) -> CalibrationPoints:
    """Read the calibration's source runs and price every sample both ways. ``extra_runs`` (the report's
    ``--run``) stand in, flagged as held out, only when none of the source runs can be read: mixing
    fitted and unseen samples in one error figure would blur both."""
    from coplan.calibration.device_fit import predict
    from coplan.calibration.runs import run_samples
    from coplan.costmodel.efficiency import resolve_efficiencies

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
        dirs = [d for d in extra_runs]
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
        e0 = resolve_efficiencies(topo)
        e1 = resolve_efficiencies(topo, cal, force=True)
        b = predict(rs.samples, e0.compute, e0.memory, e0.launch_s, e0.lookup_id_s)
        a = predict(rs.samples, e1.compute, e1.memory, e1.launch_s, e1.lookup_id_s)
        runs.append(rs.run)
        for s, pb, pa in zip(rs.samples, b, a):
            names.append(f"{rs.run}: {s.name} ({s.phase})")
            cls.append(s.op_class)
            meas.append(s.measured_s)
            before.append(float(pb))
            after.append(float(pa))
    return CalibrationPoints(names, cls, np.asarray(meas), np.asarray(before), np.asarray(after), runs, skipped, held_out)


def calibration_scatter(cal: Calibration, points: CalibrationPoints | None, *,
                        title: str = "Calibration: predicted vs measured per op") -> go.Figure:
    """Log-log scatter of measured against predicted (after: filled, before: hollow), y = x diagonal,
    error per op class in the legend. Without readable samples: the calibration's reported errors."""
    fig = go.Figure()
    fe = cal.fit_error
    if points is None or points.measured.size == 0:
        per = fe.per_op_class if fe else {}
        ks = [k for k in CLASSES if k in per] + sorted(k for k in per if k not in CLASSES)
        fig.add_trace(go.Bar(
            x=ks, y=[100 * per[k] for k in ks], marker_color=[op_class_colour(k) for k in ks], name="fit error",
            hovertemplate="%{x}: |Σ predicted − Σ measured| / Σ measured = %{y:.2f}%<extra></extra>",
        ))
        fig.update_yaxes(title_text="relative error of the class total (%)", rangemode="tozero")
        why = "; ".join(points.skipped[:3]) if points and points.skipped else "the calibration lists no source runs"
        sub = f"the calibration's reported errors per op class (samples not available: {why})"
        return base_layout(fig, title, subtitle=sub, height=380, legend=False)
    eb, ea = points.class_error("before"), points.class_error("after")
    lo = float(min(points.measured.min(), points.after.min(), points.before.min()))
    hi = float(max(points.measured.max(), points.after.max(), points.before.max()))
    for c in [k for k in CLASSES if k in set(points.op_class)] + sorted(set(points.op_class) - set(CLASSES)):
        idx = [i for i, k in enumerate(points.op_class) if k == c]
        colour = op_class_colour(c)
        m = points.measured[idx]
        for which, pred, sym in (("before", points.before[idx], "circle-open"), ("after", points.after[idx], "circle")):
            err = eb[c] if which == "before" else ea[c]
            label = f"{c} {'default' if which == 'before' else 'calibrated'}: class error {100 * err:.1f}%"
            hover = [f"<b>{points.names[i]}</b><br>measured {fmt_s(mm)}<br>predicted ({'defaults' if which == 'before' else 'calibrated'}) "
                     f"{fmt_s(pp)}<br>error {100 * (pp - mm) / mm:+.1f}%" for i, mm, pp in zip(idx, m, pred)]
            fig.add_trace(go.Scatter(
                x=pred, y=m, mode="markers", name=label, legendgroup=c,
                marker={"symbol": sym, "color": colour, "size": 7 if which == "after" else 6, "line": {"color": colour, "width": 1}},
                hovertext=hover, hoverinfo="text", visible=True if which == "after" else "legendonly",
            ))
    fig.add_trace(go.Scatter(x=[lo, hi], y=[lo, hi], mode="lines", name="predicted = measured",
                             line={"color": "#555", "dash": "dot", "width": 1}, hoverinfo="skip"))
    for k, txt in ((2.0, "2×"), (0.5, "½×")):
        fig.add_trace(go.Scatter(x=[lo, hi], y=[lo * k, hi * k], mode="lines", showlegend=False, line={"color": "#bbb", "dash": "dot", "width": 1},
                                 hoverinfo="skip"))
    rng = [float(np.log10(lo)) - 0.15, float(np.log10(hi)) + 0.15]
    fig.update_xaxes(type="log", title_text="predicted seconds per micro-batch", exponentformat="power", range=rng)
    fig.update_yaxes(type="log", title_text="measured seconds per micro-batch", exponentformat="power", range=rng)
    sub = (f"{points.measured.size} samples from {len(points.runs)} run(s) on {cal.device}"
           + (" (HELD OUT: the fit never saw them; its source runs are not here)" if points.held_out else "") + "; median |error| "
           f"{100 * points.median_error('before'):.1f}% with defaults → {100 * points.median_error('after'):.1f}% calibrated"
           + (f" (the file reports {100 * fe.median_abs_rel_error:.1f}%)" if fe else "")
           + "; hollow markers (defaults) are hidden: click the legend"
           + (f"; unread: {'; '.join(points.skipped[:2])}" if points.skipped else ""))
    return base_layout(fig, title, subtitle=sub, height=560)


__all__ = ["CalibrationPoints", "calibration_points", "calibration_scatter"]
