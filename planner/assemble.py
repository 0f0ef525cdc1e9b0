"""The one assembly of a :class:`~coplan.spec.Plan`: every plan coplan writes (the CP-SAT search's, the
simulate heuristic's, the single-process and given plans of tests and benchmarks) is priced by the
cost model's full pricer and written here, so every plan carries the same prediction of the same
choices, and its mesh axes the same tier mapping (:func:`coplan.planner.mesh.mesh_axes`).
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Sequence

from coplan import __version__
from coplan.costmodel import build_context, price
from coplan.planner.heuristic import heuristic_plan_choices
from coplan.planner.mesh import mesh_axes
from coplan.spec import BalancingPlan, Calibration, LayerPlan, MeshPlan, Plan, SolverReport, TableShard, Topology, Workload, spec_sha256
from coplan.spec.plan import Alternative, PrecisionReport
from coplan.spec.workload import Kernels


def assemble(
    workload: Workload,
    topology: Topology,
    *,
    mesh: MeshPlan,
    tables: Sequence[TableShard],
    layers: Sequence[LayerPlan],
    balancing: BalancingPlan,
    calibration: Calibration | None = None,
    kernels: Kernels | None = None,
    solver: SolverReport | None = None,
    alternatives: Sequence[Alternative] = (),
    precision_report: PrecisionReport | None = None,
    notes: Sequence[str] = (),
) -> Plan:
    """Price the choices with the full pricer (per-op and per-collective detail) and write the Plan."""
    if not mesh.axes:
        mesh = mesh.model_copy(update={"axes": mesh_axes(topology, mesh)})
    kernels = kernels or workload.kernels
    ctx = build_context(workload, topology, mesh, calibration, force_calibration=True)
    cost = price(ctx, tuple(tables) if tables else None, tuple(layers), balancing, kernels, detail=True)
    pred = cost.to_prediction()
    if notes:
        pred = pred.model_copy(update={"notes": pred.notes + tuple(notes)})
    world = mesh.world_size
    return Plan(
        coplan_version=__version__, created_utc=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        topology=topology, workload=workload, calibration=calibration, topology_sha256=spec_sha256(topology),
        workload_sha256=spec_sha256(workload), world_size=world, mesh=mesh, tables=tuple(tables), layers=tuple(layers),
        balancing=balancing.model_copy(update={"expected_imbalance": max(1.0, float(cost.imbalance))}), kernels=kernels,
        precision=workload.precision, predicted=pred, solver=solver, alternatives=tuple(alternatives),
        precision_report=precision_report,
    )


def heuristic_plan(workload: Workload, topology: Topology, world_size: int, calibration: Calibration | None = None) -> Plan:
    """The simulate heuristic's plan (:mod:`coplan.planner.heuristic`), assembled."""
    hp = heuristic_plan_choices(workload, topology, world_size, calibration)
    return assemble(workload, topology, mesh=hp.mesh, tables=hp.table_shards(workload), layers=hp.layers, balancing=hp.balancing,
                    calibration=calibration, solver=SolverReport(status="HEURISTIC"), notes=tuple(hp.reasons))


__all__ = ["assemble", "heuristic_plan"]
