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
"""

from __future__ import annotations

import math

from coplan.costmodel.results import Goodput
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


def goodput(topology: Topology, state_bytes: float, num_gpus: int, *, interval_s: float | None = None) -> Goodput:
    """Goodput of a job of ``num_gpus`` GPUs checkpointing ``state_bytes`` (optimal interval unless given)."""
    lam = failure_rate_per_s(topology, num_gpus)
    mtbf = 1.0 / lam
    delta = checkpoint_write_s(topology, state_bytes, num_gpus)
    tau = daly_interval(delta, mtbf) if interval_s is None else interval_s
    R = topology.reliability.restart_s
    return Goodput(state_bytes, delta, lam * 3600.0, mtbf, tau, R, useful_fraction(tau, delta, R, mtbf))


__all__ = ["checkpoint_write_s", "daly_interval", "failure_rate_per_s", "goodput", "useful_fraction"]
