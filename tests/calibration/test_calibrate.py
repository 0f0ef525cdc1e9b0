"""Calibration: trace attribution and the fit, on Kineto traces synthesised from the cost model with
known efficiencies and noise, and on a real CPU trace from torch.profiler."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from coplan.calibration.runs import CalibrationError, run_samples
from coplan.calibration.step_price import predict_step_time
from coplan.calibration.assemble import calibrate
from coplan.calibration.device_fit import predict
from coplan.calibration.terms import unit_terms
from coplan.costmodel.efficiency import resolve_efficiencies
from coplan.calibration.attribution import attribute, classify_kernel
from coplan.errors import MismatchError
from coplan.spec import Calibration, MeshPlan, Plan, TableShard, dump_spec, load_topology, load_workload, spec_sha256

TRUE_COMPUTE = {("gemm", "bf16"): 0.62, ("attention", "bf16"): 0.41, ("elementwise", "bf16"): 0.5}
TRUE_MEMORY = {"gemm": 0.8, "attention": 0.7, "elementwise": 0.72, "embedding": 0.55}
TRUE_LAUNCH = {"gemm": 5e-6, "attention": 7e-6, "elementwise": 3e-6, "embedding": 9e-6}
TRUE_LOOKUP_ID_S = 0.7e-6
"""Seconds per serial id of the sequence lookups (the runs have no config.json: whole-history bags)."""


def _plan(batch: int, mean_len: int) -> Plan:
    t = load_topology("h200-1gpu")
    doc = load_workload("gem-h200").model_dump(mode="json")
    doc["batch"] = {"local_batch_size": batch}
    doc["sequences"][0]["length"]["mean"] = mean_len
    from coplan.spec import Workload, parse_spec

    w = parse_spec(Workload, doc, "gem-h200 variant")
    tables = tuple(TableShard(table=tab.name, sharding_type="table_wise", ranks=(0,)) for tab in w.all_tables)
    return Plan(topology=t, workload=w, world_size=1, mesh=MeshPlan(dense_shard=1, sparse_shard=1), tables=tables,
                topology_sha256=spec_sha256(t), workload_sha256=spec_sha256(w))


def synthesised(plan: Plan) -> Plan:
    """``plan`` as a synthetic run executed it: its summary (where a test writes one) records no fused FiLM and no
    masked head dims, so calibrate prices it with the PyTorch FiLM and padded copies (``calibration.runs.as_ran``);
    the trace is made of those terms."""
    ran = plan.workload.model_copy(update={"kernels": plan.workload.kernels.model_copy(
        update={"film": "eager", "head_pad": "copies"})})
    return plan.model_copy(update={"workload": ran})


def _synth_run(root: Path, name: str, plan: Plan, rng: np.random.Generator, noise: float, steps: int = 2,
               scale=None) -> Path:
    """A run directory whose trace says each op took the cost model's time under TRUE_* (± noise), times
    ``scale(term)`` where given."""
    d = root / name
    (d / "traces").mkdir(parents=True)
    dump_spec(plan, d / "plan.json")
    terms = unit_terms(synthesised(plan), seq_chunk=0)  # as calibrate reads a run without config.json
    events: list[dict] = []
    t, corr, seq = 0.0, 0, 0
    for step in range(steps):
        start = t
        fwd_seq = {}
        for term in [x for x in terms if x.phase == "fwd"]:
            names = term.members or (term.name,)
            truth = predict([term], TRUE_COMPUTE, TRUE_MEMORY, TRUE_LAUNCH, TRUE_LOOKUP_ID_S)[0] * (scale(term) if scale else 1.0)
            for nm in names:
                dur_us = truth * 1e6 / len(names) * (1 + noise * rng.standard_normal())
                corr += 1
                seq += 1
                fwd_seq[nm] = seq
                events += [
                    {"ph": "X", "cat": "user_annotation", "name": nm, "ts": t, "dur": 10.0, "tid": 1},
                    {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": t + 1, "dur": 5.0, "tid": 1, "args": {"Sequence number": seq}},
                    {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": t + 2, "dur": 2.0, "tid": 1, "args": {"correlation": corr}},
                    {"ph": "X", "cat": "kernel", "name": "sm90_xmma_gemm_bf16" if term.op_class == "gemm" else term.name, "ts": t + 20, "dur": max(dur_us, 0.01), "tid": 7, "args": {"correlation": corr}},
                ]
                t += 10 + max(dur_us, 0.01) + 20
        for term in [x for x in terms if x.phase == "bwd"]:
            names = term.members or (term.name,)
            truth = predict([term], TRUE_COMPUTE, TRUE_MEMORY, TRUE_LAUNCH, TRUE_LOOKUP_ID_S)[0] * (scale(term) if scale else 1.0)
            for nm in names:
                dur_us = truth * 1e6 / len(names) * (1 + noise * rng.standard_normal())
                corr += 1
                events += [
                    {"ph": "X", "cat": "cpu_op", "name": "autograd::engine::evaluate_function: MmBackward0", "ts": t, "dur": 8.0, "tid": 2, "args": {"Sequence number": fwd_seq[nm]}},
                    {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": t + 1, "dur": 2.0, "tid": 2, "args": {"correlation": corr}},
                    {"ph": "X", "cat": "kernel", "name": "elementwise_kernel", "ts": t + 20, "dur": max(dur_us, 0.01), "tid": 7, "args": {"correlation": corr}},
                ]
                t += 10 + max(dur_us, 0.01) + 20
        events.append({"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{step}", "ts": start - 0.5, "dur": t - start + 1, "tid": 1})
    # one unattributed kernel (an optimizer step nobody named)
    corr += 1
    events += [{"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": t + 1, "dur": 1, "tid": 1, "args": {"correlation": corr}},
               {"ph": "X", "cat": "kernel", "name": "multi_tensor_apply_kernel", "ts": t + 5, "dur": 50.0, "tid": 7, "args": {"correlation": corr}}]
    (d / "traces" / "rank0.json").write_text(json.dumps({"traceEvents": events}))
    (d / "metrics.jsonl").write_text("")
    return d


def _write_step(run_dir: Path, step_s: float) -> None:
    """A run summary whose measured step time (every statistic) is ``step_s``."""
    from coplan.spec import RunResult
    from coplan.spec.run import StepTimeStats

    st = StepTimeStats(mean_s=step_s, p50_s=step_s, p90_s=step_s, p99_s=step_s, min_s=step_s, max_s=step_s)
    dump_spec(RunResult(run_id=run_dir.name, world_size=1, steps=10, warmup_steps=2, device="NVIDIA H200", step_time=st),
              run_dir / "summary.json")


def test_fit_recovers_known_efficiencies(tmp_path):
    rng = np.random.default_rng(0)
    runs = [_synth_run(tmp_path, f"r{i}", _plan(b, L), rng, noise=0.03) for i, (b, L) in enumerate([(8, 256), (64, 1024), (32, 512)])]
    cal, res, parsed = calibrate(runs)
    assert cal.device == "NVIDIA H200"
    for (cls, dt), truth in TRUE_COMPUTE.items():
        fitted = cal.op_classes[cls].compute_efficiency.get(dt)
        if cls == "elementwise":  # elementwise ops are memory-bound: compute efficiency is unidentifiable
            continue
        assert fitted == pytest.approx(truth, rel=0.05), (cls, fitted, truth)
    for cls in ("gemm", "attention", "elementwise", "embedding"):
        assert cal.op_classes[cls].memory_efficiency == pytest.approx(TRUE_MEMORY[cls], rel=0.08), cls
    assert cal.op_classes["gemm"].launch_overhead_s == pytest.approx(TRUE_LAUNCH["gemm"], rel=0.3)
    assert cal.lookup_id_latency_s == pytest.approx(TRUE_LOOKUP_ID_S, rel=0.08)
    assert cal.fit_error.median_abs_rel_error < 0.04
    assert all(r.unattributed_s > 0 and r.attributed_share > 0.9 for r in parsed)


def test_calibration_from_one_device_is_refused_on_another(tmp_path):
    rng = np.random.default_rng(1)
    cal, _, _ = calibrate([_synth_run(tmp_path, "r", _plan(16, 256), rng, noise=0.0)])
    meta = load_topology("meta-roce-24k")  # H100
    with pytest.raises(MismatchError, match="re-calibrate"):
        resolve_efficiencies(meta, cal)
    assert resolve_efficiencies(meta, cal, force=True).compute[("gemm", "bf16")] == pytest.approx(cal.op_classes["gemm"].compute_efficiency["bf16"])


def test_bad_run_dirs_are_explained(tmp_path):
    with pytest.raises(CalibrationError, match="not a run directory"):
        calibrate([tmp_path / "nope"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(CalibrationError, match="no plan.json"):
        calibrate([tmp_path / "empty"])


def test_real_cpu_profiler_trace_is_attributed(tmp_path):
    torch = pytest.importorskip("torch")
    from torch.profiler import ProfilerActivity, profile, record_function

    lin = torch.nn.Linear(64, 64)
    x = torch.randn(16, 64)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(2):
            with record_function("kunlun.0.qkv"):
                y = lin(x)
            with record_function("kunlun.0.norm_act"):
                z = torch.nn.functional.silu(y)
            z.square().mean().backward()
    prof.export_chrome_trace(str(tmp_path / "t.json"))
    att = attribute(json.loads((tmp_path / "t.json").read_text()))
    got = {(o.name, o.phase) for o in att.ops}
    assert {("kunlun.0.qkv", "fwd"), ("kunlun.0.qkv", "bwd"), ("kunlun.0.norm_act", "fwd"), ("kunlun.0.norm_act", "bwd")} <= got
    assert not att.on_device
    assert 0 < att.unattributed_s < att.total_s  # the loss ops were in no range


def test_kernel_rules():
    assert classify_kernel("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64") == "gemm"
    assert classify_kernel("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTN") == "gemm"
    assert classify_kernel("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)") == "collective:all_gather"
    assert classify_kernel("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)") == "collective:all_to_all"
    assert classify_kernel("split_embedding_codegen_forward_unweighted_kernel") == "embedding"
    assert classify_kernel("_gdpa_fwd_kernel") == "attention"
    assert classify_kernel("void at::native::vectorized_elementwise_kernel<4>") == "elementwise"


def test_cpu_recompute_is_its_own_phase(tmp_path):
    torch = pytest.importorskip("torch")
    from torch.profiler import ProfilerActivity, profile, record_function
    from torch.utils.checkpoint import checkpoint

    lin = torch.nn.Linear(32, 32)
    x = torch.randn(8, 32, requires_grad=True)

    def layer(t):
        with record_function("interformer.1.ffn_up"):
            return torch.relu(lin(t))

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        checkpoint(layer, x, use_reentrant=False).sum().backward()
    prof.export_chrome_trace(str(tmp_path / "t.json"))
    att = attribute(json.loads((tmp_path / "t.json").read_text()))
    phases = {o.phase for o in att.ops if o.name == "interformer.1.ffn_up"}
    assert phases == {"fwd", "recompute", "bwd"}, att.ops
    assert att.unattributed_s + sum(o.time_s for o in att.ops) == pytest.approx(att.total_s)


def test_host_cost_per_launch_is_recovered(tmp_path):
    """Runs whose measured step is max(device, launches x h) (host and device concurrent): the fit finds
    h from the host-bound runs, writes it as the calibration's host_launch_s (launch overheads stay the
    device fit's), and the calibrated pricer reproduces every step, device-bound ones included."""
    from coplan.calibration.host_fit import fit_host_launch_cost
    from coplan.calibration.step_price import predict_step_time, step_launches
    from coplan.spec import Calibration, OpClassCalibration

    rng = np.random.default_rng(3)
    device = Calibration(device="NVIDIA H200", op_classes={
        c: OpClassCalibration(compute_efficiency={dt: v for (cc, dt), v in TRUE_COMPUTE.items() if cc == c},
                              memory_efficiency=TRUE_MEMORY[c], launch_overhead_s=TRUE_LAUNCH[c])
        for c in TRUE_MEMORY}, lookup_id_latency_s=TRUE_LOOKUP_ID_S)
    shapes = [(8, 256), (16, 512), (64, 1024), (256, 2048)]
    from coplan.spec.run_dir import _eager

    plans = [_eager(_plan(b, L)) for b, L in shapes]  # eager runs: every dense launch costs the host
    # h between the smallest and the largest run's device time per launch: some runs host-bound, some not
    dev, nl = [], []
    for p in plans:
        d0 = predict_step_time(p, device, seq_chunk=0)
        d1 = predict_step_time(p, device.model_copy(update={"op_classes": {
            c: oc.model_copy(update={"launch_overhead_s": oc.launch_overhead_s + 1e-6}) for c, oc in device.op_classes.items()}}), seq_chunk=0)
        dev.append(d0)
        nl.append((d1 - d0) / 1e-6)
    per = sorted(d / n for d, n in zip(dev, nl))
    h_true = float(np.sqrt(per[0] * per[-1]))
    truth = device.model_copy(update={"host_launch_s": h_true})
    bound = [h_true * n > d for d, n in zip(dev, nl)]
    assert any(bound) and not all(bound), (per, h_true)
    dirs = []
    for i, plan in enumerate(plans):
        d = _synth_run(tmp_path, f"r{i}", plan, rng, noise=0.02)
        step = predict_step_time(plan, truth, seq_chunk=0)
        assert step == pytest.approx(max(dev[i], h_true * nl[i]), rel=1e-9)
        _write_step(d, step)
        dirs.append(d)
    cal, res, runs = calibrate(dirs, host=True)
    hf = fit_host_launch_cost(runs, res)
    assert hf is not None and hf.form == "max" and hf.h_s == pytest.approx(h_true, rel=0.1)
    assert hf.max_abs_error < 0.1
    assert cal.host_launch_s == pytest.approx(hf.h_s)
    assert cal.op_classes["gemm"].launch_overhead_s == pytest.approx(res.launch_s["gemm"])
    assert "host cost" in cal.notes
    for r in runs:
        meas = r.result.step_time.p50_s
        assert predict_step_time(r.plan, cal, seq_chunk=r.seq_chunk) == pytest.approx(meas, rel=0.1)
    # the additive form cannot fit device-bound and host-bound runs at once as well
    ha = fit_host_launch_cost(runs, res, form="additive")
    assert ha.max_abs_error > hf.max_abs_error
    with pytest.raises(CalibrationError, match="host form"):
        fit_host_launch_cost(runs, res, form="sum")
    # off by default: no host cost
    cal0, _, _ = calibrate(dirs)
    assert cal0.host_launch_s is None
    _, n = step_launches(runs[0].plan, res)
    assert n > 0
    # the CLI writes the same host cost by default (and with --host-cost), and none with --no-host-cost
    from coplan.cli import main
    from coplan.spec import load_calibration

    out = tmp_path / "cal.json"
    assert main(["calibrate", *map(str, dirs), "-o", str(out), "--host-cost", "--json"]) == 0
    assert load_calibration(out).host_launch_s == pytest.approx(cal.host_launch_s, rel=1e-6)
    assert main(["calibrate", *map(str, dirs), "-o", str(out), "--json"]) == 0
    assert load_calibration(out).host_launch_s == pytest.approx(cal.host_launch_s, rel=1e-6)
    assert main(["calibrate", *map(str, dirs), "-o", str(out), "--json", "--no-host-cost"]) == 0
    assert load_calibration(out).host_launch_s is None


