"""The planner's per-layer bf16/fp8 choice: tiny GEMMs stay bf16 under auto, big ones go fp8, the
numerics guard holds, force overrides it, and the plan reports the choice and its predicted gain."""

from __future__ import annotations

import io

import pytest

from coplan.costmodel.context import build_context
from coplan.planner.cli import print_summary, summary
from coplan.planner.precision import choose_layer_precision
from coplan.planner.search import PlannerConfig, make_plan
from coplan.spec import LayerPlan, MeshPlan, Workload, load_topology

H200 = load_topology("h200-1gpu")


def workload(fp8: str, *, batch: int = 131072, min_dim: int = 1024) -> Workload:
    """131,072 rows by default: the per-call FP8 overhead measured on the H200 (~1 ms fwd+bwd) makes
    fp8 pay only on GEMMs of several ms. dense_mlp.0: 64 → 4096 (under the guard); dense_mlp.1: 4096 → 4096 (big);
    dense_mlp.2: 4096 → 64 and dense_mlp.3: 64 → 4096 (under the guard); kunlun over 1 token of width 4096 (GEMMs of
    few rows: small); the heads. 64 dense input features: with thousands per sample the data loader, not the GEMMs,
    would set the step (``coplan.costmodel.loader``)."""
    return Workload.model_validate({
        "name": "mixed", "tables": [{"name": "t", "num_rows": 1000, "dim": 64, "pooling_factor": 1}],
        "blocks": [
            {"type": "dense_mlp", "num_dense_features": 64, "hidden_dims": [4096, 4096, 64], "out_tokens": 1},
            {"type": "kunlun", "num_layers": 1, "num_tokens": 1, "model_dim": 4096, "num_heads": 32, "head_dim": 128},
            {"type": "heads", "tasks": ["ctr", "cvr"], "input_dim": 4096, "hidden_dims": [4096]},
        ],
        "batch": {"local_batch_size": batch},
        "precision": {"fp8": fp8, "fp8_min_dim": min_dim},
    })


def choose(w: Workload, recompute: frozenset[str] = frozenset()):
    ctx = build_context(w, H200, MeshPlan(dense_shard=1, sparse_shard=1))
    layers = [LayerPlan(name=n, recompute=n in recompute) for n in ctx.layer_names]
    new, report = choose_layer_precision(ctx, layers)
    return {lp.name: lp.precision for lp in new}, report


def test_auto_puts_big_gemms_in_fp8_and_keeps_small_and_guarded_ones_in_bf16():
    prec, report = choose(workload("auto"))
    why = {c.name: c.reason for c in report.layers}
    assert prec["dense_mlp.1"] == "fp8" and why["dense_mlp.1"] == "pays"
    for n in ("dense_mlp.0", "dense_mlp.2", "dense_mlp.3"):
        assert prec[n] == "bf16" and why[n].startswith("guard: GEMM dim 64"), n
    assert prec["heads.0"] == "bf16" and why["heads.0"] == "guard: task head"
    # kunlun.0 runs its 4096-wide GEMMs on 1 token per sample; fewer rows than the big MLP but allowed
    assert why["kunlun.0"] in ("pays", "slower in fp8")
    for c in report.layers:  # every fp8 choice is a predicted gain, every 'slower' a predicted loss
        if c.reason == "pays":
            assert c.fp8_s < c.bf16_s
        if c.reason == "slower in fp8":
            assert c.fp8_s >= c.bf16_s * (1 - 1e-3)
    assert 0 < report.step_time_s < report.bf16_step_time_s and report.gain > 0


def test_auto_keeps_tiny_gemms_in_bf16_even_without_the_guard():
    """With the guard off (fp8_min_dim 1) the choice is the cost model's alone: on 16 rows per step,
    casting a 4096 × 4096 weight costs more than the fp8 GEMM saves."""
    prec, report = choose(workload("auto", batch=16, min_dim=1))
    assert prec["dense_mlp.1"] == "bf16"
    assert {c.name: c.reason for c in report.layers}["dense_mlp.1"] == "slower in fp8"
    prec_big, _ = choose(workload("auto", batch=131072, min_dim=1))
    assert prec_big["dense_mlp.1"] == "fp8"


