"""Overlap: an in-order schedule of one step's compute and communication on one rank.

The rank has one compute stream and one communication stream per network resource (the tier whose
links bound a collective: NVLink, the NIC/leaf, ...). Collectives bound by the same links queue
behind each other, because they would share those links' bandwidth; collectives bound by different
links run side by side (an FSDP all-gather inside the NVLink domain beside an HSDP all-reduce across
nodes). Tasks are issued in program order; a task starts when its stream is free and the tasks it
depends on have finished (FSDP prefetch is a dependency of the all-gather of layer ``i+1`` on the
*start* of layer ``i``, written as the end of layer ``i−1``).

Compute that runs beside communication that uses SMs is slowed by the SM-contention factor: the
schedule is run once, each compute task is lengthened by ``κ ×`` the time SM-using collectives run
beside it, and run again.

Exposed communication is the time the compute stream sits idle; each idle instant is shared equally
by the collectives running then, so the exposed parts add up to ``step − compute`` exactly. Compute
slowdown counts the union of SM-using collectives beside a task (two at once do not slow it twice).
"""

from __future__ import annotations

from dataclasses import dataclass, field

COMPUTE = "compute"
COMM = "comm"
"""Default communication stream (callers may pass any other stream name)."""


@dataclass(slots=True)
class Task:
    name: str
    stream: str
    duration: float
    deps: tuple[int, ...]
    phase: str
    layer: str
    sm: bool = False
    """Communication that occupies SMs (slows concurrent compute)."""
    meta: object = None
    form: tuple | None = None
    """The duration as (constant, ((variable, coefficient), ...)) in the planner's variables, for the
    tasks whose duration depends on the plan's table placement or recompute set (see
    :class:`coplan.costmodel.results.StepCut`); None: a constant."""

    @property
    def is_compute(self) -> bool:
        return self.stream == COMPUTE


