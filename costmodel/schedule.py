"""Overlap: a two-stream, in-order schedule of one step's compute and communication.

Each rank runs one compute stream and one communication stream. Tasks are issued in program order;
a task starts when its stream is free and the tasks it depends on have finished (FSDP prefetch is
a dependency of the all-gather of layer ``i+1`` on the *start* of layer ``i``, written as the end of
layer ``i−1``). Communication tasks share one stream because they share the links. Compute that runs
beside communication that uses SMs is slowed by the SM-contention factor: the schedule is run once,
each compute task is lengthened by ``κ ×`` its overlap with SM-using collectives, and run again.

Exposed communication is the time the compute stream sits idle inside a collective's interval; it
is attributed to that collective, so the exposed parts add up to ``step − compute`` exactly.
"""

from __future__ import annotations

from dataclasses import dataclass, field

COMPUTE, COMM = 0, 1


@dataclass(slots=True)
class Task:
    name: str
    stream: int
    duration: float
    deps: tuple[int, ...]
    phase: str
    layer: str
    sm: bool = False
    """Communication that occupies SMs (slows concurrent compute)."""
    meta: object = None


@dataclass(slots=True)
class Schedule:
    tasks: list[Task] = field(default_factory=list)
    start: list[float] = field(default_factory=list)
    end: list[float] = field(default_factory=list)
    exposed: list[float] = field(default_factory=list)
    makespan: float = 0.0

    def add(self, name: str, stream: int, duration: float, deps=(), *, phase: str = "fwd", layer: str = "", sm: bool = False, meta=None) -> int:
        self.tasks.append(Task(name, stream, max(0.0, float(duration)), tuple(d for d in deps if d is not None and d >= 0), phase, layer, sm, meta))
        return len(self.tasks) - 1

    def _pass(self) -> None:
        free = [0.0, 0.0]
        n = len(self.tasks)
        start = [0.0] * n
        end = [0.0] * n
        for i, t in enumerate(self.tasks):
            s = free[t.stream]
            for d in t.deps:
                e = end[d]
                if e > s:
                    s = e
            start[i] = s
            end[i] = s + t.duration
            free[t.stream] = end[i]
        self.start, self.end = start, end
        self.makespan = max(end) if end else 0.0

    def run(self, sm_contention: float) -> "Schedule":
        self._pass()
        if sm_contention > 0:
            comm = [(self.start[i], self.end[i]) for i, t in enumerate(self.tasks) if t.stream == COMM and t.sm and t.duration > 0]
            if comm:
                changed = False
                j0 = 0
                for i, t in enumerate(self.tasks):
                    if t.stream != COMPUTE or t.duration <= 0:
                        continue
                    a, b = self.start[i], self.end[i]
                    ov = 0.0
                    while j0 < len(comm) and comm[j0][1] <= a:
                        j0 += 1
                    j = j0
                    while j < len(comm) and comm[j][0] < b:
                        ov += max(0.0, min(b, comm[j][1]) - max(a, comm[j][0]))
                        j += 1
                    if ov > 0:
                        t.duration += sm_contention * ov
                        changed = True
                if changed:
                    self._pass()
        self._attribute()
        return self

    def _attribute(self) -> None:
        """Exposed time of each comm task = compute-stream idle time inside its interval."""
        busy = [(self.start[i], self.end[i]) for i, t in enumerate(self.tasks) if t.stream == COMPUTE and t.duration > 0]
        gaps = []
        cur = 0.0
        for a, b in busy:
            if a > cur:
                gaps.append((cur, a))
            cur = max(cur, b)
        if self.makespan > cur:
            gaps.append((cur, self.makespan))
        exposed = [0.0] * len(self.tasks)
        g0 = 0
        for i, t in enumerate(self.tasks):
            if t.stream != COMM or t.duration <= 0:
                continue
            a, b = self.start[i], self.end[i]
            while g0 < len(gaps) and gaps[g0][1] <= a:
                g0 += 1
            j = g0
            e = 0.0
            while j < len(gaps) and gaps[j][0] < b:
                e += max(0.0, min(b, gaps[j][1]) - max(a, gaps[j][0]))
                j += 1
            exposed[i] = e
        self.exposed = exposed


__all__ = ["COMM", "COMPUTE", "Schedule", "Task"]
