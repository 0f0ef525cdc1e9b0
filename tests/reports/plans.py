"""Real plans for the report tests and the load-time benchmark: made by the planner when it is
installed (``coplan.planner.plan``), else by the cost model's heuristic plan (what ``coplan simulate``
uses) priced by the full pricer. Nothing here writes a number by hand."""

from __future__ import annotations

from datetime import datetime, timezone
import os
from functools import lru_cache

from coplan import __version__
from coplan.spec import Plan, load_topology, load_workload, spec_sha256


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
    """The cost model's heuristic choices for this point, priced, as a Plan with its Prediction."""
    from coplan.costmodel import build_context, heuristic_plan_choices, price
    from coplan.planner.mesh import mesh_axes
    from coplan.spec import SolverReport

    w, t = load_workload(workload_name), load_topology(topology_name)
    hp = heuristic_plan_choices(w, t, world_size)
    mesh = hp.mesh if hp.mesh.axes else hp.mesh.model_copy(update={"axes": mesh_axes(t, hp.mesh)})
    ctx = build_context(w, t, mesh)
    cost = price(ctx, hp.tables, hp.layers, hp.balancing, w.kernels)
    return Plan(
        coplan_version=__version__, created_utc=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        topology=t, workload=w, topology_sha256=spec_sha256(t), workload_sha256=spec_sha256(w),
        world_size=world_size, mesh=mesh, tables=hp.table_shards(w), layers=hp.layers, balancing=hp.balancing,
        kernels=w.kernels, precision=w.precision, predicted=cost.to_prediction(),
        solver=SolverReport(status="HEURISTIC"),
    )


@lru_cache(maxsize=16)
def real_plan(workload_name: str, topology_name: str, world_size: int) -> Plan:
    """A plan from the planner if it is built, else from the heuristic + pricer."""
    fn = planner_api()
    if fn is not None:
        return fn(load_workload(workload_name), load_topology(topology_name), world_size)
    return heuristic_plan(workload_name, topology_name, world_size)
