"""Scaling curve: predicted MFU, scaling ratio and step time against the number of GPUs, from
``coplan simulate`` (one heuristic plan per point), with the reported plan marked on it.

The sweep is either computed here with the point function the caller hands in (the planner's
``simulate_point``: reports do not import the planner), over powers of two up to the plan's topology and
the plan's own GPU count, or read from a saved ``coplan simulate --json`` file. Points whose plan does not fit in HBM
are drawn hollow; points the simulator skipped are listed in the subtitle.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from coplan.errors import CoplanError, SpecError
from coplan.reports.layout import base_layout, fmt_bytes, fmt_s
from coplan.reports.palette import SERIES_COLOURS
from coplan.spec import Calibration, Plan, Topology, Workload
from coplan.spec.loader import load_document

SimulatePoint = Callable[[Workload, Topology, int, Calibration | None], dict]
"""Plans and prices one GPU count: a ``coplan simulate --json`` row (``gpus``, ``e2e_mfu``, ...)."""

MFU_COLOURS = {"local_mfu": "#88CCEE", "e2e_mfu": "#332288", "goodput_mfu": "#117733"}
MFU_LABELS = {"local_mfu": "local MFU (compute only)", "e2e_mfu": "E2E MFU", "goodput_mfu": "goodput MFU"}


class SweepFileError(CoplanError):
    """A ``coplan simulate --json`` file is not what the report expects."""


def default_gpu_counts(plan: Plan) -> list[int]:
    """Powers of two from one node up to the topology's size, plus the plan's own world size."""
    top = plan.topology.num_gpus
    g = max(1, plan.topology.gpus_per_node)
    out = []
    while g <= top:
        out.append(g)
        g *= 2
    out.append(plan.world_size)
    return sorted(set(out))


def simulate_sweep(plan: Plan, simulate_point: SimulatePoint, gpus: list[int] | None = None) -> list[dict]:
    """``simulate_point`` at each GPU count for the plan's workload on the plan's topology; a point it
    cannot price (or past the topology's size) is a ``skipped`` row."""
    rows = []
    for g in gpus or default_gpu_counts(plan):
        if g > plan.topology.num_gpus:
            rows.append({"gpus": g, "skipped": f"topology '{plan.topology.name}' has {plan.topology.num_gpus:,} GPUs"})
            continue
        try:
            rows.append(simulate_point(plan.workload, plan.topology, g, plan.calibration))
        except CoplanError as e:
            rows.append({"gpus": g, "skipped": str(e).splitlines()[0]})
    return rows


def load_sweep(path: str | Path) -> list[dict]:
    """Points of a saved ``coplan simulate --json`` output."""
    p = Path(path)
    if not p.exists():
        raise SweepFileError(f"{p}: no such file (write one with `coplan simulate ... --json > {p.name}`)")
    try:
        data = load_document(p)
    except SpecError as e:
        raise SweepFileError(str(e)) from None
    pts = data.get("points") if isinstance(data, dict) else None
    if not isinstance(pts, list) or not all(isinstance(r, dict) and "gpus" in r for r in pts):
        raise SweepFileError(f"{p}: expected `coplan simulate --json` output: an object with a 'points' list of rows with 'gpus'")
    if data.get("knob"):
        raise SweepFileError(f"{p}: is a sweep of knob '{data['knob']}'; the scaling curve needs a GPU-count sweep (no --knob)")
    return pts


def scaling_curve(rows: list[dict], plan: Plan | None = None, *, title: str = "Scaling: predicted MFU and step time vs GPUs") -> go.Figure:
    """Three stacked panels sharing a log₂ GPU axis: MFU (local, E2E, goodput), scaling ratio, step time."""
    ok = sorted((r for r in rows if "skipped" not in r), key=lambda r: r["gpus"])
    skipped = [r for r in rows if "skipped" in r]
    fig = make_subplots(rows=3, cols=1, shared_xaxes=True, vertical_spacing=0.06, row_heights=[0.45, 0.25, 0.30])
    x = [r["gpus"] for r in ok]

    def hover(r: dict) -> str:
        m = r.get("mesh", {})
        return (f"<b>{r['gpus']:,} GPUs</b> ({r.get('topology', '')})<br>"
                f"dense shard×replicate {m.get('dense_shard', '?')}×{m.get('dense_replicate', '?')}, EP {m.get('expert_parallel', '?')}, "
                f"sparse {m.get('sparse_shard', '?')}×{m.get('sparse_replicate', '?')}<br>"
                f"step {fmt_s(r['step_time_s'])}: compute {fmt_s(r['compute_s'])}, exposed comm {fmt_s(r['exposed_comm_s'])}<br>"
                f"local MFU {100 * r['local_mfu']:.2f}%, scaling {100 * r['scaling_ratio']:.1f}%, E2E {100 * r['e2e_mfu']:.2f}%, "
                f"goodput MFU {100 * r['goodput_mfu']:.2f}%<br>memory {fmt_bytes(r['memory_bytes'])} of {fmt_bytes(r['hbm_bytes'])}"
                + ("" if r.get("fits", True) else " <b>(does not fit)</b>"))

    texts = [hover(r) for r in ok]
    symbols = ["circle" if r.get("fits", True) else "circle-open" for r in ok]
    for key in ("local_mfu", "e2e_mfu", "goodput_mfu"):
        fig.add_trace(go.Scatter(
            x=x, y=[100 * r[key] for r in ok], mode="lines+markers", name=MFU_LABELS[key],
            line={"color": MFU_COLOURS[key], "width": 2}, marker={"symbol": symbols, "size": 7},
            hovertext=texts, hoverinfo="text", legendgroup="mfu",
        ), row=1, col=1)
    fig.add_trace(go.Scatter(
        x=x, y=[100 * r["scaling_ratio"] for r in ok], mode="lines+markers", name="scaling ratio (compute / step)",
        line={"color": "#44AA99", "width": 2}, marker={"symbol": symbols, "size": 7}, hovertext=texts, hoverinfo="text",
    ), row=2, col=1)
    fig.add_trace(go.Scatter(
        x=x, y=[r["step_time_s"] for r in ok], mode="lines+markers", name="step time",
        line={"color": "#555555", "width": 2}, marker={"symbol": symbols, "size": 7}, hovertext=texts, hoverinfo="text",
    ), row=3, col=1)
    if plan is not None and plan.predicted is not None:
        p = plan.predicted
        who = f"this plan, E2E MFU ({plan.solver.status.lower() if plan.solver else 'planned'})"
        ph = (f"<b>{who}</b>, {plan.world_size:,} GPUs<br>E2E MFU {100 * p.e2e_mfu:.2f}%, goodput MFU {100 * p.goodput_mfu:.2f}%<br>"
              f"scaling {100 * p.scaling_ratio:.1f}%, step {fmt_s(p.step_time_s)}")
        star = {"symbol": "star", "size": 14, "color": SERIES_COLOURS["predicted"], "line": {"color": "#fff", "width": 1}}
        fig.add_trace(go.Scatter(x=[plan.world_size], y=[100 * p.e2e_mfu], mode="markers", name=who, marker=star,
                                 hovertext=[ph], hoverinfo="text", legendgroup="plan"), row=1, col=1)
        fig.add_trace(go.Scatter(x=[plan.world_size], y=[100 * p.scaling_ratio], mode="markers", marker=star, showlegend=False,
                                 hovertext=[ph], hoverinfo="text", legendgroup="plan"), row=2, col=1)
        fig.add_trace(go.Scatter(x=[plan.world_size], y=[p.step_time_s], mode="markers", marker=star, showlegend=False,
                                 hovertext=[ph], hoverinfo="text", legendgroup="plan"), row=3, col=1)
    fig.update_xaxes(type="log", dtick=0.30102999566, tickformat=",d", row=3, col=1, title_text="GPUs (log scale)")
    fig.update_xaxes(type="log", dtick=0.30102999566, tickformat=",d", row=1, col=1)
    fig.update_xaxes(type="log", dtick=0.30102999566, tickformat=",d", row=2, col=1)
    fig.update_yaxes(title_text="MFU (%)", rangemode="tozero", row=1, col=1)
    fig.update_yaxes(title_text="scaling (%)", range=[0, 105], row=2, col=1)
    fig.update_yaxes(title_text="step (s)", rangemode="tozero", row=3, col=1)
    parts = [f"{len(ok)} points from coplan simulate (a heuristic plan per point; hollow: does not fit in HBM)"]
    if skipped:
        parts.append("skipped: " + ", ".join(f"{r['gpus']:,}" for r in skipped[:6]) + (f" ({skipped[0]['skipped']})" if skipped else ""))
    return base_layout(fig, title, subtitle="; ".join(parts), height=640)


__all__ = ["SimulatePoint", "SweepFileError", "default_gpu_counts", "load_sweep", "scaling_curve", "simulate_sweep"]
