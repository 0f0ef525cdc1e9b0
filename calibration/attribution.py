"""Read Kineto (torch.profiler) traces and attribute measured time to the cost model's ops.

Attribution, per trace (one rank):

1. *Work units* are what took device time: GPU kernels (``cat: kernel``), linked to the CPU call that
   launched them through their ``correlation`` id; on a CPU-only trace, each ``cpu_op``'s self time
   (its duration less its children's) stands in for kernels.
2. A unit launched inside a ``record_function`` range named like a cost-model op
   (``<block>.<layer>.<op>``, ``sparse.tbe``...) belongs to that op's forward. If that range itself
   runs inside an autograd backward node, it is activation-checkpoint *recompute*.
3. A unit launched inside an autograd backward node (``evaluate_function: XBackward0``) belongs to
   the backward of the op whose forward created that node: backward nodes carry the forward op's
   ``Sequence number``, and forward ops are found inside their op range.
4. Kernel-name rules give each unit an op class (GEMM, attention, embedding TBE, elementwise, NCCL
   collective with its kind); NCCL kernels are always communication, whatever range they sit in.
5. Work the cost model prices outside its dense ops has names of its own: the optimizer's
   ``Optimizer.step#...`` range is ``optimizer.step`` (phase ``optimizer``); FSDP2's hooks
   (``FSDP::...``: parameter casts, gradient copies) are ``fsdp.hooks`` and TorchRec's input and output
   distribution ranges are ``sparse.dist``; the backward of an autograd op made inside such a range
   (FSDP2's cast of the forward inputs) belongs to it too. The cost model prices FSDP2's copies
   (``context.fsdp_copy_bytes``), not TorchRec's distribution on one GPU, which stays visible as its
   own row instead of vanishing into "unattributed". The trainer's gradient norm (``aten::_foreach_norm``
   outside any range) is the optimizer's.

On a GPU trace only the profiled steps count: a kernel belongs to the step whose host ``ProfilerStep#N``
range launched it (by correlation id), wherever it ran; a step's device window is the hull of its
device-side ``ProfilerStep#N`` annotations and of its kernels, and steps are counted by name (a side
stream gets its own annotation of the same step). Kernels the previous step left queued when the
profiler started fall outside. Memory copies and sets count as device work, and the GPU's *idle* time is attributed too: each gap on the device timeline (no kernel
running) goes to the unit that ended it, i.e. the launch the GPU was waiting for, as that op's
``idle_s``. A host-bound step is mostly such gaps; the calibration can then fit a per-launch cost
that includes the host's issue time instead of pretending the step is its kernels.

What cannot be attributed is reported as ``unattributed_s``, never dropped.
"""

from __future__ import annotations

import bisect
import re
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

from coplan.calibration.kineto import load_trace
from coplan.spec import TraceClassTimes

OP_NAME = re.compile(r"^[a-z][a-z0-9_]*(\.\d+)?\.[a-z][a-z0-9_]*$")
"""``<block>.<layer index>.<op>`` or ``<group>.<op>`` (``sparse.tbe``, ``fsdp.all_gather``)."""

_BWD_NODE = re.compile(r"^autograd::engine::evaluate_function: (\w+)")

# (pattern, class): first match wins. Collective kinds are reported as "collective:<kind>".
KERNEL_RULES: tuple[tuple[re.Pattern[str], str], ...] = tuple(
    (re.compile(p, re.I), c)
    for p, c in (
        # host<->device copies (input batches, metric read-backs) are transfers, not compute of an op
        (r"^Memcpy (HtoD|DtoH|HtoH|PtoP)", "transfer"),
        (r"^(Memcpy|Memset)", "elementwise"),
        (r"nccl.*(AllGather|all_gather)", "collective:all_gather"),
        (r"nccl.*(ReduceScatter|reduce_scatter)", "collective:reduce_scatter"),
        (r"nccl.*(AllReduce|all_reduce)", "collective:all_reduce"),
        (r"nccl.*(SendRecv|Send|Recv|AllToAll|all_to_all)", "collective:all_to_all"),
        (r"nccl", "collective:other"),
        # coplan's own Triton kernels (kernels/triton_attention.py) and the usual fused-attention names
        (r"(^_fwd_kernel|^_bwd_dq_kernel|^_bwd_dkdv_kernel|_block_counts_kernel|gdpa|jagged_attn|_attn_fwd|_attn_bwd|flash|fmha|attention|sdpa|flex_attention)", "attention"),
        (r"(split_embedding|embedding_bag|tbe|batched_embedding|bounds_check_indices|linearize_cache|embedding)", "embedding"),
        (r"(gemm|cutlass|xmma|nvjet|sm90_|sm80_|cublas|matmul|_mm_|addmm|\bmm\b|bmm|linear|scaled_mm)", "gemm"),
    )
)


