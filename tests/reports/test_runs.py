"""Run and calibration figures on a real run: gem-tiny trained for a few steps on CPU (gloo) by
coplan's trainer, and the calibration coplan's calibrate code fits to its traces."""

from __future__ import annotations

import json

import numpy as np
import pytest

from coplan.calibration.attribution import trace_class_times
from coplan.calibration.points import calibration_points
from coplan.reports.calibration import calibration_scatter
from coplan.reports.inputs import load_inputs, load_run
from coplan.reports.runs import class_times, run_op_classes, run_steps

from tests.reports.conftest import RUN_RANKS


def test_run_loads(tiny_run):
    plan_path, run_dir = tiny_run
    run = load_run(run_dir)
    assert run.result.world_size == RUN_RANKS
    assert len(run.metrics) == run.result.steps
    assert len(run.trace_paths) == RUN_RANKS
    inputs = load_inputs(plan_path, run_dir)
    assert inputs.warnings == [], "the run executed this very plan"


def test_run_steps_figure(tiny_run):
    plan_path, run_dir = tiny_run
    inputs = load_inputs(plan_path, run_dir)
    fig = run_steps(inputs.run, inputs.prediction)
    measured = [tr for tr in fig.data if tr.name == "measured"]
    assert measured and list(measured[0].y) == pytest.approx([m["step_time_s"] for m in inputs.run.metrics])
    predicted = [tr for tr in fig.data if tr.name == "predicted"]
    assert predicted[0].y[0] == pytest.approx(inputs.prediction.step_time_s)
    json.loads(fig.to_json())


def test_run_op_classes_figure(tiny_run):
    plan_path, run_dir = tiny_run
    inputs = load_inputs(plan_path, run_dir)
    traced = trace_class_times(inputs.run.trace_paths)
    ct = class_times(traced, inputs.prediction)
    assert ct is not None and ct.ranks_read == tuple(range(RUN_RANKS))
    assert "gemm" in ct.measured and all(v > 0 for v in ct.measured["gemm"])
    pred_gemm = sum(o.time_s for o in inputs.prediction.ops if o.op_class == "gemm")
    assert ct.predicted["gemm"] == pytest.approx(pred_gemm)
    fig = run_op_classes(inputs.run, traced, inputs.prediction, inputs.plan)
    assert "measured on cpu" in fig.layout.title.text, "a CPU run against a GPU plan is flagged"


def test_calibration_figure_matches_the_fit(tiny_calibration):
    cal_path, cal = tiny_calibration
    pts = calibration_points(cal, cal_path=cal_path)
    assert pts.skipped == [] and pts.measured.size == cal.fit_error.num_samples
    # the figure's calibrated errors are the ones the calibration reports
    for c, e in cal.fit_error.per_op_class.items():
        assert pts.class_error("after")[c] == pytest.approx(e, rel=1e-6)
    assert pts.median_error("after") == pytest.approx(cal.fit_error.median_abs_rel_error, rel=1e-6)
    fig = calibration_scatter(cal, pts)
    assert np.isclose(sum(len(tr.x) for tr in fig.data if tr.visible is True and tr.mode == "markers"), pts.measured.size)
    # without readable source runs it falls back to the reported errors, and says why
    fallback = calibration_scatter(cal.model_copy(update={"source_runs": ("/no/such/run",)}),
                                   calibration_points(cal.model_copy(update={"source_runs": ("/no/such/run",)})))
    assert "not available" in fallback.layout.title.text


def test_calibration_held_out_run(tiny_run, tiny_calibration):
    """When the fit's own runs are gone, the report's --run stands in, flagged as held out."""
    _, run_dir = tiny_run
    _, cal = tiny_calibration
    moved = cal.model_copy(update={"source_runs": ("/no/such/run",)})
    pts = calibration_points(moved, extra_runs=[run_dir])
    assert pts.held_out and pts.measured.size > 0
    assert "HELD OUT" in calibration_scatter(moved, pts).layout.title.text
    assert not calibration_points(cal, extra_runs=[run_dir]).held_out
