"""End-to-end training of gem-tiny on CPU processes (gloo), launched with torchrun like `coplan train` does.

Two named cases, each compared with the same model trained unsharded on one process:

- ``hsdp_ep``: 4 ranks, HSDP on a (2, 2) mesh, experts split over 2 ranks, ``interformer.1``
  recomputed, table-wise, row-wise and data-parallel tables; SGD for dense and sparse weights. The
  loss curve must match the single process to 1e-5 for all 20 steps.
- ``fsdp_ep_stock``: 2 ranks, FSDP over 2, EP 2, ``moe.0`` recomputed, the workload's own optimizers
  (AdamW, fused row-wise Adagrad). It must train, match the single process to 1e-5 over the first 8
  steps and stay close after; and a run stopped at step 10 and resumed must reproduce it exactly.

Why two optimizers: the sharded and the single-process run add the same numbers in different
orders (per-rank partial sums, then the reduce-scatter), so they differ by fp32 rounding (~1e-7);
with SGD the 20-step curves agree to ~5e-7. With the stock optimizers they agree to 1e-7 for 8 steps
and then drift (1e-5 to 1e-4 by step 18), which misses the issue's 1e-5 over 20 steps:
``test_stock_matches_single_process_over_20_steps`` is a strict xfail that records it.

The cause (found 2026-11-29, task H6): a ReLU at its kink, not a bug in the
sparse path. Setup: dense SGD (lr 0.05), sparse row-wise Adagrad, every table table-wise, 2 ranks vs 1,
per-step checkpoints compared row by row. After steps 0 and 1 every table row and its Adagrad
accumulator agree to 1e-6 and the dense weights to 3e-8; the step-2 dense gradient of the 2-rank run
differs from a plain-PyTorch recomputation from the step-1 weights by 2.5e-4 (the 1-process run: 7e-9).
Traced back through the heads, the difference is in one element: ``heads.towers.cvr.0.bias[2]``, where
sample 29 of global batch 2 has the pre-activation +4.2e-7 on one process; the 2-rank run's fp32
rounding (sums in other orders since step 0) puts it on the other side of 0, so that ReLU passes that
sample's gradient in one run and blocks it in the other. That changes one sample's gradient by a few
percent everywhere, forward values not at all (the step-2 losses agree to 1e-7). Row-wise Adagrad
normalises each row's step by the row's own gradient scale, so rows touched only by that sample
(e.g. ``ad_id`` row 96) move by a few percent of ``lr`` differently (1e-3 in the weights); SGD moves
them by ``lr·|g|`` (|g| ~ 1e-3), which is why the SGD curves hid it. The step-3 loss then differs by
4e-4. Proof: the same two runs with every ``F.relu`` replaced by GELU agree to 6.6e-7 over 20 steps
(with ReLU: 2e-2). The earlier "not chaotic" check perturbed gradients, never activations, so it could
not cross a kink. ``tests/trainer/test_sparse_grad_equivalence.py`` checks the two facts this rests on
(the dense arch's input gradients are per sample; row-wise Adagrad's step ignores gradient scale).
For the stock plan (AdamW, EP 2, recompute, mixed tables) the measured gap was 1.07e-5 (step 17); with
GELU it was larger (2.9e-4 at step 18), so further discontinuities remain there, most likely MoE top-k
routing flips (not verified). A loss curve through ReLUs and top-k routing cannot be expected to match
to 1e-5 over 20 steps in fp32 across shardings; the strict xfail stays until the issue's criterion is
restated (e.g. for a kink-free model variant) or the model loses those kinks.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("torchrec")

from coplan.spec import dump_spec, load_run_result, load_topology, load_workload  # noqa: E402
from coplan.trainer.data import generate_dataset  # noqa: E402
from coplan.planner.given import as_single_process, given_plan  # noqa: E402

TIMEOUT_S = 240
STEPS = 20
TABLES = {  # table-wise, row-wise and data-parallel, on pooled and sequence tables (every other layout, and 2-D
    # sparse parallelism, against the single process: tests/trainer/test_sparse_2d.py)
    "user_id": "table_wise", "ad_id": "row_wise", "interests": "data_parallel", "geo": "table_wise",
    "hist_item": "row_wise", "hist_action": "table_wise",
}


def _launch(nproc: int, args: list[str]) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "coplan.trainer.train", *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)


def _wait(procs: list[subprocess.Popen], timeout: int) -> list[str]:
    """Wait for every launch; past the timeout, kill every process group: no rank is left behind."""
    deadline = time.monotonic() + timeout
    outs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            outs.append(out)
    except subprocess.TimeoutExpired:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        pytest.fail(f"torchrun timed out after {timeout} s")
    return outs


def torchrun(nproc: int, args: list[str], timeout: int = TIMEOUT_S) -> subprocess.CompletedProcess:
    """Run the trainer under torchrun, with a hard timeout."""
    p = _launch(nproc, args)
    (out,) = _wait([p], timeout)
    return subprocess.CompletedProcess(p.args, p.returncode, out, "")


def train_concurrently(runs: list[tuple[Path, int, str, list[str]]], root: Path, data: Path) -> list[Path]:
    """Independent runs at once (they share the cores; each has its own rendezvous port)."""
    procs = []
    for plan, nproc, rid, extra in runs:
        steps = [] if "--steps" in extra else ["--steps", str(STEPS)]
        procs.append(_launch(nproc, [str(plan), "--device", "cpu", *steps, "--runs-root", str(root), "--run-id", rid,
                                     "--data", str(data), "--no-progress", *extra]))
    outs = _wait(procs, TIMEOUT_S)
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-6000:]
    return [root / rid for _, _, rid, _ in runs]


def losses(run_dir: Path) -> np.ndarray:
    lines = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    assert [ln["step"] for ln in lines] == list(range(len(lines)))
    return np.array([ln["loss"] for ln in lines])


def falls(curve: np.ndarray) -> bool:
    """The data cycles through 4 global batches: compare the same batches early and late."""
    return curve[-4:].mean() < curve[:4].mean() - 0.05


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("train")
    tiny = load_workload("gem-tiny")
    data = generate_dataset(tiny, root / "data", 256, seed=0)  # 4 global batches of 64
    return {"root": root, "data": data, "tiny": tiny, "pod": load_topology("h200-superpod-1k")}


@pytest.fixture(scope="module")
def hsdp_ep(workspace) -> dict:
    w = workspace["tiny"]
    w = w.model_copy(update={"optimizer": w.optimizer.model_copy(update={"dense": "sgd", "sparse": "sgd", "dense_lr": 0.05, "sparse_lr": 0.1})})
    plan = given_plan(w, workspace["pod"], 4, dense_replicate=2, expert_parallel=2, recompute=["interformer.1"], tables=TABLES)
    root = workspace["root"]
    p4, p1 = dump_spec(plan, root / "hsdp_ep.json"), dump_spec(as_single_process(plan), root / "hsdp_ep_ref.json")
    sharded, ref = train_concurrently(
        [(p4, 4, "hsdp_ep", ["--trace", "5:7"]), (p1, 1, "hsdp_ep_ref", ["--trace", "none", "--checkpoint-every", "-1"])],
        root, workspace["data"],
    )
    return {"plan": plan, "sharded": sharded, "reference": ref}


@pytest.fixture(scope="module")
def fsdp_ep_stock(workspace) -> dict:
    plan = given_plan(workspace["tiny"], workspace["pod"], 2, expert_parallel=2, recompute=["moe.0"], tables=TABLES)
    root, data = workspace["root"], workspace["data"]
    p2, p1 = dump_spec(plan, root / "stock.json"), dump_spec(as_single_process(plan), root / "stock_ref.json")
    # alongside: the same run stopped after 10 steps, then resumed from its checkpoint
    sharded, ref, split = train_concurrently(
        [(p2, 2, "stock", ["--trace", "5:7"]), (p1, 1, "stock_ref", ["--trace", "none", "--checkpoint-every", "-1"]),
         (p2, 2, "stock_split", ["--trace", "none", "--steps", "10"])],
        root, data,
    )
    again = torchrun(2, [str(p2), "--device", "cpu", "--steps", str(STEPS), "--resume", str(split),
                         "--data", str(data), "--no-progress", "--trace", "none"])
    assert again.returncode == 0, again.stdout[-6000:]
    assert "resumed from" in again.stdout
    return {"plan": plan, "sharded": sharded, "reference": ref, "resumed": split}


def test_hsdp_ep_matches_single_process(hsdp_ep):
    a, b = losses(hsdp_ep["sharded"]), losses(hsdp_ep["reference"])
    assert len(a) == len(b) == STEPS
    assert falls(a), a
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)


def test_stock_gem_tiny_trains_and_tracks_single_process(fsdp_ep_stock):
    a, b = losses(fsdp_ep_stock["sharded"]), losses(fsdp_ep_stock["reference"])
    assert falls(a), a
    np.testing.assert_allclose(a[:8], b[:8], rtol=0, atol=1e-5)
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-3)  # the drift after step 8 (module docstring)


@pytest.mark.xfail(strict=True, reason="a ReLU kink crossed under fp32 rounding, exposed by row-wise Adagrad (module docstring)")
def test_stock_matches_single_process_over_20_steps(fsdp_ep_stock):
    a, b = losses(fsdp_ep_stock["sharded"]), losses(fsdp_ep_stock["reference"])
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)


def test_resume_continues_exactly(fsdp_ep_stock):
    straight, resumed = losses(fsdp_ep_stock["sharded"]), losses(fsdp_ep_stock["resumed"])
    assert len(resumed) == STEPS
    np.testing.assert_array_equal(resumed, straight)


@pytest.mark.parametrize("case, ranks", [("hsdp_ep", 4), ("fsdp_ep_stock", 2)])
def test_run_directory_is_complete(case, ranks, request):
    from coplan.calibration.attribution import attribute_file

    run = request.getfixturevalue(case)
    d = run["sharded"]
    summary = load_run_result(d / "summary.json")
    assert summary.world_size == ranks and summary.steps == STEPS and summary.device == "cpu"
    assert summary.step_time is not None and summary.model_flops_per_step > 0 and summary.tokens_per_s > 0
    # the host's share of each measured step: on CPU every op runs as it is issued, so it is nearly the whole
    # step (the step also holds the next step's start: it cannot be shorter than the host's part)
    hs = summary.host_step
    assert hs is not None and 0 < hs.p50_s <= summary.step_time.max_s and hs.p50_s > 0.5 * summary.step_time.p50_s
    # where that host time goes, per phase of the loop: the phases' medians sum to about the step's host time
    ph = summary.host_phases
    assert {"data", "forward", "loss", "backward", "optimizer", "bookkeeping"} <= set(ph)
    assert all(v >= 0 for v in ph.values()) and ph["forward"] > 0 and ph["backward"] > 0
    assert 0.5 * hs.p50_s < sum(ph.values()) < 1.5 * hs.p50_s
    assert len(summary.peak_memory_bytes) == ranks
    st = summary.startup  # time to the first step, split (rank 0's clock)
    assert st is not None and st.to_first_step_s > 0 and st.first_step_s > 0
    assert st.launch_s + st.data_s + st.build_s + st.sharding_s + st.first_step_s == pytest.approx(st.to_first_step_s, rel=1e-6)
    assert summary.loader is not None and summary.loader.samples_per_s > 0 and summary.loader.consumed_samples_per_s > 0
    for line in (d / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        assert {"step", "loss", "step_time_s", "tokens", "model_flops", "mfu"} <= set(rec)
        assert rec["imbalance"] >= 1.0
    assert list((d / "checkpoints").glob("step_*/.metadata"))
    for k in range(ranks):
        att = attribute_file(d / "traces" / f"rank{k}.json")
        assert att.steps == 2
        names = {(o.name, o.phase) for o in att.ops}
        assert ("interformer.0.gdpa", "fwd") in names and ("interformer.0.gdpa", "bwd") in names
        assert ("sparse.tbe", "fwd") in names and ("moe.0.all_to_all_dispatch", "fwd") in names
        trace = json.loads((d / "traces" / f"rank{k}.json").read_text())
        for lp in run["plan"].layers:
            assert _ranges_in_backward(trace, lp.name) == lp.recompute, lp.name


def _ranges_in_backward(trace: dict, layer: str) -> bool:
    """Whether forward op ranges of ``layer`` run inside autograd backward nodes: its recomputation.

    (On a CPU trace the cost model's attribution counts such time as backward, since only top-level
    CPU ops are work units there; on GPU the kernels inside these ranges are attributed as recompute.)
    """
    ev = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    bwd = [(e["tid"], e["ts"], e["ts"] + e["dur"]) for e in ev if e["name"].startswith("autograd::engine::evaluate_function")]
    mine = [e for e in ev if e["name"].startswith(layer + ".") and e["name"].endswith((".qkv", ".router"))]
    return any(t == e["tid"] and a <= e["ts"] and e["ts"] + e["dur"] <= b for e in mine for t, a, b in bwd)


def test_trainer_refuses_a_launch_that_does_not_match(workspace, tmp_path):
    plan = given_plan(workspace["tiny"], workspace["pod"], 2, tables=TABLES)
    path = dump_spec(plan, tmp_path / "plan2.json")
    r = torchrun(1, [str(path), "--device", "cpu", "--steps", "2", "--runs-root", str(tmp_path), "--no-progress"], timeout=120)
    assert r.returncode != 0
    assert "the plan is for 2 ranks" in r.stdout and "1 processes were launched" in r.stdout


def test_calibrate_from_trainer_traces(fsdp_ep_stock):
    """Issue 8: the trainer's own CPU traces parse, attribute to the cost model's ops and fit."""
    from coplan.calibration.assemble import calibrate
    from coplan.costmodel.efficiency import resolve_efficiencies
    from coplan.errors import MismatchError

    cal, res, runs = calibrate([fsdp_ep_stock["sharded"]])
    run = runs[0]
    assert cal.device == "cpu"
    # the trainer records its launch switches, typed, and calibration prices the lookups' bags by them
    assert run.result.options is not None and run.seq_chunk == run.result.options.seq_chunk
    # The profiled steps' own lengths, from metrics.jsonl: E[L], E[L^2] per sequence feature, and the
    # longest length per micro-batch (`seq_max`) as "<feature>@max" moments for padded backends.
    assert set(run.moments) == {"history", "history@max"}
    (mean, second), (max_mean, max_second) = run.moments["history"], run.moments["history@max"]
    assert 0 < mean and second >= mean**2 * (1 - 1e-9), run.moments  # Jensen: E[L^2] >= E[L]^2
    assert max_mean >= 1 and max_second >= max_mean**2 * (1 - 1e-9), run.moments
    # On a CPU trace every op's host self time counts. What no op range claims is FSDP's hooks and
    # gloo collectives, DTensor/TorchRec Python dispatch and the optimizer step (~40-60% of a
    # gem-tiny step on 2 cores); it is reported (`unattributed_s`), not hidden.
    assert 0.25 < run.attributed_share < 1.0, run.attributed_share
    assert run.unattributed_s == pytest.approx(run.total_s * (1 - run.attributed_share))
    classes = {s.op_class for s in res.samples}
    assert {"gemm", "attention", "embedding", "elementwise"} <= classes, classes
    assert cal.fit_error is not None and cal.fit_error.num_samples == len(res.samples)
    with pytest.raises(MismatchError):
        resolve_efficiencies(load_topology("h200-1gpu"), cal)  # a CPU calibration is no H200's
