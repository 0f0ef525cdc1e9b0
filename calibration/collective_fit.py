"""Fit a topology tier's latency and per-collective bus-bandwidth efficiency to a measured collective
sweep (``benchmarks/collectives_h200.py``, nccl-tests sizes), on the cost model's own alpha-beta form.

For a group placed inside one tier, :func:`coplan.costmodel.comm.collective_model` prices a
collective of nccl-tests size ``S`` as

    t(S) = b_k + c_k · α + S · u_k / e_k

where ``α`` is the tier's ``latency_s``, ``e_k`` its efficiency for collective ``k``, and ``b_k``,
``c_k``, ``u_k`` (fixed base latency and per-peer cost, number of latency hops, seconds per byte at
efficiency 1) follow from the placement. Rather than re-derive them, they are read off the cost model
itself (it is affine in ``α`` and in ``1/e_k`` on one tier), so the fit and the planner cannot
disagree on the form. ``α`` (shared by the kinds: the tier has one latency) and every ``e_k`` are
fitted together by ``scipy.optimize.least_squares`` on log-ratio residuals, so a 10 µs point counts
as much as a 10 ms one. Each kind's own best latency is also reported (the kinds' fixed costs differ
on real hardware; the topology schema holds one per tier).

Efficiencies are capped at 1 (the Calibration schema's range): a kind that would need more means the
topology's ``bw_bytes_per_s`` understates the tier, and the result says so.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
from scipy.optimize import least_squares

from coplan.costmodel.comm import bus_factor, collective_model, place_group
from coplan.costmodel.efficiency import resolve_efficiencies
from coplan.errors import CoplanError, SpecError
from coplan.spec import Calibration, FitError
from coplan.spec.loader import load_document
from coplan.spec.topology import Topology

FIT_KINDS: tuple[str, ...] = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")

EFF_FLOOR = 1e-6
"""Lower bound of a fitted efficiency (the schema wants > 0). Low on purpose: a gloo sweep on CPU
reaches ~1e-3 of the NVLink rate, and the fit should say so rather than hit a wall."""


class CollectiveFitError(CoplanError):
    """A sweep cannot be fitted (malformed, too few points, or a group that does not sit in one tier)."""


@dataclass(frozen=True, slots=True)
class SweepPoint:
    """One measured (collective, size) of a sweep."""

    kind: str
    dtype: str
    nbytes: float
    """nccl-tests size S."""
    time_s: float
    """Mean time of one call on the slowest rank."""


@dataclass(frozen=True, slots=True)
class Sweep:
    """A collective sweep: its points, group size and where it was measured."""

    world_size: int
    points: tuple[SweepPoint, ...]
    device: str = "unknown"
    source: str = "<sweep>"
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class KindFit:
    """The fit of one collective kind."""

    kind: str
    efficiency: float
    """Fitted bus-bandwidth efficiency (capped at 1)."""
    efficiency_uncapped: float
    """What the fit wanted before the cap; above 1 means the tier's bandwidth is understated."""
    own_latency_s: float
    """This kind's best tier latency if fitted alone (diagnostic; the tier keeps one shared value)."""
    peak_busbw_bytes_per_s: float
    """Largest measured bus bandwidth of this kind."""
    median_abs_rel_error: float
    max_abs_rel_error: float
    num_points: int


