"""Issue 8, host time and the sequence lookup: the per-sample host cost recovered from synthetic runs,
the no-bag lookup priced by its bag layout (``seq_chunk``), runs' bag layout read from their files, and
calibration files written before these fields still loading."""

from __future__ import annotations

import json

import numpy as np
import pytest

from coplan.calibration.assemble import calibrate
from coplan.calibration.host_fit import fit_host_launch_cost
from coplan.calibration.runs import run_seq_chunk
from coplan.calibration.step_price import predict_step_time
from coplan.costmodel.context import Options, build_context
from coplan.costmodel.decomposed import seq_lookup_floor_s, table_option_costs
from coplan.costmodel.efficiency import DEFAULT_LOOKUP_ID_LATENCY_S, resolve_efficiencies
from coplan.errors import CoplanError
from coplan.spec import Calibration, MeshPlan, OpClassCalibration, Plan, TableShard, Workload, load_calibration
from coplan.spec import dump_spec, load_topology, load_workload, parse_spec, spec_sha256

from .test_calibrate import TRUE_COMPUTE, TRUE_LAUNCH, TRUE_LOOKUP_ID_S, TRUE_MEMORY, _synth_run, _write_step, synthesised


def _plan(batch: int, mean_len: float, layers: int = 4, *, sigma: float | None = None, fixed: int | None = None) -> Plan:
    t = load_topology("h200-1gpu")
    doc = load_workload("gem-h200").model_dump(mode="json")
    doc["batch"] = {"local_batch_size": batch}
    if fixed is not None:
        doc["sequences"][0]["length"] = {"kind": "fixed", "length": fixed}
    else:
        doc["sequences"][0]["length"]["mean"] = mean_len
        if sigma is not None:
            doc["sequences"][0]["length"]["sigma"] = sigma
    for b in doc["blocks"]:
        if b["type"] == "interformer":
            b["num_layers"] = layers
    w = parse_spec(Workload, doc, "gem-h200 variant")
    tables = tuple(TableShard(table=tab.name, sharding_type="table_wise", ranks=(0,)) for tab in w.all_tables)
    return Plan(topology=t, workload=w, world_size=1, mesh=MeshPlan(dense_shard=1, sparse_shard=1), tables=tables,
                topology_sha256=spec_sha256(t), workload_sha256=spec_sha256(w))


DEVICE = Calibration(device="NVIDIA H200", op_classes={
    c: OpClassCalibration(compute_efficiency={dt: v for (cc, dt), v in TRUE_COMPUTE.items() if cc == c},
                          memory_efficiency=TRUE_MEMORY[c], launch_overhead_s=TRUE_LAUNCH[c])
    for c in TRUE_MEMORY}, lookup_id_latency_s=TRUE_LOOKUP_ID_S)


def _device_and_launches(plan: Plan) -> tuple[float, float]:
    plan = synthesised(plan)  # (what the synthetic runs' traces hold)
    d0 = predict_step_time(plan, DEVICE, seq_chunk=0)
    bumped = DEVICE.model_copy(update={"op_classes": {
        c: oc.model_copy(update={"launch_overhead_s": oc.launch_overhead_s + 1e-6}) for c, oc in DEVICE.op_classes.items()}})
    return d0, (predict_step_time(plan, bumped, seq_chunk=0) - d0) / 1e-6


