"""Where a run's profiled steps go, from rank 0's Kineto trace: the step's wall time, the GPU's busy and idle
time inside it, the host's forward / backward / rest with the launches each issued, and the kernel classes that
took the device's time. Used by the fresh-draw benchmark to say why a draw is slow.

A step is host-bound when the GPU sits idle for much of it (``gpu_idle_share``): the host issued its work
slower than the device ran it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from compile_host import union_length  # (the scripts run by path: benchmarks/ is on sys.path)
from coplan.calibration.attribution import attribute
from coplan.calibration.host_profile import host_profile
from coplan.calibration.kineto import load_trace
from coplan.spec import RunDir

_DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def device_busy(trace: dict[str, Any]) -> tuple[float, float, int]:
    """(seconds per step the device ran anything, seconds per step of the device-side step windows, kernels
    per step), over the ``ProfilerStep#N`` ranges on the GPU's timeline (or the host's when none)."""
    ev = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    def steps(cat: str) -> list[tuple[float, float]]:
        # one window per step: a step's annotation can stand on several streams (a short range on the side
        # stream of the input dist, the step's own on the compute stream), so each name keeps its longest range
        by: dict[str, tuple[float, float]] = {}
        for e in ev:
            name = str(e.get("name", ""))
            if e.get("cat") == cat and name.startswith("ProfilerStep#"):
                a, b = float(e["ts"]), float(e["ts"]) + float(e["dur"])
                if name not in by or b - a > by[name][1] - by[name][0]:
                    by[name] = (a, b)
        return sorted(by.values())

    windows = steps("gpu_user_annotation") or steps("user_annotation")
    if not windows:
        return 0.0, 0.0, 0
    work = [(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in ev if e.get("cat") in _DEVICE_CATS]
    busy = kernels = 0.0
    for a, b in windows:
        inside = [(max(a, x), min(b, y)) for x, y in work if y > a and x < b]
        busy += union_length(inside)
        kernels += len(inside)
    n = len(windows)
    return busy / n * 1e-6, sum(b - a for a, b in windows) / n * 1e-6, int(kernels / n)


def step_anatomy(run_dir: str | Path) -> dict[str, Any] | None:
    """Rank 0's profiled steps, per step; None when the run has no trace."""
    path = RunDir(run_dir).rank_trace(0)
    if path is None:
        return None
    trace = load_trace(path)
    busy, window, kernels = device_busy(trace)
    out: dict[str, Any] = {"trace": str(path), "device_window_s": window, "gpu_busy_s": busy,
                           "gpu_idle_share": 1.0 - busy / window if window > 0 else None, "kernels": kernels}
    try:
        hp = host_profile(trace, str(path))
        out["host"] = {"step_s": hp.step_s, "fwd_s": hp.fwd_s, "bwd_s": hp.bwd_s, "post_s": hp.post_s,
                       "launches": hp.launches, "fsdp_s": hp.fsdp_fwd_s + hp.fsdp_bwd_s,
                       "optimizer_s": hp.optimizer_s, "sparse_s": hp.sparse_s}
    except Exception as e:  # a trace of another shape: say so, keep the device figures
        out["host_error"] = str(e)[:200]
    try:
        att = attribute(trace, str(path))
        by = sorted(att.by_class_s.items(), key=lambda kv: -kv[1])
        out["device_by_class_s"] = {k: v / max(att.steps, 1) for k, v in by[:8]}
        n = max(att.steps, 1)
        out["unattributed_top"] = {k: v / n for k, v in list(att.unattributed_by_name.items())[:12]}
        out["unattributed_s"] = att.unattributed_s / n
        # per (op, phase) and kernel class, per step: the cost model's ops against their traced time
        out["ops"] = [{"name": o.name, "phase": o.phase, "time_s": o.time_s / n, "launches": o.launches / n,
                       "by_class_s": {k: v / n for k, v in o.by_class.items()}} for o in att.ops]
    except Exception as e:
        out["attribution_error"] = str(e)[:200]
    return out


def host_phases_line(phases: dict[str, float] | None) -> str:
    """The host's time per measured step by phase of the train loop (``summary.json`` ``host_phases``),
    largest first: ``"host per measured step 16.1 ms: forward 7.0, backward 5.2, optimizer 2.1, ..."``; empty without."""
    if not phases:
        return ""
    parts = ", ".join(f"{k} {v * 1e3:.1f}" for k, v in sorted(phases.items(), key=lambda kv: -kv[1]))
    return f"host per measured step {sum(phases.values()) * 1e3:.1f} ms: {parts}"


def verdict(anatomy: dict[str, Any] | None, measured_step_s: float | None = None,
            host_phases: dict[str, float] | None = None) -> str:
    """One line: where the step goes. With ``measured_step_s`` (the run's p50 over its replayed steps) the
    device's idle share is of that step: the profiled steps run the dense arch eagerly when the run replays
    CUDA graphs (so that the trace names each op), and their host times are the eager ones; ``host_phases``
    (the run's ``summary.json`` ``host_phases``, over the measured steps) says where the measured steps' host
    time went."""
    ph = host_phases_line(host_phases)
    if not anatomy or not anatomy.get("device_window_s"):
        return "no trace" + (f"; {ph}" if ph else "")
    idle = anatomy.get("gpu_idle_share") or 0.0
    if measured_step_s:
        idle = max(0.0, 1.0 - anatomy["gpu_busy_s"] / measured_step_s)
        anatomy["gpu_idle_share_of_measured"] = idle
    h = anatomy.get("host", {})
    host = (f"; host fwd {h['fwd_s'] * 1e3:.1f} ms, bwd {h['bwd_s'] * 1e3:.1f} ms, rest {h['post_s'] * 1e3:.1f} ms, "
            f"{h['launches']:.0f} launches") if h else ""
    kind = "host-bound" if idle > 0.3 else "device-bound"
    of = measured_step_s if measured_step_s else anatomy["device_window_s"]
    return (f"{kind}: GPU busy {anatomy['gpu_busy_s'] * 1e3:.1f} of {of * 1e3:.1f} ms "
            f"({idle:.0%} idle), {anatomy['kernels']} kernels{host}" + (f"; {ph}" if ph else ""))
