"""Gradient accumulation: ``M`` micro-batches per optimizer step train what one pass over the batch trains.

Each micro-batch's loss is its share of the global mean, so the gradients summed over micro-batches
and ranks are those of one pass. Two named cases, each against the same plan on one process with
``M = 1``, with SGD (whose step is linear in the gradient, so only fp32 rounding separates the runs):

- ``gem_tiny``: gem-tiny (jagged history, InterFormer, Kunlun, MoE; table-wise, row-wise and
  data-parallel tables) with ``M = 2`` on 1 and on 2 ranks: the loss curves and the dense weights
  agree to fp32 rounding. The sharded tables' fused optimizer steps in every micro-batch's backward,
  so a later micro-batch reads rows an earlier one moved (the semantics the cost model prices: one
  fused TBE backward per micro-batch); the sparse learning rate is made negligible here so that the
  comparison is of the dense part alone.
- ``dlrm_dp``: a DLRM-shaped workload with every table data-parallel (the dense-kernel optimizer steps
  once per optimizer step, like the dense weights) and ``M = 4`` on 2 ranks: tables and dense weights
  agree too. This is what catches a data-parallel gradient summed twice (TorchRec's DDP all-reduces
  ``.grad`` at every backward).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from coplan.spec import Workload, dump_spec, load_topology, load_workload
from coplan.spec.draw import random_workload
from coplan.planner.given import as_single_process, given_plan

TIMEOUT_S = 240
STEPS = 3


def _train(plan: Path, nproc: int, tmp: Path, run_id: str, data: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Train ``plan`` for STEPS steps; (losses, the final checkpoint's tensors as full tensors)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", "-m",
           "coplan.trainer.train", str(plan), "--device", "cpu", "--steps", str(STEPS), "--warmup", "0",
           "--runs-root", str(tmp / "runs"), "--run-id", run_id, "--data", str(tmp / data), "--data-samples", "256",
           "--no-progress", "--trace", "none"]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, env=dict(os.environ, OMP_NUM_THREADS="1"))
    except subprocess.TimeoutExpired:
        pytest.fail(f"trainer run timed out after {TIMEOUT_S} s")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    run = tmp / "runs" / run_id
    losses = [json.loads(x)["loss"] for x in (run / "metrics.jsonl").read_text().splitlines()]
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    ckpt = sorted((run / "checkpoints").glob("step_*"))[-1]
    dcp_to_torch_save(ckpt, tmp / f"{run_id}.pt")
    state = torch.load(tmp / f"{run_id}.pt", weights_only=False)["model"]
    return losses, {k: v for k, v in state.items() if torch.is_tensor(v) and v.is_floating_point()}


def _with(w: Workload, **batch) -> Workload:
    d = w.model_dump()
    d["batch"] = {**{k: v for k, v in d["batch"].items() if v is not None}, **batch}
    return Workload.model_validate(d)


def _compare(ref, other, *, prefix: str, atol: float) -> None:
    (l0, s0), (l1, s1) = ref, other
    assert l0 == pytest.approx(l1, abs=atol)
    keys = [k for k in s0 if k.startswith(prefix)]
    assert keys and set(keys) <= set(s1)
    for k in keys:
        torch.testing.assert_close(s1[k], s0[k], rtol=0, atol=atol, msg=k)


def test_gem_tiny_micro_batches_match_one_pass(tmp_path):
    w = load_workload("gem-tiny")
    d = w.model_dump()
    d["optimizer"] = {"dense": "sgd", "dense_lr": 0.05, "sparse": "sgd", "sparse_lr": 1e-9}
    w1 = Workload.model_validate(d)
    w2 = _with(w1, micro_batches=2)
    topo = load_topology("h200-hgx-2gpu")
    two = given_plan(w2, topo, 2)  # table-wise, row-wise and data-parallel tables
    assert two.micro_batches == 2 and {t.sharding_type for t in two.tables} >= {"table_wise", "row_wise", "data_parallel"}
    ref = _train(dump_spec(as_single_process(given_plan(w1, topo, 2)), tmp_path / "p1m1.json"), 1, tmp_path, "p1m1", "data")
    one_m2 = _train(dump_spec(as_single_process(two), tmp_path / "p1m2.json"), 1, tmp_path, "p1m2", "data")
    two_m2 = _train(dump_spec(two, tmp_path / "p2m2.json"), 2, tmp_path, "p2m2", "data")
    assert ref[0][-1] != ref[0][0]  # it trains
    _compare(ref, one_m2, prefix="dense.", atol=2e-6)
    _compare(ref, two_m2, prefix="dense.", atol=2e-6)


def test_data_parallel_tables_accumulate_once(tmp_path):
    w = random_workload(3, "sparse", world_size=2, optimizer={"dense": "sgd", "sparse": "sgd"})
    topo = load_topology("h200-hgx-2gpu")
    ref = _train(dump_spec(given_plan(_with(w, micro_batches=1), topo, 1, tables="data_parallel"), tmp_path / "a.json"),
                 1, tmp_path, "d1m1", "data")
    m4 = _train(dump_spec(given_plan(_with(w, micro_batches=4), topo, 2, tables="data_parallel"), tmp_path / "b.json"),
                2, tmp_path, "d2m4", "data")
    _compare(ref, m4, prefix="sparse.", atol=2e-7)
    _compare(ref, m4, prefix="dense.", atol=2e-7)
