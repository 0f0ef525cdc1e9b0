"""CP-SAT for one mesh candidate: a sharding option and ranks per table, recompute per layer.

The objective is the candidate's step time as :func:`coplan.planner.pricing.evaluate` computes it:
the slowest rank's lookups forward and backward, the busiest all-to-all sender (or the receive
volume), data-parallel all-reduces and recompute, under per-rank HBM. Two formulations:

- **flat** (small groups): one boolean per (table, option), per (table, option, rank) for shards the
  solver places on ranks and per (table, option, node) for table-row-wise; per-rank sums of forward
  time, backward time, bytes sent and memory. This is the exact problem: its optimum is the optimum
  of the surrogate, which the brute-force tests check.
- **decomposed** (large groups: 1,200 tables over thousands of ranks would need millions of
  booleans): the ranks of a shard group are identical, so CP-SAT chooses the option of every table and
  the recompute set over *aggregated* loads. That is a relaxation: each maximum over ranks is at least
  the uniform part plus the average of what is placed, and at least the uniform part plus the shards
  of any one table (one constraint per table, ``Σ_o size_o·y_o``, which is tighter than one per
  option); the same for memory. Recompute is one choice among the Pareto-optimal recompute sets
  (:mod:`coplan.planner.recompute`; exact, and it closes the relaxation's bound where per-layer
  booleans under a max over peaks left it several percent low). Its optimum is a valid lower bound
  of the exact problem. The last few improving relaxed solutions are placed by LPT with memory
  checks (time-first, two-resource and memory-first orders), improved by moving and swapping shards
  off the fullest rank, and the best kept; then a local search changes the option of tables whose
  shards set a maximum (:func:`break_lumps`). The gap is reported against the relaxation's proven bound.

Integers: time in units of 10 ns (bytes sent and received are converted to all-to-all seconds first),
memory in KiB with item memory rounded up and capacity down, so a plan CP-SAT accepts fits in bytes.

Determinism: with several workers CP-SAT runs ``interleave_search`` (parallel subsolvers in
deterministic batches) under a *deterministic* time limit, so the same inputs and seed give the same
plan whatever the machine load; a wall-clock limit far above it only guards against runaway solves.
"""

from __future__ import annotations

import heapq
import math
import time
from dataclasses import dataclass

from coplan.planner.pricing import Assignment, CandidatePricing, copies, evaluate, shard_weight
from coplan.planner.recompute import RecomputeFrontier, frontier

TIME_UNIT_S = 1e-8
"""One CP-SAT time unit: 10 ns."""

MEM_UNIT = 1024
"""One CP-SAT memory unit: 1 KiB."""


@dataclass(frozen=True, slots=True)
class SolveResult:
    """The best solution of one candidate and what is proven about it."""

    assignment: Assignment | None
    """None when infeasible or when no solution was found."""

    status: str
    """OPTIMAL, FEASIBLE, INFEASIBLE or UNKNOWN, for the candidate as a whole."""

    step_time_s: float
    """Surrogate step time of the solution (inf when none)."""

    peak_bytes: float
    """Memory of the fullest rank."""

    bound_s: float
    """Proven lower bound on the candidate's optimal surrogate step time."""

    wall_s: float
    """Time spent."""

    method: str
    """'flat' or 'decomposed'."""

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

    flat_max_vars: int = 20_000
    """Above this many placement booleans the decomposed formulation is used."""

    relative_gap: float = 1e-4
    """Stop a solve once proven within this relative gap."""

    placed_solutions: int = 3
    """Decomposed model: the last this many improving relaxed solutions are each placed on ranks, and
    the best placed plan kept."""

    free_tables: int | None = None
    """Decomposed model: tables that get choice variables (the most consequential first); None:
    :data:`FREE_TABLES`. Every table free makes the relaxation exact in the option choice (its bound
    and its choice then see each table's real figures rather than its least per aggregate), at some
    CPU seconds per solve: worth it where one candidate is solved, not twelve."""

    thorough_placement: bool = False
    """Decomposed model: also place each relaxed solution against the three per-rank loads
    (:func:`_place_loads`) and polish the final plan with :func:`rebalance`. Worth it where one candidate
    is solved (gem-1t over 64 ranks: 0.3 ms off a 36.6 ms sparse step); in the CLI's search at 16,384
    GPUs it doubled the CPU time (19 to 43 CPU-s, loaded machine) for no better plan, so it is off there."""

    rebalance_steps: int = 100
    """Moves of :func:`rebalance` on the final plan when ``thorough_placement``."""


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


@dataclass(frozen=True, slots=True)
class _Units:
    """An option's figures in solver units."""

    f: int
    b: int
    s: int
    m: int
    recv: int
    dp: int


def _units(p: CandidatePricing) -> list[list[_Units]]:
    wa, wdp = p.a2a_s_per_byte, p.dp_s_per_byte
    return [
        [_Units(_t(o.fwd_s), _t(o.bwd_s), _t(wa * o.send_bytes), _m_up(o.mem_bytes), _t(wa * p.recv_factor * o.recv_bytes), _t(wdp * o.allreduce_bytes)) for o in opts]
        for opts in p.options
    ]


def _recv_mem(p: CandidatePricing, o) -> int:
    return _m_up(p.recv_mem_factor * o.recv_bytes)


def _rounding_slack(p: CandidatePricing) -> float:
    """Largest amount integer rounding can understate the surrogate (half a unit per term, four terms per table)."""
    return 0.5 * TIME_UNIT_S * (4 * len(p.options) + len(p.layers) + 4)


def solve_candidate(p: CandidatePricing, settings: SolverSettings, *, hint: Assignment | None = None,
                    cutoff_s: float | None = None) -> SolveResult:
    """Best plan of one candidate: flat when small, decomposed otherwise. ``cutoff_s``: the search only
    needs plans faster than this (decomposed model; see :func:`solve_decomposed`)."""
    if placement_vars(p) <= settings.flat_max_vars:
        return solve_flat(p, settings, hint=hint or heuristic_any(p))
    free = FREE_TABLES if settings.free_tables is None else settings.free_tables
    return solve_decomposed(p, settings, cutoff_s=cutoff_s, free_tables=free)


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
    saved = sum(l.saved_bytes for l, on in zip(p.layers, recompute) if on)
    peak = max((l.peak_bytes for l, on in zip(p.layers, recompute) if on), default=0.0)
    uni = sum(p.options[t][oi].mem_bytes for t, oi in enumerate(choice) if p.options[t][oi].placement == "all")
    recv = sum(p.options[t][oi].recv_bytes for t, oi in enumerate(choice))
    return p.capacity_bytes - (p.base_bytes - saved + peak + p.recv_mem_factor * recv) - uni


