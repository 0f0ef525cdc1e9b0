"""The search over mesh candidates: price, bound, prune, solve, re-price, choose, and assemble the Plan.

1. Enumerate every (dense shard, expert-parallel, sparse shard, micro-batches) factorisation of the
   world (:mod:`coplan.planner.mesh`), keeping the user's pins.
2. Price each at its **floor point** (every aggregate a table placement adds at the least any
   placement can give it, nothing recomputed) with the cost model's full pricer
   (:mod:`coplan.planner.costs`). The pricer's step is non-decreasing in every task duration, so that
   price, plus the least recompute its memory needs (each layer at what the floor path's cut charges
   for it), bounds the candidate from below (:mod:`coplan.planner.bounds`). The floor's critical path
   is the candidate's first cut. Candidates whose memory cannot fit even with every layer recomputed
   and tables spread as thinly as possible are infeasible; they feed the explanation when nothing fits
   (:mod:`coplan.planner.explain`).
3. Branch and bound over candidates in order of their bound, in deterministic batches (one
   single-threaded solve per process; the batch is fixed before it runs). Each candidate is solved
   with CP-SAT on its cut model (:mod:`coplan.planner.solver`), the solution is **priced** with the
   full pricer, and its critical path is added as a cut; the candidate is re-solved until the priced
   step agrees with the model within ``model_tolerance`` (Kelley's cutting-plane method: the model is
   a piecewise-linear under-estimate of the pricer's step that is exact at every plan it priced). The
   search stops when the next bound cannot beat the best *priced* plan by more than
   ``gap_tolerance``; later candidates get that plan as an objective cutoff.
4. The simulate heuristic's plan is priced too; the fastest priced plan that fits is returned. The
   reported objective is its priced step; the bound is the least of the solved candidates' proven
   bounds (of their cut models) and the unsolved candidates' floor bounds; the gap is against it.
5. The plan, with the best few alternatives and why each lost, is assembled by
   :func:`coplan.planner.assemble.assemble`.
"""

from __future__ import annotations

import difflib
import heapq
import math
import multiprocessing as mp
import os
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field

from coplan.costmodel.context import local_batch_of
from coplan.errors import CoplanError
from coplan.planner.assemble import assemble, heuristic_plan
from coplan.planner.bounds import candidate_bound, memory_floor
from coplan.planner.costs import Pricer
from coplan.planner.explain import explain_infeasible
from coplan.planner.mesh import (MAX_AUTO_MICRO_BATCHES, PINNABLE, MeshCandidate, batch_split_refusal, check_world_size,
                                  enumerate_candidates)
from coplan.planner.pins import table_pin_miss, table_pin_problem
from coplan.planner.precision import choose_layer_precision, precision_line
from coplan.planner.pricing import Assignment, CandidatePricing, evaluate
from coplan.planner.solver import SolveResult, SolverSettings, solve_candidate
from coplan.spec import Calibration, LayerPlan, Plan, SolverReport, TableShard, Topology, Workload
from coplan.spec.plan import Alternative


def available_cores() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


@dataclass(kw_only=True, slots=True)
class PlannerConfig:
    """How the planner searches."""

    world_size: int | None = None
    """GPUs to plan for (the first ones of the topology); None: all of them."""

    time_limit_s: float = 300.0
    """Wall-clock budget of the whole search: every phase (bounding the mesh candidates, pricing them at
    their floor point, the batches of solves, the end refinement) checks it between candidates, and once
    it has passed no new candidate's work starts (it may be overshot by about one candidate's work). At
    least one candidate is solved, so that a plan exists; the plan then says where the search stopped
    (its solver notes). The search is budgeted in deterministic terms (``max_solves``, ``batch_size``,
    ``solve_dtime``) so that a plan does not depend on the machine's speed or load; this guard only
    matters on a machine far slower than planned for, or for a limit set short on purpose."""

    solve_dtime: float = 0.5
    """Deterministic-time limit of one CP-SAT solve (OR-Tools deterministic seconds)."""

    num_workers: int = 0
    """Parallel solves (0: the machine's cores)."""

    seed: int = 0
    """CP-SAT seed: a plan is deterministic for a seed."""

    max_solves: int = 12
    """At most this many candidates are solved (CP-SAT), in batches of ``batch_size``."""

    batch_size: int = 4
    """Candidates solved per batch before the best plan is updated; fixed, whatever the number of
    workers, so the candidates solved (and the plan) are the same on any machine."""

    flat_max_vars: int = 1_500
    """Placement booleans above which a candidate is solved in the decomposed formulation."""

    policy: str | None = None
    """Balancing policy (None: the one of least expected imbalance)."""

    min_cw_dim: int = 32
    """Narrowest column-wise shard."""

    gap_tolerance: float = 0.01
    """Candidates whose bound is within this relative gap of the best plan are not solved: the search
    stops once no unsolved candidate can beat the best plan by more than this (the usual relative-gap
    stop of branch and bound). The reported bound still includes those candidates' bounds, so the
    reported gap stays honest; 0 solves until nothing can improve (or ``max_solves``)."""

    relative_gap: float = 1e-4
    """A CP-SAT solve stops once proven within this relative gap."""

    cut_rounds: int = 6
    """Re-solves of one candidate at most, each after pricing its solution added that solution's
    critical path to the candidate's model (Kelley's cutting planes on the pricer's step)."""

    model_tolerance: float = 0.005
    """A solution whose priced step is within this fraction of the model's step ends the candidate's rounds."""

    alternatives: int = 8
    """Alternatives kept in the plan (other meshes, runner-up sharding and recompute, the heuristic's plan)."""

    baseline: bool = True
    """Also price the simulate heuristic's plan and return it if it is faster (never beaten by it)."""

    refine_time_s: float = 20.0
    """After the solves, wall seconds spent pricing the floor points of unsolved candidates whose quick
    bound is below the plan (each tightens the reported bound); what is left keeps its quick bound."""

    pins: dict[str, int] = field(default_factory=dict)
    """Mesh axes (and ``micro_batches``) the user fixed (``--pin AXIS=N``); the rest is planned."""

    table_pins: dict[str, str] = field(default_factory=dict)
    """Tables whose sharding the user fixed (``--pin-table NAME=SHARDING``; ``column_wise/N`` for N shards)."""

    @property
    def pin_labels(self) -> tuple[str, ...]:
        return tuple(f"{k}={v}" for k, v in self.pins.items()) + tuple(f"table {k}={v}" for k, v in self.table_pins.items())


