"""Launch checks and the ``coplan train`` launcher (which needs no torch)."""

import subprocess
import sys

import pytest

from coplan.cli import main
from coplan.errors import MismatchError
from coplan.spec import dump_spec, load_topology, load_workload
from coplan.trainer.plans import make_plan
from coplan.trainer.train import check_launch


@pytest.fixture(scope="module")
def plan4():
    return make_plan(load_workload("gem-tiny"), load_topology("h200-superpod-1k"), 4, dense_replicate=2)


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
    plan = make_plan(load_workload("gem-tiny"), load_topology("h200-superpod-1k"), 16)
    with pytest.raises(MismatchError, match="8 ranks on each node but 4"):
        check_launch(plan, world_size=16, local_world_size=4, device_type="cuda", device_name="NVIDIA H200")


def test_cli_refuses_wrong_nproc(plan4, tmp_path, capsys):
    path = dump_spec(plan4, tmp_path / "plan.json")
    assert main(["train", str(path), "--nproc", "2", "--device", "cpu"]) == 2
    assert "the plan is for 4 ranks but --nproc is 2" in capsys.readouterr().err


def test_cli_prints_one_torchrun_line_per_node(tmp_path, capsys):
    plan = make_plan(load_workload("gem-tiny"), load_topology("h200-superpod-1k"), 16, dense_replicate=2)
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
              "checkpoint_every": 5, "keep_last_n": 1, "log_every": 2, "seq_chunk": 16, "compile": "layers"}
    assert set(values) == set(_PASS), "a forwarded option without a value in this test"
    args = argparse.Namespace(plan=str(tmp_path / "plan.json"), **values, **{k: True for k in _FLAGS})
    parsed = _parse(_trainer_args(args))
    for k, v in values.items():
        assert getattr(parsed, k) == v, k
    for k in _FLAGS:
        assert getattr(parsed, k) is True, k