def test_per_sample_host_cost_is_recovered_from_noisy_runs(tmp_path):
    """Runs of different depths (launches) and batches (samples), host-bound at a known h per launch and s
    per sample plus 2% noise on the measured step: the fit on their traces and steps recovers both,
    and the calibration prices each step with them."""

    rng = np.random.default_rng(11)
    shapes = [(8, 256, 2), (32, 256, 2), (64, 256, 6), (16, 256, 6), (48, 256, 4), (96, 256, 3)]
    plans = [_plan(b, L, n) for b, L, n in shapes]
    dev_n = [_device_and_launches(p) for p in plans]
    # h and s such that both terms matter: s·B of the order of h·N on the mid-sized runs
    n_mid = float(np.median([n for _, n in dev_n]))
    h_true = 1.2 * max(d / n for d, n in dev_n)
    s_true = h_true * n_mid / 48.0
    dirs = []
    for i, (plan, (d0, n)) in enumerate(zip(plans, dev_n)):
        b = plan.workload.batch.local_batch_size
        step = max(d0, h_true * n + s_true * b) * (1 + 0.02 * rng.standard_normal())
        assert h_true * n + s_true * b > d0  # host-bound: the step carries both host terms
        d = _synth_run(tmp_path, f"r{i}", plan, rng, noise=0.02)
        _write_step(d, step)
        dirs.append(d)
    cal, res, runs = calibrate(dirs, host=True)
    assert cal.host_sample_s == pytest.approx(s_true, rel=0.15)
    assert cal.host_launch_s == pytest.approx(h_true, rel=0.15)
    assert "per local sample" in cal.notes
    for r in runs:
        assert predict_step_time(r.plan, cal, seq_chunk=r.seq_chunk) == pytest.approx(r.result.step_time.p50_s, rel=0.06)
    # without the per-sample term the same runs fit worse
    h_only = fit_host_launch_cost(runs, res)
    both = fit_host_launch_cost(runs, res, per_sample=True)
    assert both.max_abs_error < 0.06 < h_only.max_abs_error
    # the CLI writes and reads back the same figures
    from coplan.cli import main

    out = tmp_path / "cal.json"
    assert main(["calibrate", *map(str, dirs), "-o", str(out), "--host-cost", "--json"]) == 0
    back = load_calibration(out)
    assert back.host_sample_s == pytest.approx(cal.host_sample_s, rel=1e-6)
    assert back.lookup_id_latency_s == pytest.approx(cal.lookup_id_latency_s, rel=1e-6)
    assert resolve_efficiencies(plans[0].topology, back).host_sample_s == pytest.approx(back.host_sample_s)


def test_one_batch_leaves_the_per_sample_cost_at_zero(tmp_path):
    """With every run at one local batch, s cannot be told from h: it stays 0."""

    rng = np.random.default_rng(5)
    plans = [_plan(32, 256, n) for n in (2, 4, 6)]
    dirs = []
    for i, p in enumerate(plans):
        d0, n = _device_and_launches(p)
        step = max(d0, 2e-4 * n + 1e-3)
        d = _synth_run(tmp_path, f"r{i}", p, rng, noise=0.0)
        _write_step(d, step)
        dirs.append(d)
    cal, _, _ = calibrate(dirs, host=True)
    assert cal.host_sample_s is None and cal.host_launch_s > 0


