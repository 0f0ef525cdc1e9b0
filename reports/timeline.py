"""Predicted step timeline: the critical rank's compute stream and its communication streams (one per
bottleneck link: collectives that share links queue, others run side by side), task by task, exactly as
the cost model scheduled them (:mod:`coplan.costmodel.schedule`: in-order streams, FSDP prefetch one
layer ahead, embedding all-to-alls, MoE dispatch/combine, reduce-scatters as layers finish).

Each compute task (a layer's forward, backward or recompute; an MoE layer's router, experts, shared
experts and the rest) is cut into one segment per op class, in proportion to the cost model's per-op
times for that layer and phase, so the colours match every other figure. Time the compute stream sits
idle is drawn as a hatched "waiting" segment: that is the exposed communication. Shaded bands mark the
forward, backward and optimizer phases.
"""

from __future__ import annotations

from collections import defaultdict

import plotly.graph_objects as go

from coplan.reports.layout import base_layout, best_time_unit, fmt_bytes, fmt_s
from coplan.reports.ledger import comm_label
from coplan.reports.palette import PHASE_COLOURS, collective_colour, loss_colour, op_class_colour

COMPUTE_ROW = "compute"
COMM_ROW = "communication"


def _is_compute(task) -> bool:
    v = getattr(task, "is_compute", None)
    return bool(v) if v is not None else task.stream in (0, "compute")


def _comm_row(stream) -> str:
    """Row label of a communication stream: the cost model keeps one per bottleneck link ('net:<tier>')."""
    s = str(stream)
    if s.startswith("net:"):
        return f"comm: {s[4:]} links"
    return COMM_ROW if s in ("1", "comm") else f"comm: {s}"
CLASS_ORDER = ("embedding", "gemm", "attention", "elementwise")

_MOE_PART_OPS = {"router": ("router",), "shared": ("shared_experts",), "experts": ("experts",)}


def _task_ops(task, ops_by_layer_phase: dict[tuple[str, str], list]) -> list:
    """The cost model's ops a compute task runs (matched by layer, phase and, for MoE parts, name)."""
    name = task.name
    phase = task.phase
    last = name.rsplit(".", 1)[-1]
    if last in ("fwd", "bwd", "recompute"):
        return ops_by_layer_phase.get((task.layer, phase), [])
    part = last[:-4] if last.endswith("_bwd") else last
    if part in _MOE_PART_OPS or part == "post":
        cands = ops_by_layer_phase.get((task.layer, "bwd" if last.endswith("_bwd") else phase), [])
        if part == "post":
            taken = {s for v in _MOE_PART_OPS.values() for s in v}
            return [o for o in cands if o.name.rsplit(".", 1)[-1] not in taken]
        return [o for o in cands if o.name.rsplit(".", 1)[-1] in _MOE_PART_OPS[part]]
    # a task named after an op (sparse.tbe, optimizer.step)
    return [o for o in ops_by_layer_phase.get((task.layer, phase), []) if o.name == name] or \
        [o for o in ops_by_layer_phase.get((task.layer, "bwd" if name.endswith("_bwd") else phase), []) if name.startswith(o.name)]


def _phase_bands(tasks, start, end) -> list[tuple[str, float, float]]:
    """Contiguous runs of one phase on the compute stream: (phase, t0, t1)."""
    bands: list[tuple[str, float, float]] = []
    for i, t in enumerate(tasks):
        if not _is_compute(t) or t.duration <= 0:
            continue
        ph = "bwd" if t.phase == "recompute" else t.phase
        if bands and bands[-1][0] == ph:
            bands[-1] = (ph, bands[-1][1], end[i])
        else:
            bands.append((ph, start[i], end[i]))
    return bands


