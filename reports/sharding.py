"""Embedding sharding map: which rank of the sparse shard group holds which table, how, and how big.

The bottom panel is the map: one row per table (largest first), one column per rank of the sparse
shard group; a shard on one rank is a dot, a shard spread over a contiguous run of ranks (row-wise,
table-row-wise, data-parallel copies) a bar over that run. Colour is the sharding type, size the
bytes of one shard (weights + optimizer state, from :mod:`coplan.costmodel.embedding`). The top
panel stacks, per rank, the bytes each sharding type put there, so a rank the placement overloaded
stands out. With more ranks than can be drawn one by one, ranks are grouped into contiguous bins and
the bar shows the bin's mean and a marker its fullest rank.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from coplan.costmodel.embedding import SHARDING_CODES, option_costs, table_arrays
from coplan.reports.layout import base_layout, fmt_bytes
from coplan.reports.palette import SHARDING_COLOURS, sharding_colour
from coplan.spec import Plan
from coplan.spec.plan import SHARDING_TYPES

MAX_RANK_BARS = 256
"""Most ranks (steps) in the top panel before ranks are binned."""

MAX_BAR_RANKS = 48
"""Up to this many ranks the top panel draws bars; beyond, a stacked step area."""

MAX_MARKERS = 300
"""Up to this many single-rank shards are dots sized by bytes; beyond, dashes whose thickness is the bytes."""


@dataclass(frozen=True, slots=True)
class ShardRow:
    """One table's placement, ready to draw."""

    table: str
    sharding_type: str
    ranks: tuple[int, ...]
    """Group ranks holding a shard (every rank of the group for data-parallel)."""
    shard_bytes: float
    """Weights + optimizer state of one shard."""
    total_bytes: float
    """All shards (one copy of the table for sharded types; every copy for data-parallel)."""
    rows: int
    dim: int


def shard_rows(plan: Plan) -> list[ShardRow]:
    """Per table of ``plan``: its ranks and the bytes of one shard, from the cost model's table arrays."""
    if not plan.tables:
        return []
    ta = table_arrays(plan.workload)
    G = plan.mesh.sparse_shard
    by_type: dict[str, list[tuple[int, object]]] = defaultdict(list)
    for ts in plan.tables:
        by_type[ts.sharding_type].append((ta.index[ts.table], ts))
    rows: list[ShardRow] = []
    for stype, items in by_type.items():
        k = np.ones(ta.num)
        for i, ts in items:
            k[i] = max(1, len(ts.ranks))
        # Only the memory arrays are read; batch and bandwidth do not enter them.
        oc = option_costs(ta, stype, k, G, 1.0, 1, 2.0, 1.0)
        mem = oc.memory_bytes
        for i, ts in items:
            ranks = tuple(range(G)) if stype == "data_parallel" else tuple(ts.ranks)
            n = len(ranks)
            rows.append(ShardRow(
                table=ts.table, sharding_type=stype, ranks=ranks, shard_bytes=float(mem[i]),
                total_bytes=float(mem[i]) * (n if SHARDING_CODES[stype] != SHARDING_CODES["data_parallel"] else G),
                rows=int(ta.rows[i]), dim=int(ta.dim[i]),
            ))
    rows.sort(key=lambda r: (-r.total_bytes, r.table))
    return rows


def rank_bytes(rows: list[ShardRow], group_size: int) -> dict[str, np.ndarray]:
    """Bytes per group rank, by sharding type."""
    out = {t: np.zeros(group_size) for t in SHARDING_TYPES}
    for r in rows:
        idx = np.asarray(r.ranks, dtype=np.int64)
        np.add.at(out[r.sharding_type], idx, r.shard_bytes)
    return {k: v for k, v in out.items() if v.any()}


def _runs(ranks: tuple[int, ...]) -> list[tuple[int, int]]:
    """Contiguous runs ``(first, last)`` of the sorted ranks."""
    if not ranks:
        return []
    s = np.unique(np.asarray(ranks, dtype=np.int64))
    breaks = np.flatnonzero(np.diff(s) != 1)
    starts = np.concatenate(([0], breaks + 1))
    ends = np.concatenate((breaks, [s.size - 1]))
    return [(int(s[a]), int(s[b])) for a, b in zip(starts, ends)]


