"""The ``coplan`` command: one verb per move of the loop, each implemented in its part.

Verbs: plan, report, train, calibrate, diff, simulate, validate, schema. Each part registers its own verb
through ``register(subparsers)`` in its ``cli`` module, imported lazily so that ``coplan --help``
needs no torch. A verb whose part is not built yet says so and exits non-zero.

Bad input raises :class:`~coplan.errors.CoplanError`, printed as one message without a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from typing import Callable

from coplan import __version__
from coplan.errors import CoplanError, NotLandedError

# verb -> (module holding ``register_<verb>``, one-line help, issue that builds it)
VERBS: dict[str, tuple[str, str, str]] = {
    "plan": ("coplan.planner.cli", "choose the parallel plan of a workload on a topology (CP-SAT) -> plan.json", "#4 planner"),
    "report": ("coplan.reports.cli", "write a self-contained Plotly HTML report of a plan (and runs, calibrations)", "#7 reports"),
    "train": ("coplan.trainer.cli", "run a plan on GPUs (or CPU/gloo) with torchrun; metrics, MFU, traces, checkpoints", "#6 trainer"),
    "calibrate": ("coplan.calibration.cli", "fit the cost model to the traces of runs -> calibration.json", "#8 calibration"),
    "diff": ("coplan.planner.diff", "what differs between two plans and what each difference costs (step time, memory)", "#20 planner"),
    "simulate": ("coplan.planner.simulate", "sweep GPU count or one knob and print predicted step time, MFU, memory", "#3 cost model"),
    "validate": ("coplan.spec_cli", "check topology, workload, plan, calibration or run files (or preset names)", "#2 foundation"),
    "schema": ("coplan.spec_cli", "print the JSON Schema of a spec", "#2 foundation"),
}


def _not_landed(verb: str, issue: str) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        raise NotLandedError(
            f"coplan {verb}: this part of coplan is not built yet (issue {issue}); nothing was done."
        )

    return run


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="coplan",
        description=(
            "Co-design the parallel plan of a giant recommendation-model training job: plan it, "
            "report it, train it on GPUs, calibrate the cost model from what was measured."
        ),
        epilog="Topologies and workloads are given as preset names (e.g. h200-superpod-4k, gem-1t) or paths.",
    )
    parser.add_argument("--version", action="version", version=f"coplan {__version__}")
    sub = parser.add_subparsers(dest="verb", metavar="VERB")
    sub.required = True
    for verb, (module, help_text, issue) in VERBS.items():
        try:
            mod = importlib.import_module(module)
            register = getattr(mod, f"register_{verb}")
        except (ImportError, AttributeError):
            p = sub.add_parser(verb, help=f"{help_text} [not built yet: issue {issue}]", description=help_text)
            p.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
            p.set_defaults(func=_not_landed(verb, issue))
            continue
        register(sub, help_text)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except CoplanError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
    except OSError as e:  # the file system said no (missing folder, permissions, disk full): not a bug
        print(f"error: {e.strerror or e}: {e.filename or ''}".rstrip(": "), file=sys.stderr)
        return 2
    except Exception as e:  # a bug in coplan, not in the input: say so plainly
        if os.environ.get("COPLAN_DEBUG"):
            raise
        print(
            f"internal error (a bug in coplan, not in your input): {type(e).__name__}: {e}\n"
            "Set COPLAN_DEBUG=1 to see the traceback, and please report it.",
            file=sys.stderr,
        )
        return 1


def print_json(obj: object) -> None:
    print(json.dumps(obj, indent=1, default=str))


if __name__ == "__main__":
    sys.exit(main())