def _lookup(plan: Plan, chunk: int, cal: Calibration | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(forward seconds per table as priced, the bytes' time alone, the latency floor), sequence tables only."""
    ctx = build_context(plan.workload, plan.topology, plan.mesh, cal, options=Options(seq_chunk=chunk), force_calibration=True)
    priced = table_option_costs(ctx, "table_wise").fwd_s
    floor = seq_lookup_floor_s(ctx, ctx.local_batch)
    no_floor = (cal or Calibration(device="NVIDIA H200")).model_copy(update={"lookup_id_latency_s": 0.0})
    ctx0 = build_context(plan.workload, plan.topology, plan.mesh, no_floor, options=Options(seq_chunk=chunk), force_calibration=True)
    bytes_s = table_option_costs(ctx0, "table_wise").fwd_s
    seq = ctx.tables.is_seq
    return priced[seq], bytes_s[seq], floor[seq]


# the round-2 H200 fit (CPU re-analysis of its six fit runs, 2026-11-29): TBE at 7.5% of HBM bandwidth,
# 449 ns per serial id
H200_ROUND2 = Calibration(device="NVIDIA H200", op_classes={"embedding": OpClassCalibration(memory_efficiency=0.0746)},
                          lookup_id_latency_s=449e-9)


@pytest.mark.parametrize("cal", [None, H200_ROUND2], ids=["default", "h200-round2"])
def test_sequence_lookup_latency_bound_whole_histories_bandwidth_bound_in_chunks(cal):
    """Histories of 1,000 ids at 64 samples (gem-h200's 8 sequence tables: dims 256 x2, 128 x5, 64 x1).
    As whole-sample bags (64-320 warps, one wave as long as a 1,000-id walk) the lookup is latency-bound:
    every table at the default TBE bandwidth (floor > 4x its bytes' time); at the H200's fitted one (TBE at
    7.5% of HBM bandwidth) the 256- and 64-dim kernels, the whole lookup 1.5x its bytes' time. In bags of
    32 ids the floor is a few waves of 32 ids: bandwidth-bound at the fitted bandwidth; at the default one
    every table of 128 or more dims is, while the lone 64-dim table (128-byte rows, one wave of 32 ids:
    14 us) stays latency-bound, its bytes taking 5 us."""
    plan = _plan(64, 0.0, fixed=1000)
    t_id = cal.lookup_id_latency_s if cal else DEFAULT_LOOKUP_ID_LATENCY_S
    priced, bytes_s, floor = _lookup(plan, 0, cal)
    ta = build_context(plan.workload, plan.topology, plan.mesh).tables
    dims = ta.dim[ta.is_seq]
    assert np.allclose(priced, np.maximum(floor, bytes_s))
    # one wave per dim group: the group's floor is 1,000 serial ids (tables of one dim share it by bytes)
    for d in set(dims.tolist()):
        assert floor[dims == d].sum() == pytest.approx(1000 * t_id, rel=1e-9)
    if cal is None:
        assert np.all(floor > 4 * bytes_s)
    else:
        lat = (dims == 256) | (dims == 64)
        assert np.all(floor[lat] > bytes_s[lat]) and priced.sum() > 1.5 * bytes_s.sum()
    priced32, bytes32, floor32 = _lookup(plan, 32, cal)
    assert np.allclose(bytes32, bytes_s)  # the bag layout moves no bytes
    # ceil(64 samples x tables x 32 bags (1000/32 rounded up) / 8,448 resident warps) waves of 32 ids
    for d in set(dims.tolist()):
        n_tab = int((dims == d).sum())
        waves = -(-64 * n_tab * 32 // (132 * 64))
        assert floor32[dims == d].sum() == pytest.approx(waves * 32 * t_id, rel=1e-9)
    wide = dims >= 128
    assert np.all(floor32[wide] < bytes32[wide]) and np.allclose(priced32[wide], bytes32[wide])
    if cal is None:
        assert floor32[dims == 64][0] > bytes32[dims == 64][0]
        assert priced32.sum() < 1.1 * bytes32.sum()
    else:
        assert np.allclose(priced32, bytes32)
    assert priced32.sum() < priced.sum() / 1.5


def test_chunked_bags_price_below_whole_histories_in_the_step():
    """The pricer's step for gem-h200 is lower with the trainer's 32-id bags than with whole histories,
    by about the sequence lookups' latency floor."""
    w = load_workload("gem-h200")
    plan = _plan(64, w.sequences[0].length.mean)
    s0 = predict_step_time(plan, H200_ROUND2, seq_chunk=0)
    s32 = predict_step_time(plan, H200_ROUND2, seq_chunk=32)
    whole, _, _ = _lookup(plan, 0, H200_ROUND2)
    chunked, _, _ = _lookup(plan, 32, H200_ROUND2)
    assert s32 < s0
    assert s0 - s32 == pytest.approx(whole.sum() - chunked.sum(), rel=0.05)


def test_run_seq_chunk_reads_the_recorded_options_else_zero(tmp_path):
    from coplan.spec import RunOptions, RunResult

    def summary(d, **kw):
        d.mkdir()
        dump_spec(RunResult(run_id=d.name, world_size=1, steps=4, warmup_steps=1, **kw), d / "summary.json")
        return d

    assert run_seq_chunk(summary(tmp_path / "a", options=RunOptions(seq_chunk=32, compile="layers"))) == 32
    # a summary from before the options were recorded: the cost model's reading, whole histories
    b = summary(tmp_path / "b", notes="x; sequence lookup bags: seq_chunk=16 (bags of at most 16 ids)")
    assert run_seq_chunk(b) == 0
    c = tmp_path / "c"
    c.mkdir()
    assert run_seq_chunk(c) == 0  # no summary at all
    (c / "summary.json").write_text("{not json")
    with pytest.raises(CoplanError, match="summary.json"):
        run_seq_chunk(c)


def test_calibration_files_without_the_new_fields_still_load(tmp_path):
    old = {"schema_version": 1, "device": "NVIDIA H200", "op_classes": {"gemm": {"memory_efficiency": 0.8}},
           "host_launch_s": 2.16e-4, "notes": "written before host_sample_s and lookup_id_latency_s"}
    p = tmp_path / "old.json"
    p.write_text(json.dumps(old))
    cal = load_calibration(p)
    assert cal.host_sample_s is None and cal.lookup_id_latency_s is None
    eff = resolve_efficiencies(load_topology("h200-1gpu"), cal)
    assert eff.host_sample_s == 0.0 and eff.lookup_id_s == DEFAULT_LOOKUP_ID_LATENCY_S and eff.host_launch_s == 2.16e-4
    with pytest.raises(Exception, match="host_sample_s"):
        Calibration.model_validate({**old, "host_sample_s": -1.0})


def test_measured_host_time_identifies_the_host_cost_of_device_bound_runs():
    """Device-bound runs hide their host time in the step: from steps alone the host cost is not told (kept
    at the smallest that fits, none). With each run's own measured host time (summary.json's host_step) the
    fit recovers the host's cost per launch and per sample, and keeps the device factor of the steps."""
    from coplan.calibration.host_fit import fit_step_terms

    launches = np.array([30.0, 60.0, 90.0, 45.0])
    batch = np.array([64.0, 128.0, 256.0, 96.0])
    h_true, s_true, f_true = 40e-6, 5e-6, 1.2
    device = np.array([0.010, 0.030, 0.020, 0.025])
    host = launches * h_true + batch * s_true  # 1.5-4.9 ms: every run device-bound
    measured = f_true * device
    assert np.all(host < measured)
    h0, s0, f0 = fit_step_terms(measured, device, launches, batch, per_sample=True)
    assert h0 == 0.0 and s0 == 0.0 and f0 == pytest.approx(f_true, rel=1e-3)
    h, s, f = fit_step_terms(measured, device, launches, batch, per_sample=True, host_measured=list(host))
    assert h == pytest.approx(h_true, rel=0.02) and s == pytest.approx(s_true, rel=0.05)
    assert f == pytest.approx(f_true, rel=1e-3)
    # a run without a measured host time (None) leaves the others to tell it
    h2, s2, _ = fit_step_terms(measured, device, launches, batch, per_sample=True, host_measured=[None, *host[1:]])
    assert h2 == pytest.approx(h_true, rel=0.05) and s2 == pytest.approx(s_true, rel=0.1)


def test_run_host_time_trusts_graphed_runs_and_unblocked_eager_ones():
    from types import SimpleNamespace as NS

    from coplan.calibration.host_fit import HOST_BOUND_BUSY, HOST_UNBLOCKED, run_host_time

    def run(host, step, graphed, busy=None):  # busy: the profiled step's device busy time (None: a CPU trace)
        return NS(result=NS(host_step=NS(p50_s=host), step_time=NS(p50_s=step), options=NS(cuda_graphs=graphed)),
                  window_s=0.0 if busy is None else step, idle_s=0.0 if busy is None else step - busy)

    assert run_host_time(run(0.009, 0.010, True)) == 0.009  # graphed: never blocked on the launch queue
    assert run_host_time(run(0.0095, 0.010, False)) is None  # eager, near the step: may have waited on the device
    assert run_host_time(run(HOST_UNBLOCKED * 0.01 * 0.99, 0.010, False)) == pytest.approx(HOST_UNBLOCKED * 0.01 * 0.99)
    # device-bound (busy >= HOST_BOUND_BUSY of the step): its host phases absorbed waits at syncs, graphed or not
    assert run_host_time(run(0.009, 0.010, True, busy=0.0095)) is None
    assert run_host_time(run(0.005, 0.010, False, busy=HOST_BOUND_BUSY * 0.010)) is None
    # the device idled a third of the step: the host drove it, its time is the host's own
    assert run_host_time(run(0.009, 0.010, True, busy=0.0066)) == 0.009
    assert run_host_time(NS(result=NS(host_step=None, step_time=NS(p50_s=0.01), options=None))) is None


def test_a_host_fitted_from_step_times_alone_is_capped_by_the_host_times_recorded():
    """Where no run measured the host's own time, the fitted host terms may not price any run's host above
    the host time it recorded (an upper bound: the host's work plus its waits on the device); both terms
    shrink together, and a fit already within every bound, or a run without a record, changes nothing."""
    from types import SimpleNamespace as NS

    from coplan.calibration.host_fit import cap_by_host_bounds, run_host_bound

    h, s = 1e-3, 1e-5  # 1 ms a launch, 10 us a sample
    launches, batch = [10.0, 20.0, 4.0], [100.0, 50.0, 10.0]  # host under the fit: 11, 20.5, 4.1 ms
    hc, sc = cap_by_host_bounds(h, s, launches, batch, None, [0.0110, 0.0082, None])
    assert hc / h == pytest.approx(sc / s) == pytest.approx(0.0082 / 0.0205)  # the tightest run sets the scale
    assert launches[1] * hc + batch[1] * sc == pytest.approx(0.0082)
    assert cap_by_host_bounds(h, s, launches, batch, None, [0.02, 0.03, 0.01]) == (h, s)
    assert cap_by_host_bounds(h, s, launches, batch, None, [None, None, None]) == (h, s)
    # a slow host (speed index 2) reaches its bound at half the terms
    hc2, _ = cap_by_host_bounds(h, 0.0, [10.0], [1.0], [2.0], [0.010])
    assert hc2 == pytest.approx(0.5e-3)
    assert run_host_bound(NS(result=NS(host_step=NS(p50_s=0.012)))) == 0.012
    assert run_host_bound(NS(result=NS(host_step=None))) is None
