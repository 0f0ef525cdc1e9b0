"""Where every FLOP goes: the wall time of one step, split into useful model FLOPs at peak and a list
of losses that add up to it exactly. The MFU waterfall draws this; the summary names its biggest item.

Accounting (all per optimizer step, on the critical rank, from the cost model's
:class:`~coplan.spec.Prediction`):

- ``W = step / goodput`` is the wall time one step really costs once checkpoint writes and failures
  are paid for; 100% of peak means ``W × GPUs × dense peak`` FLOPs.
- ``T0 = model FLOPs / (GPUs × dense peak)`` is the time the step would take at peak: the useful part.
  ``T0 / W`` is the goodput MFU, ``T0 / step`` the E2E MFU. ``T0`` is split over op classes by each
  class's share of model FLOPs (:func:`coplan.costmodel.flops.op_flops`).
- Kernel efficiency of class ``c``: the critical rank's forward + backward time of ``c``'s ops, less
  ``c``'s share of ``T0``, less ``c``'s share of the jagged imbalance. It holds everything that makes a
  kernel slower than peak on model FLOPs: achieved fraction of peak, memory-bound ops, launch overhead,
  hardware FLOPs that are not model FLOPs (a fused attention backward recomputes the scores), the
  slowest embedding shard's excess over the mean, the slowdown from communication sharing the SMs.
- Kernel launch overhead (when the cost model's StepCost is given): its per-kernel launch term
  of the dense forward and backward ops, taken out of the class bars. There is no pipeline parallelism
  in these plans, so the only other gaps in the compute stream are waits on communication (below).
- Jagged load imbalance: the cost model's ``imbalance_s`` (the slowest rank's extra dense work),
  spread back over the classes in proportion to their dense time so the class bars do not count it twice.
- Recompute and the dense optimizer step: their op times.
- Exposed communication: each collective's exposed time (the part compute waited for), grouped by
  what it is (FSDP all-gather, embedding all-to-all...) and the tiers its group crosses.
- Checkpointing: ``step · δ/τ`` (each interval ``τ`` of work pays a write ``δ``); failures: the rest of
  ``W − step``. Split with :func:`coplan.costmodel.goodput.useful_fraction` at zero failures.
- Host-bound and data ingestion: when the host's time (a calibration's host costs) or the data loader's sets
  the step, the device idles for the difference (``Prediction.device_s``, ``host_s``, ``loader_s``).
- Other / unattributed: whatever of the step the items above do not explain (compute the cost model
  does not itemise per op). It is shown, never folded into another bar.

The bars therefore sum to ``W − T0`` to rounding, and ``100% − Σ losses`` is the goodput MFU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from coplan.costmodel import StepCost
from coplan.costmodel import flops as F
from coplan.costmodel.goodput import useful_fraction
from coplan.spec import Plan, Prediction

COMPUTE_CLASSES = ("gemm", "attention", "embedding", "elementwise")

COMM_LABELS: dict[str, str] = {
    "fsdp_all_gather": "FSDP all-gather",
    "fsdp_reduce_scatter": "FSDP reduce-scatter",
    "replicate_all_reduce": "HSDP replica all-reduce",
    "expert_all_gather": "expert FSDP all-gather",
    "expert_reduce_scatter": "expert FSDP reduce-scatter",
    "expert_replicate_all_reduce": "expert replica all-reduce",
    "ep_dispatch": "MoE dispatch all-to-all",
    "ep_combine": "MoE combine all-to-all",
    "ep_recompute": "MoE all-to-all (recompute)",
    "sparse.all_to_all_fwd": "embedding all-to-all (fwd)",
    "sparse.all_to_all_bwd": "embedding all-to-all (bwd)",
    "sparse.ids_all_to_all": "embedding id all-to-all",
    "sparse.dp_all_reduce": "data-parallel tables all-reduce",
    "sparse.replica_sync": "sparse replica sync",
}
"""Readable names of the cost model's collectives (the key is the name without its layer prefix)."""


