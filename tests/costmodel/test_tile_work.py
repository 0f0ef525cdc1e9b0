"""coplan's Triton attention kernels compute whole tiles: the pricer charges them the tiles' pairs
(:func:`coplan.costmodel.compute.triton_tile_factor`), hand-checked here."""

from __future__ import annotations

import numpy as np
import pytest

from coplan.costmodel import flops as F
from coplan.costmodel.compute import op_arrays, tile_pairs, triton_tile_factor, triton_tile_sizes
from coplan.costmodel.context import build_context
from coplan.spec import MeshPlan, Workload, load_topology, load_workload, parse_spec


def test_tile_pairs_by_hand():
    # causal, L = 150 in 128 x 64 tiles: query blocks [0, 128) see keys [0, 128), [128, 150) sees [0, 192)
    assert tile_pairs(np.array([150]), np.array([150]), True, 128, 64)[0] == 128 * 128 + 128 * 192
    # full attention: 2 query blocks of 128 over 3 key blocks of 64
    assert tile_pairs(np.array([150]), np.array([150]), False, 128, 64)[0] == 256 * 192
    # an exact multiple of the tiles: the causal blocks over the diagonal are all that is extra
    L = 1024.0
    exact = tile_pairs(np.array([L]), np.array([L]), True, 128, 64)[0]
    assert exact == 128 * (128 * 7 * 8 / 2 + 1024)
    assert exact / (L * (L + 1) / 2) == pytest.approx(1 + 64 / 1025 * 2, rel=1e-3)  # half of each diagonal block
    # summary queries: 6 of them in one 64-row block over 150 keys in 64-column blocks
    assert tile_pairs(np.array([6]), np.array([150]), False, 64, 64)[0] == 64 * 192


def test_tile_sizes_follow_the_candidates_the_kernels_keep():
    assert triton_tile_sizes(1000, 1000) == (128, 64)
    assert triton_tile_sizes(37, 37) == (64, 64)  # Kunlun's tokens: the 64-row blocks, the shortest candidate
    assert triton_tile_sizes(9, 9) == (64, 32)
    assert triton_tile_sizes(6, 800) == (64, 64)  # summary queries over a history


def _workload(mean: float, summary: int = 4, tokens: int = 20) -> Workload:
    doc = load_workload("gem-tiny").model_dump(mode="json")
    doc["sequences"][0]["length"] = {"kind": "fixed", "length": int(mean)}
    for b in doc["blocks"]:
        if b["type"] == "interformer":
            b["num_summary_tokens"] = summary
        if b["type"] == "kunlun":
            b["num_tokens"] = tokens
    doc["kernels"]["attention"] = "triton"
    doc["precision"] = {"compute_dtype": "bf16", "param_dtype": "fp32", "reduce_dtype": "fp32"}
    return parse_spec(Workload, doc, "tile test")


def _factors(w: Workload) -> dict[str, float]:
    return {o.name.rsplit(".", 1)[-1]: triton_tile_factor(o, w) for o in F.workload_ops(w) if o.op_class == "attention"}


def test_factors_per_op_kind():
    w = _workload(150, summary=6, tokens=20)
    f = _factors(w)
    assert f["gdpa"] == pytest.approx((128 * 128 + 128 * 192) / (150 * 151 / 2))
    assert f["summary_attn"] == pytest.approx(64 * 192 / (6 * 150))
    T = F.kunlun_tokens(w, next(b for b in w.blocks if b.type == "kunlun"))
    bm, bn = triton_tile_sizes(T, T)
    causal = next(b for b in w.blocks if b.type == "kunlun").attention.causal
    ideal = T * (T + 1) / 2 if causal else T * T
    assert f["attn"] == pytest.approx(tile_pairs(np.array([T]), np.array([T]), causal, bm, bn)[0] / ideal)


def test_short_histories_waste_more_and_long_ones_tend_to_the_pairs():
    short, long = _factors(_workload(150))["gdpa"], _factors(_workload(4096))["gdpa"]
    assert short > 2.0 > 1.0 < long < 1.05


def test_the_pricer_charges_the_triton_kernels_the_tiles_and_the_model_flops_stay():
    """The Triton kernels' attention time grows by the factor (FLOP-bound part); the padded reference is not
    priced by it; the model FLOPs (MFU's numerator) are the real pairs'."""
    w = _workload(150, summary=6)
    topo = load_topology("h200-1gpu")
    ctx = build_context(w, topo, MeshPlan(dense_shard=1, sparse_shard=1))
    arr = op_arrays(ctx, w.kernels)
    ops = [ctx.ops[int(i)] for i in ctx.dense_idx]
    k = next(i for i, o in enumerate(ops) if o.name.endswith(".gdpa"))
    f = triton_tile_factor(ops[k], w)
    peak = topo.gpu.peak_flops_per_s["bf16"]
    ce = ctx.eff.compute_eff("attention", "bf16")
    assert arr.fwd_flop_s[k] == pytest.approx(arr.fwd_flops[k] / (peak * ce) * f)
    n = ctx.mb_batch
    m1, m2 = ctx.moments[ops[k].sequence]
    assert arr.fwd_flops[k] == pytest.approx(n * ops[k].fwd_flops.expect(m1, m2))
