"""Reading runs: one run directory (``runs/<id>/``, :class:`coplan.spec.RunDir`) becomes the samples a
fit reads. Its rank's trace is attributed to the cost model's ops (:mod:`coplan.calibration.attribution`),
each measured (op, phase) is paired with its unit-efficiency roofline terms
(:mod:`coplan.calibration.terms`) at the length moments of the profiled steps, and the host side of the
profiled steps is read (:mod:`coplan.calibration.host_profile`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from coplan.calibration.attribution import TraceAttribution, attribute
from coplan.calibration.host_profile import HostProfile, host_profile
from coplan.calibration.kineto import TraceError, check_events, load_trace
from coplan.calibration.run_inputs import checked_metrics, checked_profiled_steps, checked_result, lengths_note
from coplan.calibration.terms import PADDED_SUFFIX, unit_terms
from coplan.costmodel.flops import dense_graphs_apply, film_fused
from coplan.errors import CoplanError
from coplan.spec import Plan, RunDir, RunResult


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
    see :func:`coplan.costmodel.context.seq_lookup_floor_s`."""
    extra_kernels: float = 0.0
    """Kernels of an unfused op beyond ``launches`` (per micro-batch), each costing the ``unfused`` launch
    overhead (a calibration's ``unfused_kernel_s``)."""
    head_dim: int = 0
    """The attention op's head dim (0: not an attention op): with the op and phase, the key of its
    calibrated scale (:attr:`coplan.spec.Calibration.attention_scales`)."""

    @property
    def attention_key(self) -> tuple[str, str, int] | None:
        """(op, phase, head dim) of an attention sample (op: the name's last part), None otherwise."""
        if self.op_class != "attention" or self.head_dim <= 0:
            return None
        return self.name.rsplit(".", 1)[-1], self.phase, self.head_dim


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
    """The host side of the profiled steps (:func:`coplan.calibration.host_profile.host_profile`); None when the
    trace has no profiled trainer step."""
    notes: tuple[str, ...] = ()
    """What the run lacks that the fit does without (:mod:`coplan.calibration.run_inputs`: an unfinished run's
    summary, an older trainer's step list or length statistics), each saying what the fit then does; empty for
    a complete run. ``coplan calibrate`` prints them and writes them into the calibration's notes."""


def run_seq_chunk(run_dir: str | Path) -> int:
    """Ids per bag the run's sequence lookups used: ``seq_chunk`` of its recorded options, else 0 (the
    cost model's reading of a run that did not record them: one bag per sample's whole history)."""
    opts = RunDir(run_dir).options()
    return opts.seq_chunk if opts is not None else 0


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


FUSED_FFN_RANGE = "ffn_fused"
"""The op range the trainer gives a layer's fused FP8 FFN (``fp8_recipe: blockwise-fused``,
:class:`coplan.trainer.model.layers.FusedFp8FFN`): one kernel chain doing the work the cost model prices
as three ops (``ffn_up``, ``ffn_down`` and, with the layer's other norms, ``norm_act``)."""


def fused_ffn_ops(per_step: dict[tuple[str, str], float]) -> set[str]:
    """The cost-model ops whose measured time a fused FP8 FFN took over, from the layers that have an
    ``<layer>.ffn_fused`` range in the trace: those layers' ``ffn_up`` and ``ffn_down`` (measured at 0)
    and ``norm_act`` (measured without norm2 and the SiLU). They give no sample: fitted, they would read as
    free GEMMs and fast elementwise work. The fused time itself stays listed as unpriced
    (``<layer>.ffn_fused:<phase>``), so what the fit leaves out is visible."""
    layers = {n.rsplit(".", 1)[0] for n, _ in per_step if n.rsplit(".", 1)[-1] == FUSED_FFN_RANGE}
    return {f"{layer}.{op}" for layer in layers for op in ("ffn_up", "ffn_down", "norm_act")}


def as_ran(plan: Plan, opts) -> Plan:
    """``plan`` as its run executed it: a plan the pricer would replay as CUDA graphs, whose run did not (it
    records ``cuda_graphs`` false: ``--cuda-graphs off``, a capture that failed, or a run from before the
    graphs), is priced eagerly (its workload's ``kernels.cuda_graphs`` off), so that the host launches its
    steps are compared with are the ones it issued. Likewise a run whose InterFormer layers did not run the fused
    FiLM LayerNorm (``film`` eager: ``--compile``, or a run from before the kernel) is priced with the unfused
    FiLM's traffic (``kernels.film`` eager), and a run that did not record masked head dims in the attention kernels
    (``head_pad``: runs from before 2026-12-06) with the padded copies it made (``kernels.head_pad`` copies)."""
    w = plan.workload
    update = {}
    if not (opts is not None and opts.cuda_graphs) and w.kernels.cuda_graphs == "auto" and dense_graphs_apply(w, plan.world_size):
        update["cuda_graphs"] = "off"
    if film_fused(w) and not (opts is not None and opts.film == "fused"):
        update["film"] = "eager"
    if w.kernels.head_pad == "masked" and not (opts is not None and opts.head_pad == "masked"):
        update["head_pad"] = "copies"
    if not update:
        return plan
    ran = w.model_copy(update={"kernels": w.kernels.model_copy(update=update)})
    return plan.model_copy(update={"workload": ran})


