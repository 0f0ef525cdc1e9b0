"""Write a calibration that ships with coplan (``calibration/data/<device>.json``) from `coplan train` runs.

It is `coplan calibrate` at its defaults on the runs (a folder of run directories or a ``draw_runs_*.tgz``
that `benchmarks/device/stage.sh draws` brought back), optionally on top of a base calibration, then named
for the topology's GPU (``--device``: the name `coplan plan` looks a shipped calibration up by, e.g.
"NVIDIA H100" where the runs recorded "NVIDIA H100 80GB HBM3"), with the run names as ``source_runs`` and
a note saying where it came from.

    python scripts/ship_calibration.py --runs benchmarks/results/draw_runs_h100c.tgz --device "NVIDIA H100" \\
        --base calibration/data/nvidia-h200.json --device-term gap --why "..." --out calibration/data/nvidia-h100.json
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from coplan.calibration.assemble import calibrate
from coplan.spec import load_calibration


def run_dirs(src: Path, into: Path) -> list[Path]:
    if src.is_file():
        with tarfile.open(src) as tar:
            tar.extractall(into, filter="data")
        src = into
    dirs = sorted({p.parent.parent for p in src.rglob("traces/rank0.json*")})
    if not dirs:
        sys.exit(f"{src}: no run directories with a rank-0 trace")
    return dirs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", required=True, type=Path, action="append", help="run folder or draw_runs_*.tgz (repeatable)")
    ap.add_argument("--device", required=True, help="the GPU name a topology gives (the shipped file is looked up by it)")
    ap.add_argument("--base", type=Path, help="a calibration to start from (its terms the runs do not identify stay)")
    ap.add_argument("--device-term", choices=("best", "factor", "gap"), default="factor",
                    help="how the device work no op prices is fitted (coplan calibrate --device-term; default: its default)")
    ap.add_argument("--why", default="", help="a sentence on the runs: which draws, which GPU, when, at which commit")
    ap.add_argument("--out", required=True, type=Path)
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        dirs = [d for i, src in enumerate(a.runs) for d in run_dirs(src, Path(tmp) / str(i))]
        base = load_calibration(a.base) if a.base else None
        cal, _, runs = calibrate(dirs, host=True, force=base is not None, base=base,
                                 base_name=a.base.name if a.base else "the base", device_term=a.device_term)
    recorded = sorted({r.device for r in runs})
    note = (f"shipped with coplan for {a.device}: `coplan calibrate` at its defaults"
            + (f" but --device-term {a.device_term}" if a.device_term != "factor" else "")
            + (f" on top of {a.base.name}" if a.base else "") + f" on {len(dirs)} `coplan train` run(s) at defaults "
            + f"(recorded device: {', '.join(recorded)}). {a.why} Written by scripts/ship_calibration.py. ")
    versions = dict(cal.versions)
    short = versions.get("coplan_git_commit", "")
    if 0 < len(short) < 40:  # (a run records the commit it was given; the file names it in full)
        full = subprocess.run(["git", "rev-parse", "--verify", "--quiet", short + "^{commit}"], capture_output=True, text=True)
        if full.returncode == 0:
            versions["coplan_git_commit"] = full.stdout.strip()
    cal = cal.model_copy(update={"device": a.device, "versions": versions, "source_runs": tuple(d.name for d in dirs), "notes": note + (cal.notes or "")})
    a.out.write_text(cal.model_dump_json(indent=1) + "\n")
    print(f"wrote {a.out}: {a.device}, {len(dirs)} runs, host {cal.host_launch_s}, graphed host {cal.host_launch_graphed_s}, "
          f"device step factor {cal.device_step_factor}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
