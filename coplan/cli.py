"""The ``coplan`` command: one verb per move of the loop, each implemented in its part.

Verbs: plan, report, train, calibrate, diff, simulate, validate, schema. Each part registers its own verb
through ``register_<verb>(subparsers, help)`` in its ``cli`` module; those modules import no torch, so
that ``coplan --help`` runs on the light install.

Bad input raises :class:`~coplan.errors.CoplanError`, printed as one message without a traceback. A
missing optional dependency (torch for ``coplan train``) names the extra to install; any other
failure, an import error included, is reported as the internal error it is.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys

from coplan import __version__
from coplan.errors import CoplanError

# verb -> (module holding ``register_<verb>``, one-line help)
VERBS: dict[str, tuple[str, str]] = {
    "plan": ("coplan.planner.cli", "choose the parallel plan of a workload on a topology (CP-SAT) -> plan.json"),
    "report": ("coplan.reports.cli", "write a self-contained Plotly HTML report of a plan (and runs, calibrations)"),
    "train": ("coplan.trainer.cli", "run a plan on GPUs (or CPU/gloo) with torchrun; metrics, MFU, traces, checkpoints"),
    "calibrate": ("coplan.calibration.cli", "fit the cost model to the traces of runs -> calibration.json"),
    "diff": ("coplan.planner.diff", "what differs between two plans and what each difference costs (step time, memory)"),
    "simulate": ("coplan.planner.cli", "sweep GPU count or one knob and print predicted step time, MFU, memory"),
    "sample-workload": ("coplan.sample_cli", "draw a GEM-shaped workload of a family (one H200, a node, a cluster) from a seed"),
    "validate": ("coplan.spec_cli", "check topology, workload, plan, calibration or run files (or preset names)"),
    "schema": ("coplan.spec_cli", "print the JSON Schema of a spec"),
}

EXTRAS: dict[str, str] = {"torch": "train", "torchrec": "train", "fbgemm_gpu": "train", "triton": "train", "pyarrow": "train"}
"""Optional dependencies (top-level module -> the extra that installs it)."""


def missing_extra(e: BaseException) -> str | None:
    """The message for a missing optional dependency, or None when ``e`` is not one."""
    if not isinstance(e, ModuleNotFoundError):
        return None
    module = (e.name or "").split(".")[0]
    extra = EXTRAS.get(module)
    if extra is None:
        return None
    return f"this needs the '{extra}' extra, which is not installed (no module '{module}'): pip install 'coplan[{extra}]'"


def _requested_verb(argv: list[str] | None) -> str | None:
    """The verb a command line runs (its first word that is not an option), if it is one."""
    words = [a for a in (sys.argv[1:] if argv is None else argv) if not a.startswith("-")]
    return words[0] if words and words[0] in VERBS else None


def build_parser(argv: list[str] | None = None, *, every_verb: bool = True) -> argparse.ArgumentParser:
    """The parser. With ``every_verb=False`` only the verb ``argv`` runs is imported (the others get a
    placeholder): ``coplan train`` needs neither OR-Tools nor Plotly, ``coplan plan`` no torch."""
    wanted = None if every_verb else _requested_verb(argv)
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
    for verb, (module, help_text) in VERBS.items():
        if wanted is not None and verb != wanted:
            sub.add_parser(verb, help=help_text)
            continue
        register = getattr(importlib.import_module(module), f"register_{verb.replace('-', '_')}")
        register(sub, help_text)
    return parser


TRAIN_STRINGS = {"plan": ("plan", "path", None), "runs_root": ("--runs-root", "path", "runs/"),
                 "resume": ("--resume", "path", None), "data": ("--data", "path", None), "trace": ("--trace", "value", None)}
"""``coplan train``'s plain string arguments, checked for blanks after parsing rather than by a ``type=`` where
``trainer/cli.py`` registers them: any edit of ``trainer/`` changes the trainer's fingerprint and so stales the
shipped calibrations (:mod:`coplan.calibration.fingerprint`), for no change to what a step runs."""


def _blank_train_argument(args: argparse.Namespace) -> str | None:
    """The usage error of a blank ``coplan train`` string argument (as the ``nonempty`` types of the other verbs
    word it) or of a ``--trace`` that is no profile window, or None."""
    if args.verb != "train":
        return None
    for dest, (flag, what, default) in TRAIN_STRINGS.items():
        value = getattr(args, dest, None)
        for v in value if isinstance(value, list) else [value]:
            if isinstance(v, str) and not v.strip():
                tail = f", or leave the option out for its default ({default})" if default else ""
                return f"argument {flag}: the {what} is empty; give one{tail}"
    if args.trace is not None:  # (the trainer checks it again with the other options, wording the value twice)
        from coplan.cli_args import trace_window

        try:
            trace_window(args.trace)
        except argparse.ArgumentTypeError as e:
            return f"argument --trace: {e}"
    return None


def main(argv: list[str] | None = None) -> int:
    verb = "coplan"
    given = sys.argv[1:] if argv is None else argv
    for i, a in enumerate(given):
        if isinstance(a, str) and "\x00" in a:
            # (no file name or value can hold one: the OS refuses it wherever it is used)
            print(f"error: argument {i + 1} ({a.replace(chr(0), '<NUL>')!r}) contains a NUL byte; no file name or option "
                  "value can hold one: remove it", file=sys.stderr)
            return 2
    try:
        try:
            parser = build_parser(argv, every_verb=False)
            args = parser.parse_args(argv)
        except SystemExit as e:  # a usage error (argparse printed it) is an exit code like any other; --help still exits
            if e.code == 2:
                return 2
            raise
        verb = f"coplan {args.verb}"
        refused = _blank_train_argument(args)
        if refused:
            print(f"{verb}: error: {refused}", file=sys.stderr)
            return 2
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
        hint = missing_extra(e)
        if hint:
            print(f"error: {verb}: {hint}", file=sys.stderr)
            return 2
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