def test_force_overrides_the_guard_and_off_writes_nothing():
    prec, report = choose(workload("force", batch=16))
    assert all(p == "fp8" for p in prec.values())  # every layer has a linear layer; the guard is off
    assert {c.reason for c in report.layers} == {"forced"}
    prec_off, report_off = choose(workload("off"))
    assert report_off is None and set(prec_off.values()) == {"bf16"}


def test_recompute_counts_the_forward_twice():
    _, plain = choose(workload("auto"))
    _, rc = choose(workload("auto"), frozenset({"dense_mlp.1"}))
    a = {c.name: c for c in plain.layers}["dense_mlp.1"]
    b = {c.name: c for c in rc.layers}["dense_mlp.1"]
    assert b.bf16_s > a.bf16_s and b.fp8_s > a.fp8_s
    assert b.bf16_s - b.fp8_s > a.bf16_s - a.fp8_s  # the recomputed forward gains again


def test_make_plan_reports_the_choice_and_the_gain():
    plan, _ = make_plan(workload("auto"), H200, config=PlannerConfig(num_workers=1, max_solves=2))
    r = plan.precision_report
    assert r is not None and r.mode == "auto" and r.recipe == "rowwise"
    assert {lp.name for lp in plan.layers if lp.precision == "fp8"} == set(r.fp8_layers) and "dense_mlp.1" in r.fp8_layers
    assert plan.predicted.step_time_s == pytest.approx(r.step_time_s, rel=1e-6)
    assert any(n.startswith("fp8 (auto, rowwise)") for n in plan.predicted.notes)
    s = summary(plan)
    assert s["fp8"]["layers"] == list(r.fp8_layers) and s["fp8"]["predicted_gain"] == pytest.approx(r.gain)
    out = io.StringIO()
    print_summary(plan, out)
    line = next(ln for ln in out.getvalue().splitlines() if ln.startswith("fp8 "))
    assert f"{len(r.fp8_layers)} of {len(r.layers)} layers" in line and "all-bf16" in line
    plain, _ = make_plan(workload("off"), H200, config=PlannerConfig(num_workers=1, max_solves=2))
    assert plain.precision_report is None and all(lp.precision == "bf16" for lp in plain.layers)
    assert plan.predicted.step_time_s < plain.predicted.step_time_s


def test_blockwise_fused_prices_the_fused_ffns_and_names_them():
    """Under ``blockwise-fused`` the per-layer choice weighs the fused FFN (InterFormer and Kunlun layers
    cheaper in fp8 than under ``blockwise``, every other layer the same), and the line names the layers
    whose FFN runs fused, with each fp8 layer's predicted change in compute."""
    from coplan.planner.precision import fused_ffn_of, precision_line
    from coplan.spec import load_workload

    def gem(recipe: str) -> Workload:
        w = load_workload("gem-h200")
        return w.model_copy(update={"precision": w.precision.model_copy(update={"fp8": "force", "fp8_recipe": recipe})})

    _, blk = choose(gem("blockwise"))
    _, fus = choose(gem("blockwise-fused"))
    b = {c.name: c for c in blk.layers}
    for c in fus.layers:
        assert c.bf16_s == pytest.approx(b[c.name].bf16_s)
        if c.name.startswith(("interformer.", "kunlun.")):
            assert c.fp8_s < b[c.name].fp8_s, c.name
        else:
            assert c.fp8_s == pytest.approx(b[c.name].fp8_s), c.name
    assert fus.step_time_s < blk.step_time_s
    fused = fused_ffn_of(fus, gem("blockwise-fused"))
    assert fused == tuple(n for n in fus.fp8_layers if n.startswith(("interformer.", "kunlun.")))
    assert fused_ffn_of(blk, gem("blockwise")) == ()
    line = precision_line(fus, gem("blockwise-fused"))
    assert "interformer.0 (FFN fused)" in line and f"FFN fused in {len(fused)} of them" in line
    c0 = {c.name: c for c in fus.layers}["interformer.0"]
    assert f"{(c0.fp8_s - c0.bf16_s) * 1e3:+,.3f} ms" in line
    assert "(FFN fused)" not in precision_line(blk, gem("blockwise"))
