"""gem-tiny through the trainer on one CUDA GPU (NCCL, Triton attention, CUDA-event timing)."""

import json
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torchrec")

from coplan.spec import dump_spec, load_run_result, load_workload  # noqa: E402
from coplan.spec.topology import Topology  # noqa: E402
from coplan.planner.given import single_process_plan  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_gem_tiny_trains_on_one_gpu(tmp_path):
    from coplan.spec import load_topology

    topo: Topology = load_topology("h200-1gpu")
    name = torch.cuda.get_device_name(0)
    plan = single_process_plan(load_workload("gem-tiny"), topo, attention_backend="triton")
    path = dump_spec(plan, tmp_path / "plan.json")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1", "-m", "coplan.trainer.train",
           str(path), "--device", "cuda", "--steps", "12", "--warmup", "3", "--runs-root", str(tmp_path), "--run-id", "gpu",
           "--no-progress", "--trace", "8:10"]
    if topo.gpu.name.lower() not in name.lower():
        cmd.append("--allow-device-mismatch")
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    assert r.returncode == 0, (r.stdout + r.stderr)[-6000:]
    s = load_run_result(tmp_path / "gpu" / "summary.json")
    assert s.attention_backend == "triton" and s.measured_mfu > 0 and s.peak_memory_bytes[0] > 0
    losses = [json.loads(x)["loss"] for x in (tmp_path / "gpu" / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 12
    from coplan.calibration.attribution import attribute_file

    att = attribute_file(tmp_path / "gpu" / "traces" / "rank0.json")
    assert att.on_device and any(o.name == "interformer.0.gdpa" for o in att.ops)