def _ranks_text(runs: list[tuple[int, int]]) -> str:
    parts = [f"{a}" if a == b else f"{a}–{b}" for a, b in runs[:6]]
    return ", ".join(parts) + (f", … ({len(runs)} runs)" if len(runs) > 6 else "")


def sharding_map(plan: Plan) -> go.Figure:
    """Tables × ranks of the sparse shard group, coloured by sharding type and sized by shard bytes."""
    rows = shard_rows(plan)
    G = plan.mesh.sparse_shard
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, row_heights=[0.28, 0.72], vertical_spacing=0.04)
    if not rows:
        fig.add_annotation(text="this workload has no embedding tables", showarrow=False, x=0.5, y=0.5, xref="paper", yref="paper")
        return base_layout(fig, "Embedding sharding map", height=300, legend=False)
    per_type = rank_bytes(rows, G)
    binned = G > MAX_RANK_BARS
    _add_rank_bytes(fig, per_type, G, binned)
    _add_map(fig, rows, G, shown=set(per_type))
    n = len(rows)
    fig.update_yaxes(title_text="GiB / rank", row=1, col=1, rangemode="tozero")
    tick_idx = list(range(n)) if n <= 40 else []
    fig.update_yaxes(
        title_text="tables (largest first)", autorange="reversed", row=2, col=1, showgrid=False, zeroline=False,
        tickvals=tick_idx, ticktext=[rows[i].table for i in tick_idx], showticklabels=bool(tick_idx),
    )
    fig.update_xaxes(title_text="rank in the sparse shard group", row=2, col=1, range=[-0.6, G - 0.4])
    fig.update_layout(barmode="stack", bargap=0.05)
    height = int(min(900, max(480, 220 + 9 * min(n, 80))))
    return base_layout(fig, "Embedding sharding map", height=height, subtitle=_subtitle(plan, rows, binned))


def _add_rank_bytes(fig: go.Figure, per_type: dict[str, np.ndarray], G: int, binned: bool) -> None:
    """Top panel: bytes per rank by sharding type; bars for few ranks, else a stacked step area (binned past
    :data:`MAX_RANK_BARS`, with each bin's fullest rank marked)."""
    if G <= MAX_BAR_RANKS:
        for stype in SHARDING_TYPES:
            if stype not in per_type:
                continue
            y = per_type[stype]
            fig.add_trace(go.Bar(
                x=np.arange(G), y=y / 2**30, width=0.9, name=stype, legendgroup=stype, marker_color=sharding_colour(stype),
                customdata=[fmt_bytes(v) for v in y],
                hovertemplate=f"rank %{{x}}<br>{stype}: %{{customdata}}<extra></extra>",
            ), row=1, col=1)
        return
    # a stacked step area (one flat step per rank or bin of ranks): cheap to draw for many ranks
    nb = min(G, MAX_RANK_BARS)
    edges = np.linspace(0, G, nb + 1).round().astype(int)
    lo, hi = edges[:-1], edges[1:] - 1
    xs = np.append(lo, G) - 0.5
    label = [f"rank {a}" if a == b else f"ranks {a}–{b}" for a, b in zip(lo, hi)]
    for stype in SHARDING_TYPES:
        if stype not in per_type:
            continue
        y = np.add.reduceat(per_type[stype], lo) / (hi - lo + 1)
        cd = np.stack([label, [fmt_bytes(v) for v in y]], axis=-1)
        fig.add_trace(go.Scatter(
            x=xs, y=np.append(y, y[-1]) / 2**30, mode="lines", stackgroup="bytes", name=stype, legendgroup=stype,
            line={"shape": "hv", "width": 0.5, "color": sharding_colour(stype)}, fillcolor=sharding_colour(stype),
            customdata=np.vstack([cd, cd[-1:]]),
            hovertemplate=f"%{{customdata[0]}}<br>{stype}: %{{customdata[1]}}" + (" (bin mean)" if binned else "") + "<extra></extra>",
        ), row=1, col=1)
    if binned:
        total = sum(per_type.values())
        mx = np.maximum.reduceat(total, lo)
        arg = [int(lo[i] + np.argmax(total[lo[i]:hi[i] + 1])) for i in range(len(lo))]
        cd = np.stack([[f"rank {a}" for a in arg], [fmt_bytes(v) for v in mx]], axis=-1)
        fig.add_trace(go.Scatter(
            x=xs, y=np.append(mx, mx[-1]) / 2**30, mode="lines", name="fullest rank of the bin",
            line={"shape": "hv", "width": 1, "color": "#222", "dash": "dot"}, customdata=np.vstack([cd, cd[-1:]]),
            hovertemplate="%{customdata[0]}: %{customdata[1]} of embeddings (fullest in its bin)<extra></extra>",
        ), row=1, col=1)


