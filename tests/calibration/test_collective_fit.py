"""Collective fit (issue 11): recovery from sweeps the cost model synthesises, consistency with the cost
model's own pricing, the cap at efficiency 1, readable errors, a real gloo sweep, and the CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from coplan.calibration.collective_fit import (FIT_KINDS, CollectiveFitError, apply_to_topology, fit_sweep, load_sweep,
                                               merge_into_calibration, predict_time, sweep_from_dict)
from coplan.cli import main
from coplan.spec import Calibration, OpClassCalibration, dump_spec, load_calibration, load_topology

from ._sweep import synthesize_sweep

REPO = Path(__file__).resolve().parents[2]
SIZES = [8192 * 2**i for i in range(18)]  # 8 KiB .. 1 GiB, as the benchmark sweeps
TRUE_EFF = {"all_gather": 0.71, "reduce_scatter": 0.63, "all_reduce": 0.78, "all_to_all": 0.52}


def with_nvlink(topo, latency_s: float, eff: dict, bw: float | None = None):
    t0 = topo.tiers[0]
    upd = {"latency_s": latency_s, "collective_efficiency": {**t0.collective_efficiency, **eff}}
    if bw:
        upd["bw_bytes_per_s"] = bw
    return topo.model_copy(update={"tiers": (t0.model_copy(update=upd),) + tuple(topo.tiers[1:])})


def sweep_json(sweep) -> dict:
    """The benchmark's JSON layout for a Sweep (what ``load_sweep`` reads)."""
    return {"world_size": sweep.world_size, "device_name": sweep.device,
            "cases": [{"kind": p.kind, "dtype": p.dtype, "bytes": p.nbytes, "time_s": p.time_s} for p in sweep.points]}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_recovers_latency_and_efficiencies_from_noisy_sweep(seed):
    base = load_topology("h200-hgx-2gpu")
    true = with_nvlink(base, 9e-6, TRUE_EFF)
    sweep = synthesize_sweep(true, 2, SIZES, noise=0.03, seed=seed)
    fit = fit_sweep(sweep, base)  # starts from the preset's figures, not the truth
    assert fit.tier == "nvlink" and fit.num_points == 4 * len(SIZES)
    for k, e in TRUE_EFF.items():
        assert fit.efficiencies[k] == pytest.approx(e, rel=0.04), k
    assert fit.latency_s == pytest.approx(9e-6, rel=0.15)
    assert fit.median_abs_rel_error < 0.04
    assert fit.default_median_abs_rel_error > 3 * fit.median_abs_rel_error  # the preset's figures were off


def test_noiseless_fit_is_exact_and_applied_topology_prices_like_the_fit():
    base = load_topology("h200-hgx-2gpu")
    true = with_nvlink(base, 5e-6, TRUE_EFF)
    sweep = synthesize_sweep(true, 2, SIZES)
    fit = fit_sweep(sweep, base)
    assert fit.max_abs_rel_error < 1e-6
    assert fit.latency_s == pytest.approx(5e-6, rel=1e-5)
    applied = apply_to_topology(base, fit)
    for k in FIT_KINDS:
        assert fit.efficiencies[k] == pytest.approx(TRUE_EFF[k], rel=1e-5)
        np.testing.assert_allclose(predict_time(applied, k, SIZES, 2), predict_time(true, k, SIZES, 2), rtol=1e-6)


def test_fit_on_superpod_nvlink_matches_fit_on_the_two_gpu_preset():
    """Same NVLink tier (450 GB/s per GPU): a 2-GPU group on the superpod crosses only it, so the fits agree."""
    base, sp = load_topology("h200-hgx-2gpu"), load_topology("h200-superpod-1k")
    sweep = synthesize_sweep(with_nvlink(base, 7e-6, TRUE_EFF), 2, SIZES, noise=0.02, seed=3)
    a, b = fit_sweep(sweep, base), fit_sweep(sweep, sp)
    assert a.latency_s == pytest.approx(b.latency_s, rel=1e-4)
    for k in FIT_KINDS:
        assert a.efficiencies[k] == pytest.approx(b.efficiencies[k], rel=1e-4)


