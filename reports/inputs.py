"""What a report reads: the plan, the cost model's full breakdown of it, and optionally a run
directory and a calibration. Every file goes through the spec loaders, so a bad file is a
:class:`~coplan.errors.CoplanError` that names the file and field, never a traceback.

The plan's own :class:`~coplan.spec.Prediction` is the source of truth for the headline numbers.
Where a figure needs more detail than the Prediction keeps (per-rank parts, the two-stream
schedule, memory kinds per rank), the plan is re-priced with :func:`coplan.costmodel.price`, which
is deterministic: the report says so when the re-priced step time differs from the stored one. The
figures read the re-priced :class:`~coplan.costmodel.StepCost` (its schedule, per-rank embedding
loads and launches per op class), never the pricer's internals.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from coplan.costmodel import Context, StepCost, build_context, price
from coplan.costmodel.schedule import Schedule
from coplan.errors import CoplanError
from coplan.spec import Calibration, Plan, Prediction, RunDir, RunResult, load_calibration, load_plan, load_run_result, spec_sha256
from coplan.spec.loader import read_text


class ReportInputError(CoplanError):
    """A run directory or metrics file a report was pointed at is missing or malformed."""


METRIC_KEYS = ("step", "step_time_s")
"""Keys every metrics.jsonl line must have (the run-directory contract in DESIGN.md)."""


@dataclass(frozen=True, slots=True)
class RunData:
    """One run directory: ``summary.json`` (RunResult), ``metrics.jsonl``, the plan it ran, its traces."""

    path: Path
    result: RunResult
    metrics: tuple[dict[str, Any], ...]
    """One dict per step, in step order."""
    plan: Plan | None
    """``runs/<id>/plan.json`` when present."""
    trace_paths: tuple[Path, ...]
    """``traces/rank<k>.json[.gz]``, rank order."""

    def series(self, key: str) -> tuple[list[int], list[float]]:
        """(steps, values) of one metric, skipping steps that lack it or hold a non-number."""
        xs, ys = [], []
        for m in self.metrics:
            v = m.get(key)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                xs.append(int(m["step"]))
                ys.append(float(v))
        return xs, ys


def load_metrics(path: Path) -> tuple[dict[str, Any], ...]:
    """Parse ``metrics.jsonl``; a bad line names the file and the line number."""
    rows: list[dict[str, Any]] = []
    if not path.exists():
        raise ReportInputError(f"{path}: no metrics file (the trainer writes one line per step here)")
    text = read_text(path)
    for i, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ReportInputError(f"{path}:{i}: not valid JSON ({e.msg})") from None
        if not isinstance(row, dict):
            raise ReportInputError(f"{path}:{i}: expected a JSON object per line, got {type(row).__name__}")
        missing = [k for k in METRIC_KEYS if k not in row]
        if missing:
            raise ReportInputError(f"{path}:{i}: missing {missing} (each line needs {list(METRIC_KEYS)})")
        rows.append(row)
    rows.sort(key=lambda r: r["step"])
    return tuple(rows)


def load_run(path: str | Path) -> RunData:
    """Load a run directory written by ``coplan train``."""
    rd = RunDir(path)
    p = rd.path
    if not p.is_dir():
        raise ReportInputError(f"{p}: not a run directory (expected runs/<id>/ with summary.json and metrics.jsonl)")
    if not rd.summary_path.exists():
        raise ReportInputError(f"{p}: no summary.json; is the run finished? (coplan train writes it at the end)")
    result = load_run_result(rd.summary_path)
    metrics = load_metrics(rd.metrics_path)
    plan = rd.ran_plan() if rd.plan_path.exists() else None
    return RunData(path=p, result=result, metrics=metrics, plan=plan, trace_paths=rd.trace_paths())


@dataclass
class ReportInputs:
    """Everything the figures draw from, loaded and cross-checked once."""

    plan: Plan
    plan_path: str = ""
    run: RunData | None = None
    calibration: Calibration | None = None
    calibration_path: str = ""
    warnings: list[str] = field(default_factory=list)
    """Things the reader must know (mismatched inputs, re-priced numbers that differ)."""

    # ------------------------------------------------------------------ cost model
    @cached_property
    def priced(self) -> "PricedPlan | None":
        """The plan re-priced by the installed cost model, with its two-stream schedule, or None when
        the cost model cannot price it (the reason goes to ``warnings``)."""
        try:
            priced = price_plan(self.plan)
        except CoplanError as e:
            self.warnings.append(f"re-pricing the plan failed: {e}")
            return None
        stored = self.plan.predicted
        cost = priced.cost
        if stored is not None and stored.step_time_s > 0:
            rel = abs(cost.step_time_s - stored.step_time_s) / stored.step_time_s
            if rel > 1e-6:
                self.warnings.append(
                    f"re-pricing this plan with the installed cost model gives a step time of {cost.step_time_s:.6g} s, "
                    f"{100 * rel:.2f}% off the {stored.step_time_s:.6g} s stored in the plan (cost model changed since planning?); "
                    "the detail figures (per rank, timeline, memory) use the re-priced breakdown, the rest the stored prediction"
                )
        return priced

    @property
    def cost(self) -> StepCost | None:
        """The re-priced :class:`~coplan.costmodel.results.StepCost` (None when re-pricing failed)."""
        return self.priced.cost if self.priced is not None else None

    @property
    def prediction(self) -> Prediction | None:
        """The plan's stored prediction, else the re-priced one."""
        if self.plan.predicted is not None:
            return self.plan.predicted
        c = self.cost
        return c.to_prediction() if c is not None else None

    @cached_property
    def context(self) -> Context:
        """The cost model's pricing context for the plan's mesh (jagged cost per sample, tables)."""
        if self.priced is not None:
            return self.priced.context
        return build_context(self.plan.workload, self.plan.topology, self.plan.mesh, self.plan.calibration, force_calibration=True)