def test_priced_launches_is_the_step_slope_in_the_launch_cost():
    """The host-bound form prices the host at priced_launches x h: that count must be exactly what the
    pricer charges a launch overhead for (recompute and FP8 layers included)."""
    from coplan.calibration.step_price import predict_step_time
    from coplan.costmodel.compute import op_arrays
    from coplan.costmodel.context import build_context
    from coplan.costmodel.pricer import assignment_of, collections_held, default_assignment, layer_sets, price, priced_launches
    from coplan.spec import Calibration, LayerPlan, OpClassCalibration

    from coplan.spec.run_dir import _eager

    base = _eager(_plan(32, 512))  # (eager: under CUDA graphs the host's count is not the device's, below)
    names = build_context(base.workload, base.topology, base.mesh).layer_names
    layers = [LayerPlan(name=names[1], recompute=True), LayerPlan(name=names[2], precision="fp8")]
    plan = base.model_copy(update={"layers": tuple(layers)})

    def cal(la, h=None):
        return Calibration(device="NVIDIA H200", host_launch_s=h, op_classes={
            c: OpClassCalibration(launch_overhead_s=la) for c in TRUE_MEMORY})

    for p in (base, plan):
        d0, d1 = predict_step_time(p, cal(1e-6)), predict_step_time(p, cal(2e-6))
        ctx = build_context(p.workload, p.topology, p.mesh, cal(1e-6))
        rec, fp8 = layer_sets(ctx, p.layers)
        a = assignment_of(ctx, p.tables) if p.tables else default_assignment(ctx)
        n = priced_launches(ctx, op_arrays(ctx, p.kernels, fp8), rec, float(collections_held(ctx, a).max()))
        assert (d1 - d0) / 1e-6 == pytest.approx(n, rel=1e-6)
        # host-bound: the step is the host's time and says so; device-bound: the host cost changes nothing
        h = 10 * d0 / n
        ctx = build_context(p.workload, p.topology, p.mesh, cal(1e-6, h))
        sc = price(ctx, p.tables or None, p.layers, p.balancing, p.kernels)
        assert sc.step_time_s == pytest.approx(n * h) and any("host-bound" in x for x in sc.notes)
        assert predict_step_time(p, cal(1e-6, 1e-3 * d0 / n)) == pytest.approx(d0)