def classify_kernel(name: str) -> str:
    """Op class of a kernel (or CPU op) name; ``elementwise`` when no rule matches."""
    for pattern, cls in KERNEL_RULES:
        if pattern.search(name):
            return cls
    return "elementwise"


@dataclass(frozen=True, slots=True)
class MeasuredOp:
    """Measured time of one op in one phase, summed over the trace's profiled steps."""

    name: str
    phase: str  # "fwd" | "bwd" | "recompute"
    time_s: float
    launches: int
    by_class: dict[str, float] = field(default_factory=dict)
    idle_s: float = 0.0
    """GPU idle time that ended with one of this op's units (the device waited for its launch)."""


@dataclass(frozen=True, slots=True)
class TraceAttribution:
    """What one rank's trace says, attributed to the cost model's op names."""

    path: str
    on_device: bool
    """GPU kernels were recorded (False: a CPU-only trace, top-level ops stand in for kernels)."""
    steps: int
    """Profiled steps (``ProfilerStep#N`` ranges; 1 when none were marked)."""
    ops: tuple[MeasuredOp, ...]
    by_class_s: dict[str, float]
    """Total time per kernel class, attributed or not."""
    total_s: float
    """All work-unit time in the trace."""
    unattributed_s: float
    """Work-unit time no op range or backward node claimed."""
    idle_s: float = 0.0
    """GPU idle time inside the profiled steps' device windows (0 on CPU traces or without windows)."""
    unattributed_idle_s: float = 0.0
    """Idle time ended by an unattributed unit, or left at the end of a step window."""
    window_s: float = 0.0
    """Summed length of the device-side profiled step windows (0 when the trace has none)."""
    device_units: int = 0
    """Device work units (kernels, memcpys, memsets) counted in the profiled steps (0 on CPU traces)."""
    unattributed_by_name: dict[str, float] = field(default_factory=dict)
    """Unattributed time per kernel (or CPU op) name, largest first (top 30): what to name next."""

    @property
    def attributed_share(self) -> float:
        return 1.0 - self.unattributed_s / self.total_s if self.total_s > 0 else 0.0

    def per_step(self, *, with_idle: bool = False) -> dict[tuple[str, str], float]:
        """Seconds per profiled step of each (op, phase); ``with_idle`` adds the GPU idle time each op ended."""
        return {(o.name, o.phase): (o.time_s + (o.idle_s if with_idle else 0.0)) / self.steps for o in self.ops}


class _Ranges:
    """Properly nested intervals on one thread, queried for the innermost one containing a time.

    Each range keeps a pointer to its enclosing range, so a query is a binary search plus a walk up
    the nesting (O(log n + depth)), not a scan back over every earlier range.
    """

    def __init__(self, items: Iterable[tuple[float, float, Any]]):
        self.items = sorted(items, key=lambda x: (x[0], -x[1]))
        self.starts = [s for s, _, _ in self.items]
        self.parent = [-1] * len(self.items)
        stack: list[int] = []
        for i, (s, e, _) in enumerate(self.items):
            while stack and self.items[stack[-1]][1] < s:
                stack.pop()
            self.parent[i] = stack[-1] if stack else -1
            stack.append(i)

    def innermost(self, t: float) -> Any | None:
        i = bisect.bisect_right(self.starts, t) - 1
        while i >= 0:
            s, e, payload = self.items[i]
            if s <= t <= e:
                return payload
            i = self.parent[i]
        return None


