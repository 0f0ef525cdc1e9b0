"""The Parquet generator and reader, and the per-rank split of a global batch."""

import json

import numpy as np
import pyarrow.parquet as pq
import pytest
from hypothesis import given
from hypothesis import strategies as st

from coplan.costmodel.jagged import balance, bin_loads
from coplan.errors import CoplanError
from coplan.spec import load_workload
from coplan.trainer.data import (
    BatchReader,
    DataError,
    check_dataset,
    data_sha256,
    equalize_counts,
    generate_dataset,
    sample_costs,
    split_global_batch,
    teacher_score,
    zipf_ids,
)
from coplan.trainer.features import feature_layout


@pytest.fixture(scope="module")
def tiny():
    return load_workload("gem-tiny")


@pytest.fixture(scope="module")
def dataset(tiny, tmp_path_factory):
    return generate_dataset(tiny, tmp_path_factory.mktemp("data"), 640, seed=3, rows_per_file=256)


def test_files_have_jagged_list_columns(tiny, dataset):
    files = sorted(dataset.glob("*.parquet"))
    assert len(files) == 3  # 256 + 256 + 128 rows
    table = pq.read_table(files[0])
    lay = feature_layout(tiny)
    import pyarrow as pa

    for f in ["pooled_ids", "hist_item", "hist_action"]:
        typ = table.schema.field(f).type
        assert pa.types.is_list(typ) and typ.value_type == pa.int64()
    # the pooled features: one length per table and sample, the ids of every table in table order
    typ = table.schema.field("pooled_lengths").type
    assert pa.types.is_fixed_size_list(typ) and typ.list_size == len(lay.pooled_names)
    lens = table.column("pooled_lengths").combine_chunks().flatten().to_numpy().reshape(-1, len(lay.pooled_names))
    assert np.array_equal(lens.sum(axis=1), table.column("pooled_ids").combine_chunks().value_lengths().to_numpy())
    assert (lens >= 1).all()
    lengths = table.column("len_history").to_numpy()
    assert np.array_equal(table.column("hist_item").combine_chunks().value_lengths().to_numpy(), lengths)
    assert lengths.min() >= 0 and lengths.max() <= 64
    meta = json.loads((dataset / "dataset.json").read_text())
    assert meta["num_samples"] == 640 and meta["data_sha256"] == data_sha256(tiny)


def test_generation_is_deterministic(tiny, tmp_path):
    a = generate_dataset(tiny, tmp_path / "a", 100, seed=5)
    b = generate_dataset(tiny, tmp_path / "b", 100, seed=5)
    c = generate_dataset(tiny, tmp_path / "c", 100, seed=6)
    ta, tb, tc = (pq.read_table(d / "part-00000.parquet") for d in (a, b, c))
    assert ta.equals(tb)
    assert not ta.equals(tc)


def test_lengths_are_long_tailed_and_ids_skewed():
    rng = np.random.default_rng(0)
    ids = zipf_ids(rng, 200_000, 10_000, 1.1, shift=17)
    counts = np.bincount(ids, minlength=10_000)
    top = np.sort(counts)[::-1]
    assert top[:100].sum() > 0.3 * ids.size  # the hottest 1% of rows take a large share
    assert ids.min() >= 0 and ids.max() < 10_000
    uniform = np.bincount(zipf_ids(rng, 200_000, 10_000, 0.0, shift=0), minlength=10_000)
    assert np.sort(uniform)[::-1][:100].sum() < 0.02 * 200_000


def test_labels_follow_the_teacher(tiny, dataset):
    """The labels carry signal a model can learn: the teacher's pooled-id score predicts the CTR label."""
    t = pq.read_table(dataset / "part-00000.parquet")
    lay = feature_layout(tiny)
    assert lay.pooled[0].name == "user_id" and lay.pooled[0].table.pooling_factor <= 1.0  # one id per sample, first
    user = np.array([ids[0] for ids in t.column("pooled_ids").to_pylist()])
    score = teacher_score(user, 0)
    y = t.column("label_ctr").to_numpy()
    assert 0.05 < y.mean() < 0.95
    assert np.corrcoef(score, y)[0, 1] > 0.05