def test_cuda_graphs_cut_the_hosts_launches_not_the_devices():
    """A one-GPU plan the trainer runs as CUDA graphs: the device's launch slope is unchanged, the host
    issues a few launches per micro-batch for the dense arch (recompute adds none), and an FP8 layer or
    ``kernels.cuda_graphs: off`` prices the eager host again."""
    from coplan.costmodel.compute import HOST_KERNELS_PER_PRICED_LAUNCH, op_arrays
    from coplan.costmodel.context import build_context
    from coplan.costmodel.flops import GRAPH_HOST_KERNELS
    from coplan.costmodel.pricer import emb_group_launches, host_launches, layer_sets, priced_launches
    from coplan.spec import LayerPlan
    from coplan.spec.run_dir import _eager

    graphed = _plan(32, 512)
    eager = _eager(graphed)
    ctx_g = build_context(graphed.workload, graphed.topology, graphed.mesh)
    ctx_e = build_context(eager.workload, eager.topology, eager.mesh)
    assert ctx_g.dense_graphs and not ctx_e.dense_graphs
    names = ctx_g.layer_names
    for layers in ((), (LayerPlan(name=names[1], recompute=True),)):
        rec, fp8 = layer_sets(ctx_g, layers)
        arr_g, arr_e = op_arrays(ctx_g, graphed.kernels, fp8), op_arrays(ctx_e, eager.kernels, fp8)
        assert priced_launches(ctx_g, arr_g, rec, 1.0) == pytest.approx(priced_launches(ctx_e, arr_e, rec, 1.0))
        opt = host_launches(ctx_g, arr_g, frozenset(), 0.0) - ctx_g.micro_batches * GRAPH_HOST_KERNELS / HOST_KERNELS_PER_PRICED_LAUNCH
        assert host_launches(ctx_g, arr_g, rec, 1.0) == pytest.approx(
            ctx_g.micro_batches * (GRAPH_HOST_KERNELS / HOST_KERNELS_PER_PRICED_LAUNCH + sum(emb_group_launches(True))) + opt)
        assert host_launches(ctx_g, arr_g, rec, 1.0) < 0.2 * host_launches(ctx_e, arr_e, rec, 1.0)
    rec, fp8 = layer_sets(ctx_g, (LayerPlan(name=names[2], precision="fp8"),))
    arr = op_arrays(ctx_g, graphed.kernels, fp8)
    assert host_launches(ctx_g, arr, rec, 1.0) == pytest.approx(priced_launches(ctx_g, arr, rec, 1.0))


