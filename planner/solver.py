"""CP-SAT for one mesh candidate: a sharding option and ranks per table, recompute per layer, under
per-rank HBM, minimising the candidate's step model (:mod:`coplan.planner.pricing`: the largest of
its cuts, each one path of the pricer's schedule, linear in the solution's aggregates).

Two formulations:

- **flat** (small groups): one boolean per (table, option), per (table, option, rank) for shards the
  solver places on ranks and per (table, option, node) for table-row-wise; per-rank sums of the five
  per-rank loads (forward, backward, output bytes sent, id bytes received, replicated state) and of
  memory; their maxima; the step variable above every cut. Exact for the model (the brute-force
  tests check it). HBM is a constraint whatever the candidate holds: a dense-only candidate still
  chooses its recompute set under it.
- **decomposed** (large groups: 1,200 tables over thousands of ranks would need millions of
  booleans): the ranks of a shard group are identical, so CP-SAT chooses the option of every table and
  the recompute set over *aggregated* loads. That is a relaxation: each maximum over ranks is at least
  the uniform part plus the average of what is placed, and at least the uniform part plus the shards
  of any one table; the same for memory. Recompute is one choice among the Pareto-optimal recompute
  sets (:mod:`coplan.planner.recompute`). Its optimum is a lower bound of the model's. The last few
  improving relaxed solutions are placed on ranks (vector list scheduling with memory checks, then
  local search on the loads that set the cuts), and the best kept; the gap is reported against the
  relaxation's proven bound.

Integers: each aggregate in units of 10 ns of one schedule task's time (a cut's coefficient is then
the number of such tasks on its path: a small integer, scaled by ``Q`` when a calibrated device-step
factor makes it fractional), memory in KiB with item memory rounded up and capacity down, so a plan
CP-SAT accepts fits in bytes.

Determinism: with several workers CP-SAT runs ``interleave_search`` under a *deterministic* time
limit, so the same inputs and seed give the same plan whatever the machine load; a wall-clock limit
far above it only guards against runaway solves.
"""

from __future__ import annotations

import heapq
import math
import time
from dataclasses import dataclass, replace

import numpy as np
from ortools.sat.python import cp_model

from coplan.errors import PriceRangeError
from coplan.planner.pricing import (
    LOADS,
    VARS,
    Assignment,
    CandidatePricing,
    copies,
    evaluate,
    loads,
    recompute_memory,
    shard_weight,
    step_model,
    weights,
    x_vector,
)
from coplan.planner.recompute import frontier

TIME_UNIT_S = 1e-8
"""One CP-SAT time unit: 10 ns."""

MEM_UNIT = 1024
"""One CP-SAT memory unit: 1 KiB."""


@dataclass(frozen=True, slots=True)
class SolveResult:
    """The best solution of one candidate and what is proven about it (in the candidate's model)."""

    assignment: Assignment | None
    """None when infeasible or when no solution was found."""

    status: str
    """OPTIMAL, FEASIBLE, INFEASIBLE or UNKNOWN, for the candidate as a whole."""

    step_time_s: float
    """The model's step of the solution (inf when none)."""

    peak_bytes: float
    """Memory of the fullest rank."""

    bound_s: float
    """Proven lower bound on the candidate's optimal model step."""

    wall_s: float
    """Time spent."""

    method: str
    """'flat', 'decomposed' or 'heuristic'."""

    @property
    def gap(self) -> float:
        if not math.isfinite(self.step_time_s) or self.step_time_s <= 0:
            return 0.0
        return max(0.0, (self.step_time_s - self.bound_s) / self.step_time_s)


@dataclass(frozen=True, slots=True)
class SolverSettings:
    """How hard to search."""

    time_limit_s: float = 10.0
    """Deterministic-time budget of one CP-SAT solve (OR-Tools 'deterministic seconds')."""

    num_workers: int = 1
    """CP-SAT search workers."""

    seed: int = 0
    """CP-SAT random seed."""

    flat_max_vars: int = 1_500
    """Above this many placement booleans the decomposed formulation is used (the flat model's presolve
    alone took a whole 1-second budget at 10,000: 536 tables over 8 ranks)."""

    relative_gap: float = 1e-4
    """Stop a solve once proven within this relative gap."""

    placed_solutions: int = 3
    """Decomposed model: the last this many improving relaxed solutions are each placed on ranks, and
    the best placed plan kept."""

    free_tables: int | None = None
    """Decomposed model: tables that get choice variables (the most consequential first); None:
    :data:`FREE_TABLES`."""

    rebalance_steps: int = 200
    """Moves of :func:`rebalance` on a placed plan."""

    slack_free_bound: bool = True
    """Solve a candidate's model once more for its bound alone, when the first solve did not close its
    gap: every cut less its own SM-contention slack (each then a lower bound of the priced step at any
    aggregates, so nothing is subtracted from the bound; the first solve's bound subtracts the largest
    slack of all cuts), and in the decomposed model every table free."""


def _t(x: float) -> int:
    return int(round(x / TIME_UNIT_S))


def _m_up(x: float) -> int:
    return int(math.ceil(x / MEM_UNIT))


def _m_down(x: float) -> int:
    return int(math.floor(x / MEM_UNIT))


def _params(solver, s: SolverSettings, time_limit_s: float) -> None:
    solver.parameters.num_workers = max(1, int(s.num_workers))
    solver.parameters.random_seed = int(s.seed)
    solver.parameters.max_deterministic_time = float(time_limit_s)
    solver.parameters.max_time_in_seconds = float(time_limit_s) * 20 + 30
    solver.parameters.relative_gap_limit = float(s.relative_gap)
    if s.num_workers > 1:
        solver.parameters.interleave_search = True


def placement_vars(p: CandidatePricing) -> int:
    n = 0
    for opts in p.options:
        for o in opts:
            n += p.group_size if o.placement == "rank" else p.num_nodes if o.placement == "node" else 0
    return n


def solve_candidate(p: CandidatePricing, settings: SolverSettings, *, hint: Assignment | None = None,
                    cutoff_s: float | None = None) -> SolveResult:
    """Best plan of one candidate under its model: flat when small, decomposed otherwise. ``cutoff_s``:
    only plans faster than this are sought (see :func:`solve_decomposed`)."""
    if not p.cuts:
        raise ValueError("a candidate needs at least one cut before it is solved (Pricer.candidate prices one)")
    h = hint if hint is not None and evaluate(p, hint).peak_bytes <= p.capacity_bytes else heuristic_any(p)
    flat = placement_vars(p) <= settings.flat_max_vars
    n_t = len(p.options)
    free = (n_t if n_t <= ALL_FREE_TABLES else FREE_TABLES) if settings.free_tables is None else settings.free_tables
    if flat:
        res = solve_flat(p, settings, hint=h, cutoff_s=cutoff_s)
    else:
        res = solve_decomposed(p, settings, cutoff_s=cutoff_s, free_tables=free, hint=h)
    if not settings.slack_free_bound or res.status == "INFEASIBLE" or not math.isfinite(res.step_time_s) \
            or res.bound_s >= res.step_time_s * (1 - settings.relative_gap):
        return res
    # A second solve for the bound alone: every cut less its own slack, and (decomposed) every table
    # with its own choice variables (the first solve's fixed tables enter its relaxation with the least
    # of each load over their options, separately: a weak bound with many tables).
    q = slack_free(p)
    free_b = n_t if n_t <= ALL_FREE_TABLES else free
    if q is None and (flat or free_b <= free):
        return res
    q = q if q is not None else p
    hq = res.assignment if res.assignment is not None else h
    if flat:
        rq = solve_flat(q, settings, hint=hq, cutoff_s=cutoff_s, bound_only=True)
    else:
        rq = solve_decomposed(q, settings, cutoff_s=cutoff_s, free_tables=free_b, hint=hq, bound_only=True)
    if not math.isfinite(rq.bound_s):
        return res
    return replace(res, bound_s=min(max(res.bound_s, rq.bound_s), res.step_time_s), wall_s=res.wall_s + rq.wall_s)


def slack_free(p: CandidatePricing) -> CandidatePricing | None:
    """The candidate with every cut less its own contention slack (None when no cut holds any): a
    model whose every cut is a lower bound of the priced step at any aggregates, so that its proven
    bound is one with nothing subtracted (see :attr:`coplan.costmodel.results.StepCut.slack_s`)."""
    if cut_slack(p) <= 0:
        return None
    cuts = tuple(replace(c, const_s=c.const_s - c.slack_s, slack_s=0.0) for c in p.cuts)
    return replace(p, cuts=cuts, cache={})


# ---------------------------------------------------------------------------------------------
# Integer model of the cuts
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _IntCuts:
    """The cuts in solver integers: ``z ≥ const + Σ_v n[v]·X_v + Σ_l rc[l]·rc_l`` with ``X_v`` in 10 ns
    of one task (``scale[v]`` seconds per raw unit) and ``z`` in 10 ns / Q."""

    Q: int
    const: tuple[int, ...]
    n: tuple[dict[str, int], ...]
    rc: tuple[tuple[int, ...], ...]
    used: tuple[str, ...]
    on: tuple[dict[str, int], ...] = ()
    """Per cut, constants charged when an aggregate is positive (a collective's latency)."""
    """Aggregates some cut charges (the others are not modelled)."""

    def unit(self, p: CandidatePricing, v: str, raw: float) -> int:
        return _t(raw * p.scale.get(v, 0.0))


MAX_MODEL_INT = 1 << 60
"""Largest magnitude any bound or summed coefficient of a CP-SAT model may reach (CP-SAT's domains hold
int64, and a constraint sums a few such terms). In time units it is ~7e9 s (over 200 years) of step on
one rank, in memory units ~1.2e21 bytes: no realistic input comes near (one that does holds a unit slip
or an absurd size the spec's bounds did not catch alone)."""


