"""The recompute choices that matter: the Pareto frontier of (recompute time, memory freed).

A recompute set enters the step only through its time (the sum of its layers' forward times) and
enters memory only through what it frees net of its peak (the sum of the saved activations minus the
largest activation rebuilt during a backward). So every plan can swap its recompute set for a
frontier point that costs no more time and frees no less memory: choosing among frontier points is
*exact*, not a relaxation. The solver uses it in two ways:

- as the least recompute time that frees a given amount of memory (a binary search; the integer
  optimum, where a fractional knapsack would understate it by up to a whole layer);
- as one choice variable per point in the decomposed CP-SAT model, whose linear relaxation is then
  the convex hull of the frontier rather than a loose knapsack with a max over peaks.

Identical layers (same time, saved bytes and peak) are counted rather than enumerated, so a model of
26 layers in 5 kinds has a few hundred points. The frontier is built per peak level (every set whose
largest peak is ``P``) by merging Pareto lists; above ``max_points`` it is not built and the caller
keeps the per-layer formulation.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from functools import lru_cache

from coplan.planner.pricing import LayerOption


@dataclass(frozen=True, slots=True)
class RecomputePoint:
    """One Pareto-optimal recompute set."""

    time_s: float
    """Forward time recomputed per step."""

    freed_bytes: float
    """Saved activations minus the recompute peak."""

    layers: tuple[bool, ...]
    """Which layers are recomputed (the first ones of each kind of identical layers)."""


@dataclass(frozen=True, slots=True)
class RecomputeFrontier:
    """Pareto-optimal recompute sets, cheapest first (time and freed memory both increase)."""

    points: tuple[RecomputePoint, ...]
    _freed: tuple[float, ...]

    def cheapest(self, need_bytes: float) -> RecomputePoint | None:
        """The cheapest set freeing at least ``need_bytes``; None when none frees enough."""
        if need_bytes <= 0:
            return self.points[0]
        i = bisect.bisect_left(self._freed, need_bytes)
        return self.points[i] if i < len(self.points) else None

    def least_time(self, need_bytes: float) -> float:
        """Least recompute time that frees ``need_bytes`` (inf when nothing can)."""
        pt = self.cheapest(need_bytes)
        return float("inf") if pt is None else pt.time_s

    @property
    def most_freed(self) -> float:
        return self._freed[-1]


def _pareto(pts: list[tuple[float, float, tuple]]) -> list[tuple[float, float, tuple]]:
    """Keep (time, saved, counts) points that no other point beats in both (least time first)."""
    pts.sort(key=lambda x: (x[0], -x[1]))
    out = []
    best = -1.0
    for p in pts:
        if p[1] > best:
            out.append(p)
            best = p[1]
    return out


@lru_cache(maxsize=64)
def frontier(layers: tuple[LayerOption, ...], max_points: int = 20_000) -> RecomputeFrontier | None:
    """The recompute frontier of ``layers`` (None when it would exceed ``max_points`` points)."""
    kinds: dict[tuple[float, float, float], list[int]] = {}
    for i, l in enumerate(layers):
        if l.saved_bytes > 0:  # a layer that frees nothing only costs time
            kinds.setdefault((l.recompute_s, l.saved_bytes, l.peak_bytes), []).append(i)
    keys = list(kinds)
    by_peak: dict[float, list[int]] = {}
    for k, key in enumerate(keys):
        by_peak.setdefault(key[2], []).append(k)
    peaks = sorted(by_peak)
    merged: list[tuple[float, float, tuple]] = [(0.0, 0.0, (0,) * len(keys))]  # the empty set
    candidates: list[tuple[float, float, tuple]] = [(0.0, 0.0, (0,) * len(keys))]
    # Sets with largest peak P: any counts of kinds with peak < P (the running ``merged`` list) and at
    # least one layer of a kind with peak P. Their net is saved - P.
    for P in peaks:
        at_p: list[tuple[float, float, tuple]] = [(0.0, 0.0, (0,) * len(keys))]
        for k in by_peak[P]:
            t, sv, _ = keys[k]
            nxt = []
            for (pt, ps, pc) in at_p:
                for c in range(len(kinds[keys[k]]) + 1):
                    cc = list(pc)
                    cc[k] = c
                    nxt.append((pt + c * t, ps + c * sv, tuple(cc)))
            at_p = _pareto(nxt)
            if len(at_p) * max(1, len(merged)) > max_points * 64:
                return None
        nonempty = [x for x in at_p if any(x[2][k] for k in by_peak[P])]
        combo = []
        for (at, asv, ac) in nonempty:
            for (mt, msv, mc) in merged:
                combo.append((at + mt, asv + msv, tuple(a + b for a, b in zip(ac, mc))))
        combo = _pareto(combo)
        candidates.extend((t, sv - P, c) for t, sv, c in combo)
        merged = _pareto(merged + combo)
        if len(candidates) > max_points * 8:
            return None
    front = _pareto(candidates)
    if len(front) > max_points:
        return None
    points = []
    for t, net, counts in front:
        on = [False] * len(layers)
        for k, c in enumerate(counts):
            for i in kinds[keys[k]][:c]:
                on[i] = True
        # recompute the figures from the layers themselves (no drift from summing in another order)
        chosen = [l for l, o in zip(layers, on) if o]
        time_s = sum(l.recompute_s for l in chosen)
        freed = sum(l.saved_bytes for l in chosen) - max((l.peak_bytes for l in chosen), default=0.0)
        points.append(RecomputePoint(time_s, freed, tuple(on)))
    points.sort(key=lambda x: (x.time_s, -x.freed_bytes))
    pruned: list[RecomputePoint] = []
    for pt in points:
        if not pruned or pt.freed_bytes > pruned[-1].freed_bytes:
            pruned.append(pt)
    return RecomputeFrontier(tuple(pruned), tuple(pt.freed_bytes for pt in pruned))
