"""The pricer's step for a run's plan under a calibration, at the run's measured lengths and bag layout:
what a measured step time is compared with, and the device fit alone as a Calibration (for reading
off the launches the pricer charges per step)."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from coplan.calibration.device_fit import FitResult
from coplan.calibration.terms import CLASSES, apply_moments, context_options
from coplan.costmodel.context import build_context
from coplan.costmodel.efficiency import UNFUSED_CLASS, resolve_efficiencies
from coplan.costmodel.flops import dense_graphs_apply
from coplan.costmodel.pricer import price
from coplan.costmodel.results import StepCost
from coplan.spec import Calibration, OpClassCalibration, Plan
from coplan.spec.calibration import ComputeOpClass


def priced_step(plan: Plan, calibration: Calibration | None, moments, seq_chunk: int | None, *,
                segments: bool = False) -> StepCost:
    """The pricer's StepCost of ``plan`` under ``calibration`` at the given length moments and bag layout.
    The padded reference's attention ops carry their own dtype key
    (:data:`coplan.calibration.terms.REFERENCE_ATTENTION_DTYPE`), so the pricer reads their fitted
    efficiency directly: nothing is remapped."""
    ctx = build_context(plan.workload, plan.topology, plan.mesh, calibration, options=context_options(seq_chunk),
                        force_calibration=True)
    apply_moments(ctx, moments)
    return price(ctx, plan.tables or None, plan.layers, plan.balancing, plan.kernels, detail=False, segments=segments)


def graphed_plan(plan: Plan) -> bool:
    """Whether the trainer replays ``plan``'s dense arch as CUDA graphs (as the pricer reads it)."""
    return dense_graphs_apply(plan.workload, plan.world_size) and not any(lp.precision == "fp8" for lp in plan.layers)


def _price_step(plan: Plan, calibration: Calibration | None, moments, seq_chunk: int | None) -> float:
    return float(priced_step(plan, calibration, moments, seq_chunk).step_time_s)


def predict_step_time(plan: Plan, calibration: Calibration | None = None,
                      moments: dict[str, tuple[float, float]] | None = None, *, seq_chunk: int | None = None) -> float:
    """The pricer's step time for ``plan`` (as ``coplan plan`` prices it), under ``calibration`` (None:
    the topology's defaults) and, when given, the measured length moments of the steps it is compared
    with and the ids per bag of its sequence lookups (None: the cost model's default,
    :attr:`coplan.costmodel.context.Options.seq_chunk`). A calibration from another GPU is used as given.

    With a per-sample host cost (``host_sample_s``) the step is max(device step, priced launches ×
    ``host_launch_s`` + local samples × ``host_sample_s``): read off the pricer's device step and its
    launch slope here, so the figure holds whether or not the pricer adds the per-sample term itself
    (:func:`coplan.costmodel.context.host_work_s`)."""
    step = _price_step(plan, calibration, moments, seq_chunk)
    if calibration is None or not calibration.host_sample_s or graphed_plan(plan):
        # (a graphed plan's host launches are not its device launches: the pricer's own host time stands)
        return step
    dev_cal = calibration.model_copy(update={"host_launch_s": None, "host_launch_graphed_s": None, "host_sample_s": None,
                                             "device_step_factor": None})
    # the launches the pricer charges: its step's slope in every class's launch cost (as step_launches)
    delta = 1e-6
    dflt = resolve_efficiencies(plan.topology, default_gap=False).launch_s
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