@dataclass(frozen=True, slots=True)
class Loss:
    """One bar of the waterfall."""

    key: str
    """Stable id, e.g. ``kernel.gemm``, ``comm.fsdp_all_gather.nvlink+rack``, ``imbalance``."""
    label: str
    """What the reader sees."""
    kind: str
    """Palette family: ``op_class``, ``collective`` or ``loss``."""
    colour_key: str
    """Key within the family (``gemm``, ``all_to_all``, ``recompute``...)."""
    seconds: float
    """Time lost per step (may be negative: a gain, e.g. fp8 GEMMs beating the bf16 peak)."""
    detail: str = ""
    """Hover text: how the number was computed, with the parts that went in."""


@dataclass(frozen=True, slots=True)
class Ledger:
    """Wall time of one step split into the useful part and the losses."""

    world_size: int
    peak_flops_per_s: float
    """Dense (bf16) peak of one GPU: MFU's denominator."""
    model_flops: float
    """Model FLOPs of one step over all ranks."""
    step_time_s: float
    wall_step_s: float
    """``step / goodput``."""
    useful_s: float
    """``T0``: model FLOPs at peak."""
    losses: tuple[Loss, ...]
    e2e_mfu: float
    goodput_mfu: float
    checks: tuple[str, ...] = field(default_factory=tuple)
    """Differences found against the prediction's own figures (empty when everything reconciles)."""

    def points(self, seconds: float) -> float:
        """Seconds per step → MFU percentage points."""
        return 100.0 * seconds / self.wall_step_s if self.wall_step_s > 0 else 0.0

    @property
    def final_points(self) -> float:
        return self.points(self.useful_s)

    @property
    def residual_points(self) -> float:
        """100 − Σ losses − final, to float rounding (the tests hold it at ~0)."""
        return 100.0 - sum(self.points(x.seconds) for x in self.losses) - self.final_points

    def biggest(self) -> Loss | None:
        items = [x for x in self.losses if x.key != "other"]
        return max(items, key=lambda x: x.seconds) if items else None


def _comm_base(name: str) -> str:
    """``interformer.3.fsdp_all_gather`` → ``fsdp_all_gather``; ``sparse.x`` keeps its prefix."""
    parts = name.split(".")
    if len(parts) >= 3 and parts[1].isdigit():
        return parts[-1]
    return name


def comm_label(name: str) -> str:
    base = _comm_base(name)
    return COMM_LABELS.get(base, base.replace("_", " "))


def class_flop_shares(plan: Plan) -> dict[str, float]:
    """Share of model FLOPs per op class (the one FLOP formula, expected lengths)."""
    w = plan.workload
    cls = {op.name: op.op_class for op in F.workload_ops(w)}
    per = F.op_flops(w, batch_size=max(1, w.batch.global_(plan.world_size)))
    tot: dict[str, float] = {c: 0.0 for c in COMPUTE_CLASSES}
    for name, fc in per.items():
        tot[cls[name]] = tot.get(cls[name], 0.0) + fc.total
    s = sum(tot.values())
    return {c: (v / s if s > 0 else 0.0) for c, v in tot.items()}


def checkpoint_fraction(pred: Prediction) -> float:
    """Useful fraction with checkpoint writes but no failures (the cost model's formula at MTBF = ∞)."""
    tau, delta = pred.checkpoint_interval_s, pred.checkpoint_write_s
    if tau <= 0 or delta <= 0:
        return 1.0
    return useful_fraction(tau, delta, 0.0, math.inf)


def launch_by_class(cost: StepCost) -> dict[str, float]:
    """Seconds per step of kernel-launch overhead in the critical rank's dense forward and backward ops,
    per op class: the cost model's own launch term (:attr:`~coplan.costmodel.results.StepCost.launch_s`,
    priced with ``detail``). Recompute launches stay in the recompute bar; the lookups' launches stay in
    the embedding bar (the pricer folds them into the slowest shard's time). Empty when ``cost`` was
    priced without detail."""
    return dict(cost.launch_s)


