"""The search over mesh candidates: price, bound, prune, solve, choose, and assemble the Plan.

1. Enumerate every (dense shard, expert-parallel, sparse shard) factorisation of the world
   (:mod:`coplan.planner.mesh`).
2. Price each with the cost model (:mod:`coplan.planner.costs`; dense figures are shared by
   candidates with the same dense degrees, sparse figures by those with the same shard group) and
   bound it from below without solving: the base step, the average rank's least lookups and
   all-to-all floor, and the least recompute time that frees the memory the candidate needs
   (exact, from the recompute frontier of :mod:`coplan.planner.recompute`). Candidates whose memory cannot fit even with every
   layer recomputed and tables spread as thinly as possible are infeasible; they feed the
   explanation when nothing fits.
3. Branch and bound over candidates in order of their bound: solve them with CP-SAT
   (:mod:`coplan.planner.solver`) in deterministic batches of ``num_workers`` (one single-threaded,
   deterministic solve per process; the batch is fixed before it runs, so the result does not depend
   on which finishes first), and stop when the next bound cannot beat the best plan by more than
   ``gap_tolerance`` (1%), or when the budget is spent. Once a plan is known, each later candidate is
   solved with an objective cutoff (that plan less the tolerance), which CP-SAT refutes far faster
   than it solves the candidate; a refuted candidate's bound is the cutoff. The reported bound is the least of the solved candidates' proven bounds
   and the unsolved candidates' bounds; the gap is against it.
4. Price the chosen plan with the cost model's full pricer (overlap schedule included) for the
   prediction, and write everything into a :class:`~coplan.spec.Plan`.
"""

from __future__ import annotations

import math
import os
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timezone
import multiprocessing as mp

from coplan import __version__
from coplan.errors import CoplanError
from coplan.planner.costs import Pricer
from coplan.planner.mesh import MeshCandidate, check_world_size, enumerate_candidates
from coplan.planner.pricing import Assignment, CandidatePricing
from coplan.planner.recompute import frontier
from coplan.planner.solver import SolveResult, SolverSettings, solve_candidate
from coplan.spec import Calibration, LayerPlan, Plan, SolverReport, TableShard, Topology, Workload, spec_sha256


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
    """Wall-clock guard of the search (no new batch starts after it). The search is budgeted in
    deterministic terms (``max_solves``, ``batch_size``, ``solve_dtime``) so that a plan does not depend
    on the machine's speed or load; this guard only matters on a machine far slower than planned for,
    and then the plan says how many candidates it solved."""

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

    flat_max_vars: int = 20_000
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

    pins: dict[str, int] = field(default_factory=dict)
    """Mesh axes (and ``micro_batches``) the user fixed (``--pin AXIS=N``); the rest is planned."""

    table_pins: dict[str, str] = field(default_factory=dict)
    """Tables whose sharding the user fixed (``--pin-table NAME=SHARDING``; ``column_wise/N`` for N shards)."""

    @property
    def pin_labels(self) -> tuple[str, ...]:
        return tuple(f"{k}={v}" for k, v in self.pins.items()) + tuple(f"table {k}={v}" for k, v in self.table_pins.items())


def check_pins(workload: Workload, cfg: PlannerConfig) -> None:
    """Refuse pins that name no axis or table, or a sharding that does not exist, before any search."""
    from coplan.planner.mesh import PINNABLE
    from coplan.spec.plan import SHARDING_TYPES

    for k, v in cfg.pins.items():
        if k not in PINNABLE:
            raise CoplanError(f"--pin {k}={v}: '{k}' is not a mesh axis; pin one of {', '.join(PINNABLE)}")
        if int(v) < 1:
            raise CoplanError(f"--pin {k}={v}: the size must be a positive integer")
    names = {t.name: t for t in workload.all_tables}
    for k, v in cfg.table_pins.items():
        if k not in names:
            near = sorted(names)[:5]
            raise CoplanError(f"--pin-table {k}={v}: '{k}' is not a table of workload '{workload.name}' (tables: {near}...)")
        kind, _, n = v.partition("/")
        if kind not in SHARDING_TYPES or (n and (kind != "column_wise" or not n.isdigit() or int(n) < 1)):
            raise CoplanError(f"--pin-table {k}={v}: the sharding must be one of {', '.join(SHARDING_TYPES)} "
                              "(or column_wise/N for N column shards)")


@dataclass(slots=True)
class CandidateRecord:
    """What the search knows about one candidate (for reports and explanations)."""

    mesh: MeshCandidate
    lower_bound_s: float
    memory_floor_bytes: float
    feasible: bool
    status: str = "PRUNED"
    step_time_s: float = math.inf
    bound_s: float = math.inf
    method: str = ""


