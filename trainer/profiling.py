"""Kineto traces of a window of steps: ``runs/<id>/traces/rank<k>.json`` (:class:`coplan.spec.RunDir`).

The model's ``record_function`` ranges carry the cost model's op names, and every profiled step is a
``ProfilerStep#N`` range, which is what calibration (:mod:`coplan.calibration.attribution`) attributes
device time by.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
import json

import torch
from torch.profiler import ProfilerActivity, profile, schedule

from coplan.spec import RunDir


class TraceWindow(AbstractContextManager):
    """Profiles steps ``[first, first + count)`` (counted from the run's first step); a no-op when count is 0."""

    def __init__(self, run: RunDir, rank: int, first: int, count: int, start_step: int, device: torch.device) -> None:
        self.run = run
        self.path = run.trace_path(rank)
        self.steps = list(range(first, first + count))
        self.enabled = count > 0 and first >= start_step
        self._prof = None
        if self.enabled:
            run.traces_dir.mkdir(parents=True, exist_ok=True)
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
            wait = first - start_step
            # one warm-up step of the profiler itself when there is room, so the first active step is clean
            warm = 1 if wait >= 1 else 0
            self._prof = profile(
                activities=activities,
                schedule=schedule(wait=wait - warm, warmup=warm, active=count, repeat=1),
                on_trace_ready=self._write,
                record_shapes=False,
                with_stack=False,
            )

    def _write(self, prof) -> None:
        prof.export_chrome_trace(str(self.path))
        # which steps the trace holds: calibration prices them with those steps' own lengths
        self.run.profiled_steps_path.write_text(json.dumps(self.steps))

    def __enter__(self) -> "TraceWindow":
        if self._prof is not None:
            self._prof.__enter__()
        return self

    def profiles(self, step: int) -> bool:
        """Whether ``step`` is one the trace records."""
        return self.enabled and step in self.steps

    def step(self) -> None:
        if self._prof is not None:
            self._prof.step()

    def __exit__(self, *exc) -> None:
        if self._prof is not None:
            self._prof.__exit__(*exc)


__all__ = ["TraceWindow"]
