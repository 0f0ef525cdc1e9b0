"""`coplan calibrate` on corrupt run directories: each is refused with a typed error (exit code 2, no traceback)
naming the file, the line or field and what is wrong, and leaves no calibration behind; what a run may lack is
fitted as before with a note saying so. The runs are small synthetic ones (``test_calibrate._synth_run``), made
complete (summary, metrics lines with length statistics, the profiled steps) and then broken one file at a time."""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from coplan.calibration.runs import run_samples
from coplan.cli import main
from coplan.spec import load_calibration

from .test_calibrate import _plan, _synth_run, _write_step

STEPS = 10
PROFILED = [2, 3]


def _row(step: int) -> dict:
    n, L = 16, 250 + 3 * step
    return {"step": step, "loss": 1.0 - 0.01 * step, "step_time_s": 0.05 + 0.001 * step, "tokens": n * L, "samples": n,
            "seq_stats": {"history": [n, n * L, n * L * L * 1.2]}, "seq_max": {"history": [2 * L]}}


@pytest.fixture(scope="module")
def valid_run(tmp_path_factory) -> Path:
    """A complete run: plan, trace, summary (measured step), metrics.jsonl (one line per step) and traces/steps.json."""
    root = tmp_path_factory.mktemp("valid")
    d = _synth_run(root, "run", _plan(16, 256), np.random.default_rng(0), noise=0.0)
    _write_step(d, 0.05)
    (d / "metrics.jsonl").write_text("".join(json.dumps(_row(s)) + "\n" for s in range(STEPS)))
    (d / "traces" / "steps.json").write_text(json.dumps(PROFILED))
    return d


@pytest.fixture
def run(valid_run, tmp_path) -> Path:
    """A fresh copy of the valid run, to break."""
    return Path(shutil.copytree(valid_run, tmp_path / "run"))


def _calibrate(capsys, *dirs, out: Path) -> tuple[int, str, str]:
    rc = main(["calibrate", *map(str, dirs), "-o", str(out)])
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def _refused(capsys, run_dir: Path, *names: str, tmp_path: Path, dirs=None) -> str:
    """Calibrate ``run_dir``: exit code 2, one error line naming each of ``names``, no traceback, no output."""
    out = tmp_path / "cal.json"
    rc, _, err = _calibrate(capsys, *(dirs or (run_dir,)), out=out)
    assert rc == 2, err
    assert err.startswith("error: ") and "Traceback" not in err, err
    for n in names:
        assert n in err, (n, err)
    assert not out.exists()
    return err


def test_the_valid_run_calibrates_without_notes(valid_run, tmp_path, capsys):
    rc, out, err = _calibrate(capsys, valid_run, out=tmp_path / "cal.json")
    assert rc == 0, err
    assert "note:" not in out
    assert "run run:" not in load_calibration(tmp_path / "cal.json").notes
    r = run_samples(valid_run)
    assert r.notes == () and len(r.step_times_each) == STEPS - 2 - len(PROFILED)


# ---------------------------------------------------------------------------------------------- traces/steps.json

@pytest.mark.parametrize("text, why", [
    ("[2, 3", "not JSON"),  # truncated
    ("", "empty"),
    ('{"steps": [2, 3]}', "not a list"),
    ("[]", "lists no step"),
    ('["2", 3]', 'entry 0 is "2", not a step number'),
    ("[2.5, 3]", "entry 0 is 2.5, not a step number"),
    ("[true, 3]", "entry 0 is true"),
    ("[-1, 3]", "entry 0 is -1"),
    ("[2, 2]", "lists step 2 more than once"),
    ("[2, 99]", "lists step 99, which"),
])
def test_corrupt_profiled_steps_are_refused(run, tmp_path, capsys, text, why):
    (run / "traces" / "steps.json").write_text(text)
    err = _refused(capsys, run, "steps.json", why, tmp_path=tmp_path)
    assert "coplan train" in err  # the fix


def test_missing_profiled_steps_is_a_note(run, tmp_path, capsys):
    (run / "traces" / "steps.json").unlink()
    rc, out, err = _calibrate(capsys, run, out=tmp_path / "cal.json")
    assert rc == 0, err
    assert "note: run run: traces/steps.json missing: the profiled steps' lengths are taken as those of every logged step" in out
    assert "run run: traces/steps.json missing" in load_calibration(tmp_path / "cal.json").notes


# ---------------------------------------------------------------------------------------------------- metrics.jsonl

