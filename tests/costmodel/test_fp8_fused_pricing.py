"""The ``blockwise-fused`` FP8 recipe's pricing: the InterFormer and Kunlun FFNs lose the quantisation
passes their producers absorb (by hand, and against the kernels' own byte count), every other op prices
as ``blockwise``, and a layer whose guard keeps one FFN GEMM out of fp8 prices unfused."""

from __future__ import annotations

import numpy as np
import pytest

from coplan.costmodel import flops as F
from coplan.costmodel.compute import op_arrays
from coplan.costmodel.context import build_context
from coplan.costmodel.fp8 import fused_ffn_layers
from coplan.costmodel.pricer import priced_launches
from coplan.spec import MeshPlan, Workload, load_topology, load_workload

H200 = load_topology("h200-1gpu")
FFN = (".ffn_up", ".ffn_down")


def recipe(name: str, r: str, fp8: str = "force") -> Workload:
    w = load_workload(name)
    return w.model_copy(update={"precision": w.precision.model_copy(update={"fp8": fp8, "fp8_recipe": r})})


def arrays(w: Workload):
    ctx = build_context(w, H200, MeshPlan(dense_shard=1, sparse_shard=1))
    arr = op_arrays(ctx, fp8_layers=frozenset(ctx.layer_names))
    return ctx, arr, [ctx.ops[int(i)] for i in ctx.dense_idx]


def _rows(ops, layer: str) -> dict[str, int]:
    return {o.name[len(layer) + 1:]: k for k, o in enumerate(ops) if o.layer == layer}


@pytest.mark.parametrize("name", ["gem-h200", "gem-tiny"])  # bf16 and fp32 compute
def test_one_ffn_chain_by_hand(name):
    """One InterFormer layer's FFN (d → f → d over ``tokens`` per micro-batch, ``b`` bytes per element):
    ``blockwise`` quantises y, dh (ffn_up's x and dY) and a, dY (ffn_down's) at ``b + 2`` bytes per element
    each; fused, only ffn_down's incoming dY is left, and norm2 / SiLU / SiLU's backward write 2 fp8 bytes
    per element instead of ``b``. The chain moves ``2·b·tokens·(d + 2f)`` bytes less, and 3 kernels fewer."""
    ctx, blk, ops = arrays(recipe(name, "blockwise"))
    _, fus, _ = arrays(recipe(name, "blockwise-fused"))
    w = ctx.workload
    lay = "interformer.0"
    r = _rows(ops, lay)
    up, down, na = r["ffn_up"], r["ffn_down"], r["norm_act"]
    block = w.block("interformer")
    d, f = block.model_dim, F.ffn_width(block)
    b = F.DTYPE_BYTES[w.precision.compute_dtype]
    tokens = blk.fwd_flops[up] / (2.0 * d * f)
    bw = H200.gpu.hbm_bw_bytes_per_s * ctx.eff.memory["elementwise"]
    per = b + 2.0
    # blockwise: the four activation passes (the x/Y halves are exact in total over fwd + bwd)
    q_blk = sum(blk.fwd_quant_s[k] + blk.bwd_quant_s[k] for k in (up, down))
    assert q_blk == pytest.approx(tokens * (2 * d + 2 * f) * per / bw)
    # fused: ffn_up none, ffn_down its dY in backward; the weights' passes unchanged
    assert fus.fwd_quant_s[up] == fus.bwd_quant_s[up] == fus.fwd_quant_s[down] == 0.0
    assert fus.bwd_quant_s[down] == pytest.approx(tokens * d * per / bw)
    for k in (up, down):
        assert fus.fwd_quant_fixed_s[k] == pytest.approx(blk.fwd_quant_fixed_s[k])
    assert (fus.quant_launches[up], fus.quant_launches[down], blk.quant_launches[up], blk.quant_launches[down]) == (1, 2, 3, 3)
    # the producers' writes: bf16 unchanged (2 fp8 bytes for 2 bf16 bytes), fp32 lighter
    na_tokens = tokens  # InterFormer: norm_act runs over the same L tokens
    assert fus.fwd_bytes[na] == pytest.approx(blk.fwd_bytes[na] - (b - 2) * na_tokens * (d + f))
    assert fus.bwd_bytes[na] == pytest.approx(blk.bwd_bytes[na] - (b - 2) * na_tokens * f)
    saved = sum(blk.fwd_bytes[k] + blk.bwd_bytes[k] - fus.fwd_bytes[k] - fus.bwd_bytes[k] for k in (up, down, na))
    assert saved == pytest.approx(2 * b * tokens * (d + 2 * f))


