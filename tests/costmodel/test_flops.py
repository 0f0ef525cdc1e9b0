"""The one FLOP formula, checked against closed forms worked by hand."""

from __future__ import annotations

import numpy as np
import pytest

from coplan.costmodel.flops import (
    Coeffs,
    LengthStats,
    attention_flops,
    causal_pairs,
    dense_params,
    kunlun_tokens,
    layer_names,
    model_flops,
    op_flops,
    workload_ops,
)
from coplan.spec import load_workload
from coplan.spec.workload import Workload


def _w(doc: dict) -> Workload:
    base = {"name": "w", "batch": {"global_batch_size": 4}}
    base.update(doc)
    return Workload.model_validate(base)


def test_coeffs_sum_over_a_batch_is_the_sum_of_per_sample_values():
    c = Coeffs(3.0, 2.0, 0.5)
    L = np.array([0, 1, 5, 64])
    assert c.total(LengthStats.of(L)) == pytest.approx(float(c.at(L).sum()))
    assert causal_pairs().at(7) == pytest.approx(7 * 8 / 2)


def test_attention_flops_causal_full_and_bottom_right():
    H, dh = 4, 32
    L = np.array([3, 10])
    causal = attention_flops(L, None, H, dh, causal=True)
    pairs = 3 * 4 / 2 + 10 * 11 / 2
    assert causal.fwd == pytest.approx(4 * H * dh * pairs)
    assert causal.bwd == pytest.approx(2 * causal.fwd)
    assert attention_flops(L, None, H, dh, causal=False).fwd == pytest.approx(4 * H * dh * (9 + 100))
    # 2 queries into 5 keys, bottom-right aligned: 4 + 5 visible keys
    assert attention_flops([2], [5], 1, 1, causal=True).fwd == pytest.approx(4 * 9)
    # more queries than keys: the first queries see nothing (rows fully masked)
    assert attention_flops([5], [2], 1, 1, causal=True).fwd == pytest.approx(4 * (1 + 2))


def test_decoder_matches_the_closed_form():
    """Llama-3-8B shape: 6·N per token for the matmuls plus 12·H·dh per causal pair per layer."""
    w = load_workload("dense-decoder-8b")
    b = w.blocks[0]
    d, H, kv, dh, f, V, n, T = b.model_dim, b.num_heads, b.num_kv_heads, b.head_dim, b.ffn_hidden_dim, b.vocab_size, b.num_layers, 8192
    per_layer = d * (H + 2 * kv) * dh + H * dh * d + d * 2 * f + f * d
    matmul = 6 * T * (n * per_layer + d * V)
    attn = 12 * H * dh * (T * (T + 1) / 2) * n
    got = model_flops(w, batch_size=1)
    assert got.total == pytest.approx(matmul + attn, rel=1e-12)
    assert got.bwd == pytest.approx(2 * got.fwd)
    params, experts = dense_params(w)
    assert params == pytest.approx(8.03e9, rel=0.01) and experts == 0  # Llama 3 8B


def test_jagged_flops_follow_the_real_lengths():
    """InterFormer over concrete lengths: Σ L and Σ L(L+1)/2, never the padded maximum."""
    w = load_workload("gem-tiny")
    b = next(x for x in w.blocks if x.type == "interformer")
    L = np.array([0, 1, 7, 64])
    got = op_flops(w, {"history": L})
    pairs = float((L * (L + 1) / 2).sum())
    g = got[f"{b.name}.1.gdpa"]
    assert g.fwd == pytest.approx(4 * b.num_heads * b.head_dim * pairs)
    qkv = got[f"{b.name}.1.qkv"]
    assert qkv.fwd == pytest.approx(2 * L.sum() * b.model_dim * 3 * b.num_heads * b.head_dim)
    # summary tokens attend into every event: S·ΣL pairs
    assert got[f"{b.name}.0.summary_attn"].fwd == pytest.approx(4 * b.num_heads * b.head_dim * b.num_summary_tokens * L.sum())
    padded = op_flops(w, {"history": np.full(4, 64)})[f"{b.name}.1.gdpa"].fwd
    assert padded > 3 * g.fwd


def test_expectation_matches_the_average_of_drawn_batches():
    from coplan.spec.workload import sample_lengths

    w = load_workload("gem-tiny")
    lengths = sample_lengths(w.sequence("history").length, 200_000, seed=1)
    drawn = model_flops(w, {"history": lengths}).total / lengths.size
    expected = model_flops(w, batch_size=1).total
    assert drawn == pytest.approx(expected, rel=0.01)


def test_moe_counts_routed_tokens_only():
    w = _w({"blocks": [{"type": "moe", "model_dim": 64, "tokens_per_sample": 10, "num_experts": 8, "top_k": 2,
                        "expert_hidden_dim": 128, "capacity_factor": 2.0, "num_shared_experts": 1}]})
    f = op_flops(w, batch_size=1)
    assert f["moe.0.experts"].fwd == pytest.approx(6 * 10 * 2 * 64 * 128)  # SwiGLU: 3 matrices, top-2
    assert f["moe.0.shared_experts"].fwd == pytest.approx(6 * 10 * 64 * 128)
    assert f["moe.0.router"].fwd == pytest.approx(2 * 10 * 64 * 8)
    assert dense_params(w)[1] == 3 * 64 * 128 * 8


def test_kunlun_projection_and_tokens():
    w = load_workload("gem-1t")
    k = next(b for b in w.blocks if b.type == "kunlun")
    pooled = sum(t.dim * t.num_features for t in w.all_tables if t.feature_kind == "pooled")
    f = op_flops(w, batch_size=1)
    assert f["kunlun.0.input_proj"].fwd == pytest.approx(2 * pooled * k.model_dim)
    assert kunlun_tokens(w, k) == 64 + 4 + 16
    T = kunlun_tokens(w, k)
    assert f["kunlun.0.attn"].fwd == pytest.approx(4 * k.num_heads * k.head_dim * T * T)  # full attention


def test_dot_interaction_and_pooling():
    w = load_workload("dlrm-856")
    b = next(x for x in w.blocks if x.type == "dot_interaction")
    f = op_flops(w, batch_size=1)
    assert f["interaction.0.dot"].fwd == pytest.approx(2 * b.num_tokens**2 * b.dim)
    n = b.num_tokens
    assert f["interaction.1.gemm"].fwd == pytest.approx(2 * (n * (n - 1) // 2 + b.dim) * b.top_hidden_dims[0])
    pool = sum(t.pooling_factor * t.num_features * t.dim for t in w.all_tables)
    assert f["sparse.tbe"].fwd == pytest.approx(pool)
    assert f["sparse.tbe"].bwd == 0.0
    assert f["dense_mlp.0.gemm"].bwd == pytest.approx(f["dense_mlp.0.gemm"].fwd)  # raw features need no dX


def test_op_names_and_layers_follow_the_naming_scheme():
    w = load_workload("gem-1t")
    names = [o.name for o in workload_ops(w)]
    assert "sparse.tbe" in names and "sparse.seq_tbe" in names and "interformer.3.gdpa" in names and "moe.0.experts" in names
    for o in workload_ops(w):
        assert o.name.startswith(o.layer + ".") or o.layer == "sparse"
    assert layer_names(w)[0] == "dense_mlp.0" and "kunlun.7" in layer_names(w)


def test_lengths_must_cover_every_sequence():
    w = load_workload("gem-tiny")
    with pytest.raises(KeyError):
        model_flops(w, {})
    with pytest.raises(ValueError):
        model_flops(load_workload("gem-1t"))  # local batch only: needs batch_size
