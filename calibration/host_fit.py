"""The host fit: a host cost per priced kernel launch ``h`` (and per local sample ``s``) and a device-step
factor ``f``, fitted to the runs' measured step times.

A step of the trainer on one GPU can be mostly GPU idle time: the host issues launches slower than the
GPU runs them. The device fit (:mod:`coplan.calibration.device_fit`) is of kernel time, which is what
the op classes' efficiencies mean; the step time then gets the host's figures. With ``N`` the launches
the pricer charges per step (the exact slope of its step in the launch cost) and ``P`` its step under
the device fit, ``step ≈ max(f · P, k · (N · h + B · s))``: the host issues a step's launches while the
GPU runs earlier ones, so the two overlap and the longer one sets the step (a sum counts the overlap
twice and overstated device-bound runs by up to 54% on the H200). The max is over the whole step, not
per phase: the trainer never waits for the device inside or between steps, so the host's lead carries
across phase and step boundaries. Fitted by least squares on log ratios of the runs' measured p50 steps
(CUDA events, outside the profiled window); ``coplan calibrate --host-cost`` writes them as the
Calibration's ``host_launch_s``, ``host_sample_s`` and ``device_step_factor``.

``s`` is the host work that grows with the local batch ``B`` (batch reading, balancing, KJT building,
pinning compete with the launching threads for the GIL); it needs runs at two or more batch sizes and
comes out 0 when the batch adds nothing beyond the launches. ``k`` is each run's host speed
(:func:`coplan.calibration.host_profile.host_speed_index`): the same host work takes longer on a host
shared with another job, and a run measured on a slowed host must not bend ``h`` and ``s``
(``--host-speed``). The fitted runs' host speed is recorded (``host_op_median_us``); a plan is priced
for a host that fast.

Limits: ``N`` counts the launches the cost model prices (about a fifth of those that run), so ``h`` is
per *priced* launch. A host sync (the padded reference attention reads its longest length) serialises
host and device around it: such runs are priced per segment between syncs (:data:`Segments`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
from scipy.optimize import minimize_scalar

from coplan.calibration.device_fit import FitResult
from coplan.calibration.host_profile import host_reference_us, host_speed_index
from coplan.calibration.runs import CalibrationError, RunSamples, run_step_moments
from coplan.calibration.step_price import step_segments


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
run's is hidden, and without them ``h`` is not identified on a device-bound fit set. The wait is
inside the pageable device-to-host copy (``cudaMemcpyAsync``), not the stream sync."""