def test_padded_reference_prices_the_expected_max_and_its_square():
    """The padded reference kernels cost E[max L] and E[(max L)²] of the micro-batch's lengths: exact
    from the pmf, against a Monte Carlo estimate; the square exceeds E[max]² for a heavy tail."""
    from coplan.costmodel.compute import expected_max_moments
    from coplan.spec.workload import LognormalLength

    d = LognormalLength(kind="lognormal", mean=512.0, sigma=0.8, min_len=16, max_len=4096)
    m1, m2 = expected_max_moments(d, 8)
    rng = np.random.default_rng(0)
    mu = np.log(512.0) - 0.8**2 / 2
    x = np.clip(np.rint(np.exp(mu + 0.8 * rng.standard_normal((200_000, 8)))), 16, 4096).max(axis=1)
    assert m1 == pytest.approx(x.mean(), rel=0.01)
    assert m2 == pytest.approx((x**2).mean(), rel=0.02)
    assert m2 > 1.2 * m1**2


def test_padded_reference_is_priced_as_it_runs():
    """On the reference backend, jagged attention is priced over full padded score blocks in TF32
    (no causal halving, no flash recompute) with its fp32 score passes and pad copies; model FLOPs
    stay those of the real lengths (never the padding)."""
    from coplan.costmodel import flops as F
    from coplan.costmodel.compute import REFERENCE_PAD_MULTIPLE, expected_max_moments, op_arrays
    from coplan.costmodel.context import build_context

    plan = _plan(8, 512)
    w = plan.workload
    ref = w.model_copy(update={"kernels": w.kernels.model_copy(update={"attention": "reference"})})
    blk = next(b for b in w.blocks if b.name == "interformer")
    H, dh, S = blk.num_heads, blk.head_dim, blk.num_summary_tokens
    ctx = build_context(ref, plan.topology, plan.mesh)
    tri, pad = op_arrays(ctx, w.kernels), op_arrays(ctx, ref.kernels)
    names = [ctx.ops[i].name for i in ctx.dense_idx]
    g, s = names.index("interformer.0.gdpa"), names.index("interformer.0.summary_attn")
    p1, p2 = expected_max_moments(ref.sequence("history").length, ctx.mb_batch, REFERENCE_PAD_MULTIPLE)
    n = ctx.mb_batch
    assert pad.fwd_flops[g] == pytest.approx(n * 4 * H * dh * p2)  # full P² pairs, 4·H·dₕ each
    assert pad.bwd_flops[g] == pytest.approx(n * 8 * H * dh * p2)  # no recomputed QKᵀ
    assert pad.fwd_flops[s] == pytest.approx(n * 4 * H * dh * S * p1)
    # memory: at least the GDPA score passes (32 bytes per fp32 score element forward, 44 backward)
    assert pad.fwd_bytes[g] > n * 32 * H * p2 and pad.bwd_bytes[g] > n * 44 * H * p2
    # the summary attention is its K/V pad copies: far more bytes than the fused kernel reads
    assert pad.fwd_bytes[s] > 5 * tri.fwd_bytes[s]
    peak = plan.topology.gpu.peak_flops_per_s[F.REFERENCE_MATMUL_DTYPE]
    assert pad.fwd_flop_s[g] == pytest.approx(pad.fwd_flops[g] / (peak * ctx.eff.compute_eff("attention", "tf32")))
    # model FLOPs of backward: the real lengths, identical whatever the backend
    assert pad.model_bwd_flops[g] == pytest.approx(tri.model_bwd_flops[g])
    # launches as the fused op's (h is per priced launch): the host-cost slope does not change with the backend
    assert list(pad.fwd_launches) == list(tri.fwd_launches) and list(pad.bwd_launches) == list(tri.bwd_launches)
    # the calibration samples carry the reference's own efficiency key
    terms = {(t.name, t.phase): t for t in unit_terms(plan.model_copy(update={"workload": ref, "kernels": plan.kernels.model_copy(update={"attention": "reference"})}))}
    assert terms[("interformer.0.gdpa", "fwd")].dtype == "tf32"
    assert terms[("interformer.0.qkv", "fwd")].dtype == "bf16"


