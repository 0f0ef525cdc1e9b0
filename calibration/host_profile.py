"""The host side of a trace's profiled steps: how the host's step splits into forward, backward and
the rest, the launches each issued, and how fast the host ran (for comparing runs on shared hosts)."""

from __future__ import annotations

import bisect
import math
import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from coplan.calibration.kineto import TraceError, load_trace


LAUNCH_CALLS: frozenset[str] = frozenset({"cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx",
                                          "cudaMemcpyAsync", "cudaMemsetAsync"})
"""Runtime and driver calls that put one unit of work on a stream (Triton launches through the driver)."""

HOST_SPEED_OPS: tuple[str, ...] = ("aten::mm", "aten::addmm", "aten::add_", "aten::mul", "aten::add", "aten::copy_",
                                   "aten::empty", "aten::view", "cudaLaunchKernel")
"""Host calls every run of the trainer makes many times whatever its shapes: the median host duration of
each measures how fast this host ran the same work (their dispatch does not depend on tensor sizes)."""

_FSDP_FWD = ("FSDP::root_pre_forward", "FSDP::pre_forward", "FSDP::post_forward", "FSDP::cast_forward_inputs")


@dataclass(frozen=True, slots=True)
class HostProfile:
    """The host side of a trace's profiled steps, per step (mean over them). On one GPU the trainer's
    forward and optimizer run on the main thread and its backward on the autograd engine's device thread,
    while the main thread waits: the host's step is forward + backward + what follows (``post``)."""

    steps: int
    step_s: float
    """Length of the main thread's ``ProfilerStep#N`` range."""
    fwd_s: float
    """From the step's start to the backward thread's first event."""
    bwd_s: float
    """The backward thread's first to last event in the step."""
    post_s: float
    """After the backward: gradient norm, optimizer, metrics."""
    launches_fwd: float
    launches_bwd: float
    launches_post: float
    fsdp_fwd_s: float
    """FSDP2's forward hooks (``FSDP::pre_forward`` and the root's, input casts)."""
    fsdp_bwd_s: float
    """FSDP2's post-backward (``RegisterPostBackwardFunctionBackward`` nodes, ``FSDP::pre_backward``)."""
    optimizer_s: float
    sparse_s: float
    """TorchRec's ``sparse.*`` ranges on the main thread (lookups and their input handling)."""
    op_median_us: dict[str, float] = field(default_factory=dict)
    """Median host duration of each of :data:`HOST_SPEED_OPS` (µs): the host's speed, for comparing runs."""

    @property
    def launches(self) -> float:
        return self.launches_fwd + self.launches_bwd + self.launches_post


