"""Writes ``BENCHMARKS.md``, the one page of current benchmark figures, from ``benchmarks/results/``.

Each row is a :class:`figures.Figure`: its value read from the benchmark's current result, its goal,
where and when it was measured, at which commit, and the command that measures it again. A figure is
**stale** when the result records no commit, or when any source path it depends on differs in content
between that commit and the working tree. Renames are detected (``git diff -M``), so a file moved
unchanged to another folder does not by itself make a figure stale. The page holds nothing that changes
with time alone, so ``--check`` can compare it in CI.

    python benchmarks/make_page.py            # rewrite BENCHMARKS.md
    python benchmarks/make_page.py --check    # exit 1 when BENCHMARKS.md is not what the results give

The round-by-round history of the benchmarks is in ``docs/benchmarks-log/``.
"""

from __future__ import annotations

import argparse
import functools
import json
import subprocess
import sys
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import figures  # noqa: E402  (the scripts run by path)
from figures import SECTIONS, Figure, Result  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = "benchmarks/results"
PAGE = "BENCHMARKS.md"
_UNKNOWN_COMMITS = ("", "unknown", "none")


def _git(root: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=True).stdout


@functools.lru_cache(maxsize=None)
def resolve_commit(root: Path, commit: str) -> str | None:
    """The full hash of ``commit`` in ``root``'s history, or None when it is not there."""
    try:
        return _git(root, "rev-parse", "--verify", "--quiet", f"{commit}^{{commit}}").strip() or None
    except subprocess.CalledProcessError:
        return None


@functools.lru_cache(maxsize=None)
def _tree_changes(root: Path, commit: str) -> tuple[tuple[str, ...], ...]:
    """Files changed between ``commit`` and the working tree: (status, path, ...), renames with both paths."""
    fields = _git(root, "diff", "-M", "--name-status", "-z", commit).split("\0")
    out, i = [], 0
    while i < len(fields) and fields[i]:
        status = fields[i]
        n = 2 if status[0] in "RC" else 1
        out.append((status, *fields[i + 1:i + 1 + n]))
        i += 1 + n
    return tuple(out)


def _under(path: str, dep: str) -> bool:
    return path.startswith(dep) if dep.endswith("/") else path == dep


def changed_dependencies(root: Path, commit: str, depends: tuple[str, ...]) -> dict[str, list[str]]:
    """Per entry of ``depends``, its files whose content differs between ``commit`` and the working tree
    (a pure rename, similarity 100, is not a change); entries with no change are left out."""
    changed: dict[str, set[str]] = {}
    for status, *paths in _tree_changes(root, commit):
        if status == "R100":
            continue
        for dep in depends:
            if any(_under(p, dep) for p in paths):
                changed.setdefault(dep, set()).add(paths[-1])
    return {dep: sorted(files) for dep, files in changed.items()}


# --- reading a result's metadata --------------------------------------------------------------------

def recorded_commit(d: dict, key: str = "git_commit") -> str | None:
    host = d.get("host") if isinstance(d.get("host"), dict) else {}
    for c in (d.get(key), host.get(key)):
        if isinstance(c, str) and c.strip().split(" ")[0].lower() not in _UNKNOWN_COMMITS:
            return c.strip()
    return None


def recorded_date(d: dict) -> str:
    for key in ("date", "date_utc", "created_utc"):
        if isinstance(d.get(key), str):
            t = datetime.fromisoformat(d[key])
            return t.strftime("%Y-%m-%d %H:%M UTC")
    return "not recorded"


def recorded_device(d: dict, result: Result) -> str:
    if result.device:
        return result.device
    versions = d.get("versions") if isinstance(d.get("versions"), dict) else {}
    for name in (d.get("device"), versions.get("device_name"), versions.get("device")):
        if isinstance(name, str) and name.lower() not in ("cuda", "cpu", ""):
            return name
    machine = d.get("machine") if isinstance(d.get("machine"), dict) else {}
    host = d.get("host") if isinstance(d.get("host"), dict) else {}
    cpus = machine.get("cpus") or machine.get("cpu_count") or host.get("cpus")
    return f"CPU, {cpus} cores" if cpus else "CPU"


# --- formatting --------------------------------------------------------------------------------------

def _num(v: float) -> str:
    return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}"


def fmt(v: float, unit: str) -> str:
    if unit == "%":
        return f"{v * 100:.2f}%" if abs(v) < 0.01 else f"{v * 100:.1f}%"
    if unit == "x":
        return f"{v:.2f}×"
    if unit == "ratio":
        return f"{v:.6f}"
    if unit == "TFLOP/s":
        return f"{v:.0f} TFLOP/s"
    if unit == "GiB":
        return f"{v:.2f} GiB"
    return f"{_num(v)} {unit}"


def fmt_goal(goal: figures.Goal, unit: str) -> str:
    sign = "≤" if goal.op == "<=" else "≥"
    if unit == "%":
        return f"{sign} {goal.value * 100:g}%"
    if unit == "x":
        return f"{sign} {goal.value:g}×"
    return f"{sign} {goal.value:g} {unit}"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