@dataclass(frozen=True, slots=True)
class CollectiveFit:
    """Result of :func:`fit_sweep`: the tier's fitted latency and per-kind efficiencies, with errors."""

    tier: str
    topology: str
    world_size: int
    device: str
    latency_s: float
    """Fitted tier latency (the alpha of ``topology.tiers[tier].latency_s``)."""
    kinds: dict[str, KindFit]
    median_abs_rel_error: float
    max_abs_rel_error: float
    num_points: int
    default_median_abs_rel_error: float
    """The same error measure with the topology's own (unfitted) latency and efficiencies."""
    default_max_abs_rel_error: float
    source: str = ""
    notes: tuple[str, ...] = ()

    @property
    def efficiencies(self) -> dict[str, float]:
        return {k: f.efficiency for k, f in self.kinds.items()}

    def to_dict(self) -> dict[str, Any]:
        return {
            "tier": self.tier, "topology": self.topology, "world_size": self.world_size, "device": self.device,
            "latency_s": self.latency_s, "efficiency": self.efficiencies,
            "median_abs_rel_error": self.median_abs_rel_error, "max_abs_rel_error": self.max_abs_rel_error,
            "default_median_abs_rel_error": self.default_median_abs_rel_error,
            "default_max_abs_rel_error": self.default_max_abs_rel_error,
            "num_points": self.num_points, "source": self.source, "notes": list(self.notes),
            "kinds": {k: {"efficiency": f.efficiency, "efficiency_uncapped": f.efficiency_uncapped,
                          "own_latency_s": f.own_latency_s, "peak_busbw_bytes_per_s": f.peak_busbw_bytes_per_s,
                          "median_abs_rel_error": f.median_abs_rel_error, "max_abs_rel_error": f.max_abs_rel_error,
                          "num_points": f.num_points} for k, f in self.kinds.items()},
        }


# ---------------------------------------------------------------------------------------------
# Reading sweeps
# ---------------------------------------------------------------------------------------------

def sweep_from_dict(d: Mapping[str, Any], source: str = "<sweep>") -> Sweep:
    """A :class:`Sweep` from the JSON ``benchmarks/collectives_h200.py`` writes (failed cases dropped)."""
    if not isinstance(d, Mapping) or "cases" not in d:
        raise CollectiveFitError(f"{source}: not a collective sweep (no 'cases'); write one with benchmarks/collectives_h200.py")
    n = d.get("world_size")
    if not isinstance(n, int) or n < 2:
        raise CollectiveFitError(f"{source}: world_size must be an integer >= 2 to fit collectives (got {n!r})")
    if not isinstance(d["cases"], list):
        raise CollectiveFitError(f"{source}: 'cases' must be a list of measured cases")
    pts = []
    for i, c in enumerate(d["cases"]):
        if not isinstance(c, Mapping):
            raise CollectiveFitError(f"{source}: cases[{i}] is not an object")
        if "error" in c:
            continue
        try:
            kind, t, s = c["kind"], float(c["time_s"]), float(c["bytes"])
        except (KeyError, TypeError, ValueError) as e:
            raise CollectiveFitError(f"{source}: cases[{i}] lacks kind/bytes/time_s ({e})") from None
        if kind not in FIT_KINDS:
            continue
        if not (math.isfinite(t) and t > 0 and math.isfinite(s) and s > 0):
            raise CollectiveFitError(f"{source}: cases[{i}] has a non-positive or non-finite time or size (time_s={t}, bytes={s})")
        pts.append(SweepPoint(kind, str(c.get("dtype", "bf16")), s, t))
    if not pts:
        raise CollectiveFitError(f"{source}: no successful cases to fit")
    return Sweep(n, tuple(pts), str(d.get("device_name", "unknown")), source,
                 {k: d.get(k) for k in ("date", "git_commit", "versions", "nccl_version", "command")})


def load_sweep(path: str | Path) -> Sweep:
    p = Path(path)
    if not p.exists():
        raise CollectiveFitError(f"{p}: no such sweep file; run benchmarks/collectives_h200.py to make one")
    try:
        d = load_document(p)
    except SpecError as e:
        raise CollectiveFitError(str(e)) from None
    return sweep_from_dict(d, str(p))


# ---------------------------------------------------------------------------------------------
# The model's terms
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Terms:
    """``t = base + hops · α + S · per_byte / e`` for one kind on one placed group."""

    base_s: float
    hops: float
    per_byte_s: float


