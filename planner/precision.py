"""Per-layer GEMM precision (bf16 or fp8): a post-pass after the mesh, sharding and recompute solve.

Why a post-pass and not a CP-SAT variable: in this recipe fp8 changes no memory the plan holds
(master weights, gradients and optimizer state keep their dtypes, FSDP gathers the compute dtype,
and the cost model keeps the saved activations in the compute dtype), so precision never decides
whether a plan fits; and a layer's precision changes only that layer's compute time. Given the
solved plan, the best precision of each layer is therefore chosen layer by layer, by comparing the
cost model's time of the layer (forward + backward, + forward again when recomputed) with its GEMMs
in bf16 and in fp8, quantisation passes included. The one interaction left out is second-order:
a faster layer could make a different recompute set marginally cheaper. Under ``blockwise-fused`` the
fp8 time of an InterFormer or Kunlun layer is that of its fused FFN (the pricer's, through
:func:`coplan.costmodel.fp8.fused_ffn_layers`), so the choice weighs the fused chain; the report's line
names the layers whose FFN runs fused and each fp8 layer's predicted change in compute.

Modes (the workload's ``precision.fp8``): ``off`` leaves every layer in bf16 and writes no report;
``auto`` puts a layer in fp8 where its predicted time falls, with the numerics guard (GEMMs with a
dimension under ``fp8_min_dim`` and the task heads stay in the compute dtype); ``force`` puts every
layer with an fp8-capable GEMM in fp8, guard off. The step is then re-priced with the full pricer
for the report's predicted gain (communication overlap can hide part of a compute gain).
"""

from __future__ import annotations

from typing import Sequence

from coplan.costmodel import price
from coplan.costmodel.context import Context
from coplan.costmodel.decomposed import layer_costs
from coplan.costmodel.flops import workload_ops
from coplan.costmodel.fp8 import fp8_allowed, fp8_capable, fp8_guard, fused_ffn_layers
from coplan.spec.plan import BalancingPlan, LayerPlan, LayerPrecisionChoice, PrecisionReport, TableShard
from coplan.spec.workload import Kernels, Workload

MIN_GAIN = 1e-3
"""A layer goes to fp8 under ``auto`` only when its predicted time falls by more than this fraction:
a gain inside the cost model's rounding is not worth a numerics risk."""


def _layer_status(ctx: Context) -> dict[str, tuple[int, int, str | None]]:
    """Per layer: (fp8-capable GEMM ops, ops allowed in fp8, the first guard reason met)."""
    w = ctx.workload
    out: dict[str, list] = {n: [0, 0, None] for n in ctx.layer_names}
    for i in ctx.dense_idx:
        o = ctx.ops[int(i)]
        if not fp8_capable(o, w):
            continue
        s = out[o.layer]
        s[0] += 1
        if fp8_allowed(o, w):
            s[1] += 1
        elif s[2] is None:
            s[2] = fp8_guard(o, w)
    return {k: (v[0], v[1], v[2]) for k, v in out.items()}


