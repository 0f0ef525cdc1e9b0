"""coplan's sparse plan against TorchRec's EmbeddingShardingPlanner, judged by TorchRec's own estimator.

For each workload's tables (dlrm-856, gem-1t) and world size (64, 512, 4,096 ranks):

1. TorchRec plans the tables with ``EmbeddingShardingPlanner`` (its default enumerator, proposers,
   greedy partitioner, perf and storage estimators) on a ``Topology(world_size, compute_device="cuda")``
   built from the coplan topology's figures (HBM, NVLink and NIC bandwidth, GPUs per node), on CPU
   (planning needs no GPU), with the per-rank batch and each table's ids per sample as constraints.
2. coplan plans the same tables over one shard group of all ranks (as TorchRec does), with its own
   cost model and CP-SAT (the decomposed model at these sizes), and exports them as a ShardingPlan.
3. Both ShardingPlans are turned into TorchRec ShardingOptions (TorchRec's enumerator, constrained to
   each plan's own sharding types and column-wise widths; the shards put on the plan's ranks) and
   rated by TorchRec's ``EmbeddingPerfEstimator`` (per-shard fwd/bwd compute and comms) and its
   ``NoopPerfModel``: the maximum over ranks of the summed shard perf, the figure TorchRec's planner
   itself minimises; ``EmbeddingStorageEstimator`` checks the HBM of each.

Both planners' wall and CPU times are reported (TorchRec's in a child process killed after
``--torchrec-wall-limit``; its plan is cached as JSON so coplan's side can be re-run against it).
Run: ``python benchmarks/planner_torchrec.py [--workloads W] [--worlds N,...]``;
results go to ``benchmarks/results/planner_torchrec.json``.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import logging
import os
import platform
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"

logging.getLogger("torchrec").setLevel(logging.ERROR)
logging.disable(logging.WARNING)


def build_module(workload, only: set[str] | None = None):
    """The tables as the trainer lays them out: ``sparse.ebc`` (pooled) and ``sparse.ecs.ec_d<dim>``
    (``only``: just these tables)."""
    from torchrec.modules.embedding_configs import DataType, EmbeddingBagConfig, EmbeddingConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection

    dt = {"fp32": DataType.FP32, "fp16": DataType.FP16, "bf16": DataType.BF16, "int8": DataType.INT8}
    tables = [t for t in workload.all_tables if only is None or t.name in only]
    pooled = [t for t in tables if t.feature_kind == "pooled"]
    seq = [t for t in tables if t.feature_kind == "sequence"]

    class Sparse(nn.Module):
        def __init__(self):
            super().__init__()
            if pooled:
                self.ebc = EmbeddingBagCollection(
                    tables=[EmbeddingBagConfig(name=t.name, embedding_dim=t.dim, num_embeddings=t.num_rows, feature_names=[t.name],
                                               data_type=dt[t.dtype]) for t in pooled],
                    device=torch.device("meta"),
                )
            groups: dict[int, list] = {}
            for t in seq:
                groups.setdefault(t.dim, []).append(t)
            self.ecs = nn.ModuleDict({
                f"ec_d{d}": EmbeddingCollection(
                    tables=[EmbeddingConfig(name=t.name, embedding_dim=t.dim, num_embeddings=t.num_rows, feature_names=[t.name],
                                            data_type=dt[t.dtype]) for t in ts],
                    device=torch.device("meta"),
                )
                for d, ts in sorted(groups.items())
            })

    class Root(nn.Module):
        def __init__(self):
            super().__init__()
            self.sparse = Sparse()

    return Root()


def lookups_per_sample(workload) -> dict[str, float]:
    from coplan.costmodel.jagged import length_moments

    means = {s.name: length_moments(s.length).mean for s in workload.sequences}
    return {t.name: (means[t.sequence] if t.feature_kind == "sequence" else t.pooling_factor) * t.num_features for t in workload.all_tables}


def torchrec_topology(topology, world: int, batch: int):
    from torchrec.distributed.planner.types import Topology as TRTopology

    t0 = topology.tiers[0]
    net = topology.tiers[1] if len(topology.tiers) > 1 else t0
    return TRTopology(
        world_size=world, compute_device="cuda", hbm_cap=int(topology.gpu.hbm_bytes), local_world_size=topology.gpus_per_node,
        hbm_mem_bw=topology.gpu.hbm_bw_bytes_per_s / 1000.0,  # bytes/ms
        intra_host_bw=t0.bw_bytes_per_s / 1000.0, inter_host_bw=net.bw_bytes_per_s / 1000.0,
    )


def constraints_for(workload, *, kinds: dict[str, str] | None = None, cw_width: dict[str, int] | None = None):
    from torchrec.distributed.planner.types import ParameterConstraints

    lam = lookups_per_sample(workload)
    out = {}
    for t in workload.all_tables:
        # the sharding types both planners may use (TorchRec's planner also knows table-column-wise
        # and grid sharding; leaving them out gives both the same search space and saves TorchRec time)
        kw = {"sharding_types": ["table_wise", "row_wise", "column_wise", "table_row_wise", "data_parallel"]}
        if t.feature_kind == "sequence":
            kw["sharding_types"] = ["table_wise", "row_wise", "column_wise", "data_parallel"]
        if kinds is not None:
            kw["sharding_types"] = [kinds[t.name]]
        if cw_width and t.name in cw_width:
            kw["min_partition"] = cw_width[t.name]
        kern = ["dense"] if kinds is not None and kinds[t.name] == "data_parallel" else ["fused"]
        if kinds is None:
            kern = ["fused", "dense"]  # dense only applies to data-parallel options in TorchRec
        out[t.name] = ParameterConstraints(pooling_factors=[max(lam[t.name], 1e-3)], compute_kernels=kern, **kw)
    return out


def sharders():
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

    return [EmbeddingBagCollectionSharder(), EmbeddingCollectionSharder()]


def rate_plan(sharding_plan, workload, topology, world: int, batch: int) -> dict:
    """TorchRec's estimate of a ShardingPlan: max over ranks of summed shard perf, and HBM."""
    from torchrec.distributed.planner.enumerators import EmbeddingEnumerator
    from torchrec.distributed.planner.shard_estimators import EmbeddingPerfEstimator, EmbeddingStorageEstimator

    summary = sharding_plan if isinstance(sharding_plan, dict) else plan_summary(sharding_plan)
    kinds, cw_width, ranks = {}, {}, {}
    for name, (kind, rr, width) in summary.items():
        kinds[name] = kind
        ranks[name] = list(rr)
        if kind == "column_wise":
            cw_width[name] = int(width)
    topo = torchrec_topology(topology, world, batch)
    cons = constraints_for(workload, kinds=kinds, cw_width=cw_width)
    enum = EmbeddingEnumerator(topology=topo, batch_size=batch, constraints=cons,
                               estimator=[EmbeddingPerfEstimator(topo, cons), EmbeddingStorageEstimator(topo, cons)])
    options = enum.enumerate(build_module(workload), sharders())
    by_table: dict[str, list] = {}
    for o in options:
        by_table.setdefault(o.name, []).append(o)
    perf = [0.0] * world
    hbm = [0.0] * world
    on_rank: dict[int, list] = {}
    for name, opts in by_table.items():
        want = kinds[name]
        cand = [o for o in opts if o.sharding_type == want]
        if want == "column_wise":
            cand = [o for o in cand if len(o.shards) == len(ranks[name])]
        if not cand:
            raise RuntimeError(f"TorchRec enumerates no {want} option with {len(ranks[name])} shards for {name}")
        o = copy.deepcopy(cand[0])
        rr = ranks[name] if want not in ("data_parallel", "row_wise") else list(range(world))
        if len(rr) != len(o.shards):
            raise RuntimeError(f"{name}: {len(rr)} ranks for {len(o.shards)} shards")
        for s, r in zip(o.shards, rr):
            perf[r] += s.perf.total
            hbm[r] += s.storage.hbm
            on_rank.setdefault(r, []).append((name, want, s.perf.total))
    top = max(range(world), key=lambda r: perf[r])
    return {"max_rank_perf_ms": max(perf), "mean_rank_perf_ms": sum(perf) / world, "max_rank_hbm_bytes": max(hbm),
            "fits": max(hbm) <= topology.gpu.hbm_bytes,
            # what the slowest rank holds, largest first (where the max comes from)
            "max_rank_shards": sorted(([n, k, p] for n, k, p in on_rank.get(top, [])), key=lambda x: -x[2])[:8]}


