"""Head dims the Triton attention kernels cannot take are refused when planning, naming the block and the fix."""

from __future__ import annotations

import subprocess
import sys

import yaml

from coplan.kernels import api
from coplan.spec import load_workload
from coplan.spec.workload import MAX_TRITON_HEAD_DIM, Workload


def _with_head_dim(d: int, attention: str = "triton") -> Workload:
    doc = load_workload("gem-h200").model_dump(mode="json")
    for b in doc["blocks"]:
        if b["type"] == "interformer":
            b["head_dim"], b["num_heads"] = d, 2
    doc["kernels"]["attention"] = attention
    return Workload.model_validate(doc)


def test_the_limit_is_the_kernels():
    assert MAX_TRITON_HEAD_DIM == api._MAX_TRITON_HEAD_DIM


def test_issues_name_the_block_field_and_fix():
    assert _with_head_dim(256).triton_attention_issues() == []
    assert _with_head_dim(320, "reference").triton_attention_issues() == []
    (path, reason), = _with_head_dim(320).triton_attention_issues()
    assert path.startswith("blocks[") and path.endswith("].head_dim")
    assert "320" in reason and "256" in reason and "'reference'" in reason
    assert _with_head_dim(320, "reference").triton_attention_issues("triton")  # the trainer asks for its own backend


def test_coplan_plan_refuses_without_a_traceback(tmp_path):
    path = tmp_path / "w.yaml"
    path.write_text(yaml.safe_dump(_with_head_dim(384).model_dump(mode="json")))
    r = subprocess.run([sys.executable, "-m", "coplan.cli", "plan", "-t", "h200-1gpu", "-w", str(path), "-o",
                        str(tmp_path / "p.json"), "--quiet"], capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert str(path) in r.stderr and "head_dim" in r.stderr and "reference" in r.stderr
    assert not (tmp_path / "p.json").exists()
