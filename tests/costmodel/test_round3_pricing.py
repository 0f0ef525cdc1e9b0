"""Round-3 pricing fixes, each on synthetic inputs worked by hand: an op of separate kernels costs the
sum of their rooflines (the padded reference); FSDP2's one-rank copies are bytes at the elementwise
bandwidth; the trace attributes the kernels those ops run (the input casts' backward, the gradient norm)."""

from __future__ import annotations

import numpy as np
import pytest

from coplan.costmodel import flops as F
from coplan.calibration.device_fit import predict
from coplan.calibration.runs import Sample
from coplan.calibration.terms import unit_terms
from coplan.costmodel.compute import REFERENCE_PAD_MULTIPLE, expected_max_moments, op_arrays
from coplan.costmodel.context import build_context
from coplan.costmodel.decomposed import FSDP_COPY_LAUNCHES, OPTIMIZER_LAUNCHES, dense_fixed_costs
from coplan.costmodel.memory import EMBEDDING_OUTPUT_BYTES, fsdp_copy_bytes
from coplan.costmodel.efficiency import UNFUSED_CLASS
from coplan.costmodel.pricer import price, priced_launches
from coplan.calibration.attribution import attribute
from coplan.spec import MeshPlan

from tests.calibration._trace import _ev
from .helpers import gem_h200_plan


_plan = gem_h200_plan


# ------------------------------------------------------------------ an op of several kernels


def test_predict_adds_the_separate_kernels_of_an_unfused_op():
    """Two kernels in sequence, a compute-bound matmul (2 ms) and an elementwise pass (3 ms at the unfused
    op's class's bandwidth): 5 ms, not max(2, 3) = 3 ms; the matmul's bytes use the class its sample names."""
    s = Sample("r", "x.0.attn", "fwd", "attention", "tf32", 1.0, flop_s=1e-3, mem_s=0.4e-3, launches=0.0,
               serial_mem_s=1.5e-3, mem_class=UNFUSED_CLASS)
    comp = {("attention", "tf32"): 0.5}
    mem = {UNFUSED_CLASS: 0.5, "attention": 0.01, "gemm": 0.01, "elementwise": 0.01}
    assert predict([s], comp, mem, {})[0] == pytest.approx(2e-3 + 3e-3)
    # the matmul turns memory-bound when its bandwidth is low: its roofline, then plus the pass
    assert predict([s], comp, {**mem, UNFUSED_CLASS: 0.1}, {})[0] == pytest.approx(4e-3 + 15e-3)
    # a fused op (no separate kernels) keeps one roofline over its class's bandwidth
    fused = Sample("r", "x.0.attn", "fwd", "attention", "bf16", 1.0, flop_s=1e-3, mem_s=0.4e-3, launches=0.0)
    assert predict([fused], {("attention", "bf16"): 0.5}, {"attention": 0.1}, {})[0] == pytest.approx(4e-3)