@dataclass(slots=True)
class SearchResult:
    """The search's outcome, with the chosen candidate's pricing and solution."""

    pricing: CandidatePricing
    assignment: Assignment
    solve: SolveResult
    records: list[CandidateRecord]
    bound_s: float
    wall_s: float
    num_workers: int
    pricer: Pricer


def _pin_miss(cfg: PlannerConfig, every: list[MeshCandidate], world: int) -> str:
    opts = {k: sorted({c.axis(k) for c in every}) for k in cfg.pins}
    bad = [k for k, v in cfg.pins.items() if v not in opts[k]]
    if bad:
        k = bad[0]
        return (f"--pin {k}={cfg.pins[k]}: no mesh of {world:,} ranks has {k} = {cfg.pins[k]}; possible values: "
                f"{', '.join(str(x) for x in opts[k][:24])}")
    return (f"--pin {' '.join(f'{k}={v}' for k, v in cfg.pins.items())}: no mesh of {world:,} ranks has all of these at once "
            "(dp_shard x dp_replicate and sparse_shard x sparse_replicate must each equal the world; ep must divide dp_shard "
            "and every MoE block's expert count)")


def recompute_floor(p: CandidatePricing, need_bytes: float) -> float:
    """Least recompute time that frees ``need_bytes`` net of the recompute peak: exact, from the
    recompute frontier (:mod:`coplan.planner.recompute`); when the frontier is too large to build,
    for each possible peak (the largest activation among recomputed layers) a fractional knapsack
    over the layers no bigger than it. A valid lower bound either way; inf when even recomputing
    everything cannot free enough."""
    if need_bytes <= 0:
        return 0.0
    front = frontier(p.layers)
    if front is not None:
        return front.least_time(need_bytes)
    layers = [l for l in p.layers if l.saved_bytes > 0]
    best = math.inf
    for peak in sorted({l.peak_bytes for l in layers}):
        need = need_bytes + peak
        t = 0.0
        for l in sorted((l for l in layers if l.peak_bytes <= peak), key=lambda l: l.recompute_s / l.saved_bytes):
            take = min(1.0, need / l.saved_bytes)
            t += take * l.recompute_s
            need -= take * l.saved_bytes
            if need <= 0:
                break
        if need <= 0:
            best = min(best, t)
    return best


@dataclass(frozen=True, slots=True)
class _SparseFloor:
    time_s: float
    """Least the tables add to the step (lookups, all-to-all, all-reduce), per-table minima of joint terms."""
    mem_bytes: float
    recv_mem_bytes: float


def _sparse_floor(p: CandidatePricing) -> _SparseFloor:
    """Valid lower bounds of what the tables add. The slowest rank's lookups are at least the average
    rank's; the all-to-all moves at least the receive volume and at least the average rank's sends; so
    the sum of lookups, all-to-all and all-reduce is at least each table's least joint contribution."""
    s = p.group_size
    wa, rf, wdp = p.a2a_s_per_byte, p.recv_factor, p.dp_s_per_byte
    via_recv = via_send = item = mem = recv_mem = 0.0
    for opts in p.options:
        share = [(1.0 if o.placement == "all" else o.num_shards / s) for o in opts]
        via_recv += min((o.fwd_s + o.bwd_s) * k + wa * rf * o.recv_bytes + wdp * o.allreduce_bytes for o, k in zip(opts, share))
        via_send += min((o.fwd_s + o.bwd_s) * k + wa * o.send_bytes * k + wdp * o.allreduce_bytes for o, k in zip(opts, share))
        item = max(item, min(0.0 if o.placement == "all" else o.fwd_s + o.bwd_s + wa * o.send_bytes for o in opts))
        mem += min(o.mem_bytes * k for o, k in zip(opts, share))
        recv_mem += min(o.recv_bytes for o in opts)
    return _SparseFloor(max(via_recv, via_send, item), mem, p.recv_mem_factor * recv_mem)


def bounds(p: CandidatePricing, floor: _SparseFloor) -> tuple[float, float]:
    """(step-time lower bound, memory floor) of a candidate."""
    mem_no_rc = p.base_bytes + floor.mem_bytes + floor.recv_mem_bytes
    # the most recompute can free: all layers up to some peak size, minus that peak
    most = max([0.0] + [sum(l.saved_bytes for l in p.layers if l.peak_bytes <= pk) - pk for pk in {l.peak_bytes for l in p.layers}])
    mem_floor = mem_no_rc - most
    rc = recompute_floor(p, mem_no_rc - p.capacity_bytes)
    return p.base_time_s + floor.time_s + rc, mem_floor