def least_largest_shard(workload, topology, world: int, batch: int, names: list[str]) -> dict[str, list]:
    """For each named table, over every option TorchRec's enumerator offers (the sharding types both
    planners may use), the least possible perf of the table's largest shard: whatever plan either
    planner makes, some rank holds a shard of that table at least this costly, so the max over ranks is
    at least the largest of these (a lower bound for any plan, by TorchRec's own estimator)."""
    from torchrec.distributed.planner.enumerators import EmbeddingEnumerator
    from torchrec.distributed.planner.shard_estimators import EmbeddingPerfEstimator, EmbeddingStorageEstimator

    topo = torchrec_topology(topology, world, batch)
    cons = {k: v for k, v in constraints_for(workload).items() if k in names}
    enum = EmbeddingEnumerator(topology=topo, batch_size=batch, constraints=cons,
                               estimator=[EmbeddingPerfEstimator(topo, cons), EmbeddingStorageEstimator(topo, cons)])
    options = enum.enumerate(build_module(workload, only=set(names)), sharders())
    out: dict[str, list] = {}
    for o in options:
        largest = max(s.perf.total for s in o.shards)
        if o.name not in out or largest < out[o.name][1]:
            out[o.name] = [o.sharding_type, largest, len(o.shards)]
    return out


def torchrec_plan(workload, topology, world: int, batch: int, timeout_s: int):
    from torchrec.distributed.planner import EmbeddingShardingPlanner

    topo = torchrec_topology(topology, world, batch)
    planner = EmbeddingShardingPlanner(topology=topo, batch_size=batch, constraints=constraints_for(workload), debug=False,
                                       timeout_seconds=timeout_s)
    t0 = time.perf_counter()
    plan = planner.plan(build_module(workload), sharders())
    return plan, time.perf_counter() - t0


