"""`coplan plan --calibration`: a calibration fitted on another GPU is refused, unless --force, and
then the plan says it was forced (issue 8)."""

from __future__ import annotations

import contextlib
import io

from coplan.cli import main
from coplan.spec import Calibration, OpClassCalibration, dump_spec, load_plan


def _run(argv: list[str]) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = main(argv)
    return code, out.getvalue()


def test_foreign_calibration_refused_unless_forced(tmp_path):
    cal = dump_spec(Calibration(device="cpu", op_classes={"gemm": OpClassCalibration(compute_efficiency={"bf16": 0.5})}),
                    tmp_path / "cpu.json")
    base = ["plan", "-w", "gem-tiny", "-t", "h200-superpod-1k", "--gpus", "8", "-c", str(cal), "-o", str(tmp_path / "p.json"), "--quiet"]
    code, text = _run(base)
    assert code == 2 and "fitted on 'cpu'" in text and "--force" in text
    assert not (tmp_path / "p.json").exists()
    code, text = _run(base + ["--force"])
    assert code == 0, text
    plan = load_plan(tmp_path / "p.json")
    assert plan.calibration.device == "NVIDIA H200"
    assert "forced: fitted on 'cpu'" in plan.calibration.notes
