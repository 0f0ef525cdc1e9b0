"""Where the host time of a compiled trainer step goes, against the eager step (issue 6, H5).

Reads the Kineto traces that ``benchmarks/train_h200.py`` wrote (one per case, two profiled steps
each) and prints, per case and per profiled step:

- the step's phases on the host: forward (main thread, from the step's start to the autograd
  thread's first event), backward (the autograd thread), the optimizer, and the rest;
- per thread: busy time, and the top host ops by inclusive and by self time (self = duration less
  the ops and CUDA runtime calls directly inside it; layer indices and Inductor's graph hashes folded);
- launches: how many, per phase, and the host time between consecutive launches (median, mean);
- the device's waits on the host: for every gap in the device's busy time, whether the work after
  it was launched only after the device had gone idle (a host-bound gap, charged to the phase that
  launched it) or earlier (a dependency: an event or a stream wait); and the launch-to-start lag of
  the device work over the step's time, in bins;
- the compiled machinery: Dynamo's cache lookup and region, AOTAutograd's ``CompiledFunction``
  (forward and backward), Inductor's graph call with its own self time (its Python wrapper), the
  Triton launcher ranges Inductor records per kernel (``triton_*``), the attention custom ops
  (``coplan::*``) against the eager ``autograd.Function`` path, FSDP2's hooks, TorchRec's ranges.

    python benchmarks/compile_host.py                  # the v5 traces -> benchmarks/results/compile_host.json
    python benchmarks/compile_host.py --cases triton,triton-compile --tag v5 --out /tmp/h.json

No torch import: it reads JSON only.
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
import re
import statistics
import sys
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import git_commit  # noqa: E402  (the scripts run by path)

RESULTS = Path(__file__).resolve().parent / "results"
# the v5 traces it was written for are kept with the benchmarks' history
TRACES = Path(__file__).resolve().parents[1] / "docs" / "benchmarks-log" / "results"
HOST_CATS = ("cpu_op", "user_annotation")
RUNTIME_CATS = ("cuda_runtime", "cuda_driver")
DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH = re.compile(r"LaunchKernel|cuLaunch|MemcpyAsync|MemsetAsync")

# the machinery each range belongs to (first match wins); "inclusive" sums may nest
MACHINERY = (
    ("dynamo cache lookup (guards)", r"^TorchDynamo Cache Lookup"),
    ("dynamo compiled region (total)", r"^Torch-Compiled Region"),
    ("aot CompiledFunction forward (total)", r"^CompiledFunction$"),
    ("aot CompiledFunctionBackward (total)", r"^CompiledFunctionBackward$"),
    ("inductor graph call (total)", r"^## Call CompiledFxGraph"),
    ("inductor triton launchers (total)", r"^triton_(poi|per|red|tem|for)_"),
    ("attention custom op fwd (total)", r"^coplan::jagged_(gdpa|softmax_attention)$"),
    ("attention custom op bwd (total)", r"^coplan::jagged_(gdpa|softmax_attention)_backward$"),
    ("attention autograd.Function fwd (total)", r"^_(Gdpa|Softmax)Function$"),
    ("attention autograd.Function bwd (total)", r"^_(Gdpa|Softmax)FunctionBackward$"),
    ("fsdp pre_forward (total)", r"^FSDP::pre_forward"),
    ("fsdp post_backward_reduce (total)", r"^FSDP::post_backward_reduce"),
    ("fsdp other hooks (total)", r"^FSDP::"),
    ("torchrec lookup (total)", r"^\[lookup\]"),
    ("torchrec dist/awaitables (total)", r"^\[(input|output)_dist|^## .*(Awaitable|all2all|jagged)"),
    ("optimizer step (total)", r"^Optimizer\.step"),
)


def fold(name: str) -> str:
    """Layer indices, graph hashes and step numbers folded, so that per-layer ranges add up."""
    name = re.sub(r"CompiledFxGraph \w+", "CompiledFxGraph <hash>", name)
    name = re.sub(r"\.\d+\.", ".*.", name)
    name = re.sub(r"Region: \d+/\d+", "Region: */*", name)
    name = re.sub(r"Backward\d+$", "Backward", name)
    return name[:90]


def _load(path: Path) -> tuple[list[dict], dict]:
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        raw = json.load(f)["traceEvents"]
    names = {}
    for e in raw:
        if e.get("ph") == "M" and e.get("name") == "thread_name":
            # Kineto can name a thread twice; keep the more telling one (pt_autograd_N)
            n = e.get("args", {}).get("name", "")
            if "autograd" in n or e.get("tid") not in names:
                names[e.get("tid")] = n
    return [e for e in raw if e.get("ph") == "X"], names


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _self_times(ops: list[dict], runtime: list[dict]) -> dict[int, float]:
    """Self time of each host op: its duration less the events directly inside it (same thread)."""
    out: dict[int, float] = {}
    by_tid: dict = {}
    for e in ops + runtime:
        by_tid.setdefault(e["tid"], []).append(e)
    for evs in by_tid.values():
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack: list[dict] = []
        for e in evs:
            while stack and stack[-1]["ts"] + stack[-1]["dur"] <= e["ts"]:
                stack.pop()
            if stack:
                parent = stack[-1]
                out[id(parent)] = out.get(id(parent), parent["dur"]) - e["dur"]
            out.setdefault(id(e), e["dur"])
            stack.append(e)
    return out


def union_length(spans: list[tuple[float, float]]) -> float:
    """Total length covered by the spans (overlaps counted once), in their unit."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def analyze_step(events: list[dict], names: dict, step: dict, top: int = 15) -> dict:
    lo, hi = step["ts"], step["ts"] + step["dur"]
    main = step["tid"]
    autograd = next((t for t, n in names.items() if "autograd" in (n or "")), None)
    host = [e for e in events if e.get("cat") in HOST_CATS and lo <= e["ts"] < hi and e is not step
            and not e["name"].startswith("ProfilerStep")]
    rt = [e for e in events if e.get("cat") in RUNTIME_CATS and lo <= e["ts"] < hi]
    corr = {e["args"]["correlation"]: e for e in rt if "correlation" in e.get("args", {})}
    dev = [e for e in events if e.get("cat") in DEVICE_CATS and e.get("args", {}).get("correlation") in corr]
    dev.sort(key=lambda e: e["ts"])

    # phases
    bwd = [e for e in host + rt if e["tid"] == autograd]
    bwd_lo = min((e["ts"] for e in bwd), default=hi)
    bwd_hi = max((e["ts"] + e["dur"] for e in bwd), default=hi)
    opt = [e for e in host if e["tid"] == main and e["name"].startswith("Optimizer.step")]
    opt_lo = min((e["ts"] for e in opt), default=hi)
    opt_hi = max((e["ts"] + e["dur"] for e in opt), default=hi)

    def phase(e: dict) -> str:
        if e["tid"] == autograd:
            return "backward"
        if opt_lo <= e["ts"] < opt_hi:
            return "optimizer"
        if e["ts"] < bwd_lo:
            return "forward"
        return "other (main thread after backward starts)"

    phases_ms = {"forward (step start -> backward start)": (bwd_lo - lo) / 1e3,
                 "backward (autograd thread first -> last event)": (bwd_hi - bwd_lo) / 1e3,
                 "optimizer step": (opt_hi - opt_lo) / 1e3 if opt else 0.0,
                 "step (host)": step["dur"] / 1e3}

    # per thread: busy, top inclusive, top self
    selfs = _self_times(host, rt)
    threads = {}
    for tid in sorted({e["tid"] for e in host}, key=str):
        mine = [e for e in host if e["tid"] == tid]
        incl: dict[str, list[float]] = {}
        slf: dict[str, float] = {}
        for e in mine:
            k = fold(e["name"])
            acc = incl.setdefault(k, [0.0, 0])
            acc[0] += e["dur"]
            acc[1] += 1
            slf[k] = slf.get(k, 0.0) + selfs.get(id(e), e["dur"])
        rt_mine = [e for e in rt if e["tid"] == tid]
        busy = union_length([(e["ts"], e["ts"] + e["dur"]) for e in mine + rt_mine])
        threads[str(tid)] = {
            "name": names.get(tid), "busy_ms": busy / 1e3,
            "runtime_calls_ms": sum(e["dur"] for e in rt_mine) / 1e3,
            "top_inclusive": [{"op": k, "ms": v[0] / 1e3, "calls": v[1]}
                              for k, v in sorted(incl.items(), key=lambda kv: -kv[1][0])[:top]],
            "top_self": [{"op": k, "ms": v / 1e3} for k, v in sorted(slf.items(), key=lambda kv: -kv[1])[:top]],
        }

    # launches and the host time between them
    launches = sorted((e for e in rt if LAUNCH.search(e["name"])), key=lambda e: e["ts"])
    gaps: dict[str, list[float]] = {}
    last: dict = {}
    for e in launches:
        p = phase(e)
        if e["tid"] in last:
            gaps.setdefault(p, []).append((e["ts"] - last[e["tid"]]) / 1e3)
        last[e["tid"]] = e["ts"]
    launch_gaps = {p: {"launches": len(g) + 1, "median_us": _pct(g, 0.5) * 1e3, "mean_us": statistics.fmean(g) * 1e3,
                       "p90_us": _pct(g, 0.9) * 1e3}
                   for p, g in gaps.items() if g}

    # device gaps: host-bound or dependency; launch -> start lag over the step
    idle: dict[str, float] = {}
    waits_dep = 0.0
    end = None
    lag_bins: dict[int, list[float]] = {}
    for d in dev:
        launch = corr[d["args"]["correlation"]]
        lag = d["ts"] - launch["ts"]
        lag_bins.setdefault(int((launch["ts"] - lo) // 5000), []).append(lag)
        if end is not None and d["ts"] > end:
            gap = d["ts"] - end
            if launch["ts"] + launch["dur"] >= end - 1.0:  # issued only once the device had drained
                idle[phase(launch)] = idle.get(phase(launch), 0.0) + gap
            else:
                waits_dep += gap
        end = max(end or d["ts"], d["ts"] + d["dur"])
    window = (end - dev[0]["ts"]) if dev else 0.0
    busy_dev = union_length([(d["ts"], d["ts"] + d["dur"]) for d in dev])
    lag_profile = [{"launch_at_ms": 5 * b, "launches": len(v), "median_lag_us": _pct(v, 0.5), "min_lag_us": min(v)}
                   for b, v in sorted(lag_bins.items())]

    # the machinery
    mach: dict[str, dict] = {}
    for e in host:
        label = next((m for m, pat in MACHINERY if re.search(pat, e["name"])), None)
        if label is None:
            continue
        acc = mach.setdefault(label, {"ms": 0.0, "self_ms": 0.0, "calls": 0, "runtime_ms": 0.0})
        acc["ms"] += e["dur"] / 1e3
        acc["self_ms"] += selfs.get(id(e), e["dur"]) / 1e3
        acc["calls"] += 1
    # runtime time (launch calls) inside each machinery's ranges, and the Python left over
    for label, pat in MACHINERY:
        if label not in mach:
            continue
        spans = [(e["tid"], e["ts"], e["ts"] + e["dur"]) for e in host if re.search(pat, e["name"])]
        inner = [r for r in rt if any(t == r["tid"] and a <= r["ts"] < b for t, a, b in spans)]
        mach[label]["runtime_ms"] = sum(r["dur"] for r in inner) / 1e3
        mach[label]["launches"] = sum(1 for r in inner if LAUNCH.search(r["name"]))
    return {
        "step": step["name"], "phases_ms": phases_ms, "threads": threads,
        "launches": len(launches), "launch_gaps_by_phase": launch_gaps,
        "device": {"busy_ms": busy_dev / 1e3, "window_ms": window / 1e3,
                   "host_bound_idle_ms_by_phase": {k: v / 1e3 for k, v in sorted(idle.items(), key=lambda kv: -kv[1])},
                   "dependency_idle_ms": waits_dep / 1e3,
                   "launch_to_start_lag_by_5ms_bin": lag_profile},
        "machinery": {k: {kk: round(vv, 4) if isinstance(vv, float) else vv for kk, vv in v.items()}
                      for k, v in mach.items()},
    }


def analyze(path: Path, top: int = 15) -> dict:
    events, names = _load(path)
    steps = sorted((e for e in events if e["name"].startswith("ProfilerStep#") and e.get("cat") == "user_annotation"),
                   key=lambda e: e["ts"])
    if not steps:
        raise ValueError(f"{path}: no ProfilerStep ranges on the host (was it written by the trainer's TraceWindow?)")
    per = [analyze_step(events, names, s, top) for s in steps]
    return {"trace": str(path), "steps": per, "mean": _mean(per)}


def _mean(per: list[dict]) -> dict:
    """Per-step means of the headline numbers (the steps differ; both are kept)."""
    n = len(per)

    def avg(get) -> float:
        vals = [get(p) for p in per]
        return sum(v for v in vals if v is not None) / n

    out = {"phases_ms": {k: avg(lambda p, k=k: p["phases_ms"][k]) for k in per[0]["phases_ms"]},
           "launches": avg(lambda p: p["launches"]),
           "device_busy_ms": avg(lambda p: p["device"]["busy_ms"]),
           "device_window_ms": avg(lambda p: p["device"]["window_ms"]),
           "dependency_idle_ms": avg(lambda p: p["device"]["dependency_idle_ms"])}
    phases = {k for p in per for k in p["device"]["host_bound_idle_ms_by_phase"]}
    out["host_bound_idle_ms_by_phase"] = {k: avg(lambda p, k=k: p["device"]["host_bound_idle_ms_by_phase"].get(k, 0.0))
                                          for k in sorted(phases)}
    tids = {t for p in per for t in p["threads"]}
    out["thread_busy_ms"] = {f"{t} {per[0]['threads'].get(t, {}).get('name')}":
                             avg(lambda p, t=t: p["threads"].get(t, {}).get("busy_ms", 0.0)) for t in sorted(tids)}
    labels = {k for p in per for k in p["machinery"]}
    out["machinery"] = {k: {f: avg(lambda p, k=k, f=f: p["machinery"].get(k, {}).get(f, 0.0))
                            for f in ("ms", "self_ms", "runtime_ms", "calls", "launches")} for k in sorted(labels)}
    gph = {k for p in per for k in p["launch_gaps_by_phase"]}
    out["launch_gaps_by_phase"] = {k: {f: avg(lambda p, k=k, f=f: p["launch_gaps_by_phase"].get(k, {}).get(f))
                                       for f in ("launches", "median_us", "mean_us")} for k in sorted(gph)}
    return out


def _print(case: str, r: dict) -> None:
    m = r["mean"]
    print(f"\n=== {case}: {r['trace']}")
    print("  phases (ms/step): " + ", ".join(f"{k} {v:.1f}" for k, v in m["phases_ms"].items()))
    print("  threads busy (ms/step): " + ", ".join(f"{k} {v:.1f}" for k, v in m["thread_busy_ms"].items()))
    print(f"  device busy {m['device_busy_ms']:.1f} ms in a {m['device_window_ms']:.1f} ms window; idle waiting on the "
          f"host: " + ", ".join(f"{k} {v:.1f}" for k, v in m["host_bound_idle_ms_by_phase"].items())
          + f"; dependency waits {m['dependency_idle_ms']:.1f}")
    print(f"  launches/step {m['launches']:.0f}; host time between launches: "
          + ", ".join(f"{k}: {v['launches']:.0f} launches, median {v['median_us']:.0f} us, mean {v['mean_us']:.0f} us"
                      for k, v in m["launch_gaps_by_phase"].items()))
    print("  machinery (ms/step: inclusive / self / runtime calls; calls; launches):")
    for k, v in sorted(m["machinery"].items(), key=lambda kv: -kv[1]["ms"]):
        print(f"    {k:42s} {v['ms']:7.2f} / {v['self_ms']:6.2f} / {v['runtime_ms']:5.2f}  {v['calls']:6.1f} {v['launches']:6.1f}")
    for tid, t in r["steps"][-1]["threads"].items():
        print(f"  {t['name']} (last profiled step), top self time:")
        for o in t["top_self"][:10]:
            print(f"    {o['ms']:6.2f} ms  {o['op']}")


SPEED_OPS = ("aten::empty", "aten::empty_strided", "aten::view", "aten::as_strided", "aten::detach", "aten::copy_",
             "cudaLaunchKernel", "cuLaunchKernelEx", "cudaMemcpyAsync")


def host_speed(path: Path) -> dict:
    """Median duration (us) of C++-only host ops that both cases run: the same op slower in one trace
    means a slower host (clock, contention), not more Python."""
    events, _ = _load(path)
    return {n: statistics.median(d) for n in SPEED_OPS if (d := [e["dur"] for e in events if e["name"] == n])}


def dispatch_bench(calls: int = 3000) -> dict:
    """Host us per call of the GDPA custom op under no_grad (as a compiled graph calls it), launches
    stubbed (CPU tensors; only the Python and dispatcher path is timed), custom_op's path against
    the direct dispatch of ``coplan.kernels.ops``."""
    import time

    import torch

    from coplan.kernels import ops, triton_attention as ta

    ta._launch = lambda *a, **k: None
    ops.attention_forward.__globals__["block_counts"] = lambda qo, ko: (qo, ko)
    ops.attention_backward.__globals__["block_counts"] = lambda qo, ko: (qo, ko)
    q, k, v, g = (torch.randn(4096, 4, 64) for _ in range(4))
    off = torch.arange(0, 4097, 256, dtype=torch.int32)
    fwd = lambda: torch.ops.coplan.jagged_gdpa.default(q, k, v, off, off, 256, 256, True, 0.125, 1 / 256, "silu")  # noqa: E731
    bwd = lambda: torch.ops.coplan.jagged_gdpa_backward.default(g, q, k, v, off, off, 256, 256, True, 0.125, 1 / 256, "silu")  # noqa: E731

    def us(f) -> float:
        for _ in range(200):
            f()
        best = float("inf")
        for _ in range(3):
            t = time.perf_counter()
            for _ in range(calls):
                f()
            best = min(best, (time.perf_counter() - t) / calls * 1e6)
        return best

    out = {}
    with torch.no_grad():
        ops.disable_direct_dispatch()
        out["custom_op_path_us"] = {"fwd": us(fwd), "bwd": us(bwd)}
        ops.enable_direct_dispatch()
        out["direct_dispatch_us"] = {"fwd": us(fwd), "bwd": us(bwd)}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cases", default="triton,triton-compile,triton-seq-whole")
    p.add_argument("--tag", default="v5", help="trace suffix: train_h200_trace_<case>_<tag>.json.gz")
    p.add_argument("--results", type=Path, default=TRACES, help="folder of the traces")
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--out", type=Path, default=RESULTS / "compile_host.json")
    p.add_argument("--dispatch", action="store_true", help="also time the custom op's host path here (imports torch)")
    args = p.parse_args(argv)
    out = {"benchmark": "compile_host", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
           "git_commit": git_commit(), "tag": args.tag, "cases": {}, "host_speed_median_us": {}}
    for case in args.cases.split(","):
        path = args.results / f"train_h200_trace_{case}_{args.tag}.json.gz"
        if not path.exists():
            print(f"{case}: no trace at {path}; skipped")
            continue
        out["cases"][case] = analyze(path, args.top)
        out["host_speed_median_us"][case] = host_speed(path)
        _print(case, out["cases"][case])
    print("\nhost speed (median us of the same C++ ops): " + json.dumps(out["host_speed_median_us"], indent=None))
    if args.dispatch:
        out["dispatch_micro_bench"] = dispatch_bench()
        print("custom op host path (us/call, launches stubbed): " + json.dumps(out["dispatch_micro_bench"]))
    dest = args.out
    dest.write_text(json.dumps(out, indent=1) + "\n")
    print(f"\nwrote {dest}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
