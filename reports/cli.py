"""``coplan report``: write one self-contained HTML report of a plan (and optionally a run and a calibration).

The verb is the CLI layer of reports: it hands the planner's ``simulate_point`` to the report for the
scaling curve, and calibration's ``trace_class_times`` and ``calibration_points`` for the run and
calibration figures, so that nothing else under ``reports/`` imports the planner or calibration."""

from __future__ import annotations

import argparse
import json

from coplan.calibration.attribution import trace_class_times
from coplan.calibration.points import calibration_points
from coplan.cli_args import check_output, nonempty, nonempty_path
from coplan.errors import CoplanError
from coplan.planner.simulate import simulate_point


def run_report(args: argparse.Namespace) -> int:
    # Here, not at the top: every `coplan` command imports each verb's module to build its parser, and
    # the report's modules bring in plotly.
    from coplan.reports.build import write_report

    if args.simulate and args.no_scaling:
        raise CoplanError("--simulate and --no-scaling contradict each other: give one")
    check_output(args.output, "-o", (args.plan, args.run, args.calibration, args.simulate))
    out, report, log = write_report(
        args.plan, args.output, run=args.run, calibration=args.calibration, sweep_path=args.simulate,
        simulate_point=simulate_point, trace_class_times=trace_class_times, calibration_points=calibration_points,
        scaling=not args.no_scaling, what_if=not args.no_what_if,
    )
    size = out.stat().st_size
    drawn = [s.key for s in report.sections if s.figure is not None]
    missing = {s.key: s.note for s in report.sections if s.figure is None}
    if args.json:
        print(json.dumps({"output": str(out), "bytes": size, "figures": drawn, "not_drawn": missing,
                          "summary": list(report.summary), "build_s": log.seconds}, indent=1))
        return 0
    print(f"wrote {out} ({size / 1e6:.1f} MB, {len(drawn)} figures; opens offline)")
    for p in report.summary:
        print(f"  {p}")
    for k, note in missing.items():
        print(f"  [{k}] {note}")
    return 0


def register_report(sub: argparse._SubParsersAction, help_text: str) -> None:
    p = sub.add_parser(
        "report", help=help_text, description=help_text + ". The page embeds plotly.js once and needs no network.",
        epilog="example: coplan report plan.json --run runs/gem-tiny-1r-20260101T000000 --calibration calibration.json -o report.html",
    )
    p.add_argument("plan", type=nonempty_path, help="plan.json written by `coplan plan`")
    p.add_argument("--run", type=nonempty_path, metavar="RUN_DIR", help="a run directory (runs/<id>/) to compare with the prediction")
    p.add_argument("--calibration", type=nonempty_path, metavar="FILE", help="calibration.json to show predicted vs measured per op")
    p.add_argument("--simulate", type=nonempty_path, metavar="FILE", help="`coplan simulate --json` output to draw the scaling curve from "
                   "(default: sweep the plan's workload on its topology now)")
    p.add_argument("--no-scaling", action="store_true", help="leave out the scaling curve (it prices one plan per GPU count)")
    p.add_argument("--no-what-if", action="store_true", help="do not re-price the plan to quote what fixing the biggest loss would give")
    p.add_argument("-o", "--output", default="report.html", type=nonempty("path", "report.html"),
                   help="HTML file to write (default: report.html)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run_report)


__all__ = ["register_report", "run_report"]
