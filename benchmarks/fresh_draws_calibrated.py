"""Held-out accuracy of the shipped calibration on fresh draws (issue 23): every draw of
``benchmarks/results/fresh_draws_h200.json`` that ran on the H200 is planned again with ``coplan plan`` at its
defaults (the shipped calibration for the topology's GPU) and with ``--calibration none``; where a plan makes the
same choices as the plan that ran, its predicted step is compared with the measured one (p50; each of the two is
counted over the draws where it does). No refit. A draw whose run the calibration was fitted on (its
``source_runs``) is in sample: its error is reported apart (``*_in_sample``), never in the held-out figures.

Runs on any machine (no GPU): the measurements are the H200's, recorded in the input JSON::

    python benchmarks/fresh_draws_calibrated.py

Writes ``benchmarks/results/fresh_draws_calibrated.json``. Draws planned for another topology (the input's
``topology``, e.g. ``h100-1gpu``) are planned again for it::

    python benchmarks/fresh_draws_calibrated.py --measured benchmarks/results/fresh_draws_h100.json \
        --plans benchmarks/results/fresh_plans_h100 --out benchmarks/results/fresh_draws_h100_calibrated.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import as_ran, plans_of, same_choices, write_result  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def plan(workload: Path, out: Path, calibration: str, topology: str = "h200-1gpu") -> dict:
    subprocess.run([sys.executable, "-m", "coplan.cli", "plan", "-t", topology, "-w", str(workload), "-o", str(out),
                    "--quiet", "--calibration", calibration], check=True, capture_output=True, text=True)
    return json.loads(out.read_text())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--measured", type=Path, default=RESULTS / "fresh_draws_h200.json")
    ap.add_argument("--plans", type=Path, default=None,
                    help="the draws' plan set (default: the one the --measured result ran)")
    ap.add_argument("--out", type=Path, default=RESULTS / "fresh_draws_calibrated.json")
    ap.add_argument("--calibration", default="auto",
                    help="the calibration to test: 'auto' (default: the one shipped for the topology's GPU) or a file")
    a = ap.parse_args()
    if a.plans is None:
        a.plans = plans_of(a.measured, RESULTS / "fresh_plans")
    measured = json.loads(a.measured.read_text())
    topology = measured.get("topology", "h200-1gpu")  # (what the draws were planned for)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in measured["rows"]:
            if "measured_step_p50_s" not in r:
                continue
            ran = json.loads((a.plans / r["plan"]).read_text())
            wl = as_ran(a.plans / r["workload"], r, Path(tmp))
            cal = plan(wl, Path(tmp) / "auto.json", a.calibration, topology)
            unc = plan(wl, Path(tmp) / "none.json", "none", topology)
            same_cal = same_choices(cal, ran)
            same_unc = same_choices(unc, ran)
            same = same_cal and same_unc
            m = r["measured_step_p50_s"]
            # a draw whose run the calibration was fitted on is in sample: counted apart, never as held out
            fitted = f"draw-{r['seed']}" in {Path(x).name for x in (cal.get("calibration") or {}).get("source_runs", ())}
            rows.append({"seed": r["seed"], "measured_step_p50_s": m, "same_choices_as_the_run": same,
                         "in_calibration_fit": fitted,
                         "calibrated_plan_is_the_run": same_cal, "uncalibrated_plan_is_the_run": same_unc,
                         "calibrated_step_s": cal["predicted"]["step_time_s"],
                         "uncalibrated_step_s": unc["predicted"]["step_time_s"],
                         "calibrated_error": cal["predicted"]["step_time_s"] / m - 1,
                         "uncalibrated_error": unc["predicted"]["step_time_s"] / m - 1,
                         "calibration": (cal.get("calibration") or {}).get("notes", "")[:160]})
            print(f"seed {r['seed']}: measured {m * 1e3:.1f} ms, calibrated {rows[-1]['calibrated_step_s'] * 1e3:.1f} ms "
                  f"({rows[-1]['calibrated_error']:+.0%}), uncalibrated {rows[-1]['uncalibrated_step_s'] * 1e3:.1f} ms "
                  f"({rows[-1]['uncalibrated_error']:+.0%})"
                  f"{' (in the calibration fit: in sample)' if fitted else ''}"
                  f"{'' if same_cal else ' (the calibrated plan differs from the run: not counted)'}"
                  f"{'' if same_unc else ' (the uncalibrated plan differs from the run: not counted)'}", flush=True)
    ce = [abs(x["calibrated_error"]) for x in rows if x["calibrated_plan_is_the_run"] and not x["in_calibration_fit"]]
    ie = [abs(x["calibrated_error"]) for x in rows if x["calibrated_plan_is_the_run"] and x["in_calibration_fit"]]
    ue = [abs(x["uncalibrated_error"]) for x in rows if x["uncalibrated_plan_is_the_run"]]
    write_result(a.out, "held-out step-time error of the shipped calibration on fresh draws (no refit)",
                 f"CPU, from {measured['device']} measurements",
                 {"draws_measured": len(rows), "draws_compared": len(ce), "draws_compared_uncalibrated": len(ue),
                  "draws_in_calibration_fit": sum(x["in_calibration_fit"] for x in rows),
                  "median_abs_error_calibrated": statistics.median(ce) if ce else None,
                  "max_abs_error_calibrated": max(ce) if ce else None,
                  "median_abs_error_in_sample": statistics.median(ie) if ie else None,
                  "max_abs_error_in_sample": max(ie) if ie else None,
                  "median_abs_error_uncalibrated": statistics.median(ue) if ue else None,
                  "max_abs_error_uncalibrated": max(ue) if ue else None},
                 rows, measured_git_commit=measured["git_commit"], seed=measured["seed"], topology=topology)
    return 0


if __name__ == "__main__":
    sys.exit(main())