def check_pins(workload: Workload, cfg: PlannerConfig) -> None:
    """Refuse pins that name no axis or table, or a sharding that does not exist, before any search."""
    for k, v in cfg.pins.items():
        if k not in PINNABLE:
            raise CoplanError(f"--pin {k}={v}: '{k}' is not a mesh axis; pin one of {', '.join(PINNABLE)}")
        if int(v) < 1:
            raise CoplanError(f"--pin {k}={v}: the size must be a positive integer")
    names = {t.name: t for t in workload.all_tables}
    for k, v in cfg.table_pins.items():
        if k not in names:
            near = difflib.get_close_matches(k, list(names), n=1)
            hint = (f"did you mean '{near[0]}'?" if near else
                    f"give one of its {len(names):,} tables ({', '.join(sorted(names)[:5])}{', ...' if len(names) > 5 else ''})")
            raise CoplanError(f"--pin-table {k}={v}: '{k}' is not a table of workload '{workload.name}'; {hint}")
        why = table_pin_problem(k, int(names[k].dim), v, cfg.min_cw_dim)
        if why:
            raise CoplanError(f"--pin-table {k}={v}: {why}")


def _pin_miss(cfg: PlannerConfig, every: list[MeshCandidate], world: int, workload: Workload | None = None) -> str:
    opts = {k: sorted({c.axis(k) for c in every}) for k in cfg.pins}
    bad = [k for k, v in cfg.pins.items() if v not in opts[k]]
    if bad:
        k = bad[0]
        msg = (f"--pin {k}={cfg.pins[k]}: no mesh of {world:,} rank{'s' if world != 1 else ''} has it; give one of the "
               f"possible values of {k}: {', '.join(str(x) for x in opts[k][:24])}")
        fixed = workload.batch.fixed_micro_batches if workload is not None else None
        if k == "micro_batches" and fixed is not None:
            local = local_batch_of(workload, world)
            if local % cfg.pins[k] == 0 and cfg.pins[k] <= MAX_AUTO_MICRO_BATCHES:
                msg += (f"; the workload fixes batch.micro_batches: {fixed}; set it to 'auto' (or {cfg.pins[k]}) to let "
                        "--pin choose")
            else:
                msg += (f"; the workload fixes batch.micro_batches: {fixed}, and this count does not split the local batch "
                        f"of {local:,} (with batch.micro_batches: 'auto', --pin micro_batches takes a divisor of it up to "
                        f"{MAX_AUTO_MICRO_BATCHES})")
        return msg
    return (f"--pin {' '.join(f'{k}={v}' for k, v in cfg.pins.items())}: no mesh of {world:,} ranks has all of these at once "
            "(dp_shard x dp_replicate and sparse_shard x sparse_replicate must each equal the world; ep must divide dp_shard "
            "and every MoE block's expert count)")