def build_ledger(plan: Plan, pred: Prediction, *, launch_s: dict[str, float] | None = None) -> Ledger:
    """The step's ledger from a plan and its prediction (see the module docstring). With ``launch_s``
    (:func:`launch_by_class`), kernel-launch overhead becomes its own bar, taken out of the class bars."""
    N = plan.world_size
    peak = plan.topology.dense_peak_flops_per_s
    step = pred.step_time_s
    g = pred.goodput if pred.goodput > 0 else 1.0
    W = step / g
    T0 = pred.model_flops_per_step / (N * peak) if N and peak else 0.0
    checks: list[str] = []
    if step > 0 and pred.e2e_mfu > 0 and abs(T0 / step - pred.e2e_mfu) > 1e-6 * max(1.0, pred.e2e_mfu):
        checks.append(f"model FLOPs at peak / step = {T0 / step:.6f} but the prediction's E2E MFU is {pred.e2e_mfu:.6f}")
    ct = _ClassTimes.of(pred)
    losses = _compute_losses(plan, pred, ct, T0, launch_s)
    comm, exposed_sum = _comm_losses(pred)
    losses += comm
    losses += _host_losses(pred)
    if pred.comms and abs(exposed_sum - pred.exposed_comm_s) > 1e-9 + 1e-6 * pred.exposed_comm_s:
        checks.append(f"per-collective exposed times sum to {exposed_sum:.6g} s, the prediction says {pred.exposed_comm_s:.6g} s")

    # unattributed: whatever of the step the items above do not explain
    explained = T0 + sum(x.seconds for x in losses)
    other = step - explained
    compute_items = sum(ct.total.values()) + sum(ct.recompute.values()) + ct.optimizer
    losses.append(Loss(
        "other", "other / unattributed", "loss", "other", other,
        f"step {_ms(step)} − model FLOPs at peak − the bars above<br>"
        f"compute not itemised per op: {_ms(pred.compute_s - compute_items)}; "
        f"exposed communication not itemised: {_ms(pred.exposed_comm_s - exposed_sum) if pred.comms else _ms(pred.exposed_comm_s)}",
    ))
    losses += _goodput_losses(pred, W, g, N)
    return Ledger(N, peak, pred.model_flops_per_step, step, W, T0, tuple(losses), pred.e2e_mfu, pred.goodput_mfu or pred.e2e_mfu * g, tuple(checks))


@dataclass(slots=True)
class _ClassTimes:
    """The critical rank's op times per class: forward + backward, of them the dense ops' (the jagged
    imbalance is spread over those), recompute; and the dense optimizer step."""

    total: dict[str, float]
    dense: dict[str, float]
    recompute: dict[str, float]
    optimizer: float = 0.0

    @classmethod
    def of(cls, pred: Prediction) -> "_ClassTimes":
        ct = cls({c: 0.0 for c in COMPUTE_CLASSES}, {c: 0.0 for c in COMPUTE_CLASSES}, {c: 0.0 for c in COMPUTE_CLASSES})
        for o in pred.ops:
            c = o.op_class if o.op_class in ct.total else "elementwise"
            if o.phase in ("fwd", "bwd"):
                ct.total[c] += o.time_s
                if not o.name.startswith("sparse."):
                    ct.dense[c] += o.time_s
            elif o.phase == "recompute":
                ct.recompute[c] += o.time_s
            else:
                ct.optimizer += o.time_s
        return ct


