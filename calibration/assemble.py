"""Calibrate: read runs, fit the device and (optionally) the host, and write one Calibration with its
fit error. The entry point of ``coplan calibrate RUN...``."""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path
from typing import Sequence

import numpy as np

from coplan import __version__
from coplan.calibration import fingerprint
from coplan.calibration.device_fit import FitResult, attention_scale_of, fit, fit_attention_scales, predict
from coplan.calibration.host_fit import fit_host_launch_cost
from coplan.calibration.step_price import graphed_plan
from coplan.calibration.host_profile import host_reference_us
from coplan.calibration.runs import CalibrationError, RunSamples, run_samples
from coplan.calibration.step_price import unfused_memory
from coplan.calibration.terms import CLASSES
from coplan.costmodel.context import local_batch_of, micro_batches_of
from coplan.costmodel.efficiency import UNFUSED_CLASS, resolve_efficiencies
from coplan.costmodel.loader import balance_group, loader_step_s
from coplan.spec import Calibration, FitError, OpClassCalibration
from coplan.spec.calibration import ComputeOpClass


MIN_ATTRIBUTED_SHARE = 0.5
"""Below this share of a run's traced device time attributed to the cost model's ops (the worst run's), its
per-op samples do not stand for the step (e.g. a trace of replayed CUDA graphs, whose kernels carry no op
names), and a calibration made ``on top of`` a base keeps the base's device terms."""


def base_result(samples: Sequence, base: Calibration, eff) -> FitResult:
    """A :class:`FitResult` that is ``base`` kept whole (no fit; ``eff``: its resolved efficiencies): what it
    predicts for the samples, and the step priced with it."""
    samples = tuple(samples)
    return FitResult(compute=dict(eff.compute), memory=dict(eff.memory), launch_s=dict(eff.launch_s),
                     predicted_s=predict(samples, eff.compute, eff.memory, eff.launch_s, base.lookup_id_latency_s,
                                         attention_scale_of(eff)),
                     measured_s=np.array([s.measured_s for s in samples]), samples=samples,
                     lookup_id_s=base.lookup_id_latency_s, base=base, attention_scales=dict(base.attention_scales))


def ran_graphed(r: RunSamples) -> bool:
    """Whether run ``r`` replayed its dense arch as CUDA graphs (its host launches then are the graphed few:
    :func:`coplan.calibration.step_price.step_segments`). A run that did not has its plan priced eagerly
    already (:func:`coplan.calibration.runs.as_ran`), so the plan says it."""
    return graphed_plan(r.plan)


def _graphed_note(h: float, h_graphed: float, graph_fit, n_graphed: int, n_eager: int, has_base: bool) -> str:
    if not n_graphed:
        return ""
    if graph_fit is not None:
        return (f"the {n_graphed} run(s) that replayed the dense arch as CUDA graphs fitted apart from the {n_eager} eager "
                f"one(s): {h_graphed * 1e6:.2f} us per priced launch under the graphs (host_launch_graphed_s; step-time "
                f"error on them: median {graph_fit.median_abs_error:.1%}, max {graph_fit.max_abs_error:.1%}), "
                f"{h * 1e6:.2f} us eager (host_launch_s); ")
    return (f"every run replayed the dense arch as CUDA graphs: the host cost below is theirs (host_launch_graphed_s), "
            + ("and the eager one (host_launch_s) stays the base's; " if has_base and h > 0 else
               "and no eager host cost is identified (host_launch_s unset: eager plans price device time alone); "))


def _device_term(f: float, g: float) -> str:
    """The fitted device term in words: the gap per priced launch where one was fitted, else the factor."""
    return (f"device gap {g * 1e6:.2f} us per priced launch (device_gap_s)" if g else
            f"device step factor {f:.3f} (device_step_factor)")