def refine_on_grid(loss, grid: np.ndarray, losses, xatol: float) -> tuple[float, float]:
    """(x, loss(x)): the grid point of least loss (``losses``: ``loss`` at each point), refined by a bounded
    scalar search between its neighbours; the grid point where the search does no better. (The losses here
    are piecewise smooth: the grid picks the basin, the search its bottom.)"""
    j = int(np.argmin(losses))
    r = minimize_scalar(loss, bounds=(grid[max(0, j - 1)], grid[min(len(grid) - 1, j + 1)]), method="bounded",
                        options={"xatol": xatol})
    return (float(r.x), float(r.fun)) if r.fun <= losses[j] else (float(grid[j]), float(losses[j]))


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
    host_measured: tuple = ()
    """Per run, its measured host time per step that the fit used (:func:`run_host_time`), or None."""
    device_gap_s: float = 0.0
    """Device seconds per priced device launch between kernels (fitted as the alternative to ``device_factor``:
    :func:`fit_gap_terms`; 0: not fitted)."""
    device_launches: tuple = ()
    """Per run, the priced device launches per step (as ``device_s``), or per step and segment (as ``segments``):
    what ``device_gap_s`` multiplies; empty: none."""

    def shifted(self) -> tuple[tuple[float, ...], tuple]:
        """(device_s, segments) with the device gap added (:func:`gap_shift`)."""
        if not self.device_gap_s or not self.device_launches:
            return self.device_s, self.segments
        d, seg = gap_shift(self.device_s, self.segments or None, self.device_launches, self.device_gap_s)
        return tuple(d), tuple(seg) if seg is not None else ()

    def host_s(self) -> np.ndarray:
        """Each run's host time under the fit."""
        b = np.array(self.batch) if self.batch else np.zeros(len(self.runs))
        k = np.array(self.speed) if self.speed else np.ones(len(self.runs))
        return k * (np.array(self.launches) * self.h_s + self.sample_s * b)

    def _steps(self) -> _StepSet:
        device_s, segments = self.shifted()
        segs = _segment_arrays(device_s, self.launches, segments or None)
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
                 step_measured: Sequence[Sequence[float] | None] | None = None,
                 host_measured: Sequence[float | None] | None = None):
        self.n_runs = len(segs)
        # a run's measured host time per step (summary.json's host_step), where it is the host's own: fitted
        # beside its step (see sq_err); only for a run that does not sync (one segment)
        hm = [float("nan")] * len(segs) if host_measured is None else [
            float(x) if x is not None and x > 0 and segs[i][0].shape[1] == 1 else float("nan") for i, x in enumerate(host_measured)]
        self.hm = np.asarray(hm, float)
        self.hk, self.hb = k, bt
        self.hn = np.array([float(np.median(N.sum(axis=1))) for N, _, _ in segs])
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
        has = np.isfinite(self.hm)
        if has.any():
            # the host's own time, measured: k · (launches · h + batch · s) against it, so that a device-bound
            # run (whose step hides its host) still tells the host's cost
            host = self.hk[has] * (h[:, None] * self.hn[has] + s * self.hb[has])
            out[:, has] += np.log(np.maximum(host, 1e-12) / self.hm[has]) ** 2
        for i, N, E, D, kr, b in self.many:
            t = self.per_step.get(i)
            if t is not None:
                out[:, i] = np.mean(np.log(self._steps(h, s, f, form, N, E, D, kr, b) / t[None, :]) ** 2, axis=1)
        return out


