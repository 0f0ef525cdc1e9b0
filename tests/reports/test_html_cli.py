"""The page and the verb: one self-contained file (plotly.js once, no network), every figure present,
summary at the top; `coplan report` errors are one message, never a traceback."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import plotly.graph_objects as go
import pytest

from coplan.cli import main
from coplan.planner.simulate import simulate_point
from coplan.reports.build import write_report
from coplan.reports.html import Report, Section, render
from coplan.reports.plotlyjs import choose_bundle
from coplan.spec import dump_spec


def _run(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "coplan.cli", *args], capture_output=True, text=True, cwd=cwd, timeout=600)


def test_page_embeds_plotly_once_and_loads_nothing_remote():
    fig = go.Figure(go.Bar(x=[1], y=[2]))
    html = render(Report("t", ("a </script><script>alert(1)</script> summary",), (Section("a", "A", fig), Section("b", "B", fig))))
    js = choose_bundle({"bar"}).js
    assert html.count(js[:200]) == 1, "plotly.js is embedded exactly once"
    assert html.count("* plotly.js") == 1, "and no second bundle"
    assert not re.search(r"<script[^>]+src=", html), "no external scripts"
    assert not re.search(r"<link[^>]+href=", html), "no external stylesheets or fonts"
    assert "cdn.plot.ly" not in html.replace(js, "")
    assert html.count('data-figure="fig-') == 2
    assert "</script><script>alert(1)" not in html, "text is escaped"


def test_json_blocks_cannot_close_the_script():
    fig = go.Figure(go.Bar(x=[1], y=[2], name="</script><b>x</b>"))
    html = render(Report("t", (), (Section("a", "A", fig),)))
    block = re.search(r'data-figure="fig-a"[^>]*>(.*?)</script>', html, re.S).group(1)
    assert json.loads(block)["data"][0]["name"] == "</script><b>x</b>"


def test_write_report_has_summary_and_every_figure(tmp_path, plan_file):
    out, report, log = write_report(plan_file, tmp_path / "r.html", simulate_point=simulate_point)
    keys = [s.key for s in report.sections]
    assert keys == ["waterfall", "timeline", "ranks", "memory", "alternatives", "sharding", "balance", "assumptions", "scaling"]
    missing = {s.key: s.note for s in report.sections if s.figure is None}
    assert not missing, missing
    assert report.summary[0].startswith("Plan: ")
    assert "goodput MFU" in report.summary[1]
    assert report.summary[2].startswith("Biggest loss: ") and "What would recover it" in report.summary[2]
    html = out.read_text()
    assert html.index("Biggest loss") < html.index('data-figure="fig-waterfall"'), "the summary comes first"


def test_cli_report(tmp_path, plan_file):
    out = _run("report", str(plan_file), "-o", str(tmp_path / "r.html"), "--no-scaling", "--json")
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    assert Path(d["output"]).exists() and d["bytes"] > 1_000_000
    assert "scaling" not in d["figures"] and "waterfall" in d["figures"]
    assert d["not_drawn"] == {}


@pytest.mark.parametrize("content,needle", [
    ("{}", "required field is missing"),
    ("{not json", "not valid JSON"),
])
def test_cli_bad_plan_file_is_one_message(tmp_path, content, needle):
    p = tmp_path / "plan.json"
    p.write_text(content)
    out = _run("report", str(p), "-o", str(tmp_path / "r.html"))
    assert out.returncode == 2
    assert needle in out.stderr and "Traceback" not in out.stderr
    assert not (tmp_path / "r.html").exists()


def test_cli_bad_run_and_calibration(tmp_path, plan_file):
    out = _run("report", str(plan_file), "--run", str(tmp_path), "-o", str(tmp_path / "r.html"))
    assert out.returncode == 2 and "summary.json" in out.stderr and "Traceback" not in out.stderr
    run = tmp_path / "run"
    run.mkdir()
    (run / "summary.json").write_text('{"run_id": "x", "world_size": 1, "steps": 1, "warmup_steps": 0}')
    (run / "metrics.jsonl").write_text('{"step": 0, "step_time_s": 1.0}\nnot json\n')
    out = _run("report", str(plan_file), "--run", str(run), "-o", str(tmp_path / "r.html"))
    assert out.returncode == 2 and "metrics.jsonl:2" in out.stderr
    cal = tmp_path / "cal.json"
    cal.write_text('{"device": ""}')
    out = _run("report", str(plan_file), "--calibration", str(cal), "-o", str(tmp_path / "r.html"))
    assert out.returncode == 2 and "device" in out.stderr and "Traceback" not in out.stderr
    out = _run("report", str(plan_file), "-o", str(tmp_path / "no" / "such" / "dir" / "r.html"))
    assert out.returncode == 2 and "does not exist" in out.stderr


def test_cli_sweep_file_of_binary_garbage_is_named(tmp_path, plan_file, capsys):
    """`report --simulate FILE` reads the file as the spec loader does: binary garbage is an input error naming it."""
    bad = tmp_path / "sweep.json"
    bad.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\xff\xfe garbage")
    assert main(["report", str(plan_file), "--simulate", str(bad), "-o", str(tmp_path / "r.html")]) == 2
    err = capsys.readouterr().err
    assert str(bad) in err and "binary" in err and "Traceback" not in err
    assert not (tmp_path / "r.html").exists()


def test_scaling_curve_needs_a_sweep_or_the_planners_simulate(tmp_path, plan_file):
    """Reports do not import the planner: without a sweep or a point function the curve is a note, not a guess."""
    _, report, _ = write_report(plan_file, tmp_path / "r.html", what_if=False)
    sec = next(s for s in report.sections if s.key == "scaling")
    assert sec.figure is None and "--simulate" in sec.note


def test_plan_without_prediction_is_repriced(tmp_path, h200_plan):
    p = tmp_path / "bare.json"
    dump_spec(h200_plan.model_copy(update={"predicted": None}), p)
    out, report, _ = write_report(p, tmp_path / "r.html", scaling=False, what_if=False)
    assert not [s for s in report.sections if s.figure is None]
    assert "goodput MFU" in report.summary[1]


def test_reports_never_import_torch(tmp_path, plan_file):
    """The planning half installs light: writing a report (re-pricing, simulate sweep, what-if) loads no torch and
    no trainer. (The scaling curve's sweep is the simulate heuristic's plans, made by the planner, which is torch-free.)"""
    code = (
        "import sys\n"
        "from coplan.planner.simulate import simulate_point\n"
        "from coplan.reports.build import write_report\n"
        f"write_report({str(plan_file)!r}, {str(tmp_path / 'r.html')!r}, simulate_point=simulate_point)\n"
        "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith(('torch.', 'coplan.trainer', 'coplan.kernels')))\n"
        "assert not bad, bad\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
