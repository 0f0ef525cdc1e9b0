"""Checkpoint interval and useful fraction against Young's and Daly's formulas worked by hand."""

from __future__ import annotations

import math

import pytest

from coplan.costmodel.goodput import checkpoint_write_s, daly_interval, failure_rate_per_s, goodput, useful_fraction
from coplan.spec import load_topology


def test_daly_reduces_to_young_for_cheap_checkpoints():
    delta, M = 1.0, 1e6
    assert daly_interval(delta, M) == pytest.approx(math.sqrt(2 * delta * M), rel=1e-3)
    assert daly_interval(3 * M, M) == M  # checkpoint longer than 2 MTBF: checkpoint every MTBF


def test_daly_higher_order_value():
    delta, M = 60.0, 3600.0
    x = delta / (2 * M)
    assert daly_interval(delta, M) == pytest.approx(math.sqrt(2 * delta * M) * (1 + math.sqrt(x) / 3 + x / 9) - delta)


def test_failure_rate_counts_gpus_and_switches():
    t = load_topology("h200-superpod-1k")
    lam = failure_rate_per_s(t, 1024) * 3600
    # 1,024 GPUs at 50,000 h, plus 4 leaf groups and 1 spine group at 200,000 h
    assert lam == pytest.approx(1024 / 50_000 + 4 / 200_000 + 1 / 200_000)


def test_checkpoint_write_is_bounded_by_the_storage_ceiling():
    t = load_topology("h200-superpod-1k")
    assert checkpoint_write_s(t, 1e12, 8) == pytest.approx(1e12 / 25e9)       # one node
    assert checkpoint_write_s(t, 1e12, 1024) == pytest.approx(1e12 / 1e12)    # 128 nodes, capped at 1 TB/s


def test_goodput_falls_with_scale_and_is_optimal_at_daly():
    t = load_topology("h200-superpod-4k")
    small, big = goodput(t, 2e12, 256), goodput(t, 2e12, 4096)
    assert 0 < big.fraction < small.fraction < 1
    g = big
    for k in (0.5, 2.0):
        assert useful_fraction(g.interval_s * k, g.checkpoint_write_s, g.restart_s, g.mtbf_s) <= g.fraction + 1e-9
