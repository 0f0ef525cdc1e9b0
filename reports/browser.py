"""Open a report in headless Chromium and read back what happened: JavaScript errors, figures
rendered, and how long the page took. Used by the browser test and ``benchmarks/report_load.py``.

Speaks the DevTools protocol over ``--remote-debugging-pipe`` (fd 3 in, fd 4 out, NUL-separated
JSON), so nothing listens on a port and no browser-automation package is needed. Exceptions are
collected twice: by the page's own ``window.onerror`` hook (see :mod:`coplan.reports.html`) and by
the protocol's ``Runtime.exceptionThrown`` / console ``error`` events, so an error thrown before the
hook or inside plotly.js is still seen. Every wait has a deadline; the browser is killed on exit.
"""

from __future__ import annotations

import fcntl
import json
import os
import queue
import shutil
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable", "chrome")

HEADLESS_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-extensions",
    "--disable-default-apps",
    "--mute-audio",
    "--hide-scrollbars",
)


def find_chromium() -> str | None:
    """Path of a Chromium/Chrome binary (``$COPLAN_CHROMIUM`` first), or None."""
    env = os.environ.get("COPLAN_CHROMIUM")
    if env and Path(env).exists():
        return env
    for name in CHROMIUM_NAMES:
        p = shutil.which(name)
        if p:
            return p
    return None


@dataclass(slots=True)
class PageLoad:
    """What a headless browser saw when it opened a report."""

    url: str
    """The file opened."""

    width_px: int
    """Viewport width."""

    expected: int = 0
    """Figures the page holds."""

    rendered: int = 0
    """Figures that drew an SVG."""

    errors: list[str] = field(default_factory=list)
    """JavaScript errors (page hook, uncaught exceptions, console errors), deduplicated."""

    load_event_ms: float | None = None
    """Navigation start → ``load`` event, from the page's Navigation Timing."""

    figures_done_ms: float | None = None
    """Navigation start → every figure drawn (``performance.now()`` when the loader finished)."""

    render_ms: float | None = None
    """Time inside ``Plotly.newPlot`` for all figures."""

    wall_ms: float | None = None
    """Harness wall clock: ``Page.navigate`` sent → figures drawn reported back."""

    overflow_px: int = 0
    """How far the page is wider than the viewport (0: nothing sticks out in a narrow window)."""

    timed_out: bool = False
    """The page did not finish within the deadline."""

    figure_ms: dict[str, float] = field(default_factory=dict)
    """Figure element id → ms from its JSON parse to its drawn promise (includes waiting behind earlier figures)."""

    plotly_ready_ms: float | None = None
    """Navigation start → plotly.js evaluated (its cost is the same for every report)."""

    first_paint_ms: float | None = None
    """Navigation start → first contentful paint (the summary text is visible)."""

    first_figure_ms: float | None = None
    """Navigation start → the first figure (the MFU waterfall, at the top) drawn: the page is readable."""

    main_thread_ms: dict[str, float] = field(default_factory=dict)
    """The renderer main thread's busy time for the whole load (DevTools ``Performance.getMetrics``:
    TaskDuration = all tasks, ScriptDuration = JavaScript, LayoutDuration, RecalcStyleDuration). On a
    loaded machine wall time includes waiting for a CPU; busy time does not."""

    settle_ms: float | None = None
    """Time spent, before opening the page, waiting for the freshly started browser to go idle (see
    :func:`_wait_idle`); not part of any page timing."""

    first_screen_ms: float | None = None
    """Navigation start → every figure that is on the first screen (the window's height at load) drawn;
    the summary's paint time when no figure is on it."""

    first_screen: list[str] = field(default_factory=list)
    """Figure element ids on the first screen."""

    draw_order: list[str] = field(default_factory=list)
    """Figure element ids in the order they were drawn."""

    margin_grown: dict[str, dict] = field(default_factory=dict)
    """Figures whose margins ended larger than the page's estimate (automargin, or the room a legend below
    the plot reserves; Plotly then draws the figure a second time): element id → the margins it ended with."""

    breakdown_ms: dict[str, float] = field(default_factory=dict)
    """With ``trace=True``: the renderer main thread's CPU (thread) time by what it was spent on, from a
    Chromium trace of the load (see :func:`thread_time_breakdown`)."""

    @property
    def ok(self) -> bool:
        return not self.errors and not self.timed_out and self.rendered == self.expected and self.expected > 0