def test_reader_shares_partition_the_global_batch(tiny, dataset):
    shares = [BatchReader(tiny, dataset, world_size=4, rank=r, policy="greedy", global_batch=64).read(7) for r in range(4)]
    idx = np.sort(np.concatenate([s.indices for s in shares]))
    assert np.array_equal(idx, np.arange(64))
    assert {s.size for s in shares} == {16}
    whole = BatchReader(tiny, dataset, world_size=1, rank=0, policy="greedy", global_batch=64).read(7)
    assert sum(int(s.seq_lengths["history"].sum()) for s in shares) == int(whole.seq_lengths["history"].sum())
    assert np.array_equal(shares[0].global_lengths["history"], whole.global_lengths["history"])
    # the same step reads the same rows on every rank, and steps wrap around the 640 rows
    again = BatchReader(tiny, dataset, world_size=4, rank=2, policy="greedy", global_batch=64).read(7)
    assert np.array_equal(again.pooled_values, shares[2].pooled_values)
    wrapped = BatchReader(tiny, dataset, world_size=1, rank=0, policy="none", global_batch=64).read(10)
    first = BatchReader(tiny, dataset, world_size=1, rank=0, policy="none", global_batch=64).read(0)
    assert np.array_equal(wrapped.labels, first.labels)


def test_dataset_of_another_workload_is_refused(dataset):
    other = load_workload("gem-h200")
    with pytest.raises(CoplanError, match="differ"):
        check_dataset(dataset, other)


def test_balanced_split_beats_a_plain_one(tiny):
    rng = np.random.default_rng(1)
    lengths = {"history": rng.lognormal(np.log(16) - 0.32, 0.8, size=256).clip(0, 64).round().astype(np.int64)}
    costs = sample_costs(tiny, lengths, 256)
    loads = lambda shares: np.array([costs[s].sum() for s in shares])  # noqa: E731
    plain = loads(split_global_batch(costs, 8, "none"))
    kk = loads(split_global_batch(costs, 8, "karmarkar_karp"))
    greedy = loads(split_global_batch(costs, 8, "greedy"))
    assert kk.max() / kk.mean() < plain.max() / plain.mean()
    assert greedy.max() / greedy.mean() < plain.max() / plain.mean()


@given(
    costs=st.lists(st.floats(min_value=0.0, max_value=1e6, allow_nan=False), min_size=1, max_size=200),
    k=st.integers(min_value=1, max_value=9),
)
def test_equalize_counts_gives_equal_counts_and_keeps_items(costs, k):
    c = np.asarray(costs)
    bins = balance(c, k, "greedy")
    out = equalize_counts(bins, c, k)
    sizes = np.bincount(out, minlength=k)
    assert sizes.max() - sizes.min() <= 1
    assert sizes.sum() == c.size
    # deterministic, and a no-op on a split that is already even
    assert np.array_equal(out, equalize_counts(bins, c, k))
    assert np.array_equal(equalize_counts(out, c, k), out)
    assert np.isclose(bin_loads(c, out, k).sum(), c.sum())


