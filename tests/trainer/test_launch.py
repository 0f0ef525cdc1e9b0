"""Launch checks and the ``coplan train`` launcher (which needs no torch)."""

import subprocess
import sys

import pytest

from coplan.cli import main
from coplan.errors import MismatchError
from coplan.spec import dump_spec, load_topology, load_workload
from coplan.planner.given import given_plan
from coplan.trainer.train import check_launch


@pytest.fixture(scope="module")
def plan4():
    return given_plan(load_workload("gem-tiny"), load_topology("h200-superpod-1k"), 4, dense_replicate=2)


def test_world_size_mismatch_is_refused(plan4):
    with pytest.raises(MismatchError, match="plan is for 4 ranks .* 2 processes"):
        check_launch(plan4, world_size=2, local_world_size=2, device_type="cpu", device_name="cpu")
    check_launch(plan4, world_size=4, local_world_size=4, device_type="cpu", device_name="cpu")


def test_gpu_model_mismatch_is_refused(plan4):
    with pytest.raises(MismatchError, match="H200 GPUs but this machine has 'NVIDIA A100"):
        check_launch(plan4, world_size=4, local_world_size=4, device_type="cuda", device_name="NVIDIA A100-SXM4-80GB")
    check_launch(plan4, world_size=4, local_world_size=4, device_type="cuda", device_name="NVIDIA H200")
    check_launch(plan4, world_size=4, local_world_size=4, device_type="cuda", device_name="NVIDIA A100",
                 allow_device_mismatch=True)


def test_gpus_per_node_mismatch_is_refused():
    plan = given_plan(load_workload("gem-tiny"), load_topology("h200-superpod-1k"), 16)
    with pytest.raises(MismatchError, match="8 ranks on each node but 4"):
        check_launch(plan, world_size=16, local_world_size=4, device_type="cuda", device_name="NVIDIA H200")


def test_cli_refuses_wrong_nproc(plan4, tmp_path, capsys):
    path = dump_spec(plan4, tmp_path / "plan.json")
    assert main(["train", str(path), "--nproc", "2", "--device", "cpu"]) == 2
    assert "the plan is for 4 ranks but --nproc is 2" in capsys.readouterr().err


def test_cli_prints_one_torchrun_line_per_node(tmp_path, capsys):
    plan = given_plan(load_workload("gem-tiny"), load_topology("h200-superpod-1k"), 16, dense_replicate=2)
    path = dump_spec(plan, tmp_path / "plan.json")
    assert main(["train", str(path), "--steps", "5", "--master", "node0:29500"]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("torchrun")]
    assert len(lines) == 2
    assert "--node-rank=1" in lines[1] and "--nproc-per-node=8" in lines[1] and "--rdzv-endpoint=node0:29500" in lines[1]
    assert "-m coplan.trainer.train" in lines[0] and "--steps 5" in lines[0]


def test_launcher_does_not_import_torch():
    code = "import sys, coplan.cli as c; c.build_parser(); assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_every_launcher_option_reaches_the_trainer(plan4, tmp_path):
    """What `coplan train` forwards, the trainer's own parser accepts with the same value."""
    import argparse

    from coplan.trainer.cli import _FLAGS, _PASS, _trainer_args
    from coplan.trainer.train import _parse

    values = {"steps": 7, "warmup": 2, "runs_root": str(tmp_path), "run_id": "r", "resume": "auto", "data": str(tmp_path),
              "data_samples": 64, "seed": 3, "device": "cpu", "attention": "reference", "trace": "none",
              "checkpoint_every": 5, "keep_last_n": 1, "log_every": 2, "seq_chunk": 16, "compile": "layers",
              "cuda_graphs": "off", "fp8_guard_every": 7}
    assert set(values) == set(_PASS), "a forwarded option without a value in this test"
    args = argparse.Namespace(plan=str(tmp_path / "plan.json"), **values, **{k: True for k in _FLAGS})
    parsed = _parse(_trainer_args(args))
    for k, v in values.items():
        assert getattr(parsed, k) == v, k
    for k in _FLAGS:
        assert getattr(parsed, k) is True, k



def test_the_trainer_takes_only_what_the_launcher_passes():
    """No trainer option that `coplan train` cannot give (experiments patch the trainer in benchmarks/)."""
    from coplan.trainer.cli import _FLAGS, _PASS
    from coplan.trainer.train import _parse

    assert set(vars(_parse(["plan.json"]))) - {"plan"} == set(_PASS) | set(_FLAGS)

# ---- refused before torchrun starts (issue 21): coplan.trainer.cli.check_plans, torch-free ----------------------


def _edit_tables(plan, **kinds):
    """The plan with some tables' shards replaced: {table: (sharding_type, ranks)} (no planner involved)."""
    from coplan.spec import Plan
    from coplan.spec.plan import TableShard

    shards = [TableShard(table=t.table, sharding_type=kinds[t.table][0], ranks=kinds[t.table][1],
                         compute_kernel="dense" if kinds[t.table][0] == "data_parallel" else "fused")
              if t.table in kinds else t for t in plan.tables]
    return Plan.model_validate(plan.model_copy(update={"tables": tuple(shards)}).model_dump())


