"""``coplan simulate``: sweeps, knobs, JSON output, and errors without tracebacks."""

from __future__ import annotations

import json

import pytest

from coplan.cli import main
from coplan.planner.simulate import scale_topology, topology_for
from coplan.spec import load_topology


def run(capsys, *argv):
    rc = main(["simulate", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_gpu_sweep_json(capsys):
    rc, out, err = run(capsys, "-w", "gem-h200", "-t", "h200-superpod", "--gpus", "8,64,2048", "--json")
    assert rc == 0, err
    doc = json.loads(out)
    pts = doc["points"]
    assert [p["gpus"] for p in pts] == [8, 64, 2048]
    for p in pts:
        assert 0 < p["e2e_mfu"] <= p["local_mfu"] <= 1
        assert p["step_time_s"] > 0 and p["memory_bytes"] > 0
    assert pts[2]["topology"] == "h200-superpod-4k"  # the smallest family member with enough GPUs


def test_knob_sweep_table(capsys):
    rc, out, err = run(capsys, "-w", "gem-h200", "-t", "h200-superpod-1k", "--gpus", "64", "--knob", "balancing", "--values", "none,greedy")
    assert rc == 0, err
    assert "none" in out and "greedy" in out and "E2E MFU" in out


def test_small_global_batch_points_are_skipped(capsys):
    rc, out, err = run(capsys, "-w", "gem-tiny", "-t", "h200-superpod-1k", "--gpus", "8,128", "--json")
    assert rc == 0
    pts = json.loads(out)["points"]
    assert "skipped" in pts[1] and "skipped" not in pts[0]


@pytest.mark.parametrize("argv,msg", [
    (["-w", "gem-h200", "-t", "nowhere"], "neither a preset"),
    (["-w", "gem-h200", "-t", "h200-superpod-1k", "--knob", "volume", "--values", "1"], "unknown knob"),
    (["-w", "gem-h200", "-t", "h200-superpod-1k", "--knob", "balancing"], "needs --values"),
    (["-w", "gem-h200", "-t", "h200-superpod-1k", "--gpus", "8,x"], "integers"),
    (["-w", "gem-h200", "-t", "h200-superpod-1k", "--gpus", "64", "--knob", "dense_shard", "--values", "3"], "does not divide"),
])
def test_bad_input_is_a_message_not_a_traceback(capsys, argv, msg):
    rc, out, err = run(capsys, *argv)
    assert rc != 0 and msg in err and "Traceback" not in err


def test_topology_family_extends_past_its_largest_member():
    t, extended = topology_for("h200-superpod", 16384)
    assert extended and t.num_gpus >= 16384 and t.tiers[-1].name == "core"
    base = load_topology("h200-superpod-1k")
    assert scale_topology(base, 512) is base


def test_the_shipped_calibration_prices_the_sweep_unless_told_otherwise(capsys):
    """As `coplan plan` does: the calibration shipped for the topology's GPU by default (the line on stderr
    with --json says which), none with --calibration none, and the two price the step differently."""
    rc, out, err = run(capsys, "-w", "gem-h200", "-t", "h200-1gpu", "--gpus", "1", "--json")
    assert rc == 0 and "shipped (nvidia-h200.json)" in err
    cal = json.loads(out)["points"][0]
    rc, out, err = run(capsys, "-w", "gem-h200", "-t", "h200-1gpu", "--gpus", "1", "--json", "--calibration", "none")
    assert rc == 0 and "calibration: none" in err
    none = json.loads(out)["points"][0]
    assert cal["step_time_s"] != none["step_time_s"]
