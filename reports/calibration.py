"""Calibration figure (``coplan report --calibration c.json``): predicted against measured time of every
(op, phase) sample of the runs the calibration was fitted on, before (the cost model's defaults) and
after (the calibration), with the error per op class.

The figure draws :class:`~coplan.spec.CalibrationPoints`, which calibration computes (it reads the
source runs' traces and prices each sample by the roofline its fit used) and the report verb hands in.
Without readable samples it falls back to the per-class errors the calibration file itself reports.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol, Sequence

import numpy as np
import plotly.graph_objects as go

from coplan.reports.layout import base_layout, fmt_s
from coplan.reports.palette import op_class_colour
from coplan.spec import Calibration, CalibrationPoints

CLASSES = ("gemm", "attention", "embedding", "elementwise")


class CalibrationPointsOf(Protocol):
    """Reads a calibration's source runs and prices their samples with and without it: calibration's
    ``calibration_points``, which the report verb hands in. ``extra_runs`` stand in, flagged as held out,
    when none of the source runs can be read."""

    def __call__(self, cal: Calibration, *, cal_path: str | Path | None = None,
                 extra_runs: Sequence[Path] = ()) -> CalibrationPoints: ...


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


__all__ = ["CalibrationPointsOf", "calibration_scatter"]