def _edit_metrics(run: Path, line: int, text: str | None = None, **update) -> None:
    """Replace 1-based line ``line`` of metrics.jsonl by ``text``, or update its fields (None: remove one)."""
    p = run / "metrics.jsonl"
    lines = p.read_text().splitlines()
    if text is None:
        row = json.loads(lines[line - 1])
        for k, v in update.items():
            if v is None:
                row.pop(k, None)
            else:
                row[k] = v
        text = json.dumps(row)
    lines[line - 1] = text
    p.write_text("\n".join(lines) + "\n")


@pytest.mark.parametrize("line, text, update, why", [
    (4, '{"step": 3, "loss": 0.9', {}, "metrics.jsonl:4: the line is not JSON"),
    (4, "[3, 0.05]", {}, "metrics.jsonl:4: the line is [3, 0.05], not a JSON object"),
    (4, None, {"step": None}, "metrics.jsonl:4: the line has no 'step'"),
    (4, None, {"step": "3"}, "metrics.jsonl:4: 'step' is \"3\", not a step number"),
    (4, None, {"step": 2}, "metrics.jsonl:4: step 2 is logged twice (lines 3 and 4)"),
    (7, None, {"step_time_s": None}, "metrics.jsonl:7: 'step_time_s' of step 6 is missing"),
    (7, '{"step": 6, "step_time_s": NaN}', {}, "metrics.jsonl:7: 'step_time_s' of step 6 is nan"),
    (7, '{"step": 6, "step_time_s": null}', {}, "metrics.jsonl:7: 'step_time_s' of step 6 is null"),
    (7, None, {"step_time_s": -0.05}, "'step_time_s' of step 6 is -0.05, not a measured time"),
    (7, None, {"step_time_s": 0}, "'step_time_s' of step 6 is 0, not a measured time"),
    (7, None, {"step_time_s": "0.05"}, "'step_time_s' of step 6 is \"0.05\""),
    (7, None, {"seq_stats": [16, 4000, 1e6]}, "metrics.jsonl:7: 'seq_stats' is [16, 4000, 1000000.0], not an object"),
    (7, None, {"seq_stats": {"history": [16, 4000]}}, "'seq_stats' of sequence 'history' is [16, 4000]"),
    (7, None, {"seq_stats": {"history": [16, "4000", 1e6]}}, "'seq_stats' of sequence 'history'"),
    (7, None, {"seq_stats": {}}, "metrics.jsonl:7: 'seq_stats' has the sequences [], line 1 has ['history']"),
    (7, None, {"seq_max": {"history": [-3]}}, "'seq_max' of sequence 'history' is [-3]"),
])
def test_corrupt_metrics_lines_are_refused(run, tmp_path, capsys, line, text, update, why):
    _edit_metrics(run, line, text, **update)
    err = _refused(capsys, run, why, tmp_path=tmp_path)
    assert "coplan train" in err or "corrupt" in err


def test_a_truncated_last_metrics_line_is_refused(run, tmp_path, capsys):
    p = run / "metrics.jsonl"
    p.write_text(p.read_text()[:-25])  # cut inside the last line, as a run stopped mid-write leaves it
    _refused(capsys, run, f"metrics.jsonl:{STEPS}: the line is not JSON", "cut short", tmp_path=tmp_path)


def test_metrics_that_are_not_text_are_refused(run, tmp_path, capsys):
    (run / "metrics.jsonl").write_bytes(b'{"step": 0}\n\xff\xfe\x00garbage\n')
    _refused(capsys, run, "metrics.jsonl: not UTF-8 text", tmp_path=tmp_path)


def test_metrics_without_length_statistics_is_a_note(run, tmp_path, capsys):
    """A trainer before ``seq_stats``: the run is priced at the workload's lengths, and says so."""
    p = run / "metrics.jsonl"
    rows = [json.loads(x) for x in p.read_text().splitlines()]
    p.write_text("".join(json.dumps({k: v for k, v in r.items() if k not in ("seq_stats", "seq_max")}) + "\n" for r in rows))
    rc, out, err = _calibrate(capsys, run, out=tmp_path / "cal.json")
    assert rc == 0, err
    assert "note: run run: metrics.jsonl logs no seq_stats (a trainer before them)" in out


@pytest.mark.parametrize("how", ["missing", "empty"])
def test_missing_or_empty_metrics_is_a_note(run, tmp_path, capsys, how):
    p = run / "metrics.jsonl"
    p.unlink() if how == "missing" else p.write_text("\n")
    rc, out, err = _calibrate(capsys, run, out=tmp_path / "cal.json")
    assert rc == 0, err
    note = f"metrics.jsonl {how}: its ops are priced at the workload's nominal sequence lengths"
    assert f"note: run run: {note}" in out
    assert note in load_calibration(tmp_path / "cal.json").notes


