"""Attention at a head dim coplan's Triton kernels do not take: the kernels mask the padded columns (priced as
at the head dim, no copies); runs from before that (``kernels.head_pad: copies``) are priced padded, with their
copies (:func:`coplan.costmodel.flops.triton_head_padding`), against hand counts."""

from __future__ import annotations

import pytest

from coplan.costmodel import flops as F
from coplan.costmodel.compute import op_arrays
from coplan.costmodel.context import build_context
from coplan.costmodel.efficiency import UNFUSED_CLASS
from coplan.spec import Workload, load_workload, parse_spec
from coplan.spec.run import RunOptions

from .helpers import gem_h200_plan


def _with_head_dim(head_dim: int, kind: str | None = None, head_pad: str = "copies") -> Workload:
    doc = load_workload("gem-h200").model_dump(mode="json")
    doc.setdefault("kernels", {})["head_pad"] = head_pad
    for b in doc["blocks"]:
        if b["type"] == "interformer":
            b["head_dim"] = head_dim
            if kind is not None:
                b["attention"]["kind"] = kind
    return parse_spec(Workload, doc, f"gem-h200 head_dim {head_dim}")


@pytest.mark.parametrize(("d", "p"), [(96, 128), (48, 64), (12, 16), (128, 128), (16, 16), (256, 256), (300, 512)])
def test_kernel_head_dim_is_the_next_power_of_two_the_kernels_take(d, p):
    assert F.kernel_head_dim(d) == p


def test_a_head_dim_the_kernels_take_is_priced_as_it_is():
    w = _with_head_dim(128)
    for op in F.workload_ops(w):
        assert F.triton_head_padding(op, w) is op


def test_head_dim_96_adds_the_copies_by_hand_and_leaves_the_kernels():
    w = _with_head_dim(96)
    block = next(b for b in w.blocks if b.type == "interformer")
    H, b = block.num_heads, 2  # bf16
    ops = {o.name: o for o in F.workload_ops(w)}
    gdpa = ops[f"{block.name}.0.gdpa"]
    padded = F.triton_head_padding(gdpa, w)
    L = 700.0
    # the kernels' work as at 96 (see the docstring: the zero columns add no priced time)
    assert (padded.fwd_flops, padded.bwd_flops, padded.bwd_extra_flops) == (gdpa.fwd_flops, gdpa.bwd_flops, gdpa.bwd_extra_flops)
    assert (padded.fwd_bytes, padded.bwd_bytes, padded.act_bytes) == (gdpa.fwd_bytes, gdpa.bwd_bytes, gdpa.act_bytes)
    # per token and head: a pad copy reads 96 and writes 128, a copy out reads and writes 96
    pad, out = (96 + 128) * b, 2 * 96 * b
    assert block.attention.kind != "softmax"  # GDPA: the backward pads Q and dO (not O)
    assert padded.fwd_serial_bytes.at(L) == pytest.approx(L * H * (3 * pad + out))
    assert padded.bwd_serial_bytes.at(L) == pytest.approx(L * H * (4 * pad + 3 * out))
    assert (padded.fwd_launches, padded.bwd_launches) == (gdpa.fwd_launches + 4, gdpa.bwd_launches + 7)
    # softmax pads O too in backward
    ws = _with_head_dim(96, "softmax")
    s = F.triton_head_padding({o.name: o for o in F.workload_ops(ws)}[f"{block.name}.0.gdpa"], ws)
    assert s.bwd_serial_bytes.at(L) == pytest.approx(L * H * (5 * pad + 3 * out))


def test_summary_attention_pads_its_queries_per_sample_and_its_keys_per_token():
    w = _with_head_dim(96)
    block = next(b for b in w.blocks if b.type == "interformer")
    H, S, b = block.num_heads, block.num_summary_tokens, 2
    assert S > 0
    op = F.triton_head_padding({o.name: o for o in F.workload_ops(w)}[f"{block.name}.0.summary_attn"], w)
    pad, out = (96 + 128) * b, 2 * 96 * b
    assert op.fwd_serial_bytes == F.Coeffs(S * H * (pad + out), 2 * H * pad, 0.0)
    assert op.bwd_serial_bytes == F.Coeffs(S * H * (2 * pad + out), 2 * H * (pad + out), 0.0)