def calibrate(run_dirs: Sequence[str | Path], *, rank: int = 0, force: bool = False, host: bool = False, prepared: Sequence[RunSamples] | None = None,
              host_speed: bool = False, base: Calibration | None = None, base_name: str = "the base",
              device_term: str = "factor") -> tuple[Calibration, FitResult, list[RunSamples]]:
    """Fit a Calibration to the runs; all must come from one device unless ``force``.

    ``host``: also fit the per-launch host cost ``h`` to the runs' measured step times
    (:mod:`coplan.calibration.host_fit`, max form) when their summaries have them, written as ``host_launch_s``; the
    ``fit_error`` stays that of the device-time fit (per op, without ``h``). ``prepared``: the runs' :func:`run_samples`, already
    read (same order as ``run_dirs``), to save parsing their traces again. ``host_speed`` (with ``host``):
    fit the host costs to the runs' steps each scaled by its host's speed (``fit_host_launch_cost``);
    either way the fitted runs' host speed is recorded (``host_op_median_us``) when their traces have it.
    ``device_term``: how the device work no priced op accounts for is fitted: ``"factor"`` (the default: a share of the
    device step), ``"gap"`` (a time per priced launch) or ``"best"`` (whichever fits the steps closer;
    :func:`~coplan.calibration.host_fit.fit_host_launch_cost`). The default stays the factor: fitted on one set of
    ten draws and checked by leaving one out, the gap (and the choice between the two) priced the left-out draws
    worse on two of three H100 sets (2026-12-06); fitted on one set and checked on four later ones, it priced their
    worst steps better (the shipped H100 calibration's notes).
    ``base``: a calibration to start from (``coplan calibrate --base``): its device terms are the fit's
    starting point and stay for the op classes the runs do not measure; when the worst run's trace attributes
    under :data:`MIN_ATTRIBUTED_SHARE` of its device time, all its device terms stay and only the step-level
    terms (host costs, device-step factor, loader) are fitted to the runs.
    """
    if not run_dirs:
        raise CalibrationError("give at least one run directory")
    given: dict[Path, str] = {}
    for d in run_dirs:
        key = Path(d).resolve()
        if key in given:
            raise CalibrationError(f"{d}: the run is given twice (also as {given[key]}): it would count twice in the fit; "
                                   "give each run once")
        given[key] = str(d)
    if base is not None and base.device_gap_s:
        # (a step-level term, refitted with the host costs: the base's launch costs without it are the device's)
        base = base.model_copy(update={"device_gap_s": None})
    runs = list(prepared) if prepared is not None else [run_samples(d, rank=rank, force=force) for d in run_dirs]
    devices = sorted({r.device for r in runs})
    if len(devices) > 1 and not force:
        raise CalibrationError(f"the runs come from different devices {devices}; calibrate each device separately (or --force)")
    topo = runs[0].plan.topology
    eff = resolve_efficiencies(topo, base, force=force) if base is not None else resolve_efficiencies(topo, default_gap=False)
    samples = [s for r in runs for s in r.samples]
    worst = min(r.attributed_share for r in runs)
    keep_base = base is not None and worst < MIN_ATTRIBUTED_SHARE
    if keep_base:
        res = base_result(samples, base, eff)
    else:
        res = fit_attention_scales(fit(samples, eff.compute, eff.memory, eff.launch_s,
                                       default_lookup_id_s=base.lookup_id_latency_s if base is not None else None))
    rel = res.rel_errors()
    # the host's cost per priced launch differs between eager steps and steps that replay the dense arch as CUDA
    # graphs (a few dozen priced launches, mostly the loop's and TorchRec's Python): fitted apart
    graphed_runs: list[RunSamples] = []
    eager_runs: list[RunSamples] = []
    for r in runs:
        (graphed_runs if ran_graphed(r) else eager_runs).append(r)
    host_fit = fit_host_launch_cost(eager_runs or runs, res, per_sample=True, host_speed=host_speed,
                                    fit_device_factor=True, device_term=device_term) if host else None
    graph_fit = (fit_host_launch_cost(graphed_runs, res, per_sample=False, host_speed=host_speed, fit_device_factor=True,
                                      device_term=device_term)
                 if host and graphed_runs and eager_runs else None)
    profiles = [r.host for r in runs if r.host is not None and r.host.op_median_us]
    if host_fit and host_fit.host_reference_us:
        host_ref = host_fit.host_reference_us
    else:
        host_ref = host_reference_us(profiles) if host and profiles else {}
    h = host_fit.h_s if host_fit else 0.0
    h_graphed = graph_fit.h_s if graph_fit else (h if host_fit and not eager_runs else 0.0)
    if host_fit and not eager_runs:
        # graphed runs alone: the eager host cost is not identified by them (the base's stays, if any)
        h = (base.host_launch_s or 0.0) if base is not None else 0.0
    if host_fit and h <= 0 and base is not None and base.host_launch_s and not host_fit.host_bound().any():
        # the eager runs do not identify the eager host cost (none is host-bound): the base's stays
        h = base.host_launch_s
    hs = host_fit.sample_s if host_fit else 0.0
    f = host_fit.device_factor if host_fit else 1.0
    g = host_fit.device_gap_s if host_fit else 0.0
    f_note = ""
    if graph_fit is not None and len(graphed_runs) > len(eager_runs):
        # the device term is the device's: fitted on the larger of the two groups of runs
        f_note = (f"the device term is the graphed runs' ({_device_term(graph_fit.device_factor, graph_fit.device_gap_s)}, "
                  f"{len(graphed_runs)} runs; the eager runs' alone: {_device_term(f, g)}); ")
        f, g = graph_fit.device_factor, graph_fit.device_gap_s
    h_note = (f"eager host cost kept from {base_name} ({h * 1e6:.1f} us per priced launch: no eager run is host-bound); "
              if host_fit and base is not None and h == base.host_launch_s and h > 0 and host_fit.h_s <= 0 else "")
    op_classes: dict[ComputeOpClass, OpClassCalibration] = {}
    for c in CLASSES:
        ce = {dt: min(1.0, v) for (cc, dt), v in res.compute.items() if cc == c}
        me = res.memory.get(c)
        la = res.launch_s.get(c)
        if ce or me is not None or la is not None:
            op_classes[c] = OpClassCalibration(
                compute_efficiency=ce, memory_efficiency=None if me is None else min(1.0, me), launch_overhead_s=la
            )
    if base is not None:  # the base's classes where these runs fit none (all of them when its terms are kept)
        op_classes = dict(base.op_classes) if keep_base else {**base.op_classes, **op_classes}
    loader = fit_loader_scale(runs)

    def kept(name: str, fitted):
        """A device term: the base's when its terms are kept whole, else the fitted one, else the base's (if any)."""
        if base is None:
            return fitted
        return getattr(base, name) if keep_base or fitted is None else fitted
    n_host = sum(x is not None for x in host_fit.host_measured) if host_fit else 0  # runs fitted on their host time
    versions = dict(runs[0].result.versions) if runs[0].result else {}
    versions.setdefault("coplan", __version__)
    trainer, trainer_source = fingerprint.of_runs([dict(r.result.versions) if r.result else {} for r in runs])
    versions.pop(fingerprint.KEY, None)
    versions.pop(fingerprint.SCHEME_KEY, None)
    if trainer:
        versions[fingerprint.KEY] = trainer
        versions[fingerprint.SCHEME_KEY] = fingerprint.SCHEME
    versions[fingerprint.SOURCE_KEY] = trainer_source
    cal = Calibration(
        device=devices[0],
        created_utc=datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        versions=versions,
        source_runs=tuple(str(d) for d in run_dirs),
        op_classes=op_classes,
        attention_scales=res.attention_scales,
        host_launch_s=min(1.0, h) if h > 0 else None,
        host_launch_graphed_s=min(1.0, h_graphed) if h_graphed > 0 else None,
        host_sample_s=min(1.0, hs) if hs > 0 else None,
        device_step_factor=f if host_fit and not g else None,
        device_gap_s=g if host_fit and g else None,
        host_op_median_us=host_ref,
        lookup_id_latency_s=kept("lookup_id_latency_s", res.lookup_id_s),
        unfused_memory_efficiency=kept("unfused_memory_efficiency", unfused_memory(res)),
        unfused_kernel_s=kept("unfused_kernel_s", res.launch_s.get(UNFUSED_CLASS)),
        loader_scale=loader[0] if loader else None,
        fit_error=FitError(
            median_abs_rel_error=float(np.median(rel)),
            max_abs_rel_error=float(np.max(rel)),
            per_op_class=res.per_class_error(),
            num_samples=len(samples),
        ),
        notes=(
            (f"on top of {base_name} ({base.device}, {base.created_utc or 'undated'}): " + (
                f"its device terms kept whole, since the runs' traces attribute only {worst:.1%} of their device time "
                f"(worst run; under {MIN_ATTRIBUTED_SHARE:.0%}); " if keep_base else
                "its device terms the fit's starting point, and kept for the op classes these runs do not measure; ")
             if base is not None else "")
            + (f"fitted {len(samples)} (op, phase) samples from {len(runs)} run(s) of rank {rank}; " if not keep_base else
               f"{len(runs)} run(s) of rank {rank}; ")
            + f"trace time attributed: {worst:.1%} (worst run); "
            + (_graphed_note(h, h_graphed, graph_fit, len(graphed_runs), len(eager_runs), base is not None) if host_fit else "")
            + (f"host cost {host_fit.h_s * 1e6:.2f} us per priced launch and {hs * 1e6:.1f} us per local sample "
               f"(host_sample_s), and {_device_term(f, g)} (device work the ops do not price: the form, a share of the device "
               f"step or a time per priced launch, whose fit to the steps is closer), "
               f"fitted to {len(host_fit.runs)} measured step time(s) (step = max(factor x device step, launches x "
               f"host cost + samples x per-sample host cost): host and device run concurrently; "
               + (f"{n_host} of those runs' own measured host times (summary.json host_step) fitted beside their "
                  "steps; " if n_host else "")
               + ("no fitted run is host-bound under the fit, so the host costs are not identified by these runs (the "
                  "smallest that fits is kept); " if not host_fit.host_bound().any() and not n_host else "")
               + f"step-time error on those runs: median {host_fit.median_abs_error:.1%}, max {host_fit.max_abs_error:.1%}; "
               f"fit_error is of device time, without it); "
               + (f"each run's host time scaled by its host's speed (index {min(host_fit.speed):.2f}-{max(host_fit.speed):.2f} "
                  "against the runs' mean, host_op_median_us); " if host_fit.speed else "")
               if host_fit else ("no host cost fitted (no measured step times); " if host else ""))
            + f_note + h_note
            + (f"data loader x{loader[0]:.3g} the default coefficients (median over {len(loader[1])} run(s) of a reader "
               f"process's measured seconds per step over the priced: {', '.join(f'{x:.2f}' for x in loader[1])}); "
               if loader else "data loader left at the default coefficients (no run recorded its loader); ")
            + "collective efficiencies left at the topology's values (no multi-GPU communication measured)"
            + "".join(f"; run {r.run}: {n}" for r in runs for n in r.notes)
        ),
    )
    return cal, res, runs


