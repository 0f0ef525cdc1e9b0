"""Time to the first step of ``coplan train`` on one H200, first and repeated (issue 24's start-up goal:
a repeated run of ``gem-h200`` reaches its first step within 30 s).

The user's path: ``coplan plan -t h200-1gpu -w gem-h200`` (made beforehand with ``--plan-only``: the lent
GPU machines have no OR-Tools), then ``coplan train PLAN`` at its defaults, twice in a row on the same
machine and runs folder. The first run generates the dataset and fills the Triton / Inductor caches;
the repeated one reads the dataset and finds the caches. Each run's ``summary.json`` ``startup`` split
(launch, data, build, sharding, first step, compile, autotune, CUDA-graph capture where recorded) is kept.

    python benchmarks/startup_h200.py --plan-only
    # on the H200 (TorchRec installed, coplan importable):
    python benchmarks/startup_h200.py --out $OUT/startup_h200.json

Writes ``benchmarks/results/startup_h200.json`` (device, versions, date, commit).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import coplan_cmd as _coplan  # noqa: E402
from _common import git_commit, wait_or_kill  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def run(plan: Path, runs_root: Path, run_id: str, steps: int, timeout_s: float) -> dict:
    t0 = time.perf_counter()
    proc = subprocess.Popen(_coplan("train", str(plan), "--steps", str(steps), "--runs-root", str(runs_root),
                                    "--run-id", run_id, "--no-progress"),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    code = wait_or_kill(proc, timeout_s)
    out = proc.stdout.read() if proc.stdout else ""
    row: dict = {"run": run_id, "exit": code, "wall_s": round(time.perf_counter() - t0, 1)}
    summary = runs_root / run_id / "summary.json"
    if code == 0 and summary.is_file():
        s = json.loads(summary.read_text())
        row |= {"startup": s.get("startup"), "measured_step_p50_s": s["step_time"]["p50_s"],
                "measured_mfu": s["measured_mfu"], "notes": s.get("notes", "")}
    else:
        row["tail"] = out[-1500:]
    shutil.rmtree(runs_root / run_id / "checkpoints", ignore_errors=True)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", default="gem-h200")
    ap.add_argument("--plans", type=Path, default=RESULTS / "startup_plans")
    ap.add_argument("--plan-only", action="store_true", help="plan with coplan plan, then stop (no GPU needed)")
    ap.add_argument("--steps", type=int, default=12, help="steps per run (the start-up is what is measured)")
    ap.add_argument("--repeats", type=int, default=1, help="repeated runs after the first")
    ap.add_argument("--run-timeout-s", type=float, default=200.0)
    ap.add_argument("--runs-root", type=Path, default=Path("runs/startup"))
    ap.add_argument("--out", type=Path, default=RESULTS / "startup_h200.json")
    a = ap.parse_args()
    plan = a.plans / f"{a.workload}.plan.json"
    if a.plan_only:
        a.plans.mkdir(parents=True, exist_ok=True)
        subprocess.run(_coplan("plan", "-t", "h200-1gpu", "-w", a.workload, "-o", str(plan), "--quiet"), check=True)
        print(f"wrote {plan}")
        return 0
    rows = []
    for i in range(1 + a.repeats):
        rows.append(run(plan, a.runs_root, "first" if i == 0 else f"repeat{i}", a.steps, a.run_timeout_s))
        st = rows[-1].get("startup") or {}
        print(f"{rows[-1]['run']}: exit {rows[-1]['exit']}, to first step {st.get('to_first_step_s')} s", flush=True)
    import torch  # the device's versions, recorded

    firsts = [r["startup"]["to_first_step_s"] for r in rows if r.get("startup")]
    result = {"benchmark": f"coplan train {a.workload} on one H200: time to the first step, first and repeated runs",
              "workload": a.workload, "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
              "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else platform.processor(),
              "torch": torch.__version__, "python": platform.python_version(), "git_commit": git_commit(),
              "command": " ".join(sys.argv), "steps": a.steps,
              "first_s": firsts[0] if rows[0].get("startup") else None,
              "repeated_s": min(firsts[1:]) if len(firsts) > 1 and rows[0].get("startup") else None, "rows": rows}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1))
    print(json.dumps({k: result[k] for k in ("first_s", "repeated_s")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