def place(p: CandidatePricing, choice: tuple[int, ...], recompute: tuple[bool, ...], *, improve: bool = True,
          by_memory: bool | str = False) -> Assignment | None:
    """Put the shards of the chosen options on ranks: node options by LPT over nodes, then rank options
    by LPT over ranks (largest first, each shard to the least-loaded ranks with room), then local moves.
    The size of a shard is its time plus the all-to-all time of what it sends. None when a shard finds
    no rank with room."""
    s, g = p.group_size, p.node_size
    wa = p.a2a_s_per_byte
    budget = _room(p, choice, recompute)
    load = [0.0] * s
    mem = [0.0] * s
    ranks: list[tuple[int, ...]] = [()] * len(choice)
    node_items = sorted((t for t, oi in enumerate(choice) if p.options[t][oi].placement == "node"),
                        key=lambda t: (-shard_weight(p.options[t][choice[t]], wa), t))
    if node_items:
        nodes = [(0.0, n) for n in range(p.num_nodes)]
        node_mem = [0.0] * p.num_nodes
        for t in node_items:
            o = p.options[t][choice[t]]
            held, placed = [], None
            while nodes:
                ld, n = heapq.heappop(nodes)
                if node_mem[n] + o.mem_bytes <= budget:
                    placed = (ld, n)
                    break
                held.append((ld, n))
            for h in held:
                heapq.heappush(nodes, h)
            if placed is None:
                return None
            ld, n = placed
            node_mem[n] += o.mem_bytes
            w = shard_weight(o, wa)
            heapq.heappush(nodes, (ld + w, n))
            rr = tuple(range(n * g, (n + 1) * g))
            ranks[t] = rr
            for r in rr:
                load[r] += w
                mem[r] += o.mem_bytes
    if by_memory == "loads":
        return _place_loads(p, choice, recompute, ranks, mem, budget)
    if by_memory == "vector":
        # both: largest first by the bigger of its time and memory shares of an average rank (the
        # usual order for packing two resources), each to the least loaded ranks in time with room
        items = [t for t, oi in enumerate(choice) if p.options[t][oi].placement == "rank"]
        tw = sum(shard_weight(p.options[t][choice[t]], wa) * p.options[t][choice[t]].num_shards for t in items) / s or 1.0
        tm = sum(p.options[t][choice[t]].mem_bytes * p.options[t][choice[t]].num_shards for t in items) / s or 1.0
        rank_items = sorted(items, key=lambda t: (-max(shard_weight(p.options[t][choice[t]], wa) / tw, p.options[t][choice[t]].mem_bytes / tm), t))
        key_of = load
    elif by_memory:  # memory-first: biggest shards first, each to the emptiest ranks
        rank_items = sorted((t for t, oi in enumerate(choice) if p.options[t][oi].placement == "rank"),
                            key=lambda t: (-p.options[t][choice[t]].mem_bytes, t))
        key_of = mem
    else:
        rank_items = sorted((t for t, oi in enumerate(choice) if p.options[t][oi].placement == "rank"),
                            key=lambda t: (-shard_weight(p.options[t][choice[t]], wa), -p.options[t][choice[t]].mem_bytes, t))
        key_of = load
    heap = [(key_of[r], r) for r in range(s)]
    heapq.heapify(heap)
    for t in rank_items:
        o = p.options[t][choice[t]]
        w = shard_weight(o, wa)
        got: list[int] = []
        held = []
        while heap and len(got) < o.num_shards:
            ld, r = heapq.heappop(heap)
            if mem[r] + o.mem_bytes <= budget:
                got.append(r)
            else:
                held.append((ld, r))
        if len(got) < o.num_shards:
            return None
        for r in got:
            load[r] += w
            mem[r] += o.mem_bytes
            heapq.heappush(heap, (key_of[r], r))
        for h in held:
            heapq.heappush(heap, h)
        ranks[t] = tuple(sorted(got))
    a = Assignment(tuple(choice), tuple(ranks), tuple(recompute))
    if improve and rank_items:
        a = _improve(p, a, load, mem, budget)
    return a


def _place_loads(p: CandidatePricing, choice, recompute, ranks: list, mem: list[float], budget: float) -> Assignment | None:
    """Rank options placed against the step's three per-rank loads (forward, backward, sends) at once:
    largest first by the largest of its shares of an average rank's loads, each shard to the ranks
    whose largest load share would be least after taking it, among those with room. ``ranks`` and
    ``mem`` hold the node options already placed.

    The step pays the maximum of each load separately, and a scalar weight (time plus send time)
    lets one rank gather backward-heavy shards and another send-heavy ones while their sums stay
    equal; this vector form of list scheduling keeps all three near their averages.
    """
    import numpy as np

    s = p.group_size
    wa = p.a2a_s_per_byte
    X = np.zeros((s, 3))
    M = np.asarray(mem, dtype=float).copy()
    us = recv = 0.0
    items = []
    for t, oi in enumerate(choice):
        o = p.options[t][oi]
        recv += o.recv_bytes
        if o.placement == "all":
            us += wa * o.send_bytes
        elif o.placement == "node":
            X[list(ranks[t])] += (o.fwd_s, o.bwd_s, wa * o.send_bytes)
        else:
            items.append(t)
    vec = {t: np.array([p.options[t][choice[t]].fwd_s, p.options[t][choice[t]].bwd_s, wa * p.options[t][choice[t]].send_bytes])
           for t in items}
    total = X.sum(axis=0) + sum((vec[t] * p.options[t][choice[t]].num_shards for t in items), np.zeros(3))
    target = total / s
    # sends cost nothing below the receive floor, so their target is at least that
    target[2] = max(target[2], wa * p.recv_factor * recv - us)
    target = np.maximum(target, 1e-30)
    order = sorted(items, key=lambda t: (-float((vec[t] / target).max()), t))
    for t in order:
        o = p.options[t][choice[t]]
        score = ((X + vec[t]) / target).max(axis=1)
        score = np.where(M + o.mem_bytes <= budget, score, np.inf)
        got = np.argsort(score, kind="stable")[: o.num_shards]
        if got.size < o.num_shards or not np.isfinite(score[got]).all():
            return None
        X[got] += vec[t]
        M[got] += o.mem_bytes
        ranks[t] = tuple(sorted(int(r) for r in got))
    return Assignment(tuple(choice), tuple(ranks), tuple(recompute))


def place_with_repair(p: CandidatePricing, choice: tuple[int, ...], recompute: tuple[bool, ...], *,
                      loads: bool = False) -> Assignment | None:
    """:func:`place`, then memory-first placement, then more recompute until the shards fit (the next
    frontier point that frees more memory; without a frontier, one more layer at a time, cheapest per
    byte freed first); then the cheapest recompute the placed plan needs. None when nothing fits."""
    front = frontier(p.layers)
    if front is not None:
        net = _net_freed(p, recompute)
        pts = [pt for pt in front.points if pt.freed_bytes >= net - 1e-6]

        def attempt(pt):
            return _place_best(p, choice, pt.layers, loads=loads)

        if not pts:
            return None
        first = attempt(pts[0])
        if first is not None:
            return trim_recompute(p, first)
        # more room makes placement succeed more easily (not strictly: it is a heuristic), so find
        # the cheapest point that places by bisection rather than walking hundreds of points
        lo, hi = 0, len(pts) - 1
        found = attempt(pts[hi])
        if found is None:
            return None
        while hi - lo > 1:
            mid = (lo + hi) // 2
            a = attempt(pts[mid])
            if a is not None:
                hi, found = mid, a
            else:
                lo = mid
        return trim_recompute(p, found)
    rc = list(recompute)
    order = sorted(range(len(p.layers)), key=lambda i: (p.layers[i].recompute_s / max(p.layers[i].saved_bytes, 1.0), i))
    while True:
        a = _place_best(p, choice, tuple(rc), loads=loads)
        if a is not None:
            return trim_recompute(p, a)
        nxt = next((i for i in order if not rc[i] and p.layers[i].saved_bytes > 0), None)
        if nxt is None:
            return None
        rc[nxt] = True


def _place_best(p: CandidatePricing, choice, recompute, *, loads: bool = False) -> Assignment | None:
    """The time-first placement (``loads``: the faster of it and the three-load one) if it fits; else
    the two-resource and then the memory-first placement (they leave fuller ranks less full)."""
    best, best_t = None, math.inf
    for by_memory in (("loads", False) if loads else (False,)):
        a = place(p, choice, recompute, by_memory=by_memory)
        if a is not None:
            ev = evaluate(p, a)
            if ev.peak_bytes <= p.capacity_bytes and ev.step_time_s < best_t:
                best, best_t = a, ev.step_time_s
    if best is not None:
        return best
    for by_memory in ("vector", True):
        a = place(p, choice, recompute, by_memory=by_memory)
        if a is not None and evaluate(p, a).peak_bytes <= p.capacity_bytes:
            return a
    return None


