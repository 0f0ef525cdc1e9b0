"""Goodput: checkpoint cost, failure rate and the optimal checkpoint interval.

- Checkpoint state: dense parameters and optimizer state (master dtype) plus every embedding table
  with its optimizer state; written in parallel by all nodes, each at its storage bandwidth, under
  the storage system's aggregate ceiling. The write is counted as blocking (synchronous
  ``torch.distributed.checkpoint``); an asynchronous save would hide most of it.
- Failures: independent, exponential. Job failure rate ``λ = N_gpu / MTBF_gpu + Σ_tiers N_switch /
  MTBF_switch`` where a tier with ``mtbf_hours`` has one switch per group of that tier in use.
- Interval: Daly's higher-order estimate (Daly 2006, "A higher order estimate of the optimum
  checkpoint interval for restart dumps", FGCS 22): ``τ = √(2δM)·[1 + ⅓√(δ/2M) + δ/(18M)] − δ`` for
  ``δ < 2M`` (else ``τ = M``), which reduces to Young's ``√(2δM)`` (Young 1974) for small δ.
- Useful fraction: each interval ``τ`` of work costs ``τ + δ``, and each failure (rate ``1/M``) loses
  the restart time ``R`` plus on average half an interval with its checkpoint:
  ``f = τ/(τ+δ) · max(0, 1 − (R + (τ+δ)/2) / M)``.
- Stragglers and jitter: a synchronous step ends when its slowest rank does. With each rank's step time
  ``step · (1 + cv · Z_r)``, ``Z_r`` independent standard normals, the expected step is
  ``step · (1 + cv · E[max of N normals])`` (:func:`expected_max_normal`; 0 on one rank, ~3.9 at 4,096
  ranks). ``cv`` is :data:`DEFAULT_STEP_JITTER_CV` unless given. The goodput's fraction divides by that
  stretch, so that goodput MFU carries it; the step (the planner's objective) does not, since it
  scales every plan of a world size alike.
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np

from coplan.costmodel.results import Goodput

DEFAULT_STEP_JITTER_CV = 0.02
"""Coefficient of variation of one rank's step time around its mean (assumption, stated: OS and network
noise, clocks, stragglers of a busy cluster; on one H200 the device-bound sampled draws' steps varied by
well under 1% and the host-bound ones by ~10-20%). A calibration of multi-rank runs should replace it."""


@lru_cache(maxsize=256)
def expected_max_normal(n: int) -> float:
    """E[max of ``n`` independent standard normals] (0 for n <= 1), by quadrature of ``n·x·φ(x)·Φ(x)^(n−1)``."""
    if n <= 1:
        return 0.0
    x = np.linspace(-9.0, 9.0, 20001)
    phi = np.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi)
    from math import erf

    cdf = 0.5 * (1.0 + np.vectorize(erf)(x / math.sqrt(2.0)))
    with np.errstate(divide="ignore"):
        logp = np.where(cdf > 0, (n - 1) * np.log(np.maximum(cdf, 1e-300)), -np.inf)
    dens = n * phi * np.exp(logp)
    return float(np.trapezoid(x * dens, x) if hasattr(np, "trapezoid") else np.trapz(x * dens, x))


def jitter_stretch(num_ranks: int, cv: float = DEFAULT_STEP_JITTER_CV) -> float:
    """The expected relative excess of a synchronous step over one rank's mean step: ``cv · E[max of N]``."""
    return max(0.0, cv) * expected_max_normal(max(1, int(num_ranks)))
from coplan.spec.topology import Topology


def failure_rate_per_s(topology: Topology, num_gpus: int) -> float:
    """Expected job interruptions per second on ``num_gpus`` GPUs of ``topology``."""
    lam = num_gpus / (topology.reliability.gpu_mtbf_hours * 3600.0)
    for j, t in enumerate(topology.tiers):
        if t.mtbf_hours:
            switches = math.ceil(num_gpus / topology.gpus_within(j))
            lam += switches / (t.mtbf_hours * 3600.0)
    return lam


def checkpoint_write_s(topology: Topology, state_bytes: float, num_gpus: int) -> float:
    nodes = max(1, math.ceil(num_gpus / topology.gpus_per_node))
    r = topology.reliability
    bw = nodes * r.checkpoint_bw_bytes_per_s_per_node
    if r.checkpoint_aggregate_bw_bytes_per_s:
        bw = min(bw, r.checkpoint_aggregate_bw_bytes_per_s)
    return state_bytes / bw


def daly_interval(delta_s: float, mtbf_s: float) -> float:
    if delta_s <= 0:
        return 0.0
    if delta_s >= 2.0 * mtbf_s:
        return mtbf_s
    x = delta_s / (2.0 * mtbf_s)
    return math.sqrt(2.0 * delta_s * mtbf_s) * (1.0 + math.sqrt(x) / 3.0 + x / 9.0) - delta_s


def useful_fraction(interval_s: float, delta_s: float, restart_s: float, mtbf_s: float) -> float:
    if interval_s <= 0:
        return max(0.0, 1.0 - restart_s / mtbf_s)
    f = interval_s / (interval_s + delta_s) * (1.0 - (restart_s + (interval_s + delta_s) / 2.0) / mtbf_s)
    return max(0.0, f)


def goodput(topology: Topology, state_bytes: float, num_gpus: int, *, interval_s: float | None = None,
            jitter_cv: float = DEFAULT_STEP_JITTER_CV) -> Goodput:
    """Goodput of a job of ``num_gpus`` GPUs checkpointing ``state_bytes`` (optimal interval unless given),
    stragglers and jitter included (:func:`jitter_stretch`)."""
    lam = failure_rate_per_s(topology, num_gpus)
    mtbf = 1.0 / lam
    delta = checkpoint_write_s(topology, state_bytes, num_gpus)
    tau = daly_interval(delta, mtbf) if interval_s is None else interval_s
    R = topology.reliability.restart_s
    j = jitter_stretch(num_gpus, jitter_cv)
    return Goodput(state_bytes, delta, lam * 3600.0, mtbf, tau, R, useful_fraction(tau, delta, R, mtbf) / (1.0 + j), j)


__all__ = ["DEFAULT_STEP_JITTER_CV", "checkpoint_write_s", "daly_interval", "expected_max_normal", "failure_rate_per_s",
           "goodput", "jitter_stretch", "useful_fraction"]
