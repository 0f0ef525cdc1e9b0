"""Command-line values, checked where argparse reads them: one place for every verb.

Each ``type=`` helper parses strictly (whole numbers are ASCII digits only, never ``1e3`` or ``4.0``;
floats are finite, never NaN or infinity) and raises :class:`argparse.ArgumentTypeError`, which argparse
prints as ``argument --flag: <message>`` with exit code 2: the flag, the value and the fix on one line. Every
plain string argument of every verb takes :func:`nonempty` (or a stricter helper), so that an empty or blank path
or value is refused the same way, naming its flag.

Output paths are checked before any work starts (:func:`check_output`): not a folder or any other file
that is not a regular one (a device such as ``/dev/null``, a FIFO, a socket, a link loop), in a folder
that exists and can be written, never one of the command's inputs. An output that is a symbolic link is
written through: the file it points to is replaced, the link kept. :func:`removed_on_failure` takes away
what a failed command wrote, so that no half-done output is left behind.
"""

from __future__ import annotations

import argparse
import math
import os
import re
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from coplan.errors import CoplanError
from coplan.spec.loader import not_a_file
from coplan.spec.topology import MAX_GPUS

MAX_SEED = 2**31 - 1
"""Largest seed (CP-SAT's seed is a 32-bit signed integer; the trainer's seeds stay in the same range)."""

MAX_DRAW_SEED = 2**63 - 1
"""Largest seed of ``coplan sample-workload`` (a numpy seed, not CP-SAT's): wider than :data:`MAX_SEED`, since its
default seed ``now`` is the UTC date and time as YYYYMMDDHHMMSS (about 2 x 10^13), and a printed seed must draw again."""

MAX_SECONDS = 1e6
"""Longest time limit a flag takes (about 11.6 days): far past any useful plan, well inside what the solver takes."""

MAX_STEPS = 10**9
"""Most training steps a flag takes."""

MAX_SAMPLES = 10**9
"""Most samples ``coplan train`` generates for a missing dataset."""

MAX_SWEEP_POINTS = 256
"""Most points one ``coplan simulate`` sweep prices (GPU counts, or values of the knob)."""

_WHOLE = re.compile(r"[+-]?[0-9]+")


def _fmt(x: float) -> str:
    return f"{x:,}" if isinstance(x, int) else f"{x:g}"


def _int_range_text(lo: int | None, hi: int | None) -> str:
    return ("" if lo is None and hi is None else f" from {_fmt(lo)} to {_fmt(hi)}" if lo is not None and hi is not None
            else f" of at least {_fmt(lo)}" if lo is not None else f" of at most {_fmt(hi)}")


def _int_or_why(text: str, lo: int | None, hi: int | None) -> int | str:
    """``text`` as a whole number in [lo, hi], or why it is not one ('is not a whole number', 'is out of range')."""
    s = str(text).strip()
    if not _WHOLE.fullmatch(s) or len(s) > 40:
        return "is not a whole number"
    v = int(s)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        return "is out of range"
    return v


def parse_int(text: str, lo: int | None = None, hi: int | None = None) -> int:
    """``text`` as a whole number in [lo, hi]; ArgumentTypeError naming the value and the range otherwise."""
    v = _int_or_why(text, lo, hi)
    if isinstance(v, str):
        raise argparse.ArgumentTypeError(f"{text!r} {v}; give a whole number{_int_range_text(lo, hi)}")
    return v


def parse_float(text: str, lo: float | None = None, hi: float | None = None, *, lo_open: bool = False,
                hi_open: bool = False) -> float:
    """``text`` as a finite float in the range (``lo_open``/``hi_open``: the bound itself excluded)."""
    s = str(text).strip()
    parts = []
    if lo is not None:
        parts.append(f"{'>' if lo_open else '>='} {_fmt(lo)}")
    if hi is not None:
        parts.append(f"{'<' if hi_open else '<='} {_fmt(hi)}")
    rng = f" {' and '.join(parts)}" if parts else ""
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number; give a finite number{rng}") from None
    if not math.isfinite(v):
        raise argparse.ArgumentTypeError(f"{text!r} is not finite; give a finite number{rng}")
    if lo is not None and (v < lo or (lo_open and v == lo)) or hi is not None and (v > hi or (hi_open and v == hi)):
        raise argparse.ArgumentTypeError(f"{text!r} is out of range; give a number{rng}")
    return v


def int_range(lo: int | None = None, hi: int | None = None, name: str = "whole number") -> Callable[[str], int]:
    """A ``type=`` for whole numbers in [lo, hi]."""
    def parse(text: str) -> int:
        return parse_int(text, lo, hi)
    parse.__name__ = name
    return parse