def device_calibration(plan: Plan, res: FitResult, extra_launch_s: float = 0.0) -> Calibration:
    """The device fit alone (no host cost) as a Calibration, every class's launch cost raised by ``extra_launch_s``
    (a kept base calibration, :attr:`FitResult.base`: its device terms as they are)."""
    cls: dict[ComputeOpClass, OpClassCalibration] = {}
    eff = resolve_efficiencies(plan.topology, default_gap=False)
    if res.base is not None:
        b = res.base
        for c in CLASSES:
            oc = b.op_classes.get(c)
            la = (oc.launch_overhead_s if oc is not None and oc.launch_overhead_s is not None else eff.launch_s.get(c, 0.0))
            cls[c] = (oc or OpClassCalibration()).model_copy(update={"launch_overhead_s": min(1.0, la + extra_launch_s)})
        un = b.unfused_kernel_s
        return b.model_copy(update={"op_classes": cls, "host_launch_s": None, "host_launch_graphed_s": None, "host_sample_s": None,
                                    "device_step_factor": None, "device_gap_s": None,
                                    "loader_scale": None,
                                    "unfused_kernel_s": None if un is None else min(1.0, un + extra_launch_s)})
    for c in CLASSES:
        ce = {dt: min(1.0, v) for (cc, dt), v in res.compute.items() if cc == c}
        me = res.memory.get(c)
        la = res.launch_s.get(c, eff.launch_s.get(c, 0.0)) + extra_launch_s
        cls[c] = OpClassCalibration(compute_efficiency=ce, memory_efficiency=None if me is None else min(1.0, me),
                                    launch_overhead_s=min(1.0, la))
    la_u = res.launch_s.get(UNFUSED_CLASS)
    return Calibration(device=plan.topology.gpu.name, op_classes=cls, attention_scales=res.attention_scales,
                       lookup_id_latency_s=res.lookup_id_s,
                       unfused_memory_efficiency=unfused_memory(res),
                       unfused_kernel_s=None if la_u is None else min(1.0, la_u + extra_launch_s))


def unfused_memory(res: FitResult) -> float | None:
    m = res.memory.get(UNFUSED_CLASS)
    return None if m is None else min(1.0, m)


def step_launches(plan: Plan, res: FitResult, moments: dict[str, tuple[float, float]] | None = None, *,
                  seq_chunk: int | None = None) -> tuple[float, float]:
    """(the pricer's step time under the device fit, launches per step it charges): the pricer is
    linear in the launch cost, so the second is its slope, read off numerically."""
    delta = 1e-6
    p0 = predict_step_time(plan, device_calibration(plan, res), moments, seq_chunk=seq_chunk)
    p1 = predict_step_time(plan, device_calibration(plan, res, delta), moments, seq_chunk=seq_chunk)
    return p0, max(0.0, (p1 - p0) / delta)


def step_segments(plan: Plan, res: FitResult, moments: dict[str, tuple[float, float]] | None = None, *,
                  seq_chunk: int | None = None, extra_launch_s: float = 0.0) -> tuple[tuple[float, float, float], ...]:
    """The pricer's step under the device fit alone (device-step factor 1, no device gap, no host cost), cut
    at the host's syncs with the device: per segment (host launches, of them exposed, device seconds)
    (:attr:`coplan.costmodel.results.StepCost.segments`); every class's launch cost raised by
    ``extra_launch_s`` (to read the device launches off the slope)."""
    return priced_step(plan, device_calibration(plan, res, extra_launch_s), moments, seq_chunk, segments=True).segments


def predict_median_step(plan: Plan, calibration: Calibration | None, steps: Sequence[dict[str, tuple[float, float]] | None], *,
                        seq_chunk: int | None = None) -> float:
    """The median over ``steps`` (length moments of each measured step) of :func:`predict_step_time`: what a
    run's p50 step is compared with. A step's price depends on its batch's lengths, and for the padded
    reference steeply (its longest length squared): the median of the prices is the p50's counterpart,
    the price of the pooled moments the mean's."""
    if not steps:
        steps = (None,)
    return float(np.median([predict_step_time(plan, calibration, mo, seq_chunk=seq_chunk) for mo in steps]))


__all__ = ["device_calibration", "graphed_plan", "predict_median_step", "predict_step_time", "priced_step", "step_launches", "step_segments",
           "unfused_memory"]