def _compute_losses(plan: Plan, pred: Prediction, ct: _ClassTimes, T0: float, launch_s: dict[str, float] | None) -> list[Loss]:
    """Kernel bars per class (less their share of the imbalance and their launches), then launch overhead,
    jagged imbalance, recompute, unpriced device work and the optimizer step."""
    shares = class_flop_shares(plan)
    t_cls, dense_cls = ct.total, ct.dense
    dense_tot = sum(dense_cls.values())
    imb = pred.imbalance_s
    losses: list[Loss] = []
    launch = {c: (launch_s or {}).get(c, 0.0) for c in COMPUTE_CLASSES}
    for c in COMPUTE_CLASSES:
        if t_cls[c] <= 0 and shares.get(c, 0.0) <= 0:
            continue
        ideal = T0 * shares.get(c, 0.0)
        imb_c = imb * dense_cls[c] / dense_tot if dense_tot > 0 else 0.0
        loss = t_cls[c] - ideal - imb_c - launch[c]
        achieved = ideal / (t_cls[c] - imb_c) if t_cls[c] - imb_c > 0 else 0.0
        losses.append(Loss(
            f"kernel.{c}", f"{c} kernels below peak", "op_class", c, loss,
            f"{c} ops, forward + backward on the critical rank: {_ms(t_cls[c])}<br>"
            f"of which jagged imbalance (shown separately): {_ms(imb_c)}"
            + (f"; launch overhead (shown separately): {_ms(launch[c])}" if launch[c] else "") + "<br>"
            f"model FLOPs of {c} at peak: {_ms(ideal)} ({100 * shares.get(c, 0.0):.1f}% of model FLOPs)<br>"
            f"achieved {100 * achieved:.1f}% of peak on model FLOPs (launches included)",
        ))
    if launch_s:
        tot = sum(launch.values())
        parts = ", ".join(f"{c} {_ms(v)}" for c, v in launch.items() if v > 0)
        losses.append(Loss("launch", "kernel launch overhead", "loss", "launch", tot,
                           f"the cost model's per-kernel launch cost over the dense forward and backward kernels: {parts}"))
    if imb > 0 or pred.imbalance > 1.0:
        losses.append(Loss(
            "imbalance", "jagged load imbalance", "loss", "imbalance", imb,
            f"slowest rank's dense work is {pred.imbalance:.4f}× the mean under '{plan.balancing.policy}' balancing",
        ))
    rc = sum(ct.recompute.values())
    if rc > 0:
        parts = ", ".join(f"{c} {_ms(v)}" for c, v in ct.recompute.items() if v > 0)
        n = sum(1 for lp in plan.layers if lp.recompute)
        losses.append(Loss("recompute", "activation recompute", "loss", "recompute", rc, f"{n} layers recomputed in backward: {parts}"))
    if pred.unpriced_device_s > 0:
        losses.append(Loss("unpriced_device", "device work no op prices (calibrated)", "loss", "unpriced_device",
                           pred.unpriced_device_s,
                           "the calibration's device-step factor: measured device-bound steps over the device time "
                           "the cost model's ops add up to (small kernels of the optimizer and the allocator, copies, "
                           "gaps between dependent kernels)"))
    if ct.optimizer > 0:
        losses.append(Loss("optimizer", "dense optimizer step", "loss", "optimizer", ct.optimizer,
                           f"{plan.workload.optimizer.dense} step over this rank's shard of the dense parameters"))
    return losses


def _host_losses(pred: Prediction) -> list[Loss]:
    """When the host or the data loader sets the step (``pred.device_s`` > 0: the device's step is shorter),
    the time the device idles for them: the host's excess over the device, then the loader's over both."""
    dev = pred.device_s
    if dev <= 0:
        return []
    step = pred.step_time_s
    host = max(0.0, min(step, pred.host_s) - dev)
    loader = max(0.0, step - max(dev, pred.host_s))
    out: list[Loss] = []
    if host > 0:
        out.append(Loss("host", "host-bound: the device waits for the host", "loss", "host", host,
                        f"the host's time per step {_ms(pred.host_s)} (kernel launches and per-sample work at the "
                        f"calibration's host costs) against the device's {_ms(dev)}"))
    if loader > 0:
        out.append(Loss("loader", "data ingestion: the step waits for the loader", "loss", "loader", loader,
                        f"the data loader's {_ms(pred.loader_s)} per step (its reader processes decoding and gathering "
                        f"the batch) against the device's {_ms(dev)}" + (f" and the host's {_ms(pred.host_s)}" if pred.host_s else "")))
    return out