@dataclass(frozen=True, slots=True)
class PricedPlan:
    """A plan priced by the cost model: its StepCost and the pricing context."""

    cost: StepCost
    context: Context

    @property
    def schedule(self) -> Schedule | None:
        """The critical rank's two-stream schedule the step was read from."""
        return self.cost.schedule


def price_plan(plan: Plan) -> PricedPlan:
    """Price ``plan`` with the installed cost model, in full detail (the StepCost carries the schedule the
    timeline draws: exactly the tasks, starts and ends the pricer used)."""
    ctx = build_context(plan.workload, plan.topology, plan.mesh, plan.calibration, force_calibration=True)
    cost = price(ctx, plan.tables or None, plan.layers, plan.balancing, plan.kernels, detail=True)
    return PricedPlan(cost=cost, context=ctx)


def load_inputs(plan_path: str | Path, run_dir: str | Path | None = None, calibration_path: str | Path | None = None) -> ReportInputs:
    """Load and cross-check a plan, a run directory and a calibration."""
    plan = load_plan(plan_path)
    inputs = ReportInputs(plan=plan, plan_path=str(plan_path))
    if run_dir is not None:
        run = load_run(run_dir)
        inputs.run = run
        want = spec_sha256(plan)
        if run.result.plan_sha256 and run.result.plan_sha256 != want:
            inputs.warnings.append(
                f"run {run.result.run_id} executed a different plan (sha256 {run.result.plan_sha256[:12]}…) than {plan_path} "
                f"({want[:12]}…): measured and predicted figures compare different plans"
            )
        if run.result.world_size != plan.world_size:
            inputs.warnings.append(
                f"run {run.result.run_id} ran on {run.result.world_size} ranks, the plan is for {plan.world_size}"
            )
    if calibration_path is not None:
        cal = load_calibration(calibration_path)
        inputs.calibration = cal
        inputs.calibration_path = str(calibration_path)
        gpu = plan.topology.gpu.name
        if cal.device.lower() not in gpu.lower() and gpu.lower() not in cal.device.lower():
            inputs.warnings.append(f"calibration was fitted on '{cal.device}', the plan's topology has '{gpu}'")
    return inputs


__all__ = ["METRIC_KEYS", "PricedPlan", "ReportInputError", "ReportInputs", "RunData", "load_inputs", "load_metrics", "load_run", "price_plan"]