def _finite_prices(p: CandidatePricing) -> None:
    """Refuse a candidate whose priced times or bytes are not finite numbers (a typed error naming which), before
    they are rounded into the model's integers."""
    def groups():
        yield "the per-rank memory and buffers", (p.base_bytes, p.capacity_bytes, p.dp_comm_bytes, *p.launch_s,
                                                  p.recv_factor, p.recv_mem_factor, *p.scale.values())
        for k, c in enumerate(p.cuts):
            yield f"step cut {k} ({c.source})", (c.const_s, c.slack_s, *c.coef.values(), *c.rc_s.values(), *c.on_s.values())
        for l in p.layers:
            yield f"layer '{l.name}'", (l.recompute_s, l.saved_bytes, l.peak_bytes)
        for name, opts in zip(p.table_names, p.options):
            for o in opts:
                yield f"table '{name}' ({o.sharding_type})", (*o.load(), o.mem_bytes, o.recv_bytes, o.ids_send_bytes, o.allreduce_bytes)

    for what, xs in groups():
        if not all(map(math.isfinite, xs)):
            x = next(x for x in xs if not math.isfinite(x))
            raise PriceRangeError(
                f"mesh {p.mesh.key}: the price of {what} is {x} (not a finite number): the topology's and workload's "
                "figures together overflow the cost model; look for a unit slip (FLOP/s, bytes, bytes/s) or an absurd size")


def _check_range(p: CandidatePricing, ic: _IntCuts, H: dict[str, int]) -> None:
    """Refuse (a typed error naming what and by how much) a candidate whose CP-SAT model would hold integers beyond
    :data:`MAX_MODEL_INT`: the step variable's upper bound, and the memory terms of one rank."""
    hi = _step_hi(ic, H)
    if hi > MAX_MODEL_INT:
        raise PriceRangeError(
            f"mesh {p.mesh.key}: a rank's priced step can reach {hi * TIME_UNIT_S / ic.Q:.3g} s (its slowest cut with every "
            f"table on one rank), beyond the {MAX_MODEL_INT * TIME_UNIT_S / ic.Q:.3g} s the planner's integer model holds; "
            "the topology's and workload's figures are implausible together: look for a unit slip (FLOP/s, bytes, "
            "bytes/s) or an absurd size (rows, pooling factor, batch, sequence length)")
    mem = 4 * (abs(_m_down(p.capacity_bytes) - _m_up(p.base_bytes)) + _m_up(p.capacity_bytes)
               + sum(_m_down(l.saved_bytes) + _m_up(l.peak_bytes) for l in p.layers)) + _m_up(p.dp_comm_bytes) + \
        sum(max(_m_up(o.mem_bytes) * max(1, o.num_shards) + _m_up(p.recv_mem_factor * o.recv_bytes) for o in opts)
            for opts in p.options)
    if mem > MAX_MODEL_INT:
        raise PriceRangeError(
            f"mesh {p.mesh.key}: the memory the candidate prices reaches {mem * MEM_UNIT:.3g} bytes, beyond the "
            f"{MAX_MODEL_INT * MEM_UNIT:.3g} bytes the planner's integer model holds; look for a unit slip (hbm_bytes in "
            "bytes) or an absurd size (rows, dims, batch)")


def _step_hi(ic: _IntCuts, H: dict[str, int]) -> int:
    """An upper bound of the step variable (model units): the largest cut at every aggregate's horizon, with every
    layer recomputed."""
    return max(ic.const) + sum(max(d.get(v, 0) for d in ic.n) * H[v] for v in ic.used) + \
        max((sum(r) for r in ic.rc), default=0) + max((sum(d.values()) for d in ic.on), default=0) + 1


def _int_cuts(p: CandidatePricing) -> _IntCuts:
    _finite_prices(p)
    counts = []
    for c in p.cuts:
        counts.append({v: (c.coef.get(v, 0.0) / p.scale[v]) if p.scale.get(v, 0.0) > 0 else 0.0 for v in VARS})
    fractional = any(abs(k - round(k)) > 1e-6 for d in counts for k in d.values())
    Q = 16 if fractional else 1
    used = tuple(v for v in VARS if any(d[v] > 1e-9 for d in counts))
    const = tuple(int(round(c.const_s / TIME_UNIT_S * Q)) for c in p.cuts)
    n = tuple({v: int(round(d[v] * Q)) for v in used if d[v] > 1e-9} for d in counts)
    rc = tuple(tuple(int(round(c.rc_s.get(l.name, 0.0) / TIME_UNIT_S * Q)) for l in p.layers) for c in p.cuts)
    on = tuple({v: int(round(c.on_s.get(v, 0.0) / TIME_UNIT_S * Q)) for v in VARS if c.on_s.get(v, 0.0) > 0} for c in p.cuts)
    used = tuple(v for v in VARS if v in used or any(v in d for d in on))
    return _IntCuts(Q, const, n, rc, used, on)


def _rounding_slack(p: CandidatePricing, ic: _IntCuts | None = None) -> float:
    """Largest amount integer rounding can understate the model (half a unit per term)."""
    ic = ic or _int_cuts(p)
    big = max((sum(d.values()) for d in ic.n), default=0) / max(ic.Q, 1)
    return TIME_UNIT_S * (0.5 * big * (len(p.options) + 4) + 0.5 * (len(p.layers) + 2))


def _objective(m, p: CandidatePricing, ic: _IntCuts, X: dict, H: dict, rc_terms: list[list[tuple[int, object]]]):
    """``z`` above every cut; returns z. ``rc_terms[k]``: (coefficient, bool var) of the recompute choice in cut k."""
    hi = max(ic.const) + sum(max(d.get(v, 0) for d in ic.n) * H[v] for v in ic.used) + \
        max((sum(c for c, _ in rc) for rc in rc_terms), default=0) + max((sum(d.values()) for d in ic.on), default=0) + 1
    z = m.NewIntVar(0, max(1, hi), "step")
    on_var = {}
    for v in sorted({v for d in ic.on for v in d}):
        on_var[v] = m.NewBoolVar(f"on_{v}")
        m.Add(X[v] <= H[v] * on_var[v])  # a positive aggregate pays its latencies
    for k in range(len(p.cuts)):
        terms = [(ic.n[k][v], X[v]) for v in ic.n[k]] + list(rc_terms[k]) + [(c, on_var[v]) for v, c in ic.on[k].items()]
        expr = cp_model.LinearExpr.WeightedSum([v for _, v in terms], [c for c, _ in terms]) if terms else 0
        m.Add(z >= ic.const[k] + expr)
    m.Minimize(z)
    return z


def _bound_s(solver, ic: _IntCuts, p: CandidatePricing) -> float:
    """CP-SAT's proven bound of the model, made a bound of the priced step: less the rounding and the
    largest contention slack any cut holds (see :attr:`coplan.costmodel.results.StepCut.slack_s`)."""
    return solver.BestObjectiveBound() * TIME_UNIT_S / ic.Q - _rounding_slack(p, ic) - cut_slack(p)


def cut_slack(p: CandidatePricing) -> float:
    return max((c.slack_s for c in p.cuts), default=0.0)


# ---------------------------------------------------------------------------------------------
# Heuristics: option choice and placement
# ---------------------------------------------------------------------------------------------


def _recompute_for(p: CandidatePricing, need_bytes: float) -> tuple[bool, ...]:
    """The cheapest recompute set freeing at least ``need_bytes`` net of the recompute peak (from the
    frontier; greedy by time per byte freed when there is none)."""
    rc = [False] * len(p.layers)
    if need_bytes <= 0:
        return tuple(rc)
    front = frontier(p.layers)
    if front is not None:
        pt = front.cheapest(need_bytes)
        return pt.layers if pt is not None else tuple(l.saved_bytes > 0 for l in p.layers)
    order = sorted(range(len(p.layers)), key=lambda i: (p.layers[i].recompute_s / max(p.layers[i].saved_bytes, 1.0), i))
    freed, peak = 0.0, 0.0
    for i in order:
        if freed - peak >= need_bytes:
            break
        if p.layers[i].saved_bytes > 0:
            rc[i] = True
            freed += p.layers[i].saved_bytes
            peak = max(peak, p.layers[i].peak_bytes)
    return tuple(rc)


def _room(p: CandidatePricing, choice, recompute) -> float:
    """Memory left per rank for placed shards: capacity minus the dense part and the uniform shards."""
    saved, peak = recompute_memory(p, recompute)
    uni = sum(p.options[t][oi].mem_bytes for t, oi in enumerate(choice) if p.options[t][oi].placement == "all")
    recv = sum(p.options[t][oi].recv_bytes for t, oi in enumerate(choice))
    comm = p.dp_comm_bytes if any(p.options[t][oi].allreduce_bytes > 0 for t, oi in enumerate(choice)) else 0.0
    return p.capacity_bytes - (p.base_bytes - saved + peak + p.recv_mem_factor * recv) - uni - comm


def _targets(p: CandidatePricing, choice, w: np.ndarray) -> np.ndarray:
    """What an average rank carries of each load, weighted: the scale list scheduling balances to."""
    s = p.group_size
    tot = np.zeros(len(LOADS))
    for t, oi in enumerate(choice):
        o = p.options[t][oi]
        if o.placement != "all":
            tot += np.asarray(o.load()) * copies(o)
    return np.maximum(tot / s * w, 1e-30)


