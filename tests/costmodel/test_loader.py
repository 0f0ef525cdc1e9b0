"""The data loader's price (coplan.costmodel.loader): its formula against hand-computed cases, its scaling, the
coefficients against the committed fit, the step's floor, the ledger's bar and the calibration's scale."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from coplan.calibration.assemble import fit_loader_scale
from coplan.costmodel import price
from coplan.costmodel.context import build_context
from coplan.planner import make_plan
from coplan.costmodel.loader import (
    DEFAULT_LOADER,
    DEFAULT_READER_PROCESSES,
    LoaderCoefficients,
    loader_step_s,
    reader_processes,
    values_per_sample,
)
from coplan.spec import Calibration, MeshPlan, Workload, load_topology
from coplan.spec.run import LoaderThroughput

ROOT = Path(__file__).resolve().parents[2]
H200 = load_topology("h200-1gpu")


def workload(batch: int = 64, dense: int = 8, pooling: float = 3.0, history: bool = True) -> Workload:
    """Two pooled tables (one with 2 features), a history table over one sequence of fixed length 50, dense
    features, two tasks."""
    tables = [{"name": "a", "num_rows": 1000, "dim": 16, "pooling_factor": pooling},
              {"name": "b", "num_rows": 1000, "dim": 16, "pooling_factor": 1, "num_features": 2}]
    blocks: list[dict] = [{"type": "dense_mlp", "num_dense_features": dense, "hidden_dims": [32], "out_tokens": 1}]
    seqs = []
    if history:
        seqs = [{"name": "hist", "length": {"kind": "fixed", "length": 50}}]
        tables.append({"name": "h", "num_rows": 1000, "dim": 16, "feature_kind": "sequence", "sequence": "hist"})
    blocks.append({"type": "heads", "tasks": ["ctr", "cvr"], "input_dim": 32, "hidden_dims": [16]})
    return Workload.model_validate({"name": "loader-test", "tables": tables, "sequences": seqs, "blocks": blocks,
                                    "batch": {"local_batch_size": batch}})


def test_values_per_sample_counts_every_id_length_label_and_dense_feature():
    # a: 3 ids + 1 length; b: 2 features x (1 id + 1 length); h: 50 ids; 1 length for hist; 2 labels; 8 dense
    assert values_per_sample(workload()) == pytest.approx(4 + 4 + 50 + 1 + 2 + 8)
    assert values_per_sample(workload(history=False)) == pytest.approx(4 + 4 + 2 + 8)


def test_loader_step_against_a_hand_computed_case():
    c = LoaderCoefficients(step_s=1e-3, value_s=1e-8, micro_s=1e-4, gather_s=2e-9, source="test")
    w = workload()
    v = values_per_sample(w)
    lt = loader_step_s(w, local_batch=64, micro_batches=2, group_ranks=4, processes=3, coeff=c)
    read = 1e-3 + 4 * 64 * v * 1e-8
    gather = 2 * 1e-4 + 64 * v * 2e-9
    assert lt.process_s == pytest.approx(read + gather)
    assert lt.step_s == pytest.approx((read + gather) / 3)
    assert (lt.processes, lt.group_ranks, lt.values_per_sample) == (3, 4, pytest.approx(v))


def test_loader_grows_with_the_rows_decoded_and_shrinks_with_processes():
    w = workload()
    base = loader_step_s(w, 64, 1, 1, 1)
    assert loader_step_s(w, 128, 1, 1, 1).process_s > base.process_s
    assert loader_step_s(w, 64, 1, 8, 1).process_s > base.process_s  # a larger balance group decodes more rows
    assert loader_step_s(w, 64, 1, 1, 4).step_s == pytest.approx(base.step_s / 4)
    # the decode term is linear in the group: the step part's increments are equal
    d1 = loader_step_s(w, 64, 1, 2, 1).process_s - base.process_s
    d2 = loader_step_s(w, 64, 1, 3, 1).process_s - loader_step_s(w, 64, 1, 2, 1).process_s
    assert d1 == pytest.approx(d2)


def test_default_coefficients_are_the_committed_fit():
    fit = json.loads((ROOT / "benchmarks" / "results" / "loader_fit.json").read_text())["coefficients"]
    for k, v in fit.items():
        assert getattr(DEFAULT_LOADER, k) == pytest.approx(v, rel=1e-3), k
    assert "loader_fit.py" in DEFAULT_LOADER.source


def test_reader_processes_are_the_trainer_s(monkeypatch):
    data = pytest.importorskip("coplan.trainer.data")
    assert DEFAULT_READER_PROCESSES == data.MAX_READER_PROCESSES
    assert reader_processes(None, 8) == DEFAULT_READER_PROCESSES
    for cores, ranks in ((16, 1), (96, 8), (8, 8), (224, 8), (4, 1)):
        monkeypatch.setattr(data.os, "cpu_count", lambda c=cores: c)
        assert reader_processes(cores, ranks) == data.default_reader_processes("cuda", ranks), (cores, ranks)


def test_the_balance_group_is_a_node_and_prices_both_the_loader_and_the_imbalance():
    """Across nodes each rank decodes its node's rows (not the world's) and the jagged imbalance includes the
    spread between the nodes' shares; on one node both are the global balancer's."""
    from coplan.costmodel.compute import imbalance
    from coplan.costmodel.context import Options
    from coplan.spec import load_workload

    topo = load_topology("h200-superpod-1k")
    w = load_workload("gem-tiny")
    mesh = MeshPlan(dense_shard=8, dense_replicate=8, sparse_shard=64)
    node = build_context(w, topo, mesh)
    world = build_context(w, topo, mesh, options=Options(balance_group_ranks=64))
    assert node.balance_group == topo.gpus_per_node == 8 and world.balance_group == 64
    assert price(node).loader_s < price(world).loader_s
    assert imbalance(node, "greedy") >= imbalance(world, "greedy")
    one = build_context(w, topo, MeshPlan(dense_shard=4, sparse_shard=4))
    assert one.balance_group == 4


def test_a_loader_bound_step_is_priced_at_the_loader_and_the_ledger_names_it():
    from coplan.reports.ledger import build_ledger

    big = workload(batch=65536, dense=512)
    ctx = build_context(big, H200, MeshPlan(dense_shard=1, sparse_shard=1))
    cost = price(ctx)
    assert cost.loader_s > cost.device_s > 0
    assert cost.step_time_s == pytest.approx(cost.loader_s)
    assert any(n.startswith("loader-bound") for n in cost.notes)
    small = build_context(workload(batch=64), H200, MeshPlan(dense_shard=1, sparse_shard=1))
    sc = price(small)
    assert 0 < sc.loader_s  # priced, whether or not it binds

    p, _ = make_plan(big, H200)
    pred = p.predicted
    assert pred.loader_s == pytest.approx(pred.step_time_s)
    led = build_ledger(p, pred)
    bars = {x.key: x.seconds for x in led.losses}
    assert bars["loader"] == pytest.approx(pred.step_time_s - pred.device_s, rel=1e-6)
    assert abs(led.residual_points) < 1e-6


def test_a_calibration_s_loader_scale_scales_the_price():
    w = workload(batch=4096)
    mesh = MeshPlan(dense_shard=1, sparse_shard=1)
    base = price(build_context(w, H200, mesh)).loader_s
    cal = Calibration(device=H200.gpu.name, loader_scale=2.5)
    assert price(build_context(w, H200, mesh, cal)).loader_s == pytest.approx(2.5 * base)
    # and it leaves no trace in a calibration's file (or hash) when not fitted
    assert "loader_scale" not in Calibration(device="x").model_dump()


def test_calibrate_fits_the_loader_scale_from_the_runs_summaries():
    w = workload(batch=256)
    p, _ = make_plan(w, H200)
    priced = loader_step_s(w, 256, 1, 1, 1).process_s

    def run(read_s_per_batch: float, processes: int):
        ld = LoaderThroughput(samples_per_s=1.0, consumed_samples_per_s=1.0, headroom=1.0,
                              read_s_per_batch=read_s_per_batch, processes=processes)
        return SimpleNamespace(plan=p, result=SimpleNamespace(loader=ld))

    # a process that took 3x the priced time, read by 4 processes (the summary divides by them); and 1x by the thread
    runs = [run(3 * priced / 4, 4), run(priced, 0), run(2 * priced, 0)]
    scale, ratios = fit_loader_scale(runs)
    assert ratios == pytest.approx([3.0, 1.0, 2.0])
    assert scale == pytest.approx(2.0)
    assert fit_loader_scale([SimpleNamespace(plan=p, result=SimpleNamespace(loader=None))]) is None


def test_a_host_bound_step_gets_its_own_ledger_bar():
    from coplan.reports.ledger import build_ledger

    w = workload(batch=256)
    cal = Calibration(device=H200.gpu.name, host_launch_s=2e-3)
    p, _ = make_plan(w, H200, cal)
    pred = p.predicted
    assert pred.host_s > pred.device_s > 0 and pred.step_time_s == pytest.approx(max(pred.host_s, pred.loader_s))
    led = build_ledger(p, pred)
    bars = {x.key: x.seconds for x in led.losses}
    assert bars["host"] == pytest.approx(min(pred.step_time_s, pred.host_s) - pred.device_s, rel=1e-6)
    assert "loader" not in bars or bars["loader"] == pytest.approx(pred.step_time_s - pred.host_s)
    assert abs(led.residual_points) < 1e-6
    # a device-bound plan writes no device_s, and has neither bar
    from coplan.spec import load_workload

    q, _ = make_plan(load_workload("gem-h200"), H200, Calibration(device=H200.gpu.name))
    assert q.predicted.device_s == 0.0 and "device_s" not in q.predicted.model_dump()
    assert not {"host", "loader"} & {x.key for x in build_ledger(q, q.predicted).losses}
