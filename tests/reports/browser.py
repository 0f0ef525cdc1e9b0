"""Open a report in headless Chromium through Playwright and read back what happened: JavaScript errors,
figures drawn, what stuck out, and the page's own timings. Used by the browser test and
``benchmarks/report_load.py``.

The browser is the system's Chromium (``$COPLAN_CHROMIUM``, else ``chromium`` on PATH), handed to
Playwright as its executable, so no browser is downloaded. Errors are collected twice: by the page's own
``window.onerror`` hook (see :mod:`coplan.reports.html`) and by Playwright's ``pageerror`` and console
``error`` events, so an error thrown before the hook or inside plotly.js is still seen. Each load gets a
fresh browser, as a reader's first open of the file would.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

try:
    from playwright.sync_api import TimeoutError as PlaywrightTimeout
    from playwright.sync_api import sync_playwright
except ImportError:  # the `test` extra brings it; the browser tests skip without it
    PlaywrightTimeout = sync_playwright = None

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable", "chrome")

LAUNCH_ARGS = ("--disable-gpu", "--disable-quic", "--disable-background-networking", "--disable-component-update", "--mute-audio")

DONE = "!!(window.__coplan && window.__coplan.done)"
"""True once the page's loader has drawn (or failed to draw) every figure."""

PROBE = """JSON.stringify((function () {
    var s = window.__coplan || {};
    var nav = performance.getEntriesByType('navigation')[0];
    return {expected: s.expected || 0, rendered: s.rendered || 0, errors: s.errors || [],
            render_ms: s.render_ms, done_at_ms: s.done_at_ms, figure_ms: s.figure_ms || {},
            script_ms: s.script_ms, first_figure_ms: s.first_figure_at_ms, first_screen_ms: s.first_screen_at_ms,
            first_screen: s.first_screen || [], order: s.order || [], margin_grown: s.margin_grown || {},
            first_paint_ms: (performance.getEntriesByName('first-contentful-paint')[0] || {}).startTime,
            load_ms: nav && nav.loadEventEnd > 0 ? nav.loadEventEnd : null,
            overflow: Math.max(0, document.documentElement.scrollWidth - window.innerWidth)};
})())"""


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
    width_px: int
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
    """Harness wall clock: navigation asked → figures drawn seen."""
    overflow_px: int = 0
    """How far the page is wider than the viewport (0: nothing sticks out in a narrow window)."""
    timed_out: bool = False
    figure_ms: dict[str, float] = field(default_factory=dict)
    """Figure element id → ms from its JSON parse to its drawn promise (includes waiting behind earlier figures)."""
    plotly_ready_ms: float | None = None
    """Navigation start → plotly.js evaluated."""
    first_paint_ms: float | None = None
    """Navigation start → first contentful paint (the summary text is visible)."""
    first_figure_ms: float | None = None
    """Navigation start → the first figure drawn."""
    main_thread_ms: dict[str, float] = field(default_factory=dict)
    """The renderer main thread's busy time over the load (DevTools ``Performance.getMetrics``: TaskDuration,
    ScriptDuration, LayoutDuration, RecalcStyleDuration, thread time): wall time less waiting for a CPU."""
    settle_ms: float | None = None
    """Time the ``settle`` callback took before the page was opened; not part of any page timing."""
    first_screen_ms: float | None = None
    """Navigation start → every figure on the first screen drawn; the summary's paint time when none is on it."""
    first_screen: list[str] = field(default_factory=list)
    """Figure element ids on the first screen (the window's height at load)."""
    draw_order: list[str] = field(default_factory=list)
    """Figure element ids in the order they were drawn."""
    margin_grown: dict[str, dict] = field(default_factory=dict)
    """Figures whose margins ended larger than the page's estimate (drawn twice): id → the margins they ended with."""
    trace_events: list[dict] = field(default_factory=list)
    """With ``trace_categories``: the Chromium trace of the load."""

    @property
    def ok(self) -> bool:
        return not self.errors and not self.timed_out and self.rendered == self.expected and self.expected > 0


@contextmanager
def playwright_or_none() -> Iterator[object | None]:
    """A started Playwright (sync API), or None when the package is not installed."""
    if sync_playwright is None:
        yield None
        return
    with sync_playwright() as pw:
        yield pw


