"""Assemble a whole report from a plan (and optionally a run and a calibration): the summary, then every
figure in reading order, each with a caption that says how it was computed.

A figure that cannot be drawn for a reason of the inputs (no jagged sequence, a run without traces)
becomes a note in its place. A figure that fails because of a bug in coplan also becomes a note that
says so plainly, so one broken figure does not cost the reader the rest; ``COPLAN_DEBUG=1`` re-raises.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

from coplan import __version__
from coplan.spec.calibration import stale_mark
from coplan.errors import CoplanError
from coplan.reports import alternatives, assumptions, balance, calibration, ledger, ranks, runs, sharding, summary, timeline, waterfall
from coplan.reports import scaling as scaling_mod
from coplan.reports.calibration import CalibrationPointsOf
from coplan.reports.html import Report, Section, render
from coplan.reports.inputs import ReportInputs, RunData, load_inputs
from coplan.reports.layout import fmt_bytes, fmt_pct, fmt_s
from coplan.reports.runs import TraceClassTimesOf
from coplan.reports.scaling import SimulatePoint, load_sweep
from coplan.spec import Plan, Prediction, spec_sha256, write_text_atomic

CAPTIONS = {
    "waterfall": (
        "Each bar is time one step loses against running every GPU at its dense peak on model FLOPs, as a share of the wall time a step "
        "really costs (step time / goodput), so the bars add up exactly from 100% to the goodput MFU. Kernel bars are each op class's time "
        "on the critical rank minus its model FLOPs at peak; communication bars are the part of each collective compute waited for, by "
        "what it is and the tiers it crosses; 'other' is what the cost model does not itemise. Hover for the numbers."
    ),
    "timeline": (
        "The critical rank's compute stream and its communication streams (one per bottleneck link: collectives that share links queue, "
        "others overlap) as the cost model scheduled them: compute tasks cut by op class (same colours as the waterfall), communication "
        "tasks by collective. Hatched segments are where compute waits for communication: the exposed part. Hover a task for its start, "
        "end, size and exposed time."
    ),
    "ranks": (
        "Each rank's step: compute per op class, exposed communication, and idle time waiting for the slowest rank at the next "
        "collective. Ranks differ by the embedding lookups their shards serve (from the cost model's per-rank loads, checked against "
        "the ranks it samples); the dense work is the critical rank's on every rank."
    ),
    "memory": (
        "Bytes per rank by kind against the GPU's HBM (dashed). Dense state is the same on every rank; embedding shards, their optimizer "
        "state and lookup buffers differ with the table placement. The usable line is HBM less the topology's stated reserve (allocator "
        "fragmentation, CUDA context, NCCL internals): no plan fills past it."
    ),
    "sharding": (
        "Top: embedding bytes each rank of the sparse shard group holds, by sharding type. Bottom: one row per table (largest first), one "
        "dot per shard on one rank, one bar per shard spread over a run of ranks; size is bytes per shard."
    ),
    "alternatives": (
        "The plans the search priced and did not return, against the returned one: other mesh candidates (and micro-batch counts), the "
        "runner-up sharding or recompute of the same mesh, the simulate heuristic's plan, and the best candidates it pruned by a proven "
        "lower bound or found not to fit. Hover a bar for why it lost. `coplan diff` compares any two plan files choice by choice."
    ),
    "balance": (
        "One global batch of jagged samples, drawn from the workload's length distribution and priced per sample by the cost model, split "
        "across ranks in order and with the plan's balancing policy (the trainer's own balancer). The slowest rank sets the step."
    ),
    "assumptions": (
        "The plan as priced against the same plan re-priced with one of the cost model's unmeasured assumptions moved to the far end "
        "of its own source's range (kernel efficiency, network efficiency beyond the first tier, SM contention, step jitter, host and "
        "loader speed, embedding bandwidth, failures), then all together. Nothing is re-planned. The shaded band is Meta's reported E2E MFU for GEM."
    ),
    "scaling": (
        "coplan simulate's sweep of the same workload on the same topology, one heuristic plan per GPU count; the star is this plan. "
        "Scaling ratio is compute time over step time: the share not lost to exposed communication."
    ),
    "run_steps": (
        "What the run measured each step (grey: warm-up, excluded from the statistics) against the plan's prediction (dashed). MFU uses "
        "the same FLOP formula and peak as the prediction; imbalance is the max/mean of the ranks' model FLOPs each step."
    ),
    "run_classes": (
        "Device time per step by op class and collective, attributed from the run's Kineto traces, next to the cost model's per-op and "
        "per-collective times (whole durations, not just exposed parts)."
    ),
    "calibration": (
        "Every (op, phase) the calibration was fitted on: measured time against the time the cost model predicts with the calibration "
        "(filled) and with its defaults (hollow, hidden until clicked in the legend). Points on the dotted diagonal are exact; the grey "
        "lines are 2× off."
    ),
}


@dataclass
class BuildLog:
    """How long each figure took to build and how big its JSON is (for the benchmark)."""

    seconds: dict[str, float] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)


def _section(key: str, title: str, make: Callable[[], object], log: BuildLog) -> Section:
    t0 = time.perf_counter()
    try:
        fig = make()
        note = ""
        if isinstance(fig, tuple):
            fig, note = fig
        if fig is None and not note:
            note = "nothing to draw for this plan"
    except CoplanError as e:
        fig, note = None, f"not drawn: {e}"
    except Exception as e:  # a bug: say so, keep the rest of the report
        if os.environ.get("COPLAN_DEBUG"):
            raise
        fig, note = None, f"not drawn because of a bug in coplan ({type(e).__name__}: {e}); set COPLAN_DEBUG=1 to see the traceback"
    log.seconds[key] = time.perf_counter() - t0
    if note:
        log.notes[key] = note
    return Section(key=key, title=title, figure=fig, caption=CAPTIONS.get(key, ""), note=note)


def build_report(inputs: ReportInputs, *, sweep: list[dict] | None = None, simulate_point: SimulatePoint | None = None,
                 trace_class_times: TraceClassTimesOf | None = None, calibration_points: CalibrationPointsOf | None = None,
                 scaling: bool = True, what_if: bool = True, log: BuildLog | None = None) -> Report:
    """Every figure and the summary for ``inputs``. The scaling curve is drawn from ``sweep``, else from
    ``simulate_point`` run at each GPU count (the planner's; the CLI hands it in), else left as a note.
    The run's per-class figure needs ``trace_class_times`` and the calibration figure ``calibration_points``
    (calibration's; the CLI hands them in): without them, each is left as a note."""
    log = log or BuildLog()
    plan = inputs.plan
    pred = inputs.prediction
    if pred is None:
        raise CoplanError(f"{inputs.plan_path or 'the plan'} has no prediction and the cost model could not price it: "
                          + "; ".join(inputs.warnings or ["no reason given"]))
    cost = inputs.cost
    launch = ledger.launch_by_class(cost) if cost is not None else None
    if not launch:
        launch = None
        inputs.warnings.append("kernel launch overhead is left inside the kernel bars: the cost model gave no launch times "
                               "per op class (the plan could not be re-priced)")
    led = ledger.build_ledger(plan, pred, launch_s=launch)
    sections: list[Section] = [
        _section("waterfall", "MFU waterfall", lambda: waterfall.mfu_waterfall(led), log),
        _section("timeline", "Predicted step timeline", lambda: timeline.step_timeline(inputs.priced.schedule, cost, tiers=tuple(t.name for t in plan.topology.tiers))
                 if inputs.priced is not None and inputs.priced.schedule is not None else (None, "the cost model did not expose its schedule"), log),
        _section("ranks", "Per-rank time", lambda: ranks.rank_time_breakdown(cost, every_rank=True) if cost is not None else (None, "needs the cost model's breakdown"), log),
        _section("memory", "Memory per rank", lambda: ranks.memory_per_rank(plan, cost) if cost is not None else (None, "needs the cost model's breakdown"), log),
        # against the step the report shows (a plan saved without its prediction was re-priced above)
        *([_section("alternatives", "Why this plan", lambda: alternatives.alternatives_figure(plan.model_copy(update={"predicted": pred})), log)]
          if plan.alternatives else []),
        _section("sharding", "Embedding sharding map", lambda: sharding.sharding_map(plan) if plan.tables else (None, "the plan shards no embedding tables"), log),
        _section("balance", "Jagged balance", lambda: (balance.jagged_balance(plan, inputs.context)
                 or (None, "the workload has no jagged sequence: every sample costs the same, there is nothing to balance"))
                 if plan.world_size > 1 else (None, "one rank: nothing to balance"), log),
    ]
    table: list = []
    if what_if:
        def _assumptions():
            table.extend(assumptions.assumption_table(plan))
            return assumptions.assumptions_figure(plan, table)
        sections.append(_section("assumptions", "Which assumption makes the difference", _assumptions, log))
    if scaling:
        sections.append(_section("scaling", "Scaling curve", lambda: _scaling_figure(plan, sweep, simulate_point), log))
    if inputs.run is not None:
        r = inputs.run
        sections.append(_section("run_steps", "Run: measured vs predicted per step", lambda: runs.run_steps(r, pred), log))
        sections.append(_section("run_classes", "Run: measured vs predicted per op class",
                                 lambda: _run_classes_figure(r, pred, plan, trace_class_times), log))
    if inputs.calibration is not None:
        sections.append(_section("calibration", "Calibration: predicted vs measured",
                                 lambda: _calibration_figure(inputs, calibration_points), log))

    t0 = time.perf_counter()
    paras = [summary.describe_plan(plan), summary.describe_prediction(pred), summary.describe_losses(plan, pred, led, price_what_if=what_if)]
    if table:
        paras.append(assumptions.describe(table, assumptions.PUBLISHED_GEM_E2E_MFU if assumptions.compare_with_gem(plan) else None))
    log.seconds["summary"] = time.perf_counter() - t0
    if inputs.run is not None:
        res = inputs.run.result
        if res.step_time is not None:
            ratio = res.step_time.p50_s / pred.step_time_s if pred.step_time_s else float("nan")
            paras.append(f"Run {res.run_id} ({res.world_size} × {res.device or '?'}, {res.steps} steps): measured step p50 "
                         f"{fmt_s(res.step_time.p50_s)} ({ratio:.3g}× the prediction), MFU {fmt_pct(res.measured_mfu)} against "
                         f"{fmt_pct(pred.e2e_mfu)} predicted.")
    if inputs.calibration is not None and inputs.calibration.fit_error is not None:
        fe = inputs.calibration.fit_error
        paras.append(f"Calibration on {inputs.calibration.device} from {len(inputs.calibration.source_runs)} run(s): median error "
                     f"{fmt_pct(fe.median_abs_rel_error, 1)}, worst {fmt_pct(fe.max_abs_rel_error, 1)} over {fe.num_samples} samples.")
    if led.checks:
        inputs.warnings.extend(f"ledger check: {c}" for c in led.checks)
    mark = stale_mark(plan.calibration.notes) if plan.calibration is not None else None
    if mark:  # (coplan plan marks a calibration whose runs ran another trainer than the installed one)
        inputs.warnings.append(f"the plan's calibration ({plan.calibration.device}) is {mark} (judged when the plan was made)")
    paras += [f"Note: {w}" for w in inputs.warnings]
    if pred.notes:
        paras.append("Cost-model notes: " + "; ".join(pred.notes) + ".")
    facts = [
        ("GPUs", f"{plan.world_size:,} × {plan.topology.gpu.name} ({plan.topology.name})"),
        ("step time", fmt_s(pred.step_time_s)),
        ("local MFU × scaling", f"{fmt_pct(pred.local_mfu)} × {fmt_pct(pred.scaling_ratio, 1)}"),
        ("E2E MFU / goodput MFU", f"{fmt_pct(pred.e2e_mfu)} / {fmt_pct(pred.goodput_mfu)}"),
        ("peak memory / usable HBM", f"{fmt_bytes(pred.peak_memory_bytes)} / {fmt_bytes(pred.hbm_capacity_bytes - pred.hbm_reserve_bytes)}"
                                      f" (HBM {fmt_bytes(pred.hbm_capacity_bytes)} less its reserve)"),
        ("model FLOPs per step", f"{pred.model_flops_per_step:.4g}"),
    ]
    footer = (f"coplan {__version__}; report written {datetime.now(timezone.utc).isoformat(timespec='seconds')}; plan {inputs.plan_path} "
              f"(sha256 {spec_sha256(plan)[:16]}…, planned {plan.created_utc or '?'} by coplan {plan.coplan_version or '?'}); "
              f"topology sha256 {plan.topology_sha256[:16] or '?'}…, workload sha256 {plan.workload_sha256[:16] or '?'}….")
    meta = {"coplan-version": __version__, "coplan-plan-sha256": spec_sha256(plan)}
    return Report(title=f"coplan report: {plan.workload.name} on {plan.world_size:,} GPUs of {plan.topology.name}",
                  summary=tuple(p for p in paras if p), sections=tuple(sections), facts=tuple(facts), footer=footer, meta=meta)


def _scaling_figure(plan, sweep: list[dict] | None, simulate_point: SimulatePoint | None):
    if sweep is None:
        if simulate_point is None:
            return None, "no sweep to draw: give `coplan simulate --json` output (--simulate FILE)"
        sweep = scaling_mod.simulate_sweep(plan, simulate_point)
    return scaling_mod.scaling_curve(sweep, plan)


def _run_classes_figure(r: RunData, pred: Prediction, plan: Plan, trace_class_times: TraceClassTimesOf | None):
    if not r.trace_paths:
        return None, f"{r.path} has no traces/rank<k>.json (run with profiling on)"
    if trace_class_times is None:
        return None, "the run's traces were not attributed: `coplan report --run` does it (build_report needs trace_class_times)"
    return runs.run_op_classes(r, trace_class_times(r.trace_paths), pred, plan)


def _calibration_figure(inputs: ReportInputs, calibration_points: CalibrationPointsOf | None):
    if calibration_points is None:
        return None, ("the calibration's samples were not read: `coplan report --calibration` does it "
                      "(build_report needs calibration_points)")
    # the report's run stands in for the calibration's source runs only when it ran a plan
    extra = [inputs.run.path] if inputs.run is not None and inputs.run.plan is not None else []
    pts = calibration_points(inputs.calibration, cal_path=inputs.calibration_path, extra_runs=extra)
    return calibration.calibration_scatter(inputs.calibration, pts)


def write_report(plan_path: str | Path, output: str | Path, *, run: str | Path | None = None, calibration: str | Path | None = None,
                 sweep_path: str | Path | None = None, simulate_point: SimulatePoint | None = None,
                 trace_class_times: TraceClassTimesOf | None = None, calibration_points: CalibrationPointsOf | None = None,
                 scaling: bool = True, what_if: bool = True) -> tuple[Path, Report, BuildLog]:
    """Load, build and write a report; returns (path, report, build log). ``simulate_point``,
    ``trace_class_times`` and ``calibration_points``: see :func:`build_report`."""
    out = Path(output)
    if out.parent and not out.parent.exists():
        raise CoplanError(f"{out}: folder {out.parent} does not exist")
    inputs = load_inputs(plan_path, run, calibration)
    sweep = load_sweep(sweep_path) if sweep_path else None
    log = BuildLog()
    report = build_report(inputs, sweep=sweep, simulate_point=simulate_point, trace_class_times=trace_class_times,
                          calibration_points=calibration_points, scaling=scaling, what_if=what_if, log=log)
    html = render(report)
    try:
        write_text_atomic(out, html)
    except OSError as e:
        raise CoplanError(f"{out}: cannot be written ({e.strerror})") from None
    return out, report, log


__all__ = ["BuildLog", "CAPTIONS", "build_report", "write_report"]
