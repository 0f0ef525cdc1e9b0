"""Calibration: fit the cost model's efficiencies to what runs measured (``coplan calibrate``).

For each run (``runs/<id>/``: the plan it ran, ``metrics.jsonl``, ``summary.json``, Kineto traces),
the traces are attributed to the cost model's ops (:mod:`coplan.costmodel.traces`) and each measured
(op, phase) becomes one sample. The cost model's own roofline gives each sample's prediction as a
function of the parameters of its op class ``c``:

    t̂ = max(F / (peak · e_c), (B + B_fixed) / (hbm_bw · m_c)) + launches · λ_c

(an unfused op, the padded reference attention, adds ``S / (hbm_bw · m_u)`` for the bytes ``S`` of its
separate elementwise kernels, which run after its matmuls; its matmuls' bytes use the same ``m_u``, the
memory efficiency of :data:`coplan.costmodel.efficiency.UNFUSED_CLASS`: each kernel costs its own
roofline and the op costs their sum)

``F``, ``B``, ``launches`` come from the same context the planner prices with (built once with unit
efficiencies, so ``F/peak`` and ``B/hbm_bw`` are read off directly) and the *measured* length moments
of the profiled steps. ``e_c`` (compute efficiency, for the dtype the ops ran in), ``m_c`` (fraction of
HBM bandwidth) and ``λ_c`` (seconds per launch) are fitted by ``scipy.optimize.least_squares`` on
log-ratio residuals (every op counts by its relative error, whatever its size), with a weak prior
pulling parameters that the data cannot identify (a class whose ops are all memory-bound says
nothing of its compute efficiency) towards the defaults. The fit error is reported, not hidden.

Host-bound steps. A step of the trainer on one H200 is about half GPU idle time: the host issues
launches slower than the GPU runs them. The fit above is of *device* time (kernels), which is what
the op classes' efficiencies mean. The step time then gets one more fitted figure, ``h``, a host cost
per kernel launch the cost model prices: with ``N`` its launches per step
(:func:`coplan.costmodel.pricer.priced_launches`, the exact slope of the pricer's step in the launch
cost) and ``P`` its step time under the device fit, ``step ≈ max(P, N · h)``: the host issues a step's
launches while the GPU runs earlier ones, so the two overlap and the longer one sets the step (a sum
would count the overlapped part twice: it overstated device-bound variants by up to 54% on the H200).
``h`` is fitted to the runs' measured step times (CUDA events, steps outside the profiled window) by
least squares on log ratios. With ``calibrate(..., host=True)`` (``coplan calibrate --host-cost``) it is
written as the Calibration's ``host_launch_s`` (launch overheads stay the device fit's), and
``coplan plan`` prices each step at the longer of its device time and its priced launches × ``h``.
Why the max and not a sum of per-phase maxima (forward, backward, optimizer): the trainer never
waits for the device inside or between steps (no device-to-host copy or synchronisation in its
profiled steps), so the host's lead carries across phase and step boundaries; in the H200 traces the
launch-to-start lag reaches 14-21 ms at the end of ``base``'s backward and is drained in the next
forward, and ``rc-nomoe``/``L6`` start their steps with a 13-21 ms backlog. The per-phase sum would hold
only with a sync at each phase boundary; :func:`fit_host_phase_form` computes it as a reading.
Limits: ``N`` counts the launches the cost model prices (about a fifth of those that run), so ``h`` is
per *priced* launch; a host sync (the MoE routing counts read back, the reference attention's longest
length) serialises host and device around it, which the max form does not capture; both are stated
in the calibration's notes and measured by the held-out benchmark (``benchmarks/calibration_h200.py``).
The trace's GPU idle time per op
(``coplan.costmodel.traces``) is reported beside it (``host_gaps=True`` in :func:`run_samples` fits
kernel-plus-idle time per op instead).
The fit also matches each run's per-class *sums* (the figure the step time is made of), beside each
sample's log-ratio.

Per-sample host work. The host's time may also hold work that grows with the local batch ``B`` (the
data thread's batch read, balancing, KJT building and pinning run concurrently with the launching
threads and compete with them for the GIL): host = ``N · h + B · s``. ``s`` (``host_sample_s``) is
fitted with ``h`` on the same runs (``fit_host_launch_cost(..., per_sample=True)``, what
``calibrate(..., host=True)`` writes); it needs runs at two or more batch sizes and comes out 0 when
the data say the batch adds nothing beyond the launches. On the H200 round-2 fit runs it is 0: among
the Triton fit runs, ``d512-L6`` (64 samples, 336 priced launches) measured a shorter step than
``b32-h512`` (32 samples, 268), and the profiled host threads' busy time across all Triton runs is
explained by launches alone as well as by launches and samples (12.3% vs 12.4% rms); the step-to-step
spread of one run's host-bound steps is about ±20%.

The host's speed. A host-bound step lasts as long as the host takes to issue it, and the same host work
takes longer on a slowed host (a CPU shared with another job, a lower clock). The traces measure it:
the median host duration of calls every step makes many times whatever its shapes (``aten::mm``,
``aten::add_``, ``cudaLaunchKernel``...: :data:`coplan.costmodel.traces.HOST_SPEED_OPS`) varied by 1.9x
between the H200 round-4 runs (one GPU, another job on the host's other GPU for part of the time).
The big-batch fit runs happened to meet the slow host, and the per-sample term fitted to it (371 µs
per sample) was that: with each run's host time scaled by its host's speed
(``fit_host_launch_cost(..., host_speed=True)``, ``coplan calibrate --host-speed``) the same runs fit
h = 221 µs per priced launch and s = 0, as round 2's runs did blind to it (216 µs, s = 0). In those
traces the host's step is its forward (main thread) then its backward (autograd thread) then the
optimizer, one after the other; the launches actually issued are 3.7-4.2 per priced launch on the
Triton runs (7.2 on the padded reference: 88 + 84 kernels per layer's forward calls; now priced,
see :data:`HOST_SYNCING_BACKENDS`), and a fixed per-step term (FSDP2's hooks, ~11-19 ms of the
profiled step, grow with the launches' layers) fits to about 1 ms: not worth a parameter. The fitted
runs' host speed is recorded (``host_op_median_us``); a plan is priced for a host that fast.

The sequence lookup. FBGEMM's no-bag forward gives one warp per bag and walks a bag's ids one after
another, so with whole histories as bags (a few hundred warps) it is latency-bound: each sequence-lookup
kernel costs max(bytes / (HBM bandwidth · m_embedding), waves × ids in the longest bag × ``t_id``)
(:func:`coplan.costmodel.decomposed.seq_lookup_floor_s`, the bag layout from the run's ``seq_chunk``:
:func:`run_seq_chunk`). ``t_id`` (``lookup_id_latency_s``) is fitted with the efficiencies on the
embedding forward samples (:attr:`Sample.lookup_groups`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from coplan import __version__
from coplan.costmodel.compute import op_arrays
from coplan.costmodel.context import build_context
from coplan.costmodel.efficiency import UNFUSED_CLASS, resolve_efficiencies
from coplan.costmodel.traces import (HostProfile, TraceAttribution, TraceError, attribute, host_profile, host_speed_index,
                                     load_trace)
from coplan.errors import CoplanError
from coplan.spec import Calibration, FitError, OpClassCalibration, Plan, RunResult, load_plan, load_run_result
from coplan.spec.calibration import ComputeOpClass

CLASSES: tuple[str, ...] = ("gemm", "attention", "embedding", "elementwise")
PRIOR_WEIGHT = 0.05
SAMPLE_F_SCALE = 0.1
"""Soft-L1 scale of the per-sample log-ratio residuals (beyond ~10% an op counts linearly, not squared)."""
CLASS_SUM_WEIGHT = 2.0
"""Weight of each (run, op class) summed-time residual against 1 per sample: per-op ratios alone let
a few large, well-fitted ops and many tiny badly-fitted ones balance to a biased class total."""
"""Weight of the pull towards defaults, against 1 per sample: small enough that any parameter the
samples constrain is set by them."""


class CalibrationError(CoplanError):
    """A run directory cannot be calibrated from (missing files, no attributable ops)."""


@dataclass(frozen=True, slots=True)
class Sample:
    """One measured (op, phase) of one run, per micro-batch, with its unit-efficiency roofline terms."""

    run: str
    name: str
    phase: str
    op_class: str
    dtype: str
    measured_s: float
    flop_s: float
    """F / peak: seconds at compute efficiency 1."""
    mem_s: float
    """(B + B_fixed) / datasheet HBM bandwidth: seconds at memory efficiency 1."""
    launches: float
    serial_mem_s: float = 0.0
    """Bytes of the op's separate elementwise kernels / HBM bandwidth (an unfused op: the padded
    reference), priced at :data:`coplan.costmodel.efficiency.UNFUSED_CLASS`'s memory efficiency and
    added to the roofline."""
    mem_class: str = ""
    """Class whose memory efficiency prices ``mem_s`` ("": the op's own; an unfused op's matmuls:
    :data:`coplan.costmodel.efficiency.UNFUSED_CLASS`)."""
    lookup_groups: tuple[tuple[float, float], ...] = ()
    """The sequence lookups' kernels within this sample (the embedding forward), one per group of
    tables: (bytes / HBM bandwidth, serial ids: waves × ids in the longest bag × micro-batches). Each
    costs max(bytes time / m_embedding, serial ids × lookup_id_s) and adds to the rest (``mem_s``);
    see :func:`coplan.costmodel.decomposed.seq_lookup_floor_s`."""
    extra_kernels: float = 0.0
    """Kernels of an unfused op beyond ``launches`` (per micro-batch), each costing the ``unfused`` launch
    overhead (a calibration's ``unfused_kernel_s``)."""


@dataclass(frozen=True, slots=True)
class RunSamples:
    """What one run contributes: its samples and what could not be attributed."""

    run: str
    device: str
    plan: Plan
    result: RunResult | None
    samples: tuple[Sample, ...]
    attributed_share: float
    unattributed_s: float
    total_s: float
    moments: dict[str, tuple[float, float]] = field(default_factory=dict)
    idle_s: float = 0.0
    """GPU idle time of the profiled steps, per step (0 on CPU traces)."""
    window_s: float = 0.0
    """Device-side length of a profiled step (0 on CPU traces)."""
    step_moments: dict[str, tuple[float, float]] = field(default_factory=dict)
    """Length moments of the steps the run's step-time statistics cover (after warm-up, outside the
    profiled window): what its measured step time is compared with."""
    step_moments_each: tuple[dict[str, tuple[float, float]], ...] = ()
    """The same, one entry per step: a run's p50 step is compared with the median over its steps of
    the step priced at each one's lengths (:func:`predict_median_step`)."""
    step_times_each: tuple[float, ...] = ()
    """Those steps' measured times (``step_time_s`` of metrics.jsonl), one per ``step_moments_each`` entry
    (empty when a step lacks one)."""
    unpriced_s: dict[str, float] = field(default_factory=dict)
    """Per step: measured time (with the idle it ended) the cost model has no op for, by name and phase
    (FSDP hooks, TorchRec distribution, 'unattributed')."""
    seq_chunk: int = 0
    """Ids per bag of the run's sequence lookups (:func:`run_seq_chunk`; 0: whole histories)."""
    host: HostProfile | None = None
    """The host side of the profiled steps (:func:`coplan.costmodel.traces.host_profile`); None when the
    trace has no profiled trainer step."""


def _unit_calibration(device: str) -> Calibration:
    """Efficiencies of 1 and no launch cost: the context then yields the raw roofline terms."""
    ones = {dt: 1.0 for dt in ("bf16", "fp16", "fp8", "tf32", "fp32")}
    return Calibration(
        device=device,
        op_classes={c: OpClassCalibration(compute_efficiency=ones, memory_efficiency=1.0, launch_overhead_s=0.0) for c in CLASSES},
        lookup_id_latency_s=0.0, unfused_memory_efficiency=1.0, unfused_kernel_s=0.0,
    )


def run_seq_chunk(run_dir: str | Path) -> int:
    """Ids per bag the run's sequence lookups used: ``seq_chunk`` of its ``config.json`` (the trainer's
    launch switches), else a ``seq_chunk=N`` in its summary's notes, else 0 (runs from before the switch:
    one bag per sample's whole history)."""
    import re

    d = Path(run_dir)
    cfg = d / "config.json"
    if cfg.is_file():
        try:
            v = json.loads(cfg.read_text()).get("seq_chunk")
            if v is not None:
                return int(v)
        except (ValueError, TypeError, AttributeError) as e:
            raise CalibrationError(f"{cfg}: unreadable ({e}); the run's launch switches are corrupt") from None
    summ = d / "summary.json"
    if summ.is_file():
        try:
            m = re.search(r"seq_chunk=(\d+)", json.loads(summ.read_text()).get("notes", "") or "")
        except (ValueError, AttributeError):
            m = None
        if m:
            return int(m.group(1))
    return 0


def _read_metrics(run_dir: Path) -> list[dict]:
    p = run_dir / "metrics.jsonl"
    if not p.is_file():
        return []
    rows = []
    for line in p.read_text().splitlines():
        line = line.strip()
        if line:
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise CalibrationError(f"{p}: a line is not JSON ({e.msg}); the run's metrics are corrupt") from None
    return rows


def measured_moments(metrics: Sequence[dict], steps: Iterable[int] | None = None) -> dict[str, tuple[float, float]]:
    """Mean (E[L], E[L²]) per sequence over the given steps, from ``seq_stats`` lines of metrics.jsonl
    (``{"<sequence>": [n, ΣL, ΣL²]}`` per rank-local batch); empty when the run did not log them."""
    want = set(steps) if steps is not None else None
    acc: dict[str, list[float]] = {}
    longest: dict[str, list[float]] = {}
    for row in metrics:
        if want is not None and row.get("step") not in want:
            continue
        for seq, v in (row.get("seq_stats") or {}).items():
            a = acc.setdefault(seq, [0.0, 0.0, 0.0])
            a[0] += v[0]
            a[1] += v[1]
            a[2] += v[2]
        for seq, maxima in (row.get("seq_max") or {}).items():
            longest.setdefault(seq, []).extend(float(x) for x in maxima)
    out = {s: (a[1] / a[0], a[2] / a[0]) for s, a in acc.items() if a[0] > 0}
    for seq, xs in longest.items():
        if xs:
            x = np.asarray(xs)
            out[seq + PADDED_SUFFIX] = (float(x.mean()), float((x * x).mean()))
    return out


PADDED_SUFFIX = "@max"
"""Key suffix, in a moments dict, of (E[M], E[M²]) of M, each micro-batch's longest length: what the
padded reference attention pads to. From ``seq_max`` lines of metrics.jsonl (``{"<sequence>": [longest per
micro-batch]}``) or given to :func:`run_samples`; the pricer uses the length pmf's expectation without it.
A small data set repeats a few batches, whose longest lengths can sit far from that expectation (on
the H200's reference runs the profiled batches' E[M²] was up to ~1.9x it), and the padded reference's
quadratic terms scale with E[M²]: comparing such a run with the expectation misprices it by construction."""


def apply_moments(ctx, moments: dict[str, tuple[float, float]] | None) -> None:
    """Price ``ctx`` at measured moments: (E[L], E[L²]) per sequence, and per ``<seq>@max`` the padded
    reference's (E[M], E[M²]) (see :data:`PADDED_SUFFIX`)."""
    for seq, m in (moments or {}).items():
        if seq.endswith(PADDED_SUFFIX):
            ctx.padded_moments[seq[: -len(PADDED_SUFFIX)]] = (float(m[0]), float(m[1]))
        elif seq in ctx.moments:
            ctx.moments[seq] = m
    ctx.cache.clear()


def run_samples(run_dir: str | Path, *, rank: int = 0, force: bool = False, host_gaps: bool = False,
                longest: dict[int, dict[str, list[int]]] | None = None) -> RunSamples:
    """Attribute one run's trace (of ``rank``) and pair each measured op with its roofline terms.

    ``host_gaps``: count the GPU idle time each op ended as part of its time (see the module docstring).
    ``longest``: per step, per sequence, the longest length of each of ``rank``'s micro-batches, when
    metrics.jsonl does not log them (``seq_max``) but the caller knows the batches (see :data:`PADDED_SUFFIX`).
    """
    d = Path(run_dir)
    if not d.is_dir():
        raise CalibrationError(f"{d}: not a run directory (expected runs/<id>/ with plan.json, metrics.jsonl, traces/)")
    plan_path = d / "plan.json"
    if not plan_path.is_file():
        raise CalibrationError(f"{d}: has no plan.json; was it written by `coplan train`?")
    plan = load_plan(plan_path)
    result = load_run_result(d / "summary.json") if (d / "summary.json").is_file() else None
    traces = sorted((d / "traces").glob(f"rank{rank}*.json*")) if (d / "traces").is_dir() else []
    if not traces:
        raise CalibrationError(f"{d}: no trace for rank {rank} under traces/ (run with profiling on)")
    trace = load_trace(traces[0])
    att: TraceAttribution = attribute(trace, str(traces[0]))
    try:
        hp: HostProfile | None = host_profile(trace, str(traces[0]))
    except TraceError:
        hp = None
    del trace
    device = (result.device if result and result.device else plan.topology.gpu.name)
    metrics = _read_metrics(d)
    if longest:
        metrics = [({**m, "seq_max": longest[m["step"]]} if m.get("step") in longest and "seq_max" not in m else m)
                   for m in metrics]
    seq_chunk = run_seq_chunk(d)
    profiled = _profiled_steps(d, metrics)
    moments = measured_moments(metrics, profiled)
    warm = result.warmup_steps if result else 0
    timed = [int(m["step"]) for m in metrics if "step" in m and m["step"] >= warm and m["step"] not in set(profiled or ())]
    step_moments = measured_moments(metrics, timed) if timed else {}
    pairs = [(measured_moments(metrics, [t]), m.get("step_time_s")) for t in timed
             for m in metrics if m.get("step") == t] if timed else []
    each = tuple(mo for mo, _ in pairs if mo)
    times = tuple(float(x) for mo, x in pairs if mo and x)
    times = times if len(times) == len(each) else ()

    per_step = att.per_step(with_idle=host_gaps)
    out: list[Sample] = []
    priced: set[tuple[str, str]] = set()
    for t in unit_terms(plan, moments, rank=rank, seq_chunk=seq_chunk):
        members = t.members or (t.name,)
        priced.update((n, t.phase) for n in members)
        meas = sum(per_step.get((n, t.phase), 0.0) for n in members) / t.micro_batches
        if meas > 0:
            out.append(Sample(d.name, t.name, t.phase, t.op_class, t.dtype, meas, t.flop_s, t.mem_s, t.launches,
                              t.serial_mem_s, t.mem_class, t.lookup_groups, t.extra_kernels))
    unpriced = {f"{n}:{ph}": v for (n, ph), v in sorted(per_step.items()) if (n, ph) not in priced and v > 0}
    steps = max(1, att.steps)
    unpriced["unattributed"] = (att.unattributed_s + (att.unattributed_idle_s if host_gaps else 0.0)) / steps
    if not out:
        raise CalibrationError(
            f"{traces[0]}: no op of the cost model could be attributed ({att.unattributed_s * 1e3:.1f} ms unattributed); "
            "the trainer names its record_function ranges '<block>.<layer>.<op>'"
        )
    return RunSamples(d.name, device, plan, result, tuple(out), att.attributed_share, att.unattributed_s, att.total_s, moments,
                      idle_s=att.idle_s / steps, window_s=att.window_s / steps, step_moments=step_moments, unpriced_s=unpriced, step_moments_each=each,
                      step_times_each=times,
                      seq_chunk=seq_chunk, host=hp)


@dataclass(frozen=True, slots=True)
class UnitTerm:
    """The roofline terms of one (op, phase) at unit efficiencies, per micro-batch of one rank."""

    name: str
    phase: str
    op_class: str
    dtype: str
    flop_s: float
    mem_s: float
    launches: float
    micro_batches: int
    members: tuple[str, ...] = ()
    """For the merged embedding sample ('sparse'): the op names whose measured time it sums."""
    serial_mem_s: float = 0.0
    """See :attr:`Sample.serial_mem_s`."""
    mem_class: str = ""
    """See :attr:`Sample.mem_class`."""
    extra_kernels: float = 0.0
    """See :attr:`Sample.extra_kernels`."""
    lookup_groups: tuple[tuple[float, float], ...] = ()
    """See :attr:`Sample.lookup_groups`."""


def _options(seq_chunk: int | None):
    from coplan.costmodel.context import Options

    return Options() if seq_chunk is None else Options(seq_chunk=int(seq_chunk))


def unit_terms(plan: Plan, moments: dict[str, tuple[float, float]] | None = None, *, rank: int = 0,
               seq_chunk: int | None = None) -> list[UnitTerm]:
    """Per (op, phase) of ``plan`` on ``rank``: F/peak, B/hbm_bw and kernel launches, from the same
    context the planner prices with (unit efficiencies) and, when given, measured length moments.

    Embedding lookups are one sample per phase (``sparse``), priced by the pricer's per-rank lookup
    time at full HBM bandwidth: the trace cannot split one fused TBE kernel among tables.
    """
    from coplan.costmodel.pricer import assignment_of, default_assignment, embedding_loads

    ctx = build_context(plan.workload, plan.topology, plan.mesh, _unit_calibration(plan.topology.gpu.name),
                        options=_options(seq_chunk), force_calibration=True)
    apply_moments(ctx, moments)
    fp8 = frozenset(lp.name for lp in plan.layers if lp.precision == "fp8")
    arr = op_arrays(ctx, plan.kernels, fp8)
    mb = ctx.micro_batches
    out: list[UnitTerm] = []
    for k, i in enumerate(ctx.dense_idx):
        o = ctx.ops[int(i)]
        dt = "fp8" if (o.layer in fp8 and o.op_class == "gemm") else o.dtype
        if plan.kernels.attention == "reference" and o.op_class == "attention" and o.sequence:
            # priced as the padded reference runs (context.op_arrays): fitted under its own key
            dt = REFERENCE_ATTENTION_DTYPE
        unfused = bool(arr.fwd_serial_s[k] > 0 or arr.bwd_serial_s[k] > 0)
        mc = UNFUSED_CLASS if unfused else ""
        out.append(UnitTerm(o.name, "fwd", o.op_class, dt, float(arr.fwd_flop_s[k]),
                            float(arr.fwd_mem_s[k] + arr.fwd_fixed_mem_s[k]), float(arr.fwd_launches[k]), mb,
                            serial_mem_s=float(arr.fwd_serial_s[k]), mem_class=mc, extra_kernels=float(arr.fwd_extra_kernels[k])))
        out.append(UnitTerm(o.name, "bwd", o.op_class, dt, float(arr.bwd_flop_s[k]),
                            float(arr.bwd_mem_s[k] + arr.bwd_fixed_mem_s[k]), float(arr.bwd_launches[k]), mb,
                            serial_mem_s=float(arr.bwd_serial_s[k]), mem_class=mc, extra_kernels=float(arr.bwd_extra_kernels[k])))
    sparse = tuple(o.name for o in ctx.ops if o.layer == "sparse")
    if ctx.tables.num and sparse:
        a = assignment_of(ctx, plan.tables) if plan.tables else default_assignment(ctx)
        loads = embedding_loads(ctx, a)
        r = rank % ctx.mesh.sparse_shard
        groups = _lookup_groups(ctx) if ctx.mesh.sparse_shard == 1 else ()
        for phase, key in (("fwd", "fwd_s"), ("bwd", "bwd_s")):
            g = groups if phase == "fwd" else ()
            rest = max(0.0, float(loads[key][r]) - sum(x[0] for x in g))
            out.append(UnitTerm("sparse", phase, "embedding", "fp32", 0.0, rest, float(len(sparse)), 1, sparse, lookup_groups=g))
    # the dense optimizer, once per step, as the pricer prices it (memory-bound elementwise, with the
    # trainer's gradient norm), and FSDP2's copies per micro-batch (the trace's "fsdp.hooks")
    from coplan.costmodel.decomposed import FSDP_COPY_LAUNCHES, dense_fixed_costs
    from coplan.costmodel.memory import fsdp_copy_bytes

    opt = dense_fixed_costs(ctx).optimizer_step_s  # unit efficiencies: bytes / HBM bandwidth exactly
    if opt > 0:
        out.append(UnitTerm("optimizer.step", "optimizer", "elementwise", "fp32", 0.0, float(opt), OPTIMIZER_LAUNCHES, 1))
    cf, cbk = fsdp_copy_bytes(ctx)
    bw = ctx.topology.gpu.hbm_bw_bytes_per_s
    for phase, nbytes, nl in (("fwd", cf, FSDP_COPY_LAUNCHES[0]), ("bwd", cbk, FSDP_COPY_LAUNCHES[1])):
        if nbytes > 0:
            out.append(UnitTerm("fsdp.hooks", phase, "elementwise", "fp32", 0.0, float(nbytes / bw), nl, mb))
    return out


from coplan.costmodel.flops import REFERENCE_MATMUL_DTYPE as REFERENCE_ATTENTION_DTYPE  # noqa: E402

"""The PyTorch reference attention pads and computes its scores in fp32 with TF32 matmuls
(:func:`coplan.costmodel.flops.padded_reference_attention`): its efficiency is fitted under this key,
apart from the fused kernels' (one class, two very different implementations), and the pricer reads it
under the same key."""

from coplan.costmodel.decomposed import OPTIMIZER_LAUNCHES  # noqa: E402  (the pricer's launches of the optimizer step)


def _lookup_groups(ctx) -> tuple[tuple[float, float], ...]:
    """Per sequence-lookup kernel (tables of one sequence and one dim) on a one-rank sparse group: (its
    forward bytes / HBM bandwidth, its serial ids per step), from a context at unit efficiencies (its
    lookups priced at their bytes alone); the floor at one second per id gives the serial ids."""
    from dataclasses import replace

    from coplan.costmodel.decomposed import seq_lookup_floor_s, table_option_costs

    ta = ctx.tables
    if not ta.num or not ta.is_seq.any():
        return ()
    mem = table_option_costs(ctx, "table_wise").fwd_s
    eff = ctx.eff
    ctx.eff = replace(eff, lookup_id_s=1.0)
    try:
        ids = seq_lookup_floor_s(ctx, ctx.local_batch / ctx.micro_batches)
    finally:
        ctx.eff = eff
    out = []
    for key in sorted({(sq, float(d)) for sq, d, s in zip(ta.sequence, ta.dim, ta.is_seq) if s}):
        idx = np.array([i for i in range(ta.num) if ta.is_seq[i] and ta.sequence[i] == key[0] and float(ta.dim[i]) == key[1]])
        out.append((float(mem[idx].sum()), float(ids[idx].sum())))
    return tuple(out)


def _profiled_steps(run_dir: Path, metrics: Sequence[dict]) -> list[int] | None:
    marker = run_dir / "traces" / "steps.json"
    if marker.is_file():
        try:
            return [int(s) for s in json.loads(marker.read_text())]
        except (ValueError, TypeError):
            return None
    return None


# ---------------------------------------------------------------------------------------------
# The fit
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class FitResult:
    """Fitted parameters, predictions and errors."""

    compute: dict[tuple[str, str], float]
    memory: dict[str, float]
    launch_s: dict[str, float]
    predicted_s: np.ndarray
    measured_s: np.ndarray
    samples: tuple[Sample, ...]
    lookup_id_s: float | None = None
    """Fitted seconds per id of the sequence lookups' serial bag walk (None: not identified, no sample
    has a sequence lookup)."""

    def rel_errors(self) -> np.ndarray:
        return np.abs(self.predicted_s - self.measured_s) / self.measured_s

    def per_class_error(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for c in sorted({s.op_class for s in self.samples}):
            idx = [i for i, s in enumerate(self.samples) if s.op_class == c]
            m = float(self.measured_s[idx].sum())
            out[c] = abs(float(self.predicted_s[idx].sum()) - m) / m if m > 0 else 0.0
        return out


def predict(samples: Sequence[Sample], compute: dict[tuple[str, str], float], memory: dict[str, float], launch_s: dict[str, float],
            lookup_id_s: float | None = None) -> np.ndarray:
    """The roofline of each sample under the given efficiencies (the same form the pricer uses);
    ``lookup_id_s``: the sequence lookups' seconds per serial id (None: the default)."""
    from coplan.costmodel.efficiency import DEFAULT_LOOKUP_ID_LATENCY_S

    t_id = DEFAULT_LOOKUP_ID_LATENCY_S if lookup_id_s is None else lookup_id_s
    out = np.empty(len(samples))
    for i, s in enumerate(samples):
        e = compute.get((s.op_class, s.dtype), 1.0)
        m = memory.get(s.mem_class or s.op_class, 1.0)
        # an unfused op: its separate elementwise kernels run after its matmuls, so their time adds
        serial = s.serial_mem_s / memory.get(UNFUSED_CLASS, 1.0) if s.serial_mem_s > 0 else 0.0
        # the sequence lookups: each kernel the longer of its bytes and its warps' serial bag walk
        look = sum(max(gm / m, gi * t_id) for gm, gi in s.lookup_groups)
        kernels = s.launches * launch_s.get(s.op_class, 0.0) + s.extra_kernels * launch_s.get(UNFUSED_CLASS, 0.0)
        out[i] = max(s.flop_s / e, s.mem_s / m) + look + serial + kernels
    return out


def fit(samples: Sequence[Sample], defaults_compute: dict[tuple[str, str], float], defaults_memory: dict[str, float],
        defaults_launch: dict[str, float], default_lookup_id_s: float | None = None) -> FitResult:
    """Least-squares fit of (e, m, λ) per op class present in ``samples``, and of the sequence lookups'
    seconds per serial id when a sample has a sequence lookup (:attr:`Sample.lookup_groups`)."""
    from coplan.costmodel.efficiency import DEFAULT_LOOKUP_ID_LATENCY_S
    from scipy.optimize import least_squares

    samples = tuple(samples)
    if not samples:
        raise CalibrationError("nothing to fit: no measured op")
    keys_c = sorted({(s.op_class, s.dtype) for s in samples if s.flop_s > 0})
    keys_m = sorted({s.mem_class or s.op_class for s in samples if s.mem_s > 0}
                    | {UNFUSED_CLASS for s in samples if s.serial_mem_s > 0})
    keys_l = sorted({s.op_class for s in samples if s.launches > 0} | {UNFUSED_CLASS for s in samples if s.extra_kernels > 0})
    has_lookup = any(gi > 0 for s in samples for _, gi in s.lookup_groups)
    t0 = default_lookup_id_s if default_lookup_id_s else DEFAULT_LOOKUP_ID_LATENCY_S
    # parameters in log space: efficiencies in (1e-6, 1], launch overhead in (1e-8 s, 0.5 s) (the upper end
    # only matters for CPU traces, where an "op launch" can be a whole interpreted kernel)
    x0 = np.array(
        [math.log(min(1.0, max(1e-6, defaults_compute.get(k, 0.5)))) for k in keys_c]
        + [math.log(min(1.0, max(1e-6, defaults_memory.get(k, 0.8)))) for k in keys_m]
        + [math.log(min(1e-2, max(1e-8, defaults_launch.get(k, 3e-6)))) for k in keys_l]
        + ([math.log(t0)] if has_lookup else [])
    )
    # seconds per serial id: (1e-10 s, 1e-3 s), last in x when present
    lo = np.array([math.log(1e-6)] * (len(keys_c) + len(keys_m)) + [math.log(1e-8)] * len(keys_l) + [math.log(1e-10)] * has_lookup)
    hi = np.array([0.0] * (len(keys_c) + len(keys_m)) + [math.log(0.5)] * len(keys_l) + [math.log(1e-3)] * has_lookup)
    # start inside the box, from the measured data's own scale where the defaults are far off
    x0 = np.clip(x0, lo + 1e-9, hi - 1e-9)
    meas = np.array([s.measured_s for s in samples])
    prior0 = x0.copy()

    def unpack(x):
        nc, nm = len(keys_c), len(keys_m)
        comp = {k: math.exp(v) for k, v in zip(keys_c, x[:nc])}
        mem = {k: math.exp(v) for k, v in zip(keys_m, x[nc : nc + nm])}
        lau = {k: math.exp(v) for k, v in zip(keys_l, x[nc + nm : nc + nm + len(keys_l)])}
        return comp, mem, lau

    def t_id(x) -> float:
        return math.exp(x[-1]) if has_lookup else t0

    groups: dict[tuple[str, str], list[int]] = {}
    for i, s in enumerate(samples):
        groups.setdefault((s.run, s.op_class), []).append(i)
    gidx = [np.array(v) for v in groups.values()]
    gmeas = np.array([meas[g].sum() for g in gidx])

    def residuals(x):
        comp, mem, lau = unpack(x)
        pred = predict(samples, comp, mem, lau, t_id(x))
        gpred = np.array([pred[g].sum() for g in gidx])
        # robust (soft-L1) per sample, plain squares on the class sums: an outlier op must not move a
        # class total, and a class total must not be discounted as an outlier
        r = np.log(pred / meas)
        f = SAMPLE_F_SCALE
        r = np.sign(r) * f * np.sqrt(2.0 * (np.sqrt(1.0 + (r / f) ** 2) - 1.0))
        return np.concatenate([r, CLASS_SUM_WEIGHT * np.log(gpred / gmeas), PRIOR_WEIGHT * (x - prior0)])

    best = None
    # a few starts: the roofline's max() makes the problem non-smooth, so start from the defaults and
    # from "everything compute-bound" / "everything memory-bound" guesses
    starts = [x0, np.clip(x0 - 2.0, lo + 1e-9, hi - 1e-9), np.clip(x0 + 0.5, lo + 1e-9, hi - 1e-9)]
    for start in starts:
        r = least_squares(residuals, start, bounds=(lo, hi), loss="linear", max_nfev=2000)
        if best is None or r.cost < best.cost:
            best = r
    comp, mem, lau = unpack(best.x)
    pred = predict(samples, comp, mem, lau, t_id(best.x))
    return FitResult(comp, mem, lau, pred, meas, samples, t_id(best.x) if has_lookup else None)


def calibrate(run_dirs: Sequence[str | Path], *, rank: int = 0, force: bool = False, host_gaps: bool = False,
              host: bool = False, prepared: Sequence[RunSamples] | None = None,
              host_speed: bool = False) -> tuple[Calibration, FitResult, list[RunSamples]]:
    """Fit a Calibration to the runs; all must come from one device unless ``force``.

    ``host``: also fit the per-launch host cost ``h`` to the runs' measured step times (module
    docstring, max form) when their summaries have them, written as ``host_launch_s``; the
    ``fit_error`` stays that of the device-time fit (per op, without ``h``). ``host_gaps``: per-op
    samples include the GPU idle time they ended. ``prepared``: the runs' :func:`run_samples`, already
    read (same order as ``run_dirs``), to save parsing their traces again. ``host_speed`` (with ``host``):
    fit the host costs to the runs' steps each scaled by its host's speed (``fit_host_launch_cost``);
    either way the fitted runs' host speed is recorded (``host_op_median_us``) when their traces have it.
    """
    if not run_dirs:
        raise CalibrationError("give at least one run directory")
    runs = list(prepared) if prepared is not None else [run_samples(d, rank=rank, force=force, host_gaps=host_gaps) for d in run_dirs]
    devices = sorted({r.device for r in runs})
    if len(devices) > 1 and not force:
        raise CalibrationError(f"the runs come from different devices {devices}; calibrate each device separately (or --force)")
    topo = runs[0].plan.topology
    eff = resolve_efficiencies(topo)
    samples = [s for r in runs for s in r.samples]
    res = fit(samples, eff.compute, eff.memory, eff.launch_s)
    rel = res.rel_errors()
    host_fit = fit_host_launch_cost(runs, res, per_sample=True, host_speed=host_speed, fit_device_factor=True) if host else None
    profiles = [r.host for r in runs if r.host is not None and r.host.op_median_us]
    if host_fit and host_fit.host_reference_us:
        host_ref = host_fit.host_reference_us
    else:
        host_ref = host_reference_us(profiles) if host and profiles else {}
    h = host_fit.h_s if host_fit else 0.0
    hs = host_fit.sample_s if host_fit else 0.0
    f = host_fit.device_factor if host_fit else 1.0
    op_classes: dict[ComputeOpClass, OpClassCalibration] = {}
    for c in CLASSES:
        ce = {dt: min(1.0, v) for (cc, dt), v in res.compute.items() if cc == c}
        me = res.memory.get(c)
        la = res.launch_s.get(c)
        if ce or me is not None or la is not None:
            op_classes[c] = OpClassCalibration(
                compute_efficiency=ce, memory_efficiency=None if me is None else min(1.0, me), launch_overhead_s=la
            )
    versions = dict(runs[0].result.versions) if runs[0].result else {}
    versions.setdefault("coplan", __version__)
    cal = Calibration(
        device=devices[0],
        created_utc=datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        versions=versions,
        source_runs=tuple(str(d) for d in run_dirs),
        op_classes=op_classes,
        host_launch_s=min(1.0, h) if h > 0 else None,
        host_sample_s=min(1.0, hs) if hs > 0 else None,
        device_step_factor=f if host_fit else None,
        host_op_median_us=host_ref,
        lookup_id_latency_s=res.lookup_id_s,
        unfused_memory_efficiency=_unfused_memory(res),
        unfused_kernel_s=res.launch_s.get(UNFUSED_CLASS),
        fit_error=FitError(
            median_abs_rel_error=float(np.median(rel)),
            max_abs_rel_error=float(np.max(rel)),
            per_op_class=res.per_class_error(),
            num_samples=len(samples),
        ),
        notes=(
            f"fitted {len(samples)} (op, phase) samples from {len(runs)} run(s) of rank {rank}; "
            f"trace time attributed: {min(r.attributed_share for r in runs):.1%} (worst run); "
            + ("per-op samples include the GPU idle time each op's launches ended; " if host_gaps else "")
            + (f"host cost {h * 1e6:.2f} us per priced launch (host_launch_s) and {hs * 1e6:.1f} us per local sample "
               f"(host_sample_s), and device step factor {f:.3f} (device_step_factor: device work the ops do not price), "
               f"fitted to {len(host_fit.runs)} measured step time(s) (step = max(factor x device step, launches x "
               f"host cost + samples x per-sample host cost): host and device run concurrently; "
               + ("no fitted run is host-bound under the fit, so the host costs are not identified by these runs (the "
                  "smallest that fits is kept); " if not host_fit.host_bound().any() else "")
               + f"step-time error on those runs: median {host_fit.median_abs_error:.1%}, max {host_fit.max_abs_error:.1%}; "
               f"fit_error is of device time, without it); "
               + (f"each run's host time scaled by its host's speed (index {min(host_fit.speed):.2f}-{max(host_fit.speed):.2f} "
                  "against the runs' mean, host_op_median_us); " if host_fit.speed else "")
               if host_fit else ("no host cost fitted (no measured step times); " if host else ""))
            + "collective efficiencies left at the topology's values (no multi-GPU communication measured)"
        ),
    )
    return cal, res, runs


def _for_backend(plan: Plan, calibration: Calibration | None) -> Calibration | None:
    """The calibration the pricer prices ``plan`` with. The padded reference's attention ops carry
    their own dtype key (:data:`REFERENCE_ATTENTION_DTYPE`), so the pricer reads their fitted
    efficiency directly; nothing is remapped (the reference's efficiency used to be copied onto the
    compute dtype, which also repriced attention the reference does not run, Kunlun's)."""
    return calibration


def _priced(plan: Plan, calibration: Calibration | None, moments, seq_chunk: int | None, *, segments: bool = False):
    """The pricer's StepCost of ``plan`` under ``calibration`` at the given length moments and bag layout."""
    from coplan.costmodel.pricer import price

    ctx = build_context(plan.workload, plan.topology, plan.mesh, _for_backend(plan, calibration), options=_options(seq_chunk),
                        force_calibration=True)
    apply_moments(ctx, moments)
    return price(ctx, plan.tables or None, plan.layers, plan.balancing, plan.kernels, detail=False, segments=segments)


def _price_step(plan: Plan, calibration: Calibration | None, moments, seq_chunk: int | None) -> float:
    return float(_priced(plan, calibration, moments, seq_chunk).step_time_s)


def predict_step_time(plan: Plan, calibration: Calibration | None = None,
                      moments: dict[str, tuple[float, float]] | None = None, *, seq_chunk: int | None = None) -> float:
    """The pricer's step time for ``plan`` (as ``coplan plan`` prices it), under ``calibration`` (None:
    the topology's defaults) and, when given, the measured length moments of the steps it is compared
    with and the ids per bag of its sequence lookups (None: the cost model's default,
    :attr:`coplan.costmodel.context.Options.seq_chunk`). A calibration from another GPU is used as given.

    With a per-sample host cost (``host_sample_s``) the step is max(device step, priced launches ×
    ``host_launch_s`` + local samples × ``host_sample_s``): read off the pricer's device step and its
    launch slope here, so the figure holds whether or not the pricer adds the per-sample term itself
    (:func:`coplan.costmodel.compute.host_work_s`)."""
    step = _price_step(plan, calibration, moments, seq_chunk)
    if calibration is None or not calibration.host_sample_s:
        return step
    dev_cal = calibration.model_copy(update={"host_launch_s": None, "host_sample_s": None, "device_step_factor": None})
    # the launches the pricer charges: its step's slope in every class's launch cost (as step_launches)
    delta = 1e-6
    dflt = resolve_efficiencies(plan.topology).launch_s
    bumped_cls = {}
    for c in CLASSES:
        oc = dev_cal.op_classes.get(c, OpClassCalibration())
        base = oc.launch_overhead_s if oc.launch_overhead_s is not None else dflt.get(c, 0.0)
        bumped_cls[c] = oc.model_copy(update={"launch_overhead_s": base + delta})
    bumped = dev_cal.model_copy(update={"op_classes": bumped_cls})
    p0 = _price_step(plan, dev_cal, moments, seq_chunk)
    n = max(0.0, (_price_step(plan, bumped, moments, seq_chunk) - p0) / delta)
    B = plan.workload.batch.local(plan.mesh.world_size)
    host = (calibration.host_launch_s or 0.0) * n + calibration.host_sample_s * B
    return max((calibration.device_step_factor or 1.0) * p0, host, step)


@dataclass(frozen=True, slots=True)
class HostFit:
    """The per-launch host cost fitted to measured step times."""

    h_s: float
    runs: tuple[str, ...]
    measured_s: tuple[float, ...]
    device_s: tuple[float, ...]
    """The pricer's step under the device fit alone (h = 0)."""
    launches: tuple[float, ...]
    """Launches per step the pricer charges (its step time's slope in the launch cost)."""
    form: str = "max"
    """"max": step = max(device, launches · h), host and device concurrent (what the pricer prices);
    "additive": step = device + launches · h (kept as a reading for comparison only)."""
    sample_s: float = 0.0
    """Host seconds per local sample per step (fitted with ``per_sample=True``), added to launches · h."""
    batch: tuple[float, ...] = ()
    """Local samples per step of each run."""
    speed: tuple[float, ...] = ()
    """Each run's host speed index against ``host_reference_us`` (empty: not used, all 1)."""
    host_reference_us: dict[str, float] = field(default_factory=dict)
    """The fitted runs' host speed (:func:`host_reference_us`) the fit is for (empty: not used)."""
    device_factor: float = 1.0
    """Measured over priced device step (fitted with ``fit_device_factor=True``; 1: not fitted)."""
    segments: tuple = ()
    """Per run, (N, E, D) per step and segment (:data:`Segments`): what the fit priced; empty: one step of one
    segment per run (``device_s``, ``launches``)."""

    def host_s(self) -> np.ndarray:
        """Each run's host time under the fit."""
        b = np.array(self.batch) if self.batch else np.zeros(len(self.runs))
        k = np.array(self.speed) if self.speed else np.ones(len(self.runs))
        return k * (np.array(self.launches) * self.h_s + self.sample_s * b)

    def _steps(self) -> _StepSet:
        segs = _segment_arrays(self.device_s, self.launches, self.segments or None)
        k = np.array(self.speed) if self.speed else np.ones(len(self.runs))
        b = np.array(self.batch) if self.batch else np.zeros(len(self.runs))
        return _StepSet(segs, k, b)

    def host_bound(self) -> np.ndarray:
        """Which runs the fit prices longer for their host time (max form: some segment is the host's)."""
        st = self._steps()
        return st.median(self.h_s, self.sample_s, self.device_factor, "max")[0] > \
            st.median(0.0, 0.0, self.device_factor, "max")[0] * (1 + 1e-9)

    def predicted(self) -> np.ndarray:
        return self._steps().median(self.h_s, self.sample_s, self.device_factor, self.form)[0]

    @property
    def median_abs_error(self) -> float:
        m = np.array(self.measured_s)
        return float(np.median(np.abs(self.predicted() - m) / m))

    @property
    def max_abs_error(self) -> float:
        m = np.array(self.measured_s)
        return float(np.max(np.abs(self.predicted() - m) / m))


def _device_calibration(plan: Plan, res: FitResult, extra_launch_s: float = 0.0) -> Calibration:
    """The device fit alone (no host cost) as a Calibration, every class's launch cost raised by ``extra_launch_s``."""
    cls: dict[ComputeOpClass, OpClassCalibration] = {}
    eff = resolve_efficiencies(plan.topology)
    for c in CLASSES:
        ce = {dt: min(1.0, v) for (cc, dt), v in res.compute.items() if cc == c}
        me = res.memory.get(c)
        la = res.launch_s.get(c, eff.launch_s.get(c, 0.0)) + extra_launch_s
        cls[c] = OpClassCalibration(compute_efficiency=ce, memory_efficiency=None if me is None else min(1.0, me),
                                    launch_overhead_s=min(1.0, la))
    la_u = res.launch_s.get(UNFUSED_CLASS)
    return Calibration(device=plan.topology.gpu.name, op_classes=cls, lookup_id_latency_s=res.lookup_id_s,
                       unfused_memory_efficiency=_unfused_memory(res),
                       unfused_kernel_s=None if la_u is None else min(1.0, la_u + extra_launch_s))


def _unfused_memory(res: FitResult) -> float | None:
    m = res.memory.get(UNFUSED_CLASS)
    return None if m is None else min(1.0, m)


def step_launches(plan: Plan, res: FitResult, moments: dict[str, tuple[float, float]] | None = None, *,
                  seq_chunk: int | None = None) -> tuple[float, float]:
    """(the pricer's step time under the device fit, launches per step it charges): the pricer is
    linear in the launch cost, so the second is its slope, read off numerically."""
    delta = 1e-6
    p0 = predict_step_time(plan, _device_calibration(plan, res), moments, seq_chunk=seq_chunk)
    p1 = predict_step_time(plan, _device_calibration(plan, res, delta), moments, seq_chunk=seq_chunk)
    return p0, max(0.0, (p1 - p0) / delta)


def step_segments(plan: Plan, res: FitResult, moments: dict[str, tuple[float, float]] | None = None, *,
                  seq_chunk: int | None = None) -> tuple[tuple[float, float, float], ...]:
    """The pricer's step under the device fit alone (device-step factor 1, no host cost), cut at the
    host's syncs with the device: per segment (host launches, of them exposed, device seconds)
    (:attr:`coplan.costmodel.results.StepCost.segments`)."""
    return _priced(plan, _device_calibration(plan, res), moments, seq_chunk, segments=True).segments


def run_step_moments(r: RunSamples) -> tuple[dict[str, tuple[float, float]] | None, ...]:
    """The length moments to price ``r``'s measured steps at: one per step when the run logged them,
    else the steps' pooled moments (or the profiled ones, or none: the workload's own)."""
    return r.step_moments_each or (r.step_moments or r.moments or None,)


def predict_median_step(plan: Plan, calibration: Calibration | None, steps: Sequence[dict[str, tuple[float, float]] | None], *,
                        seq_chunk: int | None = None) -> float:
    """The median over ``steps`` (length moments of each measured step) of :func:`predict_step_time`: what a
    run's p50 step is compared with. A step's price depends on its batch's lengths, and for the padded
    reference steeply (its longest length squared): the median of the prices is the p50's counterpart,
    the price of the pooled moments the mean's."""
    if not steps:
        steps = (None,)
    return float(np.median([predict_step_time(plan, calibration, mo, seq_chunk=seq_chunk) for mo in steps]))


PHASES = ("fwd", "bwd", "optimizer")


def step_phases(plan: Plan, res: FitResult, moments: dict[str, tuple[float, float]] | None = None, *,
                seq_chunk: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Per phase (forward, backward with recompute, optimizer): the pricer's device time under the device
    fit (compute plus the communication it did not hide) and the launches it charges there (each phase's
    slope in the launch cost, read off numerically as :func:`step_launches` does for the step); they sum
    to the step and to :func:`coplan.costmodel.pricer.priced_launches`. For the per-phase host reading."""
    def phases(extra: float) -> np.ndarray:
        p = _priced(plan, _device_calibration(plan, res, extra), moments, seq_chunk).perf
        return np.array([p.fwd_compute_s + p.fwd_exposed_s, p.bwd_compute_s + p.recompute_s + p.bwd_exposed_s, p.optimizer_s])

    delta = 1e-6
    d0 = phases(0.0)
    return d0, np.maximum(0.0, (phases(delta) - d0) / delta)


def _refine_on_grid(loss, grid: np.ndarray, losses, xatol: float) -> tuple[float, float]:
    """(x, loss(x)): the grid point of least loss (``losses``: ``loss`` at each point), refined by a bounded
    scalar search between its neighbours; the grid point where the search does no better. (The losses here
    are piecewise smooth: the grid picks the basin, the search its bottom.)"""
    from scipy.optimize import minimize_scalar

    j = int(np.argmin(losses))
    r = minimize_scalar(loss, bounds=(grid[max(0, j - 1)], grid[min(len(grid) - 1, j + 1)]), method="bounded",
                        options={"xatol": xatol})
    return (float(r.x), float(r.fun)) if r.fun <= losses[j] else (float(grid[j]), float(losses[j]))


def fit_host_phase_form(runs: Sequence[RunSamples], res: FitResult) -> tuple[float, dict[str, tuple[np.ndarray, np.ndarray]]]:
    """``h`` of the per-phase reading, step = Σ over phases of max(device_p, launches_p · h), fitted like
    the max form's (log ratios, host-syncing backends left out; see :func:`fit_host_launch_cost`).
    Returns (h, per fitted run: its phase arrays). A reading only: it holds where the host cannot run
    ahead of the device across a phase boundary (a sync at each boundary), which the trainer does not do."""
    plain = [r for r in runs if r.plan.kernels.attention not in HOST_SYNCING_BACKENDS]
    per: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    meas = []
    for r in plain or runs:
        st = r.result.step_time if r.result else None
        if st is None or not st.p50_s:
            continue
        per[r.run] = step_phases(r.plan, res, r.step_moments or r.moments or None, seq_chunk=r.seq_chunk)
        meas.append(float(st.p50_s))
    if not per:
        return 0.0, per
    m = np.array(meas)
    D = np.array([v[0] for v in per.values()])
    N = np.array([v[1] for v in per.values()])

    def loss(h: float) -> float:
        return float(np.sum(np.log(np.maximum(D, h * N).sum(axis=1) / m) ** 2))

    hi = float(max(1e-9, np.max(m / np.maximum(N.sum(axis=1), 1.0)) * 2))
    grid = np.concatenate(([0.0], np.geomspace(hi * 1e-4, hi, 400)))
    return _refine_on_grid(loss, grid, [loss(float(g)) for g in grid], 1e-10)[0], per


HOST_FORMS = ("max", "additive")


HOST_SYNCING_BACKENDS: tuple[str, ...] = ("reference",)
"""Attention backends that read a device value on the host in every call (the padded reference's
longest length, ``.tolist()``, 8 times per forward step of gem-h200): at each sync the host waits for
the device to drain, so host and device overlap only between syncs. The pricer prices these plans'
host side itself: the reference's real kernels on the host (``flops.reference_kernels`` /
``context.HOST_KERNELS_PER_PRICED_LAUNCH`` priced launches per call) and a step that is the sum over
the segments between syncs of max(host, device) (``pricer.host_segments``, ``pricer.synced_step``);
the host-cost fit prices their steps the same way (:func:`fit_host_launch_cost`, :data:`Segments`),
so they fit ``h`` with the other runs: their host time is exposed at every sync, where a device-bound
run's is hidden. (Until calibration round 8 they were left out of that fit, and ``h`` was not
identified on device-bound fit sets: the reference's host time went unpriced, −16% on its held-out
run.) The wait is inside the pageable device-to-host copy (``cudaMemcpyAsync``), not the stream sync: on
``ref-b12-h768`` (round 2) 17-61 ms per call where the device was behind, ~0.04 ms on ``ref-b8``."""


def host_reference_us(profiles: Sequence[HostProfile]) -> dict[str, float]:
    """The host speed of a set of runs: per call of :data:`coplan.costmodel.traces.HOST_SPEED_OPS` that
    every one of them made, the geometric mean of their median host durations (µs)."""
    ops = set.intersection(*(set(p.op_median_us) for p in profiles)) if profiles else set()
    return {k: float(np.exp(np.mean([np.log(p.op_median_us[k]) for p in profiles])))
            for k in sorted(ops) if all(p.op_median_us[k] > 0 for p in profiles)}


Segments = Sequence[tuple]
"""Per run, (N, E, D) (or (N, D): nothing exposed): host launches, of them those the device waits through
at the segment's start, and device seconds (device-step factor 1), of each step (rows) and of each segment
between the host's syncs with the device (columns), as the pricer cuts the step
(:attr:`coplan.costmodel.results.StepCost.segments`). A run that does not sync has one column."""


def _segment_arrays(device_s: Sequence[float], launches: Sequence[float],
                    segments: Segments | None) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    if segments is None:
        return [(np.array([[float(n)]]), np.zeros((1, 1)), np.array([[float(d)]])) for d, n in zip(device_s, launches)]
    out = []
    for i, seg in enumerate(segments):
        if len(seg) == 2:
            N, D = (np.atleast_2d(np.asarray(x, float)) for x in seg)
            E = np.zeros_like(N)
        else:
            N, E, D = (np.atleast_2d(np.asarray(x, float)) for x in seg)
        if not (N.shape == E.shape == D.shape) or N.size == 0:
            raise CalibrationError(f"run {i}: host launches {N.shape}, exposed {E.shape} and device times {D.shape} "
                                   "need one value per step and segment")
        if N.shape[1] == 1 and np.ptp(N) == 0 and not E.any():
            # no sync: max(host, f · D_step) is monotone in D_step, so the median step is the median D's
            N, E, D = N[:1], E[:1], np.median(D, axis=0, keepdims=True)
        out.append((N, E, D))
    return out


class _StepSet:
    """The runs' steps as :func:`_segment_arrays` gives them, priced for many host costs at once: runs of
    one step of one segment (no sync) in one vectorised max form, the others one by one."""

    def __init__(self, segs: list[tuple[np.ndarray, np.ndarray, np.ndarray]], k: np.ndarray, bt: np.ndarray,
                 step_measured: Sequence[Sequence[float] | None] | None = None):
        self.n_runs = len(segs)
        # a syncing run's steps, each with its own measured time: fitted step by step (see sq_err)
        self.per_step = {i: np.asarray(t, float) for i, t in enumerate(step_measured or ())
                         if t is not None and len(t) == segs[i][0].shape[0] and segs[i][0].shape[0] > 1 and np.all(np.asarray(t) > 0)}
        one = [i for i, (N, E, _) in enumerate(segs) if N.shape == (1, 1) and not E.any()]
        self.one = np.array(one, dtype=int)
        self.N1 = np.array([segs[i][0][0, 0] for i in one])
        self.D1 = np.array([segs[i][2][0, 0] for i in one])
        self.k1, self.b1 = k[self.one], bt[self.one]
        self.many = [(i, *segs[i], float(k[i]), float(bt[i])) for i in range(len(segs)) if i not in set(one)]

    def _steps(self, h: np.ndarray, s: float, f: float, form: str, N, E, D, kr: float, b: float) -> np.ndarray:
        """[len(h), steps] of one multi-segment run: per step the sum over its segments of exposed host +
        max(the rest of the host, f · device) (``"max"``), or f · device + host (``"additive"``)."""
        tot = np.maximum(N.sum(axis=1), 1e-300)
        per = (kr * (h[:, None] + s * b / tot[None, :]))[:, :, None]
        host, ex = per * N[None], per * E[None]
        if form == "max":
            return (ex + np.maximum(host - ex, f * D[None])).sum(axis=2)
        return f * D.sum(axis=1)[None] + host.sum(axis=2)

    def median(self, h, s: float, f: float, form: str) -> np.ndarray:
        """[len(h), runs]: each run's median step over its steps, for each host cost in ``h``: per step the
        sum over its segments of exposed host + max(the rest of the host, f · device) (``form="max"``; one
        segment, nothing exposed: the max form), the host's time in a segment being k · (h + s · batch /
        the step's launches) · its launches; ``"additive"``: f · device + host."""
        if form not in HOST_FORMS:
            raise CalibrationError(f"unknown host form {form!r} (one of {HOST_FORMS})")
        h = np.atleast_1d(np.asarray(h, float))
        out = np.empty((len(h), self.n_runs))
        if len(self.one):
            host = self.k1 * (h[:, None] * self.N1 + s * self.b1)
            out[:, self.one] = np.maximum(f * self.D1, host) if form == "max" else f * self.D1 + host
        for i, N, E, D, kr, b in self.many:
            out[:, i] = np.median(self._steps(h, s, f, form, N, E, D, kr, b), axis=1)
        return out

    def sq_err(self, h, s: float, f: float, form: str, m: np.ndarray) -> np.ndarray:
        """[len(h), runs]: each run's squared log error against its measured p50 ``m``, except a run with
        per-step measured times (``step_measured``), whose error is the mean over its steps of each step's
        squared log error. A syncing run's steps spread over a wide range (the padded reference: 70-280 ms
        in one run, in clusters of the few batches its data set repeats), and the p50 of such a spread jumps
        between clusters; fitted step by step, its host time is read off all of them."""
        out = np.log(self.median(h, s, f, form) / m) ** 2
        h = np.atleast_1d(np.asarray(h, float))
        for i, N, E, D, kr, b in self.many:
            t = self.per_step.get(i)
            if t is not None:
                out[:, i] = np.mean(np.log(self._steps(h, s, f, form, N, E, D, kr, b) / t[None, :]) ** 2, axis=1)
        return out


def fit_host_terms(measured_s: Sequence[float], device_s: Sequence[float], launches: Sequence[float],
                   batch: Sequence[float] | None = None, *, form: str = "max", per_sample: bool = False,
                   speed: Sequence[float] | None = None, device_factor: float = 1.0,
                   segments: Segments | None = None,
                   step_measured: Sequence[Sequence[float] | None] | None = None) -> tuple[float, float]:
    """(h, s): host seconds per priced launch and per local sample fitted to measured steps, step =
    max(device, k · (launches · h + batch · s)) (``form="max"``) or device + that (``"additive"``), where
    ``k`` is each run's host speed (``speed``: how much slower its host ran the same calls than the
    reference host the fit is for, 1 = as fast; None: all 1). Least squares on log ratios; the max form's
    loss is piecewise smooth in ``h``, so a log-spaced grid picks the basin and a bounded scalar search
    refines it; ``s`` (``per_sample``, needs two or more batch sizes) by an outer grid and search.
    ``device_factor`` multiplies every device step first (:func:`fit_step_terms` fits it). Where the
    loss is flat in ``h`` (no run is host-bound at any ``h`` in a range) the smallest such ``h`` is kept:
    host time the runs do not show is not invented.

    ``segments`` (:data:`Segments`): each run's steps as the pricer cuts them at the host's syncs; a
    run's predicted step is then the median over its steps of the sum over their segments of max(host,
    device) (what its measured p50 is compared with), which lets a run whose host syncs (the padded
    reference) fit ``h`` with the others. Without it, each run is one step of one segment
    (``device_s``, ``launches``). ``step_measured``: per run, its steps' measured times (in the order of
    its ``segments`` rows) or None; a syncing run that has them is fitted step by step
    (:meth:`_StepSet.sq_err`), the others at their p50."""
    from scipy.optimize import minimize_scalar

    if form not in HOST_FORMS:
        raise CalibrationError(f"unknown host form {form!r} (one of {HOST_FORMS})")
    m, d, n = np.asarray(measured_s, float), np.asarray(device_s, float), np.asarray(launches, float)
    bt = np.zeros_like(m) if batch is None else np.asarray(batch, float)
    k = np.ones_like(m) if speed is None else np.asarray(speed, float)
    if not (len(m) == len(d) == len(n) == len(bt) == len(k)) or len(m) == 0 or (segments is not None and len(segments) != len(m)):
        raise CalibrationError("fit_host_terms: measured, device, launches, batch, speed (and segments) need one value per run")
    if np.any(m <= 0) or np.any(k <= 0):
        raise CalibrationError("fit_host_terms: measured steps and host speeds must be positive")
    segs = _segment_arrays(d, n, segments)
    n_tot = np.array([float(np.median(N.sum(axis=1))) for N, _, _ in segs])
    d_tot = np.array([float(np.median(D.sum(axis=1))) for _, _, D in segs]) * device_factor
    f = device_factor
    steps = _StepSet(segs, k, bt, step_measured)

    def fit_h(sv: float) -> tuple[float, float]:
        def loss(h: float) -> float:
            return float(np.sum(steps.sq_err(h, sv, f, form, m)[0]))

        if form == "additive":
            hi = float(max(1e-9, np.max((m - d_tot) / np.maximum(k * n_tot, 1.0)) * 2 + 1e-6))
            r = minimize_scalar(loss, bounds=(0.0, hi), method="bounded", options={"xatol": 1e-9})
            h = float(max(0.0, r.x))
            return h, loss(h)
        hi = float(max(1e-9, np.max(m / np.maximum(k * n_tot, 1.0)) * 2))
        grid = np.concatenate(([0.0], np.geomspace(hi * 1e-4, hi, 400)))
        losses = np.sum(steps.sq_err(grid, sv, f, form, m), axis=1)  # loss() per point
        return _refine_on_grid(loss, grid, losses, 1e-10)

    s_best = 0.0
    h, _ = fit_h(0.0)
    if per_sample and len(set(bt.tolist())) > 1:
        s_hi = float(np.max(m / np.maximum(k * bt, 1.0)))
        s_grid = np.concatenate(([0.0], np.geomspace(s_hi * 1e-4, s_hi, 120)))
        s_loss = lambda sv: fit_h(sv)[1]  # noqa: E731
        s_best = _refine_on_grid(s_loss, s_grid, [s_loss(sv) for sv in s_grid], 1e-10)[0]
        h, _ = fit_h(s_best)
    return max(0.0, h), max(0.0, s_best)


DEVICE_FACTOR_RANGE = (0.8, 1.5)
"""Bounds of the fitted device-step factor."""
DEVICE_FACTOR_PRIOR = 1e-4
"""Weight of the pull of log(factor) towards 0 (factor 1): decides only where the runs do not (all host-bound)."""


def fit_step_terms(measured_s: Sequence[float], device_s: Sequence[float], launches: Sequence[float],
                   batch: Sequence[float] | None = None, *, per_sample: bool = False,
                   speed: Sequence[float] | None = None, segments: Segments | None = None,
                   step_measured: Sequence[Sequence[float] | None] | None = None) -> tuple[float, float, float]:
    """(h, s, f): :func:`fit_host_terms`' host costs and a device-step factor ``f``, fitted together to
    measured steps, step = max(f · device, k · (launches · h + batch · s)) (with ``segments``: per step
    the sum over the segments between the host's syncs of that max, the median over the steps). ``f``
    is the device work no priced op accounts for (small kernels of the optimizer and the allocator,
    copies, the gaps between dependent kernels), as a share of the priced device step: device-bound
    runs set it, host-bound ones ``h`` and ``s``. Least squares on log ratios, ``f`` by a log grid over
    :data:`DEVICE_FACTOR_RANGE` and a bounded search around its best point, ``h`` and ``s`` inside; a
    weak prior (:data:`DEVICE_FACTOR_PRIOR`) keeps ``f`` at 1 when no run is device-bound.

    A host term is kept only where more runs are host-bound under the fit (their predicted step is
    longer than with no host cost) than it has parameters (two for ``h``, three for ``h`` and ``s``):
    one run above the others' device factor, by its noise, is fitted exactly by any host cost that
    makes it host-bound alone, which says nothing of the host. Otherwise the term is dropped (``s``,
    then ``h``) and the rest refitted."""
    m = np.asarray(measured_s, float)
    d = np.asarray(device_s, float)
    n = np.asarray(launches, float)
    bt = np.zeros_like(m) if batch is None else np.asarray(batch, float)
    k = np.ones_like(m) if speed is None else np.asarray(speed, float)
    steps = _StepSet(_segment_arrays(d, n, segments), k, bt, step_measured)

    def pred(h: float, s: float, f: float) -> np.ndarray:
        return steps.median(h, s, f, "max")[0]

    def terms(f: float, host: bool, samples: bool) -> tuple[float, float, float]:
        h, s = (fit_host_terms(m, d, n, bt, form="max", per_sample=samples, speed=k, device_factor=f, segments=segments,
                               step_measured=step_measured)
                if host else (0.0, 0.0))
        return h, s, float(np.sum(steps.sq_err(h, s, f, "max", m)[0]) + DEVICE_FACTOR_PRIOR * math.log(f) ** 2)

    def solve(host: bool, samples: bool) -> tuple[float, float, float]:
        grid = np.geomspace(*DEVICE_FACTOR_RANGE, 57)
        f_loss = lambda f: terms(f, host, samples)[2]  # noqa: E731
        f = _refine_on_grid(f_loss, grid, [f_loss(float(g)) for g in grid], 1e-5)[0]
        h, s, _ = terms(f, host, samples)
        return h, s, f

    def host_bound(h: float, s: float, f: float) -> int:
        return int(np.sum(pred(h, s, f) > pred(0.0, 0.0, f) * (1 + 1e-9)))

    h, s, f = solve(True, per_sample)
    if s > 0 and host_bound(h, s, f) < 3:
        h, s, f = solve(True, False)
    if h > 0 and host_bound(h, s, f) < 2:
        h, s, f = solve(False, False)
    return h, s, f


def fit_host_launch_cost(runs: Sequence[RunSamples], res: FitResult, form: str = "max", *,
                         per_sample: bool = False, host_speed: bool = False,
                         fit_device_factor: bool = False) -> HostFit | None:
    """Fit ``h`` (host seconds per priced launch) to the runs' measured steps (CUDA-event p50).

    ``form="max"`` (the cost model's): step = max(device step under the device fit, launches · h). The
    host issues a step's launches while the GPU runs earlier ones, so on a host-bound step the device
    work hides under the host's, and on a device-bound one the launches hide under the kernels: the
    longer of the two, not their sum. ``form="additive"``: step = device + launches · h (a reading only).
    See :func:`fit_host_terms`.

    ``per_sample``: the host's time also holds a per-sample cost ``s`` (host = launches · h + local samples
    · s): fitted with ``h``. Needs runs at two or more local batches to tell ``s`` from ``h``; with one
    batch ``s`` is 0.

    ``host_speed``: each run's host time is scaled by how fast its host ran (the median host duration
    of the same ATen and launch calls in its profiled steps, against the fitted runs' geometric mean:
    :func:`coplan.costmodel.traces.host_speed_index`), so that ``h`` and ``s`` are those of the fitted
    runs' typical host and a run measured on a slowed host (a shared CPU) does not bend them. Needs every
    fitted run's host profile; without one the runs count as equally fast.

    ``fit_device_factor`` (max form): also fit ``f``, step = max(f · device step, host), the device work no
    priced op accounts for as a share of the priced device step (:func:`fit_step_terms`). Host-syncing
    runs are left out of it as they are of ``h``.
    """
    if form not in HOST_FORMS:
        raise CalibrationError(f"unknown host form {form!r} (one of {HOST_FORMS})")

    names, meas, dev, nl, bs, prof, segments, per_step = [], [], [], [], [], [], [], []
    # every run, a host-syncing one too: each is priced per measured step as the pricer cuts it at the
    # host's syncs (one segment without any), and its median step is compared with its measured p50
    for r in runs:
        st = r.result.step_time if r.result else None
        if st is None or not st.p50_s or st.p50_s <= 0:
            continue
        cut = [step_segments(r.plan, res, mo, seq_chunk=r.seq_chunk) for mo in run_step_moments(r)]
        if not cut or any(len(c) != len(cut[0]) for c in cut):
            continue
        N, E, D = (np.array([[x[j] for x in c] for c in cut]) for j in range(3))
        if float(np.median(D.sum(axis=1))) <= 0:
            continue
        names.append(r.run)
        meas.append(float(st.p50_s))
        dev.append(float(np.median(D.sum(axis=1))))
        nl.append(float(np.median(N.sum(axis=1))))
        segments.append((N, E, D))
        per_step.append(r.step_times_each if r.step_moments_each and len(r.step_times_each) == len(cut) else None)
        bs.append(float(r.plan.workload.batch.local(r.plan.mesh.world_size)))
        prof.append(r.host)
    if not names:
        return None
    speed: tuple[float, ...] = ()
    reference: dict[str, float] = {}
    if host_speed and all(p is not None and p.op_median_us for p in prof):
        reference = host_reference_us(prof)
        ks = [host_speed_index(p, reference) for p in prof]
        if reference and all(x is not None for x in ks):
            speed = tuple(float(x) for x in ks)
    if fit_device_factor and form == "max":
        h, s, f = fit_step_terms(meas, dev, nl, bs, per_sample=per_sample, speed=speed or None, segments=segments,
                                 step_measured=per_step)
    else:
        (h, s), f = fit_host_terms(meas, dev, nl, bs, form=form, per_sample=per_sample, speed=speed or None,
                                   segments=segments, step_measured=per_step), 1.0
    return HostFit(h, tuple(names), tuple(meas), tuple(dev), tuple(nl), form, s, tuple(bs), speed, reference, f,
                   tuple(segments))