@contextmanager
def open_page(pw, *, width_px: int = 1280, height_px: int = 900, binary: str | None = None) -> Iterator[tuple[object, object]]:
    """A fresh headless browser with one page of that viewport: ``(browser, page)``; closed on exit."""
    binary = binary or find_chromium()
    if binary is None:
        raise FileNotFoundError("no chromium/chrome binary on PATH (set COPLAN_CHROMIUM to one)")
    browser = pw.chromium.launch(executable_path=binary, headless=True, args=list(LAUNCH_ARGS))
    try:
        page = browser.new_page(viewport={"width": width_px, "height": height_px}, device_scale_factor=1)
        yield browser, page
    finally:
        browser.close()


def wait_done(page, timeout_s: float) -> bool:
    """Wait until the page's loader reports every figure drawn; False on the deadline."""
    try:
        page.wait_for_function(DONE, polling=50, timeout=timeout_s * 1e3)  # polling often takes the page's CPU
        return True
    except PlaywrightTimeout:
        return False


def load_report(pw, path: str | Path, *, width_px: int = 1280, height_px: int = 900, timeout_s: float = 60.0, binary: str | None = None,
                screenshot: str | Path | None = None, resize_to_px: int | None = None, fragment: str | None = None,
                settle: Callable[[], None] | None = None, trace_categories: list[str] | None = None) -> PageLoad:
    """Open ``path`` in a fresh headless browser at ``width_px`` and wait until every figure is drawn.

    ``screenshot``: a PNG of the whole page is written there. ``resize_to_px``: once drawn, the window is
    narrowed and errors and overflow are read after that. ``fragment``: the page is opened at that anchor
    (``#scaling``), as a link to one figure would. ``settle``: called once the browser has started, before
    the page opens (the benchmark waits there for the new browser to go idle). ``trace_categories``: a
    Chromium trace of the load is kept in :attr:`PageLoad.trace_events`.
    """
    url = Path(path).resolve().as_uri()
    result = PageLoad(url=url, width_px=width_px)
    errors: list[str] = []
    with open_page(pw, width_px=width_px, height_px=height_px, binary=binary) as (browser, page):
        page.on("pageerror", lambda e: errors.append(f"uncaught: {e.stack or e.message}"))
        page.on("console", lambda m: errors.append(f"console.error: {m.text}") if m.type == "error" else None)
        cdp = page.context.new_cdp_session(page)
        try:
            cdp.send("Performance.enable", {"timeDomain": "threadTicks"})
        except Exception:  # noqa: BLE001 - older browsers have no thread-time domain
            cdp.send("Performance.enable")
        if settle is not None:
            t = time.monotonic()
            settle()
            result.settle_ms = (time.monotonic() - t) * 1e3
        if trace_categories:
            browser.start_tracing(page=page, categories=trace_categories)
        t0 = time.monotonic()
        page.goto(f"{url}#{fragment}" if fragment else url, wait_until="commit", timeout=timeout_s * 1e3)
        done = wait_done(page, max(1.0, timeout_s - (time.monotonic() - t0)))
        result.wall_ms = (time.monotonic() - t0) * 1e3
        result.timed_out = not done
        if resize_to_px is not None and done:
            page.set_viewport_size({"width": resize_to_px, "height": height_px})
            result.width_px = resize_to_px
            time.sleep(1.5)  # the page re-wraps titles 250 ms after the last resize event; Plotly redraws
        # the load event may trail the loader's last promise by a tick; give it a moment
        for _ in range(50):
            info = json.loads(page.evaluate(PROBE))
            if info["load_ms"] is not None or not done:
                break
            time.sleep(0.02)
        time.sleep(0.05)
        metrics = {m["name"]: m["value"] for m in cdp.send("Performance.getMetrics")["metrics"]}
        result.main_thread_ms = {k: metrics[k] * 1e3 for k in ("TaskDuration", "ScriptDuration", "LayoutDuration", "RecalcStyleDuration")
                                 if k in metrics}
        if trace_categories:
            result.trace_events = json.loads(browser.stop_tracing()).get("traceEvents", [])
        if screenshot is not None:
            page.screenshot(path=str(screenshot), full_page=True)
    _fill(result, info)
    seen: set[str] = set()
    errors = [f"page: {e}" for e in info["errors"]] + errors
    result.errors = [e for e in errors if not (e in seen or seen.add(e))]
    return result


def _fill(result: PageLoad, info: dict) -> None:
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
