"""``coplan simulate``: sweep the GPU count (or one knob) for a workload on a topology family and
print the predicted step time, MFU, scaling ratio and memory headroom of a reasonable plan per point.

The plan per point comes from :func:`coplan.planner.heuristic.heuristic_plan_choices` (fast and
explainable; ``coplan plan`` prices it too and never returns a slower plan). A *topology family* is a preset name prefix (``h200-superpod`` covers
``h200-superpod-1k`` and ``h200-superpod-4k``): each point uses the smallest member with enough GPUs;
past the largest, its outermost tier is repeated as needed (the output says so).
"""

from __future__ import annotations

import argparse
import json
import math
import sys

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from coplan.cli_args import MAX_SWEEP_POINTS, int_list, nonempty, nonempty_path, nonempty_str, parse_float, parse_int, split_list
from coplan.costmodel import build_context, price
from coplan.costmodel.embedding import greedy_table_wise
from coplan.costmodel.flops import recomputable_layers
from coplan.errors import CoplanError, PresetNotFoundError
from coplan.planner.heuristic import heuristic_plan_choices
from coplan.planner.mesh import mesh_axes
from coplan.spec import BalancingPlan, LayerPlan, MeshPlan, Topology, Workload, list_presets, load_topology, load_workload
from coplan.spec.topology import MAX_GPUS
from coplan.spec.workload import MAX_LOCAL_BATCH, Kernels
from coplan.units import human_bytes, human_seconds

KNOBS = {
    "local_batch": "samples per GPU (integers)",
    "micro_batches": "gradient-accumulation micro-batches (integers)",
    "balancing": "jagged balancing policy: none, greedy, karmarkar_karp",
    "attention": "attention kernel backend: triton, flex, reference",
    "recompute": "activation recompute: none, all",
    "fp8": "GEMM precision of every layer: bf16, fp8",
    "dense_shard": "FSDP shard degree (divisors of the GPU count)",
    "sparse_shard": "ranks one copy of the tables is sharded over (divisors of the GPU count)",
    "expert_parallel": "expert-parallel degree",
    "bw_scale:<tier>": "multiply one tier's bandwidth (floats), e.g. bw_scale:leaf",
}


class SimulateError(CoplanError):
    """Bad arguments to ``coplan simulate``."""


def scale_topology(topology: Topology, num_gpus: int) -> Topology:
    """``topology`` with its outermost tier repeated so that it holds at least ``num_gpus`` GPUs."""
    if num_gpus <= topology.num_gpus:
        return topology
    below = topology.gpus_below(len(topology.tiers) - 1)
    size = math.ceil(num_gpus / below)
    tiers = list(topology.tiers)
    tiers[-1] = tiers[-1].model_copy(update={"size": size})
    data = topology.model_dump()
    data["tiers"] = [t.model_dump() for t in tiers]
    data["name"] = f"{topology.name}@{below * size}"
    data["description"] = f"{topology.description} [outer tier '{tiers[-1].name}' extended to {size} for {num_gpus:,} GPUs]"
    return Topology.model_validate(data)


def topology_for(name: str, num_gpus: int) -> tuple[Topology, bool]:
    """The topology for ``num_gpus`` from a preset, a path or a family prefix; True when extended."""
    try:
        t = load_topology(name)
        family = [t]
    except PresetNotFoundError:
        members = [p for p in list_presets(Topology) if p.startswith(name + "-") or p == name]
        if not members:
            raise SimulateError(
                f"--topology '{name}' is neither a preset, a file nor a family prefix of the presets {list_presets(Topology)}"
            ) from None
        family = sorted((load_topology(m) for m in members), key=lambda x: x.num_gpus)
    for t in family:
        if t.num_gpus >= num_gpus:
            return t, False
    return scale_topology(family[-1], num_gpus), True


INT_KNOBS = ("local_batch", "micro_batches", "dense_shard", "sparse_shard", "expert_parallel")
CHOICE_KNOBS = {"balancing": ("none", "greedy", "karmarkar_karp"), "attention": ("triton", "flex", "reference"),
                "recompute": ("none", "all"), "fp8": ("bf16", "fp8")}