def host_profile(trace: dict[str, Any], path: str = "<trace>") -> HostProfile:
    """Split each profiled step's host time into forward, backward and the rest, with the launches each
    issued and the time of FSDP2's hooks, the optimizer and TorchRec's ranges (a trace of
    ``coplan.trainer``: ``ProfilerStep#N`` ranges on the thread that drives the step)."""
    ev = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e and "ts" in e]
    host_cats = ("cpu_op", "user_annotation", "cuda_runtime", "cuda_driver")
    steps = [e for e in ev if e.get("cat") == "user_annotation" and str(e.get("name", "")).startswith("ProfilerStep#")]
    if not steps:
        raise TraceError(f"{path}: no host 'ProfilerStep#N' ranges: not a profiled trainer step")
    main_tid = steps[0].get("tid")
    host = sorted((e for e in ev if e.get("cat") in host_cats), key=lambda e: float(e["ts"]))
    starts = [float(e["ts"]) for e in host]
    acc: dict[str, float] = defaultdict(float)
    for st in steps:
        s0, s1 = float(st["ts"]), float(st["ts"]) + float(st["dur"])
        inside = host[bisect.bisect_left(starts, s0): bisect.bisect_left(starts, s1)]
        main = [e for e in inside if e.get("tid") == main_tid]
        others: dict[Any, int] = defaultdict(int)
        for e in inside:
            if e.get("tid") != main_tid:
                others[e.get("tid")] += 1
        bw_tid = max(others, key=others.get) if others else None  # the busiest other thread: autograd's
        bw = [e for e in inside if bw_tid is not None and e.get("tid") == bw_tid]
        b0 = min((float(e["ts"]) for e in bw), default=s1)
        b1 = max((float(e["ts"]) + float(e["dur"]) for e in bw), default=s1)
        acc["step"] += s1 - s0
        acc["fwd"] += b0 - s0
        acc["bwd"] += b1 - b0
        acc["post"] += max(0.0, s1 - b1)
        acc["l_fwd"] += sum(1 for e in main if e["name"] in LAUNCH_CALLS and float(e["ts"]) < b0)
        acc["l_post"] += sum(1 for e in main if e["name"] in LAUNCH_CALLS and float(e["ts"]) >= b1)
        acc["l_bwd"] += sum(1 for e in bw if e["name"] in LAUNCH_CALLS)
        acc["fsdp_fwd"] += sum(float(e["dur"]) for e in main if e["name"] in _FSDP_FWD)
        acc["fsdp_bwd"] += sum(float(e["dur"]) for e in bw if ("RegisterPostBackwardFunctionBackward" in e["name"]
                               and e["name"].startswith("autograd::engine")) or e["name"].startswith("FSDP::pre_backward"))
        acc["opt"] += sum(float(e["dur"]) for e in main if e["name"].startswith("Optimizer.step#"))
        acc["sparse"] += sum(float(e["dur"]) for e in main if e.get("cat") == "user_annotation"
                             and e["name"].startswith("sparse."))
    n = len(steps)
    durs: dict[str, list[float]] = defaultdict(list)
    for e in host:
        if e["name"] in HOST_SPEED_OPS:
            durs[e["name"]].append(float(e["dur"]))
    us = 1e-6 / n  # trace times are µs; per step, in seconds
    return HostProfile(
        steps=n, step_s=acc["step"] * us, fwd_s=acc["fwd"] * us, bwd_s=acc["bwd"] * us, post_s=acc["post"] * us,
        launches_fwd=acc["l_fwd"] / n, launches_bwd=acc["l_bwd"] / n, launches_post=acc["l_post"] / n,
        fsdp_fwd_s=acc["fsdp_fwd"] * us, fsdp_bwd_s=acc["fsdp_bwd"] * us, optimizer_s=acc["opt"] * us,
        sparse_s=acc["sparse"] * us, op_median_us={k: float(statistics.median(v)) for k, v in durs.items()},
    )


def host_profile_file(path: str | Path) -> HostProfile:
    return host_profile(load_trace(path), str(path))


def host_speed_index(profile: HostProfile, reference: dict[str, float]) -> float | None:
    """How much slower than ``reference`` (op name → median µs, e.g. another run's
    :attr:`HostProfile.op_median_us`) this host ran the same calls: the geometric mean of the ratios over
    the ops both have (1: as fast; 1.5: 50% slower). None when they share none."""
    common = [k for k in profile.op_median_us if reference.get(k, 0) > 0 and profile.op_median_us[k] > 0]
    if not common:
        return None
    return float(math.exp(sum(math.log(profile.op_median_us[k] / reference[k]) for k in common) / len(common)))


def host_reference_us(profiles: Sequence[HostProfile]) -> dict[str, float]:
    """The host speed of a set of runs: per call of :data:`HOST_SPEED_OPS` that every one of them made,
    the geometric mean of their median host durations (µs)."""
    ops = set.intersection(*(set(p.op_median_us) for p in profiles)) if profiles else set()
    return {k: float(np.exp(np.mean([np.log(p.op_median_us[k]) for p in profiles])))
            for k in sorted(ops) if all(p.op_median_us[k] > 0 for p in profiles)}


__all__ = ["HOST_SPEED_OPS", "LAUNCH_CALLS", "HostProfile", "host_profile", "host_profile_file", "host_reference_us",
           "host_speed_index"]