def test_the_cost_model_prices_the_padding_only_for_the_triton_backend():
    """The copies are serial (after the kernels) at the unfused class's bandwidth, the kernel stays in the
    attention class with its FLOPs; the reference backend prices its own padding instead."""
    base = gem_h200_plan()
    w96 = _with_head_dim(96)
    ctx = build_context(w96, base.topology, base.mesh)
    arr = op_arrays(ctx)
    names = [ctx.ops[int(i)].name for i in ctx.dense_idx]
    g = names.index(next(n for n in names if n.endswith(".gdpa")))
    assert arr.fwd_serial_s[g] > 0 and arr.bwd_serial_s[g] > 0 and arr.unfused[g] == 0
    bw = base.topology.gpu.hbm_bw_bytes_per_s
    assert arr.fwd_serial_s[g] == pytest.approx(
        ctx.mb_batch * F.triton_head_padding(ctx.ops[int(ctx.dense_idx[g])], w96).fwd_serial_bytes.expect(*ctx.moments[
            ctx.ops[int(ctx.dense_idx[g])].sequence]) / (bw * ctx.eff.memory.get(UNFUSED_CLASS, 0.85)))
    # the kernels' FLOPs as the unpadded op's
    op = ctx.ops[int(ctx.dense_idx[g])]
    m1, m2 = ctx.moments[op.sequence]
    assert arr.fwd_flops[g] == pytest.approx(ctx.mb_batch * op.fwd_flops.expect(m1, m2))
    # the copies are not negligible beside the kernels
    assert arr.fwd_serial_s[g] + arr.bwd_serial_s[g] > 0.01 * (arr.fwd_flop_s[g] + arr.bwd_flop_s[g])
    ref = op_arrays(ctx, base.kernels.model_copy(update={"attention": "reference"}))
    assert ref.unfused[g] == 1


def test_masked_head_dims_add_no_copies():
    """The default (``kernels.head_pad: masked``, what the trainer runs): no serial bytes, the kernels as at 96."""
    base = gem_h200_plan()
    w96 = _with_head_dim(96, head_pad="masked")
    assert "head_pad" not in w96.model_dump(mode="json")["kernels"]  # the default is not written (hashes unchanged)
    ctx = build_context(w96, base.topology, base.mesh)
    arr = op_arrays(ctx)
    names = [ctx.ops[int(i)].name for i in ctx.dense_idx]
    for g, n in enumerate(names):
        if n.endswith((".gdpa", ".summary_attn")):
            assert arr.fwd_serial_s[g] == 0 and arr.bwd_serial_s[g] == 0, n
    copies = op_arrays(build_context(_with_head_dim(96), base.topology, base.mesh))
    g = names.index(next(n for n in names if n.endswith(".gdpa")))
    assert copies.fwd_flops[g] == pytest.approx(arr.fwd_flops[g]) and copies.fwd_serial_s[g] > 0


def test_calibration_prices_an_old_run_with_its_copies():
    """``calibration.runs.as_ran`` marks a run from before masked head dims on its workload (``kernels.head_pad:
    copies``); the calibration's terms (priced with the plan's own ``kernels``) must carry the copies then. (At first
    the flag was read from the plan's kernels, which ``as_ran`` leaves alone: the fit lost the copies.)"""
    from coplan.calibration.runs import as_ran
    from coplan.calibration.terms import unit_terms

    base = gem_h200_plan()
    w96 = _with_head_dim(96, head_pad="masked")
    plan = base.model_copy(update={"workload": w96})
    old, new = as_ran(plan, None), as_ran(plan, RunOptions(film="fused", head_pad="masked", cuda_graphs=True))
    assert old.workload.kernels.head_pad == "copies" and old.kernels.head_pad == "masked"
    serial = lambda p: sum(t.serial_mem_s for t in unit_terms(p) if t.name.endswith((".gdpa", ".summary_attn")))  # noqa: E731
    assert serial(old) > 0 and serial(new) == 0
