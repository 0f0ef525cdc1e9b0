"""Fuzzing found inputs that crashed the CP-SAT model building (an int64 domain overflowed, an infinite price
rounded), an infeasibility explanation that ignored --time-limit, an OOM message that blamed every rank for one
rank's table, and a --pin micro_batches refusal that did not say the workload fixes the count. Each is now a typed
error or a message saying which rank, what and how to fix it."""

from __future__ import annotations

import math
import time
from dataclasses import replace

import pytest

from coplan.errors import CoplanError, InfeasibleError, PriceRangeError
from coplan.planner.costs import Pricer
from coplan.planner.explain import explain_infeasible
from coplan.planner.mesh import enumerate_candidates
from coplan.planner.search import PlannerConfig, bound_candidates, make_plan
from coplan.planner.solver import SolverSettings, solve_candidate
from coplan.planner.explain import with_changes
from coplan.spec import load_topology, load_workload


def _candidate():
    w, t = load_workload("gem-tiny"), load_topology("h200-1gpu")
    pricer = Pricer(w, t, 1, None)
    return pricer.candidate(next(iter(enumerate_candidates(t, w, 1))))


@pytest.mark.parametrize("const_s", [math.inf, 1e12])
def test_a_price_the_integer_model_cannot_hold_is_a_typed_error(const_s):
    p = _candidate()
    p = replace(p, cuts=tuple(replace(c, const_s=const_s) for c in p.cuts), cache={})
    with pytest.raises(PriceRangeError, match="mesh fsdp1x1"):
        solve_candidate(p, SolverSettings(time_limit_s=0.1))


def test_pinned_micro_batches_on_a_fixed_count_says_to_set_auto():
    w, t = load_workload("gem-tiny"), load_topology("h200-1gpu")
    with pytest.raises(CoplanError, match=r"the workload fixes batch.micro_batches: 1; set it to 'auto' \(or 2\)"):
        make_plan(w, t, None, PlannerConfig(num_workers=1, pins={"micro_batches": 2}))


def _one_big_table():
    w = load_workload("gem-tiny")
    tables = [t.model_dump() for t in w.tables]
    tables[0]["num_rows"] = 2_000_000_000
    return with_changes(w, tables=tables), load_topology("h200-superpod-1k")


def test_an_oom_of_one_rank_names_that_rank_and_what_it_holds():
    w, t = _one_big_table()
    with pytest.raises(InfeasibleError) as e:
        make_plan(w, t, None, PlannerConfig(world_size=8, num_workers=1, table_pins={"user_id": "table_wise"}))
    msg = str(e.value)
    assert "the rank holding table 'user_id' (its smallest shard, table_wise, takes 136.0 GB: 7.1 GB over" in msg
    assert "the other ranks need about" in msg and "which fits" in msg and "on every rank" not in msg
    assert "FSDP gather buffers, NCCL" not in msg and "other buffers:" in msg and "(NCCL communicator buffers" in msg
    short = e.value.shortfalls[0]
    assert short["short_bytes"] <= short["needed_bytes"]


def test_the_explanation_checks_no_fix_past_the_deadline():
    w, t = load_workload("gem-1t"), load_topology("h200-1gpu")
    pricer = Pricer(w, t, 1, None)
    cands = list(enumerate_candidates(t, w, 1))
    records, pricings = bound_candidates(pricer, cands, PlannerConfig(num_workers=1), None)
    t0 = time.perf_counter()
    err = explain_infeasible(w, t, 1, pricer, records, pricings, deadline=t0)
    assert time.perf_counter() - t0 < 5.0
    assert "no plan fits" in str(err) and "the time limit ran out" in str(err) and not err.fixes
