"""``coplan plan``: choose the parallel plan of a workload on a topology and write plan.json.

With no arguments it plans the built-in default, ``gem-1t`` on ``h200-superpod-4k``. Prints a summary
(mesh and the tiers each axis crosses, sharding counts, recompute, predicted step time, MFU, goodput,
peak memory against capacity, solver status, bound and gap); ``--json`` prints it as JSON.
``--export-torchrec`` also writes TorchRec's ShardingPlan of the tables.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from coplan.cli_args import (MAX_SEED, check_output, fraction, gpu_count, int_range, nonempty, nonempty_path, nonempty_str,
                              parse_int, removed_on_failure, seconds, seed)
from coplan.costmodel import resolve_efficiencies
from coplan.errors import CoplanError, SpecError
from coplan.planner.precision import fused_ffn_of, precision_line
from coplan.planner.search import PlannerConfig, make_plan
from coplan.planner.torchrec_export import write_torchrec
from coplan.calibration.shipped import AUTO, choose
from coplan.spec import Plan, dump_spec, load_topology, load_workload
from coplan.spec.topology import MAX_GPUS
from coplan.units import human_bytes, human_seconds

DEFAULT_TOPOLOGY = "h200-superpod-4k"
DEFAULT_WORKLOAD = "gem-1t"


def summary(plan: Plan, result=None) -> dict:
    """The summary as plain data (what ``--json`` prints)."""
    pred = plan.predicted
    counts = Counter(t.sharding_type for t in plan.tables)
    out = {
        "workload": plan.workload.name,
        "topology": plan.topology.name,
        "world_size": plan.world_size,
        "mesh": {a.name: {"size": a.size, "tiers": list(a.tiers)} for a in plan.mesh.axes},
        "dense": {"fsdp_shard": plan.mesh.dense_shard, "replicate": plan.mesh.dense_replicate, "expert_parallel": plan.mesh.expert_parallel},
        "sparse": {"shard_group": plan.mesh.sparse_shard, "replicas": plan.mesh.sparse_replicate},
        "micro_batches": plan.micro_batches,
        "sharding_counts": dict(sorted(counts.items())),
        "recompute_layers": [l.name for l in plan.layers if l.recompute],
        "balancing": plan.balancing.model_dump(),
    }
    if pred is not None:
        out["predicted"] = {
            "step_time_s": pred.step_time_s, "local_mfu": pred.local_mfu, "scaling_ratio": pred.scaling_ratio,
            "e2e_mfu": pred.e2e_mfu, "goodput": pred.goodput, "goodput_mfu": pred.goodput_mfu,
            "peak_memory_bytes": pred.peak_memory_bytes, "hbm_capacity_bytes": pred.hbm_capacity_bytes,
        }
    if plan.precision_report is not None:
        r = plan.precision_report
        out["fp8"] = {"mode": r.mode, "recipe": r.recipe, "layers": list(r.fp8_layers), "step_time_s": r.step_time_s,
                      "bf16_step_time_s": r.bf16_step_time_s, "predicted_gain": r.gain,
                      "fused_ffn_layers": list(fused_ffn_of(r, plan.workload)),
                      "layer_saved_s": {c.name: c.bf16_s - c.fp8_s for c in r.layers if c.precision == "fp8"}}
    if plan.solver is not None:
        out["solver"] = plan.solver.model_dump()
    return out


def print_summary(plan: Plan, out=None) -> None:
    out = out or sys.stdout
    s = summary(plan)
    p = plan.predicted
    w = lambda *a: print(*a, file=out)  # noqa: E731
    w(f"plan: '{plan.workload.name}' on {plan.world_size:,} GPUs of '{plan.topology.name}'")
    w("mesh (axis: size, tiers its groups cross):")
    for name, ax in s["mesh"].items():
        w(f"  {name:<17} {ax['size']:>6,}  {' > '.join(ax['tiers'])}")
    d = s["dense"]
    w(f"dense: FSDP shard {d['fsdp_shard']:,} x replicate {d['replicate']:,} (HSDP), expert-parallel {d['expert_parallel']}")
    w(f"batch: {plan.workload.batch.global_(plan.world_size):,} samples per step, {plan.workload.batch.local(plan.world_size):,} per GPU"
      + (f" in {plan.micro_batches} micro-batches (gradient accumulation)" if plan.micro_batches > 1 else ""))
    sp = s["sparse"]
    w(f"sparse: tables sharded over groups of {sp['shard_group']:,} ranks, {sp['replicas']:,} replicas")
    if s["sharding_counts"]:
        w("tables: " + ", ".join(f"{k} {v:,}" for k, v in s["sharding_counts"].items()))
    rc = s["recompute_layers"]
    w(f"recompute: {len(rc)} of {len(plan.layers)} layers" + (f" ({', '.join(rc[:8])}{', ...' if len(rc) > 8 else ''})" if rc else ""))
    b = plan.balancing
    grp = (f" within groups of {b.group_ranks:,} ranks ({b.group_ranks // plan.topology.gpus_per_node:,} node(s); each rank reads "
           f"its group's rows: loader {plan.predicted.loader_s:.3g} s per step)" if b.group_ranks and plan.predicted is not None else "")
    w(f"jagged balancing: {b.policy}{grp} (expected max/mean rank work {b.expected_imbalance:.4f})")
    if plan.precision_report is not None:
        w(precision_line(plan.precision_report, plan.workload))
    if p is not None:
        w(f"predicted step time  {human_seconds(p.step_time_s)}")
        w(f"local MFU            {p.local_mfu:6.1%}")
        w(f"scaling ratio        {p.scaling_ratio:6.1%}")
        w(f"E2E MFU              {p.e2e_mfu:6.1%}")
        w(f"goodput              {p.goodput:6.1%}  (goodput MFU {p.goodput_mfu:.1%})")
        usable = p.hbm_capacity_bytes - p.hbm_reserve_bytes
        w(f"peak memory / rank   {human_bytes(p.peak_memory_bytes)} of {human_bytes(usable)} usable ({p.peak_memory_bytes / max(usable, 1):.1%}; "
          f"HBM {human_bytes(p.hbm_capacity_bytes)} less a {human_bytes(p.hbm_reserve_bytes)} reserve)")
    if plan.solver is not None:
        r = plan.solver
        if r.model_objective_us:
            w(f"model: CP-SAT's objective {r.model_objective_us / 1e3:,.3f} ms for the priced step's {r.objective_us / 1e3:,.3f} ms "
              f"({(r.objective_us - r.model_objective_us) / r.objective_us:+.2%}, {r.cut_rounds} re-solve(s) after pricing)"
              + (f"; pinned: {', '.join(r.pins)}" if r.pins else ""))
        w(f"solver: {r.status}, objective {r.objective_us / 1e3:,.3f} ms, bound {r.best_bound_us / 1e3:,.3f} ms, gap {r.gap:.2%}; "
          f"{r.candidates_solved} of {r.candidates_total:,} mesh candidates solved in {r.wall_s:.1f} s on {r.num_workers} workers (seed {r.seed})")
        for note in r.notes:
            w(f"solver note: {note}")


def parse_pins(items: list[str] | None, flag: str, cast) -> dict:
    """``NAME=VALUE`` strings as a dict (a repeated name is refused)."""
    out: dict = {}
    for item in items or ():
        name, sep, value = item.partition("=")
        name, value = name.strip(), value.strip()
        if not sep or not name or not value:
            raise CoplanError(f"{flag} {item!r}: expected NAME=VALUE, e.g. {'sparse_replicate=2' if cast is int else 'user_id=row_wise'}")
        if name in out:
            raise CoplanError(f"{flag} {name} is given twice; give it once")
        try:
            out[name] = parse_int(value) if cast is int else cast(value)  # strict: never 1e3, 4.0 or 1_000
        except argparse.ArgumentTypeError:
            raise CoplanError(f"{flag} {name}={value}: the size is not a whole number; give a whole number of at least 1, "
                              f"e.g. {name}=2") from None
    return out


class PlanProgress:
    """The plan's progress on stderr: one line per phase and batch of solves, and on a terminal a rich
    spinner with the elapsed time and the step of work under way, so that no stretch of the search is quiet."""

    def __init__(self) -> None:
        self.console = Console(stderr=True)
        self.bar: Progress | None = None
        if self.console.is_terminal:
            self.bar = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                TimeElapsedColumn(), console=self.console, transient=True)
            self.task = self.bar.add_task("loading the inputs", total=None)
            self.bar.start()

    def __call__(self, message: str) -> None:
        if self.bar is not None:
            self.bar.console.print(message, markup=False, highlight=False)
        else:
            print(message, file=sys.stderr, flush=True)

    def work(self, what: str, done: int, total: int) -> None:
        if self.bar is not None:
            self.bar.update(self.task, description=what, completed=done, total=total)

    def stop(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def run_plan(args: argparse.Namespace) -> int:
    inputs = (args.topology, args.workload, *([args.calibration] if args.calibration.lower() not in ("auto", "none") else []))
    out = check_output(args.output, "-o", inputs)
    torchrec = None
    if args.export_torchrec:
        torchrec = Path(args.export_torchrec) if isinstance(args.export_torchrec, str) else out.with_suffix(".torchrec.pt")
        check_output(torchrec, "--export-torchrec", (*inputs, out))
    progress = None if (args.json or args.quiet) else PlanProgress()
    try:
        plan, calibration_line = _make_plan(args, progress)
    finally:
        if progress is not None:
            progress.stop()
    written = [str(out)]
    with removed_on_failure(out, torchrec, torchrec and torchrec.with_suffix(torchrec.suffix + ".json")):
        dump_spec(plan, out)
        if torchrec is not None:
            written += [str(p) for p in write_torchrec(plan, torchrec)]
    if args.json:
        print(json.dumps({"written": written, "calibration_used": calibration_line, **summary(plan)}, indent=1, default=str))
    else:
        print(calibration_line)
        print_summary(plan)
        print("wrote " + ", ".join(written))
    return 0


def _make_plan(args: argparse.Namespace, progress: PlanProgress | None) -> tuple[Plan, str]:
    topology = load_topology(args.topology)
    workload = load_workload(args.workload)
    issues = workload.triton_attention_issues()
    if issues:  # a GPU plan: the trainer would stop at its first attention call
        raise SpecError(str(args.workload), issues)
    calibration, line = choose(args.calibration, topology)
    if calibration is not None:
        if args.force:
            # Say so in the calibration itself, so the plan (and whoever re-prices it) carries the choice.
            orig = calibration.device
            if resolve_efficiencies(topology, calibration, force=True) and orig != topology.gpu.name:
                calibration = calibration.model_copy(update={
                    "device": topology.gpu.name,
                    "notes": (calibration.notes + " " if calibration.notes else "") + f"[forced: fitted on '{orig}', used for '{topology.gpu.name}']",
                })
        else:
            resolve_efficiencies(topology, calibration)  # refuses a calibration from another GPU, before any search
    cfg = PlannerConfig(world_size=args.gpus, time_limit_s=args.time_limit, num_workers=args.workers, seed=args.seed,
                        policy=args.policy, solve_dtime=args.solve_dtime, max_solves=args.max_solves,
                        gap_tolerance=args.gap_tolerance, pins=parse_pins(args.pin, "--pin", int),
                        table_pins=parse_pins(args.pin_table, "--pin-table", str))
    plan, _ = make_plan(workload, topology, calibration, cfg, progress=progress, on_work=progress.work if progress else None)
    return plan, line


def register_plan(sub: argparse._SubParsersAction, help_text: str) -> None:
    p = sub.add_parser("plan", help=help_text, description=help_text + f". With no arguments: {DEFAULT_WORKLOAD} on {DEFAULT_TOPOLOGY}.")
    p.add_argument("--topology", "-t", default=DEFAULT_TOPOLOGY, type=nonempty("path", DEFAULT_TOPOLOGY),
                   help=f"topology preset or file (default {DEFAULT_TOPOLOGY})")
    p.add_argument("--workload", "-w", default=DEFAULT_WORKLOAD, type=nonempty("path", DEFAULT_WORKLOAD),
                   help=f"workload preset or file (default {DEFAULT_WORKLOAD})")
    p.add_argument("--calibration", "-c", default=AUTO, type=nonempty("path", AUTO),
                   help="calibration.json from coplan calibrate; 'auto' (default): the one shipped for the topology's GPU, "
                        "if any (coplan/calibration/data/); 'none': default efficiencies, host time not priced")
    p.add_argument("--force", action="store_true", help="use a calibration fitted on another GPU than the topology's")
    p.add_argument("-o", "--output", default="plan.json", type=nonempty("path", "plan.json"), help="where to write the plan (default plan.json)")
    p.add_argument("--gpus", type=gpu_count, help=f"plan for the first N GPUs of the topology (default: all; at most {MAX_GPUS:,})")
    p.add_argument("--max-solves", type=int_range(1, 100_000), default=12, help="mesh candidates solved with CP-SAT at most (default 12)")
    p.add_argument("--time-limit", type=seconds, default=300.0, help="wall-clock guard: no new batch of solves after this many seconds (default 300)")
    p.add_argument("--solve-dtime", type=seconds, default=0.5, help="CP-SAT deterministic-time limit per candidate (default 0.5)")
    p.add_argument("--gap-tolerance", type=fraction, default=0.01,
                   help="stop once no unsolved mesh candidate can beat the best plan by more than this fraction (default 0.01)")
    p.add_argument("--workers", type=int_range(0, 1024), default=0, help="parallel solves (default 0: the machine's cores)")
    p.add_argument("--seed", type=seed, default=0, help=f"CP-SAT seed, 0 to {MAX_SEED:,} (plans are deterministic for a seed)")
    p.add_argument("--policy", choices=["none", "greedy", "karmarkar_karp"], help="jagged balancing policy (default: least expected imbalance)")
    p.add_argument("--pin", action="append", type=nonempty_str, metavar="AXIS=N",
                   help="fix a mesh axis (dp_shard, dp_replicate, ep, sparse_shard, sparse_replicate) or micro_batches and plan "
                        "the rest; repeatable")
    p.add_argument("--pin-table", action="append", type=nonempty_str, metavar="NAME=SHARDING",
                   help="fix one table's sharding (table_wise, row_wise, column_wise[/N], table_row_wise, data_parallel) and "
                        "plan the rest; repeatable")
    p.add_argument("--export-torchrec", nargs="?", const=True, default=None, type=nonempty_path, metavar="PATH",
                   help="also write TorchRec's ShardingPlan (torch.save) and a JSON rendering (default <output>.torchrec.pt)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    p.set_defaults(func=run_plan)


def register_simulate(sub: argparse._SubParsersAction, help_text: str) -> None:
    """``coplan simulate`` (:mod:`coplan.planner.simulate`), pricing with the calibration ``coplan plan`` would
    use: the one shipped for the topology's GPU unless ``--calibration`` says otherwise."""
    from coplan.planner import simulate

    def _choose(args: argparse.Namespace, topology):
        return choose(args.calibration, topology)

    simulate.register_simulate(sub, help_text, run=lambda args: simulate.run_simulate(args, _choose))