def place(p: CandidatePricing, choice: tuple[int, ...], recompute: tuple[bool, ...], *, by_memory: bool = False) -> Assignment | None:
    """Put the shards of the chosen options on ranks: node options on the least loaded node, then rank
    options largest first, each shard to the ranks whose largest weighted load share would be least
    after taking it, among those with room (``by_memory``: biggest shards first, each to the emptiest
    ranks). None when a shard finds no rank with room."""
    s, g = p.group_size, p.node_size
    w = weights(p)
    budget = _room(p, choice, recompute)
    X = np.zeros((s, len(LOADS)))
    M = np.zeros(s)
    ranks: list[tuple[int, ...]] = [()] * len(choice)
    target = _targets(p, choice, w)
    node_items = sorted((t for t, oi in enumerate(choice) if p.options[t][oi].placement == "node"),
                        key=lambda t: (-shard_weight(p.options[t][choice[t]], w), t))
    for t in node_items:
        o = p.options[t][choice[t]]
        if not g:
            return None
        vec = np.asarray(o.load()) * w
        nodes_load = ((X * w + vec) / target).max(axis=1).reshape(-1, g).max(axis=1)
        ok = (M + o.mem_bytes <= budget).reshape(-1, g).all(axis=1)
        cand = np.flatnonzero(ok)
        if cand.size == 0:
            return None
        n = int(cand[np.lexsort((cand, nodes_load[cand]))[0]])
        idx = np.arange(n * g, (n + 1) * g)
        X[idx] += o.load()
        M[idx] += o.mem_bytes
        ranks[t] = tuple(int(r) for r in idx)
    items = [t for t, oi in enumerate(choice) if p.options[t][oi].placement == "rank"]
    if by_memory:
        order = sorted(items, key=lambda t: (-p.options[t][choice[t]].mem_bytes, t))
    else:
        mt = max(sum(p.options[t][choice[t]].mem_bytes * copies(p.options[t][choice[t]]) for t in items) / s, 1.0)
        order = sorted(items, key=lambda t: (-max(float((np.asarray(p.options[t][choice[t]].load()) * w / target).max()),
                                                   p.options[t][choice[t]].mem_bytes / mt), t))
    Y = X * w / target  # each rank's loads as shares of an average rank's

    def rank_key(r: int) -> float:
        return float(M[r]) if by_memory else float(Y[r].max())

    heap = [(rank_key(r), r) for r in range(s)]
    heapq.heapify(heap)
    for t in order:
        o = p.options[t][choice[t]]
        v = np.asarray(o.load()) * w / target
        if by_memory or float(v.max()) < SMALL_SHARE or heap[0][0] == 0.0:
            # a small shard (most tables of a large set), or one an empty rank can take: the ranks
            # whose largest share is least (or, memory first, the emptiest) take its shards, from a
            # heap instead of scoring every rank
            held = []
            got_rs: list[int] = []
            while heap and len(got_rs) < o.num_shards:
                key, r = heapq.heappop(heap)
                if key != rank_key(r) or r in got_rs:
                    continue  # stale: the rank was pushed again when its loads changed
                if M[r] + o.mem_bytes <= budget:
                    got_rs.append(r)
                else:
                    held.append((key, r))
            for hh in held:
                heapq.heappush(heap, hh)
            if len(got_rs) < o.num_shards:
                return None
            for r in got_rs:
                X[r] += o.load()
                Y[r] += v
                M[r] += o.mem_bytes
                heapq.heappush(heap, (rank_key(r), r))
            ranks[t] = tuple(sorted(got_rs))
            continue
        score = M.copy() if by_memory else (Y + v).max(axis=1)
        score = np.where(M + o.mem_bytes <= budget, score, np.inf)
        k = o.num_shards
        got = np.argpartition(score, k - 1)[:k] if k < s else np.arange(s)
        got = got[np.argsort(score[got], kind="stable")]
        if got.size < k or not np.isfinite(score[got]).all():
            return None
        X[got] += o.load()
        Y[got] += v
        M[got] += o.mem_bytes
        for r in got:
            heapq.heappush(heap, (rank_key(int(r)), int(r)))
        ranks[t] = tuple(sorted(int(r) for r in got))
    return Assignment(tuple(choice), tuple(ranks), tuple(recompute))


SMALL_SHARE = 0.25
"""A shard under this share of an average rank's load is placed by the heap in :func:`place`."""


def place_with_repair(p: CandidatePricing, choice: tuple[int, ...], recompute: tuple[bool, ...]) -> Assignment | None:
    """:func:`place` (then memory-first), with more recompute until the shards fit; then the cheapest
    recompute the placed plan needs, and :func:`rebalance`. None when nothing fits."""
    front = frontier(p.layers)

    def attempt(rc, memory_first: bool = True):
        for by_memory in ((False, True) if memory_first else (False,)):
            a = place(p, choice, rc, by_memory=by_memory)
            if a is not None and evaluate(p, a).peak_bytes <= p.capacity_bytes:
                return a
        return None

    found = None
    if front is not None:
        net = _net_freed(p, recompute)
        # no recompute set freeing less than the average rank's (or the largest) shards need can place
        # them: start there
        s = p.group_size
        placed = [p.options[t][oi] for t, oi in enumerate(choice) if p.options[t][oi].placement != "all"]
        avg = sum(o.mem_bytes * copies(o) for o in placed) / max(s, 1)
        lump = max((o.mem_bytes for o in placed), default=0.0)
        need = max(avg, lump) - _room(p, choice, tuple(False for _ in p.layers))
        pts = [pt for pt in front.points if pt.freed_bytes >= max(net, need) - 1e-6]
        if not pts:
            return None
        found = attempt(pts[0].layers)
        if found is None:
            lo, hi = 0, len(pts) - 1
            found = attempt(pts[hi].layers)
            if found is None:
                return None
            while hi - lo > 1:
                mid = (lo + hi) // 2
                a = attempt(pts[mid].layers, memory_first=False)
                if a is not None:
                    hi, found = mid, a
                else:
                    lo = mid
    else:
        rc = list(recompute)
        order = sorted(range(len(p.layers)), key=lambda i: (p.layers[i].recompute_s / max(p.layers[i].saved_bytes, 1.0), i))
        while found is None:
            found = attempt(tuple(rc))
            if found is None:
                nxt = next((i for i in order if not rc[i] and p.layers[i].saved_bytes > 0), None)
                if nxt is None:
                    return None
                rc[nxt] = True
    return rebalance(p, trim_recompute(p, found))


def _net_freed(p: CandidatePricing, recompute) -> float:
    saved, peak = recompute_memory(p, recompute)
    return saved - peak


def trim_recompute(p: CandidatePricing, a: Assignment) -> Assignment:
    """The cheapest recompute (by the model) with which the placed plan still fits."""
    front = frontier(p.layers)
    ld = loads(p, a)
    best, best_t = a, evaluate(p, a, ld).step_time_s
    if front is not None:
        none = Assignment(a.choice, a.ranks, tuple(False for _ in p.layers))
        need = evaluate(p, none, ld).peak_bytes - p.capacity_bytes
        for pt in front.points:
            if pt.freed_bytes < need:
                continue
            trial = Assignment(a.choice, a.ranks, pt.layers)
            ev = evaluate(p, trial, ld)
            if ev.peak_bytes <= p.capacity_bytes and ev.step_time_s < best_t - 1e-15:
                best, best_t = trial, ev.step_time_s
            if pt.time_s > 2 * max(best_t, 1e-12):
                break
        return best
    rc = list(a.recompute)
    for i in sorted((i for i, on in enumerate(rc) if on), key=lambda i: (-p.layers[i].recompute_s, i)):
        rc[i] = False
        trial = Assignment(a.choice, a.ranks, tuple(rc))
        ev = evaluate(p, trial, ld)
        if ev.peak_bytes > p.capacity_bytes or ev.step_time_s > best_t:
            rc[i] = True
        else:
            best, best_t = trial, ev.step_time_s
    return best


REBALANCE_DESTINATIONS = 64
"""Ranks :func:`rebalance` considers as destinations of a move: the least loaded."""

REBALANCE_PLATEAU = 32
"""Moves in a row that keep the step and only even out the loads before :func:`rebalance` stops."""