@dataclass(slots=True)
class Schedule:
    tasks: list[Task] = field(default_factory=list)
    start: list[float] = field(default_factory=list)
    end: list[float] = field(default_factory=list)
    exposed: list[float] = field(default_factory=list)
    makespan: float = 0.0
    pred: list[int] = field(default_factory=list)
    """Per task, the task whose end set its start (its stream's previous task or a dependency; -1: none)."""
    base: list[float] = field(default_factory=list)
    """Per task, its duration before the SM-contention slowdown."""

    def add(self, name: str, stream: str, duration: float, deps=(), *, phase: str = "fwd", layer: str = "", sm: bool = False, meta=None,
            form=None) -> int:
        self.tasks.append(Task(name, stream, max(0.0, float(duration)), tuple(d for d in deps if d is not None and d >= 0), phase, layer, sm, meta,
                               form))
        return len(self.tasks) - 1

    def _pass(self) -> None:
        free: dict[str, float] = {}
        last: dict[str, int] = {}
        n = len(self.tasks)
        start = [0.0] * n
        end = [0.0] * n
        pred = [-1] * n
        for i, t in enumerate(self.tasks):
            s = free.get(t.stream, 0.0)
            p = last.get(t.stream, -1)
            for d in t.deps:
                e = end[d]
                if e > s:
                    s, p = e, d
            start[i] = s
            end[i] = s + t.duration
            pred[i] = p if s > 0 or p >= 0 else -1
            free[t.stream] = end[i]
            last[t.stream] = i
        self.start, self.end, self.pred = start, end, pred
        self.makespan = max(end) if end else 0.0

    def tail_paths(self) -> tuple[list[float], list[int]]:
        """Per task, the longest chain of tasks that can only start after it ends (its dependents and the
        tasks after it on its stream, transitively), as (length, next task on that chain; -1: none)."""
        n = len(self.tasks)
        succ: list[list[int]] = [[] for _ in range(n)]
        last: dict[str, int] = {}
        for i, t in enumerate(self.tasks):
            p = last.get(t.stream)
            if p is not None:
                succ[p].append(i)
            last[t.stream] = i
            for d in t.deps:
                succ[d].append(i)
        tail = [0.0] * n
        nxt = [-1] * n
        for i in range(n - 1, -1, -1):
            best, arg = 0.0, -1
            for j in succ[i]:
                v = self.tasks[j].duration + tail[j]
                if v > best:
                    best, arg = v, j
            tail[i], nxt[i] = best, arg
        return tail, nxt

    def path_through(self, i: int, tail_next: list[int]) -> list[int]:
        """A chain of tasks through task ``i``: the chain that set its start, ``i``, and its longest tail."""
        path = []
        j = self.pred[i]
        while j >= 0:
            path.append(j)
            j = self.pred[j]
        path.reverse()
        path.append(i)
        j = tail_next[i]
        while j >= 0:
            path.append(j)
            j = tail_next[j]
        return path

    def chain_ids(self, tail_next: list[int]) -> list[int]:
        """Per task, an id of its :meth:`path_through` chain: tasks of equal id have the same chain. The chain
        through ``j = tail_next[i]`` is the one through ``i`` where ``pred[j] == i`` (the chain that set ``j``'s
        start comes through ``i``, and ``j``'s tail is the rest of ``i``'s); each id is the first task of such a
        run of links. (Conversely, two tasks of one chain are joined by such links, so one chain has one id.)"""
        ids = list(range(len(self.tasks)))
        for j, p in enumerate(self.pred):
            if p >= 0 and tail_next[p] == j:
                ids[j] = ids[p]
        return ids

    def critical_path(self) -> list[int]:
        """The tasks of a longest chain ending at the makespan, last first: each task's start is the end
        of the next one in the list (a path of the DAG of dependencies and stream order)."""
        if not self.tasks:
            return []
        i = max(range(len(self.tasks)), key=lambda k: (self.end[k], k))
        path = []
        while i >= 0:
            path.append(i)
            i = self.pred[i]
        return path

    def _comm_intervals(self, sm_only: bool) -> list[tuple[float, float, int]]:
        out = [(self.start[i], self.end[i], i) for i, t in enumerate(self.tasks)
               if not t.is_compute and t.duration > 0 and (t.sm or not sm_only)]
        out.sort()
        return out

    def run(self, sm_contention: float) -> "Schedule":
        self.base = [t.duration for t in self.tasks]
        self._pass()
        if sm_contention > 0:
            union = _union([(s, e) for s, e, _ in self._comm_intervals(sm_only=True)])
            if union:
                changed = False
                j = 0
                # compute tasks run in issue order on one stream, so their intervals are sorted
                for i, t in enumerate(self.tasks):
                    if not t.is_compute or t.duration <= 0:
                        continue
                    a, b = self.start[i], self.end[i]
                    while j < len(union) and union[j][1] <= a:
                        j += 1
                    ov, k = 0.0, j
                    while k < len(union) and union[k][0] < b:
                        ov += min(b, union[k][1]) - max(a, union[k][0])
                        k += 1
                    if ov > 0:
                        t.duration += sm_contention * ov
                        changed = True
                if changed:
                    self._pass()
        self._attribute()
        return self

    def _attribute(self) -> None:
        """Split every compute-idle instant equally among the collectives running at that instant."""
        busy = _union([(self.start[i], self.end[i]) for i, t in enumerate(self.tasks) if t.is_compute and t.duration > 0])
        exposed = [0.0] * len(self.tasks)
        events: list[tuple[float, int, int]] = []  # (time, +1 start / -1 end, task)
        for s, e, i in self._comm_intervals(sm_only=False):
            events.append((s, 1, i))
            events.append((e, -1, i))
        events.sort()
        active: set[int] = set()
        bi = 0
        prev = 0.0
        for time, kind, i in events:
            if time > prev and active:
                # idle part of [prev, time]: its length minus the compute-busy time inside it
                idle = time - prev
                while bi < len(busy) and busy[bi][1] <= prev:
                    bi += 1
                k = bi
                while k < len(busy) and busy[k][0] < time:
                    idle -= min(time, busy[k][1]) - max(prev, busy[k][0])
                    k += 1
                if idle > 0:
                    share = idle / len(active)
                    for x in active:
                        exposed[x] += share
            prev = max(prev, time)
            if kind > 0:
                active.add(i)
            else:
                active.discard(i)
        self.exposed = exposed


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            if e > out[-1][1]:
                out[-1] = (out[-1][0], e)
        else:
            out.append((s, e))
    return out


__all__ = ["COMM", "COMPUTE", "Schedule", "Task"]