@dataclass(frozen=True, slots=True)
class PricedSolve:
    """One candidate solved on its cut model, its solutions priced with the full pricer."""

    assignment: Assignment | None
    """The best solution by priced step that fits (priced memory within the usable HBM)."""
    step_time_s: float
    """Its priced step (inf when none)."""
    peak_bytes: float
    """Its priced memory of the fullest rank."""
    model_step_s: float
    """The model's step of it (the largest cut, its own included)."""
    solver_objective_s: float
    """CP-SAT's objective of the last solve (the model before that solution's cut was added)."""
    bound_s: float
    """The last solve's proven bound on the candidate's model."""
    status: str
    rounds: int
    """Solves after the first."""
    method: str
    pricing: CandidatePricing
    """The candidate with every cut the rounds added."""
    runner_up: tuple[Assignment, float] | None = None
    """Another solution priced on the way (a different sharding or recompute), with its priced step."""


def solve_priced(pricer: Pricer, p: CandidatePricing, settings: SolverSettings, *, cutoff_s: float | None = None,
                 rounds: int = 6, tol: float = 0.005) -> PricedSolve:
    """Kelley's cutting planes on one candidate: solve the cut model, price the solution, add its
    critical path, and again, until the priced step is within ``tol`` of the model (or ``rounds``)."""
    p = pricer.probe_cuts(p)
    seen: list[tuple[float, Assignment, float]] = []
    best: tuple[float, Assignment, float, float] | None = None  # (priced, assignment, peak, model)
    hint = None
    res: SolveResult | None = None
    last_obj = math.inf
    n = 0
    for n in range(rounds + 1):
        res = solve_candidate(p, settings, hint=hint, cutoff_s=cutoff_s)
        if res.assignment is None:
            break
        a = res.assignment
        last_obj = res.step_time_s
        cost = pricer.price(p, a)
        q = p
        for c in cost.cuts:
            q = q.with_cut(c)
        priced = float(cost.step_time_s)
        fits = cost.fits
        seen.append((priced, a, float(cost.memory.total)))
        if fits and (best is None or priced < best[0]):
            best = (priced, a, float(cost.memory.total), evaluate(q, a).step_time_s)
        converged = priced <= res.step_time_s * (1 + tol) and fits
        p = q
        hint = best[1] if best is not None else None
        if converged or q is p and not fits:
            break
    if best is None:
        bound = res.bound_s if res is not None else math.inf
        status = res.status if res is not None else "UNKNOWN"
        return PricedSolve(None, math.inf, math.inf, math.inf, last_obj, bound, status if status == "INFEASIBLE" else "UNKNOWN", n,
                           res.method if res else "", p)
    priced, a, peak, _ = best
    model = evaluate(p, a).step_time_s
    others = sorted((s, x) for s, x, _ in seen if x != a)
    runner = (others[0][1], others[0][0]) if others else None
    return PricedSolve(a, priced, peak, model, last_obj, min(res.bound_s, priced), res.status, n, res.method, p, runner)


_STATE: dict = {}

_now = time.perf_counter
"""The search's clock (a test may replace it)."""


@dataclass(slots=True)
class _Deadline:
    """The search's wall-clock budget (``time_limit_s`` after it started), and whether some phase stopped at it."""

    at: float
    hit: bool = False
    reordered: bool = False

    def passed(self) -> bool:
        if _now() > self.at:
            self.hit = True
            return True
        return False

    def left(self) -> float:
        return self.at - _now()

OnWork = Callable[[str, int, int], None]
"""Told of each step of the search's work: (what, steps done, steps in all)."""
"""The search's pricer, set before the worker pool forks (workers inherit it; each job carries its candidate)."""


def _solve_job(args) -> PricedSolve:
    p, settings, cutoff, rounds, tol = args
    return solve_priced(_STATE["pricer"], p, settings, cutoff_s=cutoff, rounds=rounds, tol=tol)


@dataclass(slots=True)
class CandidateRecord:
    """What the search knows about one candidate (for reports and explanations)."""

    mesh: MeshCandidate
    lower_bound_s: float
    memory_floor_bytes: float
    feasible: bool
    status: str = "PRUNED"
    step_time_s: float = math.inf
    """Priced step of its best solution."""
    bound_s: float = math.inf
    method: str = ""
    peak_bytes: float = 0.0
    solve: PricedSolve | None = None


@dataclass(slots=True)
class SearchResult:
    """The search's outcome, with the chosen candidate's pricing and solution."""

    pricing: CandidatePricing | None
    assignment: Assignment | None
    solve: PricedSolve | None
    records: list[CandidateRecord]
    bound_s: float
    wall_s: float
    num_workers: int
    pricer: Pricer
    heuristic: Plan | None = None
    """The simulate heuristic's plan, priced."""
    chosen: str = "cpsat"
    """'cpsat' or 'heuristic'."""
    candidates_total: int = 0
    """Mesh candidates enumerated (pins applied); more than ``len(records)`` when bounding stopped at the time limit."""
    stopped: str | None = None
    """Where the search stopped at the time limit (None: it did not)."""


