"""Exhaustive search of one candidate's plans: every option of every table, every placement of its
shards, every recompute set, evaluated with the planner's own formula (:func:`evaluate`).

Two exact reductions only: within a node, ranks that hold nothing yet are interchangeable, so a
shard goes either to a rank already in use or to the lowest unused ones; and a partial plan whose
step (with the best recompute for its memory so far) already reaches the best complete plan is not
extended, because every term of the step and of memory only grows as tables are added. Recompute
is enumerated for every plan (all 2^L subsets, vectorised).
"""

from __future__ import annotations

import itertools
import math

import numpy as np

from coplan.planner.pricing import Assignment, CandidatePricing, evaluate


def _subsets(p: CandidatePricing):
    L = len(p.layers)
    rows = []
    for bits in itertools.product((False, True), repeat=L):
        t = sum(l.recompute_s for l, on in zip(p.layers, bits) if on)
        saved = sum(l.saved_bytes for l, on in zip(p.layers, bits) if on)
        peak = max((l.peak_bytes for l, on in zip(p.layers, bits) if on), default=0.0)
        rows.append((t, peak - saved, bits))
    return np.array([r[0] for r in rows]), np.array([r[1] for r in rows]), [r[2] for r in rows]


def brute_force(p: CandidatePricing, initial_best: float = math.inf) -> tuple[float, Assignment | None, int]:
    """(best step time, a best assignment, plans enumerated); inf when nothing fits (or nothing beats
    ``initial_best``, a step time known to be reachable elsewhere)."""
    s, g = p.group_size, max(1, p.node_size)
    rc_time, rc_mem, rc_bits = _subsets(p)
    n_t = len(p.options)
    best = [initial_best, None]
    count = [0]
    choice = [0] * n_t
    ranks: list[tuple[int, ...]] = [()] * n_t

    def fresh(used: set[int], n: int) -> list[int]:
        """The lowest unused ranks of each node, at most n per node (unused ranks of a node are interchangeable)."""
        out = []
        for node in range(s // g):
            free = [r for r in range(node * g, (node + 1) * g) if r not in used][:n]
            out += free
        return out

    def leaf():
        count[0] += 1
        a = Assignment(tuple(choice), tuple(ranks), tuple(False for _ in p.layers))
        ev = evaluate(p, a)
        ok = ev.peak_bytes + rc_mem <= p.capacity_bytes
        if not ok.any():
            return
        k = int(np.argmin(np.where(ok, rc_time, np.inf)))
        step = ev.step_time_s + rc_time[k]
        if step < best[0] - 1e-15:
            best[0] = step
            best[1] = Assignment(tuple(choice), tuple(ranks), tuple(rc_bits[k]))

    def partial_bound(t: int) -> float:
        """Step of the tables placed so far (the rest as nothing) with the best feasible recompute."""
        sub = CandidatePricing(p.mesh, p.node_size, p.base_time_s, p.base_bytes, p.capacity_bytes, p.layers,
                               p.options[:t], p.table_names[:t], p.a2a_s_per_byte, p.recv_factor, p.recv_mem_factor, p.dp_s_per_byte)
        ev = evaluate(sub, Assignment(tuple(choice[:t]), tuple(ranks[:t]), tuple(False for _ in p.layers)))
        ok = ev.peak_bytes + rc_mem <= p.capacity_bytes
        return ev.step_time_s + float(rc_time[ok].min()) if ok.any() else math.inf

    def rec(t: int, used: frozenset[int]):
        if t == n_t:
            leaf()
            return
        if t and partial_bound(t) >= best[0]:
            return
        for i, o in enumerate(p.options[t]):
            choice[t] = i
            if o.placement == "all":
                ranks[t] = ()
                rec(t + 1, used)
            elif o.placement == "node":
                seen_fresh = False
                for node in range(s // g):
                    rr = tuple(range(node * g, (node + 1) * g))
                    is_fresh = not (set(rr) & used)
                    if is_fresh and seen_fresh:
                        continue  # empty nodes are interchangeable
                    seen_fresh |= is_fresh
                    ranks[t] = rr
                    rec(t + 1, used | set(rr))
            else:
                pool = sorted(used) + fresh(set(used), o.num_shards)
                seen = set()
                for rr in itertools.combinations(pool, o.num_shards):
                    key = _canon(rr, used, g)
                    if key in seen:
                        continue
                    seen.add(key)
                    ranks[t] = tuple(rr)
                    rec(t + 1, used | set(rr))
        ranks[t] = ()

    rec(0, frozenset())
    return best[0], best[1], count[0]


def _canon(rr, used, g):
    """Placements that differ only in which unused ranks of a node they take are the same."""
    key = []
    for r in rr:
        if r in used:
            key.append(("u", r))
        else:
            key.append(("f", r // g))
    return tuple(sorted(key))
