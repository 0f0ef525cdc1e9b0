"""The HTML assembler: one self-contained file, plotly.js embedded once, every figure as JSON.

Nothing is loaded from the network: plotly.js is inlined (the smallest bundle that draws every trace
of the report: the vendored basic bundle or the installed ``plotly`` package's full one, see
:mod:`coplan.reports.plotlyjs`), fonts are the reader's system fonts, and figures carry their data as
``<script type="application/json">`` blocks (their shared Plotly template once) that one small loader
hands to ``Plotly.newPlot`` with ``responsive: true``: the figures on the first screen first, the rest
when the browser is idle, a figure scrolled into view before its turn first. The loader records what
happened where a headless browser (the tests, ``benchmarks/report_load.py``) can read it:
``window.__coplan`` and the ``data-rendered`` / ``data-expected`` / ``data-errors`` attributes of ``<body>``.
"""

from __future__ import annotations

import html
import json
import re
from dataclasses import dataclass, field

import plotly.graph_objects as go

from coplan.reports.palette import FONT
from coplan.reports.plotlyjs import choose_bundle


@dataclass(frozen=True, slots=True)
class Section:
    """One figure of the report, with the text that tells the reader how to read it."""

    key: str
    """Stable id (``waterfall``, ``ranks``...): the figure's element id and anchor."""

    title: str
    """Heading above the figure."""

    figure: go.Figure | None
    """The figure; None when it cannot be drawn (``note`` says why)."""

    caption: str = ""
    """One or two sentences: what is plotted, how it was computed, what to look for. Plain text."""

    note: str = ""
    """Shown instead of (or under) the figure: why it is missing or what it leaves out. Plain text."""


@dataclass(frozen=True, slots=True)
class Report:
    """A whole report: a title, a short summary and the sections."""

    title: str
    """Page title."""

    summary: tuple[str, ...]
    """Summary paragraphs (plain text; shown first)."""

    sections: tuple[Section, ...]
    """Figures in reading order."""

    facts: tuple[tuple[str, str], ...] = ()
    """Key figures shown as a small table under the summary: (label, value)."""

    footer: str = ""
    """Provenance: coplan version, inputs' hashes, generation time (plain text)."""

    meta: dict[str, str] = field(default_factory=dict)
    """Extra ``<meta name=... content=...>`` tags (machine-readable provenance)."""


_CSS = """
:root { color-scheme: light; }
* { box-sizing: border-box; }
body { font-family: %(font)s; margin: 0; color: #222; background: #fff; line-height: 1.45; }
main { max-width: 1200px; margin: 0 auto; padding: 12px 16px 48px; }
h1 { font-size: 1.45rem; margin: 8px 0 4px; }
h2 { font-size: 1.1rem; margin: 28px 0 2px; border-top: 1px solid #e4e4e4; padding-top: 14px; }
.summary p { margin: 6px 0; max-width: 72em; }
.summary p:first-child { font-size: 1.02rem; }
table.facts { border-collapse: collapse; margin: 10px 0; font-size: .92rem; }
table.facts td { padding: 2px 14px 2px 0; vertical-align: top; }
table.facts td:first-child { color: #555; white-space: nowrap; }
nav { font-size: .9rem; margin: 10px 0; }
nav a { color: #3556a0; text-decoration: none; margin-right: 12px; white-space: nowrap; display: inline-block; }
.caption { color: #444; font-size: .92rem; margin: 2px 0 6px; max-width: 72em; }
.note { color: #7a4b00; background: #fff7e6; border-left: 3px solid #e0a040; padding: 6px 10px; font-size: .9rem; margin: 6px 0; }
.fig { width: 100%%; min-height: 200px; }
footer { color: #777; font-size: .8rem; margin-top: 36px; border-top: 1px solid #eee; padding-top: 8px; word-break: break-all; }
@media (max-width: 640px) { main { padding: 6px 6px 32px; } h1 { font-size: 1.2rem; } }
""" % {"font": FONT}

