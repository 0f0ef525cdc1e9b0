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
    at_daly = g.fraction * (1.0 + g.jitter)  # (the checkpoint-and-failure part; jitter divides it)
    for k in (0.5, 2.0):
        assert useful_fraction(g.interval_s * k, g.checkpoint_write_s, g.restart_s, g.mtbf_s) <= at_daly + 1e-9


def test_expected_max_of_normals_matches_closed_forms_and_grows_like_sqrt_2_ln_n():
    from coplan.costmodel.goodput import expected_max_normal

    assert expected_max_normal(1) == 0.0
    assert expected_max_normal(2) == pytest.approx(1 / math.sqrt(math.pi), rel=1e-6)        # closed form
    assert expected_max_normal(3) == pytest.approx(3 / (2 * math.sqrt(math.pi)), rel=1e-6)  # closed form
    vals = [expected_max_normal(n) for n in (2, 8, 64, 512, 4096, 65536)]
    assert vals == sorted(vals)
    for n, v in zip((4096, 65536), vals[-2:]):  # below the sqrt(2 ln n) envelope, within 15% of it
        assert 0.85 * math.sqrt(2 * math.log(n)) < v < math.sqrt(2 * math.log(n))


def test_stragglers_and_jitter_stretch_the_step_by_cv_times_the_expected_max():
    from coplan.costmodel.goodput import expected_max_normal, jitter_stretch

    t = load_topology("h200-superpod-4k")
    assert jitter_stretch(1) == 0.0 and jitter_stretch(1, 0.5) == 0.0
    assert jitter_stretch(1024, 0.03) == pytest.approx(0.03 * expected_max_normal(1024))
    assert jitter_stretch(4096, 0.02) > jitter_stretch(256, 0.02) > 0  # grows with the rank count
    assert jitter_stretch(4096, 0.04) == pytest.approx(2 * jitter_stretch(4096, 0.02))  # linear in the CV
    calm, noisy = goodput(t, 2e12, 4096, jitter_cv=0.0), goodput(t, 2e12, 4096, jitter_cv=0.02)
    assert calm.jitter == 0.0 and noisy.fraction == pytest.approx(calm.fraction / (1 + noisy.jitter))