class _Pipe:
    """A DevTools-protocol connection to a browser started with ``--remote-debugging-pipe``."""

    def __init__(self, binary: str, extra_flags: tuple[str, ...] = ()) -> None:
        self._profile = tempfile.mkdtemp(prefix="coplan-chromium-")
        to_child_r, to_child_w = os.pipe()
        from_child_r, from_child_w = os.pipe()
        # Move the child's ends above 4 first so that the dup2 onto 3 and 4 below cannot clobber them.
        hi_r = fcntl.fcntl(to_child_r, fcntl.F_DUPFD, 10)
        hi_w = fcntl.fcntl(from_child_w, fcntl.F_DUPFD, 10)
        os.close(to_child_r)
        os.close(from_child_w)

        def child_fds() -> None:
            os.dup2(hi_r, 3)
            os.dup2(hi_w, 4)

        args = [binary, *HEADLESS_FLAGS, *extra_flags, f"--user-data-dir={self._profile}", "--remote-debugging-pipe", "about:blank"]
        self.proc = subprocess.Popen(
            args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            preexec_fn=child_fds, pass_fds=(3, 4), close_fds=True,
        )
        os.close(hi_r)
        os.close(hi_w)
        self._w = os.fdopen(to_child_w, "wb", buffering=0)
        self._r = os.fdopen(from_child_r, "rb", buffering=0)
        self._next_id = 0
        self._responses: dict[int, dict] = {}
        self._cond = threading.Condition()
        self.events: "queue.Queue[dict]" = queue.Queue()
        self._reader = threading.Thread(target=self._read_loop, daemon=True)
        self._reader.start()

    def _read_loop(self) -> None:
        buf = b""
        while True:
            try:
                chunk = self._r.read(1 << 16)
            except (OSError, ValueError):
                break
            if not chunk:
                break
            buf += chunk
            while b"\0" in buf:
                raw, buf = buf.split(b"\0", 1)
                try:
                    msg = json.loads(raw)
                except json.JSONDecodeError:
                    continue
                if "id" in msg:
                    with self._cond:
                        self._responses[msg["id"]] = msg
                        self._cond.notify_all()
                else:
                    self.events.put(msg)
        with self._cond:
            self._cond.notify_all()

    def send(self, method: str, params: dict | None = None, session: str | None = None, timeout_s: float = 30.0) -> dict:
        self._next_id += 1
        mid = self._next_id
        msg: dict = {"id": mid, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        self._w.write(json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while mid not in self._responses:
                left = deadline - time.monotonic()
                if left <= 0 or self.proc.poll() is not None:
                    raise TimeoutError(f"no answer to {method} within {timeout_s:.0f} s")
                self._cond.wait(min(left, 0.5))
            resp = self._responses.pop(mid)
        if "error" in resp:
            raise RuntimeError(f"{method}: {resp['error']}")
        return resp.get("result", {})

    def close(self) -> None:
        try:
            self._w.close()
        except OSError:
            pass
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        try:
            self._r.close()
        except OSError:
            pass
        shutil.rmtree(self._profile, ignore_errors=True)


def _event_error(ev: dict) -> str | None:
    m, p = ev.get("method"), ev.get("params", {})
    if m == "Runtime.exceptionThrown":
        d = p.get("exceptionDetails", {})
        exc = d.get("exception", {})
        return f"uncaught: {exc.get('description') or d.get('text')}"
    if m == "Runtime.consoleAPICalled" and p.get("type") == "error":
        return "console.error: " + " ".join(str(a.get("value", a.get("description", ""))) for a in p.get("args", []))
    if m == "Log.entryAdded":
        e = p.get("entry", {})
        # Only page errors: a file:// page has no network, and 'favicon.ico' misses are not the report's fault.
        if e.get("level") == "error" and e.get("source") in ("javascript",):
            return f"log: {e.get('text')}"
    return None


def _tree_cpu_s(pid: int) -> float:
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
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        total += cpu.get(p, 0.0)
        todo += children.get(p, [])
    return total


def _wait_idle(pid: int, *, quiet_s: float = 0.3, max_cpu_share: float = 0.05, timeout_s: float = 8.0) -> float:
    """Wait until the browser's processes use under ``max_cpu_share`` of a CPU for ``quiet_s``; returns the seconds waited.

    A freshly started headless Chromium (156) spends about a second of CPU after start-up building its own
    UI (the omnibox pop-up WebUI, in a renderer of its own). On a 2-CPU machine that work competes with the
    page for the CPUs, and it is not the page's cost: a reader opens a report in a browser that is already
    running. Without /proc (not Linux) this returns at once.
    """
    if not Path(f"/proc/{pid}/stat").exists():
        return 0.0
    t0 = time.monotonic()
    last = _tree_cpu_s(pid)
    while time.monotonic() - t0 < timeout_s:
        time.sleep(quiet_s)
        now = _tree_cpu_s(pid)
        if now - last < max_cpu_share * quiet_s:
            break
        last = now
    return time.monotonic() - t0


TRACE_CATEGORIES = ",".join((
    "devtools.timeline", "v8", "v8.execute", "disabled-by-default-devtools.timeline", "disabled-by-default-v8.compile",
    "blink.user_timing", "loading",
))


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


def load_report(path: str | Path, *, width_px: int = 1280, height_px: int = 900, timeout_s: float = 60.0, binary: str | None = None,
                screenshot: str | Path | None = None, resize_to_px: int | None = None, settle: bool = True, trace: bool = False,
                fragment: str | None = None) -> PageLoad:
    """Open ``path`` in a fresh headless browser at ``width_px`` and wait until every figure is drawn.
    With ``screenshot``, a PNG of the whole page at that width is written there. With ``resize_to_px``,
    the window is resized once every figure is drawn, and errors and overflow are read after that.
    With ``settle`` (default), the page is opened once the new browser has gone idle (:func:`_wait_idle`).
    With ``fragment``, the page is opened at that anchor (``#scaling``), as a link to one figure would.
    With ``trace``, a Chromium trace of the load gives :attr:`PageLoad.breakdown_ms` (tracing itself slows
    the page a little: use the untraced loads for timings).

    Raises FileNotFoundError when no browser is installed (callers decide whether that skips).
    """
    binary = binary or find_chromium()
    if binary is None:
        raise FileNotFoundError("no chromium/chrome binary on PATH (set COPLAN_CHROMIUM to one)")
    url = Path(path).resolve().as_uri()
    result = PageLoad(url=url, width_px=width_px)
    nav_url = f"{url}#{fragment}" if fragment else url
    pipe = _Pipe(binary, (f"--window-size={width_px},{height_px}",))
    errors: list[str] = []
    try:
        targets = pipe.send("Target.getTargets", timeout_s=timeout_s)["targetInfos"]
        page = next((t for t in targets if t.get("type") == "page"), None)
        if page is None:
            page = {"targetId": pipe.send("Target.createTarget", {"url": "about:blank"})["targetId"]}
        session = pipe.send("Target.attachToTarget", {"targetId": page["targetId"], "flatten": True})["sessionId"]
        for domain in ("Page", "Runtime", "Log"):
            pipe.send(f"{domain}.enable", session=session)
        try:
            pipe.send("Performance.enable", {"timeDomain": "threadTicks"}, session=session)
        except RuntimeError:  # older browsers: no thread-time domain
            pipe.send("Performance.enable", session=session)
        pipe.send("Emulation.setDeviceMetricsOverride",
                  {"width": width_px, "height": height_px, "deviceScaleFactor": 1, "mobile": False}, session=session)
        if settle:
            result.settle_ms = _wait_idle(pipe.proc.pid) * 1e3
        if trace:
            pipe.send("Tracing.start", {"categories": TRACE_CATEGORIES, "transferMode": "ReportEvents"})
        t0 = time.monotonic()
        pipe.send("Page.navigate", {"url": nav_url}, session=session)
        deadline = t0 + timeout_s
        done = False
        while time.monotonic() < deadline:
            while True:
                try:
                    ev = pipe.events.get_nowait()
                except queue.Empty:
                    break
                if ev.get("sessionId") == session:
                    err = _event_error(ev)
                    if err:
                        errors.append(err)
            r = pipe.send("Runtime.evaluate", {"expression": "!!(window.__coplan && window.__coplan.done)", "returnByValue": True},
                          session=session, timeout_s=max(1.0, deadline - time.monotonic()))
            if r.get("result", {}).get("value") is True:
                done = True
                break
            time.sleep(0.05)  # the page times itself; polling less often takes less of its CPU
        result.wall_ms = (time.monotonic() - t0) * 1e3
        result.timed_out = not done
        if resize_to_px is not None and done:
            pipe.send("Emulation.setDeviceMetricsOverride",
                      {"width": resize_to_px, "height": height_px, "deviceScaleFactor": 1, "mobile": False}, session=session)
            result.width_px = resize_to_px
            time.sleep(1.5)  # the page re-wraps titles 250 ms after the last resize event; Plotly redraws
            pipe.send("Runtime.evaluate", {"expression": "1", "returnByValue": True}, session=session)
        probe = """JSON.stringify((function () {
            var s = window.__coplan || {};
            var nav = performance.getEntriesByType('navigation')[0];
            return {expected: s.expected || 0, rendered: s.rendered || 0, errors: s.errors || [],
                    render_ms: s.render_ms, done_at_ms: s.done_at_ms, figure_ms: s.figure_ms || {},
                    script_ms: s.script_ms, first_figure_ms: s.first_figure_at_ms, first_screen_ms: s.first_screen_at_ms,
                    first_screen: s.first_screen || [], order: s.order || [], margin_grown: s.margin_grown || {}, first_paint_ms: (performance.getEntriesByName('first-contentful-paint')[0] || {}).startTime,
                    load_ms: nav && nav.loadEventEnd > 0 ? nav.loadEventEnd : null,
                    overflow: Math.max(0, document.documentElement.scrollWidth - window.innerWidth)};
        })())"""
        # the load event may trail the loader's last promise by a tick; give it a moment
        for _ in range(50):
            info = json.loads(pipe.send("Runtime.evaluate", {"expression": probe, "returnByValue": True}, session=session)["result"]["value"])
            if info["load_ms"] is not None or not done:
                break
            time.sleep(0.02)
        time.sleep(0.05)
        while True:
            try:
                ev = pipe.events.get_nowait()
            except queue.Empty:
                break
            if ev.get("sessionId") == session:
                err = _event_error(ev)
                if err:
                    errors.append(err)
        try:
            metrics = {m["name"]: m["value"] for m in pipe.send("Performance.getMetrics", session=session)["metrics"]}
            result.main_thread_ms = {k: metrics[k] * 1e3 for k in ("TaskDuration", "ScriptDuration", "LayoutDuration", "RecalcStyleDuration")
                                     if k in metrics}
        except (RuntimeError, TimeoutError):
            pass
        if trace:
            events: list[dict] = []
            pipe.send("Tracing.end")
            t_end = time.monotonic() + 60
            while time.monotonic() < t_end:
                try:
                    ev = pipe.events.get(timeout=1.0)
                except queue.Empty:
                    continue
                if ev.get("method") == "Tracing.dataCollected":
                    events += ev["params"]["value"]
                elif ev.get("method") == "Tracing.tracingComplete":
                    break
            result.breakdown_ms = thread_time_breakdown(events, url)
        if screenshot is not None:
            import base64

            shot = pipe.send("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True}, session=session, timeout_s=timeout_s)
            Path(screenshot).write_bytes(base64.b64decode(shot["data"]))
        result.expected = int(info["expected"])
        result.rendered = int(info["rendered"])
        result.render_ms = info.get("render_ms")
        result.figures_done_ms = info.get("done_at_ms")
        result.load_event_ms = info.get("load_ms")
        result.overflow_px = int(info["overflow"])
        result.figure_ms = {k: float(v) for k, v in (info.get("figure_ms") or {}).items()}
        result.plotly_ready_ms = info.get("script_ms")
        result.first_paint_ms = info.get("first_paint_ms")
        result.first_figure_ms = info.get("first_figure_ms")
        # no figure on the first screen: it is complete once the summary is painted
        result.first_screen_ms = info.get("first_screen_ms") if info.get("first_screen") else result.first_paint_ms
        result.first_screen = list(info.get("first_screen") or [])
        result.draw_order = list(info.get("order") or [])
        result.margin_grown = dict(info.get("margin_grown") or {})
        errors = [f"page: {e}" for e in info["errors"]] + errors
    finally:
        pipe.close()
    seen: set[str] = set()
    result.errors = [e for e in errors if not (e in seen or seen.add(e))]
    return result