# Installed before plotly.js so that an error anywhere (plotly.js itself included) is recorded.
_ERROR_HOOK = """
window.__coplan = {errors: [], rendered: 0, expected: 0, done: false, render_ms: null, done_at_ms: null, figure_ms: {}};
function __coplanError(msg) {
  window.__coplan.errors.push(String(msg));
  if (document.body) { document.body.dataset.errors = String(window.__coplan.errors.length); }
}
window.addEventListener('error', function (e) { __coplanError(e.message || e); });
window.addEventListener('unhandledrejection', function (e) { __coplanError('unhandled rejection: ' + (e.reason && e.reason.message || e.reason)); });
"""

_LOADER = """
(function () {
  var state = window.__coplan;
  var blocks = Array.prototype.slice.call(document.querySelectorAll('script[type="application/json"][data-figure]'));
  var tmplBlock = document.querySelector('script[type="application/json"][data-templates]');
  // Template texts, parsed again for every figure: Plotly keeps the layout object it is given.
  var templates = tmplBlock ? JSON.parse(tmplBlock.textContent).map(function (t) { return JSON.stringify(t); }) : [];
  state.expected = blocks.length;
  document.body.dataset.expected = String(blocks.length);
  document.body.dataset.errors = String(state.errors.length);
  var t0 = performance.now();
  state.loader_at_ms = t0;
  var config = {responsive: true, displaylogo: false, scrollZoom: false};
  var NARROW_PX = 640;
  function wrapWords(text, maxChars) {
    var words = text.split(' '), lines = [], cur = '';
    words.forEach(function (w) {
      if (cur && (cur + ' ' + w).replace(/<[^>]*>/g, '').length > maxChars) { lines.push(cur); cur = w; }
      else { cur = cur ? cur + ' ' + w : w; }
    });
    if (cur) { lines.push(cur); }
    return lines;
  }
  function merge(dst, src) {
    Object.keys(src).forEach(function (k) {
      if (src[k] && typeof src[k] === 'object' && !Array.isArray(src[k]) && dst[k] && typeof dst[k] === 'object') { merge(dst[k], src[k]); }
      else { dst[k] = src[k]; }
    });
  }
  // Titles are SVG text and do not wrap: wrap the subtitle to the figure's width, growing the top margin
  // and the height by the extra lines; below NARROW_PX also apply the figure's own narrow overrides.
  function fitToWidth(layout, width) {
    var t = layout.title && layout.title.text;
    if (t) {
      var cut = t.indexOf('<br><sup>');
      var head = cut >= 0 ? t.slice(0, cut) : t;
      var sub = cut >= 0 ? t.slice(cut + 9).replace('</sup>', '') : '';
      var heads = wrapWords(head, Math.max(24, Math.floor((width - 16) / 8.6)));
      var subs = sub ? wrapWords(sub, Math.max(36, Math.floor((width - 16) / 6.1))) : [];
      layout.title.text = heads.join('<br>') + subs.map(function (l) { return '<br><sup>' + l + '</sup>'; }).join('');
      var extra = 20 * (heads.length - 1) + 19 * Math.max(0, subs.length - 1);
      layout.margin = layout.margin || {};
      layout.margin.t = (layout.margin.t || 72) + extra;
      if (layout.height) { layout.height += extra; }
    }
    if (width < NARROW_PX) {
      layout.font = layout.font || {};
      layout.font.size = Math.min(layout.font.size || 12, 11);
      // a left margin above the default was sized for the labels (hint_margins): keep it, unless the
      // figure's narrow overrides shrink those labels (then automargin sizes it for the smaller font)
      var n = layout.meta && layout.meta.narrow, smallerY = !!(n && n.yaxis && n.yaxis.tickfont);
      if (layout.margin) { layout.margin.l = (layout.margin.l || 60) > 60 && !smallerY ? layout.margin.l : 44; layout.margin.r = 8; }
      if (layout.meta && layout.meta.narrow) { merge(layout, layout.meta.narrow); }
    }
  }
  // A horizontal legend under the plot (legend.yref 'container') takes room from the plot: Plotly reserves it
  // and, when the bottom margin did not already hold it, draws the figure a second time. Estimate its rows the
  // way Plotly lays it out (one row if every item fits, else a grid of the widest item) and start the bottom
  // margin there; layout.meta.axis_b (from hint_margins) is the room the x axis itself takes.
  function legendRoom(spec, width) {
    var L = spec.layout, lg = L.legend || {};
    var axisB = L.meta && L.meta.axis_b;
    if (axisB === undefined || L.showlegend === false || lg.yref !== 'container' || lg.orientation !== 'h') { return; }
    var fs = (lg.font && lg.font.size) || (L.font && L.font.size) || 12;
    var items = spec.data.filter(function (t) { return t.showlegend !== false && t.name; }).map(function (t) {
      return 40 + 0.55 * fs * String(t.name).replace(/<[^>]*>/g, '').length;
    });
    if (!items.length || (L.showlegend === undefined && items.length < 2)) { return; }
    var m = L.margin = L.margin || {};
    var avail = width - (m.l || 80) - (m.r || 80);
    var rows = 1;
    if (items.reduce(function (a, w) { return a + w + 5; }, 0) >= avail) {
      rows = Math.ceil(items.length / Math.max(1, Math.floor(avail / (Math.max.apply(null, items) + 5))));
    }
    m.b = Math.max(m.b || 0, Math.ceil(axisB + rows * 1.9 * fs + 2));  // a row is 19.4 px at 11 px in Chromium
  }
  var originals = {};
  function draw(block) {
    var id = block.dataset.figure;
    var div = document.getElementById(id);
    var t1 = performance.now();
    try {
      var spec = JSON.parse(block.textContent);
      var ti = block.dataset.template;
      if (ti !== undefined && templates[+ti] !== undefined) { spec.layout.template = JSON.parse(templates[+ti]); }
      var t2 = performance.now();
      originals[id] = {title: spec.layout.title && spec.layout.title.text, t: spec.layout.margin && spec.layout.margin.t,
                       height: spec.layout.height, width: div.clientWidth || window.innerWidth};
      fitToWidth(spec.layout, div.clientWidth || window.innerWidth);
      legendRoom(spec, div.clientWidth || window.innerWidth);
      var cfg = Object.assign({}, config, {toImageButtonOptions: {format: 'svg', filename: id}});
      return Plotly.newPlot(div, spec.data, spec.layout, cfg).then(function () {
        var t3 = performance.now();
        // User-timing entries: a trace of the load (benchmarks/report_load.py --trace) finds each figure's work by them.
        try { performance.measure('coplan:figure:' + id, {start: t1, end: t3}); } catch (e) { /* older browsers */ }
        div.dataset.rendered = '1';
        state.figure_ms[id] = t3 - t1;
        state.parse_ms[id] = t2 - t1;
        state.drawn_at_ms[id] = t3;
        // Did automargin grow a margin (and so draw the figure twice)? See hint_margins.
        var fs = div._fullLayout && div._fullLayout._size, lm = spec.layout.margin || {};
        if (fs && ['l', 'r', 't', 'b'].some(function (k) { return lm[k] !== undefined && fs[k] > lm[k] + 1; })) {
          state.margin_grown[id] = {l: fs.l, r: fs.r, t: fs.t, b: fs.b};
        }
        state.order.push(id);
        if (state.first_figure_at_ms === undefined) { state.first_figure_at_ms = t3; }
        if (!state.first_screen_at_ms && firstScreen.every(function (f) { return state.drawn_at_ms[f] !== undefined; })) { state.first_screen_at_ms = t3; }
      }, function (err) { __coplanError(id + ': ' + err); });
    } catch (err) {
      __coplanError(id + ': ' + err);
      return Promise.resolve();
    }
  }
  // Order: the figures on the first screen now, one per task; then the rest in reading order when the
  // browser is idle, except that a figure scrolled near the window (a nav link, a fast scroll) jumps the
  // queue. Every figure is drawn without the reader doing anything; the first screen is not kept waiting.
  state.parse_ms = {}; state.drawn_at_ms = {}; state.order = []; state.margin_grown = {};
  var near = {};
  // Opened at a figure's anchor: scroll there now (the browser would only after the load), so that the first
  // screen is the one the reader will see.
  var anchor = location.hash && document.getElementById(decodeURIComponent(location.hash.slice(1)));
  if (anchor) { anchor.scrollIntoView(); }
  var firstScreen = blocks.filter(function (b) {
    var r = document.getElementById(b.dataset.figure).getBoundingClientRect();
    return r.top < window.innerHeight && r.bottom > 0;
  }).map(function (b) { return b.dataset.figure; });
  state.first_screen = firstScreen;
  if (!firstScreen.length) { state.first_screen_at_ms = t0; }
  firstScreen.forEach(function (id) { near[id] = true; });
  if ('IntersectionObserver' in window) {
    var io = new IntersectionObserver(function (entries) {
      entries.forEach(function (e) { near[e.target.id] = e.isIntersecting; });
    }, {rootMargin: '50% 0px 50% 0px'});
    blocks.forEach(function (b) { io.observe(document.getElementById(b.dataset.figure)); });
  }
  var pending = blocks.slice();
  var idle = window.requestIdleCallback || function (f) { return setTimeout(f, 1); };
  function pump() {
    if (!pending.length) { return finish(); }
    var k = 0;
    for (var j = 0; j < pending.length; j++) { if (near[pending[j].dataset.figure]) { k = j; break; } }
    var block = pending.splice(k, 1)[0];
    draw(block).then(function () {
      var next = pending.some(function (b) { return near[b.dataset.figure]; });
      // setTimeout lets the browser paint what was just drawn; idle waits for input and scrolling too.
      if (next) { setTimeout(pump, 0); } else { idle(pump, {timeout: 100}); }
    });
  }
  // On a resize, re-wrap each title to the new width (Plotly itself resizes the plot).
  var resizeTimer = null;
  window.addEventListener('resize', function () {
    clearTimeout(resizeTimer);
    resizeTimer = setTimeout(function () {
      Object.keys(originals).forEach(function (id) {
        var o = originals[id], div = document.getElementById(id);
        var w = div && div.clientWidth;
        if (!w || !o.title || Math.abs(w - o.width) < 40 || !div.dataset.rendered) { return; }
        o.width = w;
        var lay = {title: {text: o.title}, margin: {t: o.t}, height: o.height};
        fitToWidth(lay, w);
        Plotly.relayout(div, {'title.text': lay.title.text, 'margin.t': lay.margin.t, height: lay.height});
      });
    }, 250);
  });
  function finish() {
    state.render_ms = performance.now() - t0;
    state.done_at_ms = performance.now();
    var ok = 0;
    document.querySelectorAll('.fig').forEach(function (d) {
      if (d.dataset.rendered === '1' && d.querySelector('.main-svg')) { ok += 1; }
    });
    state.rendered = ok;
    document.body.dataset.rendered = String(ok);
    document.body.dataset.errors = String(state.errors.length);
    document.body.dataset.renderMs = String(Math.round(state.render_ms));
    document.body.dataset.done = '1';
    state.done = true;
  }
  // The first draw is a task of its own, so the summary paints before it and each figure's cost is one task.
  setTimeout(pump, 0);
})();
"""


