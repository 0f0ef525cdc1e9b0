"""The FP8 numerics guard (coplan.trainer.fp8_guard): what a check records, when a layer trips, and that a
tripped layer runs as the plain linear layer from then on. CPU: the rowwise recipe's emulation."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from coplan.kernels.fp8 import Float8Linear
from coplan.trainer.fp8_guard import Fp8Guard


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(Float8Linear(64, 64, recipe="rowwise"), nn.ReLU(), Float8Linear(64, 32, recipe="rowwise"))


def _step(model, guard, step, x):
    guard.begin_step(step)
    model(x).square().mean().backward()
    model.zero_grad()
    return guard.end_step(step)


def test_checks_record_on_check_steps_only_and_keep_healthy_layers_in_fp8():
    model = _model()
    guard = Fp8Guard(model, every=3, tol=0.15)
    x = torch.randn(300, 64)
    for step in range(7):
        assert _step(model, guard, step, x) == []
    h = guard.history["0"]
    assert h.checks == 3  # steps 0 (the first), 3 and 6
    assert len(h.amax) == 3 and h.amax[0] == pytest.approx(float(x.abs().max()), rel=1e-6)
    assert all(0 < e < 0.1 for e in h.errors)  # e4m3 rowwise on normal operands: a few percent
    assert guard.fallen_back() == [] and h.overflows == 0
    note = guard.note()
    assert "2 FP8 linear layer(s) checked 3 time(s)" in note and "no layer fell back" in note
    assert all(not m.check and not m.stats for m in guard.modules.values())  # nothing recorded off the check steps


def test_a_non_finite_output_trips_the_layer_which_then_runs_as_nn_linear():
    model = _model()
    guard = Fp8Guard(model, every=1)
    x = torch.randn(64, 64)
    x[3, 5] = float("inf")
    trips = _step(model, guard, 0, x)
    assert [t.module for t in trips] == ["0", "2"]  # the second layer's input is the first's inf
    assert "non-finite" in trips[0].reason
    first = guard.modules["0"]
    assert not first.fp8_enabled and guard.history["0"].overflows > 0
    y = torch.randn(8, 64)
    torch.testing.assert_close(first(y), nn.functional.linear(y, first.weight, first.bias))
    assert "fell back to the compute dtype: 0 at step 0" in guard.note()


def test_an_error_above_tolerance_trips():
    model = _model()
    guard = Fp8Guard(model, every=1, tol=1e-4)
    trips = _step(model, guard, 0, torch.randn(64, 64))
    assert {t.module for t in trips} == {"0", "2"}
    assert all("off the compute dtype" in t.reason for t in trips)


def test_an_amax_spike_trips_after_enough_history():
    model = _model()
    guard = Fp8Guard(model, every=1, spike=100.0, min_history=4)
    x = torch.randn(64, 64)
    for step in range(4):
        assert _step(model, guard, step, x) == []
    trips = _step(model, guard, 4, x * 1e4)
    assert trips and trips[0].module == "0" and "amax" in trips[0].reason


def test_off_and_bad_settings():
    model = _model()
    guard = Fp8Guard(model, every=0)
    assert not guard.active and _step(model, guard, 0, torch.randn(4, 64)) == []
    assert "guard off" in guard.note()
    with pytest.raises(ValueError):
        Fp8Guard(model, tol=0.0)
    assert Fp8Guard(nn.Linear(4, 4)).note() == ""