def _top3(X: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per column, the indices and values of the three largest rows (padded with -inf)."""
    n = X.shape[0]
    k = min(3, n)
    idx = np.argpartition(-X, k - 1, axis=0)[:k] if n > k else np.arange(n)[:, None].repeat(X.shape[1], axis=1)
    vals = np.take_along_axis(X, idx, axis=0)
    order = np.argsort(-vals, axis=0, kind="stable")
    idx = np.take_along_axis(idx, order, axis=0)
    vals = np.take_along_axis(vals, order, axis=0)
    if k < 3:
        idx = np.vstack([idx, np.full((3 - k, X.shape[1]), -1)])
        vals = np.vstack([vals, np.full((3 - k, X.shape[1]), -np.inf)])
    return idx, vals


def _colmax_without(top, h, d):
    """Per column, the largest entry leaving out rows ``h`` and ``d`` (arrays broadcast to (..., 1))."""
    idx, vals = top
    out = np.where((idx[2] != h) & (idx[2] != d), vals[2], -np.inf)
    out = np.where((idx[1] != h) & (idx[1] != d), vals[1], out)
    return np.where((idx[0] != h) & (idx[0] != d), vals[0], out)


def rebalance(p: CandidatePricing, a: Assignment, *, max_steps: int = 200) -> Assignment:
    """Local search on the placement alone (options kept): move a shard off a rank that sets a
    per-rank maximum some cut charges to any rank with room, taking each time the move that lowers the
    model's step most (ties: the move that makes the weighted loads more even, so that plateaus of
    identical ranks can be left), until none does. Every move is priced against the model exactly
    (each load's maximum without the two ranks involved is kept, so a move costs no pass over the
    ranks). Shards placed by node stay; two shards of one table never share a rank. Never makes a
    plan worse."""
    s = p.group_size
    if s < 2 or not p.options or not p.cuts:
        return a
    ld = loads(p, a)
    ev0 = evaluate(p, a, ld)
    items = [(t, r) for t, (oi, rr) in enumerate(zip(a.choice, a.ranks)) if p.options[t][oi].placement == "rank" for r in rr]
    if not items:
        return a
    it_t = np.array([t for t, _ in items])
    it_r = np.array([r for _, r in items])
    vec = np.array([p.options[t][a.choice[t]].load() for t in it_t])
    mem = np.array([p.options[t][a.choice[t]].mem_bytes for t in it_t])
    X = ld.per_rank + ld.uniform
    M = ld.mem.copy()
    cap = p.capacity_bytes - ev0.dense_bytes - ld.uniform_mem
    holds = np.zeros((len(p.options), s), dtype=bool)
    holds[it_t, it_r] = True
    model = step_model(p)
    w = weights(p)
    w2 = w**2
    ranks = np.arange(s)
    cur = model.step(x_vector(p, X.max(axis=0), ld.recv, ld.ids_send, ld.dp), a.recompute)
    plateau = 0
    for _ in range(max_steps):
        top = _top3(X)
        colmax = top[1][0]
        hot = sorted({int(top[0][0][j]) for j in range(X.shape[1]) if w[j] > 0 and colmax[j] > 0})
        J = np.flatnonzero(np.isin(it_r, hot))
        if J.size == 0:
            break
        # destinations: the least loaded ranks (a move to a fuller one cannot lower a maximum by more)
        load = (X * w).sum(axis=1)
        D = np.argpartition(load, min(s, REBALANCE_DESTINATIONS) - 1)[:REBALANCE_DESTINATIONS] if s > REBALANCE_DESTINATIONS else ranks
        h = it_r[J][:, None, None]                       # (J, 1, 1)
        d = D[None, :, None]                             # (1, D, 1)
        v = vec[J][:, None, :]                           # (J, 1, 5)
        rest = _colmax_without(top, h, d)                # (J, D, 5)
        new = np.maximum(rest, np.maximum(X[it_r[J]][:, None, :] - v, X[D][None, :, :] + v))
        st = model.steps(x_vector(p, new, ld.recv, ld.ids_send, ld.dp), a.recompute)   # (J, D)
        # evenness: of each weighted load, and of each rank's weighted total (a rank that is light on
        # every maximum but heavy in sum is what a per-rank estimator such as TorchRec's charges)
        u = (v * w).sum(axis=-1)                         # (J, 1)
        dsp = (w2 * (2 * v * (X[D][None, :, :] - X[it_r[J]][:, None, :] + v))).sum(axis=-1) + \
            2 * u * (load[D][None, :] - load[it_r[J]][:, None] + u)
        ok = (D[None, :] != it_r[J][:, None]) & ~holds[it_t[J]][:, D] & (M[D][None, :] + mem[J][:, None] <= cap)
        st = np.where(ok, st, np.inf)
        better = st < cur * (1 - 1e-9)
        if better.any():
            k = int(np.argmin(np.where(better, st, np.inf)))
            plateau = 0
        else:
            same = (st <= cur * (1 + 1e-12)) & (dsp < -1e-9 * max(float((w2 * X**2).sum() + (load**2).sum()), 1e-300))
            plateau += 1
            if not same.any() or plateau > REBALANCE_PLATEAU:
                break
            k = int(np.argmin(np.where(same, dsp, np.inf)))
        jj, di = np.unravel_index(k, st.shape)
        dest = int(D[di])
        j = int(J[jj])
        src = int(it_r[j])
        X[src] -= vec[j]
        X[dest] += vec[j]
        M[src] -= mem[j]
        M[dest] += mem[j]
        holds[it_t[j], src] = False
        holds[it_t[j], dest] = True
        it_r[j] = dest
        cur = min(cur, float(st[jj, di]))
    new_ranks = [list(rr) if p.options[t][a.choice[t]].placement != "rank" else [] for t, rr in enumerate(a.ranks)]
    for t, r in zip(it_t.tolist(), it_r.tolist()):
        new_ranks[t].append(r)
    out = Assignment(a.choice, tuple(tuple(sorted(rr)) for rr in new_ranks), a.recompute)
    ev = evaluate(p, out)
    if ev.peak_bytes > p.capacity_bytes or ev.step_time_s > ev0.step_time_s:
        return a
    if ev.step_time_s < ev0.step_time_s:
        return out

    def spread(x: Assignment) -> float:
        t = loads(p, x)
        xx = t.per_rank + t.uniform
        return float((w2 * xx**2).sum() + (((xx * w).sum(axis=1)) ** 2).sum())

    return out if spread(out) < spread(a) else a  # the same step, more even


def break_lumps(p: CandidatePricing, a: Assignment, *, rounds: int = 100, per_round: int = 4, settle: int = 0) -> Assignment:
    """Local search on the option of the tables whose shards sit on the ranks that set a maximum: try
    every other option of such a table (its shards on the least loaded ranks, or node, with room) and
    keep a change that lowers the model's step. The decomposed model decides only its most
    consequential tables; a large table left whole on one rank can set a maximum that splitting it
    would remove. ``settle``: a change that does not lower the step at once is rebalanced with up to
    this many moves and kept if that lowers it (a split lump's shards land on ranks already loaded; the
    gain shows once the rest moves). Never makes a plan worse."""
    s, g = p.group_size, p.node_size
    if not p.options:
        return a
    w = weights(p)
    best_a, best = a, evaluate(p, a)
    for _ in range(rounds):
        ld = loads(p, best_a)
        tot = (ld.per_rank + ld.uniform) * w
        tops = {int(np.argmax(tot[:, j])) for j in range(len(LOADS)) if w[j] > 0}
        on_top = sorted({t for t, rr in enumerate(best_a.ranks) if rr and tops.intersection(rr)},
                        key=lambda t: -shard_weight(p.options[t][best_a.choice[t]], w))[:per_round]
        improved = False
        for t in on_top:
            o = p.options[t][best_a.choice[t]]
            base_load = ld.per_rank.copy()
            base_load[list(best_a.ranks[t])] -= o.load()
            base_mem = ld.mem.copy()
            base_mem[list(best_a.ranks[t])] -= o.mem_bytes
            scalar = (base_load * w).sum(axis=1)
            for i, q in enumerate(p.options[t]):
                if i == best_a.choice[t]:
                    continue
                if q.placement == "all":
                    rr: tuple[int, ...] = ()
                elif q.placement == "node":
                    if not g:
                        continue
                    n = int(np.argmin(scalar.reshape(-1, g).max(axis=1)))
                    rr = tuple(range(n * g, (n + 1) * g))
                else:
                    order = np.lexsort((np.arange(s), base_mem, scalar))
                    rr = tuple(sorted(int(r) for r in order[: q.num_shards]))
                choice = list(best_a.choice)
                ranks = list(best_a.ranks)
                choice[t], ranks[t] = i, rr
                trial = Assignment(tuple(choice), tuple(ranks), best_a.recompute)
                ev = evaluate(p, trial)
                if settle and ev.peak_bytes <= p.capacity_bytes and ev.step_time_s >= best.step_time_s * (1 - 1e-9):
                    trial = rebalance(p, trial, max_steps=settle)
                    ev = evaluate(p, trial)
                if ev.peak_bytes <= p.capacity_bytes and ev.step_time_s < best.step_time_s * (1 - 1e-9):
                    best_a, best, improved = trial, ev, True
                    break
            if improved:
                break
        if not improved:
            break
    return best_a


def _avg_cost(p: CandidatePricing, o, w: np.ndarray) -> float:
    """What an option adds to the average rank, weighted: its per-rank loads (and its share of the
    receive floor and all-reduce)."""
    s = p.group_size
    per = shard_weight(o, w)
    base = per if o.placement == "all" else per * copies(o) / s
    return base + w[2] * p.recv_factor * o.recv_bytes / max(1, s) + _dp_weight(p) * o.allreduce_bytes


def _dp_weight(p: CandidatePricing) -> float:
    return max((c.coef.get("dp", 0.0) for c in p.cuts), default=0.0)


def heuristic(p: CandidatePricing, recompute: tuple[bool, ...] | None = None) -> Assignment | None:
    """Greedy option choice and placement on the model itself.

    Tables go largest first; each takes the option (and ranks: the least loaded with room) that keeps
    the projected step lowest, where the projection is the larger of the model's step so far and the
    average rank once every remaining table adds its smallest possible share. Recompute is chosen up
    front to free what the embeddings need on average. Returns None when some table fits nowhere.
    """
    s, g = p.group_size, p.node_size
    n_t = len(p.options)
    w = weights(p)
    model = step_model(p)
    if recompute is None:
        min_mem = sum(min(o.mem_bytes * (copies(o) if o.placement != "all" else s) for o in opts) for opts in p.options) / s
        min_recv = p.recv_mem_factor * sum(min(o.recv_bytes for o in opts) for opts in p.options)
        recompute = _recompute_for(p, (min_mem + min_recv) * 1.05 - _room(p, (), ()))
    saved, peak = recompute_memory(p, recompute)
    rmin = [min(o.recv_bytes for o in opts) for opts in p.options]
    room0 = p.capacity_bytes - (p.base_bytes - saved + peak) - p.recv_mem_factor * sum(rmin)
    U = 0.0
    X = np.zeros((s, len(LOADS)))
    uni = np.zeros(len(LOADS))
    Mm = np.zeros(s)
    recv = ids_send = dp = 0.0
    min_contrib = [min(_avg_cost(p, o, w) for o in opts) for opts in p.options]
    order = sorted(range(n_t), key=lambda t: (-min(shard_weight(o, w) for o in p.options[t]), t))
    remaining = sum(min_contrib)
    min_mem_t = [min(o.mem_bytes * (s if o.placement == "all" else copies(o)) for o in opts) / s for opts in p.options]
    mem_remaining = sum(min_mem_t)
    choice = [0] * n_t
    ranks: list[tuple[int, ...]] = [()] * n_t
    scalar = np.zeros(s)
    heap = [(0.0, r) for r in range(s)]
    Xsum = np.zeros(len(LOADS))
    colmax = np.zeros(len(LOADS))
    mem_max = 0.0
    for t in order:
        remaining -= min_contrib[t]
        mem_remaining -= min_mem_t[t]
        mem_avg = float(Mm.sum()) / s
        cur_avg = float(((Xsum / s + uni) * w).sum()) + w[2] * p.recv_factor * recv / s + _dp_weight(p) * dp
        best = None
        for i, o in enumerate(p.options[t]):
            new_u = U + p.recv_mem_factor * (o.recv_bytes - rmin[t]) + (o.mem_bytes if o.placement == "all" else 0.0)
            if o.allreduce_bytes > 0 and dp == 0:
                new_u += p.dp_comm_bytes  # the first data-parallel table opens the world communicator
            if mem_max + new_u > room0:
                continue
            room = room0 - new_u
            vec = np.asarray(o.load())
            if o.placement == "all":
                rr: tuple[int, ...] = ()
                newmax = colmax + vec
            else:
                bad = Mm + o.mem_bytes > room
                if o.placement == "node":
                    if not g:
                        continue
                    node_ok = ~bad.reshape(-1, g).any(axis=1)
                    cand = np.flatnonzero(node_ok)
                    if cand.size == 0:
                        continue
                    node_load = scalar.reshape(-1, g).max(axis=1)
                    n = int(cand[np.argmin(node_load[cand])])
                    idx = np.arange(n * g, (n + 1) * g)
                else:
                    k = o.num_shards
                    idx = _least_loaded(heap, scalar, bad, k)
                    if idx is None:
                        continue
                rr = tuple(sorted(int(r) for r in idx))
                newmax = np.maximum(colmax, (X[idx] + uni + vec).max(axis=0))
            step = model.step(x_vector(p, newmax, recv + o.recv_bytes, ids_send + o.ids_send_bytes, dp + o.allreduce_bytes), recompute)
            proj = max(step, cur_avg + _avg_cost(p, o, w) + remaining)
            mem_proj = mem_avg + (0.0 if o.placement == "all" else o.mem_bytes * copies(o) / s) + mem_remaining + new_u
            lump = o.placement != "all" and o.mem_bytes > 0.5 * (room0 - new_u)
            key2 = (mem_proj > room0, lump, proj, step, _avg_cost(p, o, w), i)
            if best is None or key2 < best[0]:
                best = (key2, i, rr)
        if best is None:
            return None
        _, i, rr = best
        o = p.options[t][i]
        choice[t] = i
        ranks[t] = rr
        U += p.recv_mem_factor * (o.recv_bytes - rmin[t]) + (o.mem_bytes if o.placement == "all" else 0.0)
        if o.allreduce_bytes > 0 and dp == 0:
            U += p.dp_comm_bytes
        recv += o.recv_bytes
        ids_send += o.ids_send_bytes
        dp += o.allreduce_bytes
        vec = np.asarray(o.load())
        if o.placement == "all":
            uni = uni + vec
            colmax = colmax + vec
        else:
            idx = np.asarray(rr, dtype=np.int64)
            X[idx] += vec
            Xsum += vec * len(idx)
            Mm[idx] += o.mem_bytes
            scalar[idx] = (X[idx] * w).sum(axis=1)
            colmax = np.maximum(colmax, (X[idx] + uni).max(axis=0))
            mem_max = max(mem_max, float(Mm[idx].max()))
            for r in idx:
                heapq.heappush(heap, (float(scalar[r]), int(r)))
    return Assignment(tuple(choice), tuple(ranks), tuple(recompute))


def _least_loaded(heap: list, scalar: np.ndarray, bad: np.ndarray, k: int) -> np.ndarray | None:
    """The ``k`` ranks of least ``scalar`` that are not ``bad``, from a lazy heap of (scalar, rank)
    entries (stale ones dropped); the heap keeps them. None when fewer than ``k`` qualify."""
    got: list[int] = []
    popped = []
    while heap and len(got) < k:
        key, r = heapq.heappop(heap)
        if key != scalar[r] or r in got:
            continue
        popped.append((key, r))
        if not bad[r]:
            got.append(r)
    for e in popped:
        heapq.heappush(heap, e)
    return np.asarray(got, dtype=np.int64) if len(got) == k else None


def least_work(p: CandidatePricing, recompute: tuple[bool, ...]) -> Assignment | None:
    """Each table's option of least added work on the average rank (what TorchRec's greedy proposer
    starts from: mostly whole tables), placed largest first, the lumps split, and rebalanced. The projected-step greedy
    of :func:`heuristic` splits the big tables early to keep the step low while it is still short, and
    on many small tables over few ranks can end with more total work than whole tables balanced."""
    w = weights(p)
    choice = tuple(min(range(len(opts)), key=lambda i: (_avg_cost(p, opts[i], w), copies(opts[i]), i)) for opts in p.options)
    a = place(p, choice, recompute)
    if a is None:
        return None
    a = trim_recompute(p, a)
    # then the whole tables that set a maximum split (each split settled by rebalancing where the group is small)
    settle = _settle(p)
    return rebalance(p, break_lumps(p, a, rounds=100 if settle else 20, settle=settle))


def _better(p: CandidatePricing, a: Assignment | None, b: Assignment | None) -> Assignment | None:
    """The faster of two plans that fit (either may be None; the first on a tie)."""
    fits = [(ev.step_time_s, i, x) for i, x in enumerate((a, b)) if x is not None
            for ev in (evaluate(p, x),) if ev.peak_bytes <= p.capacity_bytes]
    return min(fits)[2] if fits else None


def _settle(p: CandidatePricing) -> int:
    """Rebalancing moves :func:`break_lumps` may spend settling each split (none on large groups,
    where a rebalance per trial costs more than the split can gain)."""
    return 50 if p.group_size <= 256 else 0


def heuristic_any(p: CandidatePricing) -> Assignment | None:
    """The better of :func:`heuristic` (rebalanced) and :func:`least_work`; when neither fits, the
    greedy's options placed memory-first with more recompute, and at last every layer recomputed.
    None when nothing fits."""
    a = heuristic(p)
    if a is not None:
        if evaluate(p, a).peak_bytes <= p.capacity_bytes:
            a = rebalance(p, trim_recompute(p, a))
            return _better(p, a, least_work(p, a.recompute))
        fixed = place_with_repair(p, a.choice, a.recompute)
        if fixed is not None:
            return _better(p, fixed, least_work(p, fixed.recompute))
    if not p.layers:
        return None
    full = tuple(l.saved_bytes > 0 for l in p.layers)
    a = heuristic(p, full)
    if a is None:
        return None
    return place_with_repair(p, a.choice, _recompute_for(p, 0.0))


# ---------------------------------------------------------------------------------------------
# Common model pieces
# ---------------------------------------------------------------------------------------------


def _recompute_model(m, p: CandidatePricing, ic: _IntCuts, points=None):
    """Recompute booleans (one per frontier point, or one per layer), the memory they free net of the
    recompute peak (KiB, an expression), and per cut the (coefficient, bool) terms of their time."""
    if points is not None:
        rc = [m.NewBoolVar(f"rcp{j}") for j in range(len(points))]
        m.AddExactlyOne(rc)
        freed = cp_model.LinearExpr.WeightedSum(rc, [_m_down(pt.freed_bytes) for pt in points])
        sums = _point_rc_sums(ic, points)
        terms = [[(sums[j][k], v) for j, v in enumerate(rc)] for k in range(len(p.cuts))]
        return rc, freed, [[(c, v) for c, v in tk if c] for tk in terms]
    rc = [m.NewBoolVar(f"rc{l}") for l in range(len(p.layers))]
    peak_hi = max((_m_up(l.peak_bytes) for l in p.layers), default=0)
    peak = m.NewIntVar(0, peak_hi, "rc_peak")
    for l, v in zip(p.layers, rc):
        if l.peak_bytes > 0:
            m.Add(peak >= _m_up(l.peak_bytes) * v)
    freed = (cp_model.LinearExpr.WeightedSum(rc, [_m_down(l.saved_bytes) for l in p.layers]) if rc else 0) - peak
    terms = [[(c, v) for c, v in zip(ic.rc[k], rc) if c] for k in range(len(p.cuts))]
    return rc, freed, terms


def _point_rc_sums(ic: _IntCuts, points) -> list[list[int]]:
    """Per frontier point and cut, the cut's recompute units of the point's layers (``sums[j][k]``): one integer
    product of the (points × layers) and (layers × cuts) matrices, exact (each row of ``ic.rc`` sums to far below
    int64's range, see :data:`MAX_MODEL_INT`), where a sum per point and cut would loop over every layer in Python
    (points × cuts × layers: cubic in depth for a deep block of identical layers)."""
    if not ic.rc or not points:
        return [[0] * len(ic.rc) for _ in points]
    n = len(ic.rc[0])
    if any(len(r) != n for r in ic.rc) or any(len(pt.layers) != n for pt in points) or max(sum(map(abs, r)) for r in ic.rc) >= 1 << 62:
        return [[sum(c for c, on in zip(r, pt.layers) if on) for r in ic.rc] for pt in points]
    on = np.array([pt.layers for pt in points], dtype=np.int64).reshape(len(points), n)
    units = np.array(ic.rc, dtype=np.int64).reshape(len(ic.rc), n)
    return (on @ units.T).tolist()


def _any_dp(m, p: CandidatePricing, y, tables):
    """KiB of the world communicator's buffers, charged once any of ``tables`` is data-parallel."""
    if p.dp_comm_bytes <= 0:
        return 0
    dps = [y[t][i] for t in tables for i, o in enumerate(p.options[t]) if o.allreduce_bytes > 0]
    if not dps:
        return 0
    any_dp = m.NewBoolVar("any_dp")
    for v in dps:
        m.AddImplication(v, any_dp)
    return _m_up(p.dp_comm_bytes) * any_dp


def _lin(terms):
    return cp_model.LinearExpr.WeightedSum([v for _, v in terms], [c for c, _ in terms]) if terms else 0


def _load_units(p: CandidatePricing, ic: _IntCuts, o) -> dict[str, int]:
    """One shard's per-rank loads in solver units, for the aggregates the cuts use."""
    raw = dict(zip(LOADS, o.load()))
    return {v: ic.unit(p, v, raw[v]) for v in LOADS if v in ic.used}


def _horizon(p: CandidatePricing, ic: _IntCuts) -> dict[str, int]:
    """Upper bounds of the aggregates in solver units: a rank holds at most one shard of a table, so a
    per-rank load is at most every table's largest shard (kept small: the decomposed model multiplies
    them by the group size, and CP-SAT refuses a model whose sums could overflow)."""
    H = {}
    for v in ic.used:
        if v == "dp":
            H[v] = sum(max(ic.unit(p, "dp", o.allreduce_bytes) for o in opts) for opts in p.options) + 1
            continue
        j = LOADS.index(v)
        tot = sum(max(ic.unit(p, v, o.load()[j]) for o in opts) for opts in p.options)
        floor = {"fwd": p.launch_s[0], "bwd": p.launch_s[1]}.get(v, 0.0)
        extra = {"a2a": p.recv_factor * sum(max(o.recv_bytes for o in opts) for opts in p.options),
                 "ids": sum(max(o.ids_send_bytes for o in opts) for opts in p.options)}.get(v, 0.0)
        H[v] = tot + ic.unit(p, v, floor) + ic.unit(p, v, extra) + 1
    return H


def _floors(m, p: CandidatePricing, ic: _IntCuts, X: dict, y, tables) -> None:
    """The aggregates' floors: the receive volume under the output all-to-all, the ids every rank
    sends under the input one, the data-parallel all-reduce's sum; launches under the lookups."""
    if "a2a" in X:
        m.Add(X["a2a"] >= _lin([(ic.unit(p, "a2a", p.recv_factor * p.options[t][i].recv_bytes), y[t][i])
                                for t in tables for i in range(len(p.options[t])) if p.options[t][i].recv_bytes > 0]))
    if "ids" in X:
        m.Add(X["ids"] >= _lin([(ic.unit(p, "ids", p.options[t][i].ids_send_bytes), y[t][i])
                                for t in tables for i in range(len(p.options[t])) if p.options[t][i].ids_send_bytes > 0]))


def _solution_aggregates(p: CandidatePricing, a: Assignment, ic: _IntCuts) -> dict[str, int]:
    ev = evaluate(p, a)
    return {v: ic.unit(p, v, ev.x[v]) for v in ic.used}


# ---------------------------------------------------------------------------------------------
# Flat CP-SAT
# ---------------------------------------------------------------------------------------------


def solve_flat(p: CandidatePricing, settings: SolverSettings, *, hint: Assignment | None = None,
               cutoff_s: float | None = None, bound_only: bool = False) -> SolveResult:
    """The whole candidate as one CP-SAT model (every shard's rank a boolean). ``bound_only``: only the
    proven bound is wanted (the solution is not polished)."""
    t0 = time.perf_counter()
    s, g = p.group_size, p.node_size
    ic = _int_cuts(p)
    _check_range(p, ic, _horizon(p, ic))
    m = cp_model.CpModel()
    y = [[m.NewBoolVar(f"y{t}_{i}") for i in range(len(opts))] for t, opts in enumerate(p.options)]
    for yt in y:
        m.AddExactlyOne(yt)
    per: dict[str, list[list]] = {v: [[] for _ in range(s)] for v in ic.used if v in LOADS}
    Mm: list[list] = [[] for _ in range(s)]
    xr: dict[tuple[int, int, int], object] = {}
    zn: dict[tuple[int, int, int], object] = {}

    def put(r, u: dict[str, int], mem: int, v):
        for k, c in u.items():
            if c:
                per[k][r].append((c, v))
        if mem:
            Mm[r].append((mem, v))

    for t, opts in enumerate(p.options):
        for i, o in enumerate(opts):
            u = _load_units(p, ic, o)
            mem = _m_up(o.mem_bytes)
            if o.placement == "all":
                for r in range(s):
                    put(r, u, mem, y[t][i])
            elif o.placement == "rank":
                xs = [m.NewBoolVar(f"x{t}_{i}_{r}") for r in range(s)]
                for r, v in enumerate(xs):
                    xr[t, i, r] = v
                    m.AddImplication(v, y[t][i])
                    put(r, u, mem, v)
                m.Add(sum(xs) == o.num_shards * y[t][i])
            else:
                zs = [m.NewBoolVar(f"z{t}_{i}_{n}") for n in range(p.num_nodes)]
                for n, v in enumerate(zs):
                    zn[t, i, n] = v
                    for r in range(n * g, (n + 1) * g):
                        put(r, u, mem, v)
                m.Add(sum(zs) == y[t][i])
    rc, freed, rc_terms = _recompute_model(m, p, ic)
    recv_mem = _lin([(_m_up(p.recv_mem_factor * p.options[t][i].recv_bytes), y[t][i])
                     for t in range(len(p.options)) for i in range(len(p.options[t])) if p.options[t][i].recv_bytes > 0])
    cap = _m_down(p.capacity_bytes) - _m_up(p.base_bytes)
    span = 4 * (abs(cap) + _m_up(p.capacity_bytes) + sum(_m_down(l.saved_bytes) for l in p.layers)) + 1
    room = m.NewIntVar(-span, span, "room")
    m.Add(room == cap + freed - recv_mem - _any_dp(m, p, y, range(len(p.options))))
    m.Add(room >= 0)  # the dense part alone must fit, with or without tables
    H = _horizon(p, ic)
    X = {v: m.NewIntVar(0, H[v], f"X_{v}") for v in ic.used}
    launch = {"fwd": ic.unit(p, "fwd", p.launch_s[0]), "bwd": ic.unit(p, "bwd", p.launch_s[1])} if p.options else {}
    for v in per:
        for r in range(s):
            m.Add(X[v] >= _lin(per[v][r]) + launch.get(v, 0))
    for r in range(s):
        if Mm[r]:
            m.Add(_lin(Mm[r]) <= room)
    if "dp" in X:
        m.Add(X["dp"] == _lin([(ic.unit(p, "dp", p.options[t][i].allreduce_bytes), y[t][i])
                               for t in range(len(p.options)) for i in range(len(p.options[t])) if p.options[t][i].allreduce_bytes > 0]))
    _floors(m, p, ic, X, y, range(len(p.options)))
    # identical ranks of a node: order them (any plan can be permuted into this order)
    if per:
        key = next(iter(per))
        for n in range(p.num_nodes):
            for r in range(n * g, (n + 1) * g - 1):
                if per[key][r]:
                    m.Add(_lin(per[key][r]) >= _lin(per[key][r + 1]))
    z = _objective(m, p, ic, X, H, rc_terms)
    if cutoff_s is not None and math.isfinite(cutoff_s):
        m.Add(z <= int((cutoff_s + _rounding_slack(p, ic)) / TIME_UNIT_S * ic.Q))
    if hint is not None:
        _hint_flat(m, p, _sorted_hint(p, hint, per), y, xr, zn, rc)
    solver = cp_model.CpSolver()
    _params(solver, settings, settings.time_limit_s)
    status = solver.Solve(m)
    name = solver.StatusName(status)
    wall = time.perf_counter() - t0
    if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        choice = tuple(next(i for i, v in enumerate(y[t]) if solver.BooleanValue(v)) for t in range(len(p.options)))
        ranks = []
        for t, oi in enumerate(choice):
            o = p.options[t][oi]
            if o.placement == "rank":
                ranks.append(tuple(r for r in range(s) if solver.BooleanValue(xr[t, oi, r])))
            elif o.placement == "node":
                n = next(n for n in range(p.num_nodes) if solver.BooleanValue(zn[t, oi, n]))
                ranks.append(tuple(range(n * g, (n + 1) * g)))
            else:
                ranks.append(())
        a = Assignment(choice, tuple(ranks), tuple(solver.BooleanValue(v) for v in rc))
        if not bound_only:  # never worse: lumps split where the solve left them, then a plateau evened out
            a = rebalance(p, break_lumps(p, a, rounds=20, settle=50), max_steps=settings.rebalance_steps)
        ev = evaluate(p, a)
        bound = _bound_s(solver, ic, p)
        return SolveResult(a, name, ev.step_time_s, ev.peak_bytes, min(bound, ev.step_time_s), wall, "flat")
    if status == cp_model.INFEASIBLE:
        if cutoff_s is not None and hint is not None:
            ev = evaluate(p, hint)
            return SolveResult(hint, "FEASIBLE", ev.step_time_s, ev.peak_bytes, min(cutoff_s, ev.step_time_s), wall, "flat")
        return SolveResult(None, "INFEASIBLE", math.inf, math.inf, math.inf if cutoff_s is None else cutoff_s, wall, "flat")
    if hint is not None:
        ev = evaluate(p, hint)
        ok = ev.peak_bytes <= p.capacity_bytes
        return SolveResult(hint if ok else None, "FEASIBLE" if ok else "UNKNOWN", ev.step_time_s if ok else math.inf, ev.peak_bytes,
                           min(_bound_s(solver, ic, p), ev.step_time_s), wall, "flat")
    return SolveResult(None, "UNKNOWN", math.inf, math.inf, max(0.0, _bound_s(solver, ic, p)), wall, "flat")


def _hint_flat(m, p, hint: Assignment, y, xr, zn, rc) -> None:
    g = p.node_size
    for t, oi in enumerate(hint.choice):
        for i, v in enumerate(y[t]):
            m.AddHint(v, i == oi)
            o = p.options[t][i]
            if o.placement == "rank":
                for r in range(p.group_size):
                    m.AddHint(xr[t, i, r], i == oi and r in hint.ranks[t])
            elif o.placement == "node":
                for n in range(p.num_nodes):
                    m.AddHint(zn[t, i, n], bool(i == oi and hint.ranks[t] and hint.ranks[t][0] // g == n))
    for v, on in zip(rc, hint.recompute):
        m.AddHint(v, on)


def _sorted_hint(p: CandidatePricing, a: Assignment, per: dict) -> Assignment:
    """Relabel ranks within each node so the rank order matches the model's symmetry breaking."""
    if not per or not p.node_size:
        return a
    key = next(iter(per))
    j = LOADS.index(key)
    tot = loads(p, a).per_rank[:, j]
    g = p.node_size
    mapping: dict[int, int] = {}
    for n in range(p.num_nodes):
        rr = list(range(n * g, (n + 1) * g))
        for new, old in zip(rr, sorted(rr, key=lambda r: (-tot[r], r))):
            mapping[old] = new
    ranks = tuple(tuple(sorted(mapping[r] for r in rr)) for rr in a.ranks)
    return Assignment(a.choice, ranks, a.recompute)


class _Collector(cp_model.CpSolverSolutionCallback):
    """CP-SAT callback keeping the values of some variables in the last ``keep`` solutions."""

    def __init__(self, variables, more, keep: int):
        super().__init__()
        self.vars = list(variables) + list(more)
        self.keep = keep
        self.solutions: list[tuple[int, ...]] = []

    def on_solution_callback(self):
        self.solutions.append(tuple(int(self.Value(v)) for v in self.vars))
        del self.solutions[:-self.keep]


# ---------------------------------------------------------------------------------------------
# Decomposed CP-SAT
# ---------------------------------------------------------------------------------------------


FREE_TABLES = 160
"""Tables that keep their own choice variables in the decomposed model (the most consequential)."""

ALL_FREE_TABLES = 600
"""Up to this many tables every table is free in the decomposed model (the first solve and the
bound-only one, :attr:`SolverSettings.slack_free_bound`): on 430 tables over 16 ranks that priced a
3% faster plan and closed the gap from 28% to 6%. Above it, :data:`FREE_TABLES`: a relaxation that
large does not close within one solve's budget (with 600 free of gem-1t's 1,200 tables the default
plan's bound fell from 1.0% to 3.5% below its step)."""

LIGHT_PRESOLVE_ABOVE = 400
"""Free tables above which the decomposed model is presolved without probing and overlap detection."""


def _importances(p: CandidatePricing) -> list[float]:
    """How much each table's choice can matter, relative to an average rank: the spread between its
    options in time added to the average rank, and its biggest single shard in time and in memory."""
    w = weights(p)
    s = p.group_size
    avg = [[_avg_cost(p, o, w) for o in opts] for opts in p.options]
    t_scale = max(1e-12, sum(min(a) for a in avg))
    m_scale = max(1.0, sum(min(o.mem_bytes * (s if o.placement == "all" else copies(o)) for o in opts) / s for opts in p.options))
    out = []
    for opts, a in zip(p.options, avg):
        lump_t = max((shard_weight(o, w) for o in opts if o.placement != "all"), default=0.0)
        lump_m = max((o.mem_bytes for o in opts if o.placement != "all"), default=0.0)
        out.append((max(a) - min(a) + lump_t) / t_scale + lump_m / m_scale)
    return out


def solve_decomposed(p: CandidatePricing, settings: SolverSettings, *, free_tables: int = FREE_TABLES,
                     cutoff_s: float | None = None, hint: Assignment | None = None, bound_only: bool = False) -> SolveResult:
    """Aggregated option choice (a relaxation, so its bound is valid for the model), then placement.

    The ``free_tables`` most consequential tables get choice variables; every other table enters the
    relaxation with the least it can add to each aggregate (over its options), which keeps the bound
    valid, and keeps the heuristic's choice in the plan.

    ``cutoff_s`` (branch and bound across mesh candidates): only relaxed solutions below it are
    sought. When the relaxation has none, the candidate is proven unable to go below the cutoff, which
    is then its bound, and its heuristic plan stands.
    """
    t0 = time.perf_counter()
    ic = _int_cuts(p)
    _check_range(p, ic, _horizon(p, ic))
    hint = hint if hint is not None else heuristic_any(p)
    hint_ev = evaluate(p, hint) if hint is not None else None
    free, fixed = _free_and_fixed(p, free_tables)
    rx = _relaxation(p, ic, free, fixed, cutoff_s, hint)
    solver = cp_model.CpSolver()
    _params(solver, settings, settings.time_limit_s)
    if len(free) > LIGHT_PRESOLVE_ABOVE:
        # With many free tables, probing and the search for overlapping linear blocks take the whole
        # deterministic budget in presolve; the LP relaxation, not presolve, is what closes this model.
        solver.parameters.find_big_linear_overlap = False
        solver.parameters.cp_model_probing_level = 0
    keep = max(1, int(settings.placed_solutions))
    collector = _Collector([v for t in free for v in rx.y[t]], list(rx.rc), keep)
    status = solver.Solve(rx.m, collector)
    hint_ok = hint is not None and hint_ev is not None and hint_ev.peak_bytes <= p.capacity_bytes
    if status == cp_model.INFEASIBLE and rx.cut is not None:
        wall = time.perf_counter() - t0
        lb = rx.cut * TIME_UNIT_S / ic.Q - 2 * _rounding_slack(p, ic) - cut_slack(p)
        if hint_ok:
            return SolveResult(hint, "FEASIBLE", hint_ev.step_time_s, hint_ev.peak_bytes, min(lb, hint_ev.step_time_s), wall, "decomposed")
        return SolveResult(None, "UNKNOWN", math.inf, math.inf, lb, wall, "decomposed")
    if status == cp_model.INFEASIBLE:
        return SolveResult(None, "INFEASIBLE", math.inf, math.inf, math.inf, time.perf_counter() - t0, "decomposed")
    bound = _bound_s(solver, ic, p)
    if bound_only:
        return SolveResult(None, "UNKNOWN", math.inf, math.inf, bound, time.perf_counter() - t0, "decomposed")
    best: Assignment | None = hint if hint_ok else None
    best_t = hint_ev.step_time_s if hint_ok else math.inf
    relaxed_opt = status == cp_model.OPTIMAL and not fixed
    if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        best, best_t = _place_relaxed(p, rx, collector.solutions, hint, best, best_t)
    if best is not None:
        best = rebalance(p, break_lumps(p, best, settle=_settle(p)), max_steps=settings.rebalance_steps)
    wall = time.perf_counter() - t0
    if best is None:
        return SolveResult(None, "UNKNOWN", math.inf, math.inf, bound, wall, "decomposed")
    ev = evaluate(p, best)
    overall = "OPTIMAL" if relaxed_opt and ev.step_time_s <= bound + 2 * _rounding_slack(p, ic) else "FEASIBLE"
    return SolveResult(best, overall, ev.step_time_s, ev.peak_bytes, min(bound, ev.step_time_s), wall, "decomposed")


def _free_and_fixed(p: CandidatePricing, free_tables: int) -> tuple[list[int], list[int]]:
    """The ``free_tables`` most consequential tables (sorted by index), and the rest (most
    consequential first)."""
    n_t = len(p.options)
    imp = _importances(p)
    order = sorted(range(n_t), key=lambda t: (-imp[t], t))
    return sorted(order[: min(n_t, free_tables)]), order[min(n_t, free_tables):]


@dataclass(slots=True)
class _Relaxation:
    """The decomposed model of one candidate, and what reading its solutions back needs."""

    m: cp_model.CpModel
    free: list[int]
    """Tables with choice variables, by index."""
    y: list[list]
    """``y[t][i]``: table ``t`` takes option ``i`` (empty for a fixed table)."""
    rc: list
    """Recompute booleans: one per frontier point (``points``), or one per layer when ``points`` is None."""
    points: list | None
    cut: int | None
    """The objective cutoff, in model units (None: none)."""


@dataclass(slots=True)
class _FixedLeast:
    """What the fixed tables add at least (each at its least over its options), in model units."""

    per_rank: dict[str, int]
    """Per aggregate (and ``m``, memory), summed over the group."""
    recv: int
    ids: int
    dp: int
    recv_mem: int


def _fixed_least(p: CandidatePricing, ic: _IntCuts, fixed: list[int], U: dict, mem_u: dict, keys: list[str]) -> _FixedLeast:
    s = p.group_size
    cw = {k: 0 for k in keys + ["m"]}
    recv_c = ids_c = dp_c = recv_mem_c = 0
    for t in fixed:
        opts = p.options[t]
        for k in keys:
            cw[k] += min(U[t][i][k] * (s if o.placement == "all" else copies(o)) for i, o in enumerate(opts))
        cw["m"] += min(mem_u[t][i] * (s if o.placement == "all" else copies(o)) for i, o in enumerate(opts))
        recv_c += min(ic.unit(p, "a2a", p.recv_factor * o.recv_bytes) for o in opts) if "a2a" in ic.used else 0
        ids_c += min(ic.unit(p, "ids", o.ids_send_bytes) for o in opts) if "ids" in ic.used else 0
        dp_c += min(ic.unit(p, "dp", o.allreduce_bytes) for o in opts) if "dp" in ic.used else 0
        recv_mem_c += min(_m_up(p.recv_mem_factor * o.recv_bytes) for o in opts)
    return _FixedLeast(cw, recv_c, ids_c, dp_c, recv_mem_c)


def _relaxation(p: CandidatePricing, ic: _IntCuts, free: list[int], fixed: list[int], cutoff_s: float | None,
                hint: Assignment | None) -> _Relaxation:
    """The decomposed model: option choice of the free tables and the recompute set, over aggregated
    loads (see the module docstring), with the hint and the objective cutoff."""
    n_t = len(p.options)
    m = cp_model.CpModel()
    y: list[list] = [[] for _ in range(n_t)]
    for t in free:
        y[t] = [m.NewBoolVar(f"y{t}_{i}") for i in range(len(p.options[t]))]
        m.AddExactlyOne(y[t])
    U = {t: [_load_units(p, ic, o) for o in p.options[t]] for t in range(n_t)}
    mem_u = {t: [_m_up(o.mem_bytes) for o in p.options[t]] for t in range(n_t)}
    keys = [v for v in ic.used if v in LOADS]
    least = _fixed_least(p, ic, fixed, U, mem_u, keys)
    front = frontier(p.layers)
    points = None
    if front is not None:
        points = list(front.points)
    rc, freed, rc_terms = _recompute_model(m, p, ic, points)
    room = _memory_room(m, p, free, fixed, y, freed, least.recv_mem)
    H = _horizon(p, ic)
    X = {v: m.NewIntVar(0, H[v], f"X_{v}") for v in ic.used}
    _load_constraints(m, p, ic, free, y, U, mem_u, keys, X, room, least.per_rank)
    _traffic_constraints(m, p, ic, free, y, X, least)
    zobj = _objective(m, p, ic, X, H, rc_terms)
    cut = None
    if cutoff_s is not None and math.isfinite(cutoff_s):
        cut = int((cutoff_s + _rounding_slack(p, ic)) / TIME_UNIT_S * ic.Q)
        m.Add(zobj <= cut)
    if hint is not None:
        _hint_decomposed(m, p, hint, free, y, rc, points)
    return _Relaxation(m, free, y, rc, points, cut)


def _memory_room(m, p: CandidatePricing, free: list[int], fixed: list[int], y, freed, recv_mem_c: int):
    """KiB a rank has for its table shards: capacity, less the fixed state and the receive buffers,
    plus what recompute frees."""
    recv_mem = _lin([(_m_up(p.recv_mem_factor * p.options[t][i].recv_bytes), y[t][i])
                     for t in free for i in range(len(p.options[t])) if p.options[t][i].recv_bytes > 0])
    cap = _m_down(p.capacity_bytes) - _m_up(p.base_bytes) - recv_mem_c
    span = 4 * (abs(cap) + _m_up(p.capacity_bytes) + sum(_m_down(l.saved_bytes) for l in p.layers)) + 1
    room = m.NewIntVar(-span, span, "room")
    forced_dp = any(min(o.allreduce_bytes for o in p.options[t]) > 0 for t in fixed)
    m.Add(room == cap + freed - recv_mem - (_m_up(p.dp_comm_bytes) if forced_dp else _any_dp(m, p, y, free)))
    return room


def _load_constraints(m, p: CandidatePricing, ic: _IntCuts, free: list[int], y, U: dict, mem_u: dict, keys: list[str], X: dict,
                      room, cw: dict[str, int]) -> None:
    """Each per-rank maximum at least the uniform part plus the average of what is placed, and at
    least the uniform part plus the shards of any one table; memory likewise within ``room``."""
    s = p.group_size
    launch = {"fwd": ic.unit(p, "fwd", p.launch_s[0]), "bwd": ic.unit(p, "bwd", p.launch_s[1])} if p.options else {}
    uni = {k: [] for k in keys + ["m"]}
    pack = {k: [] for k in keys + ["m"]}
    per_table = []
    for t in free:
        item = {k: [] for k in keys + ["m"]}
        for i, o in enumerate(p.options[t]):
            vals = dict(U[t][i])
            vals["m"] = mem_u[t][i]
            for k in keys + ["m"]:
                c = vals.get(k, 0)
                if not c:
                    continue
                if o.placement == "all":
                    uni[k].append((c, y[t][i]))
                else:
                    pack[k].append((c * copies(o), y[t][i]))
                    item[k].append((c, y[t][i]))
        per_table.append(item)
    u = {k: m.NewIntVar(0, max(1, sum(c for c, _ in uni[k])), f"uni_{k}") for k in keys + ["m"]}
    for k in keys + ["m"]:
        m.Add(u[k] == _lin(uni[k]))
    for k in keys:
        z = X[k]
        L = launch.get(k, 0)
        m.Add(s * z >= s * (u[k] + L) + _lin(pack[k]) + cw[k])
        m.Add(z >= u[k] + L)
        for item in per_table:
            if item[k]:
                m.Add(z >= u[k] + L + _lin(item[k]))
    m.Add(_lin(pack["m"]) + cw["m"] <= s * (room - u["m"]))
    m.Add(room >= u["m"])
    for item in per_table:
        if item["m"]:
            m.Add(u["m"] + _lin(item["m"]) <= room)


def _traffic_constraints(m, p: CandidatePricing, ic: _IntCuts, free: list[int], y, X: dict, least: _FixedLeast) -> None:
    """The all-reduce of data-parallel tables and the all-to-alls' volumes (received, and ids sent)."""
    if "dp" in X:
        m.Add(X["dp"] == least.dp + _lin([(ic.unit(p, "dp", p.options[t][i].allreduce_bytes), y[t][i])
                                          for t in free for i in range(len(p.options[t])) if p.options[t][i].allreduce_bytes > 0]))
    if "a2a" in X:
        m.Add(X["a2a"] >= least.recv + _lin([(ic.unit(p, "a2a", p.recv_factor * p.options[t][i].recv_bytes), y[t][i])
                                             for t in free for i in range(len(p.options[t])) if p.options[t][i].recv_bytes > 0]))
    if "ids" in X:
        m.Add(X["ids"] >= least.ids + _lin([(ic.unit(p, "ids", p.options[t][i].ids_send_bytes), y[t][i])
                                            for t in free for i in range(len(p.options[t])) if p.options[t][i].ids_send_bytes > 0]))


def _hint_decomposed(m, p: CandidatePricing, hint: Assignment, free: list[int], y, rc, points) -> None:
    for t in free:
        for i, v in enumerate(y[t]):
            m.AddHint(v, i == hint.choice[t])
    if points is None:
        for v, on in zip(rc, hint.recompute):
            m.AddHint(v, on)
    else:
        net = _net_freed(p, hint.recompute)
        j = next((j for j, pt in enumerate(points) if pt.freed_bytes >= net - 1e-6), len(points) - 1)
        for k, v in enumerate(rc):
            m.AddHint(v, k == j)


def _place_relaxed(p: CandidatePricing, rx: _Relaxation, solutions: list[tuple[int, ...]], hint: Assignment | None,
                   best: Assignment | None, best_t: float) -> tuple[Assignment | None, float]:
    """Place the collected relaxed solutions on ranks (best first, each distinct one once); the
    fastest placed plan that fits, if it beats ``best``."""
    y, free, points = rx.y, rx.free, rx.points
    n_y = sum(len(y[t]) for t in free)
    seen = set()
    base_choice = list(hint.choice) if hint is not None else [0] * len(p.options)
    base_rc = hint.recompute if hint is not None else tuple(False for _ in p.layers)
    for values in reversed(solutions):  # best (last) first
        ys, rs = values[:n_y], values[n_y:]
        choice = list(base_choice)
        k = 0
        for t in free:
            choice[t] = next(i for i in range(len(y[t])) if ys[k + i])
            k += len(y[t])
        if points is None:
            recompute = tuple(bool(x) for x in rs) if rs else base_rc
        else:
            recompute = next(pt.layers for pt, x in zip(points, rs) if x)
        key = (tuple(choice), recompute)
        if key in seen:
            continue
        seen.add(key)
        placed = place_with_repair(p, tuple(choice), recompute)
        if placed is not None:
            ev = evaluate(p, placed)
            if ev.peak_bytes <= p.capacity_bytes and ev.step_time_s < best_t:
                best, best_t = placed, ev.step_time_s
    return best, best_t


__all__ = [
    "FREE_TABLES", "SolveResult", "SolverSettings", "break_lumps", "heuristic", "heuristic_any", "place", "place_with_repair",
    "placement_vars", "rebalance", "slack_free", "solve_candidate", "solve_decomposed", "solve_flat", "trim_recompute",
]