def test_padded_reference_is_its_matmuls_plus_its_elementwise_passes():
    """The reference's bytes are split between its matmuls (score writes/reads, Q K V and output) and its
    separate elementwise kernels; the split keeps the total that was counted before, and the op's time is
    the matmuls' roofline plus the passes' time at the unfused op's class's bandwidth."""
    plan = _plan(8, 512, "reference")
    w = plan.workload
    ctx = build_context(w, plan.topology, plan.mesh)
    arr = op_arrays(ctx, w.kernels)
    names = [ctx.ops[i].name for i in ctx.dense_idx]
    g = names.index("interformer.0.gdpa")
    op = ctx.ops[int(ctx.dense_idx[g])]
    ref = F.padded_reference_attention(op, w)
    blk = next(b for b in w.blocks if b.name == "interformer")
    H, dh = blk.num_heads, blk.head_dim
    # per score element: matmuls 8 bytes forward, 16 backward; the GDPA total stays 32 / 44
    assert ref.fwd_bytes.quad == pytest.approx(H * F._REF_SCORE_GEMM_BYTES[0])
    assert (ref.fwd_bytes + ref.fwd_serial_bytes).quad == pytest.approx(H * (32.0 + F._REF_MASK_BYTES / H))
    assert (ref.bwd_bytes + ref.bwd_serial_bytes).quad == pytest.approx(H * 44.0)
    assert ref.fwd_flops.quad == pytest.approx(4.0 * dh * H)
    for part in (ref.fwd_serial_bytes, ref.bwd_serial_bytes):
        assert part.const >= 0 and part.lin >= 0 and part.quad > 0
    # priced as the sum: roofline of the matmuls + the passes at the unfused op's class's bandwidth
    gpu = plan.topology.gpu
    f, b = arr.times(1.0)
    matmuls = max(arr.fwd_flop_s[g], arr.fwd_mem_s[g] + arr.fwd_fixed_mem_s[g])
    assert arr.fwd_serial_s[g] > 0
    assert f[g] == pytest.approx(matmuls + arr.fwd_serial_s[g] + arr.fwd_launch_s[g])
    m1, m2 = expected_max_moments(w.sequence("history").length, ctx.mb_batch, REFERENCE_PAD_MULTIPLE)
    serial_bytes = ctx.mb_batch * F.padded_reference_attention(op, w, min(1.0, ctx.moments["history"][0] / m1)).fwd_serial_bytes.expect(m1, m2)
    assert arr.fwd_serial_s[g] == pytest.approx(serial_bytes / (gpu.hbm_bw_bytes_per_s * ctx.eff.memory[UNFUSED_CLASS]))
    # the Triton backend is one fused kernel: nothing separate
    tri = op_arrays(build_context(_plan(8, 512).workload, plan.topology, plan.mesh))
    assert float(np.abs(tri.fwd_serial_s).sum() + np.abs(tri.bwd_serial_s).sum()) == 0.0
    # the calibration's samples carry the split (matmul bytes streamed at the unfused op's class's
    # bandwidth, as the passes; the passes apart)
    t = {(u.name, u.phase): u for u in unit_terms(plan)}[("interformer.0.gdpa", "fwd")]
    assert t.mem_class == UNFUSED_CLASS == "unfused" and t.serial_mem_s > 0
    assert arr.fwd_mem_s[g] * ctx.eff.memory[UNFUSED_CLASS] == pytest.approx(
        ctx.mb_batch * F.padded_reference_attention(op, w, min(1.0, ctx.moments["history"][0] / m1)).fwd_bytes.expect(m1, m2)
        / gpu.hbm_bw_bytes_per_s)


# ------------------------------------------------------------------ FSDP2's copies on one rank


def test_fsdp_copies_on_one_rank_are_bytes_at_the_elementwise_bandwidth():
    """One rank, fp32 parameters gathered in bf16, gradients reduced in fp32: forward casts each
    parameter (4+2 bytes) and copies it into the unsharded parameter (2+2); backward copies the bf16
    gradients into the fp32 reduce buffer (2+4), then the one-rank reduce-scatter is a division and a
    copy (8+8); plus the embedding outputs' cast (4+2 each way)."""
    plan = _plan(8, 512)
    w = plan.workload  # (CUDA graphs off: FSDP2 wraps the one rank; the graphed case is the test below)
    w = w.model_copy(update={"kernels": w.kernels.model_copy(update={"cuda_graphs": "off"})})
    ctx = build_context(w, plan.topology, plan.mesh)
    assert not ctx.dense_graphs
    N = float(ctx.layer_params.sum() + ctx.layer_expert_params.sum())
    ta = ctx.tables
    elems = float((np.where(ta.is_seq, ctx.mb_batch * ta.lookups_per_sample, ctx.mb_batch * ta.features) * ta.dim).sum())
    assert EMBEDDING_OUTPUT_BYTES == 4 and elems > 0
    fwd, bwd = fsdp_copy_bytes(ctx)
    assert fwd == pytest.approx(N * (4 + 2) + N * (2 + 2) + elems * 6)
    assert bwd == pytest.approx(N * (2 + 4) + 2 * N * 8 + elems * 6)
    fixed = dense_fixed_costs(ctx)
    bw = plan.topology.gpu.hbm_bw_bytes_per_s * ctx.eff.memory["elementwise"]
    launch = ctx.eff.launch_s["elementwise"]
    assert fixed.fsdp_copy_fwd_s == pytest.approx(fwd / bw + FSDP_COPY_LAUNCHES[0] * launch)
    assert fixed.fsdp_copy_bwd_s == pytest.approx(bwd / bw + FSDP_COPY_LAUNCHES[1] * launch)
    # the optimizer reads the gradients once more for the trainer's norm (fp32: 4 bytes a parameter)
    st = plan.workload.optimizer.dense_state_bytes_per_param
    assert fixed.optimizer_step_s == pytest.approx(N * (2 * 4 + 4 + 2 * st + 4) / bw + OPTIMIZER_LAUNCHES * launch)


