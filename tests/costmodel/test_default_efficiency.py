"""The uncalibrated defaults measured by benchmarks, recomputed from their result files: the attention efficiency
(the kernel benchmark) and the device gap (the idle time per kernel in device-bound trainer traces)."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from statistics import NormalDist

import numpy as np

import pytest

from coplan.costmodel.compute import tile_pairs, triton_tile_sizes
from coplan.costmodel.efficiency import (
    DEFAULT_ATTENTION_EFFICIENCY,
    DEFAULT_DEVICE_GAP_S,
    DEVICE_IDLE_PER_KERNEL_S,
    HOST_KERNELS_PER_PRICED_LAUNCH,
    resolve_efficiencies,
)
from coplan.spec import Calibration, load_calibration, load_topology

RESULT = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "attention_h200.json"


# benchmarks/attention.py's shapes: batch, log-normal lengths (mean, sigma, cap) taken at evenly spaced quantiles
_SHAPES = {"a": (32, 1024, 1.0, 4096), "b": (256, 256, 1.0, 1024)}


def _tile_factor(key: str) -> float:
    """The tiles' pairs over the priced pairs at a benchmark shape (causal self-attention)."""
    n, mean, sigma, cap = _SHAPES[key]
    mu = math.log(mean) - sigma**2 / 2
    nd = NormalDist()
    L = np.array([min(max(round(math.exp(mu + sigma * nd.inv_cdf((i + 0.5) / n))), 1), cap) for i in range(n)], float)
    bm, bn = triton_tile_sizes(L.max(), L.max())
    return float(tile_pairs(L, L, True, bm, bn).sum() / (L * (L + 1) / 2).sum())


def _measured_fraction() -> float:
    d = json.loads(RESULT.read_text())
    vals = []
    for key, shape in d["shapes"].items():
        for method in ("triton_softmax", "triton_gdpa_silu"):
            r = shape["methods"][method]
            # the graphed (device-bound) fwd+bwd rate, in the cost model's FLOPs (model / counted of the eager run),
            # in the tiles the kernels compute (what the pricer charges them)
            vals.append(r["graph_forward_backward_tflops"] * r["forward_backward_model_tflops"] / r["forward_backward_tflops"]
                        * _tile_factor(key))
    assert len(vals) == 4
    return math.exp(sum(math.log(v) for v in vals) / len(vals)) * 1e12 / 989.0e12


def test_attention_default_is_the_kernel_benchmark_measurement():
    assert DEFAULT_ATTENTION_EFFICIENCY["bf16"] == pytest.approx(_measured_fraction(), abs=0.005)
    assert DEFAULT_ATTENTION_EFFICIENCY["fp16"] == DEFAULT_ATTENTION_EFFICIENCY["bf16"]


def test_uncalibrated_topology_takes_the_default_and_a_calibration_replaces_it():
    topo = load_topology("h200-1gpu")
    eff = resolve_efficiencies(topo, None)
    assert eff.compute_eff("attention", "bf16") == pytest.approx(DEFAULT_ATTENTION_EFFICIENCY["bf16"])
    cal = load_calibration(Path(__file__).resolve().parents[2] / "calibration" / "data" / "nvidia-h200.json")
    fitted = cal.op_classes["attention"].compute_efficiency["bf16"]
    assert resolve_efficiencies(topo, cal).compute_eff("attention", "bf16") == pytest.approx(fitted)


# --- the uncalibrated device gap --------------------------------------------------------------------------------

GAP_RESULT = RESULT.parent / "device_gap.json"


