"""Faults injected into gem-tiny CPU runs (torchrun + gloo): a rank killed mid-run, a checkpoint
interrupted while being written, a NaN loss or gradient. Issue 9; docs/reliability.md.

Every launch runs in its own process group with a hard timeout (killed as a group past it).
Three 4-rank runs of 8 steps share the cores at once: the uninterrupted reference, the killed one
(``torchrun --max-restarts 1``), and two 2-rank poisoned runs; then one short resume.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("torchrec")

from coplan.spec import dump_spec, load_topology, load_workload  # noqa: E402
from coplan.trainer.data import generate_dataset  # noqa: E402
from coplan.planner.given import given_plan  # noqa: E402

TIMEOUT_S = 150
POISONED = Path(__file__).with_name("poisoned_trainer.py")
STEPS = 8
EVERY = 2  # checkpoints after steps 1, 3, 5 and 7 (the end)
TABLES = {"user_id": "table_wise", "ad_id": "row_wise", "interests": "data_parallel", "geo": "table_wise",
          "hist_item": "row_wise", "hist_action": "table_wise"}


def _launch(nproc: int, args: list[str], *, restarts: int = 0, poison: str | None = None) -> subprocess.Popen:
    """torchrun of the trainer; ``poison`` ('loss@K' or 'grad@K'): of the trainer with that fault injected
    (poisoned_trainer.py)."""
    entry = [str(POISONED), poison] if poison else ["-m", "coplan.trainer.train"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           f"--max-restarts={restarts}", *entry, *args]
    e = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=e, start_new_session=True)


def _finish(p: subprocess.Popen, deadline: float) -> str:
    try:
        out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        return out
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, _ = p.communicate()
        pytest.fail(f"torchrun timed out: {' '.join(p.args[-12:])}\n{out[-4000:]}")


def _kill_all(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _children(pid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(d.name))
            except (OSError, IndexError, ValueError):
                pass
    return sorted(out)


def _steps(run_dir: Path) -> list[int]:
    mp = run_dir / "metrics.jsonl"
    if not mp.is_file():
        return []
    return [json.loads(ln)["step"] for ln in mp.read_text().splitlines() if ln.strip().endswith("}")]


def losses(run_dir: Path) -> np.ndarray:
    lines = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    assert [ln["step"] for ln in lines] == list(range(len(lines))), "metrics.jsonl has duplicated or missing steps"
    return np.array([ln["loss"] for ln in lines])


def _args(plan: Path, root: Path, data: Path, rid: str, *extra: str) -> list[str]:
    return [str(plan), "--device", "cpu", "--steps", str(STEPS), "--runs-root", str(root), "--run-id", rid,
            "--data", str(data), "--no-progress", "--trace", "none", "--checkpoint-every", str(EVERY), *extra]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("faults")
    tiny, pod = load_workload("gem-tiny"), load_topology("h200-superpod-1k")
    data = generate_dataset(tiny, root / "data", 256, seed=0)
    p4 = dump_spec(given_plan(tiny, pod, 4, dense_replicate=2, expert_parallel=2, tables=TABLES), root / "p4.json")
    p2 = dump_spec(given_plan(tiny, pod, 2, expert_parallel=2, tables=TABLES), root / "p2.json")
    t0 = time.monotonic()
    deadline = t0 + TIMEOUT_S
    procs = {
        "ref": _launch(4, _args(p4, root, data, "ref")),
        "killed": _launch(4, _args(p4, root, data, "killed", "--resume", "auto"), restarts=1),
        "nan_loss": _launch(2, _args(p2, root, data, "nan_loss"), poison="loss@2"),
        "nan_grad": _launch(2, _args(p2, root, data, "nan_grad"), poison="grad@2"),
    }
    out: dict = {"root": root, "data": data, "p4": p4}
    try:
        # kill one rank of "killed" once step 4 is logged: step 3's checkpoint is then complete
        killed = procs["killed"]
        while 4 not in _steps(root / "killed"):
            if killed.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"the run to kill ended or stalled before step 4:\n{killed.communicate()[0][-4000:]}")
            time.sleep(0.05)
        seen = max(_steps(root / "killed"))
        workers = _children(killed.pid)
        assert len(workers) == 4, workers
        os.kill(workers[2], signal.SIGKILL)
        out["killed_at_step"] = seen
        out["killed_pid"] = workers[2]
        for name, p in procs.items():
            out[f"{name}_out"] = _finish(p, deadline)
            out[f"{name}_rc"] = p.returncode
    finally:
        _kill_all(list(procs.values()))
    out["phase1_s"] = time.monotonic() - t0
    return out


def test_killed_rank_restarts_and_matches_uninterrupted_run(runs):
    root = runs["root"]
    assert runs["ref_rc"] == 0, runs["ref_out"][-4000:]
    assert runs["killed_rc"] == 0, runs["killed_out"][-6000:]
    out = runs["killed_out"]
    # torchrun restarted the workers once, and they resumed from the last complete checkpoint
    resumed = re.findall(r"resumed from \S*step_(\d+) at step (\d+)", out)
    assert len(resumed) == 1, out[-6000:]
    ckpt_step, start = (int(x) for x in resumed[0])
    assert start == ckpt_step + 1
    assert ckpt_step >= 3  # the checkpoint that was complete when the rank was killed, or a newer one
    assert start <= runs["killed_at_step"] + 2  # resumed at most one checkpoint interval back: nothing lost
    # every step logged exactly once, and the losses are those of the uninterrupted run, bit for bit
    ref, got = losses(root / "ref"), losses(root / "killed")
    assert len(ref) == len(got) == STEPS
    np.testing.assert_array_equal(got, ref)
    summary = json.loads((root / "killed" / "summary.json").read_text())
    assert summary["final_loss"] == ref[-1]


def test_interrupted_checkpoint_is_skipped_and_previous_used(runs):
    """A copy of the finished reference run whose last checkpoint was interrupted mid-write: the
    previous one is loaded (with a logged warning) and the rerun steps match bit for bit."""
    root = runs["root"]
    assert runs["ref_rc"] == 0, runs["ref_out"][-4000:]
    ck = sorted((root / "ref" / "checkpoints").iterdir())
    assert [p.name for p in ck] == ["step_00000005", "step_00000007"]  # --keep-last-n 2 (the default)
    assert all((p / "COMPLETE").is_file() for p in ck)
    run = root / "interrupted"
    shutil.copytree(root / "ref", run)
    # the two shapes an interrupted save leaves: the .tmp folder, and (old writers) a folder with no marker
    last = run / "checkpoints" / "step_00000007"
    last.rename(last.with_name("step_00000007.tmp"))
    (run / "checkpoints" / "step_00000006").mkdir()
    (run / "checkpoints" / "step_00000006" / ".metadata").write_bytes(b"partial")
    p = _launch(4, [str(runs["p4"]), "--device", "cpu", "--steps", str(STEPS), "--resume", str(run), "--data",
                    str(runs["data"]), "--no-progress", "--trace", "none", "--keep-last-n", "1"])
    try:
        out = _finish(p, time.monotonic() + 90)
    finally:
        _kill_all([p])
    assert p.returncode == 0, out[-6000:]
    assert "warning: skipping incomplete checkpoint" in out and "step_00000007.tmp" in out and "step_00000006" in out
    assert re.search(r"resumed from \S*step_00000005 at step 6", out), out[-4000:]
    np.testing.assert_array_equal(losses(run), losses(root / "ref"))
    # the rerun wrote step 7 again, complete, and --keep-last-n 1 kept only it
    assert [q.name for q in (run / "checkpoints").iterdir() if (q / "COMPLETE").is_file()] == ["step_00000007"]


@pytest.mark.parametrize("what", ["loss", "grad"])
def test_non_finite_stops_run_and_keeps_last_good_checkpoint(runs, what):
    root = runs["root"]
    rc, out = runs[f"nan_{what}_rc"], runs[f"nan_{what}_out"]
    assert rc != 0, out[-4000:]
    assert "error: step 2:" in out and "stopped without checkpointing" in out, out[-4000:]
    assert ("loss is nan" if what == "loss" else "the dense gradient norm is") in out
    assert 'trainer/train.py", line' not in out  # a message, not a trainer traceback (torchrun adds its own)
    ck = root / f"nan_{what}" / "checkpoints"
    assert sorted(p.name for p in ck.iterdir()) == ["step_00000001"]
    assert all((p / "COMPLETE").is_file() for p in ck.iterdir())
    assert _steps(root / f"nan_{what}") == [0, 1]  # the poisoned step is not logged as if it were fine