def _net_freed(p: CandidatePricing, recompute) -> float:
    on = [l for l, o in zip(p.layers, recompute) if o]
    return sum(l.saved_bytes for l in on) - max((l.peak_bytes for l in on), default=0.0)


def trim_recompute(p: CandidatePricing, a: Assignment) -> Assignment:
    """The cheapest recompute with which the placed plan still fits: the frontier point that frees
    what the plan needs; without a frontier, stop recomputing layers, most expensive first, while it
    fits. Never more expensive than ``a``'s own recompute."""
    front = frontier(p.layers)
    if front is not None:
        none = Assignment(a.choice, a.ranks, tuple(False for _ in p.layers))
        pt = front.cheapest(evaluate(p, none).peak_bytes - p.capacity_bytes)
        own = sum(l.recompute_s for l, on in zip(p.layers, a.recompute) if on)
        if pt is not None and pt.time_s <= own:
            trial = Assignment(a.choice, a.ranks, pt.layers)
            if evaluate(p, trial).peak_bytes <= p.capacity_bytes:
                return trial
        return a
    rc = list(a.recompute)
    for i in sorted((i for i, on in enumerate(rc) if on), key=lambda i: (-p.layers[i].recompute_s, i)):
        rc[i] = False
        trial = Assignment(a.choice, a.ranks, tuple(rc))
        if evaluate(p, trial).peak_bytes > p.capacity_bytes:
            rc[i] = True
    return Assignment(a.choice, a.ranks, tuple(rc))


def _improve(p: CandidatePricing, a: Assignment, load: list[float], mem: list[float], budget: float, max_moves: int = 400) -> Assignment:
    """Move or swap single table-wise/column-wise shards off the most loaded rank while that lowers it."""
    s = p.group_size
    wa = p.a2a_s_per_byte
    ranks = [list(r) for r in a.ranks]
    on_rank: list[list[int]] = [[] for _ in range(s)]
    for t, rr in enumerate(ranks):
        if p.options[t][a.choice[t]].placement == "rank":
            for r in rr:
                on_rank[r].append(t)
    w_of = [shard_weight(p.options[t][a.choice[t]], wa) for t in range(len(ranks))]
    m_of = [p.options[t][a.choice[t]].mem_bytes for t in range(len(ranks))]
    for _ in range(max_moves):
        hi = max(range(s), key=lambda r: (load[r], -r))
        order = sorted(range(s), key=lambda r: (load[r], r))[: min(s, 8)]
        best = None  # (new pair max, t_out, u_in, lo)
        for lo in order:
            gap = load[hi] - load[lo]
            if gap <= 0:
                break
            for t in on_rank[hi]:
                if lo in ranks[t]:
                    continue
                d = w_of[t]
                if 0 < d < gap and mem[lo] + m_of[t] <= budget:
                    new = max(load[hi] - d, load[lo] + d)
                    if best is None or new < best[0]:
                        best = (new, t, None, lo)
                for u in on_rank[lo]:
                    if hi in ranks[u] or u == t:
                        continue
                    e = d - w_of[u]
                    if 0 < e < gap and mem[lo] - m_of[u] + m_of[t] <= budget and mem[hi] - m_of[t] + m_of[u] <= budget:
                        new = max(load[hi] - e, load[lo] + e)
                        if best is None or new < best[0]:
                            best = (new, t, u, lo)
        if best is None or best[0] >= load[hi] * (1 - 1e-12):
            break
        _, t, u, lo = best
        ranks[t][ranks[t].index(hi)] = lo
        on_rank[hi].remove(t)
        on_rank[lo].append(t)
        load[hi] -= w_of[t]
        load[lo] += w_of[t]
        mem[hi] -= m_of[t]
        mem[lo] += m_of[t]
        if u is not None:
            ranks[u][ranks[u].index(lo)] = hi
            on_rank[lo].remove(u)
            on_rank[hi].append(u)
            load[lo] -= w_of[u]
            load[hi] += w_of[u]
            mem[lo] -= m_of[u]
            mem[hi] += m_of[u]
    return Assignment(a.choice, tuple(tuple(sorted(r)) for r in ranks), a.recompute)


def break_lumps(p: CandidatePricing, a: Assignment, *, rounds: int = 200, per_round: int = 4) -> Assignment:
    """Local search on the option of the tables that make a maximum: for the shards on the ranks
    with the largest forward, backward and send loads, try every other option of their table (its
    shards on the least loaded ranks, or node, with room) and keep a change that lowers the step.

    The decomposed model decides only its most consequential tables; the others keep the heuristic's
    option, and a large table left whole on one rank can set a maximum that splitting it would
    remove. Every accepted change lowers the surrogate step, so this never makes a plan worse.
    """
    import numpy as np

    s, g = p.group_size, p.node_size
    wa, rf, wdp = p.a2a_s_per_byte, p.recv_factor, p.dp_s_per_byte
    F, B, S, M = (np.zeros(s) for _ in range(4))
    uf = ub = us = um = recv = dp = 0.0
    choice, ranks = list(a.choice), [tuple(r) for r in a.ranks]
    for t, (oi, rr) in enumerate(zip(choice, ranks)):
        o = p.options[t][oi]
        recv += o.recv_bytes
        dp += o.allreduce_bytes
        if o.placement == "all":
            uf, ub, us, um = uf + o.fwd_s, ub + o.bwd_s, us + o.send_bytes, um + o.mem_bytes
        else:
            idx = list(rr)
            F[idx] += o.fwd_s
            B[idx] += o.bwd_s
            S[idx] += o.send_bytes
            M[idx] += o.mem_bytes
    ev0 = evaluate(p, a)
    fixed = ev0.step_time_s - ev0.fwd_max_s - ev0.bwd_max_s - wa * ev0.a2a_bytes - wdp * ev0.dp_bytes  # base + recompute
    dense0 = ev0.dense_bytes - p.recv_mem_factor * recv  # dense part without receive buffers

    def step_of(F, B, S, uf, ub, us, recv, dp):
        return fixed + uf + F.max() + ub + B.max() + wa * max(us + S.max(), rf * recv) + wdp * dp

    def peak_of(M, um, recv):
        return dense0 + p.recv_mem_factor * recv + um + M.max()

    best = step_of(F, B, S, uf, ub, us, recv, dp)
    for _ in range(rounds):
        tops = {int(np.argmax(F)), int(np.argmax(B)), int(np.argmax(S))}
        on_top = sorted({t for t, rr in enumerate(ranks) if rr and tops.intersection(rr)},
                        key=lambda t: -shard_weight(p.options[t][choice[t]], wa))[:per_round]
        accepted = False
        for t in on_top:
            o = p.options[t][choice[t]]
            idx = list(ranks[t])
            F[idx] -= o.fwd_s
            B[idx] -= o.bwd_s
            S[idx] -= o.send_bytes
            M[idx] -= o.mem_bytes
            base = (uf, ub, us, um, recv - o.recv_bytes, dp - o.allreduce_bytes)
            found = None
            load = F + B + wa * S
            for i, q in enumerate(p.options[t]):
                if i == choice[t]:
                    continue
                nuf, nub, nus, num, nrecv, ndp = base[0], base[1], base[2], base[3], base[4] + q.recv_bytes, base[5] + q.allreduce_bytes
                if q.placement == "all":
                    nidx: list[int] = []
                    nuf, nub, nus, num = nuf + q.fwd_s, nub + q.bwd_s, nus + q.send_bytes, num + q.mem_bytes
                elif q.placement == "node":
                    if not g:
                        continue
                    n = int(np.argmin(load.reshape(-1, g).max(axis=1)))
                    nidx = list(range(n * g, (n + 1) * g))
                else:
                    nidx = [int(r) for r in np.argsort(load, kind="stable")[: q.num_shards]]
                F[nidx] += q.fwd_s
                B[nidx] += q.bwd_s
                S[nidx] += q.send_bytes
                M[nidx] += q.mem_bytes
                st = step_of(F, B, S, nuf, nub, nus, nrecv, ndp)
                ok = peak_of(M, num, nrecv) <= p.capacity_bytes
                F[nidx] -= q.fwd_s
                B[nidx] -= q.bwd_s
                S[nidx] -= q.send_bytes
                M[nidx] -= q.mem_bytes
                if ok and st < best * (1 - 1e-9) and (found is None or st < found[0]):
                    found = (st, i, nidx, (nuf, nub, nus, num, nrecv, ndp))
            if found is None:
                F[idx] += o.fwd_s
                B[idx] += o.bwd_s
                S[idx] += o.send_bytes
                M[idx] += o.mem_bytes
                continue
            best, i, nidx, (uf, ub, us, um, recv, dp) = found
            q = p.options[t][i]
            F[nidx] += q.fwd_s
            B[nidx] += q.bwd_s
            S[nidx] += q.send_bytes
            M[nidx] += q.mem_bytes
            choice[t], ranks[t] = i, tuple(sorted(nidx))
            accepted = True
            break
        if not accepted:
            break
    out = Assignment(tuple(choice), tuple(ranks), a.recompute)
    ev = evaluate(p, out)
    # floats: keep the change only if the exact evaluation agrees that it is better and fits
    return out if ev.step_time_s < ev0.step_time_s and ev.peak_bytes <= p.capacity_bytes else a


