"""Chunked bags for the sequence lookups (``--seq-chunk``): the same rows out, the same gradients in.

A history cut into bags of at most ``n`` ids holds the same ids in the same order, so TorchRec's
EmbeddingCollection must return the same rows and send the same gradients to its tables, sharded by
TorchRec (FBGEMM's CPU TBE, fused SGD) on one process and, launched by torchrun, on two gloo ranks
with a row-wise and a table-wise sequence table. Histories are random and include empty ones and
ones at the workload's cap (64 events in gem-tiny); the chunk sizes are 0 (one bag per sample), 32
and 7 (an odd size, so that the last bag of a history at the cap is short).

Run as a script (``torchrun --nproc-per-node=2 tests/trainer/test_seq_chunk.py OUT``) it is the
2-rank worker.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from coplan.errors import MismatchError
from coplan.spec import load_topology, load_workload
from coplan.trainer.batch import chunk_lengths, host_tensors, to_device
from coplan.trainer.data import DataError, HostBatch
from coplan.trainer.features import feature_layout

CHUNKS = (0, 32, 7)
# hist_item's rows split over the ranks, hist_action whole on one; the pooled tables as they come
TABLES = {"hist_item": "row_wise", "hist_action": "table_wise", "user_id": "table_wise", "ad_id": "row_wise",
          "interests": "table_wise", "geo": "table_wise"}
LR = 0.5
SEED = 3
TIMEOUT_S = 120


def _workload():
    """gem-tiny with SGD on the sparse tables: a table's change is then -lr x its gradient."""
    w = load_workload("gem-tiny")
    return w.model_copy(update={"optimizer": w.optimizer.model_copy(update={"sparse": "sgd", "sparse_lr": LR})})


def _host_batch(lay, rng: np.random.Generator, b: int, step: int) -> HostBatch:
    cap = lay.sequence_max_len["history"]
    lengths = rng.integers(0, cap + 1, size=b)
    lengths[:3] = [0, cap, 0]  # empty histories and one at the cap, always
    pooled_lengths = np.concatenate([rng.integers(1, 4, size=b) for _ in lay.pooled])
    pooled_values = np.concatenate([rng.integers(0, f.table.num_rows, size=int(n)) for f, n in
                                    zip(lay.pooled, pooled_lengths.reshape(len(lay.pooled), b).sum(1))])
    tables = lay.sequence_tables["history"]
    return HostBatch(
        step=step, indices=np.arange(b), pooled_lengths=pooled_lengths, pooled_values=pooled_values,
        seq_lengths={"history": lengths},
        seq_values={t.name: rng.integers(0, t.num_rows, size=int(lengths.sum())) for t in tables},
        dense=rng.standard_normal((b, lay.num_dense)).astype(np.float32), labels=np.zeros((b, len(lay.tasks)), np.float32),
    )


def _sharded_sparse(w, tables: dict[str, str], world: int):
    """The sparse arch sharded by TorchRec as the trainer shards it (fused SGD), tables seeded."""
    import torch.distributed as dist
    from torch import nn

    from coplan.trainer.distributed.embedding import apply_embedding_sharding, init_sharded_tables
    from coplan.trainer.model.sparse import SparseArch
    from coplan.planner.given import given_plan

    class Holder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.sparse = SparseArch(feature_layout(w))

    plan = given_plan(w, load_topology("h200-superpod-1k"), world, tables=tables)
    dmp = apply_embedding_sharding(Holder(), plan, device=torch.device("cpu"), group=dist.group.WORLD, local_size=world)
    init_sharded_tables(dmp, SEED, {t.name: t.dim for t in w.all_tables})
    return dmp


def _seq_state(dmp) -> dict[str, np.ndarray]:
    """This rank's shards of the sequence tables (``ecs`` keys), as arrays."""
    out = {}
    for k, v in dmp.state_dict().items():
        if ".ecs." in k:
            shards = v.local_shards() if hasattr(v, "local_shards") else []
            for i, s in enumerate(shards):
                out[f"{k}#{i}"] = s.tensor.detach().clone().numpy()
    return out