_OPTIMIZER_CPU_OPS = frozenset({"aten::_foreach_norm"})
"""CPU ops outside any named range whose kernels are the optimizer step's: the trainer's per-step
gradient norm (its non-finite check, priced with the optimizer as gradient clipping would be)."""

_TORCHREC_RANGE = re.compile(r"^(\[[a-z_]+\]_\[sparse|## .* ##$)")


def named_range(name: str) -> tuple[str, str] | None:
    """(op name, phase rule) for a ``record_function`` range that names work, else None.

    The rule is ``"op"`` for cost-model op ranges (forward, or recompute inside a backward node),
    ``"hook"`` for the step's other named work (FSDP2's hooks, TorchRec's distribution: forward or
    backward by where it ran) and ``"optimizer"`` for the optimizer (see the module docstring).
    """
    if OP_NAME.match(name):
        return name, "op"
    if name.startswith("Optimizer.step#") or name.startswith("Optimizer.zero_grad#"):
        return "optimizer.step", "optimizer"
    if name.startswith("FSDP::"):
        return "fsdp.hooks", "hook"
    if _TORCHREC_RANGE.match(name):
        return "sparse.dist", "hook"
    return None


@dataclass(slots=True)
class _Events:
    """A trace's complete (``ph: X``) events, sorted by what attribution does with them."""

    op_ranges: dict[Any, list] = field(default_factory=lambda: defaultdict(list))
    """Per thread: (start, end, (name, rule)) of the named ranges (:func:`named_range`)."""
    aux_ranges: dict[Any, list] = field(default_factory=lambda: defaultdict(list))
    """Per thread: CPU ops outside named ranges that belong to the optimizer."""
    bwd_nodes: dict[Any, list] = field(default_factory=lambda: defaultdict(list))
    """Per thread: (start, end, sequence number) of autograd backward nodes."""
    cpu_ops: dict[Any, list] = field(default_factory=lambda: defaultdict(list))
    fwd_seq_ops: list[tuple[Any, float, int]] = field(default_factory=list)
    """(thread, start, sequence number) of forward ops that recorded one for their backward."""
    launches: dict[Any, tuple[Any, float]] = field(default_factory=dict)
    """Correlation id -> (thread, time) of the runtime call that launched it."""
    kernels: list[dict] = field(default_factory=list)
    step_names: set[str] = field(default_factory=set)
    cpu_steps: list[tuple[float, float, str]] = field(default_factory=list)
    """Host ``ProfilerStep#N`` ranges, sorted by start."""
    gpu_steps: list[tuple[float, float, str]] = field(default_factory=list)
    cpu_starts: list[float] = field(default_factory=list)

    @property
    def on_device(self) -> bool:
        return any(k.get("cat") == "kernel" for k in self.kernels)

    def step_of_launch(self, t: float | None) -> str | None:
        """The host step range a launch at ``t`` falls in."""
        if t is None:
            return None
        i = bisect.bisect_right(self.cpu_starts, t) - 1
        return self.cpu_steps[i][2] if i >= 0 and self.cpu_steps[i][0] <= t <= self.cpu_steps[i][1] else None


def _collect(trace: dict[str, Any]) -> _Events:
    ev = _Events()
    for e in trace["traceEvents"]:
        if not isinstance(e, dict) or e.get("ph") != "X":
            continue
        cat, name = e.get("cat", ""), str(e.get("name", ""))
        ts, dur, tid = float(e.get("ts", 0.0)), float(e.get("dur", 0.0)), e.get("tid")
        args = e.get("args") or {}
        if cat == "user_annotation":
            if name.startswith("ProfilerStep#"):
                ev.step_names.add(name)
                ev.cpu_steps.append((ts, ts + dur, name))
            else:
                owner = named_range(name)
                if owner is not None:
                    ev.op_ranges[tid].append((ts, ts + dur, owner))
        elif cat == "gpu_user_annotation" and name.startswith("ProfilerStep#"):
            # a side stream's kernels give the same step a second device annotation: counted by name
            ev.step_names.add(name)
            ev.gpu_steps.append((ts, ts + dur, name))
        elif cat == "cpu_op":
            ev.cpu_ops[tid].append((ts, ts + dur, e))
            if name in _OPTIMIZER_CPU_OPS:
                ev.aux_ranges[tid].append((ts, ts + dur, ("optimizer.step", "optimizer")))
            m = _BWD_NODE.match(name)
            if m and "Sequence number" in args:
                ev.bwd_nodes[tid].append((ts, ts + dur, int(args["Sequence number"])))
            elif "Sequence number" in args and not name.startswith("autograd::"):
                ev.fwd_seq_ops.append((tid, ts, int(args["Sequence number"])))
        elif cat in ("cuda_runtime", "cuda_driver") and "correlation" in args:
            ev.launches[args["correlation"]] = (tid, ts)
        elif cat in ("kernel", "gpu_memcpy", "gpu_memset"):
            ev.kernels.append(e)
    ev.cpu_steps.sort()
    ev.cpu_starts = [a for a, _, _ in ev.cpu_steps]
    return ev


