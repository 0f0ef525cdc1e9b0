"""The uncalibrated attention default is the kernel benchmark's measurement, recomputed from its result file."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from coplan.costmodel.efficiency import DEFAULT_ATTENTION_EFFICIENCY, resolve_efficiencies
from coplan.spec import load_calibration, load_topology

RESULT = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "attention_h200.json"


def _measured_fraction() -> float:
    d = json.loads(RESULT.read_text())
    vals = []
    for shape in d["shapes"].values():
        for method in ("triton_softmax", "triton_gdpa_silu"):
            r = shape["methods"][method]
            # the graphed (device-bound) fwd+bwd rate, in the cost model's FLOPs (model / counted of the eager run)
            vals.append(r["graph_forward_backward_tflops"] * r["forward_backward_model_tflops"] / r["forward_backward_tflops"])
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
