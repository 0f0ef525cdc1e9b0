"""``coplan sample-workload``: draw a GEM-shaped workload of a family from a seed (see :mod:`coplan.sample`)."""

from __future__ import annotations

import argparse
import json
import sys
from datetime import datetime, timezone
from pathlib import Path

import yaml

from coplan.errors import CoplanError
from coplan.sample import FAMILIES, family_world, sample_workload


def _seed(text: str) -> int:
    """A seed from the command line: a whole number, or ``now`` (the UTC date and time, YYYYMMDDHHMMSS)."""
    if text == "now":
        return int(datetime.now(timezone.utc).strftime("%Y%m%d%H%M%S"))
    try:
        v = int(text, 10)
    except ValueError:
        raise CoplanError(f"--seed {text!r}: give a whole number in [0, 2**63), or 'now'") from None
    if not 0 <= v < 2**63:
        raise CoplanError(f"--seed {text!r}: give a whole number in [0, 2**63), or 'now'")
    return v


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
    seed = _seed(args.seed)
    out = Path(args.output) if args.output else None
    if out is not None and out.is_dir():
        raise CoplanError(f"-o {out}: is a folder; give a file name such as draw.yaml")
    w = sample_workload(args.family, seed)
    text = yaml.safe_dump(w.model_dump(mode="json", exclude_none=True), sort_keys=False)
    f = FAMILIES[args.family]
    header = (f"# coplan sample-workload --family {args.family} --seed {seed}\n"
              f"# plan it: coplan plan -t {f.topology} --gpus {family_world(args.family, seed)} -w <this file>\n")
    if out is None:
        sys.stdout.write(header + text)
    else:
        out.write_text(header + text)
        print(f"seed {seed}: wrote {out} ({args.family}; plan on {f.topology}, {family_world(args.family, seed)} GPU(s))",
              file=sys.stderr)
    return 0


def register_sample_workload(sub: argparse._SubParsersAction, help_text: str) -> None:
    p = sub.add_parser("sample-workload", help=help_text, description=help_text + ".")
    p.add_argument("--family", choices=list(FAMILIES), help="which family of workloads to draw from")
    p.add_argument("--seed", default="now", help="whole number, or 'now' (default): the UTC date and time, printed")
    p.add_argument("-o", "--output", help="write the workload YAML here (default: standard output)")
    p.add_argument("--list", action="store_true", help="list the families and their ranges")
    p.add_argument("--json", action="store_true", help="with --list: machine-readable")
    p.set_defaults(func=run_sample)


__all__ = ["register_sample_workload", "run_sample"]