def step_timeline(schedule, cost, *, tiers: tuple[str, ...] = (), title: str = "Predicted step timeline (critical rank)") -> go.Figure:
    """Gantt of the compute and communication streams of one step. ``tiers`` (innermost first) orders the
    communication rows: the fastest links sit next to the compute stream."""
    tasks = schedule.tasks
    start, end, exposed = schedule.start, schedule.end, schedule.exposed
    step = schedule.makespan
    unit, scale = best_time_unit(step)
    by_lp: dict[tuple[str, str], list] = defaultdict(list)
    for o in cost.ops:
        by_lp[(o.layer, o.phase)].append(o)
    M = max(1, sum(1 for t in tasks if t.name == tasks[0].name and t.stream == tasks[0].stream)) if tasks else 1
    comm_rows: list[str] = []

    seg: dict[str, dict[str, list]] = defaultdict(lambda: {"base": [], "x": [], "hover": []})
    for i, t in enumerate(tasks):
        if t.duration <= 0:
            continue
        if _is_compute(t):
            ops = _task_ops(t, by_lp)
            per_cls: dict[str, float] = defaultdict(float)
            names: dict[str, list[str]] = defaultdict(list)
            for o in ops:
                per_cls[o.op_class] += o.time_s
                names[o.op_class].append(o.name.rsplit(".", 1)[-1])
            total = sum(per_cls.values())
            head = f"<b>{t.name}</b> ({t.phase})<br>{fmt_s(start[i])} → {fmt_s(end[i])}: {fmt_s(t.duration)}"
            if total <= 0:
                key = "optimizer" if t.phase == "optimizer" else "other"
                seg[f"loss:{key}"]["base"].append(start[i] / scale)
                seg[f"loss:{key}"]["x"].append(t.duration / scale)
                seg[f"loss:{key}"]["hover"].append(head)
                continue
            cur = start[i]
            for c in sorted(per_cls, key=lambda c: CLASS_ORDER.index(c) if c in CLASS_ORDER else 99):
                d = t.duration * per_cls[c] / total
                s = seg[f"class:{c}"]
                s["base"].append(cur / scale)
                s["x"].append(d / scale)
                uniq = sorted(set(names[c]))
                s["hover"].append(f"{head}<br>{c}: {fmt_s(d)} ({100 * per_cls[c] / total:.0f}% of the task)<br>ops: {', '.join(uniq[:8])}")
                cur += d
        else:
            kind, group, nbytes = (t.meta if isinstance(t.meta, tuple) and len(t.meta) == 3 else ("p2p", "", 0.0))
            row = _comm_row(t.stream)
            if row not in comm_rows:
                comm_rows.append(row)
            s = seg[f"comm:{kind}"]
            s.setdefault("row", []).append(row)
            s["base"].append(start[i] / scale)
            s["x"].append(t.duration / scale)
            e = exposed[i] if i < len(exposed) else 0.0
            s["hover"].append(
                f"<b>{t.name}</b> ({comm_label(t.name)})<br>{kind} over the '{group}' group, {fmt_bytes(float(nbytes))} per call<br>"
                f"{fmt_s(start[i])} → {fmt_s(end[i])}: {fmt_s(t.duration)}<br>exposed (compute waited): {fmt_s(e)}"
                + ("<br>uses SMs: slows the compute beside it" if t.sm else "")
            )
    # compute-stream idle gaps, attributed to the collective active then
    busy = sorted((start[i], end[i]) for i, t in enumerate(tasks) if _is_compute(t) and t.duration > 0)
    comm = [(start[i], end[i], t.name) for i, t in enumerate(tasks) if not _is_compute(t) and t.duration > 0]
    cur = 0.0
    gaps = []
    for a, b in busy:
        if a > cur + 1e-12:
            gaps.append((cur, a))
        cur = max(cur, b)
    if step > cur + 1e-12:
        gaps.append((cur, step))
    for a, b in gaps:
        who = [n for (s0, e0, n) in comm if s0 < b and e0 > a]
        s = seg["wait"]
        s["base"].append(a / scale)
        s["x"].append((b - a) / scale)
        s["hover"].append(f"<b>compute waits</b> {fmt_s(b - a)}<br>{fmt_s(a)} → {fmt_s(b)}<br>on: {', '.join(who[:4]) or '—'}")

    fig = go.Figure()
    for band, t0, t1 in _phase_bands(tasks, start, end):
        fig.add_vrect(x0=t0 / scale, x1=t1 / scale, fillcolor=PHASE_COLOURS.get(band, "#ddd"), opacity=0.07, line_width=0, layer="below")
        if (t1 - t0) > 0.04 * step:
            fig.add_annotation(x=(t0 + t1) / 2 / scale, y=1.0, yref="paper", yanchor="bottom", text=band, showarrow=False,
                               font={"size": 10, "color": PHASE_COLOURS.get(band, "#555")})
    order = ([f"class:{c}" for c in CLASS_ORDER] + sorted(k for k in seg if k.startswith("class:") and k[6:] not in CLASS_ORDER)
             + ["loss:optimizer", "loss:other", "wait"] + sorted(k for k in seg if k.startswith("comm:")))
    for key in order:
        if key not in seg:
            continue
        s = seg[key]
        fam, _, name = key.partition(":")
        if fam == "class":
            colour, label, row, pattern = op_class_colour(name), name, COMPUTE_ROW, None
        elif fam == "comm":
            colour, label, row, pattern = collective_colour(name), name.replace("_", "-"), COMM_ROW, None
        elif key == "wait":
            colour, label, row, pattern = "#FFFFFF", "compute waits (exposed comm)", COMPUTE_ROW, {"shape": "/", "fgcolor": "#888", "size": 5}
        else:
            colour, label, row, pattern = loss_colour(name), name, COMPUTE_ROW, None
        marker = {"color": colour, "line": {"width": 0.3, "color": "#444" if key == "wait" else colour}}
        if pattern:
            marker["pattern"] = pattern
        fig.add_trace(go.Bar(
            y=s.get("row") or [row] * len(s["x"]), x=s["x"], base=s["base"], orientation="h", name=label, marker=marker,
            hovertext=s["hover"], hoverinfo="text", width=0.6,
        ))
    fig.update_layout(barmode="overlay", bargap=0.2)
    rank = {f"comm: {t} links": i for i, t in enumerate(tiers)}
    comm_rows.sort(key=lambda r: (rank.get(r, len(rank)), r))
    fig.update_yaxes(categoryorder="array", categoryarray=list(reversed(comm_rows)) + [COMPUTE_ROW], fixedrange=True, automargin=True)
    fig.update_xaxes(title_text=f"time in the step ({unit})", range=[0, step / scale * 1.01])
    n_c = sum(1 for t in tasks if _is_compute(t) and t.duration > 0)
    n_m = sum(1 for t in tasks if not _is_compute(t) and t.duration > 0)
    exp = sum(exposed) if exposed else 0.0
    sub = (f"step {fmt_s(step)}: {n_c} compute and {n_m} communication tasks on {len(comm_rows)} link stream(s), {M} micro-batch(es); "
           f"compute waits {fmt_s(exp)} ({100 * exp / step:.1f}%) on communication (drag to zoom, double-click to reset)")
    return base_layout(fig, title, subtitle=sub, height=300 + 50 * len(comm_rows))


__all__ = ["step_timeline"]
