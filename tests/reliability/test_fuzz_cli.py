"""Bad input everywhere (issue 9): hypothesis-generated command lines for every verb, each holding
at least one bad input (a missing file, a malformed file, an unknown preset, a junk value), end with
a usage error or a typed error message, never a traceback, an internal error or a hang.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os

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
