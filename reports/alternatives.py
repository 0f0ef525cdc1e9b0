"""Why this plan: the plans the search priced and did not return (other meshes and micro-batch counts,
the runner-up sharding or recompute of the same mesh, the simulate heuristic's plan, candidates pruned
by their bound or that do not fit), each against the returned plan, with why it lost."""

from __future__ import annotations

import plotly.graph_objects as go

from coplan.reports.layout import base_layout, fmt_s
from coplan.spec import Plan

KIND_COLOUR = {"mesh": "#4477AA", "micro_batches": "#66CCEE", "sharding": "#228833", "recompute": "#CCBB44",
               "heuristic": "#EE6677", "infeasible": "#BBBBBB"}


def alternatives_figure(plan: Plan) -> go.Figure | tuple[None, str]:
    """One bar per plan: the returned plan, then its alternatives, best first; an alternative known only
    by its bound is a hollow bar at the bound (it cannot be faster), one that does not fit is grey."""
    if not plan.alternatives or plan.predicted is None:
        return None, "the plan records no alternatives (a given plan, or one planned before coplan kept them)"
    best = plan.predicted.step_time_s
    names = ["returned plan"]
    values = [best * 1e3]
    colours = ["#222222"]
    patterns = [""]
    hovers = [f"the returned plan: {fmt_s(best)}<br>{plan.solver.status if plan.solver else ''}"]
    for i, a in enumerate(plan.alternatives, 1):
        names.append(f"{i}. {a.kind}: {a.mesh}")
        if a.step_time_s is not None:
            values.append(a.step_time_s * 1e3)
            patterns.append("")
            head = f"priced {fmt_s(a.step_time_s)}"
        else:
            values.append(max(a.bound_s, 0.0) * 1e3)
            patterns.append("/")
            head = f"not priced in full; at least {fmt_s(a.bound_s)}" if a.bound_s > 0 else "not priced"
        colours.append(KIND_COLOUR.get(a.kind, "#777777"))
        hovers.append(f"{a.description}<br>{head}<br><b>{a.why}</b>")
    fig = go.Figure(go.Bar(
        y=names[::-1], x=values[::-1], orientation="h", marker={"color": colours[::-1], "pattern": {"shape": patterns[::-1]}},
        hovertext=hovers[::-1], hoverinfo="text", text=[f"{v:,.3f} ms" for v in values[::-1]], textposition="auto",
    ))
    fig.add_vline(x=best * 1e3, line={"color": "#222222", "dash": "dot", "width": 1})
    fig.update_xaxes(title_text="predicted step time (ms)", rangemode="tozero")
    sub = "solid: priced by the full cost model; hatched: pruned by a proven bound (it cannot be faster than the bar)"
    return base_layout(fig, "Why this plan: the alternatives it beat", subtitle=sub, height=max(260, 60 + 34 * len(names)), legend=False)


__all__ = ["alternatives_figure"]
