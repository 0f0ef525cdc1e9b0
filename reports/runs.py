"""Run figures (``coplan report --run runs/<id>``): what a training run measured next to what the plan
predicted. Per step: step time, MFU and the jagged imbalance from ``metrics.jsonl``; per op class:
device time attributed from the Kineto traces (a :class:`~coplan.spec.TraceClassTimes` that calibration
computes and the report verb hands in) against the cost model's per-op and per-collective times.

Both sides are per optimizer step. The measured side of the op-class figure is the mean over the
ranks whose traces were read, with the slowest and fastest rank as the error bar. A run on another
device than the plan's topology (a CPU functional run on gloo) is compared as it is and flagged.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from coplan.reports.inputs import RunData
from coplan.reports.layout import base_layout, fmt_pct, fmt_s
from coplan.reports.palette import SERIES_COLOURS, collective_colour, op_class_colour
from coplan.spec import Plan, Prediction, TraceClassTimes

TraceClassTimesOf = Callable[[Sequence[Path]], TraceClassTimes | None]
"""Attributes a run's rank traces (rank order) per op class: calibration's ``trace_class_times``, which the
report verb hands in."""

COMPUTE_CLASSES = ("gemm", "attention", "embedding", "elementwise")


def _log_if_wide(values: list[float]) -> str:
    v = [x for x in values if x and x > 0]
    return "log" if v and max(v) / min(v) > 30 else "linear"


def run_steps(run: RunData, pred: Prediction | None, *, title: str = "Measured vs predicted, step by step") -> go.Figure:
    """Step time, MFU and jagged imbalance per step (measured), with the prediction as a dashed line."""
    res = run.result
    warm = res.warmup_steps
    fig = make_subplots(rows=3, cols=1, shared_xaxes=True, vertical_spacing=0.07, row_heights=[0.4, 0.35, 0.25])
    panels = (("step_time_s", "step time (s)", pred.step_time_s if pred else None, 1.0),
              ("mfu", "MFU (%)", pred.e2e_mfu if pred else None, 100.0),
              ("imbalance", "imbalance (max/mean)", pred.imbalance if pred else None, 1.0))
    for row, (key, label, predicted, k) in enumerate(panels, 1):
        xs, ys = run.series(key)
        if not xs:
            continue
        ys = [y * k for y in ys]
        warm_x = [x for x in xs if x < warm]
        colours = ["#BBBBBB" if x < warm else SERIES_COLOURS["measured"] for x in xs]
        unit = "s" if key == "step_time_s" else ("%" if key == "mfu" else "")
        hover = [f"step {x}{' (warm-up)' if x < warm else ''}<br>measured {label.split(' (')[0]}: "
                 + (fmt_s(y) if key == "step_time_s" else f"{y:.4g}{unit}") for x, y in zip(xs, ys)]
        fig.add_trace(go.Scatter(
            x=xs, y=ys, mode="lines+markers", name="measured" if row == 1 else None, showlegend=row == 1, legendgroup="m",
            line={"color": SERIES_COLOURS["measured"], "width": 1.5}, marker={"color": colours, "size": 6},
            hovertext=hover, hoverinfo="text",
        ), row=row, col=1)
        yvals = list(ys)
        if predicted is not None and predicted > 0:
            pv = predicted * k
            yvals.append(pv)
            fig.add_trace(go.Scatter(
                x=[min(xs), max(xs)], y=[pv, pv], mode="lines", name="predicted" if row == 1 else None, showlegend=row == 1,
                legendgroup="p", line={"color": SERIES_COLOURS["predicted"], "dash": "dash", "width": 2},
                hovertemplate=f"predicted {label.split(' (')[0]}: " + (fmt_s(pv) if key == "step_time_s" else f"{pv:.4g}{unit}") + "<extra></extra>",
            ), row=row, col=1)
        if warm_x:
            fig.add_vrect(x0=min(xs) - 0.5, x1=max(warm_x) + 0.5, fillcolor="#999", opacity=0.12, line_width=0, row=row, col=1)
        fig.update_yaxes(title_text=label, type=_log_if_wide(yvals), exponentformat="power", row=row, col=1)
    fig.update_xaxes(title_text="step", row=3, col=1)
    st = res.step_time
    sub = (f"run {res.run_id}: {res.steps} steps on {res.world_size} × {res.device or '?'} ({res.warmup_steps} warm-up, grey); "
           + (f"measured p50 {fmt_s(st.p50_s)}, MFU {fmt_pct(res.measured_mfu, 3)}" if st else "no step measured")
           + (f"; predicted {fmt_s(pred.step_time_s)}, E2E MFU {fmt_pct(pred.e2e_mfu, 3)}" if pred else ""))
    return base_layout(fig, title, subtitle=sub, height=620)


@dataclass(frozen=True, slots=True)
class ClassTimes:
    """Seconds per step per class: predicted, and measured per rank."""

    classes: tuple[str, ...]
    predicted: dict[str, float]
    measured: dict[str, list[float]]
    """Class → per-rank seconds per step (ranks whose traces were read)."""
    unattributed: list[float]
    """Per rank: trace time no op claimed, per step."""
    ranks_read: tuple[int, ...]
    on_device: bool


def class_times(traced: TraceClassTimes | None, pred: Prediction | None) -> ClassTimes | None:
    """Predicted vs measured seconds per step by op class and collective kind (None without traces)."""
    if traced is None:
        return None
    predicted: dict[str, float] = {}
    if pred is not None:
        for o in pred.ops:
            predicted[o.op_class] = predicted.get(o.op_class, 0.0) + o.time_s
        for c in pred.comms:
            k = f"comm:{c.collective}"
            predicted[k] = predicted.get(k, 0.0) + c.time_s
    measured = traced.measured
    keys = [c for c in COMPUTE_CLASSES if c in predicted or c in measured]
    keys += sorted(k for k in set(predicted) | set(measured) if k not in keys)
    return ClassTimes(tuple(keys), predicted, measured, traced.unattributed, traced.ranks_read, traced.on_device)


def run_op_classes(run: RunData, traced: TraceClassTimes | None, pred: Prediction | None, plan: Plan | None = None, *,
                   title: str = "Measured vs predicted time per op class") -> go.Figure | None:
    """Grouped horizontal bars per class: predicted, measured (mean over traced ranks, min–max bar);
    ``traced``: the run's traces attributed per class (None without traces)."""
    ct = class_times(traced, pred)
    if ct is None:
        return None
    labels = [k.replace("comm:", "comm: ").replace("_", "-") if k.startswith("comm:") else k for k in ct.classes]
    fig = go.Figure()
    pv = [ct.predicted.get(k, 0.0) for k in ct.classes]
    mv = [ct.measured.get(k, [0.0]) for k in ct.classes]
    mean = [float(np.mean(v)) for v in mv]
    lo = [m - float(np.min(v)) for m, v in zip(mean, mv)]
    hi = [float(np.max(v)) - m for m, v in zip(mean, mv)]
    colours = [collective_colour(k[5:]) if k.startswith("comm:") else op_class_colour(k) for k in ct.classes]

    def ratio(m: float, p: float) -> str:
        return f"measured / predicted = {m / p:.3g}×" if p > 0 and m > 0 else "no counterpart"

    fig.add_trace(go.Bar(
        y=labels, x=pv, orientation="h", name="predicted (light bars)", marker={"color": colours, "opacity": 0.45, "line": {"color": colours, "width": 1.5}},
        hovertext=[f"<b>{l}</b><br>predicted {fmt_s(p)} per step<br>{ratio(m, p)}" for l, p, m in zip(labels, pv, mean)], hoverinfo="text",
    ))
    fig.add_trace(go.Bar(
        y=labels, x=mean, orientation="h", name="measured (hatched bars: mean over ranks, min–max)", marker={"color": colours, "pattern": {"shape": "x", "fgcolor": "#fff", "size": 4}},
        error_x={"type": "data", "symmetric": False, "array": hi, "arrayminus": lo, "color": "#333", "thickness": 1},
        hovertext=[f"<b>{l}</b><br>measured {fmt_s(m)} per step (ranks {min(v) * 1e3:.4g}–{max(v) * 1e3:.4g} ms)<br>{ratio(m, p)}"
                   for l, m, v, p in zip(labels, mean, mv, pv)], hoverinfo="text",
    ))
    fig.update_layout(barmode="group", bargap=0.25)
    fig.update_yaxes(autorange="reversed", automargin=True)
    fig.update_xaxes(title_text="seconds per step", type=_log_if_wide(pv + mean), exponentformat="power")
    device = run.result.device or "?"
    gpu = plan.topology.gpu.name if plan is not None else "?"
    parts = [f"traces of rank(s) {', '.join(map(str, ct.ranks_read))} of {run.result.world_size}"]
    if not ct.on_device:
        parts.append("CPU traces: top-level CPU ops stand in for kernels")
    if plan is not None and device.lower() not in gpu.lower() and gpu.lower() not in device.lower():
        parts.append(f"<b>measured on {device}, predicted for {gpu}</b>")
    un = float(np.mean(ct.unattributed)) if ct.unattributed else 0.0
    if un > 0:
        parts.append(f"{fmt_s(un)} per step not attributed to any op")
    return base_layout(fig, title, subtitle="; ".join(parts), height=max(320, 120 + 44 * len(labels)))


__all__ = ["ClassTimes", "TraceClassTimesOf", "class_times", "run_op_classes", "run_steps"]