def test_graphed_one_rank_prices_the_graphs_casts_not_fsdp2s_copies():
    """One rank under CUDA graphs has no FSDP2: forward casts the fp32 masters to bf16 (4+2 a parameter)
    and copies the fp32 embedding outputs into the captured buffers (4+4) before casting them (4+2);
    backward casts the gradients back (2+4), adds them into the fp32 buffers (4+4+4) and casts the input
    gradients (2+4). Less than FSDP2's one-rank copies, by N·(2+2) forward and N·16-N·12 backward."""
    plan = _plan(8, 512)
    ctx = build_context(plan.workload, plan.topology, plan.mesh)
    assert ctx.dense_graphs
    N = float(ctx.layer_params.sum() + ctx.layer_expert_params.sum())
    ta = ctx.tables
    elems = float((np.where(ta.is_seq, ctx.mb_batch * ta.lookups_per_sample, ctx.mb_batch * ta.features) * ta.dim).sum())
    fwd, bwd = fsdp_copy_bytes(ctx)
    assert fwd == pytest.approx(N * (4 + 2) + elems * 8 + elems * 6)
    assert bwd == pytest.approx(N * (2 + 4) + N * 12 + elems * 6)
    w = plan.workload
    eager = build_context(w.model_copy(update={"kernels": w.kernels.model_copy(update={"cuda_graphs": "off"})}),
                          plan.topology, plan.mesh)
    fe, be = fsdp_copy_bytes(eager)
    assert fe - fwd == pytest.approx(N * 4 - elems * 8) and be - bwd == pytest.approx(N * 4)


def test_fsdp_copies_add_to_the_one_rank_step_and_to_its_launches():
    """On one GPU nothing overlaps compute: the step grows by exactly the copies' time, the breakdown
    names them 'fsdp.hooks', and priced_launches counts their launches (the step's launch slope)."""
    from dataclasses import replace

    plan = _plan(8, 512)
    ctx = build_context(plan.workload, plan.topology, plan.mesh)
    sc = price(ctx, None, plan.layers, plan.balancing, plan.kernels)
    fixed = dense_fixed_costs(ctx)
    rows = {(o.name, o.phase): o for o in sc.ops}
    assert rows[("fsdp.hooks", "fwd")].time_s == pytest.approx(fixed.fsdp_copy_fwd_s * ctx.micro_batches)
    assert rows[("fsdp.hooks", "bwd")].time_s == pytest.approx(fixed.fsdp_copy_bwd_s * ctx.micro_batches)
    ctx0 = build_context(plan.workload, plan.topology, plan.mesh)
    ctx0.cache["dense_fixed"] = replace(dense_fixed_costs(ctx0), fsdp_copy_fwd_s=0.0, fsdp_copy_bwd_s=0.0)
    sc0 = price(ctx0, None, plan.layers, plan.balancing, plan.kernels)
    assert sc.step_time_s - sc0.step_time_s == pytest.approx((fixed.fsdp_copy_fwd_s + fixed.fsdp_copy_bwd_s) * ctx.micro_batches)
    arr = op_arrays(ctx, plan.kernels)
    assert priced_launches(ctx, arr) - priced_launches(ctx0, arr) == pytest.approx(sum(FSDP_COPY_LAUNCHES) * ctx.micro_batches)


def test_fsdp_copies_with_sharding_follow_fsdp2s_all_gather_and_reduce_scatter_copies():
    """With 8 dense shards: forward casts the local shard, copies it into the all-gather input and copies
    the gathered buffer out (N/8·6 + N/8·4 + N·4), again in backward for every layer but the last;
    backward copies the gradients in (N·6) and no one-rank division runs (the collective reduces)."""
    plan = _plan(64, 512)
    ctx = build_context(plan.workload, plan.topology, plan.mesh)
    N = float(ctx.layer_params.sum() + ctx.layer_expert_params.sum())
    # only the mesh's shard count matters here; the one-GPU topology cannot place 8 ranks, so set it directly
    ctx.mesh = MeshPlan(dense_shard=8, sparse_shard=8)
    fwd, bwd = fsdp_copy_bytes(ctx)
    ta = ctx.tables
    elems = float((np.where(ta.is_seq, ctx.mb_batch * ta.lookups_per_sample, ctx.mb_batch * ta.features) * ta.dim).sum())
    gather = N / 8 * 6 + N / 8 * 4 + N * 4
    last = float(ctx.layer_params[-1] + ctx.layer_expert_params[-1])
    assert fwd == pytest.approx(gather + elems * 6)
    assert bwd == pytest.approx(N * 6 + gather * (1 - last / N) + elems * 6)