def fit_host_terms(measured_s: Sequence[float], device_s: Sequence[float], launches: Sequence[float],
                   batch: Sequence[float] | None = None, *, form: str = "max", per_sample: bool = False,
                   speed: Sequence[float] | None = None, device_factor: float = 1.0,
                   segments: Segments | None = None,
                   step_measured: Sequence[Sequence[float] | None] | None = None,
                   host_measured: Sequence[float | None] | None = None) -> tuple[float, float]:
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
    (:meth:`_StepSet.sq_err`), the others at their p50. ``host_measured``: per run, the host's own measured
    time per step (``summary.json``'s ``host_step`` p50, where it is the host's: see
    :func:`fit_host_launch_cost`) or None; a run that has it is also fitted on it, which identifies the host
    terms from device-bound runs too."""
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
    steps = _StepSet(segs, k, bt, step_measured, host_measured)

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
        return refine_on_grid(loss, grid, losses, 1e-10)

    s_best = 0.0
    h, _ = fit_h(0.0)
    if per_sample and len(set(bt.tolist())) > 1:
        s_hi = float(np.max(m / np.maximum(k * bt, 1.0)))
        s_grid = np.concatenate(([0.0], np.geomspace(s_hi * 1e-4, s_hi, 120)))
        s_loss = lambda sv: fit_h(sv)[1]  # noqa: E731
        s_best = refine_on_grid(s_loss, s_grid, [s_loss(sv) for sv in s_grid], 1e-10)[0]
        h, _ = fit_h(s_best)
    return max(0.0, h), max(0.0, s_best)


DEVICE_FACTOR_RANGE = (0.8, 1.5)
"""Bounds of the fitted device-step factor."""
DEVICE_FACTOR_PRIOR = 1e-4
"""Weight of the pull of log(factor) towards 0 (factor 1): decides only where the runs do not (all host-bound)."""


def gap_shift(device_s: Sequence[float], segments: Segments | None, device_launches: Sequence, g: float
              ) -> tuple[np.ndarray, list | None]:
    """``device_s`` and ``segments`` with ``g`` device seconds per priced device launch added: each run's
    device time plus ``g`` times its launches (``device_launches``: per run a number, or with ``segments`` an
    array shaped as the run's device times, per step and segment)."""
    d = np.asarray(device_s, float) + g * np.array([float(np.median(np.atleast_2d(x).sum(axis=1))) if np.ndim(x) else
                                                    float(x) for x in device_launches])
    if segments is None:
        return d, None
    out = []
    for seg, nd in zip(segments, device_launches):
        if len(seg) == 2:
            N, D = seg
            out.append((N, np.asarray(D, float) + g * np.asarray(nd, float)))
        else:
            N, E, D = seg
            out.append((N, E, np.asarray(D, float) + g * np.asarray(nd, float)))
    return d, out


def _fit_device_term(m: np.ndarray, d: np.ndarray, n: np.ndarray, bt: np.ndarray, k: np.ndarray, segments, step_measured,
                     host_measured, per_sample: bool, shift, grid: np.ndarray, prior) -> tuple[float, float, float, float]:
    """(h, s, x, loss): the host costs and one device term ``x`` fitted together (:func:`fit_step_terms`,
    :func:`fit_gap_terms`); ``shift(x)`` gives (device_s, segments, factor) under ``x``, ``prior(x)`` its
    penalty."""
    told = int(np.isfinite(_StepSet(_segment_arrays(d, n, segments), k, bt, step_measured, host_measured).hm).sum())

    def terms(x: float, host: bool, samples: bool) -> tuple[float, float, float]:
        dx, sx, f = shift(x)
        h, s = (fit_host_terms(m, dx, n, bt, form="max", per_sample=samples, speed=k, device_factor=f, segments=sx,
                               step_measured=step_measured, host_measured=host_measured)
                if host else (0.0, 0.0))
        st = _StepSet(_segment_arrays(dx, n, sx), k, bt, step_measured, host_measured)
        return h, s, float(np.sum(st.sq_err(h, s, f, "max", m)[0]) + prior(x))

    def solve(host: bool, samples: bool) -> tuple[float, float, float]:
        x_loss = lambda x: terms(x, host, samples)[2]  # noqa: E731
        x = refine_on_grid(x_loss, grid, [x_loss(float(g)) for g in grid], 1e-5 * float(grid[-1]))[0]
        h, s, _ = terms(x, host, samples)
        return h, s, x

    def host_bound(h: float, s: float, x: float) -> int:
        dx, sx, f = shift(x)
        st = _StepSet(_segment_arrays(dx, n, sx), k, bt)
        return int(np.sum(st.median(h, s, f, "max")[0] > st.median(0.0, 0.0, f, "max")[0] * (1 + 1e-9)))

    h, s, x = solve(True, per_sample)
    if s > 0 and host_bound(h, s, x) + told < 3:
        h, s, x = solve(True, False)
    if h > 0 and host_bound(h, s, x) + told < 2:
        h, s, x = solve(False, False)
    # (the loss without the prior: what the factor's and the gap's fits are compared on)
    return h, s, x, _loss_at(m, d, n, bt, k, segments, step_measured, host_measured, shift, h, s, x, lambda _: 0.0)


def _loss_at(m, d, n, bt, k, segments, step_measured, host_measured, shift, h, s, x, prior) -> float:
    dx, sx, f = shift(x)
    st = _StepSet(_segment_arrays(dx, n, sx), k, bt, step_measured, host_measured)
    return float(np.sum(st.sq_err(h, s, f, "max", m)[0]) + prior(x))


def _as_arrays(measured_s, device_s, launches, batch, speed):
    m = np.asarray(measured_s, float)
    d = np.asarray(device_s, float)
    n = np.asarray(launches, float)
    bt = np.zeros_like(m) if batch is None else np.asarray(batch, float)
    k = np.ones_like(m) if speed is None else np.asarray(speed, float)
    return m, d, n, bt, k


def fit_step_terms(measured_s: Sequence[float], device_s: Sequence[float], launches: Sequence[float],
                   batch: Sequence[float] | None = None, *, per_sample: bool = False,
                   speed: Sequence[float] | None = None, segments: Segments | None = None,
                   step_measured: Sequence[Sequence[float] | None] | None = None,
                   host_measured: Sequence[float | None] | None = None) -> tuple[float, float, float]:
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
    then ``h``) and the rest refitted. A run whose host time was measured (``host_measured``, see
    :func:`fit_host_terms`) counts as one that tells the host terms, host-bound or not."""
    m, d, n, bt, k = _as_arrays(measured_s, device_s, launches, batch, speed)
    h, s, f, _ = _fit_device_term(m, d, n, bt, k, segments, step_measured, host_measured, per_sample,
                                  lambda x: (d, segments, x), np.geomspace(*DEVICE_FACTOR_RANGE, 57),
                                  lambda x: DEVICE_FACTOR_PRIOR * math.log(x) ** 2)
    return h, s, f


DEVICE_GAP_RANGE = (0.0, 50e-6)
"""Bounds of the fitted device gap per priced launch (seconds)."""


def fit_gap_terms(measured_s: Sequence[float], device_s: Sequence[float], launches: Sequence[float],
                  device_launches: Sequence, batch: Sequence[float] | None = None, *, per_sample: bool = False,
                  speed: Sequence[float] | None = None, segments: Segments | None = None,
                  step_measured: Sequence[Sequence[float] | None] | None = None,
                  host_measured: Sequence[float | None] | None = None) -> tuple[float, float, float, float]:
    """(h, s, g, loss): as :func:`fit_step_terms`, with the device work no priced op accounts for taken as ``g``
    device seconds per priced device launch (``device_launches``, per run: the pricer's device step's slope in
    every class's launch cost) instead of a share of the device step: step = max(device + g · device
    launches, host). Between dependent kernels the device idles a few microseconds each (a replayed CUDA
    graph too), and the small kernels the ops do not price come with the ops' launches: the unpriced time
    grows with the count of kernels, not with how long they run. A factor fitted on small steps (tens of
    kernels a millisecond) and applied to a large device-bound one (a few a millisecond) overstates it: on
    the held-out H100 draws of 2026-12-06 the worst misses were such steps priced 20-31% long.
    ``g`` by a linear grid over :data:`DEVICE_GAP_RANGE` and a bounded search; no prior (0: none)."""
    m, d, n, bt, k = _as_arrays(measured_s, device_s, launches, batch, speed)

    def shift(g: float):
        dx, sx = gap_shift(d, segments, device_launches, g)
        return dx, sx, 1.0

    return _fit_device_term(m, d, n, bt, k, segments, step_measured, host_measured, per_sample, shift,
                            np.linspace(*DEVICE_GAP_RANGE, 101), lambda g: 0.0)


def device_term_loss(measured_s, device_s, launches, batch, speed, segments, step_measured, host_measured,
                     h: float, s: float, f: float) -> float:
    """The fit's loss (squared log errors) at (h, s, f): to compare the factor's fit with the gap's."""
    m, d, n, bt, k = _as_arrays(measured_s, device_s, launches, batch, speed)
    return _loss_at(m, d, n, bt, k, segments, step_measured, host_measured, lambda x: (d, segments, x), h, s, f,
                    lambda x: 0.0)


