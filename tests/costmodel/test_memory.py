"""Memory per rank for gem-tiny on one GPU, against a count done by hand from workloads/gem-tiny.yaml."""

from __future__ import annotations

import pytest

from coplan.costmodel import build_context, price
from coplan.costmodel.context import Options
from coplan.costmodel.jagged import length_moments
from coplan.spec import LayerPlan, MeshPlan, load_topology, load_workload
from coplan.spec.workload import Kernels

# Dense parameters of gem-tiny (weights + biases), layer by layer:
#   dense_mlp 8→32→32:                         288 + 1,056                       =  1,344
#   interformer input_proj (2 seq tables ×16 → 32): 1,056; per layer qkv 3,168, attn_out 1,056,
#     ffn 2,112 + 2,080, summary_q 1,056, summary_out 1,056 = 10,528 × 2          = 22,112
#   kunlun input_proj 64 pooled dims → 32 (+ 4 token biases of 32): 2,176; per layer
#     qkv 3,168, attn_out 1,056, ffn 2,112 + 2,080 = 8,416 × 2                    = 19,008
#   moe router 32→4                                                               =    132
#   heads, 2 tasks: 32→32 and 32→1                                               =  2,178
DENSE = 1_344 + 22_112 + 19_008 + 132 + 2_178  # 44,774
EXPERTS = 3 * 32 * 64 * 4  # SwiGLU experts: 24,576
ROWS = 1000 + 500 + 200 + 50 + 800 + 16

# Saved activations (fp32, bytes). Per history event: input_proj 32 elems; per InterFormer layer
# qkv input 32, GDPA q,k,v,o 4×32 (+ 2 heads × 4-byte row statistics), ffn_up input 32, ffn_down
# input 64, norms 2×32 + activation input 64 → (32 + 4·32 + 32 + 64 + 2·32 + 64)·4 + 8 = 1,544 B per layer with the
# fused FiLM LayerNorm (its kernel keeps only the norm's input); the PyTorch FiLM also keeps the normalised tokens
# and the expanded 1+γ (2×32 elements, FILM_EAGER_SAVED bytes).
PER_LAYER = 1_544
FILM_EAGER_SAVED = 2 * 32 * 4
PER_EVENT = 32 * 4 + 2 * PER_LAYER
# Per sample: dense_mlp inputs 8 + 32; summaries (2 tokens) q input 2×32 and summary attention q, o
# (2×(2·32·4 + 8)) per layer; Kunlun (7 tokens) pooled input 64, per layer qkv 7×32, attention
# 7×(2·32·4+8) + 7×2·32·4, ffn 7×32 + 7×64, norms 7×(2·32+64); MoE (4 tokens, top-2) router 4×32,
# experts 8×32 + 8×64, norm/act 4×32 + 2×(8×64); heads 2×32 + 2×32, and their LayerNorm's input (7 tokens × 32).
PER_SAMPLE = (
    (8 + 32) * 4
    + 2 * (2 * 32 * 4 + 2 * (2 * 32 * 4 + 8))
    + 64 * 4 + 2 * (7 * 32 * 4 + 7 * (2 * 32 * 4 + 8) + 7 * 2 * 32 * 4 + 7 * 32 * 4 + 7 * 64 * 4 + 7 * (2 * 32 + 64) * 4)
    + (4 * 32 + 8 * 32 + 8 * 64 + 4 * 32 + 2 * 8 * 64) * 4
    + (2 * 32 + 2 * 32) * 4
    + 7 * 32 * 4
)


@pytest.fixture(scope="module")
def tiny():
    w = load_workload("gem-tiny")
    w = w.model_copy(update={"kernels": Kernels(attention="triton", embedding="fused")})  # real lengths, no padding
    t = load_topology("h200-1gpu")
    ctx = build_context(w, t, MeshPlan(dense_shard=1, sparse_shard=1), options=Options())
    return w, t, ctx


def test_dense_state_by_hand(tiny):
    w, t, ctx = tiny
    m = price(ctx).memory
    n = DENSE + EXPERTS
    assert m.parameters == pytest.approx(4 * n)       # fp32 master weights
    assert m.gradients == pytest.approx(4 * n)        # fp32 gradients
    assert m.optimizer == pytest.approx(8 * n)        # AdamW: two fp32 moments
    assert m.fsdp_buffers == pytest.approx(4 * n)     # one rank: compute-dtype (fp32) copies of every weight


def test_embeddings_by_hand(tiny):
    w, t, ctx = tiny
    m = price(ctx).memory
    assert m.embeddings == pytest.approx(ROWS * 16 * 4)        # fp32 tables of dim 16
    assert m.embedding_optimizer == pytest.approx(ROWS * 4)    # row-wise Adagrad: one fp32 per row


def test_activations_by_hand(tiny):
    w, t, ctx = tiny
    mean = length_moments(w.sequence("history").length).mean
    B = 64  # global batch on one GPU, one micro-batch
    m = price(ctx).memory
    assert m.activations == pytest.approx(B * (PER_SAMPLE + PER_EVENT * mean))
    assert m.recompute_peak == 0.0


def test_the_pytorch_film_keeps_two_more_widths(tiny):
    w, t, _ = tiny
    eager = w.model_copy(update={"kernels": w.kernels.model_copy(update={"film": "eager"})})
    ctx = build_context(eager, t, MeshPlan(dense_shard=1, sparse_shard=1), options=Options())
    mean = length_moments(w.sequence("history").length).mean
    layers = sum(b.num_layers for b in w.blocks if b.type == "interformer")
    assert price(ctx).memory.activations == pytest.approx(64 * (PER_SAMPLE + (PER_EVENT + layers * FILM_EAGER_SAVED) * mean))


def test_recompute_keeps_layer_inputs_only(tiny):
    w, t, ctx = tiny
    mean = length_moments(w.sequence("history").length).mean
    layers = [LayerPlan(name="interformer.1", recompute=True)]
    m0 = price(ctx).memory
    m1 = price(ctx, layers=layers).memory
    # the layer kept 1,544 B per event; now only its 32-float input, and its full set is live once in backward
    assert m0.activations - m1.activations == pytest.approx(64 * mean * (PER_LAYER - 32 * 4) + 64 * 2 * (2 * 32 * 4 + 2 * (2 * 32 * 4 + 8)) / 2)
    assert m1.recompute_peak > 0


def test_fixed_terms_and_total(tiny):
    w, t, ctx = tiny
    cost = price(ctx)
    m = cost.memory
    # the CUDA context and the allocator's fragmentation are the topology's reserve, not priced items
    assert "cuda_context" not in m.as_dict() and "allocator_headroom" not in m.as_dict()
    assert cost.hbm_reserve_bytes == pytest.approx(t.gpu.hbm_reserve_fraction * t.gpu.hbm_bytes)
    assert cost.usable_hbm_bytes == pytest.approx(t.gpu.hbm_bytes * (1 - t.gpu.hbm_reserve_fraction))
    assert cost.fits == (m.total <= cost.usable_hbm_bytes)
    assert m.comm_buffers == 0.0  # one rank: no communicators
    assert m.total == pytest.approx(sum(m.as_dict().values()))