def _json_for_script(obj_json: str) -> str:
    """JSON safe inside ``<script>``: no ``</script>`` or ``<!--`` can end the block early."""
    return obj_json.replace("</", "<\\/").replace("<!--", "<\\!--")


def figure_json(fig: go.Figure) -> str:
    """The figure as compact JSON (data and layout only; the config is the loader's)."""
    d = json.loads(fig.to_json())
    return json.dumps({"data": d.get("data", []), "layout": d.get("layout", {})}, separators=(",", ":"))


@dataclass(frozen=True, slots=True)
class PagePayload:
    """Every figure's JSON with its template taken out: plotly.py writes the whole template (~8 KB, entries
    for two dozen trace types) into every figure; the page carries each distinct one once, trimmed to the
    trace types the report uses (entries for other types never apply)."""

    figures: dict[str, tuple[str, int | None]]
    """Section key → (figure JSON without ``layout.template``, index of its template or None)."""

    templates: list[dict]
    trace_types: set[str]


def page_payload(report: Report) -> PagePayload:
    """What the page embeds for ``report``'s figures (also read by ``benchmarks/report_load.py`` for sizes)."""
    dicts: dict[str, dict] = {}
    types: set[str] = set()
    for s in report.sections:
        if s.figure is None:
            continue
        d = json.loads(s.figure.to_json())
        d = {"data": d.get("data", []), "layout": d.get("layout", {})}
        # A trace without a type is a scatter to Plotly.
        types.update(t.get("type", "scatter") for t in d["data"])
        dicts[s.key] = d
    for d in dicts.values():
        hint_margins(d["layout"], d["data"])
    templates: list[dict] = []
    seen: dict[str, int] = {}
    figures: dict[str, tuple[str, int | None]] = {}
    for key, d in dicts.items():
        tmpl = d["layout"].pop("template", None)
        idx = None
        if isinstance(tmpl, dict):
            tmpl = dict(tmpl)
            if isinstance(tmpl.get("data"), dict):
                tmpl["data"] = {k: v for k, v in tmpl["data"].items() if k in types}
            sig = json.dumps(tmpl, sort_keys=True)
            if sig not in seen:
                seen[sig] = len(templates)
                templates.append(tmpl)
            idx = seen[sig]
        figures[key] = (json.dumps(d, separators=(",", ":")), idx)
    return PagePayload(figures, templates, types)