def fit_host_launch_cost(runs: Sequence[RunSamples], res: FitResult, form: str = "max", *,
                         per_sample: bool = False, host_speed: bool = False,
                         fit_device_factor: bool = False, device_term: str = "factor") -> HostFit | None:
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
    :func:`coplan.calibration.host_profile.host_speed_index`), so that ``h`` and ``s`` are those of the fitted
    runs' typical host and a run measured on a slowed host (a shared CPU) does not bend them. Needs every
    fitted run's host profile; without one the runs count as equally fast.

    ``fit_device_factor`` (max form): also fit ``f``, step = max(f · device step, host), the device work no
    priced op accounts for as a share of the priced device step (:func:`fit_step_terms`). Host-syncing
    runs are left out of it as they are of ``h``.

    ``device_term`` (with ``fit_device_factor``): how the device work no priced op accounts for is fitted:
    ``"factor"`` (a share of the device step, :func:`fit_step_terms`), ``"gap"`` (seconds per priced device
    launch, :func:`fit_gap_terms`) or ``"best"`` (both, and the one whose fit to the measured steps is closer
    is kept). Default: the factor (``coplan.calibration.assemble.calibrate`` says why).

    A run whose summary records the host's own time per step (``host_step``) is fitted on it too
    (:func:`run_host_time` says which runs' host times count).
    """
    if device_term not in DEVICE_TERMS:
        raise CalibrationError(f"unknown device term {device_term!r} (one of {DEVICE_TERMS})")
    if form not in HOST_FORMS:
        raise CalibrationError(f"unknown host form {form!r} (one of {HOST_FORMS})")

    names, meas, dev, nl, bs, prof, segments, per_step, hosts, bounds = [], [], [], [], [], [], [], [], [], []
    gaps = fit_device_factor and form == "max" and device_term != "factor"
    nds: list[np.ndarray] = []
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
        if gaps:
            # the device launches: the device step's slope in every class's launch cost, per step and segment
            up = [step_segments(r.plan, res, mo, seq_chunk=r.seq_chunk, extra_launch_s=_SLOPE_S) for mo in run_step_moments(r)]
            Du = np.array([[x[2] for x in c] for c in up]) if all(len(c) == D.shape[1] for c in up) else D
            nds.append(np.maximum(0.0, (Du - D) / _SLOPE_S))
        names.append(r.run)
        meas.append(float(st.p50_s))
        dev.append(float(np.median(D.sum(axis=1))))
        nl.append(float(np.median(N.sum(axis=1))))
        segments.append((N, E, D))
        per_step.append(r.step_times_each if r.step_moments_each and len(r.step_times_each) == len(cut) else None)
        bs.append(float(r.plan.workload.batch.local(r.plan.mesh.world_size)))
        prof.append(r.host)
        hosts.append(run_host_time(r) if N.shape[1] == 1 else None)
        bounds.append(run_host_bound(r) if N.shape[1] == 1 else None)
    if not names:
        return None
    speed: tuple[float, ...] = ()
    reference: dict[str, float] = {}
    if host_speed and all(p is not None and p.op_median_us for p in prof):
        reference = host_reference_us(prof)
        ks = [host_speed_index(p, reference) for p in prof]
        if reference and all(x is not None for x in ks):
            speed = tuple(float(x) for x in ks)
    g = 0.0
    if fit_device_factor and form == "max":
        common = dict(per_sample=per_sample, speed=speed or None, segments=segments, step_measured=per_step,
                      host_measured=hosts)
        h, s, f = fit_step_terms(meas, dev, nl, bs, **common) if device_term != "gap" else (0.0, 0.0, 1.0)
        if gaps:
            hg, sg, g, loss_g = fit_gap_terms(meas, dev, nl, nds, bs, **common)
            loss_f = (device_term_loss(meas, dev, nl, bs, speed or None, segments, per_step, hosts, h, s, f)
                      if device_term == "best" else math.inf)
            if loss_g < loss_f * (1 - 1e-9):
                h, s, f = hg, sg, 1.0
            else:
                g = 0.0
    else:
        (h, s), f = fit_host_terms(meas, dev, nl, bs, form=form, per_sample=per_sample, speed=speed or None,
                                   segments=segments, step_measured=per_step, host_measured=hosts), 1.0
    if all(x is None for x in hosts):
        h, s = cap_by_host_bounds(h, s, nl, bs, speed or None, bounds)
    return HostFit(h, tuple(names), tuple(meas), tuple(dev), tuple(nl), form, s, tuple(bs), speed, reference, f,
                   tuple(segments), tuple(hosts), g, tuple(nds) if g else ())


_SLOPE_S = 1e-6
"""The launch-cost step the device launches are read off with (the pricer is linear in it)."""

DEVICE_TERMS = ("best", "factor", "gap")
"""How ``coplan calibrate`` fits the device work no priced op accounts for (:func:`fit_host_launch_cost`)."""


def run_host_bound(r: RunSamples) -> float | None:
    """An upper bound on run ``r``'s host seconds per step: its recorded host time (``host_step`` p50), the host's
    own work plus whatever it waited on the device; None where the summary has none."""
    res = r.result
    if res is None or res.host_step is None or res.host_step.p50_s <= 0:
        return None
    return float(res.host_step.p50_s)


def cap_by_host_bounds(h: float, s: float, launches: Sequence[float], batch: Sequence[float],
                       speed: Sequence[float] | None, bounds: Sequence[float | None]) -> tuple[float, float]:
    """``(h, s)`` scaled down, together, until no run's host time under them (``k · (launches · h + batch ·
    s)``) exceeds what that run recorded (:func:`run_host_bound`). For fits where no run measured the host's
    own time (all device-bound): their host terms come from step times alone, and nothing else keeps them
    from predicting a host slower than any host seen. Why: on the H100's fresh draws (fresh_plans_h100c,
    2026-12-06) the fit without the one host-bound draw priced it at 31 ms of host a step; every run had
    recorded 8-138 ms, the small ones 9-11 ms."""
    if h <= 0 and s <= 0:
        return h, s
    worst = 1.0
    for j, b in enumerate(bounds):
        if b is None or b <= 0:
            continue
        k = 1.0 if speed is None else float(speed[j])
        pred = k * (float(launches[j]) * h + float(batch[j]) * s)
        if pred > b:
            worst = min(worst, b / pred)
    return h * worst, s * worst


HOST_UNBLOCKED = 0.9
"""A run issued without CUDA graphs counts its measured host time as the host's own only below this share of
its step: above it the host may have waited on the device (a full launch queue blocks the launching call), so
that time bounds the host's cost without measuring it."""