def _kernel_steps(ev: _Events) -> tuple[list[str | None], list[tuple[float, float]]]:
    """(the profiled step owning each kernel or None, the steps' merged device windows).

    A step owns the kernels its host range launched (by correlation), wherever they ran on the device;
    kernels without a launch in a step range (queued by the step before the profiler, or launched
    between steps) count only if they start inside a step's device annotation. A step's device window
    is the hull of its annotations and of its own kernels: the annotation alone can miss kernels the
    step launched (work for the next batch, issued ahead on the same stream, run after it), which left
    ~12% of a step's device work uncounted on the H200.
    """
    hull: dict[str, list[float]] = {}
    for a, b, n in ev.gpu_steps:
        h = hull.setdefault(n, [a, b])
        h[0], h[1] = min(h[0], a), max(h[1], b)
    kernel_step: list[str | None] = []
    for k in ev.kernels:
        corr = (k.get("args") or {}).get("correlation")
        owner_step = ev.step_of_launch(ev.launches[corr][1]) if corr in ev.launches else None
        kernel_step.append(owner_step)
        if owner_step is not None:
            a, b = float(k.get("ts", 0.0)), float(k.get("ts", 0.0)) + float(k.get("dur", 0.0))
            h = hull.setdefault(owner_step, [a, b])
            h[0], h[1] = min(h[0], a), max(h[1], b)
    # a trace without device step annotations has no windows: all its kernels count
    return kernel_step, (_merge([(a, b) for a, b in hull.values()]) if ev.gpu_steps else [])


def _seq_owners(ev: _Events, op_index: dict, hook_index: dict) -> dict[int, str]:
    """Forward sequence numbers -> the op range they ran in; an autograd op made inside a hook range
    (FSDP2's cast of the forward inputs) has its backward (the gradients' cast back) in that hook."""
    seq_name: dict[int, str] = {}
    for tid, ts, seq in ev.fwd_seq_ops:
        if seq in seq_name:
            continue
        idx = op_index.get(tid)
        owner = idx.innermost(ts) if idx else None
        if owner is not None and owner[1] == "op":
            seq_name[seq] = owner[0]
        elif owner is None and tid in hook_index:
            hook = hook_index[tid].innermost(ts)
            if hook is not None:
                seq_name[seq] = hook[0]
    return seq_name


_Unit = tuple[Any, float, float, str, "float | None"]
"""A work unit: (thread, launch time, duration, kernel name, device start or None on CPU traces)."""


def _device_units(ev: _Events, kernel_step: list[str | None], windows: list[tuple[float, float]]) -> list[_Unit]:
    units: list[_Unit] = []
    first_step = ev.cpu_steps[0][0] if ev.cpu_steps else None
    for k, owner_step in zip(ev.kernels, kernel_step):
        start = float(k.get("ts", 0.0))
        corr = (k.get("args") or {}).get("correlation")
        tid, ts = ev.launches.get(corr, (None, start))
        if windows and owner_step is None and (not _inside(windows, start) or (tid is not None and first_step is not None and ts < first_step)):
            continue  # queued by a step outside the profiled ones
        units.append((tid, ts, float(k.get("dur", 0.0)), str(k.get("name", "")), start))
    return units


