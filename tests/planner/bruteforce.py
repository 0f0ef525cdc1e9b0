"""Exhaustive search of one candidate's plans: every option of every table, every placement of its
shards, every recompute set, evaluated with the candidate's step model (:func:`evaluate`: the largest
of its cuts).

Two exact reductions only: within a node, ranks that hold nothing yet are interchangeable, so a
shard goes either to a rank already in use or to the lowest unused ones; and a partial plan whose
step (with the best recompute for its memory so far) already reaches the best complete plan is not
extended, because every cut's coefficients are non-negative, so every term of the step and of memory
only grows as tables are added. Recompute is enumerated for every plan (all 2^L subsets).
"""

from __future__ import annotations

import dataclasses
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

    def best_of(q: CandidatePricing, a: Assignment) -> tuple[float, int]:
        """Least model step over the recompute sets with which ``a`` fits, and that set's index."""
        ev = evaluate(q, a)
        ok = ev.peak_bytes + rc_mem <= p.capacity_bytes
        if not ok.any():
            return math.inf, -1
        steps = [evaluate(q, Assignment(a.choice, a.ranks, tuple(rc_bits[k]))).step_time_s if ok[k] else math.inf
                 for k in range(len(rc_bits))]
        k = int(np.argmin(steps))
        return steps[k], k

    def leaf():
        count[0] += 1
        a = Assignment(tuple(choice), tuple(ranks), tuple(False for _ in p.layers))
        step, k = best_of(p, a)
        if step < best[0] - 1e-15:
            best[0] = step
            best[1] = Assignment(tuple(choice), tuple(ranks), tuple(rc_bits[k]))

    def partial_bound(t: int) -> float:
        """Step of the tables placed so far (the rest as nothing) with the best feasible recompute."""
        sub = dataclasses.replace(p, options=p.options[:t], table_names=p.table_names[:t], cache={})
        return best_of(sub, Assignment(tuple(choice[:t]), tuple(ranks[:t]), tuple(False for _ in p.layers)))[0]

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


def priced_brute_force(pricer, p: CandidatePricing) -> tuple[float, Assignment | None, int]:
    """The least *priced* step of a candidate (the cost model's full pricer, not the planner's model):
    every option and placement of every table (interchangeable unused ranks reduced as above), and for
    each every *minimal* recompute set with which it fits in the pricer's own memory (recomputing more
    only adds work); placements that give the pricer the same aggregates and memory are priced once.
    Returns (step, plan, plans priced)."""
    s, g = p.group_size, max(1, p.node_size)
    n_t = len(p.options)
    L = len(p.layers)
    subsets = list(itertools.product((False, True), repeat=L))
    best = [math.inf, None]
    seen: set = set()
    priced = [0]
    choice = [0] * n_t
    ranks: list[tuple[int, ...]] = [()] * n_t

    def fresh(used: set[int], n: int) -> list[int]:
        out = []
        for node in range(s // g):
            out += [r for r in range(node * g, (node + 1) * g) if r not in used][:n]
        return out

    def leaf():
        a0 = Assignment(tuple(choice), tuple(ranks), tuple(False for _ in p.layers))
        ev = evaluate(p, a0)
        key = (tuple(round(v, 15) for v in ev.x.values()), round(ev.peak_bytes, 3))
        if key in seen:
            return
        seen.add(key)
        fitting: list[tuple[bool, ...]] = []
        for rc in sorted(subsets, key=sum):
            if any(all(x <= y for x, y in zip(f, rc)) for f in fitting):
                continue  # a subset of it already fits
            a = Assignment(a0.choice, a0.ranks, rc)
            cost = pricer.price(p, a)
            priced[0] += 1
            if cost.fits:
                fitting.append(rc)
                if cost.step_time_s < best[0]:
                    best[0], best[1] = float(cost.step_time_s), a

    def rec(t: int, used: frozenset[int]):
        if t == n_t:
            leaf()
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
                        continue
                    seen_fresh |= is_fresh
                    ranks[t] = rr
                    rec(t + 1, used | set(rr))
            else:
                pool = sorted(used) + fresh(set(used), o.num_shards)
                keys = set()
                for rr in itertools.combinations(pool, o.num_shards):
                    k = _canon(rr, used, g)
                    if k in keys:
                        continue
                    keys.add(k)
                    ranks[t] = tuple(rr)
                    rec(t + 1, used | set(rr))
        ranks[t] = ()

    if not p.options:
        for rc in subsets:
            a = Assignment((), (), rc)
            cost = pricer.price(p, a)
            priced[0] += 1
            if cost.fits and cost.step_time_s < best[0]:
                best[0], best[1] = float(cost.step_time_s), a
        return best[0], best[1], priced[0]
    rec(0, frozenset())
    return best[0], best[1], priced[0]