def _refine(pricer: Pricer, pricings: dict, r: CandidateRecord) -> None:
    """Price the candidate's floor point: its cuts (kept in its pricing) and its tighter bound."""
    p = pricings[r.mesh]
    fc = pricer.floor_cost(p)
    for cut in fc.cuts:
        p = p.with_cut(cut)
    pricings[r.mesh] = p
    b = candidate_bound(pricer, p, fc)
    r.lower_bound_s = max(r.lower_bound_s, b.lower_bound_s)
    r.feasible = r.feasible and math.isfinite(r.lower_bound_s)


def _least_bound(records: list[CandidateRecord], best: float) -> float:
    solved = [r.bound_s for r in records if r.feasible and r.status != "PRUNED"]
    pruned = [r.lower_bound_s for r in records if r.feasible and r.status == "PRUNED" and r.lower_bound_s < best]
    return min(solved + pruned + [best])


def search(workload: Workload, topology: Topology, calibration: Calibration | None = None, config: PlannerConfig | None = None,
           *, progress=None, on_work: OnWork | None = None) -> SearchResult:
    """Run the search (see the module docstring). Raises InfeasibleError when no candidate fits.
    ``progress(message)`` gets a line per batch of solves; ``on_work(what, done, total)`` is told of each
    step of the work in between (a candidate priced at its floor point, a solve finished)."""
    cfg = config or PlannerConfig()
    t0 = _now()
    deadline = _Deadline(t0 + cfg.time_limit_s)
    world = check_world_size(topology, cfg.world_size)
    check_pins(workload, cfg)
    if not workload.batch.splits(world):  # a batch that does not split is refused before anything else
        raise batch_split_refusal(workload, topology, world)
    local_batch_of(workload, world)  # (and one over the local batch's limit)
    workers = min(cfg.num_workers or available_cores(), max(1, cfg.batch_size))
    pricer = Pricer(workload, topology, world, calibration, min_cw_dim=cfg.min_cw_dim, policy=cfg.policy,
                    table_pins=dict(cfg.table_pins))
    every = list(enumerate_candidates(topology, workload, world))
    cands = [c for c in every if all(c.axis(k) == v for k, v in cfg.pins.items())]
    if not cands:
        raise CoplanError(_pin_miss(cfg, every, world, workload))
    records, pricings = bound_candidates(pricer, cands, cfg, on_work, deadline=deadline)
    if progress:
        progress(f"bounded {len(records)} mesh candidates in {_now() - t0:.1f} s")
    if not any(r.feasible for r in records):
        for r in sorted(records, key=lambda r: (r.memory_floor_bytes, r.mesh.key))[:1]:
            _refine(pricer, pricings, r)
        raise explain_infeasible(workload, topology, world, pricer, records, pricings, cfg=cfg, deadline=t0 + cfg.time_limit_s)
    queue = _Queue.of(records)
    best = _branch_and_bound(pricer, records, pricings, queue, cfg, workers, t0, progress, on_work, deadline=deadline)
    if best is not None:
        _refine_unsolved(pricer, pricings, records, queue, best[0], cfg, deadline=deadline)
    heur = _baseline(workload, topology, world, calibration, cfg) if cfg.baseline else None
    if best is None and heur is None:
        raise explain_infeasible(workload, topology, world, pricer, records, pricings, solved=True, cfg=cfg,
                                 deadline=t0 + cfg.time_limit_s)
    wall = _now() - t0
    stopped = _stopped_note(cfg, records, len(cands)) if deadline.hit else None
    if best is None or (heur is not None and heur.predicted.step_time_s < best[0]):
        step = heur.predicted.step_time_s
        bound = _least_bound(records, step)
        return SearchResult(None, None, None, records, bound, wall, workers, pricer, heur, "heuristic", len(cands), stopped)
    step, rec, res = best
    return SearchResult(pricings[rec.mesh], res.assignment, res, records, _least_bound(records, step), wall, workers, pricer, heur,
                        candidates_total=len(cands), stopped=stopped)


def _stopped_note(cfg: PlannerConfig, records: list[CandidateRecord], total: int) -> str:
    solved = sum(1 for r in records if r.status != "PRUNED")
    bounded = f"; bounded {len(records)} of them" if len(records) < total else ""
    return (f"stopped at the time limit ({cfg.time_limit_s:g} s) after {solved} of {total:,} mesh candidates solved{bounded}: "
            "the plan is the best found by then (a longer --time-limit may find a faster one)")