def _top3(x):
    """Indices and values of the three largest entries of ``x`` (padded with -inf below three ranks)."""
    import numpy as np

    k = min(3, x.size)
    idx = np.argsort(-x, kind="stable")[:k]
    vals = x[idx]
    if k < 3:
        idx = np.concatenate([idx, np.full(3 - k, -1)])
        vals = np.concatenate([vals, np.full(3 - k, -np.inf)])
    return idx, vals


def _max_without(top, h, r):
    """The largest entry of a per-rank array leaving out ranks ``h`` and ``r`` (arrays broadcast)."""
    import numpy as np

    (i1, i2, _), (v1, v2, v3) = top
    bad1 = (i1 == h) | (i1 == r)
    bad2 = (i2 == h) | (i2 == r)
    return np.where(~bad1, v1, np.where(~bad2, v2, v3))


def rebalance(p: CandidatePricing, a: Assignment, *, max_steps: int = 2_000) -> Assignment:
    """Local search on the placement alone (options kept): move one shard off a rank that sets the
    forward, backward or send maximum to any rank with room, or swap it with a shard of another rank,
    taking each time the change that lowers the step most, until none does.

    List scheduling and :func:`_improve` balance one scalar per rank (time plus send time), but the
    step pays three separate maxima (forward, backward, sends, the last only above the receive floor),
    and a plan balanced in the sum can still have one rank high in backward and another in sends.
    This prices every candidate move against the three maxima exactly (the runner-up entries of each
    are kept, so a move is priced without a pass over the ranks). Shards placed by node
    (table-row-wise) stay where they are; two shards of one table never share a rank. Every accepted
    move lowers the surrogate step, so this never makes a plan worse.
    """
    import numpy as np

    s = p.group_size
    wa = p.a2a_s_per_byte
    n_t = len(p.options)
    F, B, S, M = (np.zeros(s) for _ in range(4))
    us = um = recv = 0.0
    it_t: list[int] = []
    it_r: list[int] = []
    for t, (oi, rr) in enumerate(zip(a.choice, a.ranks)):
        o = p.options[t][oi]
        recv += o.recv_bytes
        if o.placement == "all":
            us, um = us + wa * o.send_bytes, um + o.mem_bytes
            continue
        idx = list(rr)
        F[idx] += o.fwd_s
        B[idx] += o.bwd_s
        S[idx] += wa * o.send_bytes
        M[idx] += o.mem_bytes
        if o.placement == "rank":
            it_t += [t] * len(idx)
            it_r += idx
    if not it_t or s < 2:
        return a
    ev0 = evaluate(p, a)
    floor = wa * p.recv_factor * recv
    cap = p.capacity_bytes - ev0.dense_bytes - um  # room per rank for placed shards
    it_t_a = np.asarray(it_t)
    it_r_a = np.asarray(it_r)
    opt = [p.options[t][a.choice[t]] for t in range(n_t)]
    f = np.array([opt[t].fwd_s for t in it_t])
    b = np.array([opt[t].bwd_s for t in it_t])
    sd = np.array([wa * opt[t].send_bytes for t in it_t])
    m = np.array([opt[t].mem_bytes for t in it_t])
    holds = np.zeros((n_t, s), dtype=bool)
    holds[it_t_a, it_r_a] = True
    ranks = np.arange(s)

    def step_of(fm, bm, sm):
        return fm + bm + np.maximum(us + sm, floor)

    # Plateaus: identical tables give several ranks the same maximum, and no single move lowers it.
    # A second key, the spread of each binding load (sum of squares over ranks, relative to its mean),
    # lets the search take moves that keep the step and make the loads more even, so the next move can
    # lower the maximum.
    norm = np.array([max(F.mean(), 1e-30), max(B.mean(), 1e-30), max(S.mean(), 1e-30)]) ** -2
    cur = float(step_of(F.max(), B.max(), S.max()))
    X = (F, B, S)
    for _ in range(max_steps):
        tops = tuple(_top3(x) for x in X)
        binding = [True, True, us + tops[2][1][0] > floor]  # sends matter only above the receive floor
        hot = sorted({int(tops[d][0][0]) for d in range(3) if binding[d]})
        J = np.flatnonzero(np.isin(it_r_a, hot))
        if J.size == 0:
            break
        h = it_r_a[J][:, None]
        d_j = (f[J][:, None], b[J][:, None], sd[J][:, None])
        mj = m[J][:, None]

        def price(r, dx):
            """Step and change of spread after moving ``dx`` (per load) from rank h to rank r."""
            maxes, spread = [], 0.0
            for k in range(3):
                x = X[k]
                maxes.append(np.maximum(_max_without(tops[k], h, r), np.maximum(x[h] - dx[k], x[r] + dx[k])))
                if binding[k]:
                    spread = spread + norm[k] * 2 * dx[k] * (x[r] - x[h] + dx[k])
            return step_of(*maxes), spread

        def pick(st, sp, ok):
            """Best candidate by (step, spread) among those that lower the step, or keep it and lower the spread."""
            st = np.where(ok, st, np.inf)
            better = st < cur * (1 - 1e-12)
            if better.any():
                k = int(np.argmin(np.where(better, st, np.inf)))
                return k, float(st.flat[k]), True
            same = (st <= cur * (1 + 1e-12)) & (sp < -1e-9)
            if same.any():
                k = int(np.argmin(np.where(same, sp, np.inf)))
                return k, float(st.flat[k]), True
            return -1, cur, False

        r = ranks[None, :]
        st, sp = price(r, d_j)
        ok = (r != h) & ~holds[it_t_a[J]] & (M[None, :] + mj <= cap)
        k, val, found = pick(st, sp, ok)
        if found:
            jj, dest = np.unravel_index(k, st.shape)
            moves = [(int(J[jj]), int(dest))]
        else:  # swaps, only when no single move helps (they cost |J| x shards to price)
            ru = it_r_a[None, :]
            tj, tu = it_t_a[J][:, None], it_t_a[None, :]
            st, sp = price(ru, (d_j[0] - f[None, :], d_j[1] - b[None, :], d_j[2] - sd[None, :]))
            dm = mj - m[None, :]
            ok = ((ru != h) & (tu != tj) & ~holds[tj, ru] & ~holds[tu, h]
                  & (M[h] - dm <= cap) & (M[ru] + dm <= cap))
            k, val, found = pick(st, sp, ok)
            if not found:
                break
            jj, uu = np.unravel_index(k, st.shape)
            j, u = int(J[jj]), int(uu)
            moves = [(j, int(it_r_a[u])), (u, int(it_r_a[j]))]
        for j, dest in moves:
            src = int(it_r_a[j])
            F[src] -= f[j]; B[src] -= b[j]; S[src] -= sd[j]; M[src] -= m[j]
            F[dest] += f[j]; B[dest] += b[j]; S[dest] += sd[j]; M[dest] += m[j]
            holds[it_t_a[j], src] = False
        for j, dest in moves:
            holds[it_t_a[j], dest] = True
            it_r_a[j] = dest
        cur = min(cur, val)
    new_ranks = [list(rr) if opt[t].placement != "rank" else [] for t, rr in enumerate(a.ranks)]
    for t, r in zip(it_t_a.tolist(), it_r_a.tolist()):
        new_ranks[t].append(r)
    out = Assignment(a.choice, tuple(tuple(sorted(rr)) for rr in new_ranks), a.recompute)
    ev = evaluate(p, out)
    # floats: keep the result only if the exact evaluation agrees that it is better and fits
    return out if ev.step_time_s < ev0.step_time_s and ev.peak_bytes <= p.capacity_bytes else a