def test_micro_batches_partition_each_rank_share(tiny, dataset):
    """With M micro-batches the global batch splits into world x M bins of equal size, balanced by cost;
    together they are the global batch, and the per-rank share of M = 1 has the same size."""
    M, W = 4, 2
    readers = [BatchReader(tiny, dataset, world_size=W, rank=r, policy="greedy", global_batch=64, micro_batches=M) for r in range(W)]
    parts = [readers[r].read(3, m) for r in range(W) for m in range(M)]
    assert {p.size for p in parts} == {64 // (W * M)}
    assert [(p.micro_batch, p.num_micro_batches) for p in parts[:M]] == [(m, M) for m in range(M)]
    idx = np.sort(np.concatenate([p.indices for p in parts]))
    assert np.array_equal(idx, np.arange(64))
    whole = BatchReader(tiny, dataset, world_size=1, rank=0, policy="greedy", global_batch=64).read(3)
    assert sum(int(p.seq_lengths["history"].sum()) for p in parts) == int(whole.seq_lengths["history"].sum())
    assert parts[0].rank_costs.shape == (W,)
    with pytest.raises(CoplanError, match="does not split into 2 ranks x 3 micro-batches"):
        BatchReader(tiny, dataset, world_size=2, rank=0, policy="greedy", global_batch=64, micro_batches=3)


def test_token_sequences_hold_next_token_targets(tmp_path):
    """A decoder's sequence gets L + 1 token ids per sample from the hidden chain; the batch's inputs and
    targets are each sample's ids shifted by one, and the chain is learnable (mostly the stride)."""
    from coplan.spec.draw import random_workload
    from coplan.trainer.batch import to_batch
    from coplan.trainer.data import TOKEN_STRIDE

    w = random_workload(1, "dense")  # jagged lengths
    lay = feature_layout(w)
    (s, vocab), = lay.token_sequences.items()
    data = generate_dataset(w, tmp_path / "d", 64, seed=1)
    gb = w.batch.global_(1)
    hb = BatchReader(w, data, world_size=1, rank=0, policy="greedy", global_batch=gb).read(0)
    ids = hb.token_ids[s]
    assert ids.size == int(hb.seq_lengths[s].sum()) + hb.size and ids.min() >= 0 and ids.max() < vocab
    import torch

    b = to_batch(hb, lay, torch.device("cpu"))
    x, y = b.token_ids[s].numpy(), b.targets[s].numpy()
    assert x.size == y.size == int(hb.seq_lengths[s].sum()) and b.offsets[s][-1] == x.size
    pos = 0
    for i, n in enumerate(hb.seq_lengths[s]):
        first = int(hb.seq_lengths[s][:i].sum()) + i
        assert np.array_equal(x[pos : pos + n], ids[first : first + n])
        assert np.array_equal(y[pos : pos + n], ids[first + 1 : first + n + 1])
        pos += n
    assert np.mean((y - x) % vocab == TOKEN_STRIDE) > 0.6
    assert b.labels.shape == (hb.size, 0) and b.pooled is None and b.sequences == {}


def _read_all(pf, n):
    out = [next(pf) for _ in range(n)]
    pf.close()
    return out


def _same(a, b):
    assert a.step == b.step and a.micro_batch == b.micro_batch
    assert np.array_equal(a.indices, b.indices) and np.array_equal(a.pooled_values, b.pooled_values)
    assert np.array_equal(a.labels, b.labels)
    assert all(np.array_equal(a.seq_values[k], b.seq_values[k]) for k in a.seq_values)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("processes,share", [(1, None), (3, None), (2, 0)])
def test_reader_processes_give_the_thread_s_batches_in_order(tiny, dataset, processes, share):
    """Reading in processes (steps dealt round-robin) yields exactly the thread's batches, in step order,
    and counts samples and busy time for the loader's throughput; with ``share`` 0 every array comes through
    shared memory."""
    from coplan.trainer.data import Prefetcher

    kw = dict(world_size=2, rank=1, policy="greedy", global_batch=32, micro_batches=2)
    tpf = Prefetcher(BatchReader(tiny, dataset, **kw), 1, 7)
    thread = _read_all(tpf, 12)
    assert tpf.steady_reads == 11
    pf = Prefetcher(BatchReader(tiny, dataset, **kw), 1, 7, processes=processes, prepare=lambda hb: hb.size,
                    share_min_bytes=share)
    procs = [next(pf) for _ in range(12)]
    assert pf.processes == processes and pf.samples == 12 * 8 and pf.busy_s > 0
    # the steady state leaves out each reader's first batch (it opens the files) and the first preparing
    assert pf.steady_reads == 12 - processes and pf.steady_prepared == 11 and pf.produced == 12
    assert 0 < pf.steady_read_s <= pf.read_s
    pf.close()
    assert all(not p.is_alive() for p in pf._procs)
    for a, (b, n) in zip(thread, procs):
        _same(a, b)
        assert n == b.size == 8


def test_a_batch_in_shared_memory_crosses_the_pipe_as_handles(tiny, dataset, monkeypatch):
    """A reader process's batch, its large arrays in shared memory: what crosses the pipe is a few hundred bytes
    per array, not the array (a pickled array is read on the data thread in 64 KiB pieces, each a hand-back of
    the GIL), and it reads back as the same arrays."""
    import torch.multiprocessing  # noqa: F401  (the reductions the reader processes use)
    from multiprocessing.reduction import ForkingPickler

    from coplan.trainer.data import _from_shared, _to_shared

    hb = BatchReader(tiny, dataset, world_size=1, rank=0, policy="greedy", global_batch=32).read(1)
    big = np.arange(1 << 18, dtype=np.int64)  # 2 MiB of ids
    hb.seq_values[next(iter(hb.seq_values))] = big
    plain = len(ForkingPickler.dumps(hb))
    shared = _to_shared(hb, min_bytes=1 << 16)
    sent = len(ForkingPickler.dumps(shared))
    assert plain > big.nbytes and sent < 64 * 1024
    back = _from_shared(ForkingPickler.loads(ForkingPickler.dumps(shared)))
    _same(hb, back)
    assert isinstance(back.seq_values[next(iter(back.seq_values))], np.ndarray)

    # no room on the shared-memory filesystem (a container's small /dev/shm): the batch is pickled whole, as before
    import coplan.trainer.data as data

    monkeypatch.setattr(data, "_shm_room", lambda nbytes, path="/dev/shm": False)
    assert _to_shared(hb, min_bytes=1 << 16) is hb


@pytest.mark.timeout(120)
def test_a_reader_process_error_surfaces_as_a_data_error(tiny, dataset):
    from coplan.trainer.data import DataError, Prefetcher

    # the process's reader cannot open the dataset: the consumer gets a DataError naming the process
    r = BatchReader(tiny, dataset, world_size=1, rank=0, policy="greedy", global_batch=64)
    r.args = (r.args[0], str(dataset / "gone"), *r.args[2:])
    pf = Prefetcher(r, 0, 3, processes=1)
    with pytest.raises(DataError, match="data reader process"):
        for _ in range(3):
            next(pf)
    pf.close()


def test_reader_processes_default_to_none_on_cpu():
    from coplan.trainer.data import default_reader_processes

    assert default_reader_processes("cpu", 1) == 0
    from coplan.trainer.data import MAX_READER_PROCESSES

    assert 1 <= default_reader_processes("cuda", 8) <= MAX_READER_PROCESSES
    assert 1 <= default_reader_processes("cuda", 1) <= MAX_READER_PROCESSES


def test_reader_threads_share_the_host_s_cores_out():
    from coplan.trainer.data import reader_threads

    assert reader_threads(8, 1, cores=16) == 2  # eight readers of one rank on 16 cores
    assert reader_threads(8, 8, cores=128) == 2
    assert reader_threads(4, 8, cores=16) == 1  # never fewer than one
    assert reader_threads(0, 1, cores=4) == 4


def test_regroup_swaps_table_major_and_sample_major_bags():
    from coplan.trainer.data import regroup

    rng = np.random.default_rng(0)
    for _ in range(100):
        lengths = rng.integers(0, 4, size=(int(rng.integers(0, 5)), int(rng.integers(0, 5))))
        vals = np.arange(int(lengths.sum()))
        bags, pos = {}, 0
        for r in range(lengths.shape[0]):
            for c in range(lengths.shape[1]):
                bags[r, c] = vals[pos:pos + lengths[r, c]]
                pos += lengths[r, c]
        want = [bags[r, c] for c in range(lengths.shape[1]) for r in range(lengths.shape[0])]
        got = vals[regroup(lengths)]
        assert np.array_equal(got, np.concatenate(want) if want else np.zeros(0))
        assert np.array_equal(got[regroup(lengths.T)], vals)


def test_reader_gives_each_table_its_bags(tiny, dataset):
    """The batch's pooled features are table-major as TorchRec's KJT wants them, each bag as generated."""
    import pyarrow.parquet as pq

    lay = feature_layout(tiny)
    r = BatchReader(tiny, dataset, world_size=1, rank=0, policy="greedy", global_batch=32)
    hb = r.read(0)
    table = pq.read_table(sorted(dataset.glob("*.parquet"))[0]).take(hb.indices)
    T, B = len(lay.pooled_names), len(hb.indices)
    lens = table.column("pooled_lengths").combine_chunks().flatten().to_numpy().reshape(B, T)
    ids = table.column("pooled_ids").to_pylist()
    assert np.array_equal(hb.pooled_lengths, lens.T.reshape(-1))
    pos = 0
    for t in range(T):
        for b in range(B):
            start = int(lens[b, :t].sum())
            assert list(hb.pooled_values[pos:pos + lens[b, t]]) == ids[b][start:start + lens[b, t]]
            pos += lens[b, t]


def test_a_dataset_of_an_older_generator_is_refused(tiny, tmp_path):
    d = generate_dataset(tiny, tmp_path / "old", 64, seed=1)
    meta = json.loads((d / "dataset.json").read_text())
    meta["generator_version"] = 1
    (d / "dataset.json").write_text(json.dumps(meta))
    with pytest.raises(CoplanError, match="generator version 1"):
        check_dataset(d, tiny)


def test_gather_index_is_arrow_take_of_a_sliced_list_column():
    """The reader gathers a micro-batch's rows from the step's columns by offsets (no Arrow ``take``): the same
    lengths and values as ``take``, for a slice of a column (offsets not rebased), rows in any order, empty rows."""
    import pyarrow as pa

    from coplan.trainer.data import _list_arrays, gather_index

    rng = np.random.default_rng(0)
    lengths = rng.integers(0, 6, size=40)
    lengths[[3, 17]] = 0
    values = np.arange(int(lengths.sum()), dtype=np.int64) * 7
    col = pa.ListArray.from_arrays(pa.array(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)), pa.array(values))
    sliced = pa.chunked_array([col.slice(5, 30)])
    off, vals = _list_arrays(sliced)
    for rows in (np.arange(30), np.array([29, 0, 12, 12, 3]), rng.permutation(30)[:11], np.array([], dtype=np.int64)):
        got_len, idx = gather_index(off, rows)
        want = sliced.take(pa.array(rows, type=pa.int64())).combine_chunks()
        assert np.array_equal(got_len, want.value_lengths().to_numpy(zero_copy_only=False))
        assert np.array_equal(vals[idx], want.flatten().to_numpy(zero_copy_only=False))


