"""The planner end to end with the real cost model: brute-force optimum on small instances,
determinism, capacity, infeasibility explained, the CLI."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from coplan.errors import InfeasibleError
from coplan.planner.pricing import evaluate
from coplan.planner.search import PlannerConfig, make_plan
from coplan.spec import Workload, load_plan, load_topology, load_workload

from .bruteforce import brute_force

TINY6 = {
    "name": "tiny6",
    "sequences": [{"name": "history", "length": {"kind": "lognormal", "mean": 64, "sigma": 0.8, "min_len": 1, "max_len": 256}}],
    "tables": [
        {"name": "user", "num_rows": 4000000, "dim": 32, "pooling_factor": 1},
        {"name": "ad", "num_rows": 2000000, "dim": 32, "pooling_factor": 1},
        {"name": "interest", "num_rows": 500000, "dim": 16, "pooling_factor": 20},
        {"name": "geo", "num_rows": 200000, "dim": 16, "pooling_factor": 2},
        {"name": "query", "num_rows": 1000000, "dim": 16, "pooling_factor": 8},
        {"name": "page", "num_rows": 300000, "dim": 16, "pooling_factor": 4},
        {"name": "hist_item", "num_rows": 3000000, "dim": 32, "feature_kind": "sequence", "sequence": "history"},
        {"name": "hist_action", "num_rows": 64, "dim": 16, "feature_kind": "sequence", "sequence": "history"},
    ],
    "blocks": [
        {"type": "interformer", "sequence": "history", "num_layers": 2, "model_dim": 128, "num_heads": 4, "head_dim": 32, "num_summary_tokens": 4},
        {"type": "kunlun", "num_layers": 1, "num_tokens": 8, "model_dim": 128, "num_heads": 4, "head_dim": 32},
        {"type": "moe", "num_layers": 1, "model_dim": 128, "tokens_per_sample": 8, "num_experts": 4, "top_k": 2, "expert_hidden_dim": 512},
        {"type": "heads", "tasks": ["ctr", "cvr"], "input_dim": 128, "hidden_dims": [64]},
    ],
    "batch": {"local_batch_size": 512},
}
"""8 tables (2 of them sequence tables), 6 layers: small enough to enumerate every plan."""

EXACT = dict(num_workers=1, solve_dtime=20.0, gap_tolerance=0.0, relative_gap=0.0, time_limit_s=600.0)


def _topology(hbm_bytes: float):
    t = load_topology("h200-superpod-1k")
    return t.model_copy(update={"gpu": t.gpu.model_copy(update={"hbm_bytes": hbm_bytes})})


@pytest.mark.parametrize("gpus,hbm", [(4, 3.0e9), (8, 2.6e9)])
def test_plan_equals_brute_force_optimum(gpus, hbm):
    """Every mesh candidate, every table option and placement, every recompute set: the planner's
    plan is the optimum of the same cost model (the cost model's figures, combined by the planner's
    step formula), and its bound is valid."""
    w = Workload.model_validate(TINY6)
    plan, res = make_plan(w, _topology(hbm), None, PlannerConfig(world_size=gpus, **EXACT))
    assert plan.solver.status == "OPTIMAL"
    best = math.inf
    enumerated = 0
    for rec in sorted(res.records, key=lambda r: r.lower_bound_s):
        if gpus > 4 and rec.lower_bound_s >= best:
            continue  # at 8 GPUs, skip candidates whose (checked-valid at 4 GPUs) bound cannot win
        p = res.pricer.candidate(rec.mesh)
        b, _, n = brute_force(p, initial_best=math.inf if gpus <= 4 else best)
        enumerated += n
        if gpus <= 4:  # every candidate enumerated: its cheap bounds must hold
            assert b >= rec.lower_bound_s - 1e-12
            assert rec.feasible or math.isinf(b)
        best = min(best, b)
    assert enumerated > 50
    assert plan.solver.objective_us * 1e-6 == pytest.approx(best, rel=1e-6)
    assert plan.solver.best_bound_us * 1e-6 <= best * (1 + 1e-9)
    ev = evaluate(res.pricing, res.assignment)
    assert ev.peak_bytes <= hbm
    assert plan.predicted.peak_memory_bytes <= plan.predicted.hbm_capacity_bytes


def test_memory_shapes_the_plan():
    w = Workload.model_validate(TINY6)
    roomy, _ = make_plan(w, _topology(141e9), None, PlannerConfig(world_size=8, num_workers=1))
    tight, _ = make_plan(w, _topology(2.6e9), None, PlannerConfig(world_size=8, num_workers=1))
    assert tight.mesh.sparse_shard > roomy.mesh.sparse_shard  # tables must be spread when HBM is short
    for plan in (roomy, tight):
        assert plan.predicted.peak_memory_bytes <= plan.predicted.hbm_capacity_bytes
        assert {t.table for t in plan.tables} == {t.name for t in w.all_tables}


def test_plans_are_deterministic_for_a_seed():
    w = load_workload("gem-tiny")
    t = load_topology("h200-superpod-1k")
    cfg = PlannerConfig(world_size=16, num_workers=2, seed=7, solve_dtime=0.2)
    a, _ = make_plan(w, t, None, cfg)
    b, _ = make_plan(w, t, None, cfg)
    assert a.mesh == b.mesh and a.tables == b.tables and a.layers == b.layers and a.balancing == b.balancing
    assert a.solver.objective_us == b.solver.objective_us and a.solver.best_bound_us == b.solver.best_bound_us


def test_nothing_fits_is_explained():
    w = load_workload("gem-1t")
    t = load_topology("h200-1gpu")
    with pytest.raises(InfeasibleError) as e:
        make_plan(w, t, None, PlannerConfig(num_workers=1))
    err = e.value
    msg = str(err)
    assert "no plan fits" in msg and "GB" in msg and "more GPUs" in msg
    assert err.shortfalls and err.shortfalls[0]["resource"] == "hbm" and err.shortfalls[0]["short_bytes"] > 0
    assert any("GPUs" in f for f in err.fixes) and any("bf16" in f for f in err.fixes)


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "coplan.cli", *args], capture_output=True, text=True, timeout=300)


def test_cli_writes_a_valid_plan(tmp_path):
    out = tmp_path / "plan.json"
    r = _cli("plan", "-t", "h200-superpod-1k", "-w", "gem-tiny", "--gpus", "8", "-o", str(out), "--json", "--workers", "1")
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)
    plan = load_plan(out)
    assert plan.world_size == 8 and summary["world_size"] == 8
    assert plan.solver is not None and plan.predicted is not None and plan.topology_sha256 and plan.coplan_version
    assert set(summary["mesh"]) >= {"dp_shard", "sparse_shard"}
    r = _cli("plan", "-t", "h200-superpod-1k", "-w", "gem-tiny", "--gpus", "8", "-o", str(tmp_path / "p2.json"), "--workers", "1")
    assert r.returncode == 0 and "E2E MFU" in r.stdout and "peak memory / rank" in r.stdout and "gap" in r.stdout


def test_cli_infeasible_exits_nonzero_without_traceback(tmp_path):
    r = _cli("plan", "-t", "h200-1gpu", "-w", "gem-1t", "-o", str(tmp_path / "p.json"))
    assert r.returncode == 3
    assert "Traceback" not in r.stderr and "no plan fits" in r.stderr
    r = _cli("plan", "-t", "h200-superpod-1k", "-w", "gem-tiny", "--gpus", "100000", "-o", str(tmp_path / "p.json"))
    assert r.returncode == 2 and "exceeds" in r.stderr and "Traceback" not in r.stderr