def plan_summary(sharding_plan) -> dict:
    """What rating needs of a ShardingPlan, as JSON: per table its sharding type, ranks and column width."""
    out = {}
    for mod in sharding_plan.plan.values():
        for name, ps in mod.items():
            width = int(ps.sharding_spec.shards[0].shard_sizes[1]) if ps.sharding_type == "column_wise" else None
            rr = [] if ps.sharding_type in ("row_wise", "data_parallel") else list(ps.ranks or [])
            out[name] = [ps.sharding_type, rr, width]
    return out


def _torchrec_child(workload, topo_name: str, world: int, batch: int, timeout_s: int, path: str) -> None:
    from coplan.spec import load_topology

    plan, wall = torchrec_plan(workload, load_topology(topo_name), world, batch, timeout_s)
    Path(path).write_text(json.dumps({"wall_s": wall, "plan": plan_summary(plan)}))


def random_tables(seed: int, num_tables: int):
    """A seeded random table set (mixed dims and pooling factors, a few sequence tables) behind a token
    dense part, 512 samples per rank."""
    from coplan.spec import Workload

    rng = __import__("numpy").random.default_rng(seed)
    seq = int(rng.integers(0, 5))
    gen = {"seed": seed, "num_tables": num_tables, "min_rows": int(10 ** rng.uniform(2, 4)), "max_rows": int(10 ** rng.uniform(6, 8.3)),
           "dims": [32, 64, 128, 256], "dim_weights": [0.2, 0.35, 0.3, 0.15], "pooling_mean": round(float(rng.uniform(2, 30)), 2),
           "pooling_sigma": round(float(rng.uniform(0.3, 1.5)), 3), "dtype": "fp16", "num_sequence_tables": seq,
           "sequence": "history" if seq else None}
    return Workload.model_validate({
        "name": f"random-tables-{seed}", "table_generator": gen,
        "sequences": [{"name": "history", "length": {"kind": "lognormal", "mean": 64, "sigma": 0.8, "max_len": 512}}] if seq else [],
        "blocks": [{"type": "dense_mlp", "num_dense_features": 8, "hidden_dims": [16], "out_tokens": 1},
                   {"type": "heads", "tasks": ["ctr"], "input_dim": 32, "hidden_dims": [8]}],
        "batch": {"local_batch_size": 512},
    })


