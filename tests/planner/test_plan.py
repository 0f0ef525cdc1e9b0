"""The planner end to end with the real cost model: brute-force optimum on small instances,
determinism, capacity, infeasibility explained, the CLI."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from coplan.errors import InfeasibleError
from coplan.planner.search import PlannerConfig, make_plan
from coplan.spec import Workload, load_plan, load_topology, load_workload

from .bruteforce import priced_brute_force

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
"""8 tables (2 of them sequence tables), 6 layers."""

TINY4 = {
    "name": "tiny4",
    "sequences": [{"name": "history", "length": {"kind": "lognormal", "mean": 64, "sigma": 0.8, "min_len": 1, "max_len": 256}}],
    "tables": [
        {"name": "user", "num_rows": 4000000, "dim": 64, "pooling_factor": 1},
        {"name": "interest", "num_rows": 500000, "dim": 64, "pooling_factor": 20},
        {"name": "geo", "num_rows": 20000, "dim": 16, "pooling_factor": 2},
        {"name": "hist_item", "num_rows": 3000000, "dim": 64, "feature_kind": "sequence", "sequence": "history"},
    ],
    "blocks": [
        {"type": "interformer", "sequence": "history", "num_layers": 1, "model_dim": 128, "num_heads": 4, "head_dim": 32, "num_summary_tokens": 4},
        {"type": "kunlun", "num_layers": 1, "num_tokens": 8, "model_dim": 128, "num_heads": 4, "head_dim": 32},
        {"type": "moe", "num_layers": 1, "model_dim": 128, "tokens_per_sample": 8, "num_experts": 4, "top_k": 2, "expert_hidden_dim": 512},
        {"type": "heads", "tasks": ["ctr", "cvr"], "input_dim": 128, "hidden_dims": [64]},
    ],
    "batch": {"local_batch_size": 512},
}
"""4 tables, 5 layers: small enough to price every plan of every mesh candidate with the full pricer."""


def _topology(hbm_bytes: float):
    t = load_topology("h200-superpod-1k")
    return t.model_copy(update={"gpu": t.gpu.model_copy(update={"hbm_bytes": hbm_bytes})})


@pytest.mark.parametrize("hbm", [2.2e9, 3.5e9, 141e9])
def test_no_plan_prices_below_the_returned_one_by_more_than_the_gap(hbm):
    """Every mesh candidate of 2 GPUs, every table option and placement, every minimal recompute set,
    each priced with the cost model's full pricer: no plan prices below the planner's by more than the
    gap it reports, its bound is below every candidate's exhaustive optimum, and each candidate's floor
    bound (what pruning relies on) is below that candidate's optimum."""
    w = Workload.model_validate(TINY4)
    plan, res = make_plan(w, _topology(hbm), None, PlannerConfig(world_size=2, num_workers=1))
    best = math.inf
    priced = 0
    for rec in res.records:
        p = res.pricer.candidate(rec.mesh)
        b, _, n = priced_brute_force(res.pricer, p)
        priced += n
        assert b >= rec.lower_bound_s * (1 - 1e-9)
        if math.isfinite(b):
            assert rec.feasible
        best = min(best, b)
    assert priced > 100
    step = plan.solver.objective_us * 1e-6
    assert step == pytest.approx(plan.predicted.step_time_s, rel=1e-9)
    assert plan.solver.best_bound_us * 1e-6 <= best * (1 + 1e-9)
    assert step <= best * (1 + plan.solver.gap) * (1 + 1e-9)
    assert plan.predicted.peak_memory_bytes <= plan.predicted.hbm_capacity_bytes - plan.predicted.hbm_reserve_bytes


def test_memory_shapes_the_plan():
    w = Workload.model_validate(TINY6)
    roomy, _ = make_plan(w, _topology(141e9), None, PlannerConfig(world_size=8, num_workers=1))
    tight, _ = make_plan(w, _topology(1.55e9), None, PlannerConfig(world_size=8, num_workers=1))
    # the roomy plan does not fit the tight GPU: the tight plan pays (recompute, spread tables) to fit
    assert roomy.predicted.peak_memory_bytes > tight.predicted.hbm_capacity_bytes - tight.predicted.hbm_reserve_bytes
    assert tight.predicted.step_time_s >= roomy.predicted.step_time_s
    for plan in (roomy, tight):
        assert plan.predicted.peak_memory_bytes <= plan.predicted.hbm_capacity_bytes - plan.predicted.hbm_reserve_bytes
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
    assert "no plan fits" in msg and "GB" in msg and "reserve" in msg
    assert err.shortfalls and err.shortfalls[0]["resource"] == "hbm" and err.shortfalls[0]["short_bytes"] > 0
    assert any(f.startswith("more GPUs") for f in err.fixes)


@pytest.mark.parametrize("gpus", [8])
def test_advice_is_verified_by_the_planner(gpus):
    """A global batch too large per GPU on one node: the fixes offered (micro-batches, more GPUs, a
    smaller batch) are each planned again as stated, and the planner returns a plan that fits."""
    from coplan.planner.explain import with_changes

    w, t = load_workload("dense-decoder-8b"), load_topology("h200-superpod-1k")
    with pytest.raises(InfeasibleError) as e:
        make_plan(w, t, None, PlannerConfig(world_size=gpus, num_workers=1))
    fixes = e.value.fixes
    assert any("micro_batches" in f for f in fixes) and any(f.startswith("more GPUs") for f in fixes)
    for f in fixes:
        if "micro_batches:" in f:
            mb = int(f.split("micro_batches:")[1].split()[0])
            plan, _ = make_plan(with_changes(w, **{"batch.micro_batches": mb}), t, None, PlannerConfig(world_size=gpus, num_workers=1))
        elif f.startswith("more GPUs"):
            n = int(f.split("more GPUs: ")[1].split()[0].replace(",", ""))
            plan, _ = make_plan(w, t, None, PlannerConfig(world_size=n, num_workers=1))
        elif "global_batch_size:" in f:
            gb = int(f.split("global_batch_size: ")[1].split()[0].replace(",", ""))
            plan, _ = make_plan(with_changes(w, **{"batch.global_batch_size": gb}), t, None, PlannerConfig(world_size=gpus, num_workers=1))
        else:
            continue
        pred = plan.predicted
        assert pred.peak_memory_bytes <= pred.hbm_capacity_bytes - pred.hbm_reserve_bytes, f


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
