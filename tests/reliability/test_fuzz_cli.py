"""Bad input everywhere (issue 9): hypothesis-generated command lines for every verb, each holding
at least one bad input (a missing file, a malformed file, an unknown preset, a junk value), end with
a usage error or a typed error message, never a traceback, an internal error or a hang.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import random
import signal
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coplan.cli import VERBS, build_parser, main

PARSER = build_parser()


def _verb_options(verb: str) -> list[tuple[str, bool]]:
    """(option string, takes a value) for every optional argument of a verb."""
    sub = next(a for a in PARSER._actions if isinstance(a, argparse._SubParsersAction))
    p = sub.choices[verb]
    out = []
    for a in p._actions:
        if a.option_strings and not isinstance(a, argparse._HelpAction):
            out.append((a.option_strings[-1], a.nargs != 0))
    return out


BAD_FILES = {
    "missing.yaml": None,
    "empty.yaml": "",
    "list.yaml": "- 1\n- 2\n",
    "broken.yaml": "name: [unclosed\n",
    "broken.json": "{\"a\": ",
    "wrongkind.json": "{\"run_id\": \"x\", \"world_size\": 0, \"steps\": -1, \"warmup_steps\": 0}",
    "topology-typo.yaml": "name: t\ngpu: {name: g, peak_flops_per_s: {bf16: 1e15}, hbm_bytes: 1e9, hbm_bw_bytes_per_s: 1e12}\n"
                          "gpus_per_node: 8\ntiers: [{name: nvlink, size: 8, bw_bytes_per_s: -1, latency_s: 0}]\n"
                          "reliability: {gpu_mtbf_hours: 1, checkpoint_bw_bytes_per_sec: 1}\n",
    "plan.json": "{\"world_size\": 4, \"mesh\": {\"dense_shard\": 3}}",
}

JUNK = st.one_of(
    st.sampled_from(["gem-tinny", "h200-superpod-9k", "-1", "0", "nan", "1e999", "", " ", "--", "../../etc", "∞", "a" * 300]),
    st.text(min_size=0, max_size=12),
    st.integers(-10**6, 10**6).map(str),
)


@pytest.fixture(scope="module")
def bad_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("bad")
    for name, text in BAD_FILES.items():
        if text is not None:
            (d / name).write_text(text)
    (d / "run").mkdir()  # a directory that is not a run
    return d


@pytest.fixture(scope="module")
def in_tmp_cwd(tmp_path_factory):
    """Nothing a verb writes lands in the checkout."""
    old = os.getcwd()
    os.chdir(tmp_path_factory.mktemp("cwd"))
    yield
    os.chdir(old)


def _bad_value(data, bad_dir) -> str:
    choice = data.draw(st.sampled_from(sorted(BAD_FILES) + ["run", "junk"]))
    return data.draw(JUNK) if choice == "junk" else str(bad_dir / choice)


@settings(max_examples=500, deadline=20000)
@given(data=st.data())
def test_bad_command_lines_never_escape(data, bad_dir, in_tmp_cwd):
    verb = data.draw(st.sampled_from(sorted(VERBS)))
    opts = _verb_options(verb)
    argv = [verb]
    # positional junk or bad files first (most verbs take files), then options with values
    for _ in range(data.draw(st.integers(0, 2))):
        argv.append(_bad_value(data, bad_dir))
    for _ in range(data.draw(st.integers(0, 3))):
        if not opts:
            break
        opt, takes = data.draw(st.sampled_from(opts))
        argv.append(opt)
        if takes:
            argv.append(_bad_value(data, bad_dir))
    # Something an input is always bad, so no example runs a real (minute-long) plan or training:
    # verbs that read files get a bad file where they read it.
    bad_file = str(bad_dir / data.draw(st.sampled_from([n for n in BAD_FILES if n != "plan.json"] + ["run"])))
    if verb in ("report", "train", "calibrate", "validate"):
        argv.insert(1, bad_file)
    elif verb in ("plan", "simulate"):
        argv += [data.draw(st.sampled_from(["-t", "-w"])), bad_file]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as e:  # argparse usage errors and --help/--version
            code = e.code if isinstance(e.code, int) else 2
    text = out.getvalue() + err.getvalue()
    assert "Traceback" not in text, (argv, text)
    assert "internal error" not in text, (argv, text)
    assert code in (0, 1, 2, 3, 4), (argv, code, text)
    if code not in (0,):
        assert text.strip(), (argv, "failed silently")


# --- every flag of every verb (issue 25) -------------------------------------------------------------
# The cases below are enumerated (and the drawn ones derandomized): the same ones run everywhere. Each runs
# `main` in this process under a per-case alarm, and asserts: exit 2 (never 0), one readable error, no
# traceback, no "internal error", nothing written where the command would write, and no input changed.

CASE_TIMEOUT_S = 20
BAD_NUMBERS = ["-3", "-1", "0", "1.5", "nan", "NaN", "inf", "-inf", "1e20", "1e999", "9" * 30, "abc", "", " ",
               "0x10", "1_000", "\u0661\u0662", "4.0"]


def _sub(verb: str) -> argparse.ArgumentParser:
    sub = next(a for a in PARSER._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[verb]


def _checked_flags() -> list[tuple[str, str, object]]:
    """(verb, flag, type) for every option whose value a coplan.cli_args helper (or a verb's own type) checks."""
    out = []
    for verb in sorted(VERBS):
        for a in _sub(verb)._actions:
            t = a.type
            if a.option_strings and t is not None and getattr(t, "__module__", "").startswith("coplan."):
                out.append((verb, a.option_strings[-1], t))
    return out


def _rejects(t, value: str) -> bool:
    try:
        t(value)
    except argparse.ArgumentTypeError:
        return True
    return False


BAD_FLAG_CASES = [pytest.param(verb, flag, v, id=f"{verb}{flag}={v!r}")
                  for verb, flag, t in _checked_flags() for v in BAD_NUMBERS if _rejects(t, v)]


class _Hang(Exception):
    pass


def _alarm(signum, frame):
    raise _Hang(f"no answer within {CASE_TIMEOUT_S} s")


def _run_main(argv: list[str]) -> tuple[int, str]:
    out, err = io.StringIO(), io.StringIO()
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(CASE_TIMEOUT_S)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(argv)
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else 2
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    return code, out.getvalue() + err.getvalue()


def _snapshot(*folders: Path) -> dict[str, bytes]:
    return {str(p): p.read_bytes() for f in folders for p in sorted(f.rglob("*")) if p.is_file()}


def _refused(argv: list[str], *watch: Path, codes=(2,)) -> str:
    """Run ``argv``; assert it is refused cleanly and that nothing under ``watch`` changed."""
    before = _snapshot(*watch)
    code, text = _run_main(argv)
    assert code in codes, (argv, code, text)
    assert "Traceback" not in text and "internal error" not in text, (argv, text)
    assert text.strip().count("\n") < 40 and ("error" in text or "invalid" in text), (argv, text)
    assert _snapshot(*watch) == before, (argv, "files written or changed")
    return text


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    """A workspace: valid inputs (a plan, a topology file, a calibration, a run folder) and a cwd of its own."""
    from coplan.planner.given import given_plan
    from coplan.spec import dump_spec, load_topology, load_workload

    d = tmp_path_factory.mktemp("ws")
    old = os.getcwd()
    os.chdir(d)
    plan = dump_spec(given_plan(load_workload("gem-tiny"), load_topology("h200-1gpu"), 1, tables="table_wise"), d / "plan.json")
    topo = dump_spec(load_topology("h200-1gpu"), d / "topo.yaml")
    (d / "sweep.json").write_text('{"points": []}')
    (d / "run").mkdir()
    (d / "run" / "summary.json").write_text("{}")
    (d / "out").mkdir()
    yield {"dir": d, "plan": str(plan), "topo": str(topo), "sweep": str(d / "sweep.json"), "run": str(d / "run"),
           "out": d / "out"}
    os.chdir(old)


def _positionals(verb: str, ws) -> list[str]:
    return {"report": [ws["plan"]], "train": [ws["plan"]], "diff": [ws["plan"], ws["plan"]],
            "simulate": ["-w", "gem-tiny", "-t", "h200-1gpu"]}.get(verb, [])


def test_every_checked_flag_has_bad_cases():
    flags = {(v, f) for v, f, _ in _checked_flags()}
    for want in [("plan", "--workers"), ("plan", "--seed"), ("plan", "--time-limit"), ("plan", "--gpus"),
                 ("simulate", "--gpus"), ("simulate", "--knob"), ("train", "--steps"), ("train", "--warmup"),
                 ("calibrate", "--rank"), ("sample-workload", "--seed")]:
        assert want in flags, want
    assert len(BAD_FLAG_CASES) >= 250


@pytest.mark.parametrize("verb, flag, value", BAD_FLAG_CASES)
def test_bad_flag_values_are_refused_naming_the_flag(verb, flag, value, ws):
    text = _refused([verb, *_positionals(verb, ws), f"{flag}={value}"], ws["dir"])
    assert flag in text and "usage" in text, text


@pytest.mark.parametrize("verb, flag", [pytest.param(v, o, id=f"{v}{o}") for v in sorted(VERBS) for o, takes in _verb_options(v)
                                        if takes and _sub(v)._option_string_actions[o].nargs is None])
def test_a_flag_without_its_value_is_refused(verb, flag, ws):
    text = _refused([verb, *_positionals(verb, ws), flag], ws["dir"])
    assert flag in text, text


BW = "bw_scale:leaf"
SIMULATE_CASES = [
    *[["--knob", BW, f"--values={v}"] for v in ["-1", "0", "nan", "inf", "-inf", "1,nan", "1,,2", "", "x", "1e999", "2e6"]],
    *[["--knob", "bw_scale:nope", "--values=2"], ["--knob", "bw_scale:", "--values=2"], ["--knob", "banana", "--values=1"]],
    *[["--knob", k, f"--values={v}"] for k in ("local_batch", "micro_batches", "dense_shard", "sparse_shard", "expert_parallel")
      for v in ["0", "-2", "1.5", "nan", "1e20", str(1 << 40), "a"]],
    *[["--knob", k, "--values=nope"] for k in ("balancing", "attention", "recompute", "fp8")],
    ["--values=1,2"], ["--values=1,2", "--gpus", "8"],
    ["--knob", "local_batch", "--values=" + ",".join(["8"] * 257)],
    *[["--gpus", g] for g in ["0", "-8", "8,0", "1000000000000", "8,,16", "", "nan", ",".join(["8"] * 300)]],
    ["--knob", "local_batch", "--values=8", "--gpus", "8,16"],
]


@pytest.mark.parametrize("extra", SIMULATE_CASES, ids=[" ".join(c)[:60] for c in SIMULATE_CASES])
def test_simulate_sweeps_are_checked_before_pricing(extra, ws):
    _refused(["simulate", "-w", "gem-tiny", "-t", "h200-superpod", *extra], ws["dir"])


def _output_cases(ws) -> list[tuple[list[str], str]]:
    d = ws["dir"]
    missing, folder = str(d / "missing" / "x.json"), str(ws["out"])
    plan_in = ["plan", "-t", ws["topo"], "-w", "gem-tiny", "--quiet"]
    cases = [
        [*plan_in, "-o", ws["topo"]], [*plan_in, "-o", missing], [*plan_in, "-o", folder], [*plan_in, "-o", ""],
        ["plan", "-t", "h200-1gpu", "-w", ws["topo"], "-o", ws["topo"]],
        [*plan_in, "-o", str(d / "out" / "p.json"), "--export-torchrec", ws["topo"]],
        [*plan_in, "-o", str(d / "out" / "p.json"), "--export-torchrec", missing],
        [*plan_in, "-o", str(d / "out" / "p.json"), "--export-torchrec", str(d / "out" / "p.json")],
        ["report", ws["plan"], "-o", ws["plan"]], ["report", ws["plan"], "-o", missing], ["report", ws["plan"], "-o", folder],
        ["report", ws["plan"], "--simulate", ws["sweep"], "-o", ws["sweep"]],
        ["report", ws["plan"], "--run", ws["run"], "-o", str(Path(ws["run"]) / "summary.json")],
        ["calibrate", "--collectives", ws["sweep"], "-o", ws["sweep"]],
        ["calibrate", "--collectives", ws["sweep"], "-o", missing], ["calibrate", "--collectives", ws["sweep"], "-o", folder],
        ["calibrate", ws["run"], "-o", str(Path(ws["run"]) / "cal.json")],
        ["calibrate", "--collectives", ws["sweep"], "-o", str(d / "out" / "c.json"), "--apply-to", "h200-1gpu",
         "--topology-out", ws["sweep"]],
        ["calibrate", "--collectives", ws["sweep"], "-o", str(d / "out" / "c.json"), "--apply-to", ws["topo"],
         "--topology-out", ws["topo"]],
        ["calibrate", "--collectives", ws["sweep"], "-o", str(d / "out" / "c.json"), "--apply-to", "h200-1gpu",
         "--topology-out", missing],
        ["calibrate", "--collectives", ws["sweep"], "-o", str(d / "out" / "c.json")],  # an empty sweep: refused, nothing left
        ["sample-workload", "--family", "h200-1gpu", "--seed", "1", "-o", missing],
        ["sample-workload", "--family", "h200-1gpu", "--seed", "1", "-o", folder],
        ["schema", "topology", "-o", ws["topo"]],
        ["train", ws["plan"], "--device", "cpu", "--dry-run", "--resume", str(d / "nope")],
        ["train", ws["plan"], "--device", "cpu", "--dry-run", "--runs-root", ws["topo"]],
        ["train", ws["plan"], "--device", "cpu", "--dry-run", "--steps", "4", "--warmup", "4"],
        *[["train", ws["plan"], "--device", "cpu", "--dry-run", "--trace", t] for t in ("banana", "5:3", "3:3", "-1:2", "1:", "")],
    ]
    return cases


@pytest.mark.parametrize("i", range(33))
def test_outputs_are_checked_before_work_and_never_overwrite_inputs(i, ws):
    cases = _output_cases(ws)
    assert len(cases) == 33
    argv = cases[i]
    _refused(argv, ws["dir"])
    assert not (ws["dir"] / "missing").exists()


def _garbage_templates(ws, g: str, gdir: str) -> list[list[str]]:
    out = str(ws["out"] / "o.json")
    return [
        ["plan", "-t", g, "-w", "gem-tiny", "-o", out, "--quiet"], ["plan", "-t", "h200-1gpu", "-w", g, "-o", out, "--quiet"],
        ["plan", "-t", "h200-1gpu", "-w", "gem-tiny", "-c", g, "-o", out, "--quiet"],
        ["report", g, "-o", out], ["report", ws["plan"], "--calibration", g, "-o", out],
        ["report", ws["plan"], "--simulate", g, "-o", out], ["report", ws["plan"], "--run", gdir, "-o", out],
        ["calibrate", "--collectives", g, "-o", out], ["calibrate", gdir, "-o", out],
        ["calibrate", "--collectives", g, "--topology", g, "-o", out],
        ["diff", g, ws["plan"]], ["diff", ws["plan"], g], ["train", g, "--device", "cpu", "--dry-run"], ["validate", g],
        ["simulate", "-w", g, "-t", "h200-1gpu", "--gpus", "1"], ["simulate", "-w", "gem-tiny", "-t", g, "--gpus", "1"],
        ["simulate", "-w", "gem-tiny", "-t", "h200-1gpu", "--gpus", "1", "--calibration", g],
    ]


def _garbage(seed: int) -> bytes:
    rng = random.Random(seed)
    data = bytes(rng.randrange(256) for _ in range(rng.choice([1, 9, 100, 2000])))
    data = (b"{\"a\": " if seed % 3 == 1 else b"name: x\n" if seed % 3 == 2 else b"") + data
    return data if any(b > 127 or b == 0 for b in data) else data + b"\xff\x00"


GARBAGE_SEEDS = range(12)


@pytest.mark.parametrize("suffix", [".json", ".yaml"])
@pytest.mark.parametrize("seed", GARBAGE_SEEDS)
@pytest.mark.parametrize("t", range(17))
def test_binary_garbage_in_every_file_argument_is_named(t, seed, suffix, ws, tmp_path):
    g = tmp_path / f"garbage{suffix}"
    g.write_bytes(_garbage(seed))
    gdir = tmp_path / "grun"
    gdir.mkdir()
    for name in ("summary.json", "metrics.jsonl", "plan.json", "config.json"):
        (gdir / name).write_bytes(_garbage(seed + 100))
    argv = _garbage_templates(ws, str(g), str(gdir))[t]
    text = _refused(argv, ws["dir"], tmp_path)
    assert str(g) in text or str(gdir) in text or "usage" in text, (argv, text)


NUMERIC_FLAGS = [(v, f) for v, f, _ in _checked_flags()]


@settings(max_examples=400, deadline=None, derandomize=True)
@given(data=st.data())
def test_drawn_bad_values_of_several_flags_never_run(data, ws):
    """Several flags of a verb, one of them surely bad (a NaN, a negative, a huge or a junk value)."""
    verb, flag = data.draw(st.sampled_from(NUMERIC_FLAGS))
    t = dict(((v, f), ty) for v, f, ty in _checked_flags())[(verb, flag)]
    bad = data.draw(st.one_of(st.sampled_from(BAD_NUMBERS), st.floats(allow_nan=True, allow_infinity=True).map(repr),
                              st.integers(-10**40, 10**40).map(str), st.text(max_size=8)).filter(lambda v: _rejects(t, v)))
    pool = [f for v, f in NUMERIC_FLAGS if v == verb and f != flag]
    others = data.draw(st.lists(st.sampled_from(pool), max_size=2, unique=True)) if pool else []
    argv = [verb, *_positionals(verb, ws)]
    for f in others:
        argv.append(f"{f}={data.draw(st.sampled_from(['1', '2', '8', '0.5', '1:3']))}")
    argv.append(f"{flag}={bad}")
    code, text = _run_main(argv)
    assert code == 2, (argv, code, text)
    assert "Traceback" not in text and "internal error" not in text, (argv, text)


@pytest.mark.parametrize("verb", sorted(VERBS))
def test_a_nul_byte_in_any_argument_is_a_usage_error(verb, capsys):
    """A NUL byte can be in no file name or value (the OS refuses it wherever the path is used, as a ValueError that
    reached users as an internal error: `coplan calibrate RUN --output $'\\x00'`, found by the fuzz test above): every
    verb refuses it up front, naming the argument."""
    for argv in ([verb, "a\x00b"], [verb, "x.yaml", "--output", "\x00"]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "NUL byte" in err and "internal error" not in err and "Traceback" not in err