def fit_loader_scale(runs: Sequence[RunSamples]) -> tuple[float, list[float]] | None:
    """The data loader's measured time over its priced time (``coplan.costmodel.loader``, default coefficients):
    the median over the runs whose summary records the loader, each the seconds a reader process (or the data
    thread, without processes) spent reading one step, over the priced seconds for the run's workload, local
    batch, micro-batches and balance group (the plan's, else a node's ranks, as the trainer reads). None when no
    run recorded it."""
    ratios: list[float] = []
    for r in runs:
        ld = r.result.loader if r.result is not None else None
        if ld is None or ld.read_s_per_batch <= 0:
            continue
        plan = r.plan
        M = micro_batches_of(plan.workload, plan.mesh)
        measured = ld.read_s_per_batch * max(1, ld.processes) * M
        group = balance_group(plan.world_size, plan.topology.gpus_per_node, plan.balancing.group_ranks)
        priced = loader_step_s(plan.workload, local_batch_of(plan.workload, plan.world_size), M, group, 1).process_s
        if priced > 0:
            ratios.append(measured / priced)
    if not ratios:
        return None
    return float(min(100.0, max(1e-3, np.median(ratios)))), ratios


__all__ = ["MIN_ATTRIBUTED_SHARE", "base_result", "calibrate", "fit_loader_scale"]