def test_saved_bytes_match_the_kernels_count():
    """The kernels' own count of the ``ln_ffn`` chain (``fused_bytes``: fp8 scales and padding included,
    in fused and unfused alike, so they cancel in ``saved_bytes``) saves what the cost model saves per token.
    (Its quantisation-pass bytes alone differ: they count the scales and the padded transposed copies, and
    the cost model moves the fp8 writes onto the producers, so only the totals are comparable.)"""
    pytest.importorskip("triton")
    fused_bytes = pytest.importorskip("coplan.kernels.fp8_fused").fused_bytes
    ctx, blk, ops = arrays(recipe("gem-h200", "blockwise"))
    _, fus, _ = arrays(recipe("gem-h200", "blockwise-fused"))
    for lay, block_name in (("interformer.0", "interformer"), ("kunlun.1", "kunlun")):
        r = _rows(ops, lay)
        block = ctx.workload.block(block_name)
        d, f = block.model_dim, F.ffn_width(block)
        tokens = blk.fwd_flops[r["ffn_up"]] / (2.0 * d * f)
        saved = sum(blk.fwd_bytes[k] + blk.bwd_bytes[k] - fus.fwd_bytes[k] - fus.bwd_bytes[k] for k in r.values())
        M = max(1, round(tokens))
        kb = fused_bytes(M, d, f, chain="ln_ffn", act_bytes=2)
        assert saved / tokens == pytest.approx(kb.saved_bytes / M, rel=1e-9), lay


@pytest.mark.parametrize("name", ["gem-h200", "gem-tiny"])
def test_fused_never_costs_more_and_touches_only_the_ffns(name):
    ctx, blk, ops = arrays(recipe(name, "blockwise"))
    _, fus, _ = arrays(recipe(name, "blockwise-fused"))
    bf, bb = blk.times()
    ff, fb = fus.times()
    fused = fused_ffn_layers(ops, recipe(name, "blockwise-fused"), ctx.layer_names)
    assert fused == {n for n in ctx.layer_names if n.startswith(("interformer.", "kunlun."))}
    b = F.DTYPE_BYTES[ctx.workload.precision.compute_dtype]
    for k, o in enumerate(ops):
        tb, tf = bf[k] + bb[k], ff[k] + fb[k]
        nb, nf = blk.fwd_bytes[k] + blk.bwd_bytes[k], fus.fwd_bytes[k] + fus.bwd_bytes[k]
        if o.layer in fused and o.name.endswith(FFN):
            assert fus.fp8[k] == 1.0
            assert nf < nb and tf < tb, o.name
        elif o.layer in fused and o.name.endswith(".norm_act") and b != 2:
            assert nf < nb and tf <= tb, o.name
        else:
            assert (nf, tf, fus.quant_launches[k], fus.act_bytes[k]) == (nb, tb, blk.quant_launches[k], blk.act_bytes[k]), o.name
    # memory: the same saved tensors (fp8 yᵀ, aᵀ are ffn_up's and ffn_down's xᵀ), priced alike
    np.testing.assert_array_equal(fus.act_bytes, blk.act_bytes)
    # the launch count: 3 quantisation kernels fewer per fused layer and micro-batch
    n = len(fused) * ctx.micro_batches
    assert priced_launches(ctx, blk) - priced_launches(ctx, fus) == pytest.approx(3 * n)


def test_guard_keeping_one_ffn_gemm_in_bf16_prices_unfused(monkeypatch):
    """The trainer fuses the chain only when both GEMMs pass the guard: with ffn_down kept out of fp8,
    ffn_up prices as plain ``blockwise`` and nothing else moves."""
    import coplan.costmodel.compute as C
    import coplan.costmodel.fp8 as P

    real = P.fp8_allowed

    def no_down(o, w):
        return False if o.name == "interformer.1.ffn_down" else real(o, w)

    monkeypatch.setattr(P, "fp8_allowed", no_down)
    monkeypatch.setattr(C, "fp8_allowed", no_down)
    _, blk, ops = arrays(recipe("gem-h200", "blockwise"))
    ctx, fus, _ = arrays(recipe("gem-h200", "blockwise-fused"))
    assert "interformer.1" not in fused_ffn_layers(ops, ctx.workload) and "interformer.0" in fused_ffn_layers(ops, ctx.workload)
    r = _rows(ops, "interformer.1")
    assert fus.fp8[r["ffn_down"]] == 0.0 and fus.fp8[r["ffn_up"]] == 1.0
    bt, ft = sum(blk.times()), sum(fus.times())
    for name, k in r.items():
        assert (fus.fwd_bytes[k], fus.bwd_bytes[k], ft[k], fus.quant_launches[k]) == \
            (blk.fwd_bytes[k], blk.bwd_bytes[k], bt[k], blk.quant_launches[k]), name


def test_other_recipes_and_blocks_are_not_fused():
    ops = F.workload_ops(recipe("gem-h200", "blockwise"))
    assert fused_ffn_layers(ops, recipe("gem-h200", "blockwise")) == frozenset()
    assert fused_ffn_layers(ops, recipe("gem-h200", "rowwise")) == frozenset()
    # a decoder's FFN (SwiGLU / GELU, no InterFormer or Kunlun block) is not the fused chain
    dec = recipe("dense-decoder-8b", "blockwise-fused")
    assert fused_ffn_layers(F.workload_ops(dec), dec) == frozenset()
