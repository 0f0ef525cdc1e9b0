"""How well a shipped calibration's recipe carries from one set of fresh draws to another (issue 23): each set's
runs fitted as ``scripts/ship_calibration.py`` fits the shipped file (the same base, the same device term), then
the other sets' draws re-planned with that fit and priced against their measured steps
(``benchmarks/fresh_draws_calibrated.py --calibration``). Every pair is held out both ways: the sets are fresh
draws of the same trainer whose runs the fit never read.

Runs on any machine (no GPU): the measurements are the lent GPU's, recorded in each set's JSON and run archive::

    python benchmarks/calibration_cross_set.py --set h100h --set h100i --device "NVIDIA H100" \\
        --out benchmarks/results/calibration_cross_set_h100.json

Why it exists: ten draws are what a shipped calibration was fitted on, and whether ten pin its terms down is
what the shipped file's next held-out set tests only once. Fitting each set and testing on the others shows
how far apart two ten-draw fits land and what that costs a plan.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from itertools import permutations
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import write_result  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"


def fit(tag: str, device: str, base: Path, device_term: str, out: Path) -> dict:
    subprocess.run([sys.executable, str(ROOT / "scripts" / "ship_calibration.py"), "--runs", str(RESULTS / f"draw_runs_{tag}.tgz"),
                    "--device", device, "--base", str(base), "--device-term", device_term, "--why", f"cross-set fit on {tag}",
                    "--out", str(out)], check=True, capture_output=True, text=True)
    return json.loads(out.read_text())


def test(tag: str, calibration: Path, out: Path) -> dict:
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "fresh_draws_calibrated.py"), "--measured",
                    str(RESULTS / f"fresh_draws_{tag}.json"), "--calibration", str(calibration), "--out", str(out)],
                   check=True, capture_output=True, text=True)
    return json.loads(out.read_text())


def terms(cal: dict) -> dict:
    """The fitted terms that move the step most, to show how far two fits land apart."""
    oc = cal.get("op_classes", {})
    return {"device_gap_s": cal.get("device_gap_s"), "device_step_factor": cal.get("device_step_factor"),
            "host_launch_graphed_s": cal.get("host_launch_graphed_s"),
            "compute_efficiency_bf16": {c: v.get("compute_efficiency", {}).get("bf16") for c, v in oc.items()},
            "memory_efficiency": {c: v.get("memory_efficiency") for c, v in oc.items()}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--set", dest="sets", action="append", required=True,
                    help="a set's tag: benchmarks/results/fresh_draws_<tag>.json and draw_runs_<tag>.tgz (two or more)")
    ap.add_argument("--device", required=True, help="the GPU name the shipped file is looked up by, e.g. 'NVIDIA H100'")
    ap.add_argument("--base", type=Path, default=ROOT / "calibration" / "data" / "nvidia-h200.json")
    ap.add_argument("--device-term", choices=("best", "factor", "gap"), default="gap")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    if len(a.sets) < 2:
        ap.error("give two sets or more (--set A --set B)")
    rows, fits = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for tag in a.sets:
            fits[tag] = fit(tag, a.device, a.base, a.device_term, Path(tmp) / f"fit_{tag}.json")
            print(f"fitted on {tag}: {json.dumps(terms(fits[tag]))}", flush=True)
        for fit_on, test_on in permutations(a.sets, 2):
            res = test(test_on, Path(tmp) / f"fit_{fit_on}.json", Path(tmp) / f"test_{fit_on}_{test_on}.json")
            s = res["summary"]
            per = {str(r["seed"]): r["calibrated_error"] for r in res["rows"] if r["calibrated_plan_is_the_run"]}
            signed = list(per.values())
            rows.append({"fit_on": fit_on, "test_on": test_on, "draws_compared": s["draws_compared"],
                         "median_abs_error": s["median_abs_error_calibrated"], "max_abs_error": s["max_abs_error_calibrated"],
                         "median_signed_error": statistics.median(signed) if signed else None, "per_draw_error": per,
                         "fit_terms": terms(fits[fit_on])})
            print(f"fit on {fit_on}, tested on {test_on}: median {s['median_abs_error_calibrated']:.1%}, worst "
                  f"{s['max_abs_error_calibrated']:.1%} over {s['draws_compared']} draws (signed median "
                  f"{rows[-1]['median_signed_error']:+.1%})", flush=True)
    med = [r["median_abs_error"] for r in rows]
    write_result(a.out, "a shipped calibration's recipe fitted on one set of fresh draws, tested on another (both ways)",
                 "CPU, from the lent GPU's measurements",
                 {"sets": a.sets, "device_term": a.device_term, "base": a.base.name,
                  "median_of_median_abs_error": statistics.median(med), "worst_median_abs_error": max(med),
                  "worst_abs_error": max(r["max_abs_error"] for r in rows)},
                 rows, gpu=a.device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