def torchrec_plan_limited(workload, topo_name: str, world: int, batch: int, timeout_s: int, wall_limit_s: float, cache: Path) -> dict:
    """TorchRec's plan in a child process killed after ``wall_limit_s`` (its ``timeout_seconds`` only
    bounds the proposal loop, not the enumeration and estimation before it). The plan is cached as
    JSON so that coplan's side can be re-run against the same TorchRec plan."""
    import multiprocessing as mp

    wname = workload.name
    path = cache / f"{wname}@{world}.json"
    if path.exists():
        return {**json.loads(path.read_text()), "cached": str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)}
    cache.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    import resource

    ctx = mp.get_context("fork")
    proc = ctx.Process(target=_torchrec_child, args=(workload, topo_name, world, batch, timeout_s, str(tmp)))
    t0 = time.perf_counter()
    ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc.start()
    proc.join(wall_limit_s)
    killed = proc.is_alive()
    if killed:
        proc.kill()
        proc.join()
    ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    # the child's CPU time (a loaded machine stretches wall time, not this)
    cpu = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)
    if killed:
        return {"error": f"did not finish in {wall_limit_s:.0f} s wall (killed)", "wall_s": time.perf_counter() - t0, "cpu_s": cpu}
    if proc.exitcode != 0 or not tmp.exists():
        return {"error": f"TorchRec planner exited with code {proc.exitcode}", "wall_s": time.perf_counter() - t0, "cpu_s": cpu}
    tmp.replace(path)
    got = json.loads(path.read_text())
    got["cpu_s"] = cpu
    path.write_text(json.dumps(got))
    return got


def sparse_only(workload, batch: int):
    """The workload's tables behind a token dense part (one small MLP and one head), with ``batch``
    samples per rank: what both planners shard is the tables alone, on TorchRec's footing."""
    from coplan.spec import Workload

    data = workload.model_dump()
    dims = sorted({t.dim for t in workload.all_tables})
    data.update(name=f"{workload.name}-sparse", blocks=[
        {"type": "dense_mlp", "num_dense_features": 8, "hidden_dims": [16], "out_tokens": 1},
        {"type": "heads", "tasks": ["ctr"], "input_dim": dims[0], "hidden_dims": [8]},
    ], batch={"local_batch_size": batch, "micro_batches": 1})
    data.pop("sequences", None) if not any(t.feature_kind == "sequence" for t in workload.all_tables) else None
    return Workload.model_validate(data)


def coplan_plan(workload, topology, world: int, batch: int, dtime: float | None = None):
    """coplan's plan of the tables over one group of all ranks (as TorchRec plans them), made the way a
    user makes it: ``coplan plan --pin sparse_shard=<world>`` on the tables with a token dense part."""
    from coplan.planner.search import PlannerConfig, make_plan
    from coplan.planner.torchrec_export import to_torchrec

    t0 = time.perf_counter()
    w = sparse_only(workload, batch)
    cfg = PlannerConfig(world_size=world, pins={"sparse_shard": world}, **({"solve_dtime": dtime} if dtime else {}))
    plan, res = make_plan(w, topology, None, cfg)
    return to_torchrec(plan), time.perf_counter() - t0, plan