def knob_name(text: str) -> str:
    """``--knob``: one of :data:`KNOBS` (``bw_scale:<tier>``'s tier is checked against the topology)."""
    k = text.strip()
    if k in INT_KNOBS or k in CHOICE_KNOBS or (k.startswith("bw_scale:") and k.split(":", 1)[1].strip()):
        return k
    raise argparse.ArgumentTypeError(f"unknown knob {text!r}; knobs: {', '.join(KNOBS)}")


def _parse_values(knob: str, raw: str) -> list:
    """The knob's values, each checked: whole numbers in range, positive finite scales, or one of its choices."""
    try:
        vals = split_list(raw)
        if knob == "local_batch":
            return [parse_int(v, 1, MAX_LOCAL_BATCH) for v in vals]
        if knob == "micro_batches":
            return [parse_int(v, 1, MAX_LOCAL_BATCH) for v in vals]
        if knob in INT_KNOBS:
            return [parse_int(v, 1, MAX_GPUS) for v in vals]
        if knob.startswith("bw_scale:"):
            return [parse_float(v, 0.0, 1e6, lo_open=True) for v in vals]
    except argparse.ArgumentTypeError as e:
        raise SimulateError(f"--values for knob '{knob}': {e}") from None
    allowed = CHOICE_KNOBS[knob]
    bad = [v for v in vals if v not in allowed]
    if bad:
        raise SimulateError(f"--values {bad} are not valid for '{knob}' (choose from {list(allowed)})")
    return vals


def _gpu_list(raw: list[int] | None) -> list[int]:
    return list(raw) if raw else [8 << k for k in range(12)]  # 8 .. 16,384


def _check_tier(name: str, knob: str | None, gpus: int) -> None:
    """A ``bw_scale:<tier>`` knob naming a tier the topology lacks, refused before any pricing."""
    if knob and knob.startswith("bw_scale:"):
        topo, _ = topology_for(name, gpus)
        tier = knob.split(":", 1)[1]
        names = [t.name for t in topo.tiers]
        if tier not in names:
            raise SimulateError(f"--knob {knob}: topology '{topo.name}' has no tier '{tier}' (tiers: {names})")