def _map_tmpl(stype: str) -> str:
    return (f"<b>%{{customdata[0]}}</b> ({stype})<br>%{{customdata[1]}} rows × %{{customdata[2]}}<br>"
            "one shard: %{customdata[3]} (weights + optimizer state)<br>all shards: %{customdata[4]}<br>"
            "ranks: %{customdata[5]}<extra></extra>")


def _add_map(fig: go.Figure, rows: list[ShardRow], G: int, shown: set[str]) -> None:
    """Bottom panel: one row per table; a dot per single-rank shard (a dash past :data:`MAX_MARKERS`), a bar
    per run of ranks, line width in four buckets of shard size. ``shown``: types already in the legend."""
    smax = max(r.shard_bytes for r in rows) or 1.0

    def size_px(b: float) -> float:
        return 4.0 + 14.0 * float(np.sqrt(b / smax))

    points: dict[str, list] = defaultdict(lambda: [[], [], [], []])  # x, y, size, customdata
    segs: dict[tuple[str, int], list] = defaultdict(lambda: [[], [], []])  # x, y, customdata (None-separated)
    blank = None  # the gap between two segments carries no hover
    all_runs = [_runs(r.ranks) for r in rows]
    singles = sum(1 for runs in all_runs for a, b in runs if a == b)
    # Past a few hundred, one SVG marker per shard is what makes the page slow to draw; a line trace is
    # one path whatever its segment count, so single-rank shards become short dashes instead.
    dash = singles > MAX_MARKERS
    half = max(0.4, G / 300.0)
    for yi, (r, runs) in enumerate(zip(rows, all_runs)):
        cd = [r.table, f"{r.rows:,}", str(r.dim), fmt_bytes(r.shard_bytes), fmt_bytes(r.total_bytes), _ranks_text(runs)]
        for a, b in runs:
            if a == b and not dash:
                p = points[r.sharding_type]
                p[0].append(a)
                p[1].append(yi)
                p[2].append(size_px(r.shard_bytes))
                p[3].append(cd)
                continue
            # line width in 4 buckets of shard size (a trace has one width)
            bucket = int(min(3, np.sqrt(r.shard_bytes / smax) * 4))
            sg = segs[(r.sharding_type, bucket)]
            sg[0] += [a - half, a + half, None] if a == b else [a - 0.4, b + 0.4, None]
            sg[1] += [yi, yi, None]
            sg[2] += [cd, cd, blank]

    for (stype, bucket), (xs, ys, cds) in sorted(segs.items()):
        fig.add_trace(go.Scatter(
            x=xs, y=ys, mode="lines", line={"color": sharding_colour(stype), "width": 2 + 3 * bucket},
            name=stype, legendgroup=stype, showlegend=stype not in shown, customdata=cds, hovertemplate=_map_tmpl(stype),
        ), row=2, col=1)
        shown.add(stype)
    for stype, (xs, ys, ss, cds) in sorted(points.items()):
        fig.add_trace(go.Scatter(
            x=xs, y=ys, mode="markers", marker={"color": sharding_colour(stype), "size": ss, "line": {"width": 0.5, "color": "#333"}},
            name=stype, legendgroup=stype, showlegend=stype not in shown, customdata=cds, hovertemplate=_map_tmpl(stype),
        ), row=2, col=1)
        shown.add(stype)


def _subtitle(plan: Plan, rows: list[ShardRow], binned: bool) -> str:
    G = plan.mesh.sparse_shard
    counts: dict[str, int] = defaultdict(int)
    for r in rows:
        counts[r.sharding_type] += 1
    mix = ", ".join(f"{counts[t]:,} {t}" for t in SHARDING_TYPES if counts[t])
    sub = f"{len(rows):,} tables over a sparse shard group of {G:,} ranks ({plan.mesh.sparse_replicate}× replicated): {mix}"
    if binned:
        sub += f"; top: ranks binned by ~{G / MAX_RANK_BARS:.0f}"
    return sub + "; line thickness (and dot size) = bytes per shard"


__all__ = ["ShardRow", "rank_bytes", "shard_rows", "sharding_map", "SHARDING_COLOURS"]