def choose_layer_precision(
    ctx: Context,
    layers: Sequence[LayerPlan],
    *,
    tables: Sequence[TableShard] | None = None,
    balancing: BalancingPlan | None = None,
    kernels: Kernels | None = None,
) -> tuple[tuple[LayerPlan, ...], PrecisionReport | None]:
    """The layers with their precision set, and the report (None when the workload's fp8 is 'off')."""
    w = ctx.workload
    mode = w.precision.fp8
    balancing = balancing or BalancingPlan()
    if mode == "off":
        return tuple(lp.model_copy(update={"precision": "bf16"}) for lp in layers), None
    by_name = {lp.name: lp for lp in layers}
    costs = {c.name: c for c in layer_costs(ctx, policy=balancing.policy, kernels=kernels)}
    status = _layer_status(ctx)
    choices: list[LayerPrecisionChoice] = []
    new_layers: list[LayerPlan] = []
    for name in ctx.layer_names:
        lp = by_name.get(name, LayerPlan(name=name))
        c = costs[name]
        rc = lp.recompute
        t16 = c.fwd_s + c.bwd_s + (c.fwd_s if rc else 0.0)
        t8 = c.fp8_fwd_s + c.fp8_bwd_s + (c.fp8_fwd_s if rc else 0.0)
        capable, allowed, guard = status[name]
        if capable == 0:
            prec, reason = "bf16", "no fp8 GEMM"
        elif allowed == 0:
            prec, reason = "bf16", guard or "guard"
        elif mode == "force":
            prec, reason = "fp8", "forced"
        elif t8 < t16 * (1.0 - MIN_GAIN):
            prec, reason = "fp8", "pays"
        else:
            prec, reason = "bf16", "slower in fp8"
        choices.append(LayerPrecisionChoice(name=name, precision=prec, bf16_s=t16, fp8_s=t8 if allowed else t16, reason=reason))
        new_layers.append(lp.model_copy(update={"precision": prec}))
    bf16_layers = tuple(lp.model_copy(update={"precision": "bf16"}) for lp in new_layers)
    base = price(ctx, tables, bf16_layers, balancing, kernels, detail=False).step_time_s
    chosen = price(ctx, tables, new_layers, balancing, kernels, detail=False).step_time_s if any(
        lp.precision == "fp8" for lp in new_layers) else base
    report = PrecisionReport(mode=mode, recipe=w.precision.fp8_recipe, layers=tuple(choices), bf16_step_time_s=base,
                             step_time_s=chosen)
    return tuple(new_layers), report


def fused_ffn_of(report: PrecisionReport | None, workload: Workload) -> tuple[str, ...]:
    """The report's fp8 layers whose FFN the ``blockwise-fused`` recipe runs fused (none for another recipe)."""
    if report is None or report.recipe != "blockwise-fused":
        return ()
    fused = fused_ffn_layers(workload_ops(workload), workload, report.fp8_layers)
    return tuple(n for n in report.fp8_layers if n in fused)


def precision_line(report: PrecisionReport | None, workload: Workload | None = None) -> str | None:
    """One line for the plan summary and the prediction's notes: the fp8 layers, each with its predicted
    change in compute per step (fp8 − bf16, recompute included; communication overlap can hide part of
    it, the step figures after it are the re-priced ones), and, given the ``workload`` under
    ``blockwise-fused``, which of them run their FFN fused."""
    if report is None:
        return None
    fp8 = report.fp8_layers
    n = len(report.layers)
    by = {c.name: c for c in report.layers}
    fused = set(fused_ffn_of(report, workload)) if workload is not None else set()
    names = ", ".join(f"{x}{' (FFN fused)' if x in fused else ''} {(by[x].fp8_s - by[x].bf16_s) * 1e3:+,.3f} ms"
                      for x in fp8[:6]) + (", ..." if len(fp8) > 6 else "")
    kept = sorted({c.reason for c in report.layers if c.precision == "bf16"})
    head = f"fp8 ({report.mode}, {report.recipe}): {len(fp8)} of {n} layers" + (
        f" (layer compute per step, fp8 - bf16: {names})" if fp8 else "")
    if fp8 and workload is not None and report.recipe == "blockwise-fused":
        head += f"; FFN fused in {len(fused)} of them"
    gain = report.bf16_step_time_s - report.step_time_s
    tail = (f"; predicted step {report.step_time_s * 1e3:,.3f} ms vs {report.bf16_step_time_s * 1e3:,.3f} ms all-bf16 "
            f"({'-' if gain >= 0 else '+'}{abs(report.gain):.1%})")
    return head + tail + (f"; bf16 kept: {', '.join(kept)}" if kept else "")


__all__ = ["MIN_GAIN", "choose_layer_precision", "fused_ffn_of", "precision_line"]
