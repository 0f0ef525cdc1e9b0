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


@pytest.mark.parametrize("seed", [1, 4, 9])
def test_decomposed_bound_with_a_cutoff_is_valid(seed):
    """With an objective cutoff (the branch and bound's "beat the best plan by more than the gap
    tolerance"), the bound stays below the true optimum: below the cutoff when the relaxation has
    nothing under it, the relaxation's bound otherwise; and a returned plan always fits."""
    p = synthetic_pricing(6, 4, 4, 3, seed, capacity=40e9, base_bytes=20e9)
    best, _, _ = brute_force(p)
    for cutoff in (best * 0.9, best * 0.999, best * 1.05):
        r = solve_decomposed(p, EXACT, free_tables=6, cutoff_s=cutoff)
        assert r.bound_s <= best + 1e-9
        if cutoff < best * 0.99:  # nothing can go below the cutoff: the bound says so
            assert r.bound_s >= cutoff - 1e-6
        if r.assignment is not None:
            assert evaluate(p, r.assignment).peak_bytes <= p.capacity_bytes
            assert r.step_time_s >= best - 1e-9


def test_decomposed_recompute_choice_uses_the_frontier():
    """Layers of identical figures: the decomposed model chooses among recompute frontier points, so
    its plan's recompute is a frontier point and no more expensive than the exact optimum's."""
    from coplan.planner.recompute import frontier

    p = synthetic_pricing(6, 4, 4, 6, 7, capacity=32e9, base_bytes=24e9)
    best, plan, _ = brute_force(p)
    r = solve_decomposed(p, EXACT, free_tables=6)
    assert r.bound_s <= best + 1e-9 <= r.step_time_s + 2e-9
    front = frontier(p.layers)
    assert front is not None
    freed = sum(l.saved_bytes for l, on in zip(p.layers, r.assignment.recompute) if on) - max(
        (l.peak_bytes for l, on in zip(p.layers, r.assignment.recompute) if on), default=0.0)
    t = sum(l.recompute_s for l, on in zip(p.layers, r.assignment.recompute) if on)
    assert t <= front.least_time(freed - 1e-6) + 1e-12  # no set freeing as much is cheaper


@pytest.mark.parametrize("seed", [0, 3, 8, 13])
def test_break_lumps_never_worsens_and_keeps_capacity(seed):
    """The local search on the tables that set a maximum only accepts changes that lower the step,
    and only placements that fit; from a plan with every table whole on one rank it finds a better one
    when splitting the largest table is worth it."""
    from coplan.planner.pricing import Assignment
    from coplan.planner.solver import break_lumps

    p = synthetic_pricing(10, 8, 4, 3, seed, capacity=60e9, base_bytes=20e9)
    a = heuristic_any(p)
    b = break_lumps(p, a)
    ea, eb = evaluate(p, a), evaluate(p, b)
    assert eb.step_time_s <= ea.step_time_s and eb.peak_bytes <= p.capacity_bytes
    # every table table-wise, all on rank 0 (room enough for that): a maximum that splitting or
    # moving tables removes
    q = synthetic_pricing(10, 8, 4, 3, seed, capacity=10e12, base_bytes=20e9)
    tw = [next(i for i, o in enumerate(opts) if o.sharding_type == "table_wise") for opts in q.options]
    lump = Assignment(tuple(tw), tuple((0,) for _ in tw), tuple(False for _ in q.layers))
    assert evaluate(q, lump).peak_bytes <= q.capacity_bytes
    c = break_lumps(q, lump)
    assert evaluate(q, c).step_time_s < evaluate(q, lump).step_time_s
    assert evaluate(q, c).peak_bytes <= q.capacity_bytes