def simulate_point(workload: Workload, topology: Topology, gpus: int, calibration=None, knob: str | None = None, value=None) -> dict:
    """Plan (heuristically) and price one point; returns a JSON-ready row."""
    w = workload
    topo = topology
    if knob == "local_batch":
        w = w.model_copy(update={"batch": w.batch.model_copy(update={"local_batch_size": int(value), "global_batch_size": None})})
    elif knob == "micro_batches":
        w = w.model_copy(update={"batch": w.batch.model_copy(update={"micro_batches": int(value)})})
    elif knob and knob.startswith("bw_scale:"):
        tier = knob.split(":", 1)[1]
        names = [t.name for t in topo.tiers]
        if tier not in names:
            raise SimulateError(f"knob '{knob}': topology '{topo.name}' has no tier '{tier}' (tiers: {names})")
        tiers = [t.model_copy(update={"bw_bytes_per_s": t.bw_bytes_per_s * float(value)}) if t.name == tier else t for t in topo.tiers]
        topo = topo.model_copy(update={"tiers": tuple(tiers)})
    if not w.batch.splits(gpus):
        return {"gpus": gpus, "value": value, "skipped": f"global batch {w.batch.global_batch_size:,} does not split evenly over {gpus:,} GPUs"}
    local = w.batch.local(gpus)
    if w.batch.fixed_micro_batches and local % w.batch.fixed_micro_batches:
        return {"gpus": gpus, "value": value, "skipped": f"{w.batch.fixed_micro_batches} micro-batches do not split the local batch of {local}"}
    hp = heuristic_plan_choices(w, topo, gpus, calibration)
    mesh, tables, layers, bal = hp.mesh, hp.tables, hp.layers, hp.balancing
    kernels = w.kernels
    if knob in ("dense_shard", "sparse_shard", "expert_parallel"):
        v = int(value)
        if gpus % v:
            raise SimulateError(f"{knob}={v} does not divide {gpus:,} GPUs")
        upd = {"dense_shard": {"dense_shard": v, "dense_replicate": gpus // v},
               "sparse_shard": {"sparse_shard": v, "sparse_replicate": gpus // v},
               "expert_parallel": {"expert_parallel": v}}[knob]
        try:
            mesh = MeshPlan.model_validate({**mesh.model_dump(exclude={"axes"}), **upd})
        except Exception as e:  # pydantic ValidationError: say which knob value is inconsistent
            raise SimulateError(f"{knob}={v} gives an inconsistent mesh: {str(e).splitlines()[-1]}") from None
        mesh = mesh.model_copy(update={"axes": mesh_axes(topo, mesh)})
        if knob == "sparse_shard":
            tables = greedy_table_wise(build_context(w, topo, mesh, calibration)) if w.all_tables else None
    ctx = build_context(w, topo, mesh, calibration)
    if knob == "balancing":
        bal = BalancingPlan(policy=value)
    elif knob == "attention":
        kernels = Kernels(attention=value, embedding=kernels.embedding)
    elif knob == "recompute":
        may = set(recomputable_layers(w))
        layers = tuple(LayerPlan(name=n, recompute=(value == "all" and n in may)) for n in ctx.layer_names)
    elif knob == "fp8":
        rec = {lp.name: lp.recompute for lp in layers}
        layers = tuple(LayerPlan(name=n, recompute=rec.get(n, False), precision=value) for n in ctx.layer_names)
    c = price(ctx, tables, layers, bal, kernels, detail=False)
    return {
        "gpus": gpus,
        "topology": topo.name,
        "knob": knob,
        "value": value,
        "mesh": {"dense_shard": mesh.dense_shard, "dense_replicate": mesh.dense_replicate, "expert_parallel": mesh.expert_parallel,
                 "sparse_shard": mesh.sparse_shard, "sparse_replicate": mesh.sparse_replicate},
        "recomputed_layers": sum(1 for lp in layers if lp.recompute),
        "balancing": bal.policy,
        "step_time_s": c.step_time_s,
        "compute_s": c.compute_s,
        "exposed_comm_s": c.exposed_comm_s,
        "imbalance": c.imbalance,
        "local_mfu": c.local_mfu,
        "scaling_ratio": c.scaling_ratio,
        "e2e_mfu": c.e2e_mfu,
        "goodput": c.goodput.fraction if c.goodput else 1.0,
        "goodput_mfu": c.goodput_mfu,
        "memory_bytes": c.memory.total,
        "hbm_bytes": c.usable_hbm_bytes,
        "headroom_bytes": c.memory_headroom_bytes,
        "fits": c.fits,
        "memory": c.memory.as_dict(),
        "notes": list(hp.reasons) + list(c.notes),
    }


def run_simulate(args: argparse.Namespace, choose) -> int:
    """The sweep of ``args``; ``choose(args, topology)`` -> (calibration, the line that says which): the CLI's
    verb (``coplan.planner.cli``) chooses as ``coplan plan`` does, the shipped calibration by default."""
    workload = load_workload(args.workload)
    gpus = _gpu_list(args.gpus)
    if args.values is not None and not args.knob:
        raise SimulateError("--values needs --knob: give the knob the values are for (see the list of knobs in --help)")
    if args.knob:
        if not args.values:
            raise SimulateError("--knob needs --values (comma-separated)")
        if len(gpus) != 1:
            if args.gpus:
                raise SimulateError("a knob sweep runs at one GPU count: give --gpus N")
            gpus = [1024]
        values = _parse_values(args.knob, args.values)
        _check_tier(args.topology, args.knob, gpus[0])
        points = [(gpus[0], v) for v in values]
    else:
        points = [(g, None) for g in gpus]
    # the calibration `coplan plan` would use: the one shipped for the topology's GPU unless told otherwise
    # (every point of a sweep has the same GPU)
    calibration, line = choose(args, topology_for(args.topology, points[0][0])[0])
    print(line, file=sys.stderr if args.json else sys.stdout)
    rows = []
    extended = set()
    progress = None
    if not args.json and sys.stderr.isatty() and len(points) > 3:
        progress = Progress(transient=True, console=None)
        progress.start()
        task = progress.add_task("pricing", total=len(points))
    try:
        for g, v in points:
            topo, ext = topology_for(args.topology, g)
            if ext:
                extended.add(topo.description)
            rows.append(simulate_point(workload, topo, g, calibration, args.knob, v))
            if progress:
                progress.advance(task)
    finally:
        if progress:
            progress.stop()
    if args.json:
        print(json.dumps({"workload": workload.name, "topology": args.topology, "knob": args.knob, "points": rows}, indent=1, default=float))
        return 0
    _print_table(workload, args, rows)
    for d in sorted(extended):
        print(f"note: {d}")
    return 0


def _print_table(workload: Workload, args: argparse.Namespace, rows: list[dict]) -> None:
    title = f"coplan simulate: {workload.name} on {args.topology}" + (f", knob {args.knob}" if args.knob else "")
    t = Table(title=title)
    cols = ["GPUs"] + (["value"] if args.knob else []) + ["dense ds×dr", "ep", "sparse ss×sr", "step", "local MFU", "scaling",
                                                       "E2E MFU", "goodput MFU", "memory", "headroom"]
    for c in cols:
        t.add_column(c, justify="right", no_wrap=True)
    for r in rows:
        if "skipped" in r:
            t.add_row(f"{r['gpus']:,}", *([str(r.get("value", ""))] if args.knob else []), "[dim]skipped[/dim]", *["—"] * 9)
            continue
        m = r["mesh"]
        head = human_bytes(r["headroom_bytes"]) if r["fits"] else f"[red]-{human_bytes(-r['headroom_bytes'])}[/red]"
        t.add_row(f"{r['gpus']:,}", *([str(r["value"])] if args.knob else []), f"{m['dense_shard']}×{m['dense_replicate']}",
                  str(m["expert_parallel"]), f"{m['sparse_shard']}×{m['sparse_replicate']}", human_seconds(r["step_time_s"]),
                  f"{r['local_mfu']:.1%}", f"{r['scaling_ratio']:.1%}", f"{r['e2e_mfu']:.1%}", f"{r['goodput_mfu']:.1%}",
                  human_bytes(r["memory_bytes"]), head)
    console = Console()
    if console.width < 150:
        console = Console(width=150)
    console.print(t)
    for r in rows:
        if "skipped" in r:
            console.print(f"skipped {r['gpus']:,} GPUs: {r['skipped']}")
    short = [r for r in rows if "skipped" not in r and not r["fits"]]
    if short:
        console.print(f"[red]{len(short)} point(s) do not fit in HBM[/red] (negative headroom): their times are what the "
                      "plan would take if it fitted; `coplan plan` says which resource falls short and what would fix it.")


def register_simulate(sub: argparse._SubParsersAction, help_text: str, run) -> None:
    p = sub.add_parser("simulate", help=help_text, description=help_text + ". " + (__doc__ or "").split("\n\n")[1].replace("\n", " "),
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       epilog="knobs:\n" + "\n".join(f"  {k:<18} {v}" for k, v in KNOBS.items()))
    p.add_argument("--workload", "-w", required=True, type=nonempty_path, help="workload preset name or path")
    p.add_argument("--topology", "-t", required=True, type=nonempty_path, help="topology preset, path, or family prefix (e.g. h200-superpod)")
    p.add_argument("--gpus", type=int_list(1, MAX_GPUS),
                   help=f"comma-separated GPU counts (default 8,16,...,16384; each at most {MAX_GPUS:,}, "
                        f"at most {MAX_SWEEP_POINTS} of them)")
    p.add_argument("--knob", type=knob_name, help="sweep one knob at one GPU count instead (see the list below)")
    p.add_argument("--values", type=nonempty_str, help=f"comma-separated values of the knob (at most {MAX_SWEEP_POINTS})")
    p.add_argument("--calibration", "-c", default="auto", type=nonempty("path", "auto"),
                   help="calibration.json from coplan calibrate; 'auto' (default): the one shipped for the topology's GPU, "
                        "if any, as coplan plan uses; 'none': default efficiencies, host time not priced")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run)


__all__ = ["KNOBS", "register_simulate", "scale_topology", "simulate_point", "topology_for"]