def _comm_losses(pred: Prediction) -> tuple[list[Loss], float]:
    """Exposed communication, grouped by what it is and the tiers it crosses, largest first; and the sum
    of every collective's exposed time."""
    groups: dict[tuple[str, str, str], list] = {}
    for cp in pred.comms:
        base = _comm_base(cp.name)
        tiers = "+".join(cp.tiers) or "-"
        k = (base, cp.collective, tiers)
        acc = groups.setdefault(k, [0.0, 0.0, 0, 0.0, cp.group_size])
        acc[0] += cp.exposed_s
        acc[1] += cp.time_s
        acc[2] += cp.calls
        acc[3] += cp.bytes * cp.calls
    losses: list[Loss] = []
    for (base, coll, tiers), (exp, tot, calls, nbytes, gsize) in sorted(groups.items(), key=lambda kv: -kv[1][0]):
        if exp <= 0:
            continue
        label = f"{COMM_LABELS.get(base, base.replace('_', ' '))} exposed ({tiers})"
        losses.append(Loss(
            f"comm.{base}.{tiers}", label, "collective", coll, exp,
            f"{coll} over groups of {gsize:,} ranks crossing {tiers.replace('+', ', ')}<br>"
            f"{calls} call(s), {_bytes(nbytes)} per rank in all; {_ms(tot)} in all, {_ms(exp)} not hidden by compute "
            f"({100 * exp / tot:.0f}%)" if tot > 0 else "",
        ))
    return losses, sum(cp.exposed_s for cp in pred.comms)


def _goodput_losses(pred: Prediction, W: float, g: float, ranks: int = 1) -> list[Loss]:
    """Stragglers and jitter (the step stretched by its slowest rank), checkpoint writes, then failures: the
    rest of ``W − step``."""
    step = pred.step_time_s
    jit = step * pred.step_jitter
    fc = checkpoint_fraction(pred)
    ckpt = (step + jit) * (1.0 / fc - 1.0) if fc > 0 else 0.0
    fail = W - step - jit - ckpt
    losses: list[Loss] = []
    if jit > 0:
        losses.append(Loss(
            "jitter", "stragglers and jitter", "loss", "jitter", jit,
            f"the slowest of {ranks:,} ranks ends each synchronous step: +{100 * pred.step_jitter:.2f}% "
            f"(a rank's step varies by {100 * _cv(pred, ranks):.1f}% (CV); expected maximum of {ranks:,} normals)",
        ))
    if ckpt > 0:
        losses.append(Loss(
            "checkpoint", "checkpoint writes", "loss", "checkpoint", ckpt,
            f"a {_s(pred.checkpoint_write_s)} blocking write every {_s(pred.checkpoint_interval_s)} of work (Daly's optimum)",
        ))
    if fail > 1e-15 or fail < -1e-12:
        losses.append(Loss(
            "failures", "failures: lost work + restarts", "loss", "failures", fail,
            f"expected work lost since the last checkpoint plus restart time; goodput {100 * g:.3f}% in all",
        ))
    return losses


def _cv(pred: Prediction, ranks: int) -> float:
    from coplan.costmodel.goodput import expected_max_normal

    z = expected_max_normal(ranks)
    return pred.step_jitter / z if z > 0 else 0.0


def _ms(s: float) -> str:
    return f"{s * 1e3:.4g} ms"


def _s(s: float) -> str:
    return f"{s:.4g} s" if s >= 1 else _ms(s)


def _bytes(n: float) -> str:
    for unit, size in (("TiB", 1024.0**4), ("GiB", 1024.0**3), ("MiB", 1024.0**2), ("KiB", 1024.0)):
        if n >= size:
            return f"{n / size:.4g} {unit}"
    return f"{n:.0f} B"


__all__ = ["COMM_LABELS", "Ledger", "Loss", "build_ledger", "launch_by_class", "checkpoint_fraction", "class_flop_shares", "comm_label"]