def float_range(lo: float | None = None, hi: float | None = None, *, lo_open: bool = False, hi_open: bool = False,
                name: str = "number") -> Callable[[str], float]:
    """A ``type=`` for finite floats in the range."""
    def parse(text: str) -> float:
        return parse_float(text, lo, hi, lo_open=lo_open, hi_open=hi_open)
    parse.__name__ = name
    return parse


positive_int = int_range(1, name="positive_int")
non_negative_int = int_range(0, name="non_negative_int")
gpu_count = int_range(1, MAX_GPUS, name="gpu_count")
"""A GPU (or process) count, at most :data:`coplan.spec.topology.MAX_GPUS`."""
seed = int_range(0, MAX_SEED, name="seed")
finite_float = float_range(name="finite_float")
positive_float = float_range(0.0, lo_open=True, name="positive_float")
seconds = float_range(0.0, MAX_SECONDS, lo_open=True, name="seconds")
"""A positive, finite time in seconds, at most :data:`MAX_SECONDS`."""
fraction = float_range(0.0, 1.0, hi_open=True, name="fraction")
"""A fraction in [0, 1)."""
steps_count = int_range(1, MAX_STEPS, name="steps_count")
sample_count = int_range(1, MAX_SAMPLES, name="sample_count")
checkpoint_every = int_range(-1, MAX_STEPS, name="checkpoint_every")
"""Steps between checkpoints (0: at the end only; -1: never)."""


def int_list(lo: int, hi: int, max_items: int = MAX_SWEEP_POINTS) -> Callable[[str], list[int]]:
    """A ``type=`` for a comma-separated list of whole numbers in [lo, hi], at most ``max_items`` of them. A bad item
    is named once, with its place in the list when there are several (``'0' (item 2 of 2) is out of range``)."""
    def parse(text: str) -> list[int]:
        items = split_list(text, max_items)
        out = []
        for i, x in enumerate(items, 1):
            v = _int_or_why(x, lo, hi)
            if isinstance(v, str):
                where = f" (item {i} of {len(items)})" if len(items) > 1 else ""
                raise argparse.ArgumentTypeError(f"{x!r}{where} {v}; give comma-separated integers{_int_range_text(lo, hi)}, "
                                                 "e.g. 8,16,32")
            out.append(v)
        return out
    parse.__name__ = "int_list"
    return parse


def split_list(text: str, max_items: int = MAX_SWEEP_POINTS) -> list[str]:
    """The items of a comma-separated list: at least one, at most ``max_items``."""
    items = [x.strip() for x in str(text).split(",")]
    if not items or any(not x for x in items):
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list (an item is empty); give e.g. 8,16,32")
    if len(items) > max_items:
        raise argparse.ArgumentTypeError(f"{len(items):,} items, over the limit of {max_items:,} per command; split the sweep")
    return items


def seed_or_now(text: str) -> int | str:
    """``coplan sample-workload``'s seed: a whole number from 0 to :data:`MAX_DRAW_SEED`, or ``now`` (resolved by the
    command)."""
    if str(text).strip() == "now":
        return "now"
    v = _int_or_why(text, 0, MAX_DRAW_SEED)
    if isinstance(v, str):
        raise argparse.ArgumentTypeError(f"{text!r} {v}; give a whole number{_int_range_text(0, MAX_DRAW_SEED)}, or 'now'")
    return v


def _refuse_blank(text: str, what: str = "value", default: str | None = None) -> None:
    if not str(text).strip():
        tail = f", or leave the option out for its default ({default})" if default else ""
        raise argparse.ArgumentTypeError(f"the {what} is empty; give one{tail}")


def nonempty(what: str = "value", default: str | None = None) -> Callable[[str], str]:
    """A ``type=`` for a plain string argument: an empty or blank one is refused as an empty ``what`` ('path' for a
    file, folder or preset, 'value' otherwise), saying that the option left out gives its ``default`` when it has one.
    An empty path would otherwise be read as the current folder, far from the flag that gave it ("'.': is a
    directory"). The value is kept as given (a path may start or end with a space)."""
    def parse(text: str) -> str:
        _refuse_blank(text, what, default)
        return text
    parse.__name__ = f"nonempty_{what}"
    return parse


nonempty_path = nonempty("path")
"""A ``type=`` for a file, folder or preset name without a default."""
nonempty_str = nonempty("value")
"""A ``type=`` for any other plain string without a default."""


