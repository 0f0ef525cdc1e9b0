"""Every preset workload on every preset topology, planned as ``coplan plan`` plans it (defaults), and
the simulate heuristic's plan of the same pair: the returned plan against the heuristic, the priced
step against CP-SAT's objective and bound, planning time.

Optionally (``--random N``) the same on N seeded random (workload, topology, GPU count) pairs of
:mod:`coplan.spec.draw` (hybrid, sparse-heavy and dense-only; 1 to 16,384 GPUs), the seed taken at
run time unless given, and reported.

Run: ``python benchmarks/planner_presets.py [--random N] [--seed S]`` → ``benchmarks/results/planner_presets.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def plan_pair(workload, topology, world: int | None) -> dict:
    from coplan.errors import CoplanError, InfeasibleError
    from coplan.planner.assemble import heuristic_plan
    from coplan.planner.search import PlannerConfig, make_plan

    row: dict = {"workload": workload.name, "topology": topology.name}
    t0, c0 = time.perf_counter(), time.process_time()
    try:
        plan, res = make_plan(workload, topology, None, PlannerConfig(world_size=world))
    except InfeasibleError as e:
        row.update(status="infeasible", fixes=e.fixes, wall_s=time.perf_counter() - t0)
        return row
    except CoplanError as e:
        row.update(status="refused", reason=str(e).splitlines()[0], wall_s=time.perf_counter() - t0)
        return row
    # the search's own processes are children: their CPU time is in RUSAGE_CHILDREN
    s = plan.solver
    row.update(
        status=s.status, world_size=plan.world_size, step_s=plan.predicted.step_time_s, model_objective_s=s.model_objective_us * 1e-6,
        bound_s=s.best_bound_us * 1e-6, gap=s.gap, model_error=(s.objective_us - s.model_objective_us) / s.objective_us if s.objective_us else 0.0,
        cut_rounds=s.cut_rounds, candidates=s.candidates_total, solved=s.candidates_solved, e2e_mfu=plan.predicted.e2e_mfu,
        peak_memory_fraction_of_usable=plan.predicted.peak_memory_bytes / (plan.predicted.hbm_capacity_bytes - plan.predicted.hbm_reserve_bytes),
        mesh=res.pricer.mesh_plan(res.pricing.mesh).model_dump(exclude={"axes"}) if res.pricing is not None else plan.mesh.model_dump(exclude={"axes"}),
        wall_s=time.perf_counter() - t0, cpu_s_parent=time.process_time() - c0,
    )
    try:
        h = heuristic_plan(workload, topology, plan.world_size)
        pred = h.predicted
        row["heuristic"] = {"step_s": pred.step_time_s, "fits": pred.peak_memory_bytes <= pred.hbm_capacity_bytes - pred.hbm_reserve_bytes}
        row["returned_vs_heuristic"] = plan.predicted.step_time_s / pred.step_time_s - 1.0
    except CoplanError as e:
        row["heuristic"] = {"error": str(e).splitlines()[0]}
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--random", type=int, default=0, metavar="N", help="also N seeded random pairs")
    ap.add_argument("--seed", type=int, default=None, help="seed of --random (default: from the clock at run time)")
    ap.add_argument("--no-presets", action="store_true")
    ap.add_argument("-o", "--output", default=str(ROOT / "benchmarks" / "results" / "planner_presets.json"))
    args = ap.parse_args()
    from coplan.spec import Topology, Workload, list_presets, load_topology, load_workload
    from coplan.spec.draw import random_pair

    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    rows = []
    if not args.no_presets:
        for wn in list_presets(Workload):
            for tn in list_presets(Topology):
                r = plan_pair(load_workload(wn), load_topology(tn), None)
                print(json.dumps(r), flush=True)
                rows.append(r)
    seed = None
    if args.random:
        seed = int(time.time()) % 100_000 if args.seed is None else args.seed
        print(f"random pairs: seeds {seed}..{seed + args.random - 1}", file=sys.stderr)
        for s in range(seed, seed + args.random):
            w, t, n = random_pair(s)
            r = plan_pair(w, t, n)
            r["seed"] = s
            print(json.dumps(r), flush=True)
            rows.append(r)
    out = {
        "benchmark": "planner_presets", "created_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"), "git_commit": commit,
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "load_average": os.getloadavg()},
        "command": " ".join([Path(sys.executable).name, *sys.argv]), "random_seed_start": seed, "rows": rows,
    }
    Path(args.output).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
