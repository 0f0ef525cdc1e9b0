"""How long the cost model takes to price one full candidate plan of gem-1t on 16,384 GPUs.

Measures, on this machine (median of ``--repeats``):

- ``first_plan_s``: a fresh process-level start: context built, plan given as 1,200 ``TableShard``
  specs, jagged imbalance simulated (nothing memoised);
- ``fresh_context_plan_s``: a new (workload, topology, mesh) context and one priced plan, with the
  jagged imbalance memoised (what the planner pays per mesh candidate after the first);
- ``new_placement_s``: a new table placement priced in an existing context (the planner's inner
  loop: ``TableAssignment`` arrays, no per-op rows);
- ``warm_full_detail_s``: the same plan again with per-op and per-collective rows.

Writes ``benchmarks/results/costmodel_speed.json``. Usage::

    python benchmarks/costmodel_speed.py [--topology gb200-nvl72-16k] [--repeats 20]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from coplan import __version__
from coplan.costmodel import build_context, price
from coplan.planner.heuristic import heuristic_plan_choices
from coplan.costmodel import jagged
from coplan.planner.simulate import topology_for
from coplan.costmodel.embedding import TableAssignment
from coplan.spec import load_workload

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import git_commit  # noqa: E402  (the scripts run by path)

BUDGET_S = 0.050


def _median(f, repeats: int) -> float:
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        f()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", default="gem-1t")
    ap.add_argument("--topology", default="gb200-nvl72-16k")
    ap.add_argument("--gpus", type=int, default=16384)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "costmodel_speed.json"))
    args = ap.parse_args(argv)

    w = load_workload(args.workload)
    topo, extended = topology_for(args.topology, args.gpus)
    t0 = time.perf_counter()
    hp = heuristic_plan_choices(w, topo, args.gpus)
    heuristic_s = time.perf_counter() - t0
    shards = hp.table_shards(w)
    jagged._imb_cache.clear()  # the first plan pays for the imbalance simulation

    t0 = time.perf_counter()
    ctx = build_context(w, topo, hp.mesh)
    cost = price(ctx, shards, hp.layers, hp.balancing)
    first = time.perf_counter() - t0

    fresh = _median(lambda: price(build_context(w, topo, hp.mesh), shards, hp.layers, hp.balancing), args.repeats)
    rng = np.random.default_rng(0)
    a = hp.tables
    placements = [TableAssignment(a.sharding, a.num_shards, a.shard_table, rng.permutation(a.shard_rank), a.dp_tables)
                  for _ in range(args.repeats)]
    it = iter(placements)
    new_place = _median(lambda: price(ctx, next(it), hp.layers, hp.balancing, detail=False), args.repeats)
    warm = _median(lambda: price(ctx, shards, hp.layers, hp.balancing), args.repeats)

    result = {
        "benchmark": "costmodel_speed",
        "date_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                    "cpus": os.cpu_count(), "python": sys.version.split()[0], "numpy": np.__version__},
        "git_commit": git_commit(), "coplan_version": __version__,
        "workload": w.name, "topology": topo.name, "topology_extended": extended, "gpus": args.gpus,
        "tables": len(w.all_tables), "layers": len(ctx.layer_names), "repeats": args.repeats,
        "mesh": hp.mesh.model_dump(exclude={"axes"}),
        "predicted_step_time_s": cost.step_time_s, "predicted_e2e_mfu": cost.e2e_mfu,
        "heuristic_plan_s": heuristic_s,
        "first_plan_s": first,
        "fresh_context_plan_s": fresh,
        "new_placement_s": new_place,
        "warm_full_detail_s": warm,
        "budget_s": BUDGET_S,
        "within_budget": max(first, fresh) < BUDGET_S,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    for k in ("heuristic_plan_s", "first_plan_s", "fresh_context_plan_s", "new_placement_s", "warm_full_detail_s"):
        print(f"{k:>22}: {result[k] * 1e3:8.2f} ms")
    print(f"wrote {args.out}")
    return 0 if result["within_budget"] else 1


if __name__ == "__main__":
    sys.exit(main())
