"""Shipped calibrations (package data): used by `coplan plan` by default when the topology's GPU matches."""

import json

import pytest

from coplan.calibration.shipped import choose, describe, shipped
from coplan.cli import main
from coplan.spec import load_calibration, load_topology


def test_every_shipped_calibration_is_valid_and_says_where_it_came_from():
    found = shipped()
    assert "NVIDIA H200" in found and "NVIDIA H100" in found
    for device, path in found.items():
        cal = load_calibration(path)
        assert cal.device == device and cal.source_runs and cal.created_utc and cal.fit_error is not None
        assert len(cal.versions.get("coplan_git_commit", "")) == 40  # the commit its runs ran at
        assert cal.host_launch_s and cal.host_launch_s > 0  # the host's time is priced
        line = describe(cal, path.name)
        assert device in line and cal.created_utc[:10] in line and cal.versions["coplan_git_commit"][:7] in line


def test_choose_auto_none_file_and_a_gpu_without_one(tmp_path):
    h200, h100 = load_topology("h200-1gpu"), load_topology("meta-roce-24k")
    cal, line = choose(None, h200)
    assert cal is not None and cal.device == "NVIDIA H200" and "shipped" in line
    assert choose("AUTO", h200)[0] == cal
    none, line = choose("none", h200)
    assert none is None and "none" in line
    # an H100 has its own (fitted on the lent H100's runs)
    own, line = choose("auto", h100)
    assert own is not None and own.device == "NVIDIA H100" and "shipped (nvidia-h100.json)" in line
    assert own.host_launch_graphed_s and own.host_launch_graphed_s > 0  # (its runs replayed CUDA graphs)
    # a Hopper GPU with none of its own borrows one of its architecture's, collectives dropped, and says so
    h800 = h100.model_copy(update={"gpu": h100.gpu.model_copy(update={"name": "NVIDIA H800"})})
    cal2, line = choose("auto", h800)
    assert cal2 is not None and cal2.device == "NVIDIA H800" and cal2.collective_efficiency == {}
    source = next(d for d in shipped() if f"shipped for {d}" in line)
    assert cal2.host_launch_s == load_calibration(shipped()[source]).host_launch_s and "borrowed" in cal2.notes
    assert "borrowed for NVIDIA H800" in line and "uncalibrated" in line
    cal2.check_against(h800)  # (usable as is: no --force needed)
    # a GPU of an architecture nothing ships for stays uncalibrated
    gb200 = load_topology("gb200-nvl72-16k")
    cal3, line = choose("auto", gb200)
    assert cal3 is None and "none shipped for" in line and "uncalibrated" in line

    f = tmp_path / "mine.json"
    f.write_text(shipped()["NVIDIA H200"].read_text())
    mine, line = choose(str(f), h200)
    assert mine == cal and str(f) in line


def test_gpu_families():
    from coplan.calibration.shipped import family

    assert family("NVIDIA H100 80GB HBM3") == family("NVIDIA H200") == family("NVIDIA GH200 480GB") == "Hopper"
    assert family("NVIDIA B200") == family("NVIDIA GB200") == "Blackwell"
    assert family("NVIDIA A100-SXM4-80GB") is None and family("") is None


@pytest.mark.parametrize("flag,calibrated", [([], True), (["--calibration", "none"], False)])
def test_plan_uses_the_shipped_calibration_by_default(tmp_path, capsys, flag, calibrated):
    out = tmp_path / "p.json"
    assert main(["plan", "-t", "h200-1gpu", "-w", "gem-tiny", "-o", str(out), "--gpus", "1", *flag]) == 0
    text = capsys.readouterr().out
    plan = json.loads(out.read_text())
    assert (plan.get("calibration") is not None) == calibrated
    assert ("calibration: shipped" in text) == calibrated and ("calibration: none" in text) == (not calibrated)


def test_calibrated_plan_prices_the_host(tmp_path):
    """The shipped calibration prices the host's launches: a small one-GPU step is no longer device time alone."""
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    assert main(["plan", "-t", "h200-1gpu", "-w", "gem-tiny", "-o", str(a), "--gpus", "1", "--quiet"]) == 0
    assert main(["plan", "-t", "h200-1gpu", "-w", "gem-tiny", "-o", str(b), "--gpus", "1", "--quiet",
                 "--calibration", "none"]) == 0
    ta, tb = (json.loads(p.read_text())["predicted"]["step_time_s"] for p in (a, b))
    assert ta > tb