def test_padded_reference_priced_at_the_batches_longest_lengths_when_known():
    """A run's known longest lengths per micro-batch (``seq_max``, or given to run_samples) replace the
    length pmf's E[max L], E[max L²] for the padded reference: its GDPA FLOPs scale with the measured
    E[M²] exactly, and the Triton backend ignores them."""
    from coplan.calibration.runs import measured_moments
    from coplan.calibration.terms import PADDED_SUFFIX, apply_moments
    from coplan.costmodel.compute import op_arrays, padded_length_moments
    from coplan.costmodel.context import build_context

    plan = _plan(8, 512)
    w = plan.workload
    ref = w.model_copy(update={"kernels": w.kernels.model_copy(update={"attention": "reference"})})
    rows = [{"step": 3, "seq_stats": {"history": [8, 4000, 2.5e6]}, "seq_max": {"history": [1000]}},
            {"step": 4, "seq_stats": {"history": [8, 4800, 3.5e6]}, "seq_max": {"history": [3000]}},
            {"step": 5, "seq_stats": {"history": [8, 9999, 9e9]}, "seq_max": {"history": [4096]}}]
    mom = measured_moments(rows, [3, 4])
    assert mom["history"] == pytest.approx((8800 / 16, 6.0e6 / 16))
    assert mom["history" + PADDED_SUFFIX] == pytest.approx((2000.0, (1000**2 + 3000**2) / 2))
    assert "history" + PADDED_SUFFIX not in measured_moments([{k: v for k, v in r.items() if k != "seq_max"} for r in rows])

    ctx = build_context(ref, plan.topology, plan.mesh)
    names = [ctx.ops[i].name for i in ctx.dense_idx]
    g = names.index("interformer.0.gdpa")
    blk = next(b for b in w.blocks if b.name == "interformer")
    apply_moments(ctx, mom)
    pad = op_arrays(ctx, ref.kernels)
    # the reference pads to a multiple of 16: the spread's moments get the rounding's mean and spread
    padded = padded_length_moments(*mom["history" + PADDED_SUFFIX])
    assert padded[1] == pytest.approx(5e6 + 2 * 2000 * 7.5 + 15 * 31 / 6)
    assert pad.fwd_flops[g] == pytest.approx(ctx.mb_batch * 4 * blk.num_heads * blk.head_dim * padded[1])
    apply_moments(ctx, {"history" + PADDED_SUFFIX: (4000.0, 4000.0**2)})  # one length, a multiple of 16: exact
    assert op_arrays(ctx, ref.kernels).fwd_flops[g] == pytest.approx(pad.fwd_flops[g] * 16e6 / padded[1])
    # the fused kernels never pad: the same measured maxima change nothing there
    plain = build_context(w, plan.topology, plan.mesh)
    before = op_arrays(plain, w.kernels).fwd_flops[g]
    apply_moments(plain, {"history" + PADDED_SUFFIX: (4000.0, 4000.0**2)})
    assert op_arrays(plain, w.kernels).fwd_flops[g] == pytest.approx(before)


