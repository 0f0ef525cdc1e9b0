"""The CP-SAT models against exhaustive search, their bounds, capacity and determinism (synthetic pricings)."""

from __future__ import annotations

import math

import pytest

from coplan.planner.pricing import evaluate
from coplan.planner.solver import SolverSettings, heuristic_any, solve_decomposed, solve_flat

from .bruteforce import brute_force
from .synthetic import synthetic_pricing

EXACT = SolverSettings(time_limit_s=30.0, num_workers=1, relative_gap=0.0)


@pytest.mark.parametrize("tables,group,node,layers,seed", [(5, 2, 2, 3, 0), (6, 4, 4, 3, 1), (5, 4, 2, 6, 7)])
def test_flat_model_equals_brute_force(tables, group, node, layers, seed):
    p = synthetic_pricing(tables, group, node, layers, seed, capacity=40e9, base_bytes=20e9)
    best, plan, n = brute_force(p)
    assert n > 10 and math.isfinite(best)
    r = solve_flat(p, EXACT, hint=heuristic_any(p))
    assert r.status == "OPTIMAL"
    # integer units of 10 ns: equal up to the rounding of the figures
    assert r.step_time_s == pytest.approx(best, rel=1e-6, abs=1e-7)
    assert r.bound_s <= best + 1e-12
    assert evaluate(p, r.assignment).peak_bytes <= p.capacity_bytes


def test_decomposed_bound_is_valid_and_solution_feasible():
    p = synthetic_pricing(6, 4, 4, 3, 1, capacity=40e9, base_bytes=20e9)
    best, _, _ = brute_force(p)
    for free in (6, 2):  # every table free, and most tables fixed (their least contributions in the bound)
        r = solve_decomposed(p, EXACT, free_tables=free)
        assert r.bound_s <= best + 1e-9 <= r.step_time_s + 2e-9
        assert evaluate(p, r.assignment).peak_bytes <= p.capacity_bytes


def test_memory_pressure_forces_recompute_or_finer_shards():
    roomy = synthetic_pricing(6, 4, 4, 4, 11, capacity=200e9, base_bytes=20e9)
    tight = synthetic_pricing(6, 4, 4, 4, 11, capacity=29e9, base_bytes=20e9)
    a = solve_flat(roomy, EXACT, hint=heuristic_any(roomy))
    b = solve_flat(tight, EXACT, hint=heuristic_any(tight))
    assert b.status == "OPTIMAL" and a.status == "OPTIMAL"
    assert b.peak_bytes <= tight.capacity_bytes < a.peak_bytes
    assert b.step_time_s >= a.step_time_s


def test_infeasible_candidate_is_reported():
    p = synthetic_pricing(4, 2, 2, 2, 5, capacity=10e9, base_bytes=20e9)
    r = solve_flat(p, EXACT, hint=heuristic_any(p))
    assert r.assignment is None and r.status == "INFEASIBLE"


def test_solves_are_deterministic():
    p = synthetic_pricing(12, 8, 4, 4, 9, capacity=60e9)
    s = SolverSettings(time_limit_s=0.3, num_workers=2, seed=3)
    a, b = solve_flat(p, s, hint=heuristic_any(p)), solve_flat(p, s, hint=heuristic_any(p))
    assert a.assignment == b.assignment and a.step_time_s == b.step_time_s
    c, d = solve_decomposed(p, s, free_tables=5), solve_decomposed(p, s, free_tables=5)
    assert c.assignment == d.assignment