def _solve_job(args) -> SolveResult:
    p, settings, cutoff = args
    return solve_candidate(p, settings, cutoff_s=cutoff)


def search(workload: Workload, topology: Topology, calibration: Calibration | None = None, config: PlannerConfig | None = None,
           *, progress=None) -> SearchResult:
    """Run the search (see the module docstring). Raises InfeasibleError when no candidate fits."""
    from coplan.planner.explain import explain_infeasible

    cfg = config or PlannerConfig()
    t0 = time.perf_counter()
    world = check_world_size(topology, cfg.world_size)
    workers = min(cfg.num_workers or available_cores(), max(1, cfg.batch_size))
    check_pins(workload, cfg)
    pricer = Pricer(workload, topology, world, calibration, min_cw_dim=cfg.min_cw_dim, policy=cfg.policy,
                    table_pins=dict(cfg.table_pins))
    every = list(enumerate_candidates(topology, workload, world))
    cands = [c for c in every if all(c.axis(k) == v for k, v in cfg.pins.items())]
    if not cands:
        raise CoplanError(_pin_miss(cfg, every, world))
    floors: dict[int, _SparseFloor] = {}
    records: list[CandidateRecord] = []
    pricings: dict[MeshCandidate, CandidatePricing] = {}
    unpinnable: dict[str, list[int]] = {}
    for c in cands:
        p = pricer.candidate(c)
        empty = [p.table_names[t] for t, o in enumerate(p.options) if not o]
        if empty:
            for n in empty:
                unpinnable.setdefault(n, []).append(c.sparse_shard)
            continue
        f = floors.get((c.sparse_shard, c.micro_batches))
        if f is None:
            f = floors[(c.sparse_shard, c.micro_batches)] = _sparse_floor(p)
        lb, mem_floor = bounds(p, f)
        feasible = mem_floor <= p.capacity_bytes and math.isfinite(lb)
        records.append(CandidateRecord(c, lb, mem_floor, feasible))
        pricings[c] = p
    if not records:
        n, sizes = next(iter(unpinnable.items()))
        raise CoplanError(f"--pin-table {n}={cfg.table_pins[n]}: no mesh candidate can shard '{n}' that way "
                          f"(sparse groups tried: {sorted(set(sizes))[:8]}); pin another sharding or drop the pin")
    if progress:
        progress(f"priced {len(cands)} mesh candidates in {time.perf_counter() - t0:.1f} s")
    feasible = sorted((r for r in records if r.feasible), key=lambda r: (r.lower_bound_s, r.mesh.key))
    if not feasible:
        raise explain_infeasible(workload, topology, world, pricer, records, pricings)
    settings = SolverSettings(time_limit_s=cfg.solve_dtime, num_workers=1, seed=cfg.seed, flat_max_vars=cfg.flat_max_vars,
                              relative_gap=cfg.relative_gap)
    best: tuple[float, CandidateRecord, SolveResult] | None = None
    i = 0
    solved = 0
    import ortools.sat.python.cp_model  # noqa: F401  (imported once, before the workers fork)

    ctx = mp.get_context("fork") if "fork" in mp.get_all_start_methods() else None
    pool = ProcessPoolExecutor(max_workers=workers, mp_context=ctx) if workers > 1 else None
    try:
        while i < len(feasible) and solved < cfg.max_solves:
            if best is not None and feasible[i].lower_bound_s >= best[0] * (1 - cfg.gap_tolerance):
                break
            if best is not None and time.perf_counter() - t0 > cfg.time_limit_s:
                break
            batch = []
            while i < len(feasible) and len(batch) < cfg.batch_size and solved + len(batch) < cfg.max_solves:
                r = feasible[i]
                if best is not None and r.lower_bound_s >= best[0] * (1 - cfg.gap_tolerance):
                    break
                batch.append(r)
                i += 1
            if not batch:
                break
            # Once a plan is known, a candidate only matters if it can beat it by more than the gap
            # tolerance: the solver is told so (an objective cutoff), which is cheaper to refute than
            # to solve. The cutoff is fixed before the batch runs, so plans stay deterministic.
            cutoff = best[0] * (1 - cfg.gap_tolerance) if best is not None and cfg.gap_tolerance > 0 else None
            jobs = [(pricings[r.mesh], settings, cutoff) for r in batch]
            results = list(pool.map(_solve_job, jobs)) if pool is not None and len(jobs) > 1 else [_solve_job(j) for j in jobs]
            for r, res in zip(batch, results):
                solved += 1
                r.status, r.step_time_s, r.bound_s, r.method = res.status, res.step_time_s, res.bound_s, res.method
                if res.assignment is not None and (best is None or res.step_time_s < best[0]):
                    best = (res.step_time_s, r, res)
            if progress:
                el = time.perf_counter() - t0
                progress(f"[{el:5.1f} s] solved {solved} candidates; best {best[0] * 1e3:.1f} ms" if best else f"[{el:5.1f} s] solved {solved} candidates; none feasible yet")
    finally:
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
    if best is None:
        raise explain_infeasible(workload, topology, world, pricer, records, pricings, solved=True)
    step, rec, res = best
    # valid bound: solved candidates' proven bounds; unsolved feasible candidates' cheap bounds
    bound = min([r.bound_s for r in feasible if r.status not in ("PRUNED",)] +
                [r.lower_bound_s for r in feasible if r.status == "PRUNED" and r.lower_bound_s < step] + [step])
    return SearchResult(pricings[rec.mesh], res.assignment, res, records, bound, time.perf_counter() - t0, workers, pricer)


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


