"""``coplan sample-workload``: draw a GEM-shaped workload of a family from a seed (see :mod:`coplan.sample`)."""

from __future__ import annotations

import argparse
import json
import sys
from datetime import datetime, timezone

import yaml

from coplan.cli_args import MAX_DRAW_SEED, check_output, nonempty_path, seed_or_now
from coplan.errors import CoplanError
from coplan.sample import FAMILIES, family_world, sample_workload
from coplan.spec import write_text_atomic


def _seed(value: int | str) -> int:
    """The seed: as given (checked by :func:`coplan.cli_args.seed_or_now`), or for ``now`` the UTC date and time
    (YYYYMMDDHHMMSS)."""
    return int(datetime.now(timezone.utc).strftime("%Y%m%d%H%M%S")) if value == "now" else int(value)


def run_sample(args: argparse.Namespace) -> int:
    if args.list:
        rows = {name: {"description": f.description, **f.ranges()} for name, f in FAMILIES.items()}
        if args.json:
            print(json.dumps(rows, indent=1))
        else:
            for name, r in rows.items():
                print(f"{name}: {r.pop('description')}")
                for k, v in r.items():
                    print(f"    {k:<24} {v}")
        return 0
    if args.family is None:
        raise CoplanError("coplan sample-workload: give --family NAME (or --list to see the families)")
    out = check_output(args.output, "-o") if args.output is not None else None
    seed = _seed(args.seed)
    w = sample_workload(args.family, seed)
    text = yaml.safe_dump(w.model_dump(mode="json", exclude_none=True), sort_keys=False)
    f = FAMILIES[args.family]
    header = (f"# coplan sample-workload --family {args.family} --seed {seed}\n"
              f"# plan it: coplan plan -t {f.topology} --gpus {family_world(args.family, seed)} -w <this file>\n")
    if out is None:
        sys.stdout.write(header + text)
    else:
        write_text_atomic(out, header + text)
        print(f"seed {seed}: wrote {out} ({args.family}; plan on {f.topology}, {family_world(args.family, seed)} GPU(s))",
              file=sys.stderr)
    return 0


def register_sample_workload(sub: argparse._SubParsersAction, help_text: str) -> None:
    p = sub.add_parser("sample-workload", help=help_text, description=help_text + ".")
    p.add_argument("--family", choices=list(FAMILIES), help="which family of workloads to draw from")
    p.add_argument("--seed", type=seed_or_now, default="now",
                   help=f"whole number from 0 to {MAX_DRAW_SEED:,}, or 'now' (default): the UTC date and time as "
                        "YYYYMMDDHHMMSS, printed")
    p.add_argument("-o", "--output", type=nonempty_path, help="write the workload YAML here (default: standard output)")
    p.add_argument("--list", action="store_true", help="list the families and their ranges")
    p.add_argument("--json", action="store_true", help="with --list: machine-readable")
    p.set_defaults(func=run_sample)


__all__ = ["register_sample_workload", "run_sample"]