def bound_candidates(pricer: Pricer, cands: list[MeshCandidate], cfg: PlannerConfig, on_work: OnWork | None = None, *,
                     deadline: _Deadline | None = None) -> tuple[list[CandidateRecord], dict[MeshCandidate, CandidatePricing]]:
    """Every candidate with its quick bound and memory floor (a candidate where a pinned table has no
    option is left out; when that leaves none, the pin is refused). Past ``deadline``, no further
    candidate is bounded once one that may fit has been."""
    records: list[CandidateRecord] = []
    pricings: dict[MeshCandidate, CandidatePricing] = {}
    unpinnable: set[str] | None = None  # pinned tables no candidate so far had an option for
    todo = list(cands)
    k = -1
    while todo:
        k += 1
        if deadline is not None and deadline.passed():
            if any(r.feasible for r in records):
                break
            if k > 0 and not deadline.reordered:  # past it with none that may fit yet: the memory-friendliest next
                todo.sort(key=lambda c: (-c.dense_shard, -c.sparse_shard, -c.micro_batches, -c.expert_parallel, c.key))
                deadline.reordered = True
        c = todo.pop(0)
        if on_work and k % 16 == 0:
            on_work(f"bounding {len(cands)} mesh candidates", k, len(cands))
        p = pricer.candidate(c, with_cut=False)
        empty = [p.table_names[t] for t, o in enumerate(p.options) if not o]
        if empty:
            unpinnable = set(empty) if unpinnable is None else unpinnable & set(empty)
            continue
        mem_floor = memory_floor(pricer, p)
        feasible = mem_floor <= p.capacity_bytes
        records.append(CandidateRecord(c, pricer.quick_bound(p), mem_floor, feasible))
        pricings[c] = p
    if not records:
        n = next((t for t in cfg.table_pins if t in (unpinnable or ())), None)
        if n is not None:
            raise CoplanError(table_pin_miss(pricer, cands, n, cfg.table_pins[n]))
        pins = " ".join(f"{t}={v}" for t, v in cfg.table_pins.items())
        raise CoplanError(f"--pin-table {pins}: each pin holds on some mesh candidate, but no candidate takes them all at "
                          "once (their sparse groups differ); drop one of the pins")
    return records, pricings


@dataclass(slots=True)
class _Queue:
    """The feasible candidates not yet solved, least bound first (a heap of (bound, mesh key, index of
    the record)), and the records already priced at their floor point."""

    heap: list[tuple[float, str, int]]
    refined: set[int] = field(default_factory=set)

    @classmethod
    def of(cls, records: list[CandidateRecord]) -> _Queue:
        heap = [(r.lower_bound_s, r.mesh.key, i) for i, r in enumerate(records) if r.feasible]
        heapq.heapify(heap)
        return cls(heap)


Best = tuple[float, CandidateRecord, PricedSolve]
"""The best priced plan so far: (priced step, its candidate, its solve)."""


def _branch_and_bound(pricer: Pricer, records: list[CandidateRecord], pricings: dict, queue: _Queue, cfg: PlannerConfig,
                      workers: int, t0: float, progress, on_work: OnWork | None = None, *,
                      deadline: _Deadline | None = None) -> Best | None:
    """Branch and bound over candidates, lazily bounded: every candidate starts with its quick bound;
    the one of least bound is priced at its floor point (a tighter bound, and its first cuts) and put
    back; once the least-bound candidate is already refined, a batch of such candidates is solved."""
    settings = SolverSettings(time_limit_s=cfg.solve_dtime, num_workers=1, seed=cfg.seed, flat_max_vars=cfg.flat_max_vars,
                              relative_gap=cfg.relative_gap)
    best: Best | None = None
    solved = 0
    _STATE["pricer"] = pricer
    ctx = mp.get_context("fork") if "fork" in mp.get_all_start_methods() else None
    pool = ProcessPoolExecutor(max_workers=workers, mp_context=ctx) if workers > 1 and ctx is not None else None
    try:
        while queue.heap and solved < cfg.max_solves:
            if best is not None and queue.heap[0][0] >= best[0] * (1 - cfg.gap_tolerance):
                break
            if best is not None and deadline is not None and deadline.passed():
                break
            batch = _next_batch(pricer, pricings, records, queue, best, cfg, solved, on_work, deadline=deadline)
            if not batch:
                if best is not None and deadline is not None and deadline.hit:
                    break
                continue
            # Once a plan is known, a candidate only matters if it can beat it by more than the gap
            # tolerance: the solver is told so (an objective cutoff on its model, which under-estimates
            # the priced step), cheaper to refute than to solve. Fixed before the batch runs: deterministic.
            cutoff = best[0] * (1 - cfg.gap_tolerance) if best is not None and cfg.gap_tolerance > 0 else None
            jobs = [(pricings[r.mesh], settings, cutoff, cfg.cut_rounds, cfg.model_tolerance) for r in batch]
            results = _solve_batch(pool, jobs, solved, on_work, deadline=deadline, best=best)
            batch = [r for r, res in zip(batch, results) if res is not None]
            best = _record_solves(batch, [res for res in results if res is not None], pricings, best)
            solved += len(batch)
            if progress:
                el = _now() - t0
                progress(f"[{el:5.1f} s] solved {solved} candidates; best {best[0] * 1e3:.1f} ms (priced)" if best
                         else f"[{el:5.1f} s] solved {solved} candidates; none feasible yet")
    finally:
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
        _STATE.clear()
    return best


