"""Jagged-batch balancers: max/mean rank cost and run time, against random assignment and CP-SAT.

- 4,096 sequences of gem-1t's history length distribution (log-normal, mean 2,048, sigma 1, 16..8,192)
  over 64 ranks, each costing what the cost model says one sequence costs on an H200 (forward and
  backward of gem-1t's dense layers: ``coplan.costmodel.compute.seq_cost``, quadratic attention plus
  linear terms). Policies: greedy (LPT), Karmarkar-Karp (balanced LDM), the plain contiguous split,
  and uniformly random ranks. Time is the best and the median of repeated runs (same batch).
- The heuristics' gap to CP-SAT on small batches (40 sequences over 4 ranks, 16 over 4), where CP-SAT
  proves (or bounds) the optimum.
- The planner's expected-imbalance estimate at 16,384 ranks and its cost (memoised after the first call).

Run: ``python benchmarks/balance_jagged.py``; writes ``benchmarks/results/balance_jagged.json``.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import git_commit  # noqa: E402  (the scripts run by path)

ROOT = Path(__file__).resolve().parents[1]


def gem_seq_cost():
    from coplan.costmodel import build_context
    from coplan.costmodel.compute import seq_cost
    from coplan.spec import MeshPlan, load_topology, load_workload

    w = load_workload("gem-1t")
    t = load_topology("h200-superpod-4k")
    ctx = build_context(w, t, MeshPlan(dense_shard=64, dense_replicate=64, expert_parallel=64, sparse_shard=1024, sparse_replicate=4))
    return w, seq_cost(ctx)


def timed(fn, repeats: int) -> tuple[float, float]:
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return min(ts), statistics.median(ts)


def main() -> int:
    from coplan.costmodel.jagged import balance, balance_cpsat, bin_loads, expected_imbalance, imbalance_ratio
    from coplan.spec.workload import sample_lengths

    w, sc = gem_seq_cost()
    dist = w.sequence("history").length
    n, k = 4096, 64
    rows = []
    for seed in range(5):
        lengths = sample_lengths(dist, n, seed)
        costs = sc(lengths)
        row = {"seed": seed}
        for policy in ("greedy", "karmarkar_karp", "none"):
            bins = balance(costs, k, policy)
            best, med = timed(lambda: balance(costs, k, policy), 30)
            row[policy] = {"max_over_mean": imbalance_ratio(costs, bins, k), "best_ms": best * 1e3, "median_ms": med * 1e3}
        rng = np.random.default_rng(seed)
        rand = rng.integers(0, k, size=n)
        row["random"] = {"max_over_mean": imbalance_ratio(costs, rand, k)}
        rows.append(row)
    small = []
    for (items, bins_, seed) in [(40, 4, 0), (40, 4, 1), (40, 4, 2), (16, 4, 3), (16, 4, 4), (24, 3, 5)]:
        costs = sc(sample_lengths(dist, items, 100 + seed))
        r = balance_cpsat(costs, bins_, time_limit_s=20.0, num_workers=1)
        g = bin_loads(costs, balance(costs, bins_, "greedy"), bins_).max()
        kk = bin_loads(costs, balance(costs, bins_, "karmarkar_karp"), bins_).max()
        small.append({"items": items, "bins": bins_, "cpsat_status": r.status, "cpsat_max": r.max_load, "lower_bound": r.lower_bound,
                      "greedy_over_bound": g / r.lower_bound - 1, "kk_over_bound": kk / r.lower_bound - 1,
                      "cpsat_over_bound": r.max_load / r.lower_bound - 1})
    est = {}
    for policy in ("none", "greedy", "karmarkar_karp"):
        t0 = time.perf_counter()
        v = expected_imbalance(dist, sc, 128, 16384, policy)
        first = time.perf_counter() - t0
        t0 = time.perf_counter()
        expected_imbalance(dist, sc, 128, 16384, policy)
        est[policy] = {"expected_max_over_mean": v, "first_call_s": first, "cached_call_s": time.perf_counter() - t0}
    summary = {
        policy: {
            "max_over_mean_worst": max(r[policy]["max_over_mean"] for r in rows),
            "max_over_mean_mean": statistics.mean(r[policy]["max_over_mean"] for r in rows),
            **({"best_ms_worst": max(r[policy]["best_ms"] for r in rows), "median_ms_worst": max(r[policy]["median_ms"] for r in rows)}
               if policy != "random" else {}),
        }
        for policy in ("greedy", "karmarkar_karp", "none", "random")
    }
    out = {
        "benchmark": "balance_jagged", "created_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "git_commit": git_commit(),
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "load_average": os.getloadavg()},
        "setup": {"sequences": n, "ranks": k, "length": dist.model_dump(), "seq_cost": {"const_s": sc.const_s, "lin_s": sc.lin_s, "quad_s": sc.quad_s}},
        "summary": summary, "batches": rows, "small_vs_cpsat": small, "expected_imbalance_16384_ranks_local_128": est,
    }
    path = ROOT / "benchmarks" / "results" / "balance_jagged.json"
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps({"summary": summary, "small_vs_cpsat": small, "expected": est}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