# ---------------------------------------------------------------------------------------------------- summary.json

def _edit_summary(run: Path, **update) -> None:
    p = run / "summary.json"
    doc = json.loads(p.read_text())
    for k, v in update.items():
        if v is None:
            doc.pop(k)
        else:
            doc[k] = v
    p.write_text(json.dumps(doc))


def test_a_summary_that_is_not_json_is_refused(run, tmp_path, capsys):
    p = run / "summary.json"
    p.write_text(p.read_text()[:40])  # truncated
    _refused(capsys, run, "summary.json: invalid", "not valid JSON", "the summary is corrupt: re-run the run",
             tmp_path=tmp_path)


@pytest.mark.parametrize("update, field", [
    ({"world_size": None}, "world_size"),  # missing
    ({"steps": "ten"}, "steps"),  # wrong type
    ({"step_time": {"mean_s": 0.05, "p50_s": -1, "p90_s": 0.05, "p99_s": 0.05, "min_s": 0.05, "max_s": 0.05}},
     "step_time.p50_s"),
])
def test_a_summary_with_a_bad_field_is_refused(run, tmp_path, capsys, update, field):
    _edit_summary(run, **update)
    _refused(capsys, run, "summary.json: invalid", f"  - {field}: ", "the summary is corrupt: re-run the run",
             tmp_path=tmp_path)


def test_a_summary_with_nan_is_refused(run, tmp_path, capsys):
    p = run / "summary.json"
    doc = json.loads(p.read_text())
    doc["step_time"]["p50_s"] = float("nan")
    p.write_text(json.dumps(doc))  # (writes NaN)
    _refused(capsys, run, "summary.json", "p50_s", tmp_path=tmp_path)


@pytest.mark.parametrize("name", ["step_time", "host_step"])
def test_a_zero_step_time_in_the_summary_is_refused(run, tmp_path, capsys, name):
    st = {"mean_s": 0.0, "p50_s": 0.0, "p90_s": 0.0, "p99_s": 0.0, "min_s": 0.0, "max_s": 0.0}
    _edit_summary(run, **{name: st})
    _refused(capsys, run, "summary.json", f"{name}.p50_s is 0.0: a measured step takes time", tmp_path=tmp_path)


def test_a_summary_of_another_world_size_is_refused(run, tmp_path, capsys):
    _edit_summary(run, world_size=8)
    _refused(capsys, run, "summary.json: world_size is 8", "plan.json is a plan for 1 GPU(s)", tmp_path=tmp_path)


def test_a_missing_summary_is_a_note(run, tmp_path, capsys):
    (run / "summary.json").unlink()
    rc, out, err = _calibrate(capsys, run, out=tmp_path / "cal.json")
    assert rc == 0, err
    assert "note: run run: summary.json missing (an unfinished run?)" in out and "adds no measured step time" in out


def test_a_summary_without_a_step_time_is_a_note(run, tmp_path, capsys):
    _edit_summary(run, step_time=None)
    rc, out, err = _calibrate(capsys, run, out=tmp_path / "cal.json")
    assert rc == 0, err
    assert "note: run run: summary.json records no step_time" in out


# ---------------------------------------------------------------------------------------------------------- traces

def _trace(run: Path) -> Path:
    return run / "traces" / "rank0.json"


def _gzip(run: Path) -> Path:
    p = _trace(run)
    gz = p.with_name("rank0.json.gz")
    gz.write_bytes(gzip.compress(p.read_bytes()))
    p.unlink()
    return gz


