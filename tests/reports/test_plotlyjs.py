"""Which plotly.js a report embeds, and what the page carries once: the vendored basic bundle is the npm
file it claims to be and is used only where it can draw every trace with the installed plotly's schema;
the shared template is written once; margins start where automargin would take them."""

from __future__ import annotations

import json
import re

import plotly.graph_objects as go
import plotly.offline
import pytest

from coplan.reports import plotlyjs
from coplan.reports.html import Report, Section, hint_margins, page_payload, render


def _bar_and_line() -> tuple[go.Figure, go.Figure]:
    a = go.Figure(go.Bar(x=[1, 2], y=["short", "a much longer label"], orientation="h"))
    a.update_layout(template="plotly_white")
    b = go.Figure(go.Scatter(x=[1, 2], y=[3, 4]))
    b.update_layout(template="plotly_white")
    return a, b


def test_vendored_basic_bundle_is_the_npm_file():
    assert plotlyjs.file_sha256() == plotlyjs.BASIC_SHA256, "reports/vendor/plotly-basic.min.js differs from the npm package's file"
    head = plotlyjs.BASIC_FILE.read_text(encoding="utf-8")[:300]
    assert f"plotly.js (basic - minified) v{plotlyjs.BASIC_VERSION}" in head
    assert (plotlyjs.VENDOR_DIR / "plotly.js-LICENSE").read_text().startswith("MIT License")


def test_basic_bundle_for_scatter_and_bar_when_versions_match():
    b = plotlyjs.choose_bundle({"scatter", "bar"})
    if plotlyjs.full_version() != plotlyjs.BASIC_VERSION:
        assert b.name == "full" and plotlyjs.BASIC_VERSION in b.reason
        pytest.skip(f"installed plotly writes for plotly.js {plotlyjs.full_version()}; vendored basic is {plotlyjs.BASIC_VERSION}")
    assert b.name == "basic" and b.js.startswith("/**\n* plotly.js (basic - minified)")
    assert len(b.js) < len(plotly.offline.get_plotlyjs()) / 3


@pytest.mark.parametrize("types,prefer,why", [
    ({"scatter", "heatmap"}, "auto", "heatmap"),
    ({"bar"}, "full", "requested"),
])
def test_full_bundle_when_basic_cannot_draw_or_is_not_wanted(types, prefer, why):
    b = plotlyjs.choose_bundle(types, prefer=prefer)
    assert b.name == "full" and why in b.reason
    assert b.js == plotly.offline.get_plotlyjs()


def test_full_bundle_when_plotly_writes_for_another_version(monkeypatch):
    monkeypatch.setattr(plotlyjs, "full_version", lambda: "9.9.9")
    b = plotlyjs.choose_bundle({"bar"})
    assert b.name == "full" and "9.9.9" in b.reason


def test_bad_preference_is_refused():
    with pytest.raises(ValueError, match="auto"):
        plotlyjs.choose_bundle({"bar"}, prefer="smallest")


def test_page_says_which_bundle_and_embeds_it_once():
    a, b = _bar_and_line()
    page = render(Report("t", ("s",), (Section("a", "A", a), Section("b", "B", b))))
    chosen = plotlyjs.choose_bundle({"bar", "scatter"})
    assert re.search(rf'<meta name="coplan-plotlyjs" content="{chosen.name} {re.escape(chosen.version)}">', page)
    assert page.count(chosen.js[:300]) == 1
    heat = render(Report("t", ("s",), (Section("h", "H", go.Figure(go.Heatmap(z=[[1, 2], [3, 4]]))),)))
    assert '<meta name="coplan-plotlyjs" content="full ' in heat
    assert heat.count(plotly.offline.get_plotlyjs()[:300]) == 1


def test_template_is_written_once_and_trimmed_to_the_trace_types_used():
    a, b = _bar_and_line()
    page = render(Report("t", (), (Section("a", "A", a), Section("b", "B", b))))
    blocks = re.findall(r'<script type="application/json" data-figure="[^"]+" data-template="(\d+)">(.*?)</script>', page, re.S)
    assert len(blocks) == 2 and {i for i, _ in blocks} == {"0"}
    assert all("template" not in json.loads(body)["layout"] for _, body in blocks)
    templates = json.loads(re.search(r'<script type="application/json" data-templates="1">(.*?)</script>', page, re.S).group(1))
    assert len(templates) == 1 and set(templates[0]["data"]) == {"bar", "scatter"}
    assert templates[0]["layout"] == json.loads(a.to_json())["layout"]["template"]["layout"], "the layout part is kept whole"


def test_margin_hints_cover_bar_labels_and_x_title():
    a, _ = _bar_and_line()
    a.update_layout(margin={"l": 60, "b": 40}, font={"size": 12})
    a.update_xaxes(title_text="seconds")
    d = json.loads(a.to_json())
    hint_margins(d["layout"], d["data"])
    longest = len("a much longer label")
    assert d["layout"]["margin"]["l"] >= int(0.55 * 12 * longest) > 60
    assert d["layout"]["margin"]["b"] == 84
    # nothing to estimate: margins untouched
    c = json.loads(go.Figure(go.Scatter(x=[1], y=[1]), layout={"margin": {"l": 60, "b": 40}}).to_json())
    hint_margins(c["layout"], c["data"])
    assert c["layout"]["margin"] == {"l": 60, "b": 40}


def test_payload_collects_the_trace_types():
    fig = go.Figure()
    fig.add_trace(go.Bar(x=[1], y=[1]))
    p = page_payload(Report("t", (), (Section("a", "A", fig),)))
    assert p.trace_types == {"bar"}
