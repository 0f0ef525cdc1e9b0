"""Calibrations that ship with coplan (package data in ``calibration/data/``), fitted on the trainer's own runs.

``coplan plan`` and ``coplan simulate`` use the one whose device is the topology's GPU unless told otherwise
(``--calibration none`` turns it off, ``--calibration FILE`` uses another). Each file says where it came from:
its ``notes``, ``source_runs``, ``created_utc``, ``versions`` (with the commit the runs ran at) and ``fit_error``.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from coplan.spec import Calibration, Topology, load_calibration

AUTO = "auto"
NONE = "none"


def shipped() -> dict[str, Path]:
    """Device name -> path of every shipped calibration."""
    folder = resources.files("coplan.calibration") / "data"
    out: dict[str, Path] = {}
    for f in sorted(folder.iterdir(), key=lambda p: p.name):
        if f.name.endswith(".json"):
            path = Path(str(f))
            out[load_calibration(path).device] = path
    return out


def describe(cal: Calibration, origin: str) -> str:
    commit = cal.versions.get("coplan_git_commit", "")
    err = cal.fit_error.median_abs_rel_error if cal.fit_error is not None else None
    parts = [f"calibration: {origin} for {cal.device}", f"fitted {cal.created_utc[:10] or 'at an unknown date'}"]
    if commit:
        parts.append(f"runs at commit {commit[:7]}")
    if cal.source_runs:
        parts.append(f"{len(cal.source_runs)} run(s)")
    if err is not None:
        parts.append(f"per-op fit error median {err:.1%}")
    if cal.host_launch_s:
        parts.append(f"host {cal.host_launch_s * 1e6:.0f} us per priced launch")
    return parts[0] + " (" + ", ".join(parts[1:]) + ")"


def choose(arg: str | None, topology: Topology) -> tuple[Calibration | None, str]:
    """``--calibration``'s value (None or ``auto``: the shipped one for this GPU; ``none``: none; else a file)
    -> (calibration, what was chosen, in one line)."""
    if arg is not None and arg.lower() == NONE:
        return None, "calibration: none (--calibration none): default efficiencies, host time not priced"
    if arg is None or arg.lower() == AUTO:
        path = shipped().get(topology.gpu.name)
        if path is None:
            return None, (f"calibration: none shipped for {topology.gpu.name}: default efficiencies and host time not "
                          "priced (uncalibrated; fit one with coplan calibrate)")
        cal = load_calibration(path)
        return cal, describe(cal, f"shipped ({path.name})")
    cal = load_calibration(arg)
    return cal, describe(cal, arg)


__all__ = ["AUTO", "NONE", "choose", "describe", "shipped"]
