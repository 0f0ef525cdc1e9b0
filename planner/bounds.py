"""What no plan of a mesh candidate can beat, in time and in memory.

The search orders and prunes candidates by these bounds (:mod:`coplan.planner.search`), and the
explanation of an infeasible problem reads its shortfall off the same memory floor
(:mod:`coplan.planner.explain`), so both import them from here. A bound is read at the candidate's
**floor point** (every aggregate a table placement adds at the least any placement can give it), plus
the least recompute its memory needs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from coplan.planner.costs import Pricer
from coplan.planner.pricing import VARS, CandidatePricing, LayerOption, option_arrays
from coplan.planner.recompute import frontier


def recompute_floor(p: CandidatePricing, need_bytes: float, times: dict[str, float] | None = None) -> float:
    """Least recompute time that frees ``need_bytes`` net of the recompute peak, with each layer at
    ``times[name]`` (default its recompute time): exact, from the recompute frontier; when the frontier
    is too large to build, for each possible peak a fractional knapsack over the layers no bigger than
    it. A valid lower bound either way; inf when even recomputing everything cannot free enough."""
    if need_bytes <= 0:
        return 0.0
    layers = p.layers if times is None else tuple(LayerOption(l.name, times.get(l.name, 0.0), l.saved_bytes, l.peak_bytes) for l in p.layers)
    front = frontier(layers)
    if front is not None:
        return front.least_time(need_bytes)
    useful = [l for l in layers if l.saved_bytes > 0]
    best = math.inf
    for peak in sorted({l.peak_bytes for l in useful}):
        need = need_bytes + peak
        t = 0.0
        for l in sorted((l for l in useful if l.peak_bytes <= peak), key=lambda l: l.recompute_s / l.saved_bytes):
            take = min(1.0, need / l.saved_bytes)
            t += take * l.recompute_s
            need -= take * l.saved_bytes
            if need <= 0:
                break
        if need <= 0:
            best = min(best, t)
    return best


def most_freed(p: CandidatePricing) -> float:
    """The most memory recompute can free: all layers up to some peak size, minus that peak."""
    return max([0.0] + [sum(l.saved_bytes for l in p.layers if l.peak_bytes <= pk) - pk for pk in {l.peak_bytes for l in p.layers}])


@dataclass(frozen=True, slots=True)
class CandidateBound:
    """What pricing a candidate's floor point proves."""

    lower_bound_s: float
    """No plan of this candidate prices below this."""
    memory_floor_bytes: float
    """No plan of this candidate needs less memory on its fullest rank (every layer recomputed)."""
    floor_step_s: float
    """The pricer's step at the floor point."""


def memory_without_recompute(pricer: Pricer, p: CandidatePricing) -> float:
    """The least memory of the candidate's fullest rank with nothing recomputed: tables spread as
    thinly as their options allow."""
    f = pricer.floor(p)
    return p.base_bytes + f.mem_bytes + p.recv_mem_factor * f.recv_bytes


def memory_floor(pricer: Pricer, p: CandidatePricing) -> float:
    """No plan of the candidate needs less memory on its fullest rank: tables spread as thinly as
    their options allow, and recompute freeing the most it can (:func:`most_freed`)."""
    return memory_without_recompute(pricer, p) - most_freed(p)


def candidate_bound(pricer: Pricer, p: CandidatePricing, floor_cost) -> CandidateBound:
    """What no plan of the candidate can beat: the larger of the floor point's price and the joint
    bound of its cuts (:func:`joint_floor`), each with the least recompute its memory needs."""
    mem_no_rc = memory_without_recompute(pricer, p)
    mem_floor = mem_no_rc - most_freed(p)
    need = mem_no_rc - p.capacity_bytes
    cut = floor_cost.cuts[0] if floor_cost.cuts else None
    times = dict(cut.rc_s) if cut is not None else {}
    at_floor = float(floor_cost.step_time_s) - (cut.slack_s if cut is not None else 0.0) + recompute_floor(p, need, times)
    return CandidateBound(max(at_floor, joint_floor(p, need)), mem_floor, float(floor_cost.step_time_s))


def joint_floor(p: CandidatePricing, need_bytes: float, iterations: int = 16) -> float:
    """A lower bound of the candidate's step that keeps every table to one option.

    Each aggregate is at least what the average rank carries (per-rank loads: the options' loads times
    their share of the ranks; the all-to-alls at least half their senders' and receivers' volumes), so
    each cut is at least a sum over tables of what the table's option adds to it. A convex combination
    of the cuts (weights λ) is below their maximum, and its least over option choices separates by
    table: ``L(λ) = Σ_k λ_k (c_k − slack_k) + Σ_t min_o Σ_k λ_k cut_k(o) + least recompute``. Any λ gives
    a valid bound; a few projected subgradient steps look for a good one."""
    if not p.cuts or not p.options:
        return 0.0
    arr = option_arrays(p)
    s = p.group_size
    share = np.where(arr.place == 2, 1.0, np.array([o.num_shards for opts in p.options for o in opts], dtype=float) / s)
    avg = arr.vec * share[:, None]                      # (options, 5) per-rank loads of an average rank
    A = np.zeros((avg.shape[0], len(VARS)))            # (options, 6) in VARS order
    A[:, 0], A[:, 1] = avg[:, 0], avg[:, 1]
    A[:, 2] = 0.5 * (avg[:, 2] + p.recv_factor * arr.recv)
    A[:, 3] = 0.5 * (avg[:, 3] + arr.ids_send)
    A[:, 4] = arr.dp
    A[:, 5] = avg[:, 4]
    base = np.zeros(len(VARS))
    base[0], base[1] = p.launch_s
    N = np.array([[c.coef.get(v, 0.0) for v in VARS] for c in p.cuts])          # (cuts, 6)
    C = np.array([c.const_s - c.slack_s for c in p.cuts]) + N @ base
    R = {l.name: np.array([c.rc_s.get(l.name, 0.0) for c in p.cuts]) for l in p.layers}
    starts = arr.off[:-1]

    tid = np.repeat(np.arange(len(starts)), np.diff(arr.off))

    def value(lam: np.ndarray) -> tuple[float, np.ndarray]:
        per_opt = A @ (N.T @ lam)
        order = np.lexsort((per_opt, tid))  # by table, cheapest option first
        pick = order[arr.off[:-1]]
        grad = C + N @ A[pick].sum(axis=0)
        return float(lam @ C + per_opt[pick].sum()), grad

    K = len(p.cuts)
    best_val, best_lam = -np.inf, np.full(K, 1.0 / K)
    lam = best_lam.copy()
    for k in range(K):
        v, _ = value(np.eye(K)[k])
        if v > best_val:
            best_val, best_lam = v, np.eye(K)[k]
    lam = best_lam.copy()
    for it in range(iterations):
        v, g = value(lam)
        if v > best_val:
            best_val, best_lam = v, lam.copy()
        step = 1.0 / (it + 2)
        lam = lam + step * (g - g.mean()) / max(float(np.abs(g - g.mean()).max()), 1e-300)
        lam = np.clip(lam, 0.0, None)
        lam = lam / lam.sum() if lam.sum() > 0 else np.full(K, 1.0 / K)
    times = {n: float(best_lam @ r) for n, r in R.items()}
    return best_val + recompute_floor(p, need_bytes, times)


__all__ = ["CandidateBound", "candidate_bound", "joint_floor", "memory_floor", "memory_without_recompute", "most_freed", "recompute_floor"]
