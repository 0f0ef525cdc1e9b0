"""Load time of a `coplan report` for gem-1t at 16,384 GPUs of meta-roce-24k, in headless Chromium.

The plan is real: the planner's when it is built, else the cost model's heuristic plan priced by the
full pricer (what `coplan simulate` uses); ``--plan`` reuses a plan file. The report is written with every
plan figure (scaling curve included), then opened ``--repeats`` times in a fresh headless Chromium per load
(once it has gone idle after start-up), at a desktop width and at a phone width, driven by Playwright
(``tests/reports/browser.py``, the browser test's helper), in three variants taken in turn so that a shared machine's
changing load falls on all of them alike:

- ``report``: the report as ``coplan report`` writes it (plotly.js basic bundle when it draws every trace);
- ``report-full``: the same figures with the full plotly.js bundle (what reports embedded before);
- ``baseline``: plotly.js (the bundle ``report`` embeds) and no figure: the fixed cost of plotly.js.

Per load it records:

- ``first_paint_ms``: navigation start → first contentful paint (the summary is readable);
- ``plotly_ready_ms``: navigation start → plotly.js evaluated;
- ``first_screen_ms``: navigation start → every figure on the first screen (the window's height at load)
  drawn; the first paint where no figure is on the first screen (a phone shows only the summary);
- ``figures_done_ms``: navigation start → every figure drawn (the loader draws the rest on idle, without
  scrolling);
- ``main_thread_busy_ms``: the renderer main thread's busy time over the load (DevTools
  ``Performance.getMetrics`` TaskDuration, thread time): what the load costs without waiting for a CPU;
- per-figure draw times, figures whose margins Plotly had to grow (drawn twice), JavaScript errors, figures drawn.

With ``--trace N``, N more loads per variant at the desktop width run under a Chromium trace, which splits
the main thread's CPU time into plotly.js compile/run, each figure, HTML parsing, style/layout/paint
(:func:`thread_time_breakdown`). The machine, its load average per load, and the
browser version are recorded, because a shared machine's load moves wall times by several times.

    python benchmarks/report_load.py --trace 3 --out benchmarks/results/report_load.json
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

import plotly

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from coplan import __version__  # noqa: E402
from coplan.planner.simulate import simulate_point  # noqa: E402
from coplan.reports.build import write_report  # noqa: E402
from coplan.reports.html import Report, page_payload, render  # noqa: E402
from coplan.reports.plotlyjs import choose_bundle  # noqa: E402
from coplan.spec import dump_spec, load_plan  # noqa: E402
from tests.reports.browser import find_chromium, load_report, playwright_or_none  # noqa: E402
from tests.reports.plans import planner_api, real_plan  # noqa: E402

TRACE_CATEGORIES = [
    "devtools.timeline", "v8", "v8.execute", "disabled-by-default-devtools.timeline", "disabled-by-default-v8.compile",
    "blink.user_timing", "loading",
]


def _tree_cpu_s(pid: int, *, exclude_self: bool = False) -> float:
    """CPU seconds (user + system) of a process and all its descendants, from /proc (0 where unreadable)."""
    try:
        ticks = os.sysconf("SC_CLK_TCK")
    except (ValueError, OSError):
        return 0.0
    children: dict[int, list[int]] = {}
    cpu: dict[int, float] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            raw = Path(f"/proc/{d}/stat").read_text()
        except OSError:
            continue
        fields = raw[raw.rindex(")") + 2:].split()
        children.setdefault(int(fields[1]), []).append(int(d))
        cpu[int(d)] = (int(fields[11]) + int(fields[12])) / ticks
    total, todo = 0.0, list(children.get(pid, [])) if exclude_self else [pid]
    while todo:
        p = todo.pop()
        total += cpu.get(p, 0.0)
        todo += children.get(p, [])
    return total


def wait_idle(*, quiet_s: float = 0.3, max_cpu_share: float = 0.05, timeout_s: float = 8.0) -> None:
    """Wait until this process's children (Playwright's driver and the browser it started) use under
    ``max_cpu_share`` of a CPU for ``quiet_s``.

    A freshly started headless Chromium spends about a second of CPU after start-up building its own UI
    (the omnibox pop-up WebUI, in a renderer of its own). On a 2-CPU machine that work competes with the
    page for the CPUs, and it is not the page's cost: a reader opens a report in a browser that is already
    running. Without /proc (not Linux) this returns at once.
    """
    me = os.getpid()
    if not Path(f"/proc/{me}/stat").exists():
        return
    t0 = time.monotonic()
    last = _tree_cpu_s(me, exclude_self=True)
    while time.monotonic() - t0 < timeout_s:
        time.sleep(quiet_s)
        now = _tree_cpu_s(me, exclude_self=True)
        if now - last < max_cpu_share * quiet_s:
            return
        last = now


def thread_time_breakdown(events: list[dict], page_url: str) -> dict[str, float]:
    """The page renderer's main-thread CPU time (ms, from the trace's thread durations ``tdur``, so waiting
    for a CPU on a loaded machine is not counted), split into:

    - ``plotly_js_compile`` / ``plotly_js_run``: compiling and running the plotly.js script (the largest
      ``EvaluateScript`` of the page);
    - ``figure:<id>``: each figure's task (JSON parse of its block, title wrapping, ``Plotly.newPlot`` and the
      forced style/layout inside it), found by the loader's ``coplan:figure:<id>`` user-timing measures;
    - ``html_parse``: parsing the HTML outside scripts (the JSON blocks are parsed as text here);
    - ``other_scripts``: the page's other scripts (error hook, loader set-up);
    - ``style_layout_paint``: style, layout, paint and compositing outside the figures' tasks;
    - ``other``: everything else (idle-time tasks, input, timers); ``total``: all main-thread tasks.
    """
    def td(e: dict) -> float:  # thread time where the trace has it, else wall time
        return e.get("tdur", e.get("dur", 0))

    meta = [e for e in events if e.get("ph") == "M" and e.get("name") == "thread_name"]
    ours = {e["pid"] for e in events if e.get("name") == "EvaluateScript" and page_url in str(e.get("args", {}).get("data", {}).get("url", ""))}
    mains = {(e["pid"], e["tid"]) for e in meta if e["pid"] in ours and e.get("args", {}).get("name") == "CrRendererMain"}
    if not mains:
        return {}
    xs = sorted((e for e in events if e.get("ph") == "X" and (e["pid"], e["tid"]) in mains), key=lambda e: (e["ts"], -e.get("dur", 0)))
    # top-level tasks: RunTask slices not nested in another
    tops, end = [], -1.0
    for e in xs:
        if e["name"] in ("RunTask", "ThreadControllerImpl::RunTask") and e["ts"] >= end:
            tops.append(e)
            end = e["ts"] + e.get("dur", 0)
    out: dict[str, float] = {"total": sum(td(e) for e in tops) / 1e3}
    # figures: the loader's user-timing measures (async begin/end pairs), each drawn in one task
    spans: dict[str, list[float]] = {}
    for e in events:
        n = str(e.get("name", ""))
        if n.startswith("coplan:figure:") and e.get("ph") in ("b", "e"):
            spans.setdefault(n.split(":", 2)[2], [0.0, 0.0])[0 if e["ph"] == "b" else 1] = e["ts"]
    # performance.now() is coarsened (100 µs), so a measure can start a hair before its task: take the task
    # that overlaps the measure most.
    fig_tasks: dict[int, str] = {}
    for fid, (a, b) in spans.items():
        best, best_ov = None, 0.0
        for i, t in enumerate(tops):
            ov = min(b, t["ts"] + t.get("dur", 0)) - max(a, t["ts"])
            if ov > best_ov:
                best, best_ov = i, ov
        if best is not None:
            fig_tasks[best] = fid
    for i, fid in fig_tasks.items():
        out[f"figure:{fid}"] = out.get(f"figure:{fid}", 0.0) + td(tops[i]) / 1e3
    evals = [e for e in xs if e["name"] == "EvaluateScript"]
    plotly_eval = max(evals, key=lambda e: e.get("dur", 0), default=None)
    if plotly_eval is not None:
        a, b = plotly_eval["ts"], plotly_eval["ts"] + plotly_eval.get("dur", 0)
        comp = sum(td(e) for e in xs if e["name"] == "v8.compile" and a <= e["ts"] <= b)
        out["plotly_js_compile"] = comp / 1e3
        out["plotly_js_run"] = (td(plotly_eval) - comp) / 1e3

    def in_figure(e: dict) -> bool:
        return any(tops[i]["ts"] <= e["ts"] <= tops[i]["ts"] + tops[i].get("dur", 0) for i in fig_tasks)

    # Scripts run inside the parser's task, so parsing is ParseHTML less the scripts it ran.
    parse = sum(td(e) for e in xs if e["name"] == "ParseHTML" and not in_figure(e))
    scripts = sum(td(e) for e in evals if not in_figure(e))
    out["html_parse"] = max(0.0, (parse - scripts) / 1e3)
    out["other_scripts"] = max(0.0, (scripts - (td(plotly_eval) if plotly_eval is not None else 0)) / 1e3)
    out["style_layout_paint"] = sum(td(e) for e in xs if e["name"] in {"UpdateLayoutTree", "Layout", "Paint", "PrePaint", "Layerize", "Commit"}
                                    and not in_figure(e)) / 1e3
    known = sum(v for k, v in out.items() if k != "total")
    out["other"] = max(0.0, out["total"] - known)
    return {k: round(v, 1) for k, v in out.items()}


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


def _git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=30).stdout.strip() or "?"
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
    ap.add_argument("--plan", default=None, help="use this plan.json instead of planning (must be the case above)")
    ap.add_argument("--trace", type=int, default=0, help="traced loads per variant (desktop width) for the CPU breakdown")
    ap.add_argument("--keep", default=None, help="also copy the report here")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "report_load.json"))
    args = ap.parse_args(argv)
    binary = find_chromium()
    if binary is None:
        print("no chromium on PATH; install Debian's `chromium`", file=sys.stderr)
        return 2
    with playwright_or_none() as pw:
        if pw is None:
            print("playwright is not installed (pip install playwright; no `playwright install` needed)", file=sys.stderr)
            return 2
        return _measure(args, argv, pw, binary)


def _measure(args, argv, pw, binary: str) -> int:
    tmp = Path(tempfile.mkdtemp(prefix="coplan-report-load-"))
    t0 = time.perf_counter()
    if args.plan:
        plan = load_plan(args.plan)
        plan_source = f"file {args.plan}"
    else:
        plan = real_plan(args.workload, args.topology, args.gpus)
        plan_source = "planner" if planner_api() else "cost-model heuristic + pricer"
    plan_s = time.perf_counter() - t0
    dump_spec(plan, tmp / "plan.json")
    t0 = time.perf_counter()
    out, report, log = write_report(tmp / "plan.json", tmp / "report.html", simulate_point=simulate_point)
    build_s = time.perf_counter() - t0
    if args.keep:
        Path(args.keep).write_bytes(out.read_bytes())
    full = tmp / "report-full.html"
    full.write_text(render(report, plotlyjs="full"), encoding="utf-8")
    base = tmp / "baseline.html"
    base.write_text(render(Report("plotly.js only", ("baseline: plotly.js and no figure",), ())), encoding="utf-8")
    payload = page_payload(report)
    sizes = {k: len(v[0]) for k, v in payload.figures.items()}
    bundle = choose_bundle(payload.trace_types)
    variants = (("report", out), ("report-full", full), ("baseline", base))

    def row(r, w: int) -> dict:
        return {
            "width_px": w, "figures_done_ms": r.figures_done_ms, "plotly_ready_ms": r.plotly_ready_ms, "first_paint_ms": r.first_paint_ms,
            "first_figure_ms": r.first_figure_ms, "first_screen_ms": r.first_screen_ms, "first_screen": r.first_screen,
            "draw_order": r.draw_order, "margin_grown": r.margin_grown, "settle_ms": r.settle_ms,
            "load_event_ms": r.load_event_ms, "render_ms": r.render_ms, "wall_ms": r.wall_ms, "figure_ms": r.figure_ms,
            "expected": r.expected, "rendered": r.rendered, "errors": r.errors, "overflow_px": r.overflow_px,
            "timed_out": r.timed_out, "loadavg_1m": os.getloadavg()[0], "main_thread_ms": r.main_thread_ms,
            "breakdown_ms": thread_time_breakdown(r.trace_events, r.url) if r.trace_events else {},
        }

    def log_line(key: str, r) -> None:
        f = lambda x: "-" if x is None else f"{x / 1e3:.2f}s"  # noqa: E731
        print(f"{datetime.datetime.now(datetime.timezone.utc):%H:%M:%S} {key:22s} ok={r.ok} plotly {f(r.plotly_ready_ms)} "
              f"first screen {f(r.first_screen_ms)} all {f(r.figures_done_ms)} busy {f(r.main_thread_ms.get('TaskDuration'))} "
              f"load {os.getloadavg()[0]:.1f}", flush=True)

    load_before = os.getloadavg()
    loads: dict[str, list] = {}
    widths = [int(x) for x in args.widths.split(",")]
    for _ in range(args.repeats):
        for w in widths:
            for name, path in variants:
                key = f"{name}@{w}px"
                try:
                    r = load_report(pw, path, width_px=w, timeout_s=120, settle=wait_idle)
                except Exception as e:  # one failed load is recorded, not fatal
                    loads.setdefault(key, []).append({"width_px": w, "error": f"{type(e).__name__}: {e}", "errors": [str(e)], "timed_out": True})
                    continue
                loads.setdefault(key, []).append(row(r, w))
                log_line(key, r)
    traces: dict[str, list] = {}
    for _ in range(args.trace):
        for name, path in variants:
            try:
                r = load_report(pw, path, width_px=widths[0], timeout_s=120, settle=wait_idle, trace_categories=TRACE_CATEGORIES)
            except Exception as e:
                traces.setdefault(name, []).append({"error": f"{type(e).__name__}: {e}"})
                continue
            traces.setdefault(name, []).append(row(r, widths[0]))
            log_line(f"{name} (traced)", r)
    load_after = os.getloadavg()
    summary = {}
    metrics = ("first_paint_ms", "plotly_ready_ms", "first_screen_ms", "first_figure_ms", "figures_done_ms", "render_ms")
    for key, rows in loads.items():
        good = [r for r in rows if "error" not in r]
        summary[key] = {m: _stats([r[m] for r in good]) for m in metrics}
        summary[key]["main_thread_busy_ms"] = _stats([r["main_thread_ms"].get("TaskDuration") for r in good])
        summary[key]["main_thread_script_ms"] = _stats([r["main_thread_ms"].get("ScriptDuration") for r in good])
        summary[key]["loadavg_1m"] = _stats([r["loadavg_1m"] for r in good])
        summary[key]["all_ok"] = bool(rows) and all("error" not in r and not r["errors"] and not r["timed_out"] and r["rendered"] == r["expected"]
                                                    for r in rows)
        if not key.startswith("baseline"):
            figs = sorted({k for r in good for k in r["figure_ms"]})
            summary[key]["figure_ms_median"] = {k: statistics.median(r["figure_ms"][k] for r in good if k in r["figure_ms"]) for k in figs}
            summary[key]["first_screen"] = good[0]["first_screen"] if good else []
            summary[key]["margin_grown"] = sorted({k for r in good for k in r["margin_grown"]})
    breakdown = {}
    for name, rows in traces.items():
        good = [r for r in rows if "error" not in r and r["breakdown_ms"]]
        keys = sorted({k for r in good for k in r["breakdown_ms"]})
        breakdown[name] = {"n": len(good), "median_ms": {k: statistics.median(r["breakdown_ms"].get(k, 0.0) for r in good) for k in keys}}
    result = {
        "benchmark": "report_load",
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": "python benchmarks/report_load.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "git_commit": _git_commit(),
        "machine": {"cpu": _cpu_model(), "cpus": os.cpu_count(), "platform": platform.platform(),
                    "loadavg_before": load_before, "loadavg_after": load_after},
        "versions": {"coplan": __version__, "plotly": plotly.__version__, "chromium": _chromium_version(binary), "python": platform.python_version()},
        "case": {"workload": args.workload, "topology": args.topology, "gpus": args.gpus,
                 "plan_source": plan_source,
                 "mesh": plan.mesh.model_dump(exclude={"axes"}), "tables": len(plan.tables)},
        "report": {"bytes": out.stat().st_size, "bytes_full_bundle": full.stat().st_size, "plotlyjs": f"{bundle.name} {bundle.version}",
                   "plotlyjs_reason": bundle.reason, "plotlyjs_bytes": len(bundle.js.encode()), "figures": [s.key for s in report.sections if s.figure is not None],
                   "figure_json_bytes": sizes, "template_json_bytes": len(json.dumps(payload.templates, separators=(",", ":"))),
                   "plan_s": plan_s, "build_s": build_s, "build_s_by_figure": log.seconds},
        "summary": summary,
        "thread_time_breakdown": breakdown,
        "loads": loads,
        "traced_loads": traces,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({"report_bytes": result["report"]["bytes"], "build_s": round(build_s, 2),
                      **{k: {m: v.get("median") for m, v in s.items() if isinstance(v, dict) and "median" in v} for k, s in summary.items()},
                      "breakdown": {k: v["median_ms"] for k, v in breakdown.items()},
                      "loadavg": [load_before, load_after]}, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
