"""``coplan validate`` and ``coplan schema``: check spec files and print their JSON Schemas."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

from coplan.cli_args import nonempty_path
from coplan.errors import CoplanError
from coplan.spec import (SPEC_KINDS, Plan, RunDir, RunResult, Topology, Workload, list_presets, load_any, load_plan,
                         load_run_result)
from coplan.spec.loader import looks_like_path
from coplan.units import human_bytes


def _summary(spec: object) -> str:
    if isinstance(spec, Topology):
        tiers = " > ".join(f"{t.name}x{t.size}" for t in spec.tiers)
        return f"topology '{spec.name}': {spec.num_gpus:,} x {spec.gpu.name} ({tiers})"
    if isinstance(spec, Workload):
        tables = spec.all_tables
        emb_bytes = sum(t.num_params * {"fp32": 4, "fp16": 2, "bf16": 2, "int8": 1}[t.dtype] for t in tables)
        return (
            f"workload '{spec.name}': {len(tables):,} tables, {spec.sparse_params:.3e} sparse params "
            f"({human_bytes(emb_bytes)}), {len(spec.blocks)} blocks"
        )
    if isinstance(spec, Plan):
        return f"plan: '{spec.workload.name}' on {spec.world_size:,} GPUs of '{spec.topology.name}'"
    if isinstance(spec, RunResult):
        mfu = f", measured MFU {spec.measured_mfu:.1%}" if spec.measured_mfu else ""
        return (f"run summary '{spec.run_id}': {spec.steps:,} steps of '{spec.workload or '?'}' on {spec.world_size:,} x "
                f"{spec.device or '?'}{mfu}")
    return f"{type(spec).__name__.lower()}"


def run_validate(args: argparse.Namespace) -> int:
    if args.list:
        out = {"topologies": list_presets(Topology), "workloads": list_presets(Workload)}
        if args.json:
            print(json.dumps(out, indent=1))
        else:
            for k, v in out.items():
                print(f"{k}: {', '.join(v)}")
        return 0
    presets = list_presets(Topology) + list_presets(Workload)
    targets = [f for t in args.files for f in _run_files(t, presets)] if args.files else [(t, load_any) for t in presets]
    results = []
    failed = 0
    for target, load in targets:
        try:
            spec = load(target)
            results.append({"file": target, "ok": True, "summary": _summary(spec)})
        except CoplanError as e:
            failed += 1
            results.append({"file": target, "ok": False, "error": str(e)})
    if args.json:
        print(json.dumps(results, indent=1))
    else:
        for r in results:
            if r["ok"]:
                print(f"ok    {r['file']}: {r['summary']}")
            else:
                print(f"FAIL  {r['error']}")
        print(f"{len(results) - failed} valid, {failed} invalid")
    return 2 if failed else 0


def _run_files(target: str, presets: list[str]) -> list[tuple[str, Callable[[str], object]]]:
    """What to load for a target, and how: a run directory (``runs/<id>/``) stands for its spec files, the plan
    it ran and, once it has ended, its summary; any other target for itself, of the kind its keys say."""
    if not Path(target).is_dir() or (not looks_like_path(target) and target in presets):
        return [(target, load_any)]
    run = RunDir(target)
    files = [(str(p), load) for p, load in ((run.plan_path, load_plan), (run.summary_path, load_run_result)) if p.is_file()]
    return files or [(target, _not_a_run)]


def _not_a_run(target: str) -> object:
    raise CoplanError(f"{target}: is a directory without plan.json or summary.json; give spec files, or a run directory "
                      "written by `coplan train` (runs/<id>/)")


def register_validate(sub: argparse._SubParsersAction, help_text: str) -> None:
    p = sub.add_parser("validate", help=help_text, description=help_text + ". With no files, validates every preset.")
    p.add_argument("files", nargs="*", type=nonempty_path, help="spec files (YAML or JSON), preset names, or run directories (runs/<id>/: "
                   "their plan.json and summary.json)")
    p.add_argument("--list", action="store_true", help="list the topology and workload presets")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run_validate)


def run_schema(args: argparse.Namespace) -> int:
    kinds = [args.kind] if args.kind != "all" else list(SPEC_KINDS)
    schemas = {k: SPEC_KINDS[k].model_json_schema() for k in kinds}
    if args.output:
        out = Path(args.output)
        if out.exists() and not out.is_dir():
            raise CoplanError(f"{out}: exists and is not a folder; -o takes a folder to write <kind>.schema.json files into")
        out.mkdir(parents=True, exist_ok=True)
        for k, s in schemas.items():
            (out / f"{k}.schema.json").write_text(json.dumps(s, indent=1) + "\n")
            print(f"wrote {out / f'{k}.schema.json'}")
        return 0
    print(json.dumps(schemas if len(kinds) > 1 else schemas[kinds[0]], indent=1))
    return 0


def register_schema(sub: argparse._SubParsersAction, help_text: str) -> None:
    p = sub.add_parser("schema", help=help_text, description=help_text + ".")
    p.add_argument("kind", nargs="?", default="all", choices=[*SPEC_KINDS, "all"], help="which spec (default: all)")
    p.add_argument("-o", "--output", type=nonempty_path, help="write one <kind>.schema.json per spec into this folder")
    p.set_defaults(func=run_schema)