def run_samples(run_dir: str | Path, *, rank: int = 0, force: bool = False,
                longest: dict[int, dict[str, list[int]]] | None = None) -> RunSamples:
    """Attribute one run's trace (of ``rank``) and pair each measured op with its roofline terms.

    ``longest``: per step, per sequence, the longest length of each of ``rank``'s micro-batches, when
    metrics.jsonl does not log them (``seq_max``) but the caller knows the batches (see :data:`PADDED_SUFFIX`).
    """
    rd = RunDir(run_dir)
    d = rd.path
    _check_run_dir(rd)
    plan = rd.plan()
    result, notes = checked_result(rd, plan)
    plan = rd.ran_plan(plan)
    trace_path = rd.rank_trace(rank)
    if trace_path is None:
        raise CalibrationError(f"{d}: no trace for rank {rank} under traces/ (run with profiling on)")
    metrics, note = checked_metrics(rd)
    notes += [note] if note else []
    profiled, note = checked_profiled_steps(rd, metrics)
    notes += [note] if note else []
    note = lengths_note(plan, metrics)
    notes += [note] if note else []
    trace = load_trace(trace_path)
    check_events(trace, trace_path)
    att: TraceAttribution = attribute(trace, str(trace_path))
    try:
        hp: HostProfile | None = host_profile(trace, str(trace_path))
    except TraceError:
        hp = None
        notes.append(f"{trace_path.relative_to(d)} has no 'ProfilerStep#N' ranges: its host side is not profiled (no "
                     "host speed measured; with --host-speed no run's host time is scaled)")
    del trace
    device = (result.device if result and result.device else plan.topology.gpu.name)
    if longest:
        metrics = [({**m, "seq_max": longest[m["step"]]} if m.get("step") in longest and "seq_max" not in m else m)
                   for m in metrics]
    opts = result.options if result else None
    seq_chunk = opts.seq_chunk if opts is not None else 0
    plan = as_ran(plan, opts)
    moments = measured_moments(metrics, profiled)
    warm = result.warmup_steps if result else 0
    timed = [int(m["step"]) for m in metrics if "step" in m and m["step"] >= warm and m["step"] not in set(profiled or ())]
    step_moments = measured_moments(metrics, timed) if timed else {}
    pairs = [(measured_moments(metrics, [t]), m.get("step_time_s")) for t in timed
             for m in metrics if m.get("step") == t] if timed else []
    each = tuple(mo for mo, _ in pairs if mo)
    times = tuple(float(x) for mo, x in pairs if mo and x)
    times = times if len(times) == len(each) else ()

    per_step = att.per_step()
    out: list[Sample] = []
    priced: set[tuple[str, str]] = set()
    fused = fused_ffn_ops(per_step)
    for t in unit_terms(plan, moments, rank=rank, seq_chunk=seq_chunk):
        members = t.members or (t.name,)
        priced.update((n, t.phase) for n in members)
        if fused & set(members):
            continue
        meas = sum(per_step.get((n, t.phase), 0.0) for n in members) / t.micro_batches
        if meas > 0:
            out.append(Sample(d.name, t.name, t.phase, t.op_class, t.dtype, meas, t.flop_s, t.mem_s, t.launches,
                              t.serial_mem_s, t.mem_class, t.lookup_groups, t.extra_kernels,
                              head_dim=_head_dim(plan, t.name) if t.op_class == "attention" else 0))
    unpriced = {f"{n}:{ph}": v for (n, ph), v in sorted(per_step.items()) if (n, ph) not in priced and v > 0}
    steps = max(1, att.steps)
    unpriced["unattributed"] = att.unattributed_s / steps
    if not out:
        raise CalibrationError(
            f"{trace_path}: no op of the cost model could be attributed ({att.unattributed_s * 1e3:.1f} ms unattributed); "
            "the trainer names its record_function ranges '<block>.<layer>.<op>'"
        )
    return RunSamples(d.name, device, plan, result, tuple(out), att.attributed_share, att.unattributed_s, att.total_s, moments,
                      idle_s=att.idle_s / steps, window_s=att.window_s / steps, step_moments=step_moments, unpriced_s=unpriced, step_moments_each=each,
                      step_times_each=times,
                      seq_chunk=seq_chunk, host=hp, notes=tuple(notes))


def _check_run_dir(rd: RunDir) -> None:
    """Refuse what is not a run directory: nothing there, a file, an empty folder, a folder without a plan."""
    d = rd.path
    fix = "give run directories written by `coplan train` (runs/<id>/ with plan.json, metrics.jsonl, summary.json, traces/)"
    if not d.exists():
        raise CalibrationError(f"{d}: not a run directory (no such directory); {fix}")
    if not d.is_dir():
        raise CalibrationError(f"{d}: not a run directory (a file, not a folder); {fix}")
    try:
        empty = not any(d.iterdir())
    except OSError as e:
        raise CalibrationError(f"{d}: cannot be listed: {e.strerror or e}") from None
    if empty:
        raise CalibrationError(f"{d}: not a run directory (an empty folder: no plan.json); {fix}")
    if not rd.plan_path.is_file():
        raise CalibrationError(f"{d}: has no plan.json, so it is no run directory `coplan train` wrote; {fix}")


def _head_dim(plan: Plan, op_name: str) -> int:
    """The head dim of the block an op ``<block>.<layer>.<op>`` belongs to (0: none)."""
    try:
        return int(getattr(plan.workload.block(op_name.split(".", 1)[0]), "head_dim", 0) or 0)
    except KeyError:
        return 0


def run_step_moments(r: RunSamples) -> tuple[dict[str, tuple[float, float]] | None, ...]:
    """The length moments to price ``r``'s measured steps at: one per step when the run logged them,
    else the steps' pooled moments (or the profiled ones, or none: the workload's own)."""
    return r.step_moments_each or (r.step_moments or r.moments or None,)


__all__ = ["CalibrationError", "FUSED_FFN_RANGE", "RunSamples", "Sample", "fused_ffn_ops", "measured_moments", "run_samples", "run_seq_chunk", "run_step_moments"]
