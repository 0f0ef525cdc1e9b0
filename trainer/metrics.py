"""Step timing (CUDA events on GPU, wall clock on CPU), model FLOPs and MFU, and the run summary.

A step's time is the interval between the starts of consecutive steps, so host stalls between
steps (data, Python) count against the step as they do in production. CUDA events are read back
only when metrics are flushed, never inside the step. Model FLOPs come from the one FLOP formula
(:func:`coplan.costmodel.flops.model_flops`) on the batch's real lengths: no padding, no recompute.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from coplan.costmodel.flops import model_flops
from coplan.spec import Workload
from coplan.spec.run import StepTimeStats


class StepTimer:
    """Marks the start of every step; ``times()`` gives each finished step's duration in seconds."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._marks: list = []
        self._steps: list[int] = []

    def mark(self, step: int) -> None:
        """Start of ``step`` (and end of the previous one); marking the same step twice is a no-op."""
        if self._steps and self._steps[-1] == step:
            return
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            self._marks.append(e)
        else:
            self._marks.append(time.perf_counter())
        self._steps.append(step)

    def reset(self) -> None:
        """Forget the pending mark: what runs until the next mark is not a step (a checkpoint, say)."""
        self._marks, self._steps = [], []

    def resolve(self) -> dict[int, float]:
        """Durations of every step whose end has been marked; consumes them."""
        if len(self._marks) < 2:
            return {}
        if self.cuda:
            self._marks[-1].synchronize()
            durs = [a.elapsed_time(b) / 1e3 for a, b in zip(self._marks[:-1], self._marks[1:])]
        else:
            durs = [b - a for a, b in zip(self._marks[:-1], self._marks[1:])]
        out = dict(zip(self._steps[:-1], durs))
        self._marks, self._steps = self._marks[-1:], self._steps[-1:]
        return out


class HostPhases:
    """The host's seconds per phase of each step (``time.perf_counter`` between the loop's phases: no device
    sync, so on a device-bound step a phase that blocks on a full launch queue absorbs that wait)."""

    def __init__(self) -> None:
        self.per_step: dict[int, dict[str, float]] = {}
        self._step: dict[str, float] | None = None
        self._t = 0.0

    def begin(self, step: int) -> None:
        self._step = self.per_step.setdefault(step, {})
        self._t = time.perf_counter()

    def lap(self, phase: str) -> None:
        """Charge the time since the last lap (or :meth:`begin`) to ``phase``."""
        now = time.perf_counter()
        if self._step is not None:
            self._step[phase] = self._step.get(phase, 0.0) + now - self._t
        self._t = now

    def total(self, step: int) -> float | None:
        """The host's seconds in ``step``, all phases (None: a step not timed)."""
        row = self.per_step.get(step)
        return sum(row.values()) if row is not None else None

    def medians(self, steps: list[int]) -> dict[str, float]:
        """Per phase, the median over ``steps`` (a phase a step did not run counts as 0 there)."""
        rows = [self.per_step[s] for s in steps if s in self.per_step]
        names = sorted({k for r in rows for k in r})
        return {k: float(np.median([r.get(k, 0.0) for r in rows])) for k in names}


def step_flops(workload: Workload, global_lengths: dict[str, np.ndarray], batch_size: int) -> float:
    """Model FLOPs (forward + backward) of one global batch, on its real lengths. A sequence of the workload
    that no block or table reads has no lengths in the data (and no op): it counts as empty."""
    if not workload.sequences:
        return model_flops(workload, batch_size=batch_size).total
    lengths = {s.name: global_lengths.get(s.name, np.zeros(batch_size, np.int64)) for s in workload.sequences}
    return model_flops(workload, lengths=lengths, batch_size=batch_size).total


def stats(times: list[float]) -> StepTimeStats | None:
    if not times:
        return None
    a = np.asarray(times, dtype=float)
    return StepTimeStats(
        mean_s=float(a.mean()), p50_s=float(np.percentile(a, 50)), p90_s=float(np.percentile(a, 90)),
        p99_s=float(np.percentile(a, 99)), min_s=float(a.min()), max_s=float(a.max()),
    )


def mfu(flops: float, seconds: float, world_size: int, peak_flops_per_s: float) -> float:
    return flops / (seconds * world_size * peak_flops_per_s) if seconds > 0 and peak_flops_per_s > 0 else 0.0


@dataclass
class StepRecord:
    """One line of ``metrics.jsonl``."""

    step: int
    loss: float
    step_time_s: float
    tokens: int
    samples: int
    model_flops: float
    mfu: float
    imbalance: float
    """max / mean of the ranks' model FLOPs this step (1.0 = perfectly balanced)."""
    task_loss: dict[str, float] = field(default_factory=dict)
    seq_stats: dict[str, list[float]] = field(default_factory=dict)
    """This rank's jagged lengths per sequence, ``[n, ΣL, ΣL²]``: what calibration prices the
    profiled steps with (their real length moments, not the distribution's)."""
    seq_max: dict[str, list[int]] = field(default_factory=dict)
    """This rank's longest length per sequence, one entry per micro-batch (the trainer runs one per
    step): what the padded reference attention pads to, read by calibration as ``seq_max``."""

    def as_json(self) -> dict:
        d = {k: getattr(self, k) for k in ("step", "loss", "step_time_s", "tokens", "samples", "model_flops", "mfu", "imbalance")}
        d["task_loss"] = self.task_loss
        d["seq_stats"] = self.seq_stats
        d["seq_max"] = self.seq_max
        for k, v in list(d.items()):
            if isinstance(v, float) and not math.isfinite(v):
                d[k] = None
        return d


__all__ = ["StepRecord", "StepTimer", "mfu", "stats", "step_flops"]