def _base_calibration(tmp_path) -> Calibration:
    rng = np.random.default_rng(5)
    runs = [_synth_run(tmp_path / "base", f"b{i}", _plan(b, L), rng, noise=0.0) for i, (b, L) in enumerate([(8, 256), (64, 1024)])]
    return calibrate(runs)[0]


def _strip_op_names(run_dir: Path) -> None:
    """The trace as a replayed CUDA graph of the dense arch leaves it: its kernels run, no op range names them
    (the sparse lookups, outside the graphs, keep theirs)."""
    path = run_dir / "traces" / "rank0.json"
    trace = json.loads(path.read_text())
    trace["traceEvents"] = [e for e in trace["traceEvents"]
                            if e.get("cat") != "user_annotation" or e["name"].startswith(("ProfilerStep#", "sparse"))]
    path.write_text(json.dumps(trace))


def test_base_keeps_its_device_terms_when_the_traces_do_not_attribute(tmp_path):
    """coplan calibrate --base: runs whose traces name no op (replayed graphs) refit only the step-level terms;
    every device term is the base's, and the notes say why."""
    from coplan.calibration.assemble import MIN_ATTRIBUTED_SHARE

    base = _base_calibration(tmp_path)
    rng = np.random.default_rng(6)
    dirs = []
    for i, (b, L) in enumerate([(32, 256), (32, 512), (32, 1024)]):  # one batch: host terms cannot tell them apart
        d = _synth_run(tmp_path, f"g{i}", _plan(b, L), rng, noise=0.0)
        _strip_op_names(d)
        dirs.append(d)
    runs = [run_samples(d) for d in dirs]
    assert max(r.attributed_share for r in runs) < MIN_ATTRIBUTED_SHARE
    # measured steps 1.3x the base's device price: the device-step factor takes it
    for d, r in zip(dirs, runs):
        _write_step(d, 1.3 * predict_step_time(r.plan, base, seq_chunk=0))  # (seq_chunk as calibrate reads these runs)
    cal, _, _ = calibrate(dirs, host=True, base=base, base_name="base.json")
    assert cal.op_classes == base.op_classes
    assert cal.lookup_id_latency_s == base.lookup_id_latency_s
    assert cal.device_step_factor == pytest.approx(1.3, rel=0.03)
    assert "base.json" in cal.notes and "kept whole" in cal.notes