def _avg_cost(p: CandidatePricing, o) -> float:
    """What an option adds to the average rank: its per-rank time and sends, plus its share of the
    receive floor and the all-reduce."""
    s = p.group_size
    wa = p.a2a_s_per_byte
    per = shard_weight(o, wa)
    base = per if o.placement == "all" else per * copies(o) / s
    return base + wa * p.recv_factor * o.recv_bytes / max(1, s) + p.dp_s_per_byte * o.allreduce_bytes


def heuristic(p: CandidatePricing, recompute: tuple[bool, ...] | None = None) -> Assignment | None:
    """Greedy option choice and placement on the surrogate itself.

    Tables go largest first; each takes the option (and ranks: the least loaded with room) that keeps
    the projected step lowest, where the projection is the larger of the step so far and the average
    rank once every remaining table adds its smallest possible share. Recompute is chosen up front
    to free what the embeddings need on average. Returns None when some table fits nowhere.
    """
    import numpy as np

    s, g = p.group_size, p.node_size
    wa, rf = p.a2a_s_per_byte, p.recv_factor
    n_t = len(p.options)
    if recompute is None:
        min_mem = sum(min(o.mem_bytes * (copies(o) if o.placement != "all" else s) for o in opts) for opts in p.options) / s
        base_room = _room(p, (), ())
        recompute = _recompute_for(p, min_mem * 1.05 - base_room)
    saved = sum(l.saved_bytes for l, on in zip(p.layers, recompute) if on)
    peak = max((l.peak_bytes for l, on in zip(p.layers, recompute) if on), default=0.0)
    # Receive buffers and options on every rank take memory on all ranks. Reserve each table's least
    # receive volume up front and count the rest, with every-rank shards, as uniform memory ``U``; the
    # invariant max_r Mm[r] + U <= room0 then holds after every step, so earlier shards stay valid.
    rmin = [min(o.recv_bytes for o in opts) for opts in p.options]
    room0 = p.capacity_bytes - (p.base_bytes - saved + peak) - p.recv_mem_factor * sum(rmin)
    U = 0.0
    F = np.zeros(s)
    B = np.zeros(s)
    S = np.zeros(s)
    Mm = np.zeros(s)
    uf = ub = us = um = recv = dp = 0.0
    min_contrib = [min(_avg_cost(p, o) for o in opts) for opts in p.options]
    order = sorted(range(n_t), key=lambda t: (-min(shard_weight(o, wa) for o in p.options[t]), t))
    remaining = sum(min_contrib)
    min_mem = [min(o.mem_bytes * (s if o.placement == "all" else copies(o)) for o in opts) / s for opts in p.options]
    mem_remaining = sum(min_mem)
    choice = [0] * n_t
    ranks: list[tuple[int, ...]] = [()] * n_t
    for t in order:
        remaining -= min_contrib[t]
        mem_remaining -= min_mem[t]
        mem_avg = float(Mm.mean())
        cur_avg = (F.sum() + B.sum() + wa * S.sum()) / s + uf + ub + wa * us + wa * rf * recv / s + p.dp_s_per_byte * dp
        best = None
        for i, o in enumerate(p.options[t]):
            new_recv = recv + o.recv_bytes
            new_u = U + p.recv_mem_factor * (o.recv_bytes - rmin[t]) + (o.mem_bytes if o.placement == "all" else 0.0)
            if Mm.max() + new_u > room0:
                continue
            room = room0 - new_u
            if o.placement == "all":
                rr: tuple[int, ...] = ()
                fmax, bmax, smax = F.max() + uf + o.fwd_s, B.max() + ub + o.bwd_s, S.max() + us + o.send_bytes
            else:
                ok = Mm + o.mem_bytes <= room
                if o.placement == "node":
                    if not g:
                        continue
                    node_load = (F + B + wa * S).reshape(-1, g).max(axis=1)
                    node_ok = ok.reshape(-1, g).all(axis=1)
                    cand = np.flatnonzero(node_ok)
                    if cand.size == 0:
                        continue
                    n = int(cand[np.lexsort((cand, node_load[cand]))[0]])
                    idx = np.arange(n * g, (n + 1) * g)
                else:
                    cand = np.flatnonzero(ok)
                    if cand.size < o.num_shards:
                        continue
                    load = (F + B + wa * S)[cand]
                    idx = cand[np.lexsort((cand, load))[: o.num_shards]]
                rr = tuple(sorted(int(r) for r in idx))
                fmax = max(F.max(), float((F[idx] + o.fwd_s).max())) + uf
                bmax = max(B.max(), float((B[idx] + o.bwd_s).max())) + ub
                smax = max(S.max(), float((S[idx] + o.send_bytes).max())) + us
            step = fmax + bmax + wa * max(smax, rf * new_recv) + p.dp_s_per_byte * (dp + o.allreduce_bytes)
            proj = max(step, cur_avg + _avg_cost(p, o) + remaining)
            # memory look-ahead: the average rank must still fit once every remaining table adds its least
            mem_proj = mem_avg + (0.0 if o.placement == "all" else o.mem_bytes * copies(o) / s) + mem_remaining + new_u
            # a shard taking most of a rank's room strands it: use one only when nothing else fits
            lump = o.placement != "all" and o.mem_bytes > 0.5 * (room0 - new_u)
            key = (mem_proj > room0, lump, proj, step, _avg_cost(p, o), i)
            if best is None or key < best[0]:
                best = (key, i, rr)
        if best is None:
            return None
        _, i, rr = best
        o = p.options[t][i]
        choice[t] = i
        ranks[t] = rr
        U += p.recv_mem_factor * (o.recv_bytes - rmin[t]) + (o.mem_bytes if o.placement == "all" else 0.0)
        recv += o.recv_bytes
        dp += o.allreduce_bytes
        if o.placement == "all":
            uf += o.fwd_s
            ub += o.bwd_s
            us += o.send_bytes
            um += o.mem_bytes
        else:
            idx = np.asarray(rr, dtype=np.int64)
            F[idx] += o.fwd_s
            B[idx] += o.bwd_s
            S[idx] += o.send_bytes
            Mm[idx] += o.mem_bytes
    return Assignment(tuple(choice), tuple(ranks), tuple(recompute))