HOST_BOUND_BUSY = 0.8
"""A run whose profiled steps kept the device busy for at least this share of its measured step is device-bound:
its host time is not counted as the host's own, graphed or not. The host phases are wall-clock laps with no
device sync of their own, and any call that waits on the device (a read-back, an allocator or TorchRec call
that syncs) charges the wait to its phase. Why: on the lent H100 (fresh_plans_h100c, 2026-12-06), graphed
device-bound runs recorded host steps of 56-130 ms for a few hundred launches (an optimizer phase of 34 ms,
a backward of 71 ms), and fitting them as host costs gave 615 us per priced launch and predicted a
host-bound draw 2.6x its measured step (benchmarks/results/calibration_loo_h100.json)."""


def run_host_time(r: RunSamples) -> float | None:
    """The host's own seconds per step of run ``r`` (``summary.json``'s ``host_step`` p50, over the steps its
    step time is over), or None where it is not known to be the host's. A run replayed as CUDA graphs issues
    a handful of launches per step and never fills the launch queue; an eager run's host time counts below
    :data:`HOST_UNBLOCKED` of its step. Either way, a device-bound run's does not (:data:`HOST_BOUND_BUSY`,
    read from the profiled steps' device busy time where the trace has one)."""
    res = r.result
    if res is None or res.host_step is None or res.step_time is None or res.host_step.p50_s <= 0:
        return None
    graphed = res.options is not None and res.options.cuda_graphs
    if not (graphed or res.host_step.p50_s < HOST_UNBLOCKED * res.step_time.p50_s):
        return None
    busy = r.window_s - r.idle_s
    if r.window_s > 0 and busy >= HOST_BOUND_BUSY * res.step_time.p50_s:
        return None
    return float(res.host_step.p50_s)


__all__ = ["DEVICE_FACTOR_PRIOR", "DEVICE_FACTOR_RANGE", "DEVICE_GAP_RANGE", "DEVICE_TERMS", "device_term_loss", "fit_gap_terms",
           "gap_shift", "HOST_FORMS", "HOST_BOUND_BUSY", "HOST_UNBLOCKED", "cap_by_host_bounds", "run_host_bound", "run_host_time", "HOST_SYNCING_BACKENDS", "HostFit", "Segments",
           "fit_host_launch_cost", "fit_host_terms", "fit_step_terms", "refine_on_grid"]