def test_apply_to_superpod_changes_only_the_nvlink_tier_and_speeds_up_an_8gpu_allreduce():
    base, sp = load_topology("h200-hgx-2gpu"), load_topology("h200-superpod-4k")
    fit = fit_sweep(synthesize_sweep(with_nvlink(base, 4e-6, {**TRUE_EFF, "all_reduce": 0.95}), 2, SIZES), base)
    out = apply_to_topology(sp, fit)
    assert out.tiers[0].latency_s == pytest.approx(fit.latency_s)
    assert out.tiers[0].collective_efficiency["all_reduce"] == pytest.approx(0.95, rel=1e-4)
    assert out.tiers[0].collective_efficiency["p2p"] == sp.tiers[0].collective_efficiency["p2p"]  # not fitted: kept
    assert out.tiers[1:] == sp.tiers[1:]
    big = 1 << 30  # bandwidth-bound: 0.95 vs the preset's 0.80 → 0.80/0.95 of the time
    ratio = predict_time(out, "all_reduce", big, 8) / predict_time(sp, "all_reduce", big, 8)
    assert ratio == pytest.approx(0.80 / 0.95, rel=0.01)


def test_efficiency_above_one_is_capped_and_said():
    base = load_topology("h200-hgx-2gpu")
    fast = with_nvlink(base, 6e-6, {k: 1.0 for k in FIT_KINDS}, bw=2 * base.tiers[0].bw_bytes_per_s)
    fit = fit_sweep(synthesize_sweep(fast, 2, SIZES, kinds=("all_gather", "all_reduce")), base)
    assert fit.kinds["all_gather"].efficiency == 1.0
    assert fit.kinds["all_gather"].efficiency_uncapped == pytest.approx(2.0, rel=0.05)
    assert any("understates" in n for n in fit.notes)


def test_bad_sweeps_are_refused_readably(tmp_path):
    base = load_topology("h200-hgx-2gpu")
    with pytest.raises(CollectiveFitError, match="world_size"):
        sweep_from_dict({"world_size": 1, "cases": []})
    with pytest.raises(CollectiveFitError, match="no successful cases"):
        sweep_from_dict({"world_size": 2, "cases": [{"kind": "all_reduce", "error": "boom"}]})
    with pytest.raises(CollectiveFitError, match="non-positive"):
        sweep_from_dict({"world_size": 2, "cases": [{"kind": "all_reduce", "bytes": 8, "time_s": 0.0}]})
    with pytest.raises(CollectiveFitError, match="no such sweep"):
        load_sweep(tmp_path / "missing.json")
    (tmp_path / "x.json").write_text("{nope")
    with pytest.raises(CollectiveFitError, match="not valid JSON"):
        load_sweep(tmp_path / "x.json")
    one_size = sweep_from_dict({"world_size": 2, "cases": [{"kind": "all_reduce", "bytes": 8192, "time_s": 1e-5}]})
    with pytest.raises(CollectiveFitError, match="two distinct sizes"):
        fit_sweep(one_size, base)
    sp = load_topology("h200-superpod-1k")
    wide = synthesize_sweep(sp, 16, SIZES[:4])  # 16 GPUs span two nodes: NVLink and the leaf
    with pytest.raises(CollectiveFitError, match="crosses tiers"):
        fit_sweep(wide, sp)
    with pytest.raises(CollectiveFitError, match="not 'leaf'"):
        fit_sweep(synthesize_sweep(base, 2, SIZES[:4]), sp, "leaf")
    with pytest.raises(CollectiveFitError, match="no tier 'spine'"):
        apply_to_topology(base, fit_sweep(synthesize_sweep(base, 2, SIZES[:4]), base), "spine")


def test_merge_keeps_the_base_calibration_and_adds_the_tier():
    base = load_topology("h200-hgx-2gpu")
    fit = fit_sweep(synthesize_sweep(with_nvlink(base, 8e-6, TRUE_EFF), 2, SIZES, noise=0.01), base)
    cal0 = Calibration(device="NVIDIA H200", op_classes={"gemm": OpClassCalibration(compute_efficiency={"bf16": 0.7})},
                       collective_efficiency={"leaf": {"all_reduce": 0.9}}, notes="compute from run x")
    cal = merge_into_calibration(fit, cal0)
    assert cal.op_classes == cal0.op_classes
    assert cal.collective_efficiency["leaf"] == {"all_reduce": 0.9}
    assert cal.collective_efficiency["nvlink"]["all_to_all"] == pytest.approx(TRUE_EFF["all_to_all"], rel=0.03)
    assert "compute from run x" in cal.notes and "latency" in cal.notes
    new = merge_into_calibration(fit)
    assert new.device == "NVIDIA H200" and new.fit_error.num_samples == fit.num_points


