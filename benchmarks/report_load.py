"""Load time of a `coplan report` for gem-1t at 16,384 GPUs of meta-roce-24k, in headless Chromium.

The plan is real: the planner's when it is built, else the cost model's heuristic plan priced by the
full pricer (what `coplan simulate` uses). The report is written with every plan figure (scaling curve
included), then opened ``--repeats`` times in a fresh headless Chromium per load, at a desktop width and
at a phone width, through the DevTools protocol (:mod:`coplan.reports.browser`). Per load it records:

- ``first_paint_ms``: navigation start → first contentful paint (the summary is readable);
- ``plotly_ready_ms``: navigation start → plotly.js evaluated (the same for every report);
- ``first_figure_ms``: navigation start → the first figure (the MFU waterfall) drawn;
- ``figures_done_ms``: navigation start → every figure drawn (the "loaded" the issue's < 2 s is about);
- ``main_thread_busy_ms``: the renderer main thread's busy time over the load (DevTools
  ``Performance.getMetrics`` TaskDuration, thread time): what the load costs without waiting for a CPU;
- per-figure draw times, JavaScript errors, figures drawn.

A baseline page holding plotly.js and no figure separates the fixed cost of plotly.js from the cost of
this report's figures. The machine, its load average before and after, and the browser version are
recorded, because a shared machine's load moves these numbers by several times.

    python benchmarks/report_load.py --out benchmarks/results/report_load.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"


def _chromium_version(binary: str) -> str:
    try:
        return subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return "?"


def _stats(xs: list[float]) -> dict:
    xs = [x for x in xs if x is not None]
    if not xs:
        return {}
    return {"min": min(xs), "median": statistics.median(xs), "max": max(xs), "n": len(xs)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", default="gem-1t")
    ap.add_argument("--topology", default="meta-roce-24k")
    ap.add_argument("--gpus", type=int, default=16384)
    ap.add_argument("--repeats", type=int, default=5, help="loads per width")
    ap.add_argument("--widths", default="1280,390", help="viewport widths (px)")
    ap.add_argument("--keep", default=None, help="also copy the report here")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "report_load.json"))
    args = ap.parse_args(argv)

    import plotly

    from coplan import __version__
    from coplan.reports.browser import find_chromium, load_report
    from coplan.reports.build import write_report
    from coplan.reports.html import Report, render
    from coplan.spec import dump_spec
    from tests.reports.plans import planner_api, real_plan

    binary = find_chromium()
    if binary is None:
        print("no chromium on PATH; install Debian's `chromium`", file=sys.stderr)
        return 2
    tmp = Path(tempfile.mkdtemp(prefix="coplan-report-load-"))
    t0 = time.perf_counter()
    plan = real_plan(args.workload, args.topology, args.gpus)
    plan_s = time.perf_counter() - t0
    dump_spec(plan, tmp / "plan.json")
    t0 = time.perf_counter()
    out, report, log = write_report(tmp / "plan.json", tmp / "report.html")
    build_s = time.perf_counter() - t0
    if args.keep:
        Path(args.keep).write_bytes(out.read_bytes())
    base = tmp / "baseline.html"
    base.write_text(render(Report("plotly.js only", ("baseline: plotly.js and no figure",), ())))
    sizes = {s.key: len(s.figure.to_json()) for s in report.sections if s.figure is not None}

    load_before = os.getloadavg()
    loads: dict[str, list] = {}
    for w in (int(x) for x in args.widths.split(",")):
        for name, path in (("report", out), ("baseline", base)):
            key = f"{name}@{w}px"
            loads[key] = []
            for _ in range(args.repeats):
                r = load_report(path, width_px=w, timeout_s=120)
                loads[key].append({
                    "figures_done_ms": r.figures_done_ms, "plotly_ready_ms": r.plotly_ready_ms, "first_paint_ms": r.first_paint_ms,
                    "first_figure_ms": r.first_figure_ms,
                    "load_event_ms": r.load_event_ms, "render_ms": r.render_ms, "wall_ms": r.wall_ms, "figure_ms": r.figure_ms,
                    "expected": r.expected, "rendered": r.rendered, "errors": r.errors, "overflow_px": r.overflow_px,
                    "timed_out": r.timed_out, "loadavg_1m": os.getloadavg()[0], "main_thread_ms": r.main_thread_ms,
                })
    load_after = os.getloadavg()
    summary = {}
    for key, rows in loads.items():
        summary[key] = {m: _stats([r[m] for r in rows]) for m in ("figures_done_ms", "first_figure_ms", "plotly_ready_ms", "first_paint_ms", "render_ms")}
        summary[key]["main_thread_busy_ms"] = _stats([r["main_thread_ms"].get("TaskDuration") for r in rows])
        summary[key]["main_thread_script_ms"] = _stats([r["main_thread_ms"].get("ScriptDuration") for r in rows])
        summary[key]["all_ok"] = all(not r["errors"] and not r["timed_out"] and r["rendered"] == r["expected"] for r in rows)
        if key.startswith("report"):
            figs = sorted({k for r in rows for k in r["figure_ms"]})
            summary[key]["figure_ms_median"] = {k: statistics.median(r["figure_ms"][k] for r in rows if k in r["figure_ms"]) for k in figs}
    result = {
        "benchmark": "report_load",
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": "python benchmarks/report_load.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": {"cpu": _cpu_model(), "cpus": os.cpu_count(), "platform": platform.platform(),
                    "loadavg_before": load_before, "loadavg_after": load_after},
        "versions": {"coplan": __version__, "plotly": plotly.__version__, "chromium": _chromium_version(binary), "python": platform.python_version()},
        "case": {"workload": args.workload, "topology": args.topology, "gpus": args.gpus,
                 "plan_source": "planner" if planner_api() else "cost-model heuristic + pricer",
                 "mesh": plan.mesh.model_dump(exclude={"axes"}), "tables": len(plan.tables)},
        "report": {"bytes": out.stat().st_size, "figures": [s.key for s in report.sections if s.figure is not None],
                   "figure_json_bytes": sizes, "plan_s": plan_s, "build_s": build_s, "build_s_by_figure": log.seconds},
        "summary": summary,
        "loads": loads,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({"report_bytes": result["report"]["bytes"], "build_s": round(build_s, 2),
                      **{k: {m: v.get("median") for m, v in s.items() if isinstance(v, dict) and "median" in v} for k, s in summary.items()},
                      "loadavg": [load_before, load_after]}, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