def _cpu_units(ev: _Events) -> list[_Unit]:
    """Every CPU op's *self* time (its duration less its direct children's) as a unit at its own start,
    so nested work (a checkpoint's recompute inside a backward node) is attributed to the innermost
    range it ran in, and the units add up to the busy time exactly."""
    units: list[_Unit] = []
    for tid, ops in ev.cpu_ops.items():
        ops.sort(key=lambda x: (x[0], -x[1]))
        child_time = [0.0] * len(ops)
        stack: list[int] = []
        for i, (s_, e_, _) in enumerate(ops):
            while stack and ops[stack[-1]][1] < s_:
                stack.pop()
            if stack:
                child_time[stack[-1]] += e_ - s_
            stack.append(i)
        for (s_, e_, ev_), kids in zip(ops, child_time):
            name = str(ev_.get("name", ""))
            if name.startswith("ProfilerStep"):
                continue
            self_us = max(0.0, (e_ - s_) - kids)
            if self_us > 0:
                units.append((tid, s_, self_us, name, None))
    return units


def _idle_gaps(units: list[_Unit], windows: list[tuple[float, float]]) -> tuple[list[float], float]:
    """(per unit, the GPU idle time it ended inside a window; idle time at the windows' ends and in
    windows no unit ran in)."""
    gap_before = [0.0] * len(units)
    tail_idle = 0.0
    if not windows:
        return gap_before, tail_idle
    order = sorted(range(len(units)), key=lambda i: units[i][4])
    w, busy_to = -1, 0.0
    for i in order:
        start, dur = units[i][4], units[i][2]
        wi = _window_of(windows, start)
        if wi != w:
            if w >= 0:
                tail_idle += max(0.0, windows[w][1] - busy_to)
            w, busy_to = wi, windows[wi][0]
        gap_before[i] = max(0.0, start - busy_to)
        busy_to = max(busy_to, start + dur)
    if w >= 0:
        tail_idle += max(0.0, windows[w][1] - busy_to)
    seen = {_window_of(windows, units[i][4]) for i in order}
    tail_idle += sum(b - a for j, (a, b) in enumerate(windows) if j not in seen)
    return gap_before, tail_idle


@dataclass(frozen=True, slots=True)
class _Owners:
    """Who a unit launched at a time on a thread belongs to (see the module docstring, rules 2-5)."""

    op: dict[Any, _Ranges]
    hook: dict[Any, _Ranges]
    bwd: dict[Any, _Ranges]
    aux: dict[Any, _Ranges]
    seq_name: dict[int, str]

    @classmethod
    def of(cls, ev: _Events) -> "_Owners":
        # cost-model op ranges win over hook ranges (TorchRec's "[lookup]" sits inside "sparse.tbe")
        op = {tid: _Ranges([x for x in r if x[2][1] != "hook"]) for tid, r in ev.op_ranges.items()}
        hook = {tid: _Ranges([x for x in r if x[2][1] == "hook"]) for tid, r in ev.op_ranges.items()}
        return cls(op, hook, {tid: _Ranges(r) for tid, r in ev.bwd_nodes.items()},
                   {tid: _Ranges(r) for tid, r in ev.aux_ranges.items()}, _seq_owners(ev, op, hook))

    def owner(self, tid: Any, ts: float) -> tuple[str, str] | None:
        rng = self.op[tid].innermost(ts) if tid in self.op else None
        if rng is None and tid in self.hook:
            rng = self.hook[tid].innermost(ts)
        bwd = self.bwd[tid].innermost(ts) if tid in self.bwd else None
        if rng is not None:
            name, rule = rng
            if rule == "op":
                # a cost-model op range inside a backward node is activation-checkpoint recompute
                return name, ("recompute" if bwd is not None else "fwd")
            if rule == "hook":
                return name, ("bwd" if bwd is not None else "fwd")
            return name, rule
        if bwd is not None and bwd in self.seq_name:
            return self.seq_name[bwd], "bwd"
        if bwd is None and tid in self.aux:
            return self.aux[tid].innermost(ts)
        return None


