"""Shared figure layout and number formatting: every figure autosizes, keeps its legend below the
plot (so a narrow window gives the plot the full width) and writes units into its hover text."""

from __future__ import annotations

import plotly.graph_objects as go

from coplan.reports.palette import FONT


def base_layout(fig: go.Figure, title: str, *, height: int = 460, legend: bool = True, subtitle: str = "") -> go.Figure:
    """Apply the house layout in place and return the figure."""
    text = f"{title}<br><sup>{subtitle}</sup>" if subtitle else title
    fig.update_layout(
        template="plotly_white",
        title={"text": text, "x": 0.0, "xanchor": "left", "font": {"size": 15}},
        font={"family": FONT, "size": 12},
        autosize=True,
        height=height,
        margin={"l": 60, "r": 16, "t": 72 if subtitle else 48, "b": 40},
        hoverlabel={"namelength": -1, "font": {"family": FONT, "size": 12}},
        showlegend=legend,
        # Anchored to the bottom of the whole figure (not the plot area): Plotly then grows the bottom
        # margin to fit however many rows the legend wraps into, so it never covers the x-axis title.
        legend={"orientation": "h", "yref": "container", "yanchor": "bottom", "y": 0.0, "x": 0.0, "xanchor": "left",
                "font": {"size": 11}, "traceorder": "normal"},
    )
    return fig


def fmt_s(s: float) -> str:
    """Seconds with the unit that keeps three to four significant digits."""
    a = abs(s)
    if a >= 1.0:
        return f"{s:,.4g} s"
    if a >= 1e-3:
        return f"{s * 1e3:.4g} ms"
    if a >= 1e-6:
        return f"{s * 1e6:.4g} µs"
    return f"{s * 1e9:.4g} ns"


def fmt_bytes(n: float) -> str:
    """Bytes in binary units (GiB, as GPU memory is sold and reported by torch)."""
    a = abs(n)
    for unit, size in (("TiB", 1024.0**4), ("GiB", 1024.0**3), ("MiB", 1024.0**2), ("KiB", 1024.0)):
        if a >= size:
            return f"{n / size:.4g} {unit}"
    return f"{n:.0f} B"


def fmt_flops(f: float) -> str:
    a = abs(f)
    for unit, size in (("EFLOP", 1e18), ("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6)):
        if a >= size:
            return f"{f / size:.4g} {unit}"
    return f"{f:.4g} FLOP"


def fmt_pct(x: float, digits: int = 2) -> str:
    """A fraction as a percentage (tiny ones with three significant digits rather than as 0.00%)."""
    if x != 0 and abs(100.0 * x) < 10.0 ** -digits:
        return f"{100.0 * x:.3g}%"
    return f"{100.0 * x:.{digits}f}%"


def best_time_unit(seconds_max: float) -> tuple[str, float]:
    """(unit label, seconds per unit) for an axis whose largest value is ``seconds_max``."""
    a = abs(seconds_max)
    if a >= 1.0:
        return "s", 1.0
    if a >= 1e-3:
        return "ms", 1e-3
    return "µs", 1e-6
