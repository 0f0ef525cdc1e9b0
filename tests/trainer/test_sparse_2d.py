"""2-D sparse parallelism and every table layout on CPU/gloo (issue 21).

Units: the replicas' sync schedule, the 2-D learning-rate scale, the CPU lookup of data-parallel sequence
tables (FBGEMM's CPU no-bag dense kernel returns one row per bag; the trainer's path one per id).

Runs (torchrun, gloo, every launch under a hard timeout), on a superpod whose nodes hold 2 GPUs, so that
table-row-wise sharding exists at 4 and 8 ranks; SGD for dense and sparse weights:

- ``every_1d``: 4 ranks, one copy of the tables: column-wise (pooled and sequence), table-row-wise over
  both nodes, data-parallel pooled and sequence tables, HSDP, a recomputed layer;
- ``every_2d``: 4 ranks, 2 replicas of a 2-rank sparse group: column-wise, table-row-wise (one node), row-
  wise, table-wise, data-parallel sequence table;
- ``every_2d_8``: 8 ranks, 2 replicas of a 4-rank group (table-row-wise across its two nodes), HSDP x EP;
- each matches the single process within 1e-5 for 10 steps;
- ``adagrad_2d`` vs ``adagrad_1d``: row-wise Adagrad, where averaging replicas is not one copy's update
  (:mod:`coplan.trainer.distributed.replica_sync`): it trains, and stays near the 1-D curve;
- ``interval2``: replicas averaged every 2 steps, checkpoints every 5 (a forced sync at step 4): a run
  stopped after 5 steps and resumed reproduces the straight run exactly; the checkpoint holds one copy
  of each shard; the trace names the sync ``sparse.replica_sync`` and the data-parallel tables'
  all-reduce ``sparse.dp_all_reduce``, the cost model's names.
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
import torch

from coplan.spec import Plan, Topology, Workload, dump_spec, load_topology, load_workload
from coplan.planner.given import as_single_process, given_plan

TIMEOUT_S = 420
STEPS = 10
TOL = 1e-5


# ---------------------------------------------------------------------------------------------- units


def test_sync_schedule_and_learning_rate_scale():
    from coplan.trainer.distributed.embedding import fused_params
    from coplan.trainer.distributed.replica_sync import ReplicaSync

    s = ReplicaSync(torch.nn.Module(), None, replicas=2, interval=3)
    assert [st for st in range(9) if s.due(st)] == [2, 5, 8]
    assert not ReplicaSync(torch.nn.Module(), None, replicas=1).due(0)  # one copy: nothing to sync
    plan = given_plan(load_workload("gem-tiny"), load_topology("h200-1gpu"), 1)
    lr = plan.workload.optimizer.sparse_lr
    assert fused_params(plan)["learning_rate"] == lr and fused_params(plan, lr_scale=4)["learning_rate"] == 4 * lr


def test_sync_buckets_bound_the_copies():
    from coplan.trainer.distributed.replica_sync import _buckets

    ts = [torch.zeros(5), torch.zeros(3, dtype=torch.float64), torch.zeros(7), torch.zeros(20), torch.zeros(2)]
    shapes = sorted(sorted(t.numel() for t in b) for b in _buckets(ts, 10))
    assert shapes == [[2, 7], [3], [5], [20]]  # by dtype, at most 10 elements, a large tensor alone (in place)


def test_data_parallel_sequence_lookup_on_cpu(one_rank_group):
    """The CPU path gives one row per id, in input order, and its gradient reaches exactly those rows."""
    import torch.distributed as dist
    from torchrec import EmbeddingCollection, EmbeddingConfig, KeyedJaggedTensor
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.types import EmbeddingModuleShardingPlan, ParameterSharding, ShardingEnv, ShardingPlan

    from coplan.trainer.distributed.embedding import ECSharder, cpu_sequence_lookups, unwrap_data_parallel_lookups

    class Holder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.ec = EmbeddingCollection(tables=[EmbeddingConfig(name=n, embedding_dim=4, num_embeddings=10, feature_names=[n])
                                                  for n in ("a", "b")], device=torch.device("meta"))

        def forward(self, kjt):
            return self.ec(kjt)

    mp = EmbeddingModuleShardingPlan()
    for n in ("a", "b"):
        mp[n] = ParameterSharding(sharding_type="data_parallel", compute_kernel="dense", ranks=[0])
    dmp = DistributedModelParallel(Holder(), env=ShardingEnv.from_process_group(dist.group.WORLD), device=torch.device("cpu"),
                                   plan=ShardingPlan({"ec": mp}), sharders=[ECSharder()], init_data_parallel=False)
    unwrap_data_parallel_lookups(dmp)
    assert cpu_sequence_lookups(dmp) == 1
    weights = {n: p for n, p in dmp.named_parameters()}
    wa = next(p for n, p in weights.items() if n.endswith("a.weight"))
    wb = next(p for n, p in weights.items() if n.endswith("b.weight"))
    with torch.no_grad():
        wa.copy_(torch.arange(40.0).view(10, 4))
        wb.copy_(-torch.arange(40.0).view(10, 4))
    # 3 samples; a: [1, 2], [3], [] ; b: [4, 5, 6], [7], [7]
    kjt = KeyedJaggedTensor(keys=["a", "b"], values=torch.tensor([1, 2, 3, 4, 5, 6, 7, 7]), lengths=torch.tensor([2, 1, 0, 3, 1, 1]))
    out = dmp(kjt)
    torch.testing.assert_close(out["a"].values(), wa.detach()[[1, 2, 3]])
    torch.testing.assert_close(out["b"].values(), wb.detach()[[4, 5, 6, 7, 7]])
    (out["a"].values().sum() + 2 * out["b"].values().sum()).backward()
    ga, gb = wa.grad.view(10, 4)[:, 0], wb.grad.view(10, 4)[:, 0]
    assert ga.tolist() == [0, 1, 1, 1, 0, 0, 0, 0, 0, 0] and gb.tolist() == [0, 0, 0, 0, 2, 2, 2, 4, 0, 0]


# ----------------------------------------------------------------------------------------------- runs


def _topology() -> Topology:
    d = load_topology("h200-superpod-1k").model_dump()
    d.update(name="superpod-2gpu-nodes", gpus_per_node=2)
    return Topology.model_validate(d)


def _workload(sparse: str = "sgd", interval: int = 1) -> Workload:
    d = load_workload("gem-tiny").model_dump()
    for t in d["tables"]:
        if t["name"] in ("user_id", "hist_item", "hist_action"):
            t["dim"] = 64  # column-wise shards of pooled and sequence tables
    d["name"] = f"gem-tiny-2d-{sparse}"
    d["optimizer"].update(dense="sgd", sparse=sparse, dense_lr=0.05, sparse_lr=0.1 if sparse == "sgd" else 0.05,
                          sparse_sync_interval_steps=interval)
    return Workload.model_validate(d)


def _plan(w: Workload, world: int, replicas: int, tables: dict[str, tuple[str, tuple[int, ...]]], **kw) -> Plan:
    """A given plan (placements ours, not the planner's): ``tables`` is {table: (sharding type, ranks of the sparse group)}."""
    return given_plan(w, _topology(), world, sparse_replicate=replicas, tables=tables, **kw)


EVERY_1D = {"user_id": ("column_wise", (0, 1, 2, 3)), "ad_id": ("table_row_wise", (2, 3)), "interests": ("table_row_wise", (0, 1)),
            "geo": ("data_parallel", ()), "hist_item": ("column_wise", (1, 3)), "hist_action": ("data_parallel", ())}
EVERY_2D = {"user_id": ("column_wise", (0, 1)), "ad_id": ("table_row_wise", (0, 1)), "interests": ("row_wise", (0, 1)),
            "geo": ("table_wise", (1,)), "hist_item": ("data_parallel", ()), "hist_action": ("row_wise", (0, 1))}
EVERY_2D_8 = {"user_id": ("column_wise", (0, 1, 2, 3)), "ad_id": ("table_row_wise", (2, 3)), "interests": ("table_row_wise", (0, 1)),
              "geo": ("data_parallel", ()), "hist_item": ("row_wise", (0, 1, 2, 3)), "hist_action": ("column_wise", (0, 2))}


# the planner's own choices under pins (its rank placement, not ours): every type it offers at 4 ranks of
# 2-GPU nodes (table-row-wise only where the sparse group spans nodes: not with 2 replicas of 2 ranks)
PLANNED = {
    "planned_1d": ["--pin", "sparse_replicate=1", "--pin-table", "user_id=column_wise", "--pin-table", "ad_id=table_row_wise",
                   "--pin-table", "interests=data_parallel", "--pin-table", "geo=row_wise", "--pin-table", "hist_item=column_wise",
                   "--pin-table", "hist_action=data_parallel"],
    "planned_2d": ["--pin", "sparse_replicate=2", "--pin-table", "user_id=column_wise", "--pin-table", "ad_id=row_wise",
                   "--pin-table", "interests=data_parallel", "--pin-table", "geo=table_wise", "--pin-table", "hist_item=data_parallel",
                   "--pin-table", "hist_action=column_wise"],
}


def _coplan_plan(workload: Path, topology: Path, out: Path, pins: list[str]) -> Path:
    r = subprocess.run([sys.executable, "-m", "coplan.cli", "plan", "-w", str(workload), "-t", str(topology), "--gpus", "4", *pins,
                        "--quiet", "-o", str(out)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return out


def _launch(nproc: int, plans: list[Path], args: list[str]) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "coplan.cli", "train", *map(str, plans), "--device", "cpu", "--no-progress", *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)


def _wait(procs: list[subprocess.Popen]) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    try:
        outs = [p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0] for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        pytest.fail(f"coplan train timed out after {TIMEOUT_S} s")
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-6000:]


def _losses(run: Path) -> np.ndarray:
    lines = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    assert [ln["step"] for ln in lines] == list(range(len(lines)))
    return np.array([ln["loss"] for ln in lines])


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("sparse2d")
    w, ada, every2 = _workload(), _workload("rowwise_adagrad"), _workload(interval=2)
    p = {
        "every_1d": _plan(w, 4, 1, EVERY_1D, dense_replicate=2, recompute=["interformer.1"]),
        "every_2d": _plan(w, 4, 2, EVERY_2D),
        "adagrad_2d": _plan(ada, 4, 2, EVERY_2D),
        "adagrad_1d": _plan(ada, 4, 1, {k: (v[0], tuple(range(4)) if v[0] in ("row_wise", "column_wise") else v[1]) for k, v in EVERY_2D.items()}),
        "interval2": _plan(every2, 4, 2, EVERY_2D),
        "every_2d_8": _plan(w, 8, 2, EVERY_2D_8, dense_replicate=2, expert_parallel=2),
    }
    paths = {k: dump_spec(v, root / f"{k}.json") for k, v in p.items()}
    wpath, tpath = dump_spec(w, root / "w.yaml"), dump_spec(_topology(), root / "t.yaml")
    for k, pins in PLANNED.items():
        paths[k] = _coplan_plan(wpath, tpath, root / f"{k}.json", pins)
    paths["reference"] = dump_spec(as_single_process(p["every_1d"]), root / "reference.json")
    paths["split"] = dump_spec(p["interval2"], root / "split.json")
    # one dataset for every launch (the workloads differ in optimizer only), made before any launch: two
    # launches generating the same default dataset at once would race
    from coplan.trainer.data import generate_dataset

    data = generate_dataset(w, root / "data", 512, seed=0)
    common = ["--steps", str(STEPS), "--runs-root", str(root), "--data", str(data)]
    four = [paths[k] for k in ("every_1d", "every_2d", "adagrad_2d", "adagrad_1d", "interval2", *PLANNED)]
    _wait([_launch(4, four, [*common, "--run-id", "r4", "--trace", "2:4", "--checkpoint-every", "5"]),
           _launch(1, [paths["reference"]], [*common, "--run-id", "ref", "--trace", "none", "--checkpoint-every", "-1"])])
    _wait([_launch(8, [paths["every_2d_8"]], [*common, "--run-id", "r8", "--trace", "none", "--checkpoint-every", "-1"]),
           _launch(4, [paths["split"]], ["--steps", "5", "--runs-root", str(root), "--run-id", "split", "--trace", "none",
                                         "--checkpoint-every", "5", "--data", str(data)])])
    _wait([_launch(4, [paths["split"]], ["--steps", str(STEPS), "--resume", str(root / "split"), "--trace", "none",
                                         "--checkpoint-every", "5", "--data", str(data)])])
    dirs = {k: root / f"r4-{k}" for k in ("every_1d", "every_2d", "adagrad_2d", "adagrad_1d", "interval2", *PLANNED)}
    dirs |= {"reference": root / "ref", "every_2d_8": root / "r8", "split": root / "split"}
    return {"dirs": dirs, "plans": p, "paths": paths}


@pytest.mark.parametrize("case", ["every_1d", "every_2d", "every_2d_8", *PLANNED])
def test_every_layout_matches_the_single_process(runs, case):
    a, b = _losses(runs["dirs"][case]), _losses(runs["dirs"]["reference"])
    assert len(a) == len(b) == STEPS
    np.testing.assert_allclose(a, b, rtol=0, atol=TOL)


def test_the_planner_emitted_what_was_pinned(runs):
    from coplan.spec import load_plan

    for k, pins in PLANNED.items():
        plan = load_plan(runs["paths"][k])
        want = dict(a.split("=") for a in pins[3::2])
        assert {t.table: t.sharding_type for t in plan.tables} == want, k
        assert plan.mesh.sparse_replicate == int(pins[1].split("=")[1]) and plan.micro_batches == 1


def test_rowwise_adagrad_2d_trains_near_1d(runs):
    """Averaged replicas are not one copy's Adagrad (replica_sync's docstring): it trains, and the gap to
    the 1-D curve stays small over 10 steps (measured on CPU: a few 1e-4 or less)."""
    a, b = _losses(runs["dirs"]["adagrad_2d"]), _losses(runs["dirs"]["adagrad_1d"])
    assert np.isfinite(a).all() and a[-4:].mean() < a[:4].mean()
    assert np.abs(a - b).max() < 5e-3, np.abs(a - b)


def test_resume_of_a_2d_run_is_exact(runs):
    straight, resumed = _losses(runs["dirs"]["interval2"]), _losses(runs["dirs"]["split"])
    assert len(resumed) == STEPS
    np.testing.assert_array_equal(resumed, straight)


def test_checkpoint_holds_one_copy_of_each_shard(runs):
    from torch.distributed.checkpoint import FileSystemReader

    ckpt = sorted((runs["dirs"]["interval2"] / "checkpoints").glob("step_*"))[-1]
    md = FileSystemReader(str(ckpt)).read_metadata()
    tables = {t.name: t for t in runs["plans"]["interval2"].workload.all_tables}
    for name, t in tables.items():
        key = next(k for k in md.state_dict_metadata if k.startswith("model.sparse.") and k.endswith(f".{name}.weight"))
        chunks = md.state_dict_metadata[key].chunks
        assert sum(int(np.prod(c.sizes)) for c in chunks) == t.num_rows * t.dim, (name, chunks)  # no shard twice
    assert sorted(f.name for f in (ckpt / "fused").iterdir()) == ["rank0.pt", "rank1.pt"]  # the first sparse group's


def test_trace_names_the_sync_and_the_dp_all_reduce_as_the_cost_model_does(runs):
    for k in range(4):
        names = {e.get("name") for e in json.loads((runs["dirs"]["every_2d"] / "traces" / f"rank{k}.json").read_text())["traceEvents"]}
        assert "sparse.replica_sync" in names and "sparse.dp_all_reduce" in names, k
    names = {e.get("name") for e in json.loads((runs["dirs"]["every_1d"] / "traces" / "rank0.json").read_text())["traceEvents"]}
    assert "sparse.replica_sync" not in names and "sparse.dp_all_reduce" in names