@pytest.mark.parametrize("micro", [1, 2])
def test_balance_groups_read_their_slice_and_cover_the_batch_once(tiny, dataset, micro):
    """Four ranks in two balance groups: every sample of the global batch goes to exactly one (rank, micro-batch),
    each group's ranks take their samples from the group's slice of the batch only, every rank sees the whole
    batch's lengths, and a group of the world is the global balancer (the same batches as without groups)."""
    gb, world, group = 64, 4, 2
    kw = dict(world_size=world, policy="greedy", global_batch=gb, micro_batches=micro)
    for step in (0, 3):
        seen: list[int] = []
        full = BatchReader(tiny, dataset, rank=0, **kw).read(step, 0).global_lengths
        for rank in range(world):
            r = BatchReader(tiny, dataset, rank=rank, balance_ranks=group, **kw)
            assert (r.group, r.group_rank, r.group_batch) == (rank // group, rank % group, gb // 2)
            for m in range(micro):
                hb = r.read(step, m)
                lo = (rank // group) * (gb // 2)
                assert np.all((hb.indices >= lo) & (hb.indices < lo + gb // 2))
                assert hb.rank_costs.shape == (group,)
                assert all(np.array_equal(hb.global_lengths[s], full[s]) for s in full)
                # the samples' own lengths are the whole batch's at their positions
                for s, v in hb.seq_lengths.items():
                    assert np.array_equal(v, full[s][hb.indices])
                seen += hb.indices.tolist()
        assert sorted(seen) == list(range(gb))
    # a group of every rank is the global balancer
    a = BatchReader(tiny, dataset, rank=1, **kw).read(2, 0)
    b = BatchReader(tiny, dataset, rank=1, balance_ranks=world, **kw).read(2, 0)
    _same(a, b)
    with pytest.raises(DataError, match="balance groups"):
        BatchReader(tiny, dataset, rank=0, balance_ranks=3, **kw)
