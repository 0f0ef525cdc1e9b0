"""Attention scales: a calibration's measured-over-priced time per attention (op, phase, head dim), fitted after
the class efficiencies and applied by the pricer (one efficiency per class cannot hold a jagged kernel's forward
and its backward, the summary tokens' attention and a Kunlun layer's at once: on the lent H100 their residuals
under one class ran from 0.5x to 1.8x, by op, phase and head dim)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from coplan.calibration.assemble import calibrate
from coplan.calibration.device_fit import FitResult, fit_attention_scales, predict
from coplan.calibration.runs import Sample
from coplan.costmodel import build_context
from coplan.costmodel.compute import op_arrays
from coplan.costmodel.efficiency import resolve_efficiencies
from coplan.errors import SpecError
from coplan.spec import Calibration, OpClassCalibration, load_topology, parse_spec

from .test_calibrate import _plan, _synth_run


def _cal(scales: dict[str, float]) -> Calibration:
    return Calibration(device="NVIDIA H200", op_classes={"attention": OpClassCalibration(compute_efficiency={"bf16": 0.3})},
                       attention_scales=scales)


def test_scale_is_interpolated_in_log2_head_dim_and_held_beyond_the_fitted_ones():
    eff = resolve_efficiencies(load_topology("h200-1gpu"), _cal({"gdpa:bwd:64": 0.5, "gdpa:bwd:256": 2.0}))
    assert eff.attention_scale("gdpa", "bwd", 64) == pytest.approx(0.5)
    assert eff.attention_scale("gdpa", "bwd", 128) == pytest.approx(1.0)  # half-way in log2: the geometric mean
    assert eff.attention_scale("gdpa", "bwd", 96) == pytest.approx(math.exp(math.log(0.5) + math.log2(1.5) / 2 * math.log(4)))
    assert eff.attention_scale("gdpa", "bwd", 32) == pytest.approx(0.5)  # the nearest beyond the fitted head dims
    assert eff.attention_scale("gdpa", "bwd", 512) == pytest.approx(2.0)
    assert eff.attention_scale("gdpa", "fwd", 128) == 1.0  # nothing fitted for this (op, phase)
    assert eff.attention_scale("attn", "bwd", 128) == 1.0
    assert resolve_efficiencies(load_topology("h200-1gpu")).attention_scale("gdpa", "bwd", 128) == 1.0


def test_bad_keys_and_values_are_refused_with_the_field_named():
    for bad in ({"gdpa:backward:128": 1.2}, {"gdpa:bwd": 1.2}, {"gdpa:bwd:0": 1.2}, {"gdpa:bwd:128": 0.0}):
        with pytest.raises(SpecError) as e:
            parse_spec(Calibration, {"device": "NVIDIA H200", "attention_scales": bad}, "cal.json")
        assert "attention_scales" in str(e.value) and "cal.json" in str(e.value)


def test_a_calibration_without_scales_serialises_as_before():
    doc = Calibration(device="NVIDIA H200").model_dump(mode="json")
    assert "attention_scales" not in doc
    assert _cal({"gdpa:fwd:128": 0.7}).model_dump(mode="json")["attention_scales"] == {"gdpa:fwd:128": 0.7}


def test_the_pricer_scales_the_attention_ops_roofline_by_op_phase_and_head_dim():
    plan = _plan(64, 512)
    w, t = plan.workload, plan.topology
    hd = w.block("interformer").head_dim
    base = op_arrays(build_context(w, t, plan.mesh, _cal({}), force_calibration=True))
    scaled_ctx = build_context(w, t, plan.mesh, _cal({f"gdpa:bwd:{hd}": 2.0, f"summary_attn:fwd:{hd}": 0.5}),
                               force_calibration=True)
    scaled = op_arrays(scaled_ctx)
    names = [scaled_ctx.ops[int(i)].name for i in scaled_ctx.dense_idx]
    seen = set()
    for i, n in enumerate(names):
        kind = n.rsplit(".", 1)[-1]
        f = 0.5 if kind == "summary_attn" else 1.0
        b = 2.0 if kind == "gdpa" else 1.0
        seen.add(kind)
        assert scaled.fwd_flop_s[i] == pytest.approx(base.fwd_flop_s[i] * f), n
        assert scaled.fwd_mem_s[i] == pytest.approx(base.fwd_mem_s[i] * f), n
        assert scaled.bwd_flop_s[i] == pytest.approx(base.bwd_flop_s[i] * b), n
        assert scaled.bwd_mem_s[i] == pytest.approx(base.bwd_mem_s[i] * b), n
        assert scaled.bwd_launch_s[i] == pytest.approx(base.bwd_launch_s[i]), n  # launches are not scaled
    assert {"gdpa", "summary_attn"} <= seen


def _sample(name: str, phase: str, hd: int, meas: float) -> Sample:
    return Sample("r", name, phase, "attention", "bf16", meas, flop_s=1e-3, mem_s=1e-4, launches=0.0, head_dim=hd)


def test_each_key_is_the_shrunk_geometric_mean_of_its_residuals():
    samples = ([_sample("interformer.0.gdpa", "bwd", 128, 2e-3)] * 4 + [_sample("interformer.0.gdpa", "fwd", 128, 1e-3)] * 3
               + [_sample("kunlun.0.attn", "fwd", 64, 3e-3)]  # one sample: no scale of its own
               + [Sample("r", "interformer.0.qkv", "fwd", "gemm", "bf16", 2e-3, 1e-3, 1e-4, 0.0)])
    pred = np.full(len(samples), 1e-3)
    res = FitResult({}, {}, {}, pred, np.array([s.measured_s for s in samples]), tuple(samples))
    out = fit_attention_scales(res)
    assert out.attention_scales == {"gdpa:bwd:128": pytest.approx(2.0 ** (4 / 6)), "gdpa:fwd:128": pytest.approx(1.0)}
    assert out.predicted_s[0] == pytest.approx(1e-3 * 2.0 ** (4 / 6))
    assert out.predicted_s[-2] == pytest.approx(1e-3) and out.predicted_s[-1] == pytest.approx(1e-3)  # unscaled


def test_calibrate_fits_a_backward_the_class_efficiency_cannot_hold(tmp_path):
    """Runs whose jagged attention backward takes 1.8x what the class's efficiency gives (the forward as
    priced): one class efficiency splits the difference, the scales take it up, and the fitted calibration
    prices both phases within a few percent where the class alone is off by tens of percent."""
    rng = np.random.default_rng(1)

    def slow_bwd(term):
        return 1.8 if term.op_class == "attention" and term.phase == "bwd" and term.name.endswith(".gdpa") else 1.0

    runs = [_synth_run(tmp_path, f"r{i}", _plan(b, L), rng, noise=0.02, scale=slow_bwd)
            for i, (b, L) in enumerate([(8, 256), (64, 1024), (32, 512)])]
    cal, res, parsed = calibrate(runs)
    hd = parsed[0].plan.workload.block("interformer").head_dim
    sb, sf = cal.attention_scales[f"gdpa:bwd:{hd}"], cal.attention_scales[f"gdpa:fwd:{hd}"]
    assert sb / sf > 1.4  # the backward over the forward, beyond the class (shrunk towards 1 a little)
    gd = [i for i, s in enumerate(res.samples) if s.name.endswith(".gdpa")]
    err = np.abs(res.predicted_s[gd] / res.measured_s[gd] - 1)
    eff = resolve_efficiencies(parsed[0].plan.topology, cal.model_copy(update={"attention_scales": {}}), force=True)
    unscaled = predict([res.samples[i] for i in gd], eff.compute, eff.memory, eff.launch_s, cal.lookup_id_latency_s)
    err_class = np.abs(unscaled / res.measured_s[gd] - 1)
    assert np.median(err) < 0.1 < np.median(err_class)