def attribute(trace: dict[str, Any], path: str = "<trace>") -> TraceAttribution:
    """Attribute a loaded trace's work to op names and phases (see module docstring)."""
    ev = _collect(trace)
    on_device = ev.on_device
    windows: list[tuple[float, float]] = []
    if on_device:
        kernel_step, windows = _kernel_steps(ev)
        units = _device_units(ev, kernel_step, windows)
    else:
        units = _cpu_units(ev)
    gap_before, tail_idle = _idle_gaps(units, windows)
    owners = _Owners.of(ev)

    acc: dict[tuple[str, str], list] = {}
    by_class: dict[str, float] = defaultdict(float)
    lost: dict[str, float] = defaultdict(float)
    total = unattributed = un_idle = 0.0
    for (tid, ts, dur, kname, _), gap in zip(units, gap_before):
        cls = classify_kernel(kname)
        by_class[cls] += dur
        total += dur
        owner = owners.owner(tid, ts)
        if owner is None:
            unattributed += dur
            un_idle += gap
            lost[kname[:120]] += dur
            continue
        slot = acc.setdefault(owner, [0.0, 0, defaultdict(float), 0.0])
        slot[0] += dur
        slot[1] += 1
        slot[2][cls] += dur
        slot[3] += gap
    ops = tuple(
        MeasuredOp(name=n, phase=p, time_s=v[0] * 1e-6, launches=v[1], by_class={k: t * 1e-6 for k, t in v[2].items()},
                   idle_s=v[3] * 1e-6)
        for (n, p), v in sorted(acc.items())
    )
    top_lost = dict(sorted(lost.items(), key=lambda kv: -kv[1])[:30])
    return TraceAttribution(
        path=path,
        on_device=on_device,
        steps=max(len(ev.step_names), 1),
        ops=ops,
        by_class_s={k: v * 1e-6 for k, v in sorted(by_class.items())},
        total_s=total * 1e-6,
        unattributed_s=unattributed * 1e-6,
        idle_s=(sum(gap_before) + tail_idle) * 1e-6,
        unattributed_idle_s=(un_idle + tail_idle) * 1e-6,
        window_s=sum(b - a for a, b in windows) * 1e-6,
        device_units=len(units) if on_device else 0,
        unattributed_by_name={k: v * 1e-6 for k, v in top_lost.items()},
    )


def _merge(windows: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Sorted, non-overlapping windows (a step's device window can touch the next one's)."""
    out: list[tuple[float, float]] = []
    for a, b in sorted(windows):
        if out and a < out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _window_of(windows: list[tuple[float, float]], t: float) -> int:
    i = bisect.bisect_right(windows, (t, float("inf"))) - 1
    return max(i, 0)


def _inside(windows: list[tuple[float, float]], t: float) -> bool:
    i = bisect.bisect_right(windows, (t, float("inf"))) - 1
    return i >= 0 and windows[i][0] <= t <= windows[i][1]


def attribute_file(path: str | Path) -> TraceAttribution:
    return attribute(load_trace(path), str(path))


MAX_CLASS_TRACES = 8
"""Most rank traces :func:`trace_class_times` attributes (the first, the last and evenly spaced others)."""


def trace_class_times(trace_paths: Sequence[Path]) -> TraceClassTimes | None:
    """Device seconds per step by op class and collective (``comm:<kind>``) of a run's rank traces (in rank
    order), for at most :data:`MAX_CLASS_TRACES` of them; None without traces."""
    if not trace_paths:
        return None
    n_read = min(MAX_CLASS_TRACES, len(trace_paths))
    ranks = sorted(set(np.linspace(0, len(trace_paths) - 1, n_read).round().astype(int).tolist()))
    measured: dict[str, list[float]] = {}
    unattr: list[float] = []
    on_device = True
    for n, i in enumerate(ranks):
        a = attribute_file(trace_paths[i])
        on_device = on_device and a.on_device
        for cls, t in a.by_class_s.items():
            key = cls.replace("collective:", "comm:")
            measured.setdefault(key, [0.0] * len(ranks))[n] = t / a.steps
        unattr.append(a.unattributed_s / a.steps)
    return TraceClassTimes(measured, unattr, tuple(ranks), on_device)


__all__ = ["KERNEL_RULES", "MAX_CLASS_TRACES", "OP_NAME", "MeasuredOp", "TraceAttribution", "attribute", "attribute_file",
           "classify_kernel", "named_range", "trace_class_times"]