def heuristic_any(p: CandidatePricing) -> Assignment | None:
    """:func:`heuristic`; when its shards do not fit, its options placed memory-first with more
    recompute, and at last every layer recomputed."""
    a = heuristic(p)
    if a is not None:
        return trim_recompute(p, a) if evaluate(p, a).peak_bytes <= p.capacity_bytes else a
    if not p.layers:
        return None
    full = tuple(True for _ in p.layers)
    a = heuristic(p, full)
    if a is None:
        return None
    # the options chosen with every layer recomputed, with as little recompute as they need
    return place_with_repair(p, a.choice, _recompute_for(p, 0.0)) or a


# ---------------------------------------------------------------------------------------------
# Common model pieces
# ---------------------------------------------------------------------------------------------


def _common(m, p: CandidatePricing, units, y, *, free=None, recv_mem_const: int = 0, recv_const: int = 0, dp_const: int = 0,
            points=None):
    """Recompute booleans and their time, the recompute peak, the receive and all-reduce sums, and
    ``room``: the memory per rank left for embeddings (capacity − dense part − receive buffers).
    ``free`` lists the tables with choice variables (default all); the others enter as constants.
    With ``points`` (recompute frontier points) the recompute booleans are one per point, else one
    per layer."""
    from ortools.sat.python import cp_model

    free = range(len(p.options)) if free is None else free
    recv_terms = [(_recv_mem(p, p.options[t][i]), y[t][i]) for t in free for i in range(len(p.options[t])) if p.options[t][i].recv_bytes > 0]
    recv_mem = cp_model.LinearExpr.WeightedSum([v for _, v in recv_terms], [c for c, _ in recv_terms]) if recv_terms else 0
    cap = _m_down(p.capacity_bytes) - _m_up(p.base_bytes) - recv_mem_const
    if points is not None:
        # one choice among the recompute frontier's points: exact, and a far tighter relaxation than
        # per-layer booleans under a max over peaks (see coplan.planner.recompute)
        rc = [m.NewBoolVar(f"rcp{j}") for j in range(len(points))]
        m.AddExactlyOne(rc)
        freed_c = [_m_down(pt.freed_bytes) for pt in points]
        room = m.NewIntVar(min(0, cap + min(freed_c) - sum(c for c, _ in recv_terms)), max(0, cap + max(freed_c)), "room")
        m.Add(room == cap + cp_model.LinearExpr.WeightedSum(rc, freed_c) - recv_mem)
        rc_cost = [_t(pt.time_s) for pt in points]
    else:
        rc = [m.NewBoolVar(f"rc{l}") for l in range(len(p.layers))]
        peak_hi = max((_m_up(l.peak_bytes) for l in p.layers), default=0)
        peak = m.NewIntVar(0, peak_hi, "rc_peak")
        for l, v in zip(p.layers, rc):
            if l.peak_bytes > 0:
                m.Add(peak >= _m_up(l.peak_bytes) * v)
        freed = cp_model.LinearExpr.WeightedSum(rc, [_m_down(l.saved_bytes) for l in p.layers]) if rc else 0
        room_lo = cap - peak_hi - sum(c for c, _ in recv_terms)
        room_hi = cap + sum(_m_down(l.saved_bytes) for l in p.layers)
        room = m.NewIntVar(min(room_lo, 0), max(room_hi, 0), "room")
        m.Add(room == cap + freed - peak - recv_mem)
        rc_cost = [_t(l.recompute_s) for l in p.layers]
    recv_t = [(units[t][i].recv, y[t][i]) for t in free for i in range(len(p.options[t])) if units[t][i].recv]
    dp_t = [(units[t][i].dp, y[t][i]) for t in free for i in range(len(p.options[t])) if units[t][i].dp]
    recv = (cp_model.LinearExpr.WeightedSum([v for _, v in recv_t], [c for c, _ in recv_t]) if recv_t else 0) + recv_const
    dp = (cp_model.LinearExpr.WeightedSum([v for _, v in dp_t], [c for c, _ in dp_t]) if dp_t else 0) + dp_const
    rc_time = cp_model.LinearExpr.WeightedSum(rc, rc_cost) if rc else 0
    return rc, room, recv, dp, rc_time


def _horizon(units) -> int:
    return sum(max(max(u.f, u.b, u.s, u.recv, u.dp) for u in us) for us in units) * 4 + 1


# ---------------------------------------------------------------------------------------------
# Flat CP-SAT
# ---------------------------------------------------------------------------------------------


def solve_flat(p: CandidatePricing, settings: SolverSettings, *, hint: Assignment | None = None) -> SolveResult:
    from ortools.sat.python import cp_model

    t0 = time.perf_counter()
    s, g = p.group_size, p.node_size
    units = _units(p)
    m = cp_model.CpModel()
    y = [[m.NewBoolVar(f"y{t}_{i}") for i in range(len(opts))] for t, opts in enumerate(p.options)]
    for yt in y:
        m.AddExactlyOne(yt)
    F: list[list] = [[] for _ in range(s)]
    B: list[list] = [[] for _ in range(s)]
    S: list[list] = [[] for _ in range(s)]
    Mm: list[list] = [[] for _ in range(s)]
    xr: dict[tuple[int, int, int], object] = {}
    zn: dict[tuple[int, int, int], object] = {}

    def put(r, u: _Units, v):
        if u.f:
            F[r].append((u.f, v))
        if u.b:
            B[r].append((u.b, v))
        if u.s:
            S[r].append((u.s, v))
        if u.m:
            Mm[r].append((u.m, v))

    for t, opts in enumerate(p.options):
        for i, o in enumerate(opts):
            u = units[t][i]
            if o.placement == "all":
                for r in range(s):
                    put(r, u, y[t][i])
            elif o.placement == "rank":
                xs = [m.NewBoolVar(f"x{t}_{i}_{r}") for r in range(s)]
                for r, v in enumerate(xs):
                    xr[t, i, r] = v
                    m.AddImplication(v, y[t][i])
                    put(r, u, v)
                m.Add(sum(xs) == o.num_shards * y[t][i])
            else:
                zs = [m.NewBoolVar(f"z{t}_{i}_{n}") for n in range(p.num_nodes)]
                for n, v in enumerate(zs):
                    zn[t, i, n] = v
                    for r in range(n * g, (n + 1) * g):
                        put(r, u, v)
                m.Add(sum(zs) == y[t][i])
    rc, room, recv, dp, rc_time = _common(m, p, units, y)
    H = _horizon(units)
    zf, zb, za = m.NewIntVar(0, H, "max_fwd"), m.NewIntVar(0, H, "max_bwd"), m.NewIntVar(0, H, "a2a")

    def lin(terms):
        return cp_model.LinearExpr.WeightedSum([v for _, v in terms], [c for c, _ in terms])

    for r in range(s):
        if F[r]:
            m.Add(lin(F[r]) <= zf)
        if B[r]:
            m.Add(lin(B[r]) <= zb)
        if S[r]:
            m.Add(lin(S[r]) <= za)
        if Mm[r]:
            m.Add(lin(Mm[r]) <= room)
    m.Add(za >= recv)
    # identical ranks of a node: order them (any plan can be permuted into this order)
    for n in range(p.num_nodes):
        for r in range(n * g, (n + 1) * g - 1):
            a_, b_ = F[r] + B[r] + S[r], F[r + 1] + B[r + 1] + S[r + 1]
            if a_:
                m.Add(lin(a_) >= lin(b_))
    m.Minimize(zf + zb + za + dp + rc_time)
    if hint is not None:
        _hint_flat(m, p, _sorted_hint(p, hint), y, xr, zn, rc)
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
        ev = evaluate(p, a)
        bound = p.base_time_s + solver.BestObjectiveBound() * TIME_UNIT_S - _rounding_slack(p)
        return SolveResult(a, name, ev.step_time_s, ev.peak_bytes, min(bound, ev.step_time_s), wall, "flat")
    if status == cp_model.INFEASIBLE:
        return SolveResult(None, "INFEASIBLE", math.inf, math.inf, math.inf, wall, "flat")
    if hint is not None:
        ev = evaluate(p, hint)
        ok = ev.peak_bytes <= p.capacity_bytes
        bound = p.base_time_s + solver.BestObjectiveBound() * TIME_UNIT_S - _rounding_slack(p)
        return SolveResult(hint if ok else None, "FEASIBLE" if ok else "UNKNOWN", ev.step_time_s if ok else math.inf, ev.peak_bytes, bound, wall, "flat")
    return SolveResult(None, "UNKNOWN", math.inf, math.inf, p.base_time_s, wall, "flat")


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


