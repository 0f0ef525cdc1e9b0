"""Multi-GPU validation (issue 11): ``gem-h200`` on 1 and N H200s of one host in one invocation, with
plans made by coplan's planner, run by the real trainer, and compared with the cost model.

Runs (each a ``python -m torch.distributed.run -m coplan.trainer.train`` job, NVLink multicast off),
every plan made by the planner (``coplan plan``, with ``--pin`` where a run needs a layout):

- ``1gpu``: the trainer benchmark's plan (``--gpus 1``, every table pinned table-wise: each table whole
  on the GPU, fused TBE; ``benchmarks/train_h200.py``), the baseline of the scaling ratio and what
  compute is calibrated on. The planner's own one-GPU plan is recorded beside it.
- ``Ngpu-planner``: the planner's plan for N GPUs of ``--topology``, weak scaling (the same per-GPU
  batch as the one-GPU run), pinned to one copy of the tables over every rank (``--pin
  sparse_replicate=1``) so that the run shards the tables across GPUs; the JSON records the planner's
  unrestricted choice beside it.
- ``Ngpu-forced``: only when the planner's plan has no expert parallelism or no table sharded across
  GPUs: ``--pin dp_shard=N --pin ep=N --pin sparse_replicate=1`` (EP over every rank when the experts
  divide) and every table pinned table-wise, placed by the planner.

The lent GPU machine has no OR-Tools: ``--plan-only --plans DIR`` makes every plan beforehand on any
machine, and ``--plans DIR`` runs them (a plan made for other inputs or pins is planned again).

Per run: step time p50 (warm-up and profiled steps left out), local MFU, samples/s; per NCCL kind the
kernel time per step on each rank, from the Kineto traces (``coplan.calibration.attribution`` kernel rules),
and how much of it no compute kernel overlapped (exposed). The scaling ratio is throughput per GPU at
N over that at 1 (samples/s and model FLOP/s both given).

Cost model: compute is calibrated on the one-GPU run (``coplan.calibration.calibrate``); with
``--collectives SWEEP.json`` the NVLink tier's latency and per-collective efficiencies are fitted to a
``benchmarks/collectives_h200.py`` sweep (``coplan.calibration.collective_fit``). Each N-GPU run is then
priced under the defaults, compute-calibrated, and fully calibrated, on the run's own measured history
lengths: predicted step time against measured, and predicted time per collective kind against the
traces.

    python benchmarks/multigpu_h200.py --plan-only --plans benchmarks/results/multigpu_plans      # anywhere, first
    python benchmarks/multigpu_h200.py --plans benchmarks/results/multigpu_plans \
        --collectives benchmarks/results/collectives_h200.json                                   # 2 H200s, ~4 min
    python benchmarks/multigpu_h200.py --device cpu --workload gem-tiny --steps 6 --warmup 2     # gloo smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from collections import Counter
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import git_commit, plan_command, planned, table_pins, wait_or_kill  # noqa: E402  (the scripts run by path)

NO_MULTICAST_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
"""Set in every process this script starts: the lent machines promise no NVLink multicast, and the
cost model prices NVLink without in-switch reduction."""

T0 = time.monotonic()


def stamp(msg: str) -> None:
    print(f"[{datetime.now(timezone.utc).strftime('%H:%M:%S')} +{time.monotonic() - T0:5.0f}s] {msg}", flush=True)




def versions() -> dict:
    out = {"python": platform.python_version()}
    for mod in ("torch", "triton", "torchrec", "fbgemm_gpu"):
        try:
            out[mod] = __import__(mod).__version__
        except Exception:
            pass
    try:
        import torch

        out["cuda"] = str(torch.version.cuda)
        if torch.cuda.is_available():  # no CUDA context here: the runs' summaries name the device
            out["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
            out["cuda_devices"] = str(torch.cuda.device_count())
    except Exception:
        pass
    return out


# ---------------------------------------------------------------------------------------------
# Plans
# ---------------------------------------------------------------------------------------------

def weak_scaled(workload, local_batch: int):
    """``workload`` with a fixed per-GPU batch (its global batch then grows with the GPU count)."""
    return workload.model_copy(update={"batch": workload.batch.model_copy(update={"local_batch_size": local_batch,
                                                                                   "global_batch_size": None})})


ONE_COPY = {"sparse_replicate": 1}
"""The pin of the ``Ngpu-planner`` run: one copy of the tables over every rank, so that the run exercises
the tables sharded across GPUs and their all-to-alls (the planner's unrestricted choice is recorded beside it)."""


def plan_cases(w1, wN, topo1, topoN, N: int) -> dict[str, tuple]:
    """Every plan the benchmark may run or record, as ``coplan plan`` makes it: key -> (workload,
    topology, world, pins, table pins, what it is)."""
    from coplan.spec.workload import MoEBlock

    moe = [b for b in wN.blocks if isinstance(b, MoEBlock)]
    ep = N if moe and all(b.num_experts % N == 0 for b in moe) else 1
    return {
        "1gpu": (w1, topo1, 1, {}, table_pins(w1), "the trainer benchmark's plan: every table whole on the GPU"),
        "1gpu-planner-choice": (w1, topo1, 1, {}, {}, "the planner's own one-GPU plan, recorded, not run"),
        f"{N}gpu-planner-unrestricted": (wN, topoN, N, {}, {}, "the planner's own plan, recorded, not run"),
        f"{N}gpu-planner": (wN, topoN, N, dict(ONE_COPY), {}, "the planner's plan with one copy of the tables over every rank"),
        f"{N}gpu-forced": (wN, topoN, N, {"dp_shard": N, "ep": ep, **ONE_COPY}, table_pins(wN),
                           "EP over every rank (when the experts divide), every table whole on one GPU"),
    }


def make_case_plan(key: str, cases: dict, plans_dir: Path | None):
    """The plan of ``cases[key]`` and its JSON facts (the ``coplan plan`` command included)."""
    w, topo, world, pins, tables, what = cases[key]
    plan = planned(key, w, topo, world, pins=pins, tables=tables, plans_dir=plans_dir, log=stamp)
    return plan, {"source": f"{plan_command(w, world, pins, tables)} ({what})", **plan_facts(plan)}


def plan_facts(plan) -> dict:
    m = plan.mesh
    spread = sorted({r for t in plan.tables for r in t.ranks})
    return {
        "mesh": {"dense_shard": m.dense_shard, "dense_replicate": m.dense_replicate, "expert_parallel": m.expert_parallel,
                 "sparse_shard": m.sparse_shard, "sparse_replicate": m.sparse_replicate},
        "tables_by_sharding": dict(Counter(t.sharding_type for t in plan.tables)),
        "ranks_holding_table_shards": spread,
        "recompute": [lp.name for lp in plan.layers if lp.recompute],
        "balancing": plan.balancing.policy, "attention": plan.kernels.attention,
        "predicted_step_ms": plan.predicted.step_time_s * 1e3 if plan.predicted else None,
    }


def needs_forced(plan, workload) -> list[str]:
    """What the plan lacks of what issue 11 asks to exercise on several GPUs."""
    from coplan.spec.workload import MoEBlock

    lacks = []
    moe = [b for b in workload.blocks if isinstance(b, MoEBlock)]
    if moe and plan.world_size > 1 and plan.mesh.expert_parallel < 2 and all(b.num_experts % plan.world_size == 0 for b in moe):
        lacks.append("expert parallelism")
    holders = {r for t in plan.tables for r in t.ranks if t.sharding_type != "data_parallel"}
    if workload.all_tables and len(holders) < 2:
        lacks.append("tables sharded across GPUs")
    return lacks


# ---------------------------------------------------------------------------------------------
# Running
# ---------------------------------------------------------------------------------------------

def launch(plan_path: Path, nproc: int, args, run_id: str, data: Path, timeout: float) -> dict:
    from coplan.spec import RunDir, load_plan

    run_dir = args.runs_root / run_id
    rd = RunDir(run_dir)
    if args.reuse and rd.summary_path.is_file():
        same = [load_plan(x).model_dump(mode="json", exclude={"created_utc"}) for x in (rd.plan_path, plan_path)]
        if same[0] == same[1]:
            stamp(f"{run_id}: reusing {run_dir}")
            return {"ok": True, "reused": True, "wall_s": 0.0, "run_dir": str(run_dir)}
        stamp(f"{run_id}: {run_dir} ran another plan; running again")
    if run_dir.exists():
        shutil.rmtree(run_dir)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", "-m", "coplan.trainer.train",
           str(plan_path), "--device", args.device, "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--runs-root", str(args.runs_root), "--run-id", run_id, "--data", str(data), "--no-progress",
           "--trace", f"{args.steps - args.trace_steps}:{args.steps}", "--checkpoint-every", "-1",
           "--log-every", str(args.steps)]
    env = dict(os.environ, **NO_MULTICAST_ENV)
    if args.device == "cpu":
        env.setdefault("OMP_NUM_THREADS", "1")  # 2 gloo ranks on a small CPU box; on GPU torchrun's default, as train_h200.py
    stamp(f"{run_id}: launching {nproc} rank(s), timeout {timeout:.0f} s")
    t0 = time.monotonic()
    log = args.runs_root / f"{run_id}.log"
    with log.open("w") as fh:
        proc = subprocess.Popen(cmd, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
        rc = wait_or_kill(proc, max(5.0, timeout))
    wall = time.monotonic() - t0
    text = log.read_text(errors="replace")
    tail = text[-4000:]
    # the first lines that say what went wrong, which torchrun's own traceback pushes out of the tail
    errors = [ln for ln in text.splitlines() if ln.startswith(("error:", "Traceback", "RuntimeError", "torch.", "ValueError"))
              or "Error:" in ln][:12]
    stamp(f"{run_id}: rc={rc} in {wall:.0f} s")
    if rc != 0:
        return {"ok": False, "returncode": rc, "wall_s": wall, "run_dir": str(run_dir), "error_lines": errors, "log_tail": tail,
                "log": str(log), "command": " ".join(cmd)}
    return {"ok": True, "wall_s": wall, "run_dir": str(run_dir), "command": " ".join(cmd)}


# ---------------------------------------------------------------------------------------------
# Measuring
# ---------------------------------------------------------------------------------------------

def _union(iv: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(iv):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _length(iv) -> float:
    return sum(b - a for a, b in iv)


def _intersection(x, y) -> float:
    i = j = 0
    tot = 0.0
    while i < len(x) and j < len(y):
        lo, hi = max(x[i][0], y[j][0]), min(x[i][1], y[j][1])
        if hi > lo:
            tot += hi - lo
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return tot


def nccl_profile(trace_path: Path) -> dict:
    """Per profiled step of one rank: NCCL kernel time and calls per collective kind, how much of the
    NCCL time no compute kernel overlapped, and the device-side step length."""
    from coplan.calibration.attribution import classify_kernel
    from coplan.calibration.kineto import load_trace

    events = [e for e in load_trace(trace_path).get("traceEvents", []) if e.get("ph") == "X"]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    steps = len({e["name"] for e in events if str(e.get("name", "")).startswith("ProfilerStep#")}) or 1
    units = kernels
    if not kernels:
        # CPU (gloo) smoke runs: no kernels; the host-side "gloo:<kind>" ranges and top-level CPU ops
        # stand in, so the comparison path runs end to end (their times say nothing about GPUs)
        units = [e for e in events if str(e.get("name", "")).startswith("gloo:")
                 or (e.get("cat") == "cpu_op" and str(e.get("name", "")).startswith("aten::"))]
    by_kind: dict[str, list[float]] = {}
    comm_iv, comp_iv = [], []
    for e in units:
        iv = (float(e["ts"]), float(e["ts"]) + float(e["dur"]))
        name = str(e["name"])
        cls = f"collective:{name[5:]}" if name.startswith("gloo:") else classify_kernel(name)
        if cls.startswith("collective"):
            kind = cls.split(":", 1)[1] if ":" in cls else "other"
            acc = by_kind.setdefault(kind, [0.0, 0])
            acc[0] += float(e["dur"])
            acc[1] += 1
            comm_iv.append(iv)
        else:
            comp_iv.append(iv)
    cu, pu = _union(comm_iv), _union(comp_iv)
    busy = _length(cu)
    overlap = _intersection(cu, pu)
    return {
        "on_device": bool(kernels), "source": "GPU kernels" if kernels else "host-side gloo ranges (CPU run)",
        "profiled_steps": steps,
        "by_kind_ms_per_step": {k: v[0] / steps / 1e3 for k, v in sorted(by_kind.items())},
        "calls_per_step": {k: v[1] / steps for k, v in sorted(by_kind.items())},
        "nccl_busy_ms_per_step": busy / steps / 1e3,
        "nccl_exposed_ms_per_step": (busy - overlap) / steps / 1e3,
        "compute_busy_ms_per_step": _length(pu) / steps / 1e3,
    }


def measure(run: dict, args, nproc: int) -> dict:
    from coplan.spec import RunDir

    rd = RunDir(run["run_dir"])
    run_dir = rd.path
    s = rd.result()
    lines = rd.metrics()
    measured = [x for x in lines if args.warmup <= x["step"] < args.steps - args.trace_steps]
    p50 = s.step_time.p50_s if s.step_time else None
    samples = sum(x["samples"] for x in measured) / max(1, len(measured))
    flops = sum(x["model_flops"] for x in measured) / max(1, len(measured))
    out = {
        "world_size": s.world_size, "device": s.device, "versions": s.versions,
        "step_time_ms": {k.removesuffix("_s"): v * 1e3 for k, v in s.step_time.model_dump().items()} if s.step_time else None,
        "measured_steps": [x["step"] for x in measured],
        "global_batch": samples, "local_batch": samples / nproc,
        "measured_local_mfu": s.measured_mfu,
        "samples_per_s_p50": samples / p50 if p50 else None,
        "samples_per_s_per_gpu_p50": samples / p50 / nproc if p50 else None,
        "model_tflop_per_s_per_gpu_p50": flops / p50 / nproc / 1e12 if p50 else None,
        "samples_per_s_summary": s.samples_per_s, "tokens_per_s": s.tokens_per_s,
        "peak_memory_gib": [m / 2**30 for m in s.peak_memory_bytes],
        "loss_first_last": [s.first_loss, s.final_loss], "notes": list(s.notes),
    }
    ranks = {}
    for k in range(nproc):
        tp = rd.trace_path(k)
        if not tp.is_file():
            continue
        try:
            ranks[str(k)] = nccl_profile(tp)
        except Exception as e:  # the step figures stand without the trace
            ranks[str(k)] = {"error": f"{type(e).__name__}: {e}"}
    out["nccl_by_rank"] = ranks
    ok = [r for r in ranks.values() if "by_kind_ms_per_step" in r]
    kinds = sorted({k for r in ok for k in r["by_kind_ms_per_step"]})
    # A collective kernel runs from when its rank arrives until the last rank does and the data moved:
    # the rank that arrived last waited least, so the minimum over ranks is the closest to the transfer.
    out["nccl_ms_per_step"] = {k: {"min_over_ranks": min(r["by_kind_ms_per_step"].get(k, 0.0) for r in ok),
                                   "mean_over_ranks": sum(r["by_kind_ms_per_step"].get(k, 0.0) for r in ok) / len(ok),
                                   "calls": ok[0]["calls_per_step"].get(k, 0.0)} for k in kinds}
    if ok:
        out["nccl_exposed_ms_per_step_max_rank"] = max(r["nccl_exposed_ms_per_step"] for r in ok)
    if args.save_traces and rd.trace_path(0).is_file():
        import gzip

        args.save_traces.mkdir(parents=True, exist_ok=True)
        dst = args.save_traces / f"multigpu_{run_dir.name}_rank0.json.gz"
        with rd.trace_path(0).open("rb") as f, gzip.open(dst, "wb") as g:
            shutil.copyfileobj(f, g)
        out["trace_saved"] = str(dst)
    return out


# ---------------------------------------------------------------------------------------------
# Predicting
# ---------------------------------------------------------------------------------------------

def _profiled_or_measured_moments(run_dir: Path, steps: list[int]) -> dict:
    from coplan.calibration.runs import measured_moments
    from coplan.spec import RunDir

    return measured_moments(RunDir(run_dir).metrics(), steps)


def price_plan(plan, calibration, moments: dict, topology=None) -> dict:
    """The pricer's answer for ``plan`` (on ``topology`` when given, e.g. with a fitted NVLink tier)
    under ``calibration``, on measured length moments: step, compute, exposed comm, per collective kind."""
    from coplan.costmodel.context import build_context
    from coplan.costmodel.pricer import price

    ctx = build_context(plan.workload, topology or plan.topology, plan.mesh, calibration, force_calibration=True)
    for seq, m in moments.items():
        if seq in ctx.moments:
            ctx.moments[seq] = m
    ctx.cache.clear()
    cost = price(ctx, plan.tables or None, plan.layers, plan.balancing, plan.kernels, detail=True)
    kinds: dict[str, dict[str, float]] = {}
    for c in cost.comms:
        d = kinds.setdefault(c.collective, {"time_ms": 0.0, "exposed_ms": 0.0, "calls": 0})
        d["time_ms"] += c.time_s * 1e3
        d["exposed_ms"] += min(c.exposed_s, c.time_s) * 1e3
        d["calls"] += c.calls
    return {
        "step_ms": cost.step_time_s * 1e3, "compute_ms": cost.compute_s * 1e3, "exposed_comm_ms": cost.exposed_comm_s * 1e3,
        "local_mfu": cost.local_mfu, "scaling_ratio": cost.scaling_ratio, "by_kind": kinds,
        "comms": [{"name": c.name, "collective": c.collective, "bytes": c.bytes, "time_ms": c.time_s * 1e3,
                   "exposed_ms": c.exposed_s * 1e3, "group_size": c.group_size} for c in cost.comms],
    }


def compare(pred: dict, meas: dict) -> dict:
    p50 = (meas.get("step_time_ms") or {}).get("p50")
    out = {"predicted_step_ms": pred["step_ms"], "measured_step_ms_p50": p50,
           "step_rel_error": (pred["step_ms"] - p50) / p50 if p50 else None,
           "predicted_exposed_comm_ms": pred["exposed_comm_ms"],
           "measured_nccl_exposed_ms_max_rank": meas.get("nccl_exposed_ms_per_step_max_rank")}
    per = {}
    for kind in sorted(set(pred["by_kind"]) | set(meas.get("nccl_ms_per_step", {}))):
        pk = pred["by_kind"].get(kind, {})
        mk = meas.get("nccl_ms_per_step", {}).get(kind, {})
        m = mk.get("min_over_ranks")
        per[kind] = {"predicted_ms": pk.get("time_ms"), "predicted_calls": pk.get("calls"),
                     "measured_ms_min_rank": m, "measured_ms_mean_rank": mk.get("mean_over_ranks"),
                     "measured_calls": mk.get("calls"),
                     "rel_error": (pk["time_ms"] - m) / m if pk.get("time_ms") is not None and m else None}
    out["by_kind"] = per
    return out


# ---------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", default="gem-h200")
    p.add_argument("--gpus", type=int, default=2, help="N: ranks of the multi-GPU runs")
    p.add_argument("--topology-1", default="h200-1gpu", help="topology of the one-GPU baseline")
    p.add_argument("--topology", default="h200-hgx-2gpu", help="topology the N-GPU plans are made for")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--trace-steps", type=int, default=2)
    p.add_argument("--data-batches", type=int, default=8, help="distinct global batches generated (steps cycle over them)")
    p.add_argument("--variants", default="auto", help="auto (planner, plus forced when the planner lacks EP or sharded tables), "
                                                       "or a comma list of planner, forced")
    p.add_argument("--collectives", type=Path, default=None, help="collective sweep JSON (benchmarks/collectives_h200.py) "
                                                                 "to fit the NVLink tier from")
    p.add_argument("--plans", type=Path, default=None, help="folder of planner plans (plan-<key>.json): used when there, "
                                                           "written there when made")
    p.add_argument("--plan-only", action="store_true", help="make the planner's plans into --plans, then stop (no torch run)")
    p.add_argument("--runs-root", type=Path, default=Path("runs/multigpu"))
    p.add_argument("--reuse", action="store_true", help="analyse existing run directories instead of running again")
    p.add_argument("--save-traces", type=Path, default=None, help="copy each run's rank-0 trace here (gzip)")
    p.add_argument("--timeout", type=float, default=290.0, help="seconds for the whole benchmark")
    p.add_argument("--run-timeout", type=float, default=150.0, help="seconds for one training run (start-up included)")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/multigpu_h200.json"))
    args = p.parse_args(argv)
    if args.plan_only and not args.plans:
        p.error("--plan-only needs --plans DIR")
    if args.steps - args.trace_steps <= args.warmup:
        p.error("need --steps > --warmup + --trace-steps (some steps must be measured)")
    deadline = time.monotonic() + args.timeout

    from coplan.spec import dump_spec, load_topology, load_workload
    from coplan.trainer.data import data_sha256, generate_dataset

    N = args.gpus
    res: dict = {
        "benchmark": "multi-GPU validation (issue 11)",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": "python benchmarks/multigpu_h200.py " + " ".join(argv),
        "git_commit": git_commit(), "versions": versions(),
        "host": {"hostname": platform.node(), "python": platform.python_version(), "cpus": os.cpu_count()},
        "env": NO_MULTICAST_ENV, "gpus": N, "device": args.device,
        "steps": args.steps, "warmup_steps": args.warmup, "trace_steps": args.trace_steps,
        "plans": {}, "runs": {}, "errors": [],
    }

    def save() -> None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(res, indent=1, default=str) + "\n")

    def record_error(where: str, e: BaseException) -> None:
        res["errors"].append({"where": where, "error": f"{type(e).__name__}: {str(e)[:2000]}"})
        stamp(f"ERROR in {where}: {type(e).__name__}: {str(e)[:500]}")
        save()

    w0 = load_workload(args.workload)
    topo1, topoN = load_topology(args.topology_1), load_topology(args.topology)
    local = w0.batch.local(1)
    w1, wN = weak_scaled(w0, local), weak_scaled(w0, local)
    res.update({"workload": w0.name, "local_batch": local, "topology_1": topo1.name, "topology_n": topoN.name})
    args.runs_root.mkdir(parents=True, exist_ok=True)

    # plans, every one made by the planner (coplan plan, with pins where a run needs a layout); the
    # planner needs OR-Tools, which the lent GPU machine lacks: --plans DIR takes the plans made
    # beforehand (--plan-only on any machine) and plans here only what is missing
    cases = plan_cases(w1, wN, topo1, topoN, N)
    want = args.variants.split(",") if args.variants != "auto" else ["planner"]
    plans: dict[str, tuple[object, int]] = {}
    lacks: list[str] = []
    try:
        plan, facts = make_case_plan("1gpu", cases, args.plans)
        plans["1gpu"] = (plan, 1)
        res["plans"]["1gpu"] = facts
    except Exception as e:
        record_error("plan (1 GPU)", e)
    try:
        res["plans"].setdefault("1gpu", {})["planner_choice_not_run"] = make_case_plan("1gpu-planner-choice", cases, args.plans)[1]
    except Exception as e:
        record_error("planner (1 GPU)", e)
    try:
        res["plans"]["planner_unrestricted_not_run"] = make_case_plan(f"{N}gpu-planner-unrestricted", cases, args.plans)[1]
    except Exception as e:
        record_error("planner (N GPUs, unrestricted)", e)
    try:
        pl, facts = make_case_plan(f"{N}gpu-planner", cases, args.plans)
        if "planner" in want:
            plans[f"{N}gpu-planner"] = (pl, N)
            res["plans"][f"{N}gpu-planner"] = facts
        lacks = needs_forced(pl, wN)
    except Exception as e:
        record_error("planner (N GPUs)", e)
        lacks = ["a planner plan (the planner failed)"]
    forced_name = f"{N}gpu-forced"
    if args.plan_only:  # the forced plan too: a run may fall back on it
        try:
            make_case_plan(forced_name, cases, args.plans)
        except Exception as e:
            record_error("forced plan", e)
        save()
        stamp(f"plans written to {args.plans}; --plan-only: stopping")
        return 0 if not res["errors"] else 1
    if "forced" in want or (args.variants == "auto" and lacks):
        try:
            fp, facts = make_case_plan(forced_name, cases, args.plans)
            plans[forced_name] = (fp, N)
            res["plans"][forced_name] = {**facts, "why": lacks or ["asked for"]}
        except Exception as e:
            record_error("forced plan", e)
    stamp("plans: " + ", ".join(f"{k} {v['mesh']}" for k, v in res["plans"].items() if "mesh" in v))
    save()

    # data: one dataset serves both (the data hash ignores the batch size)
    data = args.runs_root / "data" / f"{w0.name}-{data_sha256(w0)[:8]}"
    t0 = time.monotonic()
    if not (data / "dataset.json").is_file():
        n = wN.batch.global_(N) * args.data_batches
        generate_dataset(wN, data, n, seed=0, rows_per_file=n)
    res["data_generation_s"] = time.monotonic() - t0
    stamp(f"data ready in {res['data_generation_s']:.1f} s: {data}")

    # runs, the one-GPU baseline first (calibration and scaling need it)
    def run_one(name: str, plan, nproc: int) -> None:
        left = deadline - time.monotonic()
        if left < 30:
            res["runs"][name] = {"ok": False, "skipped": f"time budget: {left:.0f} s left"}
            stamp(f"{name}: skipped, {left:.0f} s left")
            return
        try:
            path = dump_spec(plan, args.runs_root / f"plan-{name}.json")
            run = launch(path, nproc, args, name, data, min(args.run_timeout, left - 10))
            if run["ok"]:
                run.update(measure(run, args, nproc))
                st = run.get("step_time_ms") or {}
                stamp(f"{name}: p50 {st.get('p50', float('nan')):.1f} ms, MFU {run['measured_local_mfu']:.1%}, "
                      f"{run.get('samples_per_s_per_gpu_p50') or 0:.0f} samples/s/GPU, NCCL "
                      + ", ".join(f"{k} {v['min_over_ranks']:.2f} ms" for k, v in run.get("nccl_ms_per_step", {}).items()))
            res["runs"][name] = run
        except Exception as e:
            res["runs"][name] = {"ok": False, "error": f"{type(e).__name__}: {e}"}
            record_error(f"run {name}", e)
        save()

    for name, (plan, nproc) in list(plans.items()):
        run_one(name, plan, nproc)
    if args.variants == "auto" and forced_name not in plans and not res["runs"].get(f"{N}gpu-planner", {}).get("ok"):
        # the planner's plan did not run: the forced variant still gives a multi-GPU measurement
        try:
            fp, facts = make_case_plan(forced_name, cases, args.plans)
            plans[forced_name] = (fp, N)
            res["plans"][forced_name] = {**facts, "why": ["the planner's plan did not run"]}
            run_one(forced_name, fp, N)
        except Exception as e:
            record_error("forced plan (fallback)", e)

    # scaling
    base = res["runs"].get("1gpu", {})
    res["scaling"] = {}
    for name, r in res["runs"].items():
        if name == "1gpu" or not r.get("ok") or not base.get("ok"):
            continue
        try:
            res["scaling"][name] = {
                "samples_per_s_per_gpu_ratio": r["samples_per_s_per_gpu_p50"] / base["samples_per_s_per_gpu_p50"],
                "model_flops_per_gpu_ratio": r["model_tflop_per_s_per_gpu_p50"] / base["model_tflop_per_s_per_gpu_p50"],
                "mfu_ratio": r["measured_local_mfu"] / base["measured_local_mfu"] if base["measured_local_mfu"] else None,
                "goal": 0.9,
            }
        except Exception as e:
            record_error(f"scaling {name}", e)

    # cost model: calibrate compute on the one-GPU run, the NVLink tier on the sweep, then predict
    cal_compute = cal_full = fit = None
    if base.get("ok"):
        try:
            from coplan.calibration.assemble import calibrate

            # host=True: the one-GPU step is host-bound (issue 6), so the per-launch host cost is fitted
            # to its measured step times too, as benchmarks/calibration_h200.py does
            try:
                cal_compute, _, _ = calibrate([base["run_dir"]], host=True)
                res["calibration_compute_options"] = {"host": True}
            except TypeError:  # a calibrate() without the host fit
                cal_compute, _, _ = calibrate([base["run_dir"]])
                res["calibration_compute_options"] = {"host": False}
            res["calibration_compute"] = cal_compute.model_dump(mode="json")
        except Exception as e:
            record_error("calibrate (1 GPU)", e)
    if args.collectives:
        try:
            from coplan.calibration.collective_fit import fit_sweep, load_sweep, merge_into_calibration

            fit = fit_sweep(load_sweep(args.collectives), topoN)
            res["collective_fit"] = fit.to_dict()
            cal_full = merge_into_calibration(fit, cal_compute)
        except Exception as e:
            record_error("collective fit", e)
    res["predictions"] = {}
    for name, (plan, nproc) in plans.items():
        r = res["runs"].get(name, {})
        if not r.get("ok"):
            continue
        out: dict = {}
        try:
            moments = _profiled_or_measured_moments(Path(r["run_dir"]), r["measured_steps"])
            out["moments"] = moments
            cases = [("default", None, None), ("compute_calibrated", cal_compute, None)]
            if fit is not None:
                from coplan.calibration.collective_fit import apply_to_topology

                cases.append(("calibrated", cal_full, apply_to_topology(plan.topology, fit) if nproc > 1 else None))
            for label, cal, topo in cases:
                if label != "default" and cal is None:
                    continue
                try:
                    pred = price_plan(plan, cal, moments, topo)
                    out[label] = {"prediction": {k: v for k, v in pred.items() if k != "comms"}, "vs_measured": compare(pred, r)}
                    if label in ("calibrated", "compute_calibrated"):
                        out[label]["comms"] = pred["comms"]
                    e = out[label]["vs_measured"]["step_rel_error"]
                    stamp(f"{name} [{label}]: predicted {pred['step_ms']:.1f} ms"
                          + (f" vs measured {r['step_time_ms']['p50']:.1f} ms ({e:+.1%})" if e is not None else ""))
                except Exception as e:
                    out[label] = {"error": f"{type(e).__name__}: {e}"}
                    record_error(f"predict {name} [{label}]", e)
        except Exception as e:
            record_error(f"predict {name}", e)
        res["predictions"][name] = out
    # Anchored on the one-GPU run: the cost model's predicted *increase* from 1 to N GPUs (communication,
    # its exposure, imbalance) added to the measured one-GPU step. This isolates the multi-GPU part of
    # the model from the compute calibration's own error, which the one-GPU run's row shows.
    p1 = res["predictions"].get("1gpu", {})
    for name, out in res["predictions"].items():
        if name == "1gpu":
            continue
        for label in ("default", "compute_calibrated", "calibrated"):
            a, b = out.get(label, {}).get("prediction"), p1.get(label, {}).get("prediction")
            if not a or not b or not base.get("step_time_ms"):
                continue
            m1, mN = base["step_time_ms"]["p50"], res["runs"][name]["step_time_ms"]["p50"]
            anchored = m1 + a["step_ms"] - b["step_ms"]
            out[label]["anchored_on_1gpu"] = {"predicted_step_ms": anchored, "measured_step_ms_p50": mN,
                                              "step_rel_error": (anchored - mN) / mN,
                                              "predicted_scaling_ratio": m1 / anchored, "measured_scaling_ratio": m1 / mN}
    # the headline figures, against issue 11's goals (scaling ratio >= 0.9, step time within 10%)
    summary: dict = {}
    for name, r in res["runs"].items():
        if not r.get("ok"):
            summary[name] = {"ok": False, "why": r.get("skipped") or (r.get("error_lines") or [r.get("error", "")])[:2]}
            continue
        row = {"step_p50_ms": (r.get("step_time_ms") or {}).get("p50"), "local_mfu": r.get("measured_local_mfu"),
               "samples_per_s_per_gpu": r.get("samples_per_s_per_gpu_p50")}
        if name in res["scaling"]:
            sc = res["scaling"][name]["samples_per_s_per_gpu_ratio"]
            row.update({"scaling_ratio": sc, "scaling_goal_met": sc >= 0.9})
        for label in ("default", "compute_calibrated", "calibrated"):
            e = res["predictions"].get(name, {}).get(label, {})
            if "vs_measured" in e:
                row[f"{label}_step_error"] = e["vs_measured"]["step_rel_error"]
            if "anchored_on_1gpu" in e:
                row[f"{label}_anchored_step_error"] = e["anchored_on_1gpu"]["step_rel_error"]
        summary[name] = row
    res["summary"] = summary
    res["wall_s"] = time.monotonic() - T0
    save()
    print(json.dumps(summary, indent=1, default=str), flush=True)
    stamp(f"wrote {args.out}")
    for name, s in res["scaling"].items():
        stamp(f"scaling {name}: {s['samples_per_s_per_gpu_ratio']:.3f} (samples/s per GPU), {s['model_flops_per_gpu_ratio']:.3f} (model FLOP/s per GPU)")
    return 0 if all(r.get("ok") for r in res["runs"].values()) and not res["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
