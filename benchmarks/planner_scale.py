"""Planner at scale: wall time, solver status, bound and gap of whole plans.

Cases (``--cases``): ``gem-1t`` on ``meta-roce-24k`` at 16,384 GPUs (1,200 tables; the issue's
target: ≤ 60 s on 2 cores, gap ≤ 2%), and the CLI default, ``gem-1t`` on ``h200-superpod-4k``.
Each runs the full search as ``coplan plan`` does (candidate pricing, bounds, CP-SAT, final pricing)
with ``--workers`` parallel solves; pin the process to two cores with ``taskset -c 0,1`` to measure
"on 2 cores". Writes ``benchmarks/results/planner_scale.json`` (or ``-o``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections import Counter
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CASES = {
    "gem-1t@meta-roce-24k:16384": ("gem-1t", "meta-roce-24k", 16384),
    "gem-1t@h200-superpod-4k": ("gem-1t", "h200-superpod-4k", None),
}


def main() -> int:
    from coplan.planner.search import PlannerConfig, available_cores, make_plan
    from coplan.spec import load_topology, load_workload

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--time-limit", type=float, default=300.0)
    ap.add_argument("--max-solves", type=int, default=12)
    ap.add_argument("--solve-dtime", type=float, default=0.5)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--gap-tolerance", type=float, default=None, help="PlannerConfig.gap_tolerance (default: the planner's)")
    ap.add_argument("-o", "--output", default=str(ROOT / "benchmarks" / "results" / "planner_scale.json"))
    args = ap.parse_args()
    rows = []
    commit = _git_commit()  # at the start: other commits may land while it runs
    for case in args.cases.split(","):
        wl, topo, gpus = CASES[case]
        w, t = load_workload(wl), load_topology(topo)
        load0 = os.getloadavg()
        t0 = time.perf_counter()
        cpu0 = os.times()
        extra = {} if args.gap_tolerance is None else {"gap_tolerance": args.gap_tolerance}
        cfg = PlannerConfig(world_size=gpus, num_workers=args.workers, time_limit_s=args.time_limit, solve_dtime=args.solve_dtime,
                            max_solves=args.max_solves, batch_size=args.batch_size, **extra)
        plan, res = make_plan(w, t, None, cfg, progress=lambda m: print(time.strftime("%H:%M:%S"), m, file=sys.stderr, flush=True))
        wall = time.perf_counter() - t0
        cpu1 = os.times()
        s, p = plan.solver, plan.predicted
        row = {
            "case": case, "tables": len(w.all_tables), "world_size": plan.world_size, "wall_s": wall,
            # CPU of this process and its solve workers (user + system): the figure that does not depend
            # on what else the machine runs
            "cpu_s": sum(getattr(cpu1, k) - getattr(cpu0, k) for k in ("user", "system", "children_user", "children_system")),
            "load_average_before": load0, "load_average_after": os.getloadavg(),
            "gap_tolerance": cfg.gap_tolerance, "batch_size": cfg.batch_size,
            "status": s.status, "objective_ms": s.objective_us / 1e3, "bound_ms": s.best_bound_us / 1e3, "gap": s.gap,
            "candidates_total": s.candidates_total, "candidates_solved": s.candidates_solved, "workers": s.num_workers,
            "mesh": plan.mesh.model_dump(exclude={"axes"}), "axes": {a.name: list(a.tiers) for a in plan.mesh.axes},
            "sharding": dict(Counter(x.sharding_type for x in plan.tables)), "recomputed_layers": sum(l.recompute for l in plan.layers),
            "predicted_step_s": p.step_time_s, "local_mfu": p.local_mfu, "e2e_mfu": p.e2e_mfu, "goodput": p.goodput,
            "peak_memory_gb": p.peak_memory_bytes / 1e9, "hbm_gb": p.hbm_capacity_bytes / 1e9,
        }
        print(json.dumps(row), flush=True)
        rows.append(row)
    out = {
        "benchmark": "planner_scale", "created_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {"cpu_count": os.cpu_count(), "cores_available": available_cores(), "platform": platform.platform(),
                    "python": platform.python_version(), "load_average": os.getloadavg()},
        "command": " ".join(["python", *sys.argv]), "git_commit": commit, "settings": vars(args), "rows": rows,
    }
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(out, indent=1) + "\n")
    return 0


def _git_commit() -> str | None:
    import subprocess

    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10).stdout.strip() or None
    except Exception:
        return None


if __name__ == "__main__":
    sys.exit(main())