def build_plan(workload: Workload, topology: Topology, calibration: Calibration | None, result: SearchResult, cfg: PlannerConfig) -> Plan:
    from coplan.costmodel import price

    p, a = result.pricing, result.assignment
    pr = result.pricer
    mesh = pr.mesh_plan(p.mesh)
    tables = table_shards(p, a)
    layers = layer_plans(p, a)
    ctx = pr.context(p.mesh)
    cost = price(ctx, tables if tables else None, layers, pr.balancing, workload.kernels, detail=False)
    # The surrogate and the full pricer agree on memory up to their rounding; if the full pricer says
    # the fullest rank does not fit, recompute more layers (cheapest per byte freed) until it does.
    rc = [lp.recompute for lp in layers]
    order = sorted(range(len(p.layers)), key=lambda i: (p.layers[i].recompute_s / max(p.layers[i].saved_bytes, 1.0), i))
    while not cost.fits:
        nxt = next((i for i in order if not rc[i] and p.layers[i].saved_bytes > 0), None)
        if nxt is None:
            break
        rc[nxt] = True
        layers = tuple(LayerPlan(name=l.name, recompute=on) for l, on in zip(p.layers, rc))
        cost = price(ctx, tables if tables else None, layers, pr.balancing, workload.kernels, detail=False)
    # Per-layer bf16/fp8 after the solve: precision changes no memory in this recipe (see planner/precision.py).
    from coplan.planner.precision import choose_layer_precision, precision_line

    layers, precision_report = choose_layer_precision(ctx, layers, tables=tables if tables else None, balancing=pr.balancing,
                                                      kernels=workload.kernels)
    cost = price(ctx, tables if tables else None, layers, pr.balancing, workload.kernels, detail=True)
    pred = cost.to_prediction()
    if precision_report is not None:
        pred = pred.model_copy(update={"notes": pred.notes + (precision_line(precision_report),)})
    objective = result.solve.step_time_s
    bound = min(result.bound_s, objective)
    # proven optimal when the chosen candidate is, and nothing else can beat it beyond integer rounding
    from coplan.planner.solver import _rounding_slack

    slack = 2 * _rounding_slack(p) + 1e-12
    status = "OPTIMAL" if result.solve.status == "OPTIMAL" and bound >= objective - slack else "FEASIBLE"
    report = SolverReport(
        status=status, objective_us=objective * 1e6, best_bound_us=max(0.0, bound * 1e6),
        gap=max(0.0, (objective - bound) / objective) if objective > 0 else 0.0, wall_s=result.wall_s,
        num_workers=result.num_workers, seed=cfg.seed, candidates_total=len(result.records),
        candidates_solved=sum(1 for r in result.records if r.status != "PRUNED"), pins=cfg.pin_labels,
    )
    return Plan(
        coplan_version=__version__, created_utc=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        topology=topology, workload=workload, calibration=calibration, topology_sha256=spec_sha256(topology),
        workload_sha256=spec_sha256(workload), world_size=p.mesh.world_size, mesh=mesh, tables=tables, layers=layers,
        balancing=pr.balancing, kernels=workload.kernels, precision=workload.precision, predicted=pred, solver=report,
        precision_report=precision_report,
    )


def make_plan(workload: Workload, topology: Topology, calibration: Calibration | None = None, config: PlannerConfig | None = None,
              *, progress=None) -> tuple[Plan, SearchResult]:
    """Plan ``workload`` on ``topology``: the Plan and the search that produced it."""
    cfg = config or PlannerConfig()
    result = search(workload, topology, calibration, cfg, progress=progress)
    return build_plan(workload, topology, calibration, result, cfg), result