def _with_tier(topology: Topology, j: int, latency_s: float | None = None, eff: Mapping[str, float] | None = None) -> Topology:
    tiers = list(topology.tiers)
    upd: dict[str, Any] = {}
    if latency_s is not None:
        upd["latency_s"] = latency_s
    if eff is not None:
        upd["collective_efficiency"] = {**tiers[j].collective_efficiency, **eff}
    tiers[j] = tiers[j].model_copy(update=upd)
    return topology.model_copy(update={"tiers": tuple(tiers)})


def tier_index(topology: Topology, tier: str | None, world_size: int) -> int:
    """Index of the tier a stride-1 group of ``world_size`` crosses; it must cross exactly one."""
    g = place_group(topology, world_size, 1)
    crossed = g.tiers
    if len(crossed) != 1:
        raise CollectiveFitError(
            f"a group of {world_size} GPUs on topology '{topology.name}' crosses tiers {list(crossed)}; a sweep "
            "calibrates one tier, so measure it on a group that sits inside that tier (e.g. the GPUs of one host)"
        )
    names = [t.name for t in topology.tiers]
    if tier is not None and tier != crossed[0]:
        raise CollectiveFitError(
            f"the sweep's {world_size}-GPU group crosses tier '{crossed[0]}' of '{topology.name}', not '{tier}' "
            f"(tiers: {names})"
        )
    return names.index(crossed[0])


def model_terms(topology: Topology, j: int, world_size: int, kind: str) -> Terms:
    """Read ``base``, ``hops`` and ``per_byte`` off the cost model (affine in α and in 1/e on one tier)."""
    g = place_group(topology, world_size, 1)
    name = topology.tiers[j].name

    def model(alpha: float):
        topo = _with_tier(topology, j, latency_s=alpha, eff={kind: 1.0})
        eff = resolve_efficiencies(topo)
        return collective_model(topo, g, kind, eff)  # type: ignore[arg-type]

    m0, m1 = model(0.0), model(1e-6)
    if m0.bottleneck not in ("", name):
        raise CollectiveFitError(f"{kind} on {world_size} GPUs is bounded by tier '{m0.bottleneck}', not '{name}'")
    return Terms(m0.latency_s, (m1.latency_s - m0.latency_s) / 1e-6, m0.s_per_byte)


# ---------------------------------------------------------------------------------------------
# Fitting
# ---------------------------------------------------------------------------------------------

def _errors(pred: np.ndarray, meas: np.ndarray) -> tuple[float, float]:
    r = np.abs(pred - meas) / meas
    return float(np.median(r)), float(np.max(r))