# ------------------------------------------------------------------ attribution


def test_trace_attributes_the_input_casts_backward_and_the_gradient_norm():
    """FSDP2's cast of the forward inputs is an autograd op made in its hook range: its backward (the
    gradient cast back, a ToCopyBackward0 node) is fsdp.hooks's; the trainer's gradient norm
    (aten::_foreach_norm outside any range) is the optimizer's; other unnamed work stays unattributed."""
    e = [
        _ev("user_annotation", "ProfilerStep#5", 0, 1000, 1),
        _ev("gpu_user_annotation", "ProfilerStep#5", 0, 1000, 7),
        _ev("user_annotation", "FSDP::cast_forward_inputs", 10, 20, 1),
        _ev("cpu_op", "aten::_to_copy", 12, 10, 1, **{"Sequence number": 42}),
        _ev("cuda_runtime", "cudaLaunchKernel", 14, 2, 1, correlation=1),
        _ev("kernel", "void at::native::vectorized_elementwise_kernel<8, bfloat16_copy>", 50, 30, 7, correlation=1),
        # backward of that cast
        _ev("cpu_op", "autograd::engine::evaluate_function: ToCopyBackward0", 300, 40, 2, **{"Sequence number": 42}),
        _ev("cuda_runtime", "cudaLaunchKernel", 310, 2, 2, correlation=2),
        _ev("kernel", "void at::native::elementwise_kernel<128, 4, direct_copy>", 320, 90, 7, correlation=2),
        # the gradient norm, then the optimizer
        _ev("cpu_op", "aten::_foreach_norm", 500, 30, 1),
        _ev("cuda_runtime", "cudaLaunchKernel", 505, 2, 1, correlation=3),
        _ev("kernel", "void at::native::multi_tensor_apply_kernel<norm>", 510, 25, 7, correlation=3),
        _ev("user_annotation", "Optimizer.step#AdamW.step", 600, 100, 1),
        _ev("cuda_runtime", "cudaLaunchKernel", 610, 2, 1, correlation=4),
        _ev("kernel", "void at::native::multi_tensor_apply_kernel<adam>", 620, 100, 7, correlation=4),
        # an unnamed add: still unattributed
        _ev("cpu_op", "aten::add", 800, 10, 1),
        _ev("cuda_runtime", "cudaLaunchKernel", 802, 2, 1, correlation=5),
        _ev("kernel", "void at::native::vectorized_elementwise_kernel<8, add>", 805, 7, 7, correlation=5),
    ]
    att = attribute({"traceEvents": e})
    ops = {(o.name, o.phase): o.time_s for o in att.ops}
    assert ops[("fsdp.hooks", "fwd")] == pytest.approx(30e-6)
    assert ops[("fsdp.hooks", "bwd")] == pytest.approx(90e-6)
    assert ops[("optimizer.step", "optimizer")] == pytest.approx(125e-6)
    assert att.unattributed_s == pytest.approx(7e-6)


def test_step_phases_add_up_to_the_step_and_its_priced_launches():
    """The per-phase reading's parts are the pricer's own: device time per phase sums to the step under
    the device fit, launches per phase to the step's launch slope; and with every phase host-bound or
    every phase device-bound the per-phase form equals the max form."""
    from coplan.calibration.device_fit import FitResult
    from coplan.calibration.step_price import step_launches
    from benchmarks._calibration_extras import step_phases

    plan = _plan(8, 512)
    res = FitResult({("gemm", "bf16"): 0.6, ("attention", "bf16"): 0.4}, {"gemm": 0.8, "attention": 0.7, "elementwise": 0.7,
                    "embedding": 0.1}, {"gemm": 4e-6, "attention": 6e-6, "elementwise": 2e-6, "embedding": 5e-6},
                    np.zeros(0), np.zeros(0), ())
    D, N = step_phases(plan, res)
    p0, n = step_launches(plan, res)
    assert D.sum() == pytest.approx(p0, rel=1e-9) and N.sum() == pytest.approx(n, rel=1e-6)
    assert (D > 0).all() and (N > 0).all()
    h_hi = float((D / N).max()) * 2  # every phase host-bound
    assert float(np.maximum(D, h_hi * N).sum()) == pytest.approx(max(p0, h_hi * n))
    h_lo = float((D / N).min()) / 2  # every phase device-bound
    assert float(np.maximum(D, h_lo * N).sum()) == pytest.approx(max(p0, h_lo * n))
