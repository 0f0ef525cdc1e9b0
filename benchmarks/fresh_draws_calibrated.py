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

``--runs`` (the set's run directories, ``draw_runs_<set>.tgz``) adds a diagnostic, never the headline: how fast each
run's host was against the host the calibration was fitted on (``coplan.calibration.host_profile.host_speed_index``
of the run's profiled steps against the calibration's ``host_op_median_us``: the median host time of calls every run
makes whatever its shapes), and the calibrated step with the priced host time scaled by it
(``max(step, host x speed)``). The lent machines' hosts are shared and their speed varies from run to run; a plan is
priced for a host as fast as the fitted runs', so this separates a host-bound draw's miss into the host's speed and
the model's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import as_ran, plans_of, same_choices, write_result  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def plan(workload: Path, out: Path, calibration: str, topology: str = "h200-1gpu") -> dict:
    subprocess.run([sys.executable, "-m", "coplan.cli", "plan", "-t", topology, "-w", str(workload), "-o", str(out),
                    "--quiet", "--calibration", calibration], check=True, capture_output=True, text=True)
    return json.loads(out.read_text())


def host_speeds(runs: Path, reference: dict[str, float], tmp: Path) -> dict[str, float]:
    """Per run directory of the ``runs`` archive (``draw-<seed>``), its host speed against ``reference``
    (op name -> median us; 1.5: 50% slower); runs without a readable trace are left out."""
    from coplan.calibration.host_profile import host_profile_file, host_speed_index
    from coplan.calibration.kineto import TraceError

    with tarfile.open(runs) as tf:
        tf.extractall(tmp, filter="data")
    out = {}
    for trace in sorted(tmp.glob("**/traces/rank0.json*")):
        try:
            k = host_speed_index(host_profile_file(trace), reference)
        except TraceError:
            continue
        if k is not None:
            out[trace.parent.parent.name] = k
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--measured", type=Path, default=RESULTS / "fresh_draws_h200.json")
    ap.add_argument("--plans", type=Path, default=None,
                    help="the draws' plan set (default: the one the --measured result ran)")
    ap.add_argument("--out", type=Path, default=RESULTS / "fresh_draws_calibrated.json")
    ap.add_argument("--calibration", default="auto",
                    help="the calibration to test: 'auto' (default: the one shipped for the topology's GPU) or a file")
    ap.add_argument("--runs", type=Path, default=None,
                    help="the set's run directories (draw_runs_<set>.tgz): adds each run's host speed against the "
                         "calibration's fitted runs and the step priced at it (a diagnostic)")
    a = ap.parse_args()
    if a.plans is None:
        a.plans = plans_of(a.measured, RESULTS / "fresh_plans")
    measured = json.loads(a.measured.read_text())
    topology = measured.get("topology", "h200-1gpu")  # (what the draws were planned for)
    rows = []
    speeds: dict[str, float] | None = None
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
            reference = (cal.get("calibration") or {}).get("host_op_median_us") or {}
            if a.runs is not None and reference:
                if speeds is None:
                    speeds = host_speeds(a.runs, reference, Path(tmp) / "runs")
                k = speeds.get(f"draw-{r['seed']}")
                if k is not None:
                    pred = cal["predicted"]
                    at_speed = max(pred["step_time_s"], pred.get("host_s", 0.0) * k)
                    rows[-1] |= {"host_speed_vs_calibration": k, "calibrated_step_at_run_host_speed_s": at_speed,
                                 "calibrated_error_at_run_host_speed": at_speed / m - 1}
            print(f"seed {r['seed']}: measured {m * 1e3:.1f} ms, calibrated {rows[-1]['calibrated_step_s'] * 1e3:.1f} ms "
                  f"({rows[-1]['calibrated_error']:+.0%}), uncalibrated {rows[-1]['uncalibrated_step_s'] * 1e3:.1f} ms "
                  f"({rows[-1]['uncalibrated_error']:+.0%})"
                  f"{' (in the calibration fit: in sample)' if fitted else ''}"
                  f"{'' if same_cal else ' (the calibrated plan differs from the run: not counted)'}"
                  f"{'' if same_unc else ' (the uncalibrated plan differs from the run: not counted)'}", flush=True)
    ce = [abs(x["calibrated_error"]) for x in rows if x["calibrated_plan_is_the_run"] and not x["in_calibration_fit"]]
    ie = [abs(x["calibrated_error"]) for x in rows if x["calibrated_plan_is_the_run"] and x["in_calibration_fit"]]
    ue = [abs(x["uncalibrated_error"]) for x in rows if x["uncalibrated_plan_is_the_run"]]
    se = [abs(x["calibrated_error_at_run_host_speed"]) for x in rows if x["calibrated_plan_is_the_run"]
          and not x["in_calibration_fit"] and "calibrated_error_at_run_host_speed" in x]
    ks = [x["host_speed_vs_calibration"] for x in rows if "host_speed_vs_calibration" in x]
    speed = ({"median_abs_error_calibrated_at_run_host_speed": statistics.median(se) if se else None,
              "max_abs_error_calibrated_at_run_host_speed": max(se) if se else None,
              "host_speed_vs_calibration_range": [min(ks), max(ks)] if ks else None} if a.runs is not None else {})
    write_result(a.out, "held-out step-time error of the shipped calibration on fresh draws (no refit)",
                 f"CPU, from {measured['device']} measurements",
                 {"draws_measured": len(rows), "draws_compared": len(ce), "draws_compared_uncalibrated": len(ue),
                  "draws_in_calibration_fit": sum(x["in_calibration_fit"] for x in rows),
                  "median_abs_error_calibrated": statistics.median(ce) if ce else None,
                  "max_abs_error_calibrated": max(ce) if ce else None,
                  "median_abs_error_in_sample": statistics.median(ie) if ie else None,
                  "max_abs_error_in_sample": max(ie) if ie else None,
                  "median_abs_error_uncalibrated": statistics.median(ue) if ue else None,
                  "max_abs_error_uncalibrated": max(ue) if ue else None, **speed},
                 rows, measured_git_commit=measured["git_commit"], seed=measured["seed"], topology=topology)
    return 0


if __name__ == "__main__":
    sys.exit(main())
