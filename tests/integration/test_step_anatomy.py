"""The fresh-draw benchmark's step anatomy (benchmarks/_step_anatomy.py): one device window per profiled step,
however many streams carry its ProfilerStep range, and the idle share of the measured step."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
anatomy = pytest.importorskip("_step_anatomy")


def _trace() -> dict:
    """Two steps of 10 ms on the compute stream, each also annotated by a short range on a side stream
    (the input dist of the next batch), with 8 ms of kernels in each step."""
    ev = []
    for i, t0 in enumerate((0.0, 10_000.0)):
        ev.append({"ph": "X", "cat": "gpu_user_annotation", "name": f"ProfilerStep#{i}", "ts": t0, "dur": 10_000.0, "tid": 7})
        ev.append({"ph": "X", "cat": "gpu_user_annotation", "name": f"ProfilerStep#{i}", "ts": t0 + 9_900.0, "dur": 300.0, "tid": 20})
        ev += [{"ph": "X", "cat": "kernel", "name": "k", "ts": t0 + 1_000.0 * j, "dur": 1_000.0, "tid": 7} for j in range(8)]
    return {"traceEvents": ev}


def test_one_window_per_step_whatever_the_streams():
    busy, window, kernels = anatomy.device_busy(_trace())
    assert window == pytest.approx(0.010)
    assert busy == pytest.approx(0.008)
    assert kernels == 8


def test_verdict_reads_the_idle_share_off_the_measured_step():
    a = {"device_window_s": 0.010, "gpu_busy_s": 0.008, "gpu_idle_share": 0.2, "kernels": 8}
    assert anatomy.verdict(dict(a), 0.0085).startswith("device-bound")
    assert anatomy.verdict(dict(a), 0.020).startswith("host-bound")  # the replayed step is longer than the device's work
    assert "of 20.0 ms" in anatomy.verdict(dict(a), 0.020)


def test_verdict_names_the_measured_steps_host_phases_largest_first():
    a = {"device_window_s": 0.010, "gpu_busy_s": 0.008, "gpu_idle_share": 0.2, "kernels": 8}
    phases = {"data": 0.001, "forward": 0.007, "backward": 0.005, "optimizer": 0.002}
    line = anatomy.verdict(dict(a), 0.020, phases)
    assert line.startswith("host-bound")
    assert line.endswith("host per measured step 15.0 ms: forward 7.0, backward 5.0, optimizer 2.0, data 1.0")
    assert anatomy.verdict(None, 0.02, phases) == "no trace; host per measured step 15.0 ms: forward 7.0, backward 5.0, optimizer 2.0, data 1.0"
    assert anatomy.verdict(dict(a), 0.020, {}) == anatomy.verdict(dict(a), 0.020)  # a summary without phases