def test_device_idle_default_is_the_trace_measurement():
    d = json.loads(GAP_RESULT.read_text())
    kept = [r for r in d["rows"] if r.get("device_bound")]
    assert len(kept) == d["summary"]["traces_kept"] >= 2
    for r in kept:  # each trace's figure is its idle time over its device units, per step
        assert r["idle_us_per_unit"] == pytest.approx(r["idle_ms_per_step"] * 1e3 / r["device_units_per_step"], rel=1e-9)
        assert r["busy_share"] >= d["min_busy"]
    assert DEVICE_IDLE_PER_KERNEL_S * 1e6 == pytest.approx(d["summary"]["idle_us_per_unit_mean"], abs=0.01)
    assert DEFAULT_DEVICE_GAP_S == pytest.approx(HOST_KERNELS_PER_PRICED_LAUNCH * DEVICE_IDLE_PER_KERNEL_S)


def test_default_gap_only_where_no_calibration_fits_the_device():
    topo = load_topology("h200-1gpu")
    eff = resolve_efficiencies(topo, None)
    assert eff.device_gap_s == pytest.approx(DEFAULT_DEVICE_GAP_S)
    assert "default" in eff.sources["device_gap"]
    bare = resolve_efficiencies(topo, None, default_gap=False)
    assert bare.device_gap_s == 0.0
    for c, v in eff.launch_s.items():  # every class's launch cost carries it, as a calibration's gap does
        assert v == pytest.approx(bare.launch_s[c] + DEFAULT_DEVICE_GAP_S)
    data = Path(__file__).resolve().parents[2] / "calibration" / "data"
    h200 = load_calibration(data / "nvidia-h200.json")  # fits a device-step factor: no default gap on top
    assert h200.device_gap_s is None and h200.device_step_factor
    assert resolve_efficiencies(topo, h200).device_gap_s == 0.0
    h100 = load_calibration(data / "nvidia-h100.json")  # its own fitted gap, not the default
    e100 = resolve_efficiencies(load_topology("h100-1gpu"), h100)
    assert e100.device_gap_s == pytest.approx(h100.device_gap_s) and "calibration" in e100.sources["device_gap"]
    # a calibration of collectives alone fits no device term: the default gap stays
    coll = Calibration(device=topo.gpu.name)
    assert resolve_efficiencies(topo, coll).device_gap_s == pytest.approx(DEFAULT_DEVICE_GAP_S)


def test_default_gap_prices_each_priced_launch(monkeypatch):
    """The uncalibrated step grows by the gap times the priced device launches (a device-bound plan: one
    GPU, no host priced), and twice the gap adds twice as much."""
    from coplan.costmodel import build_context, price
    from coplan.costmodel import efficiency as E
    from coplan.costmodel.pricer import priced_launches
    from coplan.planner.heuristic import heuristic_plan_choices
    from coplan.spec import load_workload

    w, t = load_workload("gem-h200"), load_topology("h200-1gpu")
    hp = heuristic_plan_choices(w, t, 1)
    steps = {}
    for g in (0.0, DEFAULT_DEVICE_GAP_S, 2 * DEFAULT_DEVICE_GAP_S):
        monkeypatch.setattr(E, "DEFAULT_DEVICE_GAP_S", g)
        ctx = build_context(w, t, hp.mesh)
        assert ctx.eff.device_gap_s == pytest.approx(g)
        c = price(ctx, hp.tables, hp.layers, hp.balancing)
        steps[g] = c.step_time_s
        if g:
            assert any("uncalibrated default" in n for n in c.notes)
        if g == DEFAULT_DEVICE_GAP_S:
            notes = c.notes
    d1 = steps[DEFAULT_DEVICE_GAP_S] - steps[0.0]
    d2 = steps[2 * DEFAULT_DEVICE_GAP_S] - steps[0.0]
    assert d1 > 0 and d2 == pytest.approx(2 * d1, rel=0.05)
    # the note counts the priced launches the gap was charged on; on the critical path it is at most all of them
    note = next(n for n in notes if n.startswith("device gaps"))
    m = re.search(r"x ([\d,]+) launches = ([\d.]+) ms", note)
    launches, total_ms = float(m.group(1).replace(",", "")), float(m.group(2))
    assert total_ms == pytest.approx(DEFAULT_DEVICE_GAP_S * launches * 1e3, rel=0.01)
    assert d1 <= total_ms * 1e-3 * 1.01