def _refused_without_torch(argv: list[str]) -> str:
    """Run `coplan <argv>` in a fresh interpreter; it must fail, print one clean error and never import torch."""
    code = ("import sys\nfrom coplan.cli import main\nrc = main(sys.argv[1:])\n"
            "assert 'torch' not in sys.modules, 'torch imported before the refusal'\nsys.exit(rc)")
    r = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "Traceback" not in r.stderr and r.stderr.count("error:") == 1, r.stderr
    return r.stderr


@pytest.mark.parametrize("table, kind, ranks, match", [
    ("ad_id", "row_wise", (1, 0, 2, 3), "row-wise shards must cover the sparse group in order"),
    ("hist_item", "table_row_wise", (0, 1), "sequence table"),
    ("user_id", "column_wise", (0, 1, 2), "does not split evenly"),
])
def test_layouts_the_trainer_cannot_run_are_refused_before_launch(plan4, tmp_path, table, kind, ranks, match):
    bad = dump_spec(_edit_tables(plan4, **{table: (kind, ranks)}), tmp_path / "bad.json")
    err = _refused_without_torch(["train", str(bad), "--device", "cpu"])
    assert match in err and f"table '{table}'" in err


def test_every_layout_the_planner_emits_passes_the_launch_check(plan4):
    from coplan.trainer.cli import check_plan

    every = _edit_tables(plan4, user_id=("table_wise", (3,)), ad_id=("row_wise", (0, 1, 2, 3)), interests=("column_wise", (2, 0)),
                         geo=("data_parallel", ()), hist_item=("data_parallel", ()), hist_action=("column_wise", (1, 3)))
    check_plan(every, where="every.json", nproc=4)


def test_sweep_launch_checks(plan4, tmp_path):
    a = dump_spec(plan4, tmp_path / "a.json")
    b = dump_spec(given_plan(load_workload("gem-tiny"), load_topology("h200-superpod-1k"), 2), tmp_path / "b.json")
    assert "different world sizes" in _refused_without_torch(["train", str(a), str(b), "--device", "cpu"])
    c = dump_spec(plan4, tmp_path / "c.json")
    assert "--resume continues one run" in _refused_without_torch(["train", str(a), str(c), "--resume", "x", "--device", "cpu"])
    err = _refused_without_torch(["train", str(a), "--trace", "5:3", "--device", "cpu"])
    assert "argument --trace: '5:3' is not a profile window" in err and err.count("5:3") == 1


def test_sweep_is_one_torchrun_through_the_quiet_launcher(plan4, tmp_path, capsys):
    a, c = dump_spec(plan4, tmp_path / "a.json"), dump_spec(plan4, tmp_path / "c.json")
    assert main(["train", str(a), str(c), "--device", "cpu", "--dry-run", "--steps", "3"]) == 0
    (line,) = [ln for ln in capsys.readouterr().out.splitlines() if ln.strip()]
    assert "-m coplan.trainer.cli --standalone --nproc-per-node=4 -m coplan.trainer.train" in line
    assert f"{a} {c} --steps 3" in line


def test_a_worker_failure_is_one_message_not_an_elastic_dump(tmp_path):
    """A failure only the workers can see (here: --resume of a run that trained another plan) prints the
    rank's one-line message, once, and no torchrun ChildFailedError report."""
    w = load_workload("gem-tiny")
    one = dump_spec(given_plan(w, load_topology("h200-1gpu"), 1, tables="table_wise"), tmp_path / "one.json")
    other = tmp_path / "runs" / "other"
    other.mkdir(parents=True)
    dump_spec(given_plan(w, load_topology("h200-1gpu"), 1, tables="data_parallel"), other / "plan.json")
    r = subprocess.run([sys.executable, "-m", "coplan.cli", "train", str(one), "--device", "cpu", "--resume", str(other),
                        "--runs-root", str(tmp_path / "runs"), "--no-progress"], capture_output=True, text=True, timeout=180)
    out = r.stdout + r.stderr
    assert r.returncode == 2, out
    assert "that run trained a different plan" in out and out.count("error:") == 1, out
    assert "ChildFailedError" not in out and "Traceback" not in out, out


def test_recomputing_a_layer_the_model_does_not_have_is_refused_before_launch(plan4, tmp_path):
    from coplan.spec import LayerPlan, Plan

    layers = (*plan4.layers, LayerPlan(name="decoder.7", recompute=True))
    bad = dump_spec(Plan.model_validate(plan4.model_copy(update={"layers": layers}).model_dump()), tmp_path / "bad.json")
    assert "recomputes ['decoder.7'], which are not layers" in _refused_without_torch(["train", str(bad), "--device", "cpu"])


def test_a_gpu_launch_on_a_machine_without_gpus_is_refused_before_launch(plan4, tmp_path):
    from coplan.trainer.cli import _no_nvidia_gpu

    if not _no_nvidia_gpu():
        pytest.skip("this machine has an NVIDIA GPU")
    path = dump_spec(plan4, tmp_path / "plan.json")
    err = _refused_without_torch(["train", str(path)])
    assert "this machine has no NVIDIA GPU" in err and "pass --device cpu" in err