# --- the page ----------------------------------------------------------------------------------------

def staleness(root: Path, d: dict, result: Result) -> tuple[str | None, list[str]]:
    """The short commit a result records (None if none) and why its figures are stale (empty if current)."""
    commit = recorded_commit(d, result.commit_key)
    if commit is None:
        return None, []
    sha = resolve_commit(root, commit)
    if sha is None:
        return commit[:7], ["commit not in this repository's history"]
    changed = changed_dependencies(root, sha, result.all_depends)
    if not changed:
        return commit[:7], []
    parts = [f"`{dep}`" + (f" ({len(files)} files)" if dep.endswith("/") else "") for dep, files in changed.items()]
    return commit[:7], [", ".join(parts) + " changed since"]


def commit_cell(short: str | None, reasons: list[str]) -> str:
    if short is None:
        return "commit unknown — **stale**" + "".join(f"; {r}" for r in reasons)
    return f"`{short}`" + (f" — **stale**: {'; '.join(reasons)}" if reasons else ", current")


def rows(root: Path, results_dir: Path) -> list[dict]:
    """One dict per figure: its section, cells and the flags the summary counts."""
    loaded = {r.file: json.loads((results_dir / r.file).read_text()) for r in figures.RESULTS}
    out = []
    for f in figures.FIGURES:
        d = loaded[f.result.file]
        value = f.read(d)
        short, reasons = staleness(root, d, f.result)
        extra = f.stale_if(d) if f.stale_if else None
        reasons = reasons + [extra] if extra else reasons
        stale = short is None or bool(reasons)
        goal_cell, met = "—", None
        if f.goal is not None and value is not None:
            met = f.goal.met(value + (1e-12 if f.goal.op == ">=" else -1e-12))
            goal_cell = f"{fmt_goal(f.goal, f.unit)}: {'met' if met else '**not met**'}"
        elif f.goal is not None:
            goal_cell = f"{fmt_goal(f.goal, f.unit)}: no figure"
        out.append({
            "section": f.section, "figure": f, "stale": stale, "met": met,
            "cells": [f.name, fmt(value, f.unit) if value is not None else f.missing, goal_cell,
                      recorded_device(d, f.result), recorded_date(d), commit_cell(short, reasons),
                      f"`{f.result.command}` → [`{f.result.file}`]({RESULTS_DIR}/{f.result.file})"],
        })
    return out


HEADER = ("| Figure | Value | Goal | Measured on | Date | Commit | Command → result |\n"
          "|---|---:|---|---|---|---|---|")


def render(root: Path = ROOT, results_dir: Path | None = None) -> str:
    results_dir = results_dir or root / RESULTS_DIR
    all_rows = rows(root, results_dir)
    n_stale = sum(r["stale"] for r in all_rows)
    n_goal = sum(r["met"] is not None for r in all_rows)
    n_met = sum(bool(r["met"]) for r in all_rows)
    lines = [
        "# Benchmarks",
        "",
        "<!-- Generated by `python benchmarks/make_page.py` from benchmarks/results/; edit benchmarks/figures.py, "
        "not this file. -->",
        "",
        "The current figure of every benchmark, read from its newest result in `benchmarks/results/`. A figure is",
        "**stale** when the code it measures changed after it was measured, or when its result does not record the",
        "commit it was measured at; it stays stale until the command in its row is run again and this page is",
        "regenerated (`python benchmarks/make_page.py`). How each figure came about, round by round, is in",
        "[`docs/benchmarks-log/`](docs/benchmarks-log/README.md).",
        "",
        f"{len(all_rows)} figures: {len(all_rows) - n_stale} current, {n_stale} stale. Goals: {n_met} of {n_goal} met.",
    ]
    pending = {s: [p for p in figures.PENDING if p.section == s] for s in SECTIONS}
    for section in SECTIONS:
        in_section = [r for r in all_rows if r["section"] == section]
        if not in_section and not pending[section]:
            continue
        lines += ["", f"## {section}", "", HEADER]
        lines += ["| " + " | ".join(_cell(c) for c in r["cells"]) + " |" for r in in_section]
        lines += [f"| {_cell(p.name)} | not measured yet | {_cell(p.goal) or '—'} | — | — | — | "
                  f"`{_cell(p.command)}` → `{RESULTS_DIR}/{p.file}` |" for p in pending[section]]
        notes = [r["figure"] for r in in_section if r["figure"].note]
        if notes:
            lines.append("")
            lines += [f"- {f.name}: {f.note}." for f in notes]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="exit 1 when the page is not what the results give")
    p.add_argument("--out", type=Path, default=ROOT / PAGE)
    args = p.parse_args(argv)
    page = render()
    if args.check:
        if not args.out.is_file() or args.out.read_text() != page:
            print(f"{args.out} is out of date with benchmarks/results/ and the code: "
                  "run python benchmarks/make_page.py", file=sys.stderr)
            return 1
        print(f"{args.out} is current")
        return 0
    args.out.write_text(page)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