_DAMAGE = {"truncated": lambda data: data[: len(data) // 2], "empty": lambda data: b"",
           "not gzip": lambda data: b"this is not gzip data at all"}


@pytest.mark.parametrize("gzipped, damage, says", [
    (False, "truncated", ("rank0.json: not a readable JSON trace", "truncated or corrupt")),
    (False, "empty", ("rank0.json: empty (0 bytes)",)),
    (True, "truncated", ("rank0.json.gz: not a readable gzip file", "truncated or corrupt")),
    (True, "not gzip", ("rank0.json.gz: not a readable gzip file",)),
])
def test_a_damaged_trace_is_refused(run, tmp_path, capsys, gzipped, damage, says):
    p = _gzip(run) if gzipped else _trace(run)
    p.write_bytes(_DAMAGE[damage](p.read_bytes()))
    _refused(capsys, run, *says, tmp_path=tmp_path)


def test_a_valid_gzipped_trace_fits_as_the_plain_one(run, valid_run):
    _gzip(run)
    assert run_samples(run).samples == run_samples(valid_run).samples


@pytest.mark.parametrize("doc, why", [
    ([], "not a Kineto trace (no 'traceEvents' list)"),
    ({"traceEvents": []}, "holds no complete ('ph': 'X') event"),
    ({"traceEvents": [{"ph": "M", "name": "process_name"}]}, "holds no complete ('ph': 'X') event"),
])
def test_a_trace_without_events_is_refused(run, tmp_path, capsys, doc, why):
    _trace(run).write_text(json.dumps(doc))
    _refused(capsys, run, "rank0.json", why, tmp_path=tmp_path)


@pytest.mark.parametrize("change, why", [
    (lambda e: "not an event", "traceEvents[5] is \"not an event\", not an event object"),
    (lambda e: {**e, "dur": "12.5"}, "traceEvents[5] ('aten::mm') has 'dur' \"12.5\", not a finite duration"),
    (lambda e: {**e, "dur": -4.0}, "has 'dur' -4.0, not a finite duration >= 0"),
    (lambda e: {**e, "dur": float("nan")}, "has 'dur' nan"),
    (lambda e: {k: v for k, v in e.items() if k != "ts"}, "has 'ts' missing, not a finite time"),
    (lambda e: {**e, "tid": [1]}, "has 'tid' [1], not a thread number or name"),
    (lambda e: {**e, "args": "x"}, "has 'args' \"x\", not an object"),
    (lambda e: {**e, "args": {"Sequence number": "7"}}, "has args['Sequence number'] \"7\", not an integer"),
])
def test_a_corrupt_trace_event_is_refused(run, tmp_path, capsys, change, why):
    p = _trace(run)
    doc = json.loads(p.read_text())
    assert doc["traceEvents"][5]["name"] == "aten::mm"  # (the second op's cpu op)
    doc["traceEvents"][5] = change(doc["traceEvents"][5])
    p.write_text(json.dumps(doc))
    _refused(capsys, run, "rank0.json", why, "the trace is corrupt", tmp_path=tmp_path)


def test_a_trace_without_profiler_steps_is_a_note(run, tmp_path, capsys):
    p = _trace(run)
    doc = json.loads(p.read_text())
    doc["traceEvents"] = [e for e in doc["traceEvents"] if not e["name"].startswith("ProfilerStep#")]
    p.write_text(json.dumps(doc))
    rc, out, err = _calibrate(capsys, run, out=tmp_path / "cal.json")
    assert rc == 0, err
    assert "note: run run: traces/rank0.json has no 'ProfilerStep#N' ranges: its host side is not profiled" in out


def test_notes_are_in_the_json_report(run, tmp_path, capsys):
    (run / "summary.json").unlink()
    assert main(["calibrate", str(run), "-o", str(tmp_path / "cal.json"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["runs"][0]["notes"][0].startswith("summary.json missing (an unfinished run?)")


def test_a_run_without_its_ranks_trace_is_refused(run, tmp_path, capsys):
    _trace(run).unlink()
    _refused(capsys, run, "no trace for rank 0 under traces/", tmp_path=tmp_path)


# ------------------------------------------------------------------------------------------------ the run directory

def test_what_is_not_a_run_directory_is_refused(run, tmp_path, capsys):
    _refused(capsys, tmp_path / "nope", "nope: not a run directory (no such directory)", "coplan train", tmp_path=tmp_path)
    (tmp_path / "file").write_text("x")
    _refused(capsys, tmp_path / "file", "file: not a run directory (a file, not a folder)", tmp_path=tmp_path)
    (tmp_path / "empty").mkdir()
    _refused(capsys, tmp_path / "empty", "empty: not a run directory (an empty folder: no plan.json)", tmp_path=tmp_path)
    (run / "plan.json").unlink()
    _refused(capsys, run, "run: has no plan.json, so it is no run directory `coplan train` wrote", tmp_path=tmp_path)


def test_a_run_given_twice_is_refused(run, tmp_path, capsys):
    _refused(capsys, run, "the run is given twice", "count twice", tmp_path=tmp_path,
             dirs=(run, run.parent / ".." / run.parent.name / "run"))


def test_one_bad_run_among_good_ones_refuses_the_calibration(run, valid_run, tmp_path, capsys):
    """No run is skipped: a corrupt one stops the fit (the others' fit alone would be a different calibration)."""
    (run / "traces" / "steps.json").write_text("[2, 3")
    _refused(capsys, run, str(run / "traces" / "steps.json"), tmp_path=tmp_path, dirs=(valid_run, run))