def fit_sweep(sweep: Sweep, topology: Topology, tier: str | None = None, *, dtypes: Sequence[str] | None = None,
              min_bytes: float = 0.0) -> CollectiveFit:
    """Fit ``topology``'s tier latency and per-kind efficiencies to ``sweep`` (see the module docstring).

    ``dtypes`` restricts the points used (default: all; bandwidth is counted in bytes, so dtypes pool);
    ``min_bytes`` drops sizes below it (e.g. to fit the bandwidth end only).
    """

    j = tier_index(topology, tier, sweep.world_size)
    tname = topology.tiers[j].name
    pts = [p for p in sweep.points if (dtypes is None or p.dtype in dtypes) and p.nbytes >= min_bytes]
    kinds = [k for k in FIT_KINDS if any(p.kind == k for p in pts)]
    if not kinds:
        raise CollectiveFitError(f"{sweep.source}: no points left to fit (dtypes={dtypes}, min_bytes={min_bytes:g})")
    short = [k for k in kinds if len({p.nbytes for p in pts if p.kind == k}) < 2]
    if short:
        raise CollectiveFitError(f"{sweep.source}: {short} need at least two distinct sizes to separate latency from bandwidth")
    terms = {k: model_terms(topology, j, sweep.world_size, k) for k in kinds}
    ki = np.array([kinds.index(p.kind) for p in pts])
    S = np.array([p.nbytes for p in pts])
    meas = np.array([p.time_s for p in pts])
    base = np.array([terms[kinds[i]].base_s for i in ki])
    hops = np.array([terms[kinds[i]].hops for i in ki])
    ub = np.array([terms[kinds[i]].per_byte_s for i in ki])

    def predict(alpha: float, inv_eff: np.ndarray) -> np.ndarray:
        return base + hops * alpha + S * ub * inv_eff[ki]

    # Start from the topology's own figures; fit log α (floored) and 1/e, both positive.
    t0 = topology.tiers[j]
    x0 = np.concatenate([[max(t0.latency_s, 1e-7) * 1e6], [1.0 / t0.efficiency(k) for k in kinds]])

    def resid(x):
        return np.log(predict(x[0] * 1e-6, x[1:]) / meas)

    lo = np.concatenate([[0.0], np.full(len(kinds), 1e-3)])
    hi = np.concatenate([[1e5], np.full(len(kinds), 1.0 / EFF_FLOOR)])
    sol = least_squares(resid, np.clip(x0, lo, hi), bounds=(lo, hi), x_scale="jac")
    alpha = float(sol.x[0] * 1e-6)
    inv = sol.x[1:].copy()
    notes = []
    uncapped = {k: 1.0 / inv[i] for i, k in enumerate(kinds)}
    capped = [k for k, e in uncapped.items() if e > 1.0]
    if capped:
        # Refit α with the capped kinds held at 1 so the others absorb nothing of the cap.
        fixed = np.array([i for i, k in enumerate(kinds) if k in capped])
        free = np.array([i for i, k in enumerate(kinds) if k not in capped], dtype=int)

        def resid2(x):
            iv = np.ones(len(kinds))
            iv[free] = x[1:]
            return np.log(predict(x[0] * 1e-6, iv) / meas)

        sol2 = least_squares(resid2, np.concatenate([[sol.x[0]], inv[free]]),
                             bounds=(np.concatenate([[0.0], lo[1:][free]]), np.concatenate([[1e5], hi[1:][free]])), x_scale="jac")
        alpha = float(sol2.x[0] * 1e-6)
        inv = np.ones(len(kinds))
        inv[free] = sol2.x[1:]
        inv[fixed] = 1.0
        notes.append(f"{capped} reached more than tier '{tname}' bandwidth × 1 ({', '.join(f'{uncapped[k]:.3f}' for k in capped)}); "
                     f"capped at 1: the topology's bw_bytes_per_s ({t0.bw_bytes_per_s:.3g}) understates the tier")
    pred = predict(alpha, inv)
    med, mx = _errors(pred, meas)
    d_inv = np.array([1.0 / t0.efficiency(k) for k in kinds])
    dmed, dmx = _errors(predict(t0.latency_s, d_inv), meas)

    out: dict[str, KindFit] = {}
    for i, k in enumerate(kinds):
        sel = ki == i
        # This kind's own latency with its efficiency held: the diagnostic of how much one shared α costs.
        def r1(x, sel=sel, i=i):
            return np.log((base[sel] + hops[sel] * x[0] * 1e-6 + S[sel] * ub[sel] * inv[i]) / meas[sel])
        own = least_squares(r1, [max(alpha * 1e6, 1e-3)], bounds=([0.0], [1e5])).x[0] * 1e-6 if hops[sel][0] > 0 else alpha
        kmed, kmx = _errors(pred[sel], meas[sel])
        busbw = S[sel] / meas[sel] * bus_factor(k, sweep.world_size)
        out[k] = KindFit(k, float(min(1.0, 1.0 / inv[i])), float(uncapped[k]), float(own), float(busbw.max()),
                         kmed, kmx, int(sel.sum()))
    return CollectiveFit(tname, topology.name, sweep.world_size, sweep.device, alpha, out, med, mx, len(pts), dmed, dmx,
                         sweep.source, tuple(notes))