def lookup_and_step(chunk: int, tables: dict[str, str], world: int, rank: int) -> dict[str, np.ndarray]:
    """One forward of this rank's batch through a freshly sharded sparse arch, a backward of a fixed
    linear loss on the sequence rows (fused SGD steps the tables), and what came out."""
    w = _workload()
    lay = feature_layout(w).with_seq_chunk(chunk)
    dmp = _sharded_sparse(w, tables, world)
    sparse = dmp.module.sparse
    before = _seq_state(dmp)
    rng = np.random.default_rng([11, rank])
    hb = _host_batch(lay, rng, 16, 0)
    batch = to_device(host_tensors(hb, lay, pin=False), torch.device("cpu"))
    stride = batch.sequences["ec_d16"].stride()
    assert stride == 16 * lay.chunks_per_sample("ec_d16")
    # the pipeline's path (input dist ahead) for the chunked layouts, the plain one for whole histories
    dist_ahead = sparse.input_dist(batch.pooled, batch.sequences) if chunk else None
    _, _, _, seq = sparse(batch.pooled, batch.sequences, dist_ahead)
    g = torch.Generator().manual_seed(5 + rank)
    loss = sum((v * torch.randn(v.shape, generator=g)).sum() for _, v in sorted(seq.items()))
    loss.backward()
    out = {f"out:{k}": v.detach().numpy().copy() for k, v in seq.items()}
    for k, v in _seq_state(dmp).items():
        out[f"delta:{k}"] = v - before[k]
    return out


def _assert_same(results: dict[int, dict[str, np.ndarray]]) -> None:
    ref = results[0]
    assert any(k.startswith("delta:") and np.abs(v).max() > 0 for k, v in ref.items()), "no table was stepped"
    for chunk, res in results.items():
        assert set(res) == set(ref)
        for k in ref:
            np.testing.assert_array_equal(res[k], ref[k], err_msg=f"seq_chunk={chunk}: {k}")


def test_chunk_lengths_layout():
    got = chunk_lengths(np.array([0, 5, 64, 33]), 32, 2)
    assert got.tolist() == [0, 0, 5, 0, 32, 32, 32, 1]
    got7 = chunk_lengths(np.array([64, 0, 14]), 7, 10).reshape(3, 10)
    assert got7[0].tolist() == [7] * 9 + [1] and got7[1].sum() == 0 and got7[2].tolist() == [7, 7] + [0] * 8
    with pytest.raises(DataError, match="max_len"):
        chunk_lengths(np.array([65]), 32, 2)


def test_layout_chunks_per_sample_and_kjt():
    lay = feature_layout(load_workload("gem-tiny"))
    assert lay.seq_chunk == 0 and lay.chunks_per_sample("ec_d16") == 1
    assert lay.with_seq_chunk(32).chunks_per_sample("ec_d16") == 2
    assert lay.with_seq_chunk(7).chunks_per_sample("ec_d16") == 10  # ceil(64 / 7)
    assert lay.with_seq_chunk(1000).chunks_per_sample("ec_d16") == 1
    with pytest.raises(MismatchError, match="non-negative"):
        lay.with_seq_chunk(-1)
    hb = _host_batch(lay, np.random.default_rng(0), 8, 0)
    whole = to_device(host_tensors(hb, lay, pin=False), torch.device("cpu")).sequences["ec_d16"]
    chunked = to_device(host_tensors(hb, lay.with_seq_chunk(7), pin=False), torch.device("cpu")).sequences["ec_d16"]
    assert whole.stride() == 8 and chunked.stride() == 80 and chunked.lengths().numel() == 2 * 80
    assert torch.equal(chunked.values(), whole.values()) and chunked.length_per_key() == whole.length_per_key()
    # per key and sample, the chunks add up to the history
    per_sample = chunked.lengths().reshape(2, 8, 10).sum(-1)
    assert torch.equal(per_sample.reshape(-1), whole.lengths())


