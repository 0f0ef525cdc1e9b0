"""The recompute frontier against enumerating every subset of layers."""

from __future__ import annotations

import itertools
import math

from hypothesis import given, settings
from hypothesis import strategies as st

from coplan.planner.pricing import LayerOption
from coplan.planner.recompute import frontier

layer = st.tuples(st.sampled_from([0.0, 1.0, 1.5, 2.0, 3.0]), st.sampled_from([0.0, 1.0, 2.0, 4.0, 5.0]), st.sampled_from([0.0, 1.0, 2.0, 3.0]))


def _all_subsets(layers):
    out = []
    for mask in itertools.product([False, True], repeat=len(layers)):
        on = [l for l, m in zip(layers, mask) if m]
        out.append((sum(l.recompute_s for l in on), sum(l.saved_bytes for l in on) - max((l.peak_bytes for l in on), default=0.0)))
    return out


@settings(max_examples=150, deadline=None)
@given(st.lists(layer, max_size=8))
def test_least_time_is_the_exact_optimum(figs):
    layers = tuple(LayerOption(f"l.{i}", t, s, pk) for i, (t, s, pk) in enumerate(figs))
    front = frontier(layers)
    assert front is not None
    subsets = _all_subsets(layers)
    for need in (-1.0, 0.0, 0.5, 1.0, 2.0, 3.5, 5.0, 8.0, 13.0, 40.0):
        exact = min((t for t, f in subsets if f >= need), default=math.inf)
        assert front.least_time(need) == exact
    # every point is a real set of layers with the figures it claims, and the points are Pareto-optimal
    for a, b in zip(front.points, front.points[1:]):
        assert a.time_s <= b.time_s and a.freed_bytes < b.freed_bytes
    for pt in front.points:
        on = [l for l, m in zip(layers, pt.layers) if m]
        assert pt.time_s == sum(l.recompute_s for l in on)
        assert pt.freed_bytes == sum(l.saved_bytes for l in on) - max((l.peak_bytes for l in on), default=0.0)


def test_identical_layers_are_counted_not_enumerated():
    """60 layers of 4 kinds: 2^60 subsets, a frontier of a few hundred points built at once."""
    kinds = [(45.0, 15.0, 16.0), (1.7, 0.66, 0.71), (7.2, 0.91, 0.94), (48.6, 16.0, 17.4)]
    layers = tuple(LayerOption(f"l.{i}", *kinds[i % 4]) for i in range(60))
    front = frontier(layers)
    assert front is not None and 10 < len(front.points) < 5000
    assert front.least_time(0.0) == 0.0
    assert math.isinf(front.least_time(front.most_freed + 1.0))


def test_too_large_a_frontier_is_refused():
    """Distinct layers with incommensurate figures: the caller falls back to per-layer booleans."""
    layers = tuple(LayerOption(f"l.{i}", 1.0 + i * 0.013, 1.0 + i * 0.0071, 0.5 + (i % 7) * 0.01) for i in range(40))
    assert frontier(layers, max_points=200) is None
