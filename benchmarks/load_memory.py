"""Load (issue 9): peak memory and wall time of `coplan plan` and `coplan report` for gem-1t at
16,384 GPUs of meta-roce-24k, each in its own process (peak RSS from the kernel's accounting).

    python benchmarks/load_memory.py            # writes benchmarks/results/load_memory.json

Goal: each stays within 4 GiB.
"""

from __future__ import annotations

import json
import platform
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import git_commit  # noqa: E402  (the scripts run by path)

GOAL_BYTES = 4 * 1024**3
RESULTS = Path(__file__).resolve().parent / "results" / "load_memory.json"

# Runs a CLI verb in-process and reports its peak RSS and that of its largest child (the planner
# solves candidates in worker processes); ru_maxrss is KiB on Linux.
PROBE = """
import os, resource, sys, time
from coplan.cli import main
t = time.perf_counter()
code = main(sys.argv[1:])
wall = time.perf_counter() - t
print("LOAD", code, wall, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
      resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024, os.cpu_count())
"""


def measure(args: list[str]) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True, timeout=900)
    line = next((l for l in out.stdout.splitlines() if l.startswith("LOAD ")), None)
    if line is None:
        raise SystemExit(f"{args}: failed\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
    _, code, wall, rss, child, cpus = line.split()
    workers = int(cpus) if int(child) > 0 else 0
    # all workers at the largest child's peak at once, beside the parent's own peak: an upper bound
    bound = int(rss) + workers * int(child)
    return {"args": args, "exit_code": int(code), "wall_s": float(wall), "parent_peak_rss_bytes": int(rss),
            "largest_child_peak_rss_bytes": int(child), "workers": workers, "peak_bound_bytes": bound,
            "peak_bound_gib": bound / 1024**3, "within_goal": bound <= GOAL_BYTES}


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        plan = str(Path(tmp) / "plan.json")
        rows = [
            measure(["plan", "-w", "gem-1t", "-t", "meta-roce-24k", "--gpus", "16384", "-o", plan, "--quiet"]),
            measure(["report", plan, "-o", str(Path(tmp) / "report.html")]),
        ]
    import coplan

    result = {
        "benchmark": "load: peak memory of plan and report (issue 9)",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {platform.processor() or 'cpu'}, python {platform.python_version()}",
        "git_commit": git_commit(), "coplan": coplan.__version__,
        "goal_bytes": GOAL_BYTES,
        "rows": rows,
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=1) + "\n")
    for r in rows:
        print(f"{r['args'][0]:<8} peak <= {r['peak_bound_gib']:.2f} GiB (process {r['parent_peak_rss_bytes'] / 1024**3:.2f} GiB"
              f" + {r['workers']} workers x {r['largest_child_peak_rss_bytes'] / 1024**3:.2f} GiB), {r['wall_s']:.1f} s, "
              f"exit {r['exit_code']}, {'within' if r['within_goal'] else 'OVER'} the 4 GiB goal")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