def test_one_process_same_rows_and_gradients(one_rank_group):
    results = {c: lookup_and_step(c, TABLES, 1, 0) for c in CHUNKS}
    _assert_same(results)
    # and the gradient is the right one: SGD moved row r by -lr x the sum of the loss weights of r's rows
    # (checked in _assert_same to be equal across chunk sizes; here against a host computation)
    w = _workload()
    lay = feature_layout(w)
    hb = _host_batch(lay, np.random.default_rng([11, 0]), 16, 0)
    g = torch.Generator().manual_seed(5)
    out = results[0]
    names = sorted(k[4:] for k in out if k.startswith("out:"))
    for name in names:
        wts = torch.randn(out[f"out:{name}"].shape, generator=g).numpy()
        table = next(t for t in w.all_tables if t.name == name)
        grad = np.zeros((table.num_rows, table.dim), np.float64)
        np.add.at(grad, hb.seq_values[name], wts)
        delta = next(v for k, v in out.items() if k.startswith("delta:") and f".{name}." in k)
        np.testing.assert_allclose(delta, -LR * grad, rtol=1e-5, atol=1e-6)


def test_two_gloo_ranks_row_wise_and_table_wise(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", __file__, str(tmp_path)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    try:
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, env=env)
    except subprocess.TimeoutExpired:
        pytest.fail(f"2-rank torchrun timed out after {TIMEOUT_S} s")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    for rank in range(2):
        results = {c: dict(np.load(tmp_path / f"rank{rank}_chunk{c}.npz")) for c in CHUNKS}
        _assert_same(results)
        assert any(k.startswith("out:") for k in results[0])


@pytest.mark.slow
def test_trainer_losses_do_not_depend_on_the_bags(tmp_path):
    """End to end: ``coplan.trainer.train`` with whole histories and with bags of 7 ids gives the same
    losses bit for bit, and records the layout in the run's config and summary."""
    import json

    from coplan.spec import dump_spec
    from coplan.planner.given import single_process_plan

    plan = dump_spec(single_process_plan(load_workload("gem-tiny"), load_topology("h200-1gpu"), attention_backend="reference"),
                     tmp_path / "plan.json")
    runs = {}
    for chunk in (0, 7):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1", "-m", "coplan.trainer.train",
               str(plan), "--device", "cpu", "--steps", "2", "--warmup", "0", "--runs-root", str(tmp_path / "runs"),
               "--run-id", f"c{chunk}", "--data", str(tmp_path / "data"), "--data-samples", "64", "--no-progress",
               "--checkpoint-every", "-1", "--trace", "none", "--seq-chunk", str(chunk)]
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, env=dict(os.environ, OMP_NUM_THREADS="1"))
        except subprocess.TimeoutExpired:
            pytest.fail(f"trainer run timed out after {TIMEOUT_S} s")
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        d = tmp_path / "runs" / f"c{chunk}"
        runs[chunk] = [json.loads(x)["loss"] for x in (d / "metrics.jsonl").read_text().splitlines()]
        cfg = json.loads((d / "config.json").read_text())
        assert cfg["seq_chunk"] == chunk and cfg["seq_chunks_per_sample"] == {"ec_d16": 10 if chunk else 1}
        assert f"seq_chunk={chunk}" in json.loads((d / "summary.json").read_text())["notes"]
    assert len(runs[0]) == 2 and runs[0][-1] != runs[0][0]
    assert runs[7] == runs[0]


def _worker(out_dir: Path) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    for c in CHUNKS:
        np.savez(out_dir / f"rank{rank}_chunk{c}.npz", **lookup_and_step(c, TABLES, world, rank))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    from coplan.trainer.train import leave

    _worker(Path(sys.argv[1]))
    leave(0)  # (the results are on disk and checked by the test)