def trace_window(text: str) -> str:
    """The trainer's ``--trace``: ``A:B`` (profile steps A..B-1, A < B), ``auto`` or ``none``."""
    _refuse_blank(text)
    s = str(text).strip()
    if s in ("auto", "none"):
        return s
    a, sep, b = s.partition(":")
    if sep and _WHOLE.fullmatch(a) and _WHOLE.fullmatch(b) and 0 <= int(a) < int(b) <= 10**9:
        return f"{int(a)}:{int(b)}"
    raise argparse.ArgumentTypeError(f"{text!r} is not a profile window; give 'A:B' (profile steps A..B-1, 0 <= A < B), "
                                     "'auto' or 'none'")


def host_port(text: str) -> str:
    """``HOST:PORT`` with a port from 1 to 65535."""
    _refuse_blank(text)
    host, sep, port = str(text).rpartition(":")
    if not sep or not host or not _WHOLE.fullmatch(port) or not 1 <= int(port) <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r}: give HOST:PORT with a port from 1 to 65535, e.g. node0:29500")
    return text


def name_part(text: str) -> str:
    """A name used as one folder of a path (a run id): no separators, not '.' or '..'."""
    _refuse_blank(text)
    s = str(text)
    if s in (".", "..") or any(c in s for c in "/\\\0") or len(s) > 200:
        raise argparse.ArgumentTypeError(f"{text!r}: give a plain name of at most 200 characters, without '/' (it names a folder)")
    return s


def _same(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve() or (a.exists() and b.exists() and os.path.samefile(a, b))
    except (OSError, RuntimeError):  # RuntimeError: a symbolic link loop (Python 3.11's resolve)
        return False


def check_output(path: str | Path, flag: str, inputs: Iterable[str | Path | None] = ()) -> Path:
    """``path`` as an output of ``flag``, refused before any work: a folder or another file that is not a
    regular one (a device, a FIFO, a socket, a link loop: never replaced), a folder that does not exist or
    cannot be written, or one of ``inputs`` (an input file, or a file already inside an input folder). A
    symbolic link is written through (see :func:`coplan.spec.write_text_atomic`): its target is checked."""
    out = Path(path)
    if str(path).strip() == "":
        raise CoplanError(f"{flag}: the output path is empty; give a file name")
    if out.is_dir():
        raise CoplanError(f"{flag} {out}: is a folder; give a file name inside it")
    why = not_a_file(out)
    if why:
        raise CoplanError(f"{flag} {out}: {why}: coplan writes only regular files and will not replace it; give a file name")
    folder = Path(os.path.realpath(out)).parent if out.is_symlink() else out.parent
    if not folder.is_dir():
        raise CoplanError(f"{flag} {out}: folder '{folder}' does not exist; create it first or write elsewhere")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise CoplanError(f"{flag} {out}: folder '{folder}' cannot be written; write elsewhere")
    if out.exists() and not os.access(out, os.W_OK):
        raise CoplanError(f"{flag} {out}: the file exists and cannot be written; write elsewhere")
    for given in inputs:
        if given is None or str(given) == "":
            continue
        inp = Path(given)
        # a file already in an input folder (a run directory) may be one the command reads
        if _same(out, inp) or (inp.is_dir() and out.exists() and out.resolve().is_relative_to(inp.resolve())):
            raise CoplanError(f"{flag} {out}: is the input '{given}'; an output never overwrites an input, so write elsewhere")
    return out


@contextmanager
def removed_on_failure(*paths: str | Path | None) -> Iterator[None]:
    """Remove each of ``paths`` that did not exist before, if the block fails."""
    new = [Path(p) for p in paths if p is not None and not os.path.lexists(p)]  # (a link to a missing file is kept)
    try:
        yield
    except BaseException:
        for p in new:
            try:
                if p.is_file() or p.is_symlink():
                    p.unlink()
            except OSError:
                pass
        raise


__all__ = ["MAX_DRAW_SEED", "MAX_SAMPLES", "MAX_SECONDS", "MAX_SEED", "MAX_STEPS", "MAX_SWEEP_POINTS", "check_output",
           "checkpoint_every", "finite_float", "float_range", "fraction", "sample_count", "steps_count",
           "gpu_count", "host_port", "int_list", "int_range", "name_part", "non_negative_int", "nonempty", "nonempty_path",
           "nonempty_str", "parse_float", "parse_int",
           "positive_float", "positive_int", "removed_on_failure", "seconds", "seed", "seed_or_now", "split_list",
           "trace_window"]