def test_base_is_the_starting_point_and_fills_classes_the_runs_do_not_measure(tmp_path):
    base = _base_calibration(tmp_path)
    rng = np.random.default_rng(7)
    dirs = [_synth_run(tmp_path, f"r{i}", _plan(b, L), rng, noise=0.02) for i, (b, L) in enumerate([(8, 256), (64, 1024), (32, 512)])]
    cal, _, _ = calibrate(dirs, base=base, base_name="base.json")
    assert cal.op_classes["gemm"].compute_efficiency["bf16"] == pytest.approx(TRUE_COMPUTE[("gemm", "bf16")], rel=0.05)
    assert set(base.op_classes) <= set(cal.op_classes)
    assert "starting point" in cal.notes


def test_a_fused_ffn_gives_no_samples_for_the_ops_it_took_over(tmp_path):
    """A layer whose FFN ran fused (one ``<layer>.ffn_fused`` range, fp8_recipe blockwise-fused) measures 0 for its
    ``ffn_up``/``ffn_down`` and a short ``norm_act``: none of the three is fitted, the fused time is listed as
    unpriced, and the other layers' samples are untouched."""
    rng = np.random.default_rng(0)
    d = _synth_run(tmp_path, "fused", _plan(64, 256), rng, noise=0.0)
    trace = d / "traces" / "rank0.json"
    doc = json.loads(trace.read_text())
    for e in doc["traceEvents"]:
        if e.get("name") in ("interformer.0.ffn_up", "interformer.0.ffn_down"):
            e["name"] = "interformer.0.ffn_fused"
    trace.write_text(json.dumps(doc))
    r = run_samples(d)
    names = {s.name for s in r.samples}
    for op in ("ffn_up", "ffn_down", "norm_act"):
        assert f"interformer.0.{op}" not in names
        assert f"interformer.1.{op}" in names
    assert r.unpriced_s.get("interformer.0.ffn_fused:fwd", 0) > 0
    plain = run_samples(_synth_run(tmp_path, "plain", _plan(64, 256), np.random.default_rng(0), noise=0.0))
    assert {s.name for s in plain.samples} - names == {f"interformer.0.{op}" for op in ("ffn_up", "ffn_down", "norm_act")}
