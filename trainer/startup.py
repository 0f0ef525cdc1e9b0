"""Time to a run's first step, and where it went (``summary.json``'s ``startup``).

``coplan train`` stamps its own start in the workers' environment (:data:`LAUNCH_ENV`); a worker launched
otherwise counts from its process's start. The first step's compilation and autotuning are read from
TorchDynamo's and Triton's own timers.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import torch

from coplan.kernels import autotune_seconds
from coplan.spec import Startup

LAUNCH_ENV = "COPLAN_LAUNCH_T"
"""``time.time()`` when ``coplan train`` started (set by the CLI for its workers)."""


def _process_start() -> float:
    """This process's start (wall clock), from /proc; now where /proc is not there."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat") as f:
            boot = next(int(ln.split()[1]) for ln in f if ln.startswith("btime"))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return time.time()


def compile_seconds() -> float:
    """Seconds TorchDynamo spent compiling frames in this process (Inductor's work included)."""
    try:
        from torch._dynamo.utils import compilation_time_metrics
    except ImportError:
        return 0.0
    return float(sum(compilation_time_metrics.get("_compile.compile_inner", [])))


@dataclass
class StartupClock:
    t0: float
    """The launch (``coplan train``'s start, or this process's)."""
    last: float
    parts: dict[str, float] = field(default_factory=dict)
    first_step_end: float | None = None
    compile_s: float = 0.0
    autotune_s: float = 0.0

    @classmethod
    def begin(cls) -> StartupClock:
        stamp = os.environ.get(LAUNCH_ENV)
        try:
            t0 = float(stamp) if stamp else _process_start()
        except ValueError:
            t0 = _process_start()
        t0 = min(t0, time.time())
        return cls(t0=t0, last=t0)

    def mark(self, name: str) -> None:
        now = time.time()
        self.parts[name] = self.parts.get(name, 0.0) + now - self.last
        self.last = now

    def first_step(self, device: torch.device) -> None:
        """End of the first step: waits for the device, then reads the compilers' timers."""
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        self.mark("first_step")
        self.first_step_end = self.last
        self.compile_s = compile_seconds()
        self.autotune_s = autotune_seconds()

    def result(self, data_generated: bool) -> Startup | None:
        if self.first_step_end is None:
            return None
        p = self.parts
        return Startup(to_first_step_s=self.first_step_end - self.t0, launch_s=p.get("launch", 0.0),
                       data_s=p.get("data", 0.0), data_generated=data_generated, build_s=p.get("build", 0.0),
                       sharding_s=p.get("sharding", 0.0), first_step_s=p.get("first_step", 0.0),
                       compile_s=self.compile_s, autotune_s=self.autotune_s)


__all__ = ["LAUNCH_ENV", "StartupClock", "compile_seconds"]
