"""Calibrations that ship with coplan (package data in ``calibration/data/``), fitted on the trainer's own runs.

``coplan plan`` and ``coplan simulate`` use the one whose device is the topology's GPU unless told otherwise
(``--calibration none`` turns it off, ``--calibration FILE`` uses another). Each file says where it came from:
its ``notes``, ``source_runs``, ``created_utc``, ``versions`` (with the commit the runs ran at) and ``fit_error``.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from coplan.calibration.fingerprint import stale
from coplan.spec import Calibration, Topology, load_calibration
from coplan.spec.calibration import stale_mark

AUTO = "auto"
NONE = "none"

FAMILIES: dict[str, tuple[str, ...]] = {
    "Hopper": ("H100", "H200", "H800", "H20", "GH200"),
    "Blackwell": ("B100", "B200", "GB200", "B300", "GB300"),
}
"""GPU architectures: a GPU with no calibration of its own borrows one fitted on a GPU of its architecture.

Why: on the lent H100 (2026-12-05, ``benchmarks/results/fresh_draws_h100.json``, sampler draws planned for
``h100-1gpu``), the uncalibrated prediction was 31-80% too fast (median 51%): it leaves the host out, and
these one-GPU steps are partly host-bound. The H200's calibration, forced onto the same plans, was within
5% on two of four draws and 25% and 59% too fast on the others (median 15%). What it carries is mostly the
host's launch costs (the host's, not the GPU's) and efficiencies as fractions of the topology's peaks, which
the GPUs of one architecture share. Its collective efficiencies are dropped: they belong to a network."""


def shipped() -> dict[str, Path]:
    """Device name -> path of every shipped calibration."""
    folder = resources.files("coplan.calibration") / "data"
    out: dict[str, Path] = {}
    for f in sorted(folder.iterdir(), key=lambda p: p.name):
        if f.name.endswith(".json"):
            path = Path(str(f))
            out[load_calibration(path).device] = path
    return out


def family(gpu_name: str) -> str | None:
    """The architecture of a GPU named ``gpu_name`` (:data:`FAMILIES`), or None. The longest model name that
    the GPU's name contains as a word decides (GH200 before H200)."""
    words = gpu_name.upper().replace("-", " ").split()
    best: tuple[int, str] | None = None
    for fam, models in FAMILIES.items():
        for m in models:
            if m in words and (best is None or len(m) > best[0]):
                best = (len(m), fam)
    return best[1] if best else None


def borrowed(topology: Topology) -> tuple[Calibration, str] | None:
    """A shipped calibration of another GPU of the topology's GPU's architecture, made this GPU's (its device
    renamed, its collective efficiencies dropped, its notes saying so), with the line that says it; or None."""
    gpu = topology.gpu.name
    fam = family(gpu)
    if fam is None:
        return None
    for device, path in shipped().items():
        if family(device) == fam:
            cal = load_calibration(path)
            note = (f"[borrowed: fitted on '{cal.device}' ({fam}), used for '{gpu}', which has no calibration of its "
                    "own; its collective efficiencies dropped]")
            copy = cal.model_copy(update={"device": gpu, "collective_efficiency": {},
                                          "notes": (cal.notes + " " if cal.notes else "") + note})
            line = (f"calibration: borrowed for {gpu} from {path.name}, shipped for {cal.device} (same {fam} architecture; "
                    f"{gpu} itself is uncalibrated: fit one with coplan calibrate) ({provenance(cal)})")
            return copy, line
    return None


def provenance(cal: Calibration) -> str:
    """Where a calibration came from, in one parenthesis-free phrase: its date, commit, runs, fit error, host cost."""
    commit = cal.versions.get("coplan_git_commit", "")
    err = cal.fit_error.median_abs_rel_error if cal.fit_error is not None else None
    parts = [f"fitted {cal.created_utc[:10] or 'at an unknown date'}"]
    if commit:
        parts.append(f"runs at commit {commit[:7]}")
    if cal.source_runs:
        parts.append(f"{len(cal.source_runs)} run(s)")
    if err is not None:
        parts.append(f"per-op fit error median {err:.1%}")
    if cal.host_launch_s:
        parts.append(f"host {cal.host_launch_s * 1e6:.0f} us per priced launch")
    if cal.host_launch_graphed_s:
        parts.append(f"{cal.host_launch_graphed_s * 1e6:.0f} us under CUDA graphs")
    return ", ".join(parts)


def describe(cal: Calibration, origin: str) -> str:
    return f"calibration: {origin} for {cal.device} ({provenance(cal)})"


def judged(cal: Calibration, line: str) -> tuple[Calibration, str]:
    """The calibration and its line, each saying so where its runs ran another trainer than the one installed
    (:func:`coplan.calibration.fingerprint.stale`): the calibration's notes get a ``[stale: ...]`` mark, which
    the plan carries, and the line a second line, a warning, which ``coplan plan`` prints."""
    why = stale(cal)
    if why is None:
        return cal, line
    if stale_mark(cal.notes) != why:
        cal = cal.model_copy(update={"notes": (cal.notes + " " if cal.notes else "") + f"[{why}]"})
    return cal, f"{line}\nwarning: the calibration is {why}"


def choose(arg: str | None, topology: Topology) -> tuple[Calibration | None, str]:
    """``--calibration``'s value (None or ``auto``: the shipped one for this GPU, else one borrowed from a GPU of
    its architecture (:func:`borrowed`); ``none``: none; else a file)
    -> (calibration, what was chosen, in one line, and a warning line where its runs ran another trainer
    (:func:`judged`))."""
    if arg is not None and arg.lower() == NONE:
        return None, "calibration: none (--calibration none): default efficiencies, host time not priced"
    if arg is None or arg.lower() == AUTO:
        path = shipped().get(topology.gpu.name)
        if path is None:
            other = borrowed(topology)
            if other is not None:
                return judged(*other)
            return None, (f"calibration: none shipped for {topology.gpu.name} or its architecture: default efficiencies "
                          "and host time not priced (uncalibrated; fit one with coplan calibrate)")
        cal = load_calibration(path)
        return judged(cal, describe(cal, f"shipped ({path.name})"))
    cal = load_calibration(arg)
    return judged(cal, describe(cal, arg))


__all__ = ["AUTO", "FAMILIES", "NONE", "borrowed", "choose", "describe", "family", "judged", "provenance", "shipped"]
