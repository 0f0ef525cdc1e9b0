"""MFU waterfall: from 100% of peak down to the goodput MFU, one bar per loss (see
:mod:`coplan.reports.ledger` for how each is computed). Bars are drawn as floating horizontal bars so
each can carry its op class's or collective's colour; the biggest loss is marked."""

from __future__ import annotations

import plotly.graph_objects as go

from coplan.reports.layout import base_layout, fmt_s
from coplan.reports.ledger import Ledger, Loss
from coplan.reports.palette import collective_colour, loss_colour, op_class_colour

LABEL_CHARS = 30
"""Bar labels longer than this wrap onto two lines (so the plot keeps its width in a narrow window)."""

MIN_POINTS = 0.005
"""Losses smaller than this many MFU points are merged into one 'small items' bar (listed in its hover)."""


def _wrap(label: str) -> str:
    if len(label) <= LABEL_CHARS:
        return label
    cut = label.rfind(" ", 0, LABEL_CHARS + 1)
    if " (" in label and label.index(" (") <= LABEL_CHARS + 8:
        cut = label.index(" (")
    return label if cut <= 0 else label[:cut] + "<br>" + label[cut + 1:]


def _colour(x: Loss) -> str:
    if x.kind == "op_class":
        return op_class_colour(x.colour_key)
    if x.kind == "collective":
        return collective_colour(x.colour_key)
    return loss_colour(x.colour_key)


def mfu_waterfall(ledger: Ledger, *, title: str = "MFU waterfall: where the peak FLOPs go") -> go.Figure:
    """Horizontal waterfall, top to bottom: peak, each loss, the goodput MFU."""
    big = [x for x in ledger.losses if abs(ledger.points(x.seconds)) >= MIN_POINTS or x.key == "other"]
    small = [x for x in ledger.losses if x not in big]
    bars: list[tuple[str, float, str, str, str]] = []  # label, points, colour, hover, key
    for x in big:
        bars.append((x.label, ledger.points(x.seconds), _colour(x), x.detail, x.key))
    if small:
        s = sum(x.seconds for x in small)
        listing = "<br>".join(f"{x.label}: {ledger.points(x.seconds):.4f} pts" for x in small[:12])
        at = next((i for i, b in enumerate(bars) if b[4] == "other"), len(bars))
        bars.insert(at, (f"{len(small)} small item{'s' if len(small) > 1 else ''}", ledger.points(s), "#CCCCCC", listing, "small"))
    biggest = ledger.biggest()
    # One bar trace for the whole waterfall (per-bar colours, bases, texts and hovers): a trace per bar
    # costs the browser far more to draw than the bars themselves.
    labels = ["100% of peak"]
    xs, bases, colours, lines, texts, hovers = [100.0], [0.0], [loss_colour("peak")], [loss_colour("peak")], [""], [
        f"dense peak {ledger.peak_flops_per_s / 1e12:,.0f} TFLOP/s × {ledger.world_size:,} GPUs × "
        f"{fmt_s(ledger.wall_step_s)} of wall time per step"]
    level = 100.0
    for label, pts, colour, hover, key in bars:
        start = level - pts
        is_big = biggest is not None and key == biggest.key
        labels.append(f"<b>{_wrap(label)}<br>(biggest loss)</b>" if is_big else _wrap(label))
        secs = pts / 100.0 * ledger.wall_step_s
        xs.append(pts)
        bases.append(start)
        colours.append(colour)
        lines.append("#333" if key == "other" else colour)
        texts.append(f"−{pts:.2f}" if pts >= 0 else f"+{-pts:.2f}")
        hovers.append(f"<b>{label}</b><br>−{pts:.3f} MFU points<br>{fmt_s(secs)} per step"
                      + (f" ({100 * secs / ledger.step_time_s:.2f}% of the step)" if ledger.step_time_s > 0 else "")
                      + (f"<br>{hover}" if hover else ""))
        level = start
    final = ledger.final_points
    labels.append("<b>goodput MFU</b>")
    xs.append(final)
    bases.append(0.0)
    colours.append(loss_colour("model"))
    lines.append(loss_colour("model"))
    texts.append(f"{final:.2f}%")
    hovers.append(f"<b>goodput MFU {final:.3f}%</b><br>model FLOPs {ledger.model_flops:.4g} per step at peak take "
                  f"{fmt_s(ledger.useful_s)}<br>E2E MFU (no checkpoints or failures) {100 * ledger.e2e_mfu:.3f}%")
    texts[0] = ""
    fig = go.Figure(go.Bar(
        y=labels, x=xs, base=bases, orientation="h", name="MFU waterfall", showlegend=False,
        marker={"color": colours, "line": {"color": lines, "width": 1}},
        text=texts, textposition="outside", cliponaxis=False, hovertext=hovers, hoverinfo="text",
    ))
    fig.update_yaxes(autorange="reversed", categoryorder="array", categoryarray=labels, automargin=True, tickfont={"size": 11})
    fig.update_xaxes(title_text="% of peak FLOPs", range=[0, 108], ticksuffix="%", dtick=20)
    fig.update_layout(bargap=0.25, margin={"l": 8})
    sub = (f"{len(ledger.losses)} losses sum from 100% to goodput MFU {final:.2f}% "
           f"(E2E MFU {100 * ledger.e2e_mfu:.2f}%, step {fmt_s(ledger.step_time_s)}, wall per step {fmt_s(ledger.wall_step_s)})")
    wrapped = sum(1 for lab in labels if "<br>" in lab)
    fig.update_layout(meta={"narrow": {"yaxis": {"tickfont": {"size": 9}}, "xaxis": {"dtick": 25, "range": [0, 122]}}})
    return base_layout(fig, title, height=max(360, 80 + 26 * len(labels) + 8 * wrapped), legend=False, subtitle=sub)


__all__ = ["mfu_waterfall"]
