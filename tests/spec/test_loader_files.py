"""The loader on what fuzzing found: files that are not regular files (FIFOs, link loops), empty paths,
documents that hold themselves, YAML 1.1 scalars read by YAML 1.2's rules, a file of the wrong kind, union
fields whose errors named pydantic's internals, and writes to what is not a regular file."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import time

import pytest
import yaml

from coplan.errors import CoplanError, PresetNotFoundError, SpecError
from coplan.spec import (Calibration, Plan, RunResult, Topology, Workload, dump_spec, load_any, load_calibration,
                         load_plan, load_topology, load_workload, parse_spec, write_text_atomic)
from coplan.spec.loader import load_document, preset_path, read_text, sniff_kind, yaml_dump, yaml_load


@contextlib.contextmanager
def _within(seconds: int):
    """Fail, not hang, when the block takes longer than ``seconds``."""
    def on_alarm(signum, frame):
        raise TimeoutError(f"no answer within {seconds} s")
    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def _preset_text(kind, name):
    return preset_path(kind, name).read_text()


# ---- input files that are not regular files; empty paths -------------------------------------------------


@pytest.mark.parametrize("load", [load_workload, load_any, load_document])
def test_a_fifo_is_refused_before_it_is_opened(tmp_path, load):
    fifo = tmp_path / "w.yaml"
    os.mkfifo(fifo)
    with _within(10), pytest.raises(SpecError) as e:
        load(fifo)
    assert str(fifo) in str(e.value) and "FIFO (named pipe), not a regular file" in str(e.value)


def test_a_socket_is_refused(tmp_path):
    path = tmp_path / "t.yaml"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(path))
        with pytest.raises(SpecError, match="is a socket, not a regular file"):
            load_topology(path)


@pytest.mark.parametrize("load", [load_workload, load_any, load_document])
def test_a_symlink_loop_and_a_broken_link_are_named(tmp_path, load):
    (tmp_path / "a.yaml").symlink_to(tmp_path / "b.yaml")
    (tmp_path / "b.yaml").symlink_to(tmp_path / "a.yaml")
    with pytest.raises(SpecError) as e:
        load(tmp_path / "a.yaml")
    assert str(tmp_path / "a.yaml") in str(e.value) and "symbolic link loop" in str(e.value)
    (tmp_path / "c.yaml").symlink_to(tmp_path / "gone.yaml")
    with pytest.raises(SpecError, match="symbolic link to .*gone.yaml', which does not exist"):
        load(tmp_path / "c.yaml")


def test_a_symlink_to_a_spec_is_read(tmp_path):
    (tmp_path / "w.yaml").symlink_to(preset_path(Workload, "gem-tiny"))
    assert load_workload(tmp_path / "w.yaml").name == "gem-tiny"


def test_an_empty_path_is_not_the_current_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for load, what in ((load_topology, "topology"), (load_workload, "workload"), (load_calibration, "calibration")):
        with pytest.raises(PresetNotFoundError, match=f"the {what} path is empty"):
            load(" " if what == "workload" else "")
    with pytest.raises(PresetNotFoundError, match="the path is empty"):
        load_any("")
    with pytest.raises(SpecError, match="the path is empty"):
        read_text("")


# ---- documents that hold themselves ------------------------------------------------------------------------


@pytest.mark.parametrize("text, path, back_to", [
    ("a: &x\n  b: *x\n", "a.b", "'a'"),
    ("name: t\nblocks:\n  - &x {type: dense_mlp, layers: [*x]}\n", "blocks[0].layers[0]", "'blocks[0]'"),
    ("&x [1, *x]\n", "[1]", "the document's root"),
])
def test_a_cyclic_document_is_refused_where_it_cycles(tmp_path, text, path, back_to):
    p = tmp_path / "rec.yaml"
    p.write_text(text)
    t0 = time.perf_counter()
    with _within(20), pytest.raises(SpecError) as e:
        load_any(p)
    assert time.perf_counter() - t0 < 5
    [(got_path, reason)] = e.value.issues
    assert got_path == path and f"refers back to {back_to}" in reason and "specs cannot be cyclic" in reason
    assert str(p) in str(e.value)


def test_an_alias_used_twice_is_not_a_cycle():
    assert yaml_load("a: &x {k: [1]}\nb: [*x, *x]\n") == {"a": {"k": [1]}, "b": [{"k": [1]}, {"k": [1]}]}


# ---- YAML 1.2 scalars --------------------------------------------------------------------------------------


@pytest.mark.parametrize("text, value", [
    ("off", "off"), ("on", "on"), ("yes", "yes"), ("No", "No"), ("y", "y"), ("OFF", "OFF"),
    ("true", True), ("False", False), ("TRUE", True),
    ("64", 64), ("-3", -3), ("0x40", 64), ("0o17", 15), ("010", 10), ("6_4", "6_4"), ("1:30", "1:30"),
    ("1e5", 1e5), ("-.5", -0.5), ("6_4.0", "6_4.0"), ("2026-01-01", "2026-01-01"), ("~", None), ("=", "="),
])
def test_plain_scalars_resolve_as_yaml_1_2_core(text, value):
    got = yaml_load(f"k: {text}\n")["k"]
    assert got == value and type(got) is type(value)


@pytest.mark.parametrize("text", ["off", "on", "yes", "0o17", "-.5", "1e5", "010", "true", "6_4"])
def test_strings_that_look_like_scalars_round_trip(text):
    dumped = yaml_dump({"k": text})
    assert yaml_load(dumped) == {"k": text}
    assert yaml.safe_load(dumped) == {"k": text}  # quoted for YAML 1.1 readers too


def test_off_and_a_task_named_on_load_as_written(tmp_path):
    text = _preset_text(Workload, "gem-tiny")
    text = text.replace("kernels: {attention: reference, embedding: fused}",
                        "kernels: {attention: reference, embedding: fused, cuda_graphs: off}")
    text = text.replace("precision:\n", "precision:\n  fp8: off\n").replace("tasks: [ctr, cvr]", "tasks: [ctr, on]")
    assert "cuda_graphs: off" in text and "fp8: off" in text and "[ctr, on]" in text
    p = tmp_path / "w.yaml"
    p.write_text(text)
    w = load_workload(p)
    assert w.kernels.cuda_graphs == "off" and w.precision.fp8 == "off"
    heads = next(b for b in w.blocks if b.type == "heads")
    assert list(heads.tasks) == ["ctr", "on"]


def test_yes_for_a_boolean_and_underscored_digits_say_how_to_write_them(tmp_path):
    text = _preset_text(Topology, "h200-superpod-1k")
    doc = yaml_load(text)
    doc["tiers"][0]["in_switch_reduction"] = "yes"
    with pytest.raises(SpecError) as e:
        parse_spec(Topology, doc, "t.yaml")
    [(path, reason)] = e.value.issues
    assert path == "tiers[0].in_switch_reduction" and "write true or false" in reason
    p = tmp_path / "w.yaml"
    p.write_text(_preset_text(Workload, "gem-tiny").replace("global_batch_size: 64", "global_batch_size: 6_4"))
    with pytest.raises(SpecError) as e:
        load_workload(p)
    [(path, reason)] = e.value.issues
    assert path == "batch.global_batch_size" and "write 64" in reason


# ---- a file of the wrong kind ------------------------------------------------------------------------------


def test_a_file_of_another_kind_says_so(tmp_path):
    workload, topology = preset_path(Workload, "gem-tiny"), preset_path(Topology, "h200-1gpu")
    with pytest.raises(SpecError) as e:
        load_topology(workload)
    assert e.value.issues == [("", "looks like a workload, given as the topology; did you swap the topology and the "
                                   "workload (-t and -w)?")]
    with pytest.raises(SpecError, match="looks like a topology, given as the workload; did you swap"):
        load_workload(topology)
    with pytest.raises(SpecError, match=r"looks like a workload, given as the plan; give a plan.json written by `coplan plan`"):
        load_plan(workload)
    with pytest.raises(SpecError, match="looks like a workload, given as the calibration; give a calibration.json"):
        load_calibration(workload)


def test_a_run_summary_is_sniffed_as_one(tmp_path):
    summary = RunResult(run_id="r1", world_size=2, steps=8, warmup_steps=2, device="cpu")
    assert sniff_kind(summary.model_dump(mode="json")) is RunResult
    assert load_any(dump_spec(summary, tmp_path / "summary.json")) == summary
    assert sniff_kind({"device": "NVIDIA H200", "op_classes": {}}) is Calibration
    assert sniff_kind({"world_size": 8, "mesh": {}}) is Plan


# ---- union fields ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("edit, path, words", [
    (lambda d: d["batch"].update(micro_batches=1e300), "batch.micro_batches", ["64-bit integer range", "or give 'auto'",
                                                                              "(got 1e+300)"]),
    (lambda d: d["batch"].update(micro_batches="x"), "batch.micro_batches", ["valid integer", "or give 'auto'", "(got 'x')"]),
    (lambda d: d["blocks"][1]["attention"].update(scale=-1), "blocks[1].attention.scale",
     ["greater than 0", "or give 'inv_max_len' or 'inv_sqrt_head_dim'", "(got -1)"]),
])
def test_a_union_field_gives_one_readable_issue(edit, path, words):
    doc = yaml_load(_preset_text(Workload, "gem-tiny"))
    assert doc["blocks"][1]["type"] == "interformer"
    edit(doc)
    with pytest.raises(SpecError) as e:
        parse_spec(Workload, doc, "w.yaml")
    [(got_path, reason)] = e.value.issues
    assert got_path == path, got_path
    assert all(w in reason for w in words), reason
    for internal in ("function-", "literal[", "functools", "0x"):
        assert internal not in got_path + reason


# ---- writing -----------------------------------------------------------------------------------------------


def test_writes_refuse_what_is_not_a_regular_file(tmp_path):
    fifo = tmp_path / "p.json"
    os.mkfifo(fifo)
    with pytest.raises(CoplanError, match="is a FIFO .*will not replace it"):
        write_text_atomic(fifo, "{}")
    assert fifo.is_fifo()
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    with pytest.raises(CoplanError, match="symbolic link loop"):
        write_text_atomic(tmp_path / "loop", "{}")
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_a_symlink_is_written_through_and_kept(tmp_path):
    (tmp_path / "real").mkdir()
    target = tmp_path / "real" / "t.yaml"
    target.write_text("old\n")
    link = tmp_path / "link.yaml"
    link.symlink_to(target)
    write_text_atomic(link, "new\n")
    assert link.is_symlink() and target.read_text() == "new\n"
    assert not [p for d in (tmp_path, tmp_path / "real") for p in d.iterdir() if p.name.endswith(".tmp")]


def test_a_failed_write_names_the_path_given_not_the_temporary_file(tmp_path, monkeypatch):
    def refuse(src, dst):
        raise PermissionError(13, "Permission denied", src)
    monkeypatch.setattr(os, "replace", refuse)
    with pytest.raises(PermissionError) as e:
        write_text_atomic(tmp_path / "p.json", "{}")
    assert e.value.filename == str(tmp_path / "p.json")
    assert list(tmp_path.iterdir()) == []
    monkeypatch.undo()

    def no_temp(*a, **kw):
        raise PermissionError(13, "Permission denied", "/x/.p.json.abc.tmp")
    monkeypatch.setattr("tempfile.mkstemp", no_temp)
    with pytest.raises(PermissionError) as e:
        write_text_atomic(tmp_path / "p.json", "{}")
    assert e.value.filename == str(tmp_path / "p.json")
