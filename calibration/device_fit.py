"""The device fit: each op class's efficiencies fitted to the measured (op, phase) samples of runs.

The cost model's own roofline gives each sample's prediction as a function of the parameters of its op
class ``c``:

    t̂ = max(F / (peak · e_c), (B + B_fixed) / (hbm_bw · m_c)) + launches · λ_c

(an unfused op, the padded reference attention, adds ``S / (hbm_bw · m_u)`` for the bytes ``S`` of its
separate elementwise kernels, which run after its matmuls; its matmuls' bytes use the same ``m_u``, the
memory efficiency of :data:`coplan.costmodel.efficiency.UNFUSED_CLASS`: each kernel costs its own
roofline and the op costs their sum)

``F``, ``B``, ``launches`` come from :mod:`coplan.calibration.terms`. ``e_c`` (compute efficiency, for the
dtype the ops ran in), ``m_c`` (fraction of HBM bandwidth) and ``λ_c`` (seconds per launch) are fitted by
``scipy.optimize.least_squares`` on log-ratio residuals (every op counts by its relative error, whatever
its size), with a weak prior pulling parameters that the data cannot identify (a class whose ops are all
memory-bound says nothing of its compute efficiency) towards the defaults. The fit also matches each
run's per-class *sums* (the figure the step time is made of), beside each sample's log-ratio.

The sequence lookup. FBGEMM's no-bag forward gives one warp per bag and walks a bag's ids one after
another, so with whole histories as bags it is latency-bound: each sequence-lookup kernel costs
max(bytes / (HBM bandwidth · m_embedding), waves × ids in the longest bag × ``t_id``)
(:func:`coplan.costmodel.context.seq_lookup_floor_s`, the bag layout from the run's ``seq_chunk``).
``t_id`` (``lookup_id_latency_s``) is fitted with the efficiencies on the embedding forward samples
(:attr:`coplan.calibration.runs.Sample.lookup_groups`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence

import numpy as np
from scipy.optimize import least_squares

from coplan.calibration.runs import CalibrationError, Sample
from coplan.costmodel.efficiency import DEFAULT_LOOKUP_ID_LATENCY_S, UNFUSED_CLASS, scale_at

PRIOR_WEIGHT = 0.05
"""Weight of the pull towards defaults, against 1 per sample: small enough that any parameter the
samples constrain is set by them."""
SAMPLE_F_SCALE = 0.1
"""Soft-L1 scale of the per-sample log-ratio residuals (beyond ~10% an op counts linearly, not squared)."""
CLASS_SUM_WEIGHT = 2.0
"""Weight of each (run, op class) summed-time residual against 1 per sample: per-op ratios alone let
a few large, well-fitted ops and many tiny badly-fitted ones balance to a biased class total."""


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
    base: Any = None
    """A Calibration whose device terms these are, kept whole (``coplan calibrate --base`` on runs whose
    traces do not attribute): the step is then priced with it, not with the dicts above."""
    attention_scales: dict[str, float] = field(default_factory=dict)
    """Fitted measured-over-priced scales of the attention ops, ``"<op>:<phase>:<head dim>"`` →
    scale (:func:`fit_attention_scales`; applied in ``predicted_s``)."""

    def rel_errors(self) -> np.ndarray:
        return np.abs(self.predicted_s - self.measured_s) / self.measured_s

    def per_class_error(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for c in sorted({s.op_class for s in self.samples}):
            idx = [i for i, s in enumerate(self.samples) if s.op_class == c]
            m = float(self.measured_s[idx].sum())
            out[c] = abs(float(self.predicted_s[idx].sum()) - m) / m if m > 0 else 0.0
        return out


def launch_time(s: Sample, launch_s: dict[str, float]) -> float:
    """A sample's kernels' fixed cost: its launches at its class's seconds per launch, plus its unfused
    elementwise kernels at theirs (the part of a prediction no efficiency or attention scale multiplies)."""
    return s.launches * launch_s.get(s.op_class, 0.0) + s.extra_kernels * launch_s.get(UNFUSED_CLASS, 0.0)


def predict(samples: Sequence[Sample], compute: dict[tuple[str, str], float], memory: dict[str, float], launch_s: dict[str, float],
            lookup_id_s: float | None = None, scale_of: Callable[[Sample], float] | None = None) -> np.ndarray:
    """The roofline of each sample under the given efficiencies (the same form the pricer uses);
    ``lookup_id_s``: the sequence lookups' seconds per serial id (None: the default); ``scale_of``: a
    sample's attention scale (:func:`attention_scale_of`; None: 1), applied to its roofline as the pricer
    applies it (launches excepted)."""
    t_id = DEFAULT_LOOKUP_ID_LATENCY_S if lookup_id_s is None else lookup_id_s
    out = np.empty(len(samples))
    for i, s in enumerate(samples):
        e = compute.get((s.op_class, s.dtype), 1.0)
        m = memory.get(s.mem_class or s.op_class, 1.0)
        # an unfused op: its separate elementwise kernels run after its matmuls, so their time adds
        serial = s.serial_mem_s / memory.get(UNFUSED_CLASS, 1.0) if s.serial_mem_s > 0 else 0.0
        # the sequence lookups: each kernel the longer of its bytes and its warps' serial bag walk
        look = sum(max(gm / m, gi * t_id) for gm, gi in s.lookup_groups)
        kernels = launch_time(s, launch_s)
        k = scale_of(s) if scale_of is not None else 1.0
        out[i] = (max(s.flop_s / e, s.mem_s / m) + look + serial) * k + kernels
    return out


def attention_scale_of(eff) -> Callable[[Sample], float]:
    """A sample's attention scale under resolved efficiencies ``eff``
    (:meth:`coplan.costmodel.efficiency.Efficiencies.attention_scale`): 1 for other samples."""
    def scale(s: Sample) -> float:
        key = s.attention_key
        return eff.attention_scale(*key) if key is not None else 1.0
    return scale


def fit(samples: Sequence[Sample], defaults_compute: dict[tuple[str, str], float], defaults_memory: dict[str, float],
        defaults_launch: dict[str, float], default_lookup_id_s: float | None = None) -> FitResult:
    """Least-squares fit of (e, m, λ) per op class present in ``samples``, and of the sequence lookups'
    seconds per serial id when a sample has a sequence lookup (:attr:`Sample.lookup_groups`)."""
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


SCALE_PRIOR_SAMPLES = 2.0
"""Shrinkage of an attention scale towards 1: its log is the residuals' sum over (samples + this), so a key
seen in a couple of samples moves half-way, one seen in twenty nearly all the way."""
MIN_SCALE_SAMPLES = 2
"""Samples an (op, phase, head dim) key needs for a scale of its own."""


def fit_attention_scales(res: FitResult) -> FitResult:
    """``res`` with a time scale per attention (op, phase, head dim) fitted to the residuals of its class fit.

    One compute efficiency per class cannot price every attention kernel (the forward and the backward of a
    jagged kernel, the summary tokens' few queries, a Kunlun layer's dozens of tokens each run another share of
    the peak, moving with the head dim). Each key's scale is exp(Σ log((measured - launches) / roofline) / (n +
    :data:`SCALE_PRIOR_SAMPLES`)) over its n samples (at least :data:`MIN_SCALE_SAMPLES`), clipped to
    [0.05, 20]; the predictions' rooflines are scaled as the pricer scales them (a thin key takes its neighbours'
    scale, :func:`coplan.costmodel.efficiency.scale_at`) and the class terms stay as fitted."""
    groups: dict[tuple[str, str, int], list[int]] = {}
    for i, s in enumerate(res.samples):
        key = s.attention_key
        if key is not None:
            groups.setdefault(key, []).append(i)
    # the scale multiplies an op's roofline, not its launches (as the pricer applies it)
    launch = np.array([launch_time(s, res.launch_s) for s in res.samples])
    roof = np.maximum(res.predicted_s - launch, 1e-12)
    scales: dict[str, float] = {}
    points: dict[tuple[str, str], list[tuple[int, float]]] = {}
    for (op, phase, hd), idx in sorted(groups.items()):
        if len(idx) < MIN_SCALE_SAMPLES:
            continue
        meas = res.measured_s[idx]
        r = np.log(np.maximum(meas - launch[idx], 0.1 * meas) / roof[idx])
        k = float(np.clip(math.exp(r.sum() / (len(idx) + SCALE_PRIOR_SAMPLES)), 0.05, 20.0))
        scales[f"{op}:{phase}:{hd}"] = k
        points.setdefault((op, phase), []).append((hd, k))
    # every attention sample as the pricer will price it: a key too thin for a scale of its own takes its
    # (op, phase)'s neighbours' (Efficiencies.attention_scale)
    pred = res.predicted_s.copy()
    for (op, phase, hd), idx in groups.items():
        pred[idx] = roof[idx] * scale_at(sorted(points.get((op, phase), [])), hd) + launch[idx]
    return replace(res, predicted_s=pred, attention_scales=scales)


__all__ = ["CLASS_SUM_WEIGHT", "MIN_SCALE_SAMPLES", "PRIOR_WEIGHT", "SAMPLE_F_SCALE", "SCALE_PRIOR_SAMPLES", "FitResult",
           "attention_scale_of", "fit", "fit_attention_scales", "predict"]
