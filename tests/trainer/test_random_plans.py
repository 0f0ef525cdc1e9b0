"""Every plan the planner can emit runs (issue 21): seeded random workloads of each kind
(:func:`coplan.spec.draw.random_workload`), planned by the real planner (``coplan plan``) and trained by
``coplan train --device cpu`` for 3 steps on gloo; every loss is finite.

Named cases, chosen to cover the shapes at few launches (each torchrun launch costs ~10 s here):

- ``hybrid-9@2``: GEM-shaped, a jagged history, an MoE layer, 2 micro-batches, on 2 ranks;
- ``sparse-8@4``: DLRM-shaped (8 pooled tables, dot interaction), 2 micro-batches, on 4 ranks;
- ``dense-1@2``: a decoder-only transformer over jagged token sequences (no tables), on 2 ranks;
- ``dense-2@1``: the same over fixed-length sequences, 2 micro-batches, on 1 rank.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from coplan.spec import dump_spec, load_plan
from coplan.spec.draw import random_workload

TIMEOUT_S = 300
STEPS = 3
TOPOLOGY = {1: ["-t", "h200-1gpu"], 2: ["-t", "h200-hgx-2gpu"], 4: ["-t", "h200-superpod-1k", "--gpus", "4"]}
CASES = [("hybrid", 9, 2), ("sparse", 8, 4), ("dense", 1, 2), ("dense", 2, 1)]


def _coplan(args: list[str], timeout: int) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-c", "import sys; from coplan.cli import main; sys.exit(main())", *args]
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=dict(os.environ, OMP_NUM_THREADS="1"))
    except subprocess.TimeoutExpired:
        pytest.fail(f"coplan {args[0]} timed out after {timeout} s")


@pytest.mark.parametrize("kind, seed, world", CASES, ids=[f"{k}-{s}@{n}" for k, s, n in CASES])
def test_a_planned_random_workload_trains(kind, seed, world, tmp_path):
    w = random_workload(seed, kind, "cpu", world_size=world)
    wfile = dump_spec(w, tmp_path / "workload.yaml")
    out = _coplan(["plan", "-w", str(wfile), *TOPOLOGY[world], "-o", str(tmp_path / "plan.json"), "--quiet"], 120)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    plan = load_plan(tmp_path / "plan.json")
    assert plan.world_size == world
    out = _coplan(["train", str(tmp_path / "plan.json"), "--device", "cpu", "--steps", str(STEPS), "--no-progress",
                   "--runs-root", str(tmp_path / "runs"), "--run-id", "r", "--trace", "none", "--checkpoint-every", "-1"],
                  TIMEOUT_S)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = [json.loads(x) for x in (tmp_path / "runs" / "r" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(STEPS))
    assert all(r["loss"] is not None and math.isfinite(r["loss"]) for r in rows)
    assert all(r["model_flops"] > 0 for r in rows)
    for r in rows:  # one longest length per micro-batch, per sequence
        assert all(len(v) == plan.micro_batches for v in r["seq_max"].values())
    if kind == "dense":
        assert set(rows[0]["task_loss"]) == {"next_token:tokens"}
    else:
        assert set(rows[0]["task_loss"]) == set(next(b for b in w.blocks if b.type == "heads").tasks)
    assert (tmp_path / "runs" / "r" / "summary.json").is_file()