def _solve_batch(pool: ProcessPoolExecutor | None, jobs: list, solved: int, on_work: OnWork | None, *,
                 deadline: _Deadline | None = None, best: Best | None = None) -> list[PricedSolve | None]:
    """The solves of a batch, in the batch's order (in parallel when there is a pool). Once ``deadline``
    has passed and some solve (or ``best``) gave a plan, the solves not yet started are not run (None)."""
    if on_work:
        on_work(f"CP-SAT: solving {len(jobs)} candidates", 0, len(jobs))
    results: list[PricedSolve | None] = []
    have_plan = best is not None

    def stop() -> bool:
        return have_plan and deadline is not None and deadline.passed()

    if pool is not None and len(jobs) > 1:
        futures = [pool.submit(_solve_job, j) for j in jobs]
        for f in futures:
            if stop():
                for g in futures:
                    g.cancel()  # those not yet running; running ones finish and are kept
            res = None if f.cancelled() else f.result()
            results.append(res)
            have_plan = have_plan or (res is not None and res.assignment is not None)
            if on_work and res is not None:
                on_work(f"CP-SAT: {solved + len(results)} candidates solved", len(results), len(jobs))
        return results
    for j in jobs:
        if stop():
            results.append(None)
            continue
        res = _solve_job(j)
        results.append(res)
        have_plan = have_plan or res.assignment is not None
        if on_work:
            on_work(f"CP-SAT: {solved + len(results)} candidates solved", len(results), len(jobs))
    return results


def _next_batch(pricer: Pricer, pricings: dict, records: list[CandidateRecord], queue: _Queue, best: Best | None,
                cfg: PlannerConfig, solved: int, on_work: OnWork | None = None, *,
                deadline: _Deadline | None = None) -> list[CandidateRecord]:
    """The next candidates to solve: off the queue, least bound first, each refined (priced at its
    floor point and put back) the first time it comes up; none whose bound cannot beat ``best``. Past
    ``deadline``, none once a plan is known, else just the first candidate ready to solve."""
    heap, refined = queue.heap, queue.refined
    batch: list[CandidateRecord] = []
    while heap and len(batch) < cfg.batch_size and solved + len(batch) < cfg.max_solves:
        if deadline is not None and (best is not None or batch) and deadline.passed():
            break
        lb, _, i = heap[0]
        if best is not None and lb >= best[0] * (1 - cfg.gap_tolerance):
            break
        heapq.heappop(heap)
        r = records[i]
        if i not in refined:
            refined.add(i)
            if on_work:
                on_work(f"pricing {r.mesh.key} at its floor", len(batch), cfg.batch_size)
            _refine(pricer, pricings, r)
            if r.feasible:
                heapq.heappush(heap, (r.lower_bound_s, r.mesh.key, i))
            continue
        batch.append(r)
    return batch


def _record_solves(batch: list[CandidateRecord], results: list[PricedSolve], pricings: dict, best: Best | None) -> Best | None:
    """Write each solve into its candidate's record and pricing; the best priced plan, updated."""
    for r, res in zip(batch, results):
        # both are proven: the solve's bound of its cut model, and the floor bound from before it
        r.status, r.step_time_s, r.bound_s, r.method, r.peak_bytes, r.solve = (
            res.status, res.step_time_s, max(res.bound_s, r.lower_bound_s), res.method, res.peak_bytes, res)
        pricings[r.mesh] = res.pricing
        if res.assignment is not None and (best is None or res.step_time_s < best[0]):
            best = (res.step_time_s, r, res)
    return best


def _refine_unsolved(pricer: Pricer, pricings: dict, records: list[CandidateRecord], queue: _Queue, best_step: float,
                     cfg: PlannerConfig, *, deadline: _Deadline | None = None) -> None:
    """The budget of solves is spent: price the floor points of the candidates whose quick bound could
    still beat the plan (far cheaper than solving them), so that the reported bound is theirs. For at
    most ``refine_time_s`` wall seconds, and none past ``deadline``."""
    heap, refined = queue.heap, queue.refined
    t_ref = _now()
    while heap and heap[0][0] < best_step * (1 - cfg.gap_tolerance) and _now() - t_ref < cfg.refine_time_s:
        if deadline is not None and deadline.passed():
            break
        lb, _, i = heapq.heappop(heap)
        if i in refined:
            continue
        refined.add(i)
        _refine(pricer, pricings, records[i])


