"""Fixtures of the report tests: real plans (planner, else the cost model's heuristic + pricer), a real
tiny CPU run from the trainer, and the calibration the real calibrate code fits to it."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from coplan.spec import dump_spec

from tests.reports.browser import find_chromium, playwright_or_none
from tests.reports.plans import heuristic_plan, real_plan

ROOT = Path(__file__).resolve().parents[2]

# small, fast cases (the gem-1t @ 16,384 case lives in the load-time benchmark and one slow test)
RUN_RANKS = 1
"""Ranks of the tiny real run."""

PLAN_CASES = {
    "gem-tiny@8": ("gem-tiny", "h200-superpod-1k", 8),
    "gem-h200@64": ("gem-h200", "h200-superpod-1k", 64),
}


@pytest.fixture(scope="session", params=sorted(PLAN_CASES))
def plan_case(request):
    """(case id, Plan) for each small case."""
    return request.param, real_plan(*PLAN_CASES[request.param])


@pytest.fixture(scope="session")
def tiny_plan():
    return real_plan(*PLAN_CASES["gem-tiny@8"])


@pytest.fixture(scope="session")
def h200_plan():
    return real_plan(*PLAN_CASES["gem-h200@64"])


@pytest.fixture(scope="session")
def plan_file(tmp_path_factory, h200_plan) -> Path:
    p = tmp_path_factory.mktemp("plan") / "plan.json"
    dump_spec(h200_plan, p)
    return p


def _trainer_missing() -> str | None:
    for mod in ("torch", "torchrec"):
        if importlib.util.find_spec(mod) is None:
            return f"{mod} is not installed (the [train] extra); the run figures need a real run from the trainer"
    if importlib.util.find_spec("coplan.trainer.train") is None:
        return "the trainer (coplan.trainer.train) is not built yet"
    return None


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory):
    """A real CPU run of gem-tiny by the trainer (gloo), with traces: (plan path, run dir).

    The plan is the cost model's heuristic one (every table table-wise): the planner may choose
    data-parallel sequence tables, which the trainer runs only on CUDA. One rank: the heuristic plan for
    2 GPUs replicates the sparse tables (2-D sparse parallelism), which the trainer does not run yet."""
    why = _trainer_missing()
    if why:
        pytest.skip(why)
    d = tmp_path_factory.mktemp("run")
    plan = heuristic_plan("gem-tiny", "h200-superpod-1k", RUN_RANKS)
    dump_spec(plan, d / "plan.json")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(RUN_RANKS), "-m", "coplan.trainer.train",
           str(d / "plan.json"), "--device", "cpu", "--steps", "8", "--runs-root", str(d / "runs"), "--run-id", "tiny",
           "--checkpoint-every", "-1", "--no-progress"]
    out = subprocess.run(cmd, cwd=d, env=env, capture_output=True, text=True, timeout=600)
    run_dir = d / "runs" / "tiny"
    if out.returncode != 0 or not (run_dir / "summary.json").exists():
        pytest.fail(f"the trainer failed to produce a run ({out.returncode}):\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")
    return d / "plan.json", run_dir


@pytest.fixture(scope="session")
def tiny_calibration(tiny_run):
    """The calibration coplan's own calibrate code fits to the tiny run: (path, Calibration)."""
    from coplan.calibration.assemble import calibrate

    plan_path, run_dir = tiny_run
    cal, _, _ = calibrate([run_dir])
    p = plan_path.parent / "calibration.json"
    dump_spec(cal, p)
    return p, cal


def chromium_or_skip() -> str:
    b = find_chromium()
    if b is None:
        pytest.skip("no chromium on PATH: install Debian's `chromium` (as .ci/run does) to run the browser tests")
    return b


@pytest.fixture(scope="session")
def pw():
    """A started Playwright driving the system Chromium; skips when either is missing."""
    chromium_or_skip()
    with playwright_or_none() as p:
        if p is None:
            pytest.skip("playwright is not installed (the `test` extra) to drive chromium in the browser tests")
        yield p


__all__ = ["PLAN_CASES", "ROOT", "chromium_or_skip", "shutil"]
