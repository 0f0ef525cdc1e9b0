"""The host-overhead switches change where work runs, not what is computed: a gem-tiny run with the
dense optimizer stepped on FSDP2's local shards, the input dist one batch ahead and one FSDP2 unit on
its one rank (the defaults) gives the same losses, bit for bit, as one with all three off
(``host_overhead_off.py``: the trainer has no switch for them)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from coplan.spec import dump_spec, load_topology, load_workload
from coplan.planner.given import single_process_plan

TIMEOUT_S = 300
OFF = Path(__file__).with_name("host_overhead_off.py")


def _run(plan, tmp_path, run_id: str, entry: list[str]) -> list[dict]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1", *entry, str(plan), "--device", "cpu", "--steps", "5", "--warmup", "1", "--runs-root", str(tmp_path / "runs"),
           "--run-id", run_id, "--data", str(tmp_path / "data"), "--data-samples", "64", "--no-progress",
           "--checkpoint-every", "-1", "--trace", "none"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, env=env)
    except subprocess.TimeoutExpired:
        pytest.fail(f"trainer run timed out after {TIMEOUT_S} s")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    run_dir = tmp_path / "runs" / run_id
    notes = json.loads((run_dir / "summary.json").read_text())["notes"]
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()], notes


def test_host_overhead_switches_keep_the_losses(tmp_path):
    plan = dump_spec(single_process_plan(load_workload("gem-tiny"), load_topology("h200-1gpu"), attention_backend="reference"),
                     tmp_path / "plan.json")
    on, notes_on = _run(plan, tmp_path, "on", ["-m", "coplan.trainer.train"])
    off, notes_off = _run(plan, tmp_path, "off", [str(OFF)])
    assert "stepped on local shards" in notes_on and "one batch ahead" in notes_on and "the dense root only" in notes_on
    assert "through DTensor" in notes_off and "input dist in forward" in notes_off and "one per layer" in notes_off
    assert [r["step"] for r in on] == list(range(5))
    assert [r["loss"] for r in on] == [r["loss"] for r in off]
    assert [r["task_loss"] for r in on] == [r["task_loss"] for r in off]
    assert on[-1]["loss"] != on[0]["loss"]  # it trains: equal curves are not two frozen models

    # seq_max (what calibration reads for the padded reference) is each step's longest history, and
    # agrees with the same line's seq_stats: regenerate the batches on the host and compare
    from coplan.calibration.terms import PADDED_SUFFIX
    from coplan.calibration.runs import measured_moments
    from coplan.trainer.data import BatchReader

    w = load_workload("gem-tiny")
    reader = BatchReader(w, tmp_path / "data", world_size=1, rank=0, policy=json.loads(plan.read_text())["balancing"]["policy"],
                         global_batch=w.batch.global_(1))
    for row in on:
        lengths = reader.read(row["step"]).seq_lengths
        assert set(row["seq_max"]) == set(lengths) and lengths
        for seq, v in lengths.items():
            assert row["seq_max"][seq] == [int(v.max())]
            n, total, _ = row["seq_stats"][seq]
            assert n == v.size and total == v.sum() and row["seq_max"][seq][0] * n >= total
    moments = measured_moments(on)
    for seq in on[0]["seq_max"]:
        assert moments[seq + PADDED_SUFFIX][0] == pytest.approx(sum(r["seq_max"][seq][0] for r in on) / len(on))