def _baseline(workload, topology, world, calibration, cfg) -> Plan | None:
    """The simulate heuristic's plan when it fits, keeps the user's pins and micro-batches (else None)."""
    if cfg.pins or cfg.table_pins:
        return None  # the heuristic knows no pins: it is not a plan the user asked for
    try:
        plan = heuristic_plan(workload, topology, world, calibration)
    except CoplanError:
        return None
    pred = plan.predicted
    if pred is None or pred.peak_memory_bytes > pred.hbm_capacity_bytes - pred.hbm_reserve_bytes:
        return None
    return plan


# ---------------------------------------------------------------------------------------------
# From a solution to a Plan
# ---------------------------------------------------------------------------------------------


def table_shards(p: CandidatePricing, a: Assignment) -> tuple[TableShard, ...]:
    out = []
    for name, opts, oi, rr in zip(p.table_names, p.options, a.choice, a.ranks):
        o = opts[oi]
        if o.sharding_type == "data_parallel":
            out.append(TableShard(table=name, sharding_type="data_parallel", ranks=(), compute_kernel="dense"))
        elif o.sharding_type == "row_wise":
            out.append(TableShard(table=name, sharding_type="row_wise", ranks=tuple(range(p.group_size))))
        else:
            out.append(TableShard(table=name, sharding_type=o.sharding_type, ranks=tuple(rr)))  # type: ignore[arg-type]
    return tuple(out)


def layer_plans(p: CandidatePricing, a: Assignment) -> tuple[LayerPlan, ...]:
    return tuple(LayerPlan(name=l.name, recompute=bool(on)) for l, on in zip(p.layers, a.recompute))


def _why(step: float, best_step: float, peak: float, cap: float) -> str:
    if peak > cap:
        return f"does not fit: its fullest rank needs {peak / 2**30:,.2f} GiB, {(peak - cap) / 2**30:,.2f} GiB over the usable HBM"
    d = step - best_step
    return f"slower by {d * 1e3:,.3f} ms ({d / best_step:+.1%})" if d > 0 else "as fast (kept the first found)"


def alternatives(result: SearchResult, cfg: PlannerConfig, best_step: float, chosen_key: str) -> tuple[Alternative, ...]:
    """The best few plans the search priced and did not return, best first, and why each lost."""
    pricer = result.pricer
    cap = pricer.topology.gpu.usable_hbm_bytes
    out: list[Alternative] = []
    for r in sorted((r for r in result.records if r.solve is not None and r.solve.assignment is not None and r.mesh.key != chosen_key),
                    key=lambda r: (r.step_time_s, r.mesh.key))[: max(0, cfg.alternatives - 3)]:
        out.append(Alternative(kind="micro_batches" if _only_micro(r.mesh, chosen_key, result) else "mesh", mesh=r.mesh.key,
                               description=_describe(r.mesh), step_time_s=r.step_time_s, bound_s=max(0.0, r.bound_s),
                               peak_memory_bytes=r.peak_bytes, why=_why(r.step_time_s, best_step, r.peak_bytes, cap)))
    if result.solve is not None and result.solve.runner_up is not None and result.pricing is not None:
        a, step = result.solve.runner_up
        p = result.pricing
        ch = result.assignment
        kinds = []
        if a.choice != ch.choice or a.ranks != ch.ranks:
            n = sum(1 for x, y in zip(a.choice, ch.choice) if x != y)
            kinds.append(f"{n} tables sharded differently" if n else "the same options placed on other ranks")
        if a.recompute != ch.recompute:
            rc = sum(a.recompute)
            kinds.append(f"recompute {rc} layers instead of {sum(ch.recompute)}")
        out.append(Alternative(kind="recompute" if a.recompute != ch.recompute and a.choice == ch.choice else "sharding", mesh=p.mesh.key,
                               description="; ".join(kinds) or "another solution of the same mesh", step_time_s=step,
                               peak_memory_bytes=evaluate(p, a).peak_bytes, why=_why(step, best_step, evaluate(p, a).peak_bytes, cap)))
    if result.heuristic is not None and result.chosen != "heuristic":
        h = result.heuristic
        out.append(Alternative(kind="heuristic", mesh=_mesh_key(h), description="the simulate heuristic's plan",
                               step_time_s=h.predicted.step_time_s, peak_memory_bytes=h.predicted.peak_memory_bytes,
                               why=_why(h.predicted.step_time_s, best_step, h.predicted.peak_memory_bytes, cap)))
    pruned = sorted((r for r in result.records if r.feasible and r.status == "PRUNED"), key=lambda r: r.lower_bound_s)[:2]
    for r in pruned:
        out.append(Alternative(kind="mesh", mesh=r.mesh.key, description=_describe(r.mesh) + " (not solved)", step_time_s=None,
                               bound_s=r.lower_bound_s,
                               why=f"cannot beat it by more than the gap tolerance: at least {r.lower_bound_s * 1e3:,.3f} ms"))
    infeasible = sorted((r for r in result.records if not r.feasible), key=lambda r: r.memory_floor_bytes)[:1]
    for r in infeasible:
        out.append(Alternative(kind="infeasible", mesh=r.mesh.key, description=_describe(r.mesh), step_time_s=None,
                               peak_memory_bytes=r.memory_floor_bytes,
                               why=f"does not fit: needs at least {r.memory_floor_bytes / 2**30:,.2f} GiB per rank even with every layer "
                                   f"recomputed, {(r.memory_floor_bytes - cap) / 2**30:,.2f} GiB over the usable HBM"))
    out.sort(key=lambda x: (x.step_time_s is None, x.step_time_s or 0.0, x.bound_s))
    return tuple(out[: cfg.alternatives])


