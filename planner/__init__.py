"""Planner: enumerate mesh candidates, price them with the cost model, solve the CP-SAT co-design
model, explain infeasibility, export the sparse plan to TorchRec.

``make_plan(workload, topology, calibration, PlannerConfig(...)) -> (Plan, SearchResult)`` is the entry
point (``coplan plan`` calls it); :mod:`coplan.planner.given` writes plans whose every choice is given
(tests, the unsharded reference of a sharded run), through the same assembly. Nothing here imports
torch; ``coplan.planner.torchrec_export`` imports torch and torchrec lazily, only when a TorchRec plan
is built.
"""

from coplan.planner.search import PlannerConfig, SearchResult, make_plan

__all__ = ["PlannerConfig", "SearchResult", "make_plan"]