def test_cli_writes_calibration_and_calibrated_superpod(tmp_path, capsys):
    base = load_topology("h200-hgx-2gpu")
    sweep = synthesize_sweep(with_nvlink(base, 8e-6, TRUE_EFF), 2, SIZES, noise=0.02, seed=5)
    sj = tmp_path / "sweep.json"
    sj.write_text(json.dumps(sweep_json(sweep)))
    cal0 = tmp_path / "base.json"
    dump_spec(Calibration(device="NVIDIA H200", op_classes={"gemm": OpClassCalibration(compute_efficiency={"bf16": 0.7})}), cal0)
    out, topo_out = tmp_path / "cal.json", tmp_path / "sp4k.yaml"
    rc = main(["calibrate", "--collectives", str(sj), "--base", str(cal0), "-o", str(out),
               "--apply-to", "h200-superpod-4k", "--topology-out", str(topo_out)])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "all_to_all" in text and "latency" in text
    cal = load_calibration(out)
    assert cal.op_classes["gemm"].compute_efficiency["bf16"] == 0.7
    assert cal.collective_efficiency["nvlink"]["all_reduce"] == pytest.approx(TRUE_EFF["all_reduce"], rel=0.04)
    sp = load_topology(topo_out)
    assert sp.num_gpus == 4096 and sp.tiers[0].collective_efficiency["all_gather"] == pytest.approx(TRUE_EFF["all_gather"], rel=0.04)
    assert main(["calibrate"]) == 2
    assert "give run directories" in capsys.readouterr().err


def test_calibrate_sweep_file_of_binary_garbage_is_named(tmp_path, capsys):
    """`calibrate --collectives FILE` reads the file as the spec loader does: binary garbage is an input error naming it."""
    bad = tmp_path / "sweep.json"
    bad.write_bytes(b"\x1f\x8b\x08\x00\x00\x00\x00\x00\xff garbage")
    assert main(["calibrate", "--collectives", str(bad), "-o", str(tmp_path / "c.json")]) == 2
    err = capsys.readouterr().err
    assert str(bad) in err and "binary" in err and "Traceback" not in err
    assert not (tmp_path / "c.json").exists()


@pytest.mark.timeout(240)
def test_fit_a_real_gloo_sweep(tmp_path):
    """The benchmark's gloo smoke mode end to end, then the fit on what it measured."""
    out = tmp_path / "sweep.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "collectives_h200.py"), "--device", "cpu", "--nproc", "2",
                           "--dtypes", "fp32", "--max-bytes", "1MiB", "--iters", "6", "--warmup", "2",
                           "--timeout", "200", "--out", str(out)], capture_output=True, text=True, timeout=230, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["world_size"] == 2 and doc["backend"] == "gloo"
    assert set(doc["checks"].values()) == {"ok"}, doc["checks"]
    assert {c["kind"] for c in doc["cases"]} == set(FIT_KINDS)
    for k in ("date", "git_commit", "versions", "command", "device_name"):
        assert doc[k]
    ar = [c for c in doc["cases"] if c["kind"] == "all_reduce"]
    assert all(c["busbw_bytes_per_s"] == pytest.approx(c["algbw_bytes_per_s"] * 1.0) for c in ar)  # 2(n-1)/n = 1 at n=2
    fit = fit_sweep(load_sweep(out), load_topology("h200-hgx-2gpu"))
    assert all(0 < e <= 1 for e in fit.efficiencies.values())
    assert np.isfinite(fit.latency_s) and fit.latency_s > 0
    # gloo on CPU is ~1,000x slower than NVLink: the preset's figures predict almost nothing, and the
    # fitted latency must land among the measured small-message times (CPU timings are too noisy here
    # to ask for a tight error)
    assert fit.default_median_abs_rel_error > 0.9
    small = [c["time_s"] for c in doc["cases"] if c["bytes"] <= 32768]
    assert 0.1 * min(small) < fit.latency_s < 2 * max(small)
    assert fit.num_points == len(doc["cases"])