_PX_PER_CHAR = 0.55
"""Width of an average character of tick-label text, as a fraction of the font size (generous for the system
UI fonts: DejaVu Sans, Segoe UI, San Francisco are 0.48-0.55)."""
_X_AXIS_BOTTOM_PX = 62
"""Bottom margin an x axis with one line of tick labels and a title takes at font size 12 (Chromium)."""
_X_TITLE_BOTTOM_PX = 84
"""... and with one row of legend under it (Plotly's automargin gives 82)."""


def hint_margins(layout: dict, data: list[dict]) -> None:
    """Start the margins where Plotly's automargin would take them, so Plotly draws each figure once.

    Automargin only grows margins, and every growth redraws the whole figure (in the 16,384-GPU report each
    figure was drawn twice, a third of its drawing time). Horizontal category labels (bar names) and an
    x-axis title are the pushes that can be estimated here; an estimate that falls short costs the same
    redraw as before, one that is long some white space."""
    m = dict(layout.get("margin") or {})
    size = float((layout.get("font") or {}).get("size") or 12)
    axes = {k: v for k, v in layout.items() if re.fullmatch(r"[xy]axis\d*", k) and isinstance(v, dict)}
    labels = [str(v) for t in data if t.get("orientation") == "h" and isinstance(t.get("y"), list) for v in t["y"]]
    labels += [str(v) for k, ax in axes.items() if k.startswith("y") and ax.get("side", "left") == "left" for v in (ax.get("ticktext") or [])]
    if labels:
        longest = max(len(html.unescape(re.sub(r"<[^>]+>", "", line))) for lab in labels for line in lab.split("<br>"))
        y_title = any(k.startswith("y") and (ax.get("title") or {}).get("text") for k, ax in axes.items())
        m["l"] = max(int(m.get("l", 0)), int(_PX_PER_CHAR * size * longest + 14 + (22 if y_title else 0)))
    if any(k.startswith("x") and ax.get("side", "bottom") == "bottom" and (ax.get("title") or {}).get("text")
           and ax.get("showticklabels", True) is not False for k, ax in axes.items()):
        m["b"] = max(int(m.get("b", 0)), _X_TITLE_BOTTOM_PX)
        # what the axis alone takes; the loader adds the legend's rows, which depend on the window's width
        meta = layout.setdefault("meta", {})
        if isinstance(meta, dict):
            meta["axis_b"] = _X_AXIS_BOTTOM_PX
    # a tick label at the right end of an x axis sticks out by half its width
    for k, ax in axes.items():
        vals, text, rng = ax.get("tickvals"), ax.get("ticktext"), ax.get("range")
        if k.startswith("x") and vals and text and isinstance(rng, list) and len(rng) == 2 and rng[1] > rng[0]:
            if max(vals) >= rng[1] - 0.02 * (rng[1] - rng[0]):
                half = 0.55 * size * len(str(text[vals.index(max(vals))])) / 2
                m["r"] = max(int(m.get("r", 0)), int(16 + half + 1))
    layout["margin"] = m


