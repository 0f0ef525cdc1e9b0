"""The embedding kernel groups the pricer charges launches for: one per TorchRec collection with the fused
TBE (the trainer's EmbeddingBagCollection for pooled tables and one EmbeddingCollection per sequence-table
dimension), each with :data:`COLLECTION_KERNELS` in priced units."""

from __future__ import annotations

import numpy as np
import pytest

from coplan.costmodel.compute import HOST_KERNELS_PER_PRICED_LAUNCH, op_arrays
from coplan.costmodel.context import build_context
from coplan.costmodel.embedding import COLLECTION_KERNELS, TableAssignment, table_collections
from coplan.costmodel.pricer import (assignment_of, collections_held, emb_group_launches, host_launches, layer_sets, price,
                                     priced_launches, workload_collections)
from coplan.spec import Calibration, MeshPlan, OpClassCalibration, Plan, TableShard, Workload, load_topology, load_workload, parse_spec, spec_sha256
from coplan.trainer.features import feature_layout

from .helpers import topo


def _workload(seq_dims: list[int], pooled_dims: list[int] = (16, 32), kernel: str = "fused") -> Workload:
    doc = load_workload("gem-tiny").model_dump(mode="json")
    doc["tables"] = [{"name": f"p{i}", "num_rows": 100, "dim": d, "pooling_factor": 2} for i, d in enumerate(pooled_dims)] + [
        {"name": f"s{i}", "num_rows": 100, "dim": d, "feature_kind": "sequence", "sequence": "history"} for i, d in enumerate(seq_dims)]
    doc["kernels"]["embedding"] = kernel
    return parse_spec(Workload, doc, "collections test")


def _plan(w: Workload) -> Plan:
    t = load_topology("h200-1gpu")
    tables = tuple(TableShard(table=tab.name, sharding_type="table_wise", ranks=(0,)) for tab in w.all_tables)
    return Plan(topology=t, workload=w, world_size=1, mesh=MeshPlan(dense_shard=1, sparse_shard=1), kernels=w.kernels, tables=tables,
                topology_sha256=spec_sha256(t), workload_sha256=spec_sha256(w))


def test_a_collection_per_sequence_dimension_and_one_for_the_pooled_tables():
    w = _workload([64, 32, 64, 128])
    coll = table_collections(w.all_tables)
    # pooled p0, p1 -> 0; sequence dims numbered in increasing dimension: 32 -> 1, 64 -> 2, 128 -> 3
    assert coll.tolist() == [0, 0, 2, 1, 2, 3]
    assert table_collections(_workload([32, 32], pooled_dims=[]).all_tables).tolist() == [1, 1]


@pytest.mark.parametrize("seq_dims,pooled", [([64, 32, 64, 128], [16]), ([16], [8, 16]), ([32, 32, 32], []), ([8, 16, 32, 64, 128], [16, 64])])
def test_the_collections_are_the_trainers(seq_dims, pooled):
    """The cost model's collections are the sparse arch's: an EmbeddingBagCollection when there are pooled
    tables, and one EmbeddingCollection per group of :attr:`FeatureLayout.sequence_groups`."""
    w = _workload(seq_dims, pooled)
    layout = feature_layout(w)
    trainer = (1 if layout.pooled else 0) + len(layout.sequence_groups)
    ctx = build_context(w, load_topology("h200-1gpu"), MeshPlan(dense_shard=1, sparse_shard=1))
    assert workload_collections(ctx) == trainer


def test_collections_held_per_rank():
    w = _workload([64, 32, 64, 128])
    t = topo({"size": 2, "bw_bytes_per_s": 100e9})
    ctx = build_context(w, t, MeshPlan(dense_shard=2, sparse_shard=2))
    names = [x.name for x in w.all_tables]
    # rank 0: p0 and s0 (pooled, dim 64); rank 1: s1 (dim 32), s2 (dim 64), s3 (dim 128); p1 data-parallel on both
    st = np.array([names.index(n) for n in ("p0", "s0", "s1", "s2", "s3")])
    sr = np.array([0, 0, 1, 1, 1])
    a = assignment_of(ctx, [TableShard(table=n, sharding_type="table_wise", ranks=(int(r),)) for n, r in zip(np.array(names)[st], sr)]
                      + [TableShard(table="p1", sharding_type="data_parallel")])
    assert isinstance(a, TableAssignment)
    assert collections_held(ctx, a).tolist() == [2.0, 4.0]  # rank 1 looks up in the pooled collection through p1


def test_each_collection_adds_its_kernels_to_the_host_and_device_launches():
    """Two workloads that differ by one sequence-table dimension (a fourth collection) differ by one
    collection's kernels per micro-batch, in priced units, on the host and on the device; with per-table
    kernels the groups are the tables and each is one forward and two backward launches."""
    ef, eb = emb_group_launches(True)
    assert (ef, eb) == pytest.approx((COLLECTION_KERNELS[0] / HOST_KERNELS_PER_PRICED_LAUNCH,
                                      COLLECTION_KERNELS[1] / HOST_KERNELS_PER_PRICED_LAUNCH))
    assert emb_group_launches(False) == (1.0, 2.0)
    out = {}
    for name, dims in (("three", [32, 64, 64]), ("four", [32, 64, 128])):
        p = _plan(_workload(dims))
        ctx = build_context(p.workload, p.topology, p.mesh)
        a = assignment_of(ctx, p.tables)
        g = float(collections_held(ctx, a).max())
        rec, fp8 = layer_sets(ctx, p.layers)
        arr = op_arrays(ctx, p.kernels, fp8)
        out[name] = (g, priced_launches(ctx, arr, rec, g), host_launches(ctx, arr, rec, g), ctx.micro_batches)
    assert out["three"][0] == 3 and out["four"][0] == 4
    M = out["four"][3]
    assert out["four"][1] - out["three"][1] == pytest.approx((ef + eb) * M)
    assert out["four"][2] - out["three"][2] == pytest.approx((ef + eb) * M)


def test_a_calibrated_host_prices_each_collection():
    """With a host cost that dominates, the step grows by the host's cost of one collection's launches
    when the workload gains a collection (the trainer's host runs each collection's input distribution,
    lookup, output distribution and backward, whatever its tables)."""
    h = 1e-3  # 1 ms per priced launch: the host dominates the tiny workload's device step
    cal = Calibration(device="NVIDIA H200", host_launch_s=h, op_classes={"gemm": OpClassCalibration()})
    steps = {}
    for dims in ([32, 64, 64], [32, 64, 128]):
        p = _plan(_workload(dims))
        ctx = build_context(p.workload, p.topology, p.mesh, cal)
        steps[len(set(dims))] = price(ctx, p.tables, p.layers, p.balancing, p.kernels).step_time_s
    ef, eb = emb_group_launches(True)
    assert steps[3] - steps[2] == pytest.approx(h * (ef + eb) * ctx.micro_batches, rel=1e-6)