def predict_time(topology: Topology, kind: str, nbytes, world_size: int) -> np.ndarray:
    """The cost model's time for ``kind`` of ``nbytes`` on a stride-1 group of ``world_size`` (vectorised)."""
    g = place_group(topology, world_size, 1)
    return collective_model(topology, g, kind, resolve_efficiencies(topology)).time(np.asarray(nbytes, dtype=float))  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------
# Applying a fit
# ---------------------------------------------------------------------------------------------

def apply_to_topology(topology: Topology, fit: CollectiveFit, tier: str | None = None) -> Topology:
    """A copy of ``topology`` whose tier ``tier`` (default: the fitted tier's name) takes the fitted
    latency and efficiencies, e.g. the 2-GPU NVLink fit onto ``h200-superpod-4k``'s ``nvlink`` tier.

    The fit is per GPU on one tier, so it carries over to a larger group on the same fabric as far as
    the alpha-beta form holds (NVSwitch: every GPU reaches every other at the full port rate).
    """
    name = tier or fit.tier
    names = [t.name for t in topology.tiers]
    if name not in names:
        raise CollectiveFitError(f"topology '{topology.name}' has no tier '{name}' (tiers: {names})")
    return _with_tier(topology, names.index(name), latency_s=fit.latency_s, eff=fit.efficiencies)


def merge_into_calibration(fit: CollectiveFit, base: Calibration | None = None, tier: str | None = None) -> Calibration:
    """``base`` (or a new Calibration for the sweep's device) with ``collective_efficiency[tier]`` set
    from the fit. Its latency goes to the notes: the Calibration schema holds efficiencies only; use
    :func:`apply_to_topology` to carry the latency too."""
    name = tier or fit.tier
    note = (f"collectives: tier '{name}' fitted from {fit.source} ({fit.world_size} GPUs, {fit.num_points} points): "
            f"latency {fit.latency_s * 1e6:.2f} us, efficiency "
            + ", ".join(f"{k} {v:.3g}" for k, v in fit.efficiencies.items())
            + f"; error median {fit.median_abs_rel_error:.1%}, max {fit.max_abs_rel_error:.1%}"
            + (f" (topology defaults: median {fit.default_median_abs_rel_error:.1%}, max {fit.default_max_abs_rel_error:.1%})"))
    coll = {t: dict(d) for t, d in (base.collective_efficiency.items() if base else {})}
    coll[name] = {**coll.get(name, {}), **fit.efficiencies}
    if base is None:
        return Calibration(
            device=fit.device if fit.device not in ("", "unknown") else "unknown",
            created_utc=datetime.now(timezone.utc).isoformat(timespec="seconds"),
            source_runs=(fit.source,), collective_efficiency=coll,
            fit_error=FitError(median_abs_rel_error=fit.median_abs_rel_error, max_abs_rel_error=fit.max_abs_rel_error,
                               per_op_class={f"collective:{k}": f.median_abs_rel_error for k, f in fit.kinds.items()},
                               num_samples=fit.num_points),
            notes=note,
        )
    per = dict(base.fit_error.per_op_class) if base.fit_error else {}
    per.update({f"collective:{k}": f.median_abs_rel_error for k, f in fit.kinds.items()})
    fe = base.fit_error.model_copy(update={"per_op_class": per}) if base.fit_error else FitError(
        median_abs_rel_error=fit.median_abs_rel_error, max_abs_rel_error=fit.max_abs_rel_error, per_op_class=per,
        num_samples=fit.num_points)
    return base.model_copy(update={
        "collective_efficiency": coll, "source_runs": tuple(base.source_runs) + (fit.source,), "fit_error": fe,
        "notes": (base.notes + "\n" if base.notes else "") + note,
    })


__all__ = [
    "CollectiveFit", "CollectiveFitError", "FIT_KINDS", "KindFit", "Sweep", "SweepPoint", "apply_to_topology",
    "fit_sweep", "load_sweep", "merge_into_calibration", "model_terms", "predict_time", "sweep_from_dict",
    "tier_index",
]
