"""The CLI's files, on what fuzzing found: outputs that are not regular files (a FIFO, a socket, a link loop:
refused before any work, never replaced), outputs that are symbolic links (written through), failed writes
named by the path given, empty arguments named by their flag, inputs that would hang or loop, files of the
wrong kind, and ``coplan validate`` on run summaries and run directories."""

from __future__ import annotations

import contextlib
import os
import signal
import socket

import pytest

from coplan.cli import main
from coplan.spec import RunResult, Topology, Workload, dump_spec, load_topology, load_workload
from coplan.spec.loader import preset_path

PLAN = ["plan", "-t", "h200-1gpu", "-w", "gem-tiny", "--quiet"]


def _run(argv: list[str], capsys, seconds: int = 60) -> tuple[int, str]:
    def on_alarm(signum, frame):
        raise TimeoutError(f"no answer within {seconds} s")
    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(seconds)
    try:
        try:
            code = main(argv)
        except SystemExit as e:
            code = e.code
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    out = capsys.readouterr()
    text = out.out + out.err
    assert "Traceback" not in text and "internal error" not in text, text
    return code, text


# ---- outputs -----------------------------------------------------------------------------------------------


def test_an_output_that_is_not_a_regular_file_is_refused_before_any_work(tmp_path, capsys, monkeypatch):
    import coplan.planner.cli as planner_cli

    def no_work(*a, **kw):
        raise AssertionError("planned although the output was refused")
    monkeypatch.setattr(planner_cli, "_make_plan", no_work)
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    (tmp_path / "loop.json").symlink_to(tmp_path / "loop.json")
    (tmp_path / "to-fifo.json").symlink_to(fifo)
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(tmp_path / "sock.json"))
        for name, what in (("fifo.json", "is a FIFO (named pipe), not a regular file"), ("sock.json", "is a socket"),
                           ("loop.json", "is a symbolic link loop"), ("to-fifo.json", "is a FIFO")):
            code, text = _run([*PLAN, "-o", str(tmp_path / name)], capsys)
            assert code == 2 and f"-o {tmp_path / name}: {what}" in text, text
            assert "will not replace it" in text
    assert fifo.is_fifo() and (tmp_path / "loop.json").is_symlink() and (tmp_path / "sock.json").is_socket()


def test_an_output_symlink_is_written_through_and_kept(tmp_path, capsys):
    (tmp_path / "plans").mkdir()
    target = tmp_path / "plans" / "real.json"
    target.write_text("{}\n")
    link = tmp_path / "plan.json"
    link.symlink_to(target)
    code, text = _run([*PLAN, "-o", str(link)], capsys)
    assert code == 0, text
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert '"world_size"' in target.read_text()
    dangling = tmp_path / "new.json"
    dangling.symlink_to(tmp_path / "plans" / "new-target.json")
    assert _run([*PLAN, "-o", str(dangling)], capsys)[0] == 0
    assert dangling.is_symlink() and (tmp_path / "plans" / "new-target.json").is_file()


def test_a_failed_write_names_the_path_given(tmp_path, capsys, monkeypatch):
    real_replace = os.replace

    def refuse(src, dst):
        if str(src).endswith(".tmp"):
            raise PermissionError(13, "Permission denied", src)
        return real_replace(src, dst)
    monkeypatch.setattr(os, "replace", refuse)
    out = tmp_path / "p.json"
    code, text = _run([*PLAN, "-o", str(out)], capsys)
    assert code == 2 and f"Permission denied: {out}" in text and ".tmp" not in text, text
    assert list(tmp_path.iterdir()) == []


