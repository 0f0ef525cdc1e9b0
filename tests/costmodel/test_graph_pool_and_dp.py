"""Memory and time the trainer spends that plans on one GPU ran out of: the CUDA graphs' pool and the
dense gradients of data-parallel tables (an 80 GB H100 draw, seed 20261206024642, ran out of memory with
both priced low: 33 GiB of pool against 1.125x the activations, and a whole-table gradient for 156 tables
priced at nothing)."""

from __future__ import annotations

import numpy as np
import pytest

from coplan.costmodel import build_context, price
from coplan.costmodel import memory as M
from coplan.costmodel.embedding import DP_GRAD_PASSES, INDEX_BYTES, option_costs, table_arrays
from coplan.costmodel.jagged import bucket, length_pmf, likely_rows
from coplan.sample import sample_workload
from coplan.spec import LayerPlan, load_topology

from .helpers import gem_h200_plan


def _ctx(plan):
    return build_context(plan.workload, plan.topology, plan.mesh)


def test_graph_pool_by_hand():
    plan = gem_h200_plan(batch=8, mean_len=512)
    ctx = _ctx(plan)
    seq = plan.workload.sequences[0]
    values, probs = length_pmf(seq.length)
    rows = likely_rows(values, probs, 8)
    mean_rows = float((values * probs).sum() / probs.sum()) * 8
    ta = table_arrays(plan.workload)
    in_row = float((ta.dim * ta.features)[ta.is_seq].sum()) * M.EMBEDDING_OUTPUT_BYTES
    acts = 3e9
    want = M.GRAPH_POOL_ACTS * acts * max(rows) / mean_rows + M.GRAPH_POOL_INPUTS * sum(rows) * in_row + M.GRAPH_POOL_FIXED
    assert M.graph_pool_bytes(ctx, acts) == pytest.approx(want)
    # the buckets are the trainer's: padded row counts, the largest above the mean micro-batch
    assert all(bucket(r) == r for r in rows) and max(rows) > mean_rows


def test_graph_pool_grows_with_activations_and_the_histories():
    ctx = _ctx(gem_h200_plan(batch=8, mean_len=512))
    a, b = M.graph_pool_bytes(ctx, 1e9), M.graph_pool_bytes(ctx, 2e9)
    assert b > a > M.GRAPH_POOL_FIXED
    # slope: the largest bucket's share of the mean micro-batch, times the activation coefficient
    assert (b - a) / 1e9 > M.GRAPH_POOL_ACTS
    long = _ctx(gem_h200_plan(batch=8, mean_len=2048))
    # histories 4x longer (activations 4x): larger buckets, more input rows
    assert M.graph_pool_bytes(long, 4e9) > 2.0 * a


def test_priced_plan_holds_the_pool_beside_the_activations():
    plan = gem_h200_plan(batch=8, mean_len=512)
    ctx = _ctx(plan)
    r = price(ctx, plan.tables, [LayerPlan(name=n) for n in ctx.layer_names], detail=False)
    m = r.memory
    assert m.graph_pool > M.GRAPH_POOL_ACTS * m.activations
    assert m.total == pytest.approx(sum(getattr(m, f) for f in (
        "parameters", "gradients", "optimizer", "fsdp_buffers", "activations", "recompute_peak", "embeddings",
        "embedding_optimizer", "embedding_io", "comm_buffers", "graph_pool")))


def test_data_parallel_tables_hold_and_step_a_dense_gradient():
    w = sample_workload("h200-1gpu", 20261206024642)
    ta = table_arrays(w)
    kw = dict(group_size=1, local_batch=float(w.batch.local(1)), num_micro_batches=1, out_bytes=2.0, hbm_bytes_per_s=3e12)
    tw = option_costs(ta, "table_wise", 1, **kw)
    dp = option_costs(ta, "data_parallel", 1, **kw)
    weight = ta.rows * ta.dim * ta.wbytes
    np.testing.assert_allclose(dp.weight_bytes, weight)
    # the optimizer state plus the whole table's gradient in the weights' dtype
    np.testing.assert_allclose(dp.optimizer_bytes, tw.optimizer_bytes + weight)
    # backward: the zero fill and the optimizer's passes over every row, against the fused update of the rows touched
    assert np.all(dp.bwd_s * 3e12 >= (DP_GRAD_PASSES + 2.0) * weight)
    assert np.all(dp.bwd_s > tw.bwd_s)
    assert INDEX_BYTES > 0


def test_one_gpu_plan_keeps_tables_off_data_parallel():
    from coplan.planner.search import PlannerConfig, make_plan

    # on one GPU a data-parallel table only adds its dense gradient's passes and memory: table-wise wins
    w = sample_workload("h200-1gpu", 20261206024642)
    p, _ = make_plan(w, load_topology("h100-1gpu"), None, PlannerConfig(world_size=1, time_limit_s=30, num_workers=1))
    assert {t.sharding_type for t in p.tables} == {"table_wise"}