def render(report: Report, *, plotlyjs: str = "auto") -> str:
    """The whole page as one string. ``plotlyjs``: ``"auto"`` (the smallest bundle that draws every
    trace, see :mod:`coplan.reports.plotlyjs`) or ``"full"``."""
    esc = html.escape
    payload = page_payload(report)
    bundle = choose_bundle(payload.trace_types, prefer=plotlyjs)
    meta = {**report.meta, "coplan-plotlyjs": f"{bundle.name} {bundle.version}"}
    parts: list[str] = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>{esc(report.title)}</title>",
    ]
    for k, v in meta.items():
        parts.append(f'<meta name="{esc(k)}" content="{esc(v)}">')
    parts += [f"<style>{_CSS}</style>", f"<script>{_ERROR_HOOK}</script>", "</head><body><main>"]
    parts.append(f"<h1>{esc(report.title)}</h1>")
    parts.append('<div class="summary">' + "".join(f"<p>{esc(p)}</p>" for p in report.summary) + "</div>")
    if report.facts:
        rows = "".join(f"<tr><td>{esc(k)}</td><td>{esc(v)}</td></tr>" for k, v in report.facts)
        parts.append(f'<table class="facts">{rows}</table>')
    parts.append("<nav>" + "".join(f'<a href="#{esc(s.key)}">{esc(s.title)}</a>' for s in report.sections) + "</nav>")
    blocks: list[str] = []
    if payload.templates:
        blocks.append(f'<script type="application/json" data-templates="{len(payload.templates)}">'
                      f'{_json_for_script(json.dumps(payload.templates, separators=(",", ":")))}</script>')
    for s in report.sections:
        parts.append(f'<section id="{esc(s.key)}"><h2>{esc(s.title)}</h2>')
        if s.caption:
            parts.append(f'<p class="caption">{esc(s.caption)}</p>')
        if s.note:
            parts.append(f'<p class="note">{esc(s.note)}</p>')
        if s.figure is not None:
            fid = f"fig-{s.key}"
            # Reserve the figure's height before it is drawn: the page does not jump as figures arrive,
            # and the loader knows which figures are on the first screen.
            h = s.figure.layout.height
            style = f' style="min-height:{int(h)}px"' if isinstance(h, (int, float)) and h > 0 else ""
            parts.append(f'<div class="fig" id="{esc(fid)}"{style}></div>')
            fig_json, ti = payload.figures[s.key]
            tattr = f' data-template="{ti}"' if ti is not None else ""
            blocks.append(f'<script type="application/json" data-figure="{esc(fid)}"{tattr}>{_json_for_script(fig_json)}</script>')
        parts.append("</section>")
    if report.footer:
        parts.append(f"<footer>{esc(report.footer)}</footer>")
    parts.append("</main>")
    # plotly.js once, then the data, then the loader.
    parts.append("<script>window.__coplan.plotly_start_ms = performance.now();</script>")
    parts.append(f'<script type="text/javascript">{bundle.js}</script>')
    parts.append("<script>window.__coplan.script_ms = performance.now();</script>")
    parts += blocks
    parts.append(f"<script>{_LOADER}</script>")
    parts.append("</body></html>")
    return "\n".join(parts)