def _sorted_hint(p: CandidatePricing, a: Assignment) -> Assignment:
    """Relabel ranks within each node so the rank order matches the model's symmetry breaking."""
    units = _units(p)
    tot = [0] * p.group_size
    for t, (oi, rr) in enumerate(zip(a.choice, a.ranks)):
        u = units[t][oi]
        for r in rr:
            tot[r] += u.f + u.b + u.s
    g = p.node_size
    mapping: dict[int, int] = {}
    for n in range(p.num_nodes):
        rr = list(range(n * g, (n + 1) * g))
        for new, old in zip(rr, sorted(rr, key=lambda r: (-tot[r], r))):
            mapping[old] = new
    ranks = tuple(tuple(sorted(mapping[r] for r in rr)) for rr in a.ranks)
    return Assignment(a.choice, ranks, a.recompute)


class _Collector:
    """CP-SAT callback keeping the values of some variables in the last ``keep`` solutions."""

    def __new__(cls, variables, more, keep):
        from ortools.sat.python import cp_model

        class Impl(cp_model.CpSolverSolutionCallback):
            def __init__(self):
                super().__init__()
                self.vars = list(variables) + list(more)
                self.solutions: list[tuple[int, ...]] = []

            def on_solution_callback(self):
                self.solutions.append(tuple(int(self.Value(v)) for v in self.vars))
                del self.solutions[:-keep]

        return Impl()


def _is_on(v, on: set[tuple[int, int]]) -> bool:
    """Whether choice variable ``y{t}_{i}`` is set by the hint ``on`` (pairs (t, i))."""
    t, i = v.Name()[1:].split("_")
    return (int(t), int(i)) in on


# ---------------------------------------------------------------------------------------------
# Decomposed CP-SAT
# ---------------------------------------------------------------------------------------------


FREE_TABLES = 160
"""Tables that keep their own choice variables in the decomposed model (the most consequential)."""

LIGHT_PRESOLVE_ABOVE = 400
"""Free tables above which the decomposed model is presolved without probing and overlap detection."""


def _importances(p: CandidatePricing) -> list[float]:
    """How much each table's choice can matter, relative to an average rank: the spread between its
    options in time added to the average rank, and its biggest single shard in time and in memory."""
    wa = p.a2a_s_per_byte
    s = p.group_size
    avg = [[_avg_cost(p, o) for o in opts] for opts in p.options]
    t_scale = max(1e-12, sum(min(a) for a in avg))
    m_scale = max(1.0, sum(min(o.mem_bytes * (s if o.placement == "all" else copies(o)) for o in opts) / s for opts in p.options))
    out = []
    for opts, a in zip(p.options, avg):
        lump_t = max((shard_weight(o, wa) for o in opts if o.placement != "all"), default=0.0)
        lump_m = max((o.mem_bytes for o in opts if o.placement != "all"), default=0.0)
        out.append((max(a) - min(a) + lump_t) / t_scale + lump_m / m_scale)
    return out