def coplan_prices(summary: dict, plan) -> dict:
    """A plan's tables as TorchRec's JSON summary (:func:`plan_summary`), priced by coplan's full pricer
    on ``plan``'s mesh, batch and dense part: TorchRec's plan judged by coplan's cost model (its step and
    whether it fits), so each planner is also rated by the other's estimator."""
    from coplan.costmodel import build_context, price
    from coplan.spec import TableShard

    group = plan.mesh.sparse_shard
    shards = []
    for t in plan.workload.all_tables:
        kind, ranks, _ = summary[t.name]
        rr = () if kind == "data_parallel" else tuple(range(group)) if kind == "row_wise" and not ranks else tuple(int(r) for r in ranks)
        shards.append(TableShard(table=t.name, sharding_type=kind, ranks=rr, compute_kernel="dense" if kind == "data_parallel" else "fused"))
    ctx = build_context(plan.workload, plan.topology, plan.mesh, plan.calibration, force_calibration=True)
    c = price(ctx, tuple(shards), plan.layers, plan.balancing, plan.kernels, detail=False)
    return {"step_ms": c.step_time_s * 1e3, "peak_memory_bytes": c.memory.total,
            "fits": c.memory.total <= c.hbm_capacity_bytes - c.hbm_reserve_bytes}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", default="dlrm-856,gem-1t")
    ap.add_argument("--worlds", default="64,512,4096")
    ap.add_argument("--topology", default="h200-superpod-4k")
    ap.add_argument("--dtime", type=float, default=None, help="coplan CP-SAT deterministic time per solve (default: coplan plan's)")
    ap.add_argument("--random", type=int, default=0, metavar="N",
                    help="instead of --workloads: N seeded random table sets (50-1,000 tables, mixed dims and pooling) at random "
                         "worlds of --worlds; the seed is taken at run time (or --seed) and reported")
    ap.add_argument("--seed", type=int, default=None, help="seed of --random (default: taken from the clock at run time)")
    ap.add_argument("--table-range", default="50,1000", help="tables per random set, min,max (default 50,1000)")
    ap.add_argument("--torchrec-timeout", type=int, default=300, help="TorchRec planner timeout_seconds (its proposal loop)")
    ap.add_argument("--torchrec-wall-limit", type=float, default=1800.0,
                    help="kill TorchRec's planner (enumeration and estimation included) after this many seconds")
    ap.add_argument("--torchrec-cache", default=str(RESULTS / "planner_torchrec_plans"),
                    help="folder of TorchRec's plans as JSON (reused when present)")
    ap.add_argument("--skip-torchrec", action="store_true", help="coplan's side only (TorchRec's from the cache or --previous)")
    ap.add_argument("--previous", default=None,
                    help="a previous result JSON: TorchRec figures for points with no cached plan are taken from it (and marked so)")
    ap.add_argument("-o", "--output", default=None,
                    help="default: benchmarks/results/planner_torchrec.json, or planner_torchrec_random.json with --random")
    args = ap.parse_args()
    if args.output is None:
        args.output = str(RESULTS / ("planner_torchrec_random.json" if args.random else "planner_torchrec.json"))
    from coplan.spec import load_topology, load_workload

    topology = load_topology(args.topology)
    args.commit = _git_commit()  # at the start: other commits may land while it runs
    prev = {}
    if args.previous:
        for r in json.loads(Path(args.previous).read_text())["rows"]:
            if "max_rank_perf_ms" in r.get("torchrec", {}):
                prev[(r["workload"], r["world_size"])] = r["torchrec"]
    rows = []
    if Path(args.output).exists():  # keep the points of an earlier run that this one does not redo
        old = json.loads(Path(args.output).read_text()).get("rows", [])
    else:
        old = []
    if args.random:
        import numpy as np

        args.seed = int(time.time()) % 2**31 if args.seed is None else args.seed
        _log(f"random table sets, seed {args.seed}")
        rng = np.random.default_rng(args.seed)
        worlds = [int(x) for x in args.worlds.split(",")]
        points = []
        lo, hi = (int(x) for x in args.table_range.split(","))
        for i in range(args.random):
            w = random_tables(int(rng.integers(0, 2**31 - 1)), int(rng.integers(lo, hi + 1)))
            points.append((w, int(rng.choice(worlds))))
    else:
        points = [(load_workload(wname), int(x)) for x in args.worlds.split(",") for wname in args.workloads.split(",")]
    for w, world in points:
            wname = w.name
            batch = w.batch.local(world)
            row = {"workload": wname, "world_size": world, "batch_per_rank": batch, "tables": len(w.all_tables),
                   "load_average_before": os.getloadavg()}
            _log(f"{wname} @ {world}: TorchRec planning...")
            cache = Path(args.torchrec_cache)
            cached = (cache / f"{wname}@{world}.json").exists()
            tr_summary = None
            try:
                if args.skip_torchrec and not cached:
                    if (wname, world) not in prev:
                        raise RuntimeError("no cached TorchRec plan and --skip-torchrec")
                    row["torchrec"] = {**prev[(wname, world)], "from_previous_run": args.previous}
                else:
                    got = torchrec_plan_limited(w, args.topology, world, batch, args.torchrec_timeout, args.torchrec_wall_limit, cache)
                    if "error" in got:
                        row["torchrec"] = got
                    else:
                        _log(f"{wname} @ {world}: rating TorchRec's plan...")
                        t0 = time.perf_counter()
                        rated = rate_plan(got["plan"], w, topology, world, batch)
                        tr_summary = got["plan"]
                        row["torchrec"] = {"wall_s": got["wall_s"], "cpu_s": got.get("cpu_s"), **rated, "kinds": _kinds(got["plan"]),
                                           "rating_s": time.perf_counter() - t0, **({"cached": got["cached"]} if "cached" in got else {})}
            except Exception as e:  # TorchRec raises PlannerError when nothing fits
                row["torchrec"] = {"error": f"{type(e).__name__}: {str(e)[:400]}"}
            _log(f"{wname} @ {world}: coplan planning...")
            try:
                c0 = time.process_time()
                cp, cp_s, cplan = coplan_plan(w, topology, world, batch, args.dtime)
                cpu = time.process_time() - c0
                _log(f"{wname} @ {world}: rating coplan's plan...")
                t0 = time.perf_counter()
                rated = rate_plan(cp, w, topology, world, batch)
                row["coplan"] = {"wall_s": cp_s, "cpu_s": cpu, **rated, "kinds": _kinds(cp), "rating_s": time.perf_counter() - t0,
                                 "solver_status": cplan.solver.status, "coplan_gap": cplan.solver.gap,
                                 "coplan_step_ms": cplan.predicted.step_time_s * 1e3}
                if tr_summary is not None:  # TorchRec's plan judged by coplan's cost model, on coplan's plan's mesh
                    row["torchrec"]["coplan_model"] = coplan_prices(tr_summary, cplan)
            except Exception as e:
                row["coplan"] = {"error": f"{type(e).__name__}: {str(e)[:400]}"}
            if "max_rank_shards" in row["coplan"]:
                # the judge's own floor for any plan: the tables on coplan's slowest rank cannot be
                # sharded into a smaller largest shard than this, whoever plans them
                try:
                    names = sorted({n for n, _, _ in row["coplan"]["max_rank_shards"][:3]})
                    lb = least_largest_shard(w, topology, world, batch, names)
                    row["any_plan_lower_bound"] = {"least_largest_shard": lb, "max_rank_perf_ms_at_least": max(v[1] for v in lb.values())}
                except Exception as e:
                    row["any_plan_lower_bound"] = {"error": f"{type(e).__name__}: {str(e)[:400]}"}
            if "max_rank_perf_ms" in row["torchrec"] and "max_rank_perf_ms" in row["coplan"]:
                row["coplan_vs_torchrec"] = row["torchrec"]["max_rank_perf_ms"] / row["coplan"]["max_rank_perf_ms"] - 1.0
            if "coplan_model" in row["torchrec"] and "coplan_step_ms" in row["coplan"]:
                row["coplan_vs_torchrec_by_coplan_model"] = row["torchrec"]["coplan_model"]["step_ms"] / row["coplan"]["coplan_step_ms"] - 1.0
            print(json.dumps({k: v for k, v in row.items()}), flush=True)
            rows.append(row)
            _write(args, _merge(old, rows))
    _write(args, _merge(old, rows))
    return 0


