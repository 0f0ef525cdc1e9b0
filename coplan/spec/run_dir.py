"""RunDir: the layout of a run directory (``runs/<id>/``), written by the trainer and read by
calibration, reports and benchmarks. Every path into a run directory is named here, once.

Its own module rather than ``run.py``: its loaders use the spec loader, which itself imports
``run.py`` for RunResult.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from coplan.errors import CoplanError
from coplan.spec.hashing import spec_sha256
from coplan.spec.loader import load_plan, load_run_result
from coplan.spec.plan import Plan
from coplan.spec.run import RunOptions, RunResult

_TRACE_NAME = re.compile(r"^rank(\d+)\.json(\.gz)?$")


class RunDirError(CoplanError):
    """A run directory's file is unreadable or corrupt."""


def _eager(plan: Plan) -> Plan:
    w = plan.workload
    if w.kernels.cuda_graphs == "off":
        return plan
    w = w.model_copy(update={"kernels": w.kernels.model_copy(update={"cuda_graphs": "off"})})
    return plan.model_copy(update={"workload": w, "workload_sha256": spec_sha256(w) if plan.workload_sha256 else ""})


@dataclass(frozen=True, slots=True)
class RunDir:
    """One run directory. Paths are properties; loaders read on each call (nothing is cached)."""

    path: Path

    def __init__(self, path: str | Path) -> None:
        object.__setattr__(self, "path", Path(path))

    @property
    def name(self) -> str:
        """The run id (the directory's name)."""
        return self.path.name

    @property
    def plan_path(self) -> Path:
        """The plan the run executed (a copy)."""
        return self.path / "plan.json"

    @property
    def config_path(self) -> Path:
        """The trainer's launch switches, as it parsed them (rank 0 writes it at start)."""
        return self.path / "config.json"

    @property
    def metrics_path(self) -> Path:
        """One JSON line per step (``step``, ``loss``, ``step_time_s``, length statistics...)."""
        return self.path / "metrics.jsonl"

    @property
    def summary_path(self) -> Path:
        """The RunResult, written at the end of the run."""
        return self.path / "summary.json"

    @property
    def traces_dir(self) -> Path:
        return self.path / "traces"

    @property
    def profiled_steps_path(self) -> Path:
        """Which steps the traces hold (a JSON list of step numbers)."""
        return self.traces_dir / "steps.json"

    @property
    def checkpoints_dir(self) -> Path:
        return self.path / "checkpoints"

    def trace_path(self, rank: int) -> Path:
        """Where rank ``rank``'s Kineto trace is written."""
        return self.traces_dir / f"rank{rank}.json"

    def trace_paths(self) -> tuple[Path, ...]:
        """The ranks' traces (``rank<k>.json``, or gzipped), in rank order."""
        if not self.traces_dir.is_dir():
            return ()
        found = [(int(m.group(1)), f) for f in self.traces_dir.iterdir() if (m := _TRACE_NAME.match(f.name))]
        return tuple(f for _, f in sorted(found))

    def rank_trace(self, rank: int) -> Path | None:
        """Rank ``rank``'s trace, plain or gzipped; None when there is none."""
        for f in (self.trace_path(rank), self.traces_dir / f"rank{rank}.json.gz"):
            if f.is_file():
                return f
        return None

    def plan(self) -> Plan:
        return load_plan(self.plan_path)

    def ran_plan(self, plan: Plan | None = None) -> Plan:
        """The plan as the run ran it: a run whose summary says its dense arch did not run as CUDA graphs
        (``--cuda-graphs off``, a capture that failed, a trainer before them) is the plan with
        ``kernels.cuda_graphs: off``, so that pricing it again prices what ran. ``plan``: :meth:`plan`, when
        the caller has loaded it already."""
        plan = self.plan() if plan is None else plan
        if not self.summary_path.is_file():  # unfinished: as planned
            return plan
        opts = self.options()
        return plan if opts is not None and opts.cuda_graphs else _eager(plan)

    def result(self) -> RunResult | None:
        """The summary; None when the run has not written one (unfinished)."""
        return load_run_result(self.summary_path) if self.summary_path.is_file() else None

    def options(self) -> RunOptions | None:
        """The run's launch switches from its summary; None without a summary or one that predates them."""
        r = self.result()
        return r.options if r is not None else None

    def metrics(self) -> list[dict[str, Any]]:
        """The metrics lines in file order (empty when there is no metrics file)."""
        p = self.metrics_path
        if not p.is_file():
            return []
        rows = []
        try:
            text = p.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise RunDirError(f"{p}: not UTF-8 text (byte {e.start:,}); the run's metrics are corrupt") from None
        for i, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise RunDirError(f"{p}:{i}: a line is not JSON ({e.msg}); the run's metrics are corrupt") from None
                if not isinstance(row, dict):
                    raise RunDirError(f"{p}:{i}: a line is not a JSON object of one step's metrics; the run's metrics "
                                      "are corrupt")
                rows.append(row)
        return rows

    def profiled_steps(self) -> list[int] | None:
        """The steps the traces hold; None when not recorded or unreadable."""
        p = self.profiled_steps_path
        if not p.is_file():
            return None
        try:
            return [int(s) for s in json.loads(p.read_text())]
        except (ValueError, TypeError):
            return None


__all__ = ["RunDir", "RunDirError"]