def _only_micro(m: MeshCandidate, key: str, result: SearchResult) -> bool:
    c = result.pricing.mesh if result.pricing is not None else None
    return c is not None and (m.dense_shard, m.expert_parallel, m.sparse_shard) == (c.dense_shard, c.expert_parallel, c.sparse_shard)


def _describe(m: MeshCandidate) -> str:
    mb = f", {m.micro_batches} micro-batches" if m.micro_batches > 1 else ""
    return (f"FSDP {m.dense_shard} x {m.dense_replicate}, EP {m.expert_parallel}, tables over {m.sparse_shard} x "
            f"{m.sparse_replicate}{mb}")


def _mesh_key(plan: Plan) -> str:
    m = plan.mesh
    c = MeshCandidate(plan.world_size, m.dense_shard, m.expert_parallel, m.sparse_shard, plan.micro_batches)
    return c.key


def build_plan(workload: Workload, topology: Topology, calibration: Calibration | None, result: SearchResult, cfg: PlannerConfig) -> Plan:
    pr = result.pricer
    counts = dict(candidates_total=len(result.records) if result.stopped is None else max(len(result.records), result.candidates_total),
                  candidates_solved=sum(1 for r in result.records if r.status != "PRUNED"),
                  wall_s=result.wall_s, num_workers=result.num_workers, seed=cfg.seed, pins=cfg.pin_labels,
                  notes=(result.stopped,) if result.stopped else ())
    if result.chosen == "heuristic":
        h = result.heuristic
        step = h.predicted.step_time_s
        bound = min(result.bound_s, step)
        report = SolverReport(status="HEURISTIC", objective_us=step * 1e6, best_bound_us=max(0.0, bound * 1e6),
                              gap=max(0.0, (step - bound) / step) if step > 0 else 0.0, model_objective_us=step * 1e6, **counts)
        alts = alternatives(result, cfg, step, _mesh_key(h))
        return h.model_copy(update={"solver": report, "alternatives": alts})
    p, a, res = result.pricing, result.assignment, result.solve
    mesh = pr.mesh_plan(p.mesh)
    tables = table_shards(p, a)
    layers = layer_plans(p, a)
    ctx = pr.context(p.mesh)
    layers, precision_report = choose_layer_precision(ctx, layers, tables=tables if tables else None, balancing=pr.balancing,
                                                      kernels=workload.kernels)
    notes = ()
    if precision_report is not None:
        notes = (precision_line(precision_report, workload),)
    step = res.step_time_s
    plan = assemble(workload, topology, mesh=mesh, tables=tables, layers=layers, balancing=pr.balancing, calibration=calibration,
                    precision_report=precision_report, notes=notes)
    final = plan.predicted.step_time_s
    # the precision post-pass can only move the step by what fp8 saves; the bound scales with it
    scale = final / step if step > 0 else 1.0
    bound = min(result.bound_s * min(1.0, scale), final)
    proven = res.status == "OPTIMAL" and bound >= final * (1 - 1e-9) - 1e-9
    report = SolverReport(
        status="OPTIMAL" if proven else "FEASIBLE", objective_us=final * 1e6, best_bound_us=max(0.0, bound * 1e6),
        gap=max(0.0, (final - bound) / final) if final > 0 else 0.0, model_objective_us=res.solver_objective_s * 1e6,
        cut_rounds=res.rounds, **counts,
    )
    return plan.model_copy(update={"solver": report, "alternatives": alternatives(result, cfg, final, p.mesh.key)})


def make_plan(workload: Workload, topology: Topology, calibration: Calibration | None = None, config: PlannerConfig | None = None,
              *, progress=None, on_work: OnWork | None = None) -> tuple[Plan, SearchResult]:
    """Plan ``workload`` on ``topology``: the Plan and the search that produced it (``progress``,
    ``on_work``: see :func:`search`)."""
    cfg = config or PlannerConfig()
    result = search(workload, topology, calibration, cfg, progress=progress, on_work=on_work)
    return build_plan(workload, topology, calibration, result, cfg), result