def _log(msg: str) -> None:
    print(f"[{datetime.now(timezone.utc).strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _merge(old: list[dict], new: list[dict]) -> list[dict]:
    done = {(r["workload"], r["world_size"]) for r in new}
    keep = [r for r in old if (r["workload"], r["world_size"]) not in done]
    order = {"dlrm-856": 0, "gem-1t": 1}
    return sorted(keep + new, key=lambda r: (r["world_size"], order.get(r["workload"], 9), r["workload"]))


def _write(args, rows) -> None:
    out = {
        "benchmark": "planner_torchrec", "created_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "load_average": os.getloadavg()},
        "command": " ".join([sys.executable.rsplit("/", 1)[-1], *sys.argv]), "git_commit": args.commit,
        "versions": _versions(), "topology": args.topology, "seed": getattr(args, "seed", None), "rows": rows,
        "metric": "TorchRec EmbeddingPerfEstimator + NoopPerfModel: max over ranks of summed shard perf (ms); lower is better",
    }
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(out, indent=1) + "\n")


def _kinds(sp) -> dict[str, int]:
    out: dict[str, int] = {}
    for kind, _, _ in (sp if isinstance(sp, dict) else plan_summary(sp)).values():
        out[kind] = out.get(kind, 0) + 1
    return out


def _git_commit() -> str | None:
    import subprocess

    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10).stdout.strip() or None
    except Exception:
        return None


def _versions() -> dict[str, str]:
    import importlib.metadata as md

    out = {}
    for p in ("torch", "torchrec", "fbgemm-gpu-cpu", "ortools", "coplan"):
        try:
            out[p] = md.version(p)
        except md.PackageNotFoundError:
            pass
    return out


if __name__ == "__main__":
    sys.exit(main())