# ---- inputs ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("argv, flag, what", [
    (["plan", "-t", "", "-w", "gem-tiny"], "--topology/-t", "path"),
    (["plan", "-w", "", "-t", "h200-1gpu"], "--workload/-w", "path"),
    (["plan", "-c", " "], "--calibration/-c", "path"),
    (["simulate", "-t", "", "-w", "gem-tiny"], "--topology/-t", "path"),
    (["calibrate", ""], "runs", "path"),
    (["report", ""], "plan", "path"),
    (["validate", "gem-tiny", ""], "files", "path"),
    (["plan", "-o", ""], "-o/--output", "path"),
    (["calibrate", "--collectives", "s.json", "--tier", ""], "--tier", "value"),
    (["calibrate", "--base", " "], "--base", "path"),            # a calibration file: its help says neither
    (["calibrate", "--apply-to", ""], "--apply-to", "path"),     # a topology preset or file
    (["simulate", "-w", ""], "--workload/-w", "path"),          # named before the missing --topology
    (["simulate", "-w", "gem-tiny", "-t", "h200-1gpu", "--knob", "fp8", "--values", ""], "--values", "value"),
    (["train", "p.json", "--trace", ""], "--trace", "value"),
    (["train", "p.json", "--master", " "], "--master", "value"),
    (["plan", "--pin-table", ""], "--pin-table", "value"),
    (["train", "p.json", ""], "plan", "path"),                   # one of a list (nargs='+')
])
def test_an_empty_argument_is_named_by_its_flag(argv, flag, what, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, text = _run(argv, capsys)
    assert code == 2 and f"argument {flag}: the {what} is empty" in text, text
    assert "'.'" not in text and "is a directory" not in text


@pytest.mark.parametrize("argv, default", [(["plan", "-t", ""], "h200-superpod-4k"), (["plan", "-o", " "], "plan.json"),
                                           (["report", "p.json", "-o", ""], "report.html"),
                                           (["simulate", "-c", "", "-w", "gem-tiny", "-t", "h200-1gpu"], "auto")])
def test_an_empty_option_with_a_default_says_that_leaving_it_out_gives_it(argv, default, capsys):
    code, text = _run(argv, capsys)
    assert code == 2 and f"is empty; give one, or leave the option out for its default ({default})" in text, text


def test_every_plain_string_argument_is_checked_where_argparse_reads_it():
    """Each argument that takes a string of its own (no choices) has a ``type=`` from coplan (``nonempty*`` or a
    stricter parser), so an empty value is refused by argparse naming its flag, with no check after parsing."""
    import argparse

    import coplan.cli as coplan_cli
    from coplan.cli import build_parser

    parser = build_parser()
    verbs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    unchecked = [(verb, a.dest) for verb, p in verbs.items() for a in p._actions
                 if a.nargs != 0 and not a.choices and not isinstance(a, argparse._HelpAction)
                 and not getattr(a.type, "__module__", "").startswith("coplan.")]
    # (coplan train's are checked after parsing, from coplan.cli.TRAIN_STRINGS: its registration is trainer code)
    assert sorted(d for v, d in unchecked if v == "train") == sorted(coplan_cli.TRAIN_STRINGS)
    assert [u for u in unchecked if u[0] != "train"] == []
    import coplan.cli
    assert not hasattr(coplan.cli, "refuse_empty_values")


def test_inputs_that_would_hang_or_loop_are_refused(tmp_path, capsys):
    fifo = tmp_path / "w.yaml"
    os.mkfifo(fifo)
    (tmp_path / "a.yaml").symlink_to(tmp_path / "b.yaml")
    (tmp_path / "b.yaml").symlink_to(tmp_path / "a.yaml")
    for path, what in ((fifo, "is a FIFO (named pipe), not a regular file"), (tmp_path / "a.yaml", "symbolic link loop")):
        code, text = _run(["plan", "-t", "h200-1gpu", "-w", str(path), "-o", str(tmp_path / "p.json")], capsys, seconds=20)
        assert code == 2 and str(path) in text and what in text, text
        code, text = _run(["validate", str(path)], capsys, seconds=20)
        assert code == 2 and what in text, text


def test_swapped_topology_and_workload_are_named(tmp_path, capsys):
    w, t = str(preset_path(Workload, "gem-tiny")), str(preset_path(Topology, "h200-1gpu"))
    code, text = _run(["plan", "-t", w, "-w", t, "-o", str(tmp_path / "p.json"), "--quiet"], capsys)
    assert code == 2 and f"{w}: invalid (1 problem)" in text
    assert "looks like a workload, given as the topology; did you swap the topology and the workload (-t and -w)?" in text
    assert "did you mean" not in text
    code, text = _run(["report", w, "-o", str(tmp_path / "r.html")], capsys)
    assert code == 2 and "looks like a workload, given as the plan" in text, text


# ---- validate: run summaries and run directories -----------------------------------------------------------


@pytest.fixture
def run_dir(tmp_path):
    from coplan.planner.given import single_process_plan

    d = tmp_path / "runs" / "r1"
    d.mkdir(parents=True)
    plan = single_process_plan(load_workload("gem-tiny"), load_topology("h200-1gpu"), attention_backend="reference")
    dump_spec(plan, d / "plan.json")
    dump_spec(RunResult(run_id="r1", world_size=1, steps=8, warmup_steps=2, device="cpu", workload="gem-tiny",
                        measured_mfu=0.25), d / "summary.json")
    return d


def test_validate_takes_a_run_summary_for_one(run_dir, capsys):
    code, text = _run(["validate", str(run_dir / "summary.json")], capsys)
    assert code == 0, text
    assert "run summary 'r1': 8 steps of 'gem-tiny' on 1 x cpu, measured MFU 25.0%" in text


def test_validate_checks_a_run_directorys_files(run_dir, tmp_path, capsys):
    code, text = _run(["validate", str(run_dir)], capsys)
    assert code == 0 and "2 valid, 0 invalid" in text, text
    assert f"ok    {run_dir / 'plan.json'}: plan" in text and f"ok    {run_dir / 'summary.json'}: run summary" in text
    (run_dir / "summary.json").write_text('{"run_id": "r1", "world_size": 0, "steps": 1, "warmup_steps": 0}')
    code, text = _run(["validate", str(run_dir)], capsys)
    assert code == 2 and "summary.json: invalid" in text and "world_size" in text, text
    (tmp_path / "empty").mkdir()
    code, text = _run(["validate", str(tmp_path / "empty")], capsys)
    assert code == 2 and "is a directory without plan.json or summary.json" in text, text
