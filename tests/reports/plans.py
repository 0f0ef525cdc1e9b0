"""Real plans for the report tests and the load-time benchmark: made by the planner (CP-SAT, or the
simulate heuristic's plan), through its one assembly. Nothing here writes a number by hand."""

from __future__ import annotations

import os
from functools import lru_cache

from coplan.spec import Plan, load_topology, load_workload


PLANNER_TIME_LIMIT_S = 30.0
"""Search budget per plan in tests (the planner's default is 45 s); plans are deterministic for a seed."""


def planner_api():
    """``(workload, topology, world_size) -> Plan`` through the CP-SAT planner, or None while it is not built."""
    try:
        from coplan.planner.search import PlannerConfig, make_plan
    except ImportError:
        return None

    def plan_fn(workload, topology, world_size: int) -> Plan:
        cfg = PlannerConfig(world_size=world_size, time_limit_s=PLANNER_TIME_LIMIT_S, num_workers=min(4, os.cpu_count() or 1))
        return make_plan(workload, topology, None, cfg)[0]

    return plan_fn


def heuristic_plan(workload_name: str, topology_name: str, world_size: int) -> Plan:
    """The simulate heuristic's plan for this point, assembled and priced by the planner's one assembly."""
    from coplan.planner.assemble import heuristic_plan as assemble_heuristic

    return assemble_heuristic(load_workload(workload_name), load_topology(topology_name), world_size)


@lru_cache(maxsize=16)
def real_plan(workload_name: str, topology_name: str, world_size: int) -> Plan:
    """A plan from the planner if it is built, else from the heuristic + pricer."""
    fn = planner_api()
    if fn is not None:
        return fn(load_workload(workload_name), load_topology(topology_name), world_size)
    return heuristic_plan(workload_name, topology_name, world_size)