def solve_decomposed(p: CandidatePricing, settings: SolverSettings, *, free_tables: int = FREE_TABLES,
                     cutoff_s: float | None = None) -> SolveResult:
    """Aggregated option choice (a relaxation, so its bound is valid), then placement.

    The ``free_tables`` most consequential tables get choice variables; every other table enters the
    relaxation with the least it can add to each aggregate (its smallest total work per dimension,
    receive volume, all-reduce and memory over its options), which keeps the bound valid, and keeps
    the heuristic's choice in the plan. With 1,200 tables over thousands of ranks most tables are a
    rounding error of one rank's load; the ones that are not are the ones CP-SAT decides.

    ``cutoff_s`` (branch and bound across mesh candidates): only relaxed solutions below it are
    sought. When the relaxation has none, the candidate is proven unable to go below the cutoff, which
    is then its bound (valid), and its heuristic plan stands; proving that is usually much cheaper
    than solving the relaxation to optimality.
    """
    from ortools.sat.python import cp_model

    t0 = time.perf_counter()
    s = p.group_size
    units = _units(p)
    hint = heuristic_any(p)
    n_t = len(p.options)
    imp = _importances(p)
    order = sorted(range(n_t), key=lambda t: (-imp[t], t))
    free = sorted(order[: min(n_t, free_tables)])
    fixed = order[min(n_t, free_tables):]
    m = cp_model.CpModel()
    y: list[list] = [[] for _ in range(n_t)]
    for t in free:
        y[t] = [m.NewBoolVar(f"y{t}_{i}") for i in range(len(p.options[t]))]
        m.AddExactlyOne(y[t])
    # constants of the fixed tables: the least each can add (over its options) to each aggregate
    cw = {k: 0 for k in "fbsm"}
    recv_c = dp_c = recv_mem_c = 0
    for t in fixed:
        us = units[t]
        for k in "fbsm":
            cw[k] += min(getattr(u, k) * (s if o.placement == "all" else copies(o)) for u, o in zip(us, p.options[t]))
        recv_c += min(u.recv for u in us)
        dp_c += min(u.dp for u in us)
        recv_mem_c += min(_recv_mem(p, o) for o in p.options[t])
    front = frontier(p.layers)
    points = None
    hint_ev = evaluate(p, hint) if hint is not None else None
    if front is not None:
        # points costing more recompute than the whole sparse-and-recompute part of the heuristic
        # plan cannot beat it: leaving them out keeps the bound valid (it is capped by that plan)
        cap_s = hint_ev.step_time_s - p.base_time_s if hint_ev is not None and hint_ev.peak_bytes <= p.capacity_bytes else math.inf
        points = [pt for pt in front.points if pt.time_s <= cap_s + 2 * _rounding_slack(p)] or list(front.points[:1])
    rc, room, recv, dp, rc_time = _common(m, p, units, y, free=free, recv_mem_const=recv_mem_c, recv_const=recv_c, dp_const=dp_c,
                                          points=points)
    H = _horizon(units)
    uni = {k: [] for k in "fbsm"}
    pack = {k: [] for k in "fbsm"}
    per_table = []
    for t in free:
        item = {k: [] for k in "fbsm"}
        for i, o in enumerate(p.options[t]):
            u = units[t][i]
            for k in "fbsm":
                c = getattr(u, k)
                if not c:
                    continue
                if o.placement == "all":
                    uni[k].append((c, y[t][i]))
                else:
                    pack[k].append((c * copies(o), y[t][i]))
                    item[k].append((c, y[t][i]))
        per_table.append(item)

    def lin(terms):
        return cp_model.LinearExpr.WeightedSum([v for _, v in terms], [c for c, _ in terms]) if terms else 0

    zf, zb, za = m.NewIntVar(0, H, "max_fwd"), m.NewIntVar(0, H, "max_bwd"), m.NewIntVar(0, H, "a2a")
    uf, ub, us_ = (m.NewIntVar(0, H, f"uni_{k}") for k in "fbs")
    um = m.NewIntVar(0, max(1, sum(c for c, _ in uni["m"])), "uni_m")
    m.Add(uf == lin(uni["f"]))
    m.Add(ub == lin(uni["b"]))
    m.Add(us_ == lin(uni["s"]))
    m.Add(um == lin(uni["m"]))
    for z, u, k in ((zf, uf, "f"), (zb, ub, "b"), (za, us_, "s")):
        m.Add(s * z >= s * u + lin(pack[k]) + cw[k])
        m.Add(z >= u)
        for item in per_table:
            if item[k]:
                m.Add(z >= u + lin(item[k]))
    m.Add(za >= recv)
    m.Add(lin(pack["m"]) + cw["m"] <= s * (room - um))
    for item in per_table:
        if item["m"]:
            m.Add(um + lin(item["m"]) <= room)
    cut = None
    if cutoff_s is not None and math.isfinite(cutoff_s):
        cut = _t(cutoff_s - p.base_time_s + _rounding_slack(p))
        m.Add(zf + zb + za + dp + rc_time <= cut)
    m.Minimize(zf + zb + za + dp + rc_time)
    if hint is not None:
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
            # Hint the aggregates too: CP-SAT then starts from a complete solution instead of spending
            # most of a short budget completing the hint by search.
            on = {(t, hint.choice[t]) for t in free}
            val = {k: sum(c for (c, v) in uni[k] if v.Name() and _is_on(v, on)) for k in "fbsm"}
            packed = {k: sum(c for (c, v) in pack[k] if _is_on(v, on)) for k in "fbsm"}
            items = {k: max([sum(c for (c, v) in item[k] if _is_on(v, on)) for item in per_table] or [0]) for k in "fbsm"}
            recv_v = recv_c + sum(units[t][hint.choice[t]].recv for t in free)
            recv_mem_v = sum(_recv_mem(p, p.options[t][hint.choice[t]]) for t in free if p.options[t][hint.choice[t]].recv_bytes > 0)
            room_v = _m_down(p.capacity_bytes) - _m_up(p.base_bytes) - recv_mem_c + _m_down(points[j].freed_bytes) - recv_mem_v
            hz = {k: max(val[k] + -(-(packed[k] + cw[k]) // s), val[k] + items[k]) for k in "fbs"}
            hz["s"] = max(hz["s"], recv_v)
            for var, x in ((uf, val["f"]), (ub, val["b"]), (us_, val["s"]), (um, val["m"]), (zf, hz["f"]), (zb, hz["b"]), (za, hz["s"]),
                           (room, room_v)):
                m.AddHint(var, int(x))
    solver = cp_model.CpSolver()
    _params(solver, settings, settings.time_limit_s)
    if len(free) > LIGHT_PRESOLVE_ABOVE:
        # With many free tables, probing and the search for overlapping linear blocks take the whole
        # deterministic budget in presolve (measured: 2 deterministic s and no solution with all 1,200
        # tables of gem-1t free); the LP relaxation, not presolve, is what closes this model.
        solver.parameters.find_big_linear_overlap = False
        solver.parameters.cp_model_probing_level = 0
    # The relaxation ranks option choices by averaged loads; the placed plan pays for imbalance the
    # relaxation does not see, so the best relaxed solution is not always the best placed one. Keep
    # the last few improving solutions and place each (placement is cheap next to the solve).
    keep = max(1, int(settings.placed_solutions))
    collector = _Collector([v for t in free for v in y[t]], list(rc), keep)
    status = solver.Solve(m, collector)
    if status == cp_model.INFEASIBLE and cut is not None:
        # nothing in the relaxation goes below the cutoff (up to rounding): that is the bound
        wall = time.perf_counter() - t0
        lb = p.base_time_s + cut * TIME_UNIT_S - 2 * _rounding_slack(p)
        if hint is not None and hint_ev is not None and hint_ev.peak_bytes <= p.capacity_bytes:
            return SolveResult(hint, "FEASIBLE", hint_ev.step_time_s, hint_ev.peak_bytes, min(lb, hint_ev.step_time_s), wall, "decomposed")
        return SolveResult(None, "UNKNOWN", math.inf, math.inf, lb, wall, "decomposed")
    if status == cp_model.INFEASIBLE and points is not None and len(points) < len(front.points):
        # only rounding can make the kept points infeasible (the heuristic plan fits one of them); that
        # plan is then the best there is
        return SolveResult(hint, "FEASIBLE", hint_ev.step_time_s, hint_ev.peak_bytes, hint_ev.step_time_s - 2 * _rounding_slack(p),
                           time.perf_counter() - t0, "decomposed")
    if status == cp_model.INFEASIBLE:
        return SolveResult(None, "INFEASIBLE", math.inf, math.inf, math.inf, time.perf_counter() - t0, "decomposed")
    bound = p.base_time_s + solver.BestObjectiveBound() * TIME_UNIT_S - _rounding_slack(p)
    best: Assignment | None = hint if hint is not None and evaluate(p, hint).peak_bytes <= p.capacity_bytes else None
    relaxed_opt = status == cp_model.OPTIMAL and not fixed
    if status in (cp_model.OPTIMAL, cp_model.FEASIBLE) and hint is not None:
        n_y = sum(len(y[t]) for t in free)
        seen = set()
        for values in reversed(collector.solutions):  # best (last) first
            ys, rs = values[:n_y], values[n_y:]
            choice = list(hint.choice)
            k = 0
            for t in free:
                choice[t] = next(i for i in range(len(y[t])) if ys[k + i])
                k += len(y[t])
            if points is None:
                recompute = tuple(bool(x) for x in rs)
            else:
                recompute = next(pt.layers for pt, x in zip(points, rs) if x)
            key = (tuple(choice), recompute)
            if key in seen:
                continue
            seen.add(key)
            placed = place_with_repair(p, tuple(choice), recompute, loads=settings.thorough_placement)
            if placed is not None:
                ev = evaluate(p, placed)
                if ev.peak_bytes <= p.capacity_bytes and (best is None or ev.step_time_s < evaluate(p, best).step_time_s):
                    best = placed
    if best is not None:
        best = break_lumps(p, best)
        if settings.thorough_placement and settings.rebalance_steps > 0:
            best = rebalance(p, best, max_steps=settings.rebalance_steps)
    wall = time.perf_counter() - t0
    if best is None:
        return SolveResult(None, "UNKNOWN", math.inf, math.inf, bound, wall, "decomposed")
    ev = evaluate(p, best)
    # The placement is a heuristic: the candidate is proven optimal only if it meets the relaxation's bound.
    overall = "OPTIMAL" if relaxed_opt and ev.step_time_s <= bound + 2 * _rounding_slack(p) else "FEASIBLE"
    return SolveResult(best, overall, ev.step_time_s, ev.peak_bytes, min(bound, ev.step_time_s), wall, "decomposed")
