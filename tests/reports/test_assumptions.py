"""The report's assumption table: every row is the plan re-priced with one figure moved the pessimistic way, all of
them together move it furthest, the published GEM yardstick only where it applies, and the ledger's host and
loader bars when they set the step."""

from __future__ import annotations

import pytest

from coplan.reports.assumptions import (
    ASSUMPTIONS,
    PUBLISHED_GEM_E2E_MFU,
    assumption_table,
    assumptions_figure,
    compare_with_gem,
    describe,
)
from tests.reports.plans import heuristic_plan


@pytest.fixture(scope="module")
def multi_node():
    return heuristic_plan("gem-tiny", "h200-superpod-1k", 32)


@pytest.fixture(scope="module")
def one_node():
    return heuristic_plan("gem-tiny", "h200-superpod-1k", 8)


def test_every_assumption_moved_alone_prices_no_better_and_all_together_prices_worst(multi_node):
    rows = assumption_table(multi_node)
    keys = [r.key for r in rows]
    assert keys == ["planned", *(a.key for a in ASSUMPTIONS), "all"]
    base = rows[0]
    assert base.e2e_mfu == pytest.approx(multi_node.predicted.e2e_mfu, rel=1e-6)
    by = {r.key: r for r in rows}
    for a in ASSUMPTIONS:
        r = by[a.key]
        assert r.goodput_mfu <= base.goodput_mfu * (1 + 1e-9), a.key
        assert r.alternative and r.what
    assert by["kernels"].e2e_mfu < base.e2e_mfu  # kernels 20% slower lengthen any step
    assert by["jitter"].goodput_mfu < base.goodput_mfu and by["jitter"].e2e_mfu == pytest.approx(base.e2e_mfu)
    assert by["failures"].goodput_mfu < base.goodput_mfu
    assert by["all"].goodput_mfu <= min(by[a.key].goodput_mfu for a in ASSUMPTIONS) * (1 + 1e-9)


def test_one_node_has_no_gem_yardstick(one_node, multi_node):
    rows = assumption_table(one_node)
    assert not compare_with_gem(one_node)
    assert compare_with_gem(multi_node)  # gem-tiny is GEM-shaped (InterFormer over a history)
    text = describe(rows)
    assert "Meta reports" not in text and "moves it most" in text


def test_describe_names_the_biggest_single_assumption_and_the_published_range(multi_node):
    rows = assumption_table(multi_node)
    text = describe(rows, PUBLISHED_GEM_E2E_MFU)
    singles = [r for r in rows if r.key in {a.key for a in ASSUMPTIONS}]
    worst = min(singles, key=lambda r: r.e2e_mfu)
    assert worst.what in text
    assert "Meta reports 20-25%" in text
    assert f"{100 * rows[0].e2e_mfu:.1f}%" in text


def test_the_figure_has_a_bar_per_row_and_the_band_only_for_gem_across_nodes(multi_node, one_node):
    rows = assumption_table(multi_node)
    fig = assumptions_figure(multi_node, rows)
    assert len(fig.data) == 2 and len(fig.data[0].y) == len(rows)
    assert [100 * r.e2e_mfu for r in rows] == pytest.approx(list(fig.data[0].x))
    assert len(fig.layout.shapes) == 1
    one = assumptions_figure(one_node, assumption_table(one_node))
    assert len(one.layout.shapes) == 0
