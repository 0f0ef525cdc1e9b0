"""Leave-one-out check of `coplan calibrate` on a set of fresh draws (issue 23): for each draw that ran, fit a
calibration with ``coplan calibrate`` at its defaults on the traces of the *other* draws, plan the left-out
draw again with ``coplan plan --calibration`` that fit, and compare its predicted step with the one measured.
A fit on all the draws gives the in-sample figure beside it. The draws' own plans (made before, with the
calibration then shipped) are what ran; a draw whose re-plan makes other choices is reported and not counted.

Runs on any machine (no GPU): the traces are the run directories ``benchmarks/device/stage.sh draws`` brought
back (``draw_runs_<gpu>.tgz``, traces gzipped), the measured steps the result JSON beside them::

    python benchmarks/calibration_loo.py --measured benchmarks/results/fresh_draws_h100.json \\
        --runs benchmarks/results/draw_runs_h100c.tgz --out benchmarks/results/calibration_loo_h100.json

``--fit-out FILE`` also writes the calibration fitted on every draw (what would ship).
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


def _coplan(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "coplan.cli", *args], capture_output=True, text=True)


def calibrate(runs: list[Path], out: Path, extra: tuple[str, ...] = ()) -> dict:
    p = _coplan("calibrate", *map(str, runs), "-o", str(out), "--force", *extra)
    if p.returncode != 0:
        raise SystemExit(f"coplan calibrate failed ({p.returncode}):\n{p.stderr[-2000:]}")
    return json.loads(out.read_text())


def predict(workload: Path, calibration: Path | str, topology: str, out: Path) -> dict:
    p = _coplan("plan", "-t", topology, "-w", str(workload), "-o", str(out), "--quiet", "--calibration", str(calibration))
    if p.returncode != 0:
        raise SystemExit(f"coplan plan failed ({p.returncode}) on {workload}:\n{p.stderr[-2000:]}")
    return json.loads(out.read_text())


def run_dirs(src: Path, into: Path) -> dict[str, Path]:
    """Seed (as text) -> run directory of each draw under ``src`` (a folder, or a .tgz that stage.sh brought back)."""
    if src.is_file():
        with tarfile.open(src) as t:
            t.extractall(into, filter="data")
        src = into
    return {p.name.removeprefix("draw-"): p for p in sorted(src.rglob("draw-*")) if (p / "summary.json").is_file()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--measured", type=Path, required=True, help="the draws' result (fresh_draws_h200.py's JSON)")
    ap.add_argument("--runs", type=Path, action="append", required=True,
                    help="run directories: a folder or draw_runs_<gpu>.tgz (repeat for several)")
    ap.add_argument("--plans", type=Path, default=None, help="the draws' plan set (default: the one --measured ran)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--fit-out", type=Path, default=None, help="also write the calibration fitted on every draw here")
    ap.add_argument("--device-term", choices=("best", "factor", "gap"), default=None,
                    help="passed to coplan calibrate (default: its own default)")
    a = ap.parse_args()
    measured = json.loads(a.measured.read_text())
    plans = a.plans or plans_of(a.measured, RESULTS / "fresh_plans")
    topology = measured.get("topology", "h200-1gpu")
    steps = {str(r["seed"]): r["measured_step_p50_s"] for r in measured["rows"] if r.get("measured_step_p50_s")}
    row_of = {str(r["seed"]): r for r in measured["rows"]}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        runs: dict[str, Path] = {}
        for i, src in enumerate(a.runs):
            runs.update(run_dirs(src, tmp / f"runs{i}"))
        seeds = [s for s in steps if s in runs]
        if len(seeds) < 3:
            raise SystemExit(f"{len(seeds)} draws have both a measured step and a run directory: need 3 or more")
        extra = ("--device-term", a.device_term) if a.device_term else ()
        full = calibrate([runs[s] for s in seeds], tmp / "all.json", extra)
        if a.fit_out:
            a.fit_out.write_text((tmp / "all.json").read_text())
        for s in seeds:
            fold = tmp / f"fold-{s}.json"
            calibrate([runs[x] for x in seeds if x != s], fold, extra)
            wl = as_ran(plans / f"draw-{s}.yaml", row_of.get(s), tmp)  # (the FiLM as the run ran it)
            ran = json.loads((plans / f"draw-{s}.plan.json").read_text())
            loo = predict(wl, fold, topology, tmp / "loo.json")
            ins = predict(wl, tmp / "all.json", topology, tmp / "ins.json")
            m = steps[s]
            same = same_choices(loo, ran)
            row = {"seed": int(s), "measured_step_p50_s": m, "same_choices_as_the_run": same,
                   "held_out_step_s": loo["predicted"]["step_time_s"], "in_sample_step_s": ins["predicted"]["step_time_s"],
                   "held_out_host_s": loo["predicted"].get("host_s"),
                   "held_out_error": loo["predicted"]["step_time_s"] / m - 1,
                   "in_sample_error": ins["predicted"]["step_time_s"] / m - 1}
            rows.append(row)
            print(f"seed {s}: measured {m * 1e3:.1f} ms, left out {row['held_out_step_s'] * 1e3:.1f} ms "
                  f"({row['held_out_error']:+.0%}), in sample {row['in_sample_step_s'] * 1e3:.1f} ms "
                  f"({row['in_sample_error']:+.0%}){'' if same else ' (re-plan differs: not counted)'}", flush=True)
    ok = [r for r in rows if r["same_choices_as_the_run"]]
    ho, ins = [abs(r["held_out_error"]) for r in ok], [abs(r["in_sample_error"]) for r in ok]
    write_result(a.out, "leave-one-out step-time error of coplan calibrate on fresh draws",
                 f"CPU, from {measured['device']} traces",
                 {"draws": len(rows), "draws_compared": len(ok),
                  "median_abs_error_held_out": statistics.median(ho) if ho else None,
                  "max_abs_error_held_out": max(ho) if ho else None,
                  "median_abs_error_in_sample": statistics.median(ins) if ins else None,
                  "max_abs_error_in_sample": max(ins) if ins else None},
                 rows, measured_git_commit=measured.get("git_commit"), seed=measured.get("seed"), topology=topology,
                 fit_on_all={k: full.get(k) for k in ("device", "host_launch_s", "host_launch_graphed_s", "host_sample_s",
                                                      "device_step_factor", "device_gap_s",
                                                      "fit_error", "op_classes")})
    return 0


if __name__ == "__main__":
    sys.exit(main())
