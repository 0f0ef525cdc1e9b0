"""The CLI: help for every verb, validate on every preset, typed errors without tracebacks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from coplan.cli import VERBS, main

ROOT = Path(__file__).resolve().parents[1]


def _run(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "coplan.cli", *args], capture_output=True, text=True, cwd=cwd, timeout=300)


def test_help_lists_every_verb():
    out = _run("--help")
    assert out.returncode == 0
    for verb in ("plan", "report", "train", "calibrate", "simulate", "validate", "schema"):
        assert verb in out.stdout


@pytest.mark.parametrize("verb", list(VERBS))
def test_every_verb_has_help(verb, capsys):
    with pytest.raises(SystemExit) as e:
        main([verb, "--help"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip()


def test_validate_all_presets_by_path():
    files = sorted(str(p) for p in (ROOT / "topologies").glob("*.yaml")) + sorted(str(p) for p in (ROOT / "workloads").glob("*.yaml"))
    assert len(files) >= 10
    out = _run("validate", *files)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"{len(files)} valid, 0 invalid" in out.stdout


def test_validate_reports_bad_files_without_traceback(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\ngpu: {name: g}\ntiers: []\n")
    out = _run("validate", str(bad))
    assert out.returncode == 2
    assert "Traceback" not in out.stdout + out.stderr
    assert "gpu.peak_flops_per_s: required field is missing" in out.stdout
    js = _run("validate", "--json", str(bad), "gem-tiny")
    rows = json.loads(js.stdout)
    assert [r["ok"] for r in rows] == [False, True]


def test_schema_prints_json_schema(tmp_path):
    out = _run("schema", "topology")
    assert out.returncode == 0
    schema = json.loads(out.stdout)
    assert schema["title"] == "Topology"
    assert schema["properties"]["tiers"]["description"]
    out = _run("schema", "-o", str(tmp_path))
    assert out.returncode == 0
    assert {p.name for p in tmp_path.iterdir()} >= {"topology.schema.json", "workload.schema.json", "plan.schema.json"}


def test_unknown_verb_is_a_usage_error():
    out = _run("frobnicate")
    assert out.returncode == 2
    assert "Traceback" not in out.stderr


def test_a_broken_verb_is_an_internal_error_not_a_missing_part(monkeypatch, capsys):
    """An import error inside a verb's module is a bug, reported as one (not as a part not built yet)."""
    monkeypatch.setitem(VERBS, "plan", ("coplan.no_such_module_for_the_test", "broken"))
    assert main(["plan", "--help"]) == 1
    err = capsys.readouterr().err
    assert "internal error" in err and "no_such_module_for_the_test" in err


def test_train_without_the_training_extra_names_it(monkeypatch, tmp_path, capsys):
    """`coplan train` on the light install: one message naming the extra, before torchrun starts."""
    import importlib.util

    from coplan.spec import dump_spec, load_topology, load_workload
    from coplan.planner.given import single_process_plan

    plan = dump_spec(single_process_plan(load_workload("gem-tiny"), load_topology("h200-1gpu"), attention_backend="reference"),
                     tmp_path / "plan.json")
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torch" else find_spec(name, *a))
    assert main(["train", str(plan), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "pip install 'coplan[train]'" in err and "coplan train" in err and "torch" in err


def test_a_verb_imports_only_its_own_part():
    """`coplan train` needs neither OR-Tools nor Plotly (a GPU machine may have neither); `coplan plan` no torch."""
    import subprocess
    import sys

    code = ("import sys, coplan.cli as c; c.build_parser(['train', 'p.json'], every_verb=False); "
            "assert not {'ortools', 'plotly'} & set(sys.modules), sorted({'ortools', 'plotly'} & set(sys.modules))")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    code = ("import sys, coplan.cli as c; c.build_parser(['plan'], every_verb=False); "
            "assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def _refusal(argv: list[str], capsys) -> str:
    """The one error line of a refused command (exit 2, no traceback)."""
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err and "internal error" not in err, err
    return err.strip().splitlines()[-1]


@pytest.mark.parametrize("argv, value", [
    (["simulate", "-w", "gem-tiny", "-t", "h200-1gpu", "--gpus", "0"], "'0'"),
    (["simulate", "-w", "gem-tiny", "-t", "h200-1gpu", "--gpus", "8,1e-06"], "1e-06"),
    (["plan", "-t", "h200-1gpu", "-w", "gem-tiny", "--pin", "dp_shard=1e-06"], "1e-06"),
    (["plan", "-t", "h200-1gpu", "-w", "gem-tiny", "--pin", "dp_shard=3"], "3"),
    (["train", "p.json", "--trace", "5:1"], "5:1"),
])
def test_a_refusal_states_the_value_once(argv, value, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    line = _refusal([*argv, "-o", str(tmp_path / "p.json"), "--quiet"] if argv[0] == "plan" else argv, capsys)
    assert line.count(value) == 1, line
    assert "give" in line  # and the fix


def test_a_list_flag_names_the_bad_item_and_the_range_once(capsys):
    line = _refusal(["simulate", "-w", "gem-tiny", "-t", "h200-1gpu", "--gpus", "8,x"], capsys)
    assert "argument --gpus: 'x' (item 2 of 2) is not a whole number; give comma-separated integers from 1 to 1,048,576" in line
    assert line.count("1,048,576") == 1


def test_the_batch_split_suggests_only_gpu_counts_the_topology_takes(tmp_path, capsys):
    """100 samples over 24 GPUs of 8-GPU nodes: 10 and 20 GPUs divide the batch but are not whole nodes, which
    --gpus refuses next; the counts suggested are ones it takes."""
    from coplan.planner.mesh import check_world_size
    from coplan.spec import dump_spec, load_topology, load_workload

    w = load_workload("gem-tiny")
    w = type(w).model_validate(w.model_copy(update={"batch": w.batch.model_copy(update={"global_batch_size": 100})}).model_dump())
    path = dump_spec(w, tmp_path / "w100.yaml")
    line = _refusal(["plan", "-t", "h200-superpod-1k", "-w", str(path), "--gpus", "24", "-o", str(tmp_path / "p.json"),
                     "--quiet"], capsys)
    assert "does not split evenly over 24 GPUs" in line and line.endswith("or plan on a GPU count that divides 100 (--gpus 2, 4, 5)")
    topology = load_topology("h200-superpod-1k")
    for n in (2, 4, 5):
        assert check_world_size(topology, n) == n