def _two_load_case(node: int = 0):
    """Four table-wise tables over two ranks: two forward-and-backward heavy that send nothing, two
    send-heavy that compute little, all of the same scalar weight (time plus send time). Putting the
    two compute-heavy ones together balances the scalar but doubles the forward and backward maxima."""
    from coplan.costmodel.results import StepCut
    from coplan.planner.mesh import MeshCandidate
    from coplan.planner.pricing import CandidatePricing, ShardOption

    wa = 1e-9  # one byte sent costs 1 ns
    heavy = (ShardOption("table_wise", 1, 400e-6, 600e-6, 0.0, 1e9, 0.0),)
    sender = (ShardOption("table_wise", 1, 0.0, 0.0, 1e6, 1e9, 0.0),)  # 1 ms of sends
    cut = StepCut(5e-3, {"fwd": 1.0, "bwd": 1.0, "a2a": wa}, {})
    return CandidatePricing(
        mesh=MeshCandidate(2, 2, 1, 2), node_size=node, base_bytes=1e9, capacity_bytes=10e9,
        layers=(), options=(heavy, heavy, sender, sender), table_names=("a", "b", "c", "d"), cuts=(cut,),
        scale={"fwd": 1.0, "bwd": 1.0, "a2a": wa},
    )


def test_vector_placement_and_rebalance_reach_the_optimum():
    """A plan balanced in a scalar weight (heavy tables together) is 2 ms slower than the one that
    pairs a compute-heavy with a send-heavy table on each rank; the vector placement finds the
    latter directly and :func:`rebalance` finds it from the former."""
    from coplan.planner.pricing import Assignment
    from coplan.planner.solver import place, rebalance

    p = _two_load_case()
    bad = Assignment((0, 0, 0, 0), ((0,), (0,), (1,), (1,)), ())
    good = Assignment((0, 0, 0, 0), ((0,), (1,), (0,), (1,)), ())
    assert evaluate(p, bad).step_time_s == pytest.approx(evaluate(p, good).step_time_s + 2e-3)
    for a in (place(p, (0, 0, 0, 0), ()), rebalance(p, bad)):
        assert evaluate(p, a).step_time_s == pytest.approx(evaluate(p, good).step_time_s)
        assert sorted(a.ranks[:2]) == [(0,), (1,)] and sorted(a.ranks[2:]) == [(0,), (1,)]


def test_vector_placement_respects_memory():
    """No rank with room for a shard: no placement (the caller then tries other orders or recompute)."""
    import dataclasses

    from coplan.planner.solver import place

    p = dataclasses.replace(_two_load_case(), capacity_bytes=2.5e9, cache={})  # room for one 1 GB shard per rank
    assert place(p, (0, 0, 0, 0), ()) is None


@pytest.mark.parametrize("seed", [0, 3, 8, 13])
def test_rebalance_never_worsens_and_keeps_the_rules(seed):
    """Placement-only local search: options unchanged, shards per table unchanged, shards of one table on
    distinct ranks, node options where they were, memory within capacity, and a step no slower."""
    from coplan.planner.solver import rebalance

    p = synthetic_pricing(12, 8, 4, 3, seed, capacity=60e9, base_bytes=20e9)
    a = heuristic_any(p)
    b = rebalance(p, a, max_steps=500)
    ea, eb = evaluate(p, a), evaluate(p, b)
    assert eb.step_time_s <= ea.step_time_s and eb.peak_bytes <= p.capacity_bytes
    assert b.choice == a.choice and b.recompute == a.recompute
    for t, (ra, rb) in enumerate(zip(a.ranks, b.ranks)):
        assert len(rb) == len(set(rb)) == len(ra)
        if p.options[t][a.choice[t]].placement != "rank":
            assert ra == rb


def test_every_table_free_tightens_the_decomposed_bound():
    """With every table free the relaxation sees each table's own figures (not its least per aggregate):
    its bound is at least the partly fixed one's and still below the exhaustive optimum."""
    p = synthetic_pricing(6, 4, 4, 3, 1, capacity=40e9, base_bytes=20e9)
    best, _, _ = brute_force(p)
    s_few = SolverSettings(time_limit_s=30.0, num_workers=1, relative_gap=0.0, flat_max_vars=0, free_tables=2)
    s_all = SolverSettings(time_limit_s=30.0, num_workers=1, relative_gap=0.0, flat_max_vars=0, free_tables=6)
    from coplan.planner.solver import solve_candidate

    few, every = solve_candidate(p, s_few), solve_candidate(p, s_all)
    assert few.method == every.method == "decomposed"
    assert few.bound_s <= every.bound_s + 1e-9 <= best + 2e-9
