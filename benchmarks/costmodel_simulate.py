"""What ``coplan simulate`` predicts for a workload over a topology family's GPU counts, kept as a result with its
commit, date and command (``coplan simulate --json`` prints the sweep and records none of them).

    python benchmarks/costmodel_simulate.py                      # gem-1t on h200-superpod, 8 to 16,384 GPUs

Writes ``benchmarks/results/costmodel_simulate_gem-1t.json``: the sweep's points as ``coplan simulate --json``
gives them (``points``), and the largest point's E2E MFU and step in the summary. ``coplan simulate`` prices
uncalibrated unless given ``--calibration`` (the shipped calibrations are ``coplan plan``'s default only).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import write_result  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", "-w", default="gem-1t")
    ap.add_argument("--topology", "-t", default="h200-superpod", help="a preset, file or family prefix (coplan simulate's -t)")
    ap.add_argument("--out", type=Path, default=None, help="default benchmarks/results/costmodel_simulate_<workload>.json")
    a = ap.parse_args()
    out = a.out or RESULTS / f"costmodel_simulate_{a.workload}.json"
    proc = subprocess.run([sys.executable, "-m", "coplan.cli", "simulate", "-w", a.workload, "-t", a.topology, "--json"],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"coplan simulate failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
    sweep = json.loads(proc.stdout)
    last = sweep["points"][-1]
    write_result(out, f"coplan simulate -w {a.workload} -t {a.topology}: predicted step and MFU over GPU counts", "prediction (CPU)",
                 {"gpus": last.get("gpus"), "e2e_mfu": last["e2e_mfu"], "local_mfu": last["local_mfu"],
                  "step_time_s": last["step_time_s"]},
                 [], workload=sweep.get("workload"), topology=sweep.get("topology"), knob=sweep.get("knob"), points=sweep["points"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
