"""Jagged training data: a seeded generator that writes Parquet, a reader, and the per-rank split.

Files hold one row per sample: ``dense`` (list<float32>), the pooled features in two columns whatever
their number (``pooled_lengths``: fixed-size list<int32>, one bag length per table; ``pooled_ids``:
list<int64>, every table's bag in table order), one ``list<int64>`` column per sequence table (one id per
event), ``len_<sequence>``
(int32), ``tok_<sequence>`` (list<int64>, ``L + 1`` token ids, for the sequences a transformer with a
vocabulary reads) and ``label_<task>`` (float32). The generator draws long-tailed history lengths from
the workload's distributions, Zipf-skewed ids spread over the rows by an affine hash (as hashed ids
are), token ids from a hidden Markov chain (each token the previous one plus a fixed stride, three
times in four; a uniform draw otherwise), and labels from a hidden teacher (per-id scores,
recency-weighted history scores, token scores and a dense linear term), so a model that learns the
ids sees its loss fall for real.

Step ``s`` reads global batch ``s`` (rows ``s·G … s·G+G-1``, wrapping around the files), costs each
sample with the FLOP formula, and splits the batch over (rank, micro-batch) bins with the planner's
balancer (:func:`coplan.costmodel.jagged.balance` with ``num_micro_batches``: bin ``b`` is rank
``b // M``, micro-batch ``b % M``), identically on every rank, then evens out the sample counts of
the bins (see :func:`equalize_counts`). Each rank keeps its ``M`` shares, each in global order.
"""

from __future__ import annotations

import json
import math
import os
import queue
import shutil
import threading
import time
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from rich.console import Console
from rich.progress import track

from coplan.costmodel.flops import per_sample_flops
from coplan.costmodel.jagged import balance
from coplan.errors import CoplanError, MismatchError
from coplan.spec import Workload
from coplan.spec.workload import sample_lengths
from coplan.trainer.features import FeatureLayout, feature_layout

DATASET_META = "dataset.json"
GENERATOR_VERSION = 2
"""Version 2: a sample's pooled features in two columns (``pooled_lengths``: one length per table;
``pooled_ids``: the ids of every table, in table order), read in two column operations whatever the
number of tables (version 1 kept one column per table: 100-500 column reads a batch). Same ids and labels."""

POOLED_LENGTHS, POOLED_IDS = "pooled_lengths", "pooled_ids"

_HASH_MULT = 2_654_435_761  # a prime larger than any table: id = (rank · p + shift) mod rows is a bijection


class DataError(CoplanError):
    """A dataset is missing, malformed or does not match the workload."""


# ---------------------------------------------------------------------------------------------
# Generator
# ---------------------------------------------------------------------------------------------


def _mix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64 finaliser: a fixed pseudo-random bijection of uint64."""
    x = x.astype(np.uint64, copy=True)
    with np.errstate(over="ignore"):
        x ^= x >> np.uint64(30)
        x *= np.uint64(0xBF58476D1CE4E5B9)
        x ^= x >> np.uint64(27)
        x *= np.uint64(0x94D049BB133111EB)
        x ^= x >> np.uint64(31)
    return x


def teacher_score(ids: np.ndarray, salt: int) -> np.ndarray:
    """The hidden teacher's score of each id, uniform in [-1, 1), fixed per (id, salt)."""
    with np.errstate(over="ignore"):
        x = _mix64(ids.astype(np.uint64) + np.uint64((salt * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF))
    return (x >> np.uint64(11)).astype(np.float64) * (2.0 / 2**53) - 1.0


def zipf_ids(rng: np.random.Generator, n: int, num_rows: int, alpha: float, shift: int) -> np.ndarray:
    """``n`` ids with P(rank r) ∝ (r+1)^-alpha (continuous inverse CDF), hashed over the rows."""
    u = rng.random(n)
    if alpha <= 1e-9:
        r = np.floor(u * num_rows)
    elif abs(alpha - 1.0) < 1e-9:
        r = np.floor(np.exp(u * math.log(num_rows + 1.0))) - 1.0
    else:
        a = 1.0 - alpha
        r = np.floor(np.power(((num_rows + 1.0) ** a - 1.0) * u + 1.0, 1.0 / a)) - 1.0
    r = np.clip(r, 0, num_rows - 1).astype(np.int64)
    return (r * _HASH_MULT + shift) % num_rows


def _segment_mean(values: np.ndarray, lengths: np.ndarray, weights: np.ndarray | None = None) -> np.ndarray:
    seg = np.repeat(np.arange(lengths.size), lengths)
    w = np.ones_like(values) if weights is None else weights
    num = np.bincount(seg, weights=values * w, minlength=lengths.size)
    den = np.bincount(seg, weights=w, minlength=lengths.size)
    return np.divide(num, den, out=np.zeros_like(num), where=den > 0)


def _generate_chunk(workload: Workload, layout: FeatureLayout, n: int, seed: int, chunk: int) -> pa.Table:
    rng = np.random.default_rng([seed, chunk])
    cols: dict[str, pa.Array] = {}
    n_tasks = len(layout.tasks)
    logits = np.zeros((n, n_tasks))
    # pooled features: bags of Zipf ids; the teacher scores a bag by its mean id score
    pooled_terms = np.zeros((n, n_tasks))
    per_table_lengths, per_table_ids = [], []
    for fi, f in enumerate(layout.pooled):
        t = f.table
        pf = t.pooling_factor
        lengths = np.ones(n, dtype=np.int64) if pf <= 1.0 else 1 + rng.poisson(pf - 1.0, size=n)
        ids = zipf_ids(rng, int(lengths.sum()), t.num_rows, t.zipf_alpha, shift=_table_shift(seed, t.name))
        per_table_lengths.append(lengths)
        per_table_ids.append(ids)
        for k in range(n_tasks):
            pooled_terms[:, k] += _segment_mean(teacher_score(ids, 1_000 * k + fi), lengths)
    if layout.pooled:
        lengths_tb = np.stack(per_table_lengths)  # (tables, samples)
        ids_sample_major = np.concatenate(per_table_ids)[regroup(lengths_tb)]
        cols[POOLED_LENGTHS] = pa.FixedSizeListArray.from_arrays(
            pa.array(lengths_tb.T.reshape(-1).astype(np.int32), type=pa.int32()), len(layout.pooled))
        cols[POOLED_IDS] = pa.ListArray.from_arrays(_offsets(lengths_tb.sum(axis=0)), pa.array(ids_sample_major, type=pa.int64()))
    logits += math.sqrt(3.0) * pooled_terms / math.sqrt(max(1, len(layout.pooled)))
    # histories: recency-weighted mean of the events' id scores
    seq_lengths: dict[str, np.ndarray] = {}
    for si, s in enumerate(layout.sequences):
        lengths = sample_lengths(workload.sequence(s).length, n, seed=int(rng.integers(2**31)))
        seq_lengths[s] = lengths
        cols[f"len_{s}"] = pa.array(lengths.astype(np.int32), type=pa.int32())
        offs = _offsets(lengths)
        ends = np.cumsum(lengths)
        seg = np.repeat(np.arange(n), lengths)
        pos_from_end = (ends[seg] - 1) - np.arange(int(lengths.sum()))
        w = np.exp(-pos_from_end / 8.0)
        tables = layout.sequence_tables[s]
        hist = np.zeros((n, n_tasks))
        for ti, t in enumerate(tables):
            ids = zipf_ids(rng, int(lengths.sum()), t.num_rows, t.zipf_alpha, shift=_table_shift(seed, t.name))
            cols[t.name] = pa.ListArray.from_arrays(offs, pa.array(ids, type=pa.int64()))
            for k in range(n_tasks):
                hist[:, k] += _segment_mean(teacher_score(ids, 77_000 + 1_000 * k + 10 * si + ti), lengths, w)
        if tables:
            logits += 1.5 * math.sqrt(3.0) * hist / math.sqrt(max(1, len(tables)))
    # token sequences: a Markov chain per sample (its own generator: the other columns do not move)
    for si, (s, vocab) in enumerate(layout.token_sequences.items()):
        ids, counts = markov_tokens(np.random.default_rng([seed, chunk, 1_000 + si]), seq_lengths[s] + 1, vocab)
        cols[f"tok_{s}"] = pa.ListArray.from_arrays(_offsets(counts), pa.array(ids, type=pa.int64()))
        for k in range(n_tasks):
            logits[:, k] += math.sqrt(3.0) * _segment_mean(teacher_score(ids, 55_000 + 1_000 * k + si), counts)
    if layout.num_dense:
        x = rng.standard_normal((n, layout.num_dense)).astype(np.float32)
        w_dense = np.random.default_rng([seed, 99]).standard_normal((layout.num_dense, n_tasks)) / math.sqrt(layout.num_dense)
        logits += 0.8 * (x @ w_dense)
        cols["dense"] = pa.FixedSizeListArray.from_arrays(pa.array(x.reshape(-1), type=pa.float32()), layout.num_dense)
    bias = np.array([-1.0 - 0.5 * k for k in range(n_tasks)])
    p = 1.0 / (1.0 + np.exp(-(logits + bias)))
    labels = (rng.random((n, n_tasks)) < p).astype(np.float32)
    for k, task in enumerate(layout.tasks):
        cols[f"label_{task}"] = pa.array(labels[:, k], type=pa.float32())
    return pa.table(cols)


TOKEN_STRIDE = 7
"""The hidden chain's stride: after token ``x`` comes ``(x + 7) mod V`` three times in four."""


def markov_tokens(rng: np.random.Generator, counts: np.ndarray, vocab: int, keep: float = 0.75) -> tuple[np.ndarray, np.ndarray]:
    """Token ids of samples with ``counts`` ids each (int64, concatenated) from the hidden chain: a sample's
    first id is uniform; each next one is the previous plus :data:`TOKEN_STRIDE` (mod ``vocab``) with
    probability ``keep``, else uniform. Vectorised: an id is its last uniform draw plus the stride times the
    steps since it."""
    counts = np.asarray(counts, dtype=np.int64)
    total = int(counts.sum())
    draws = rng.integers(0, vocab, size=total, dtype=np.int64)
    reset = rng.random(total) >= keep
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    reset[starts[counts > 0]] = True
    pos = np.arange(total, dtype=np.int64)
    last = np.maximum.accumulate(np.where(reset, pos, 0)) if total else pos
    ids = (draws[last] + (pos - last) * TOKEN_STRIDE) % vocab
    return ids.astype(np.int64), counts


def regroup(lengths: np.ndarray) -> np.ndarray:
    """For bags laid out row-major over ``lengths`` (shape (R, C): bag (r, c) holds ``lengths[r, c]`` ids, the
    bags of row 0 first), the gather index that lays the same ids out column-major (bag (0, c), (1, c), ... for
    c = 0, 1, ...). Table-major <-> sample-major, both ways: ``regroup(L)`` inverts ``regroup(L.T)``.

    The index is a staircase: within a bag it counts up by one, and at each bag's first output slot it jumps to
    the bag's source start. So it is the running sum of ones with each bag's jump added at its first slot
    (one pass of ``cumsum`` over the ids), not a ``repeat`` plus an ``arange`` (two passes and a temporary):
    2.5-3.5x faster at a batch's size (176 samples x 100 tables x 30 ids)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    flat = lengths.reshape(-1)
    total = int(flat.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    starts = np.zeros_like(flat)
    np.cumsum(flat[:-1], out=starts[1:])
    order_lengths = lengths.T.reshape(-1)
    keep = order_lengths > 0  # empty bags take no slot (their jump would land on the next bag's)
    order_lengths, order_starts = order_lengths[keep], starts.reshape(lengths.shape).T.reshape(-1)[keep]
    out_starts = np.zeros_like(order_lengths)
    np.cumsum(order_lengths[:-1], out=out_starts[1:])
    jump = order_starts - out_starts
    index = np.ones(total, dtype=np.int64)
    index[0] = jump[0]
    index[out_starts[1:]] += np.diff(jump)
    return np.cumsum(index, out=index)


def _offsets(lengths: np.ndarray) -> pa.Array:
    return pa.array(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32), type=pa.int32())


def _table_shift(seed: int, table: str) -> int:
    import zlib

    return (zlib.crc32(table.encode()) * 31 + seed) % (1 << 31)


def data_sha256(workload: Workload) -> str:
    """Hash of what the data depends on (tables, sequences, dense features, tasks), not of the rest of
    the model: the same files serve any workload with the same inputs."""
    import hashlib

    layout = feature_layout(workload)
    key = {
        "tables": [t.model_dump(mode="json") for t in workload.all_tables],
        "sequences": [s.model_dump(mode="json") for s in workload.sequences],
        "num_dense": layout.num_dense,
        "tasks": list(layout.tasks),
        "generator_version": GENERATOR_VERSION,
    }
    if layout.token_sequences:  # (only then: the hashes, so the datasets, of other workloads stay as they were)
        key["token_sequences"] = layout.token_sequences
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()


PARQUET_COMPRESSION = "lz4"
"""Codec of generated datasets (any Parquet file pyarrow reads is read, whatever its codec)."""


def generate_dataset(
    workload: Workload, out_dir: str | Path, num_samples: int, *, seed: int = 0, rows_per_file: int = 65_536,
    row_group_size: int | None = None, progress: bool = False,
) -> Path:
    """Write ``num_samples`` samples of ``workload`` as Parquet files under ``out_dir``; returns ``out_dir``.

    Deterministic for (workload, num_samples, seed, rows_per_file). Row groups default to the
    global batch so that a step reads whole row groups.
    """
    layout = feature_layout(workload)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if row_group_size is None:
        gb = workload.batch.global_batch_size or workload.batch.local_batch_size or 1024
        row_group_size = max(1, min(gb, rows_per_file))
    files = []
    chunks = range(math.ceil(num_samples / rows_per_file))
    it = track(chunks, description="generate data", console=Console(stderr=True)) if progress else chunks
    for c in it:
        n = min(rows_per_file, num_samples - c * rows_per_file)
        table = _generate_chunk(workload, layout, n, seed, c)
        path = out / f"part-{c:05d}.parquet"
        # LZ4: the reader decodes a row group 1.7x faster than zstd's (a 111-table draw, 176 samples: 13.9 vs 23.8 ms,
        # pyarrow, 2 cores) for files 25% larger; decoding is most of a batch's read
        pq.write_table(table, path, row_group_size=row_group_size, compression=PARQUET_COMPRESSION)
        files.append(path.name)
    meta = {
        "generator_version": GENERATOR_VERSION, "workload": workload.name, "data_sha256": data_sha256(workload),
        "num_samples": num_samples, "seed": seed, "rows_per_file": rows_per_file, "files": files,
        "features": layout.pooled_names, "sequences": list(layout.sequences), "tasks": list(layout.tasks),
    }
    (out / DATASET_META).write_text(json.dumps(meta, indent=1) + "\n")
    return out


# ---------------------------------------------------------------------------------------------
# Reader
# ---------------------------------------------------------------------------------------------


class ParquetSource:
    """The samples of a dataset folder, addressed by a global row index (wrapping around)."""

    def __init__(self, path: str | Path, layout: FeatureLayout) -> None:
        self.path = Path(path)
        files = sorted(self.path.glob("*.parquet"))
        if not files:
            raise DataError(f"{self.path}: no Parquet files; generate a dataset with --generate-data or point --data elsewhere")
        self.layout = layout
        self.files = [pq.ParquetFile(f) for f in files]
        schema = self.files[0].schema_arrow
        need = ([POOLED_LENGTHS, POOLED_IDS] if layout.pooled else []) + [t.name for s in layout.sequences for t in layout.sequence_tables[s]]
        need += [f"len_{s}" for s in layout.sequences] + [f"label_{t}" for t in layout.tasks]
        need += [f"tok_{s}" for s in layout.token_sequences]
        if layout.num_dense:
            need.append("dense")
        missing = [c for c in need if c not in schema.names]
        if missing:
            raise DataError(f"{self.path}: columns {missing[:5]} are missing ({len(missing)} in all); the data was "
                            "written for another workload")
        self.columns = need
        self._groups: list[tuple[int, int, int]] = []  # (file, row group, first global row)
        start = 0
        for fi, f in enumerate(self.files):
            for g in range(f.num_row_groups):
                self._groups.append((fi, g, start))
                start += f.metadata.row_group(g).num_rows
        self.num_rows = start
        self._starts = np.array([g[2] for g in self._groups], dtype=np.int64)
        self._cache: dict[tuple, pa.Table] = {}

    def _group(self, i: int, columns: tuple[str, ...] | None = None) -> pa.Table:
        key = (i, columns)
        t = self._cache.get(key)
        if t is None:
            fi, g, _ = self._groups[i]
            t = self.files[fi].read_row_group(g, columns=list(columns) if columns is not None else self.columns)
            if len(self._cache) > 8:
                self._cache.pop(next(iter(self._cache)))
            self._cache[key] = t
        return t

    def rows(self, start: int, count: int, columns: tuple[str, ...] | None = None) -> pa.Table:
        """``count`` rows from global row ``start`` (mod the dataset size): every column the layout reads, or
        ``columns`` alone (Parquet decodes only the columns asked for)."""
        if count > self.num_rows:
            raise DataError(f"{self.path}: a batch of {count} samples needs at least that many rows; the dataset has {self.num_rows}")
        parts, pos, left = [], start % self.num_rows, count
        while left:
            gi = int(np.searchsorted(self._starts, pos, side="right") - 1)
            t = self._group(gi, columns)
            off = pos - int(self._starts[gi])
            take = min(left, t.num_rows - off)
            parts.append(t.slice(off, take))
            left -= take
            pos = (pos + take) % self.num_rows
        return pa.concat_tables(parts) if len(parts) > 1 else parts[0]


# ---------------------------------------------------------------------------------------------
# Per-rank split
# ---------------------------------------------------------------------------------------------


def equalize_counts(bins: np.ndarray, costs: np.ndarray, num_bins: int) -> np.ndarray:
    """Move the cheapest items of over-full bins to the least-loaded under-full bins until every bin
    holds ⌊n/k⌋ or ⌈n/k⌉ items (the first ``n mod k`` bins by load take the extra ones). Deterministic.

    Why: TorchRec's pooled-embedding exchange needs the per-rank batch sizes to agree on gloo (its
    uneven backward all-gather is NCCL-only), and the per-sample parts of the model (Kunlun, MoE,
    heads, pooled lookups) then do equal work on every rank; only the jagged work stays balanced by cost.
    """
    bins = np.asarray(bins, dtype=np.int64).copy()
    n = bins.size
    lo, extra = divmod(n, num_bins)
    loads = np.bincount(bins, weights=costs, minlength=num_bins).astype(float)
    members = [sorted(np.flatnonzero(bins == b).tolist(), key=lambda i: (costs[i], i)) for b in range(num_bins)]
    order = sorted(range(num_bins), key=lambda b: (loads[b], b))
    target = np.full(num_bins, lo, dtype=np.int64)
    # bins already holding more than lo keep an extra slot first (fewest moves)
    by_size = sorted(range(num_bins), key=lambda b: (-len(members[b]), order.index(b)))
    for b in by_size[:extra]:
        target[b] += 1
    while True:
        over = [b for b in range(num_bins) if len(members[b]) > target[b]]
        if not over:
            break
        src = max(over, key=lambda b: (len(members[b]) - target[b], -b))
        under = [b for b in range(num_bins) if len(members[b]) < target[b]]
        dst = min(under, key=lambda b: (loads[b], b))
        i = members[src].pop(0)
        members[dst].append(i)
        loads[src] -= costs[i]
        loads[dst] += costs[i]
        bins[i] = dst
    return bins


def sample_costs(workload: Workload, lengths: dict[str, np.ndarray], n: int) -> np.ndarray:
    """Model FLOPs (forward + backward) of each sample, from :mod:`coplan.costmodel.flops`."""
    coeffs = per_sample_flops(workload)
    cost = np.full(n, coeffs.get(None).const if None in coeffs else 0.0)
    for s, c in coeffs.items():
        if s is not None and s in lengths:
            cost = cost + c.at(lengths[s])
    return cost


def split_global_batch(costs: np.ndarray, world_size: int, policy: str, micro_batches: int = 1) -> list[np.ndarray]:
    """Sample indices of each (rank, micro-batch) bin, sorted, rank-major (bin ``r·M + m``): the balancer's
    bins with the counts evened out. With ``micro_batches`` 1, one share per rank."""
    k = world_size * micro_batches
    if k == 1:
        return [np.arange(len(costs), dtype=np.int64)]
    bins = balance(costs, world_size, policy, num_micro_batches=micro_batches)  # type: ignore[arg-type]
    bins = equalize_counts(bins, costs, k)
    return [np.flatnonzero(bins == b) for b in range(k)]


# ---------------------------------------------------------------------------------------------
# Host batches
# ---------------------------------------------------------------------------------------------


@dataclass
class HostBatch:
    """One rank's share of one global batch, on the host (numpy), ready to become tensors."""

    step: int
    indices: np.ndarray
    """Positions of this rank's samples (of this micro-batch) in the global batch."""
    pooled_lengths: np.ndarray
    """Feature-major lengths of the pooled features, ``[num_pooled · b]``."""
    pooled_values: np.ndarray
    seq_lengths: dict[str, np.ndarray]
    """Sequence -> per-sample lengths of this rank's samples."""
    seq_values: dict[str, np.ndarray]
    """Sequence table -> its ids (concatenated over this rank's samples)."""
    dense: np.ndarray | None
    labels: np.ndarray
    global_lengths: dict[str, np.ndarray] = field(default_factory=dict)
    """Sequence -> lengths of the whole global batch (for FLOPs and token counts)."""
    rank_costs: np.ndarray | None = None
    """Cost (model FLOPs) of the share of this micro-batch of every rank of this rank's balance group (the world,
    on one node), for the imbalance metric."""
    token_ids: dict[str, np.ndarray] = field(default_factory=dict)
    """Token sequence -> its ids, ``L + 1`` per sample, concatenated over this rank's samples."""
    micro_batch: int = 0
    """Which of the step's micro-batches this is."""
    num_micro_batches: int = 1
    """Micro-batches of the step."""
    shared: Any = None
    """A reader process's batch in transit: the shared-memory buffer its large arrays lie in (:func:`_to_shared`);
    None once received."""

    @property
    def size(self) -> int:
        return int(self.labels.shape[0])


def _list_arrays(col: pa.ChunkedArray) -> tuple[np.ndarray, np.ndarray]:
    """A list column as (offsets [rows + 1] into ``values``, values), without copying the values when the
    column is one chunk (a batch within one row group): the offsets are the slice's own, not rebased."""
    arr = col.chunk(0) if col.num_chunks == 1 else col.combine_chunks()
    offsets = arr.offsets.to_numpy(zero_copy_only=False).astype(np.int64)
    values = arr.values.to_numpy(zero_copy_only=False)
    return offsets, values


def _fixed_rows(col: pa.ChunkedArray, width: int) -> np.ndarray:
    """A fixed-size list column as a ``[rows, width]`` array."""
    arr = col.chunk(0) if col.num_chunks == 1 else col.combine_chunks()
    return arr.flatten().to_numpy(zero_copy_only=False).reshape(-1, width)


def gather_index(offsets: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For a list column given as ``offsets`` (``[n + 1]``), the lengths of ``rows`` (in that order) and the
    index of their values, concatenated in that order."""
    starts = offsets[rows]
    lengths = offsets[rows + 1] - starts
    total = int(lengths.sum())
    if total == 0:
        return lengths, np.zeros(0, dtype=np.int64)
    out_starts = np.cumsum(lengths) - lengths
    return lengths, np.repeat(starts - out_starts, lengths) + np.arange(total, dtype=np.int64)


class _StepColumns:
    """One global batch's columns as numpy arrays (views where Arrow allows), gathered per micro-batch by row."""

    def __init__(self, table: pa.Table, layout: FeatureLayout, path: Path) -> None:
        n = table.num_rows
        self.lists: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        self.pooled_lengths = None
        if layout.pooled:
            self.pooled_lengths = _fixed_rows(table.column(POOLED_LENGTHS), len(layout.pooled)).astype(np.int64)
            self.lists[POOLED_IDS] = _list_arrays(table.column(POOLED_IDS))
        self.seq_lengths = {s: table.column(f"len_{s}").to_numpy().astype(np.int64) for s in layout.sequences}
        for s in layout.sequences:
            for t in layout.sequence_tables[s]:
                off, vals = self.lists[t.name] = _list_arrays(table.column(t.name))
                if not np.array_equal(np.diff(off), self.seq_lengths[s]):
                    raise DataError(f"{path}: column '{t.name}' has lengths that differ from len_{s}")
        for s in layout.token_sequences:
            off, _ = self.lists[f"tok_{s}"] = _list_arrays(table.column(f"tok_{s}"))
            if not np.array_equal(np.diff(off), self.seq_lengths[s] + 1):
                raise DataError(f"{path}: column 'tok_{s}' does not hold len_{s} + 1 ids per sample")
        self.dense = (_fixed_rows(table.column("dense"), layout.num_dense).astype(np.float32, copy=False)
                      if layout.num_dense else None)
        self.labels = (np.stack([table.column(f"label_{t}").to_numpy().astype(np.float32) for t in layout.tasks], axis=1)
                       if layout.tasks else np.zeros((n, 0), np.float32))

    def values(self, name: str, rows: np.ndarray, contiguous: bool | None = None) -> np.ndarray:
        off, vals = self.lists[name]
        if _contiguous(rows) if contiguous is None else contiguous:  # (one rank, one micro-batch: every row in order) a view, no gather
            return vals[off[rows[0]]:off[rows[-1] + 1]].astype(np.int64, copy=False)
        _, idx = gather_index(off, rows)
        return vals[idx].astype(np.int64, copy=False)


def _contiguous(rows: np.ndarray) -> bool:
    n = len(rows)
    return n > 0 and int(rows[-1]) - int(rows[0]) + 1 == n and bool(np.all(np.diff(rows) == 1))


class BatchReader:
    """Global batch ``step`` → this rank's :class:`HostBatch` of each micro-batch (deterministic on every rank).

    The global batch is cut in order into one slice per balance group of ``balance_ranks`` ranks (the trainer
    passes a node's ranks; default every rank): each rank decodes its group's slice only, and the group's
    balancer splits it over the group's ranks and micro-batches. Reading then costs a rank its group's rows,
    not the world's; the groups do not exchange samples, so the spread between the groups' totals is jagged
    imbalance the balancer cannot remove (the cost model prices it: ``expected_imbalance(group_size=...)``).
    The whole batch's lengths (model FLOPs, token counts, the loss's normaliser) are read from their
    columns alone."""

    def __init__(self, workload: Workload, path: str | Path, *, world_size: int, rank: int, policy: str,
                 global_batch: int, micro_batches: int = 1, balance_ranks: int | None = None) -> None:
        if micro_batches < 1 or global_batch % (world_size * micro_batches):
            raise DataError(f"a global batch of {global_batch} does not split into {world_size} ranks x {micro_batches} "
                            "micro-batches of equal size")
        group = world_size if balance_ranks is None else max(1, min(int(balance_ranks), world_size))
        if world_size % group:
            raise DataError(f"{world_size} ranks do not split into balance groups of {group}: give a divisor of the world size")
        self.workload = workload
        self.args = (workload, str(path), world_size, rank, policy, global_batch, micro_batches, group)
        """Everything a reader in another process needs to read the same batches (see :class:`Prefetcher`)."""
        self.layout = feature_layout(workload)
        self.source = ParquetSource(path, self.layout)
        self.world_size, self.rank, self.policy, self.global_batch = world_size, rank, policy, global_batch
        self.micro_batches = micro_batches
        self.group_ranks = group
        """Ranks that balance one slice of the global batch together (:meth:`_step`)."""
        self.group, self.group_rank = divmod(rank, group)
        self.group_batch = global_batch // (world_size // group)
        """Samples of the global batch this rank's group shares."""
        self._split: tuple[int, _StepColumns, dict[str, np.ndarray], list[np.ndarray], np.ndarray] | None = None

    def _step(self, step: int):
        """(step, its columns, global lengths, the bins' sample indices, the bins' costs) of global batch ``step``,
        kept for its micro-batches."""
        if self._split is None or self._split[0] != step:
            lay = self.layout
            first = step * self.global_batch + self.group * self.group_batch
            table = self.source.rows(first, self.group_batch)
            lengths = {s: table.column(f"len_{s}").to_numpy().astype(np.int64) for s in lay.sequences}
            if self.group_ranks == self.world_size:
                g_lengths = lengths
            else:  # the whole batch's lengths (FLOPs, tokens, the loss's token count): their columns alone
                cols = tuple(f"len_{s}" for s in lay.sequences)
                whole = self.source.rows(step * self.global_batch, self.global_batch, cols) if cols else None
                g_lengths = {s: whole.column(f"len_{s}").to_numpy().astype(np.int64) for s in lay.sequences}
            costs = sample_costs(self.workload, lengths, self.group_batch)
            shares = split_global_batch(costs, self.group_ranks, self.policy, self.micro_batches)
            self._split = (step, _StepColumns(table, lay, self.source.path), g_lengths, shares,
                           np.array([costs[s].sum() for s in shares]))
        return self._split

    def read(self, step: int, micro_batch: int = 0) -> HostBatch:
        lay = self.layout
        M = self.micro_batches
        _, cols, g_lengths, shares, bin_costs = self._step(step)
        mine = shares[self.group_rank * M + micro_batch]
        contiguous = _contiguous(mine)
        rank_costs = bin_costs.reshape(self.group_ranks, M)[:, micro_batch]
        if lay.pooled:  # stored sample-major; TorchRec's KJT wants them table-major
            lengths_bt = cols.pooled_lengths[mine]
            off, vals = cols.lists[POOLED_IDS]
            order = regroup(lengths_bt)
            idx = order + off[mine[0]] if contiguous else gather_index(off, mine)[1][order]
            pooled_lengths = lengths_bt.T.reshape(-1)
            pooled_values = vals[idx].astype(np.int64, copy=False)
        else:
            pooled_lengths, pooled_values = np.zeros(0, np.int64), np.zeros(0, np.int64)
        seq_lengths = {s: cols.seq_lengths[s][mine] for s in lay.sequences}
        seq_values = {t.name: cols.values(t.name, mine, contiguous) for s in lay.sequences for t in lay.sequence_tables[s]}
        token_ids = {s: cols.values(f"tok_{s}", mine, contiguous) for s in lay.token_sequences}
        dense = cols.dense[mine] if cols.dense is not None else None
        labels = cols.labels[mine]
        return HostBatch(
            step=step, indices=mine + self.group * self.group_batch, pooled_lengths=pooled_lengths, pooled_values=pooled_values, seq_lengths=seq_lengths,
            seq_values=seq_values, dense=dense, labels=labels, global_lengths=g_lengths, rank_costs=rank_costs,
            token_ids=token_ids, micro_batch=micro_batch, num_micro_batches=M,
        )


def reader_threads(processes: int, local_world: int, cores: int | None = None) -> int:
    """Arrow decode threads per reader process: the host's cores shared out over every rank's readers (at
    least one). Arrow's own default is one pool of all the cores in every process, so that eight readers of
    each of eight ranks would each start a pool as large as the host and contend for it (the in-trainer read
    of a batch took 3-4x the one-process time on the H200's 16-core host, ``fresh_draws_h200.json``)."""
    cores = cores or os.cpu_count() or 1
    return max(1, cores // max(1, processes * max(1, local_world)))


SHARE_MIN_BYTES: int | None = None
"""Arrays of a batch at least this large travel from a reader process in shared memory (:func:`_to_shared`);
None (the default): every batch is pickled through the pipe, as before. Off until a GPU host decides it: on a 2-core
CPU (``benchmarks/loader_transfer.py``) runs disagreed on whether it slows or spares a busy training thread and
whether it reads faster (BENCHMARKS.md has the figures)."""


@dataclass(frozen=True, slots=True)
class _Slot:
    """Where one array of a batch lies in the batch's shared-memory buffer (:func:`_to_shared`)."""

    offset: int
    dtype: str
    shape: tuple[int, ...]


SHM_HEADROOM = 64
"""A batch goes through shared memory only while ``/dev/shm`` has this many times its bytes free (every reader
process keeps a queue's depth of batches in flight; a container's default ``/dev/shm`` is 64 MB)."""


def _shm_room(nbytes: int, path: str = "/dev/shm") -> bool:
    """Whether the shared-memory filesystem has room for a batch of ``nbytes`` (:data:`SHM_HEADROOM`)."""
    try:
        return shutil.disk_usage(path).free >= SHM_HEADROOM * nbytes
    except OSError:
        return False


def _to_shared(hb: HostBatch, min_bytes: int | None = SHARE_MIN_BYTES) -> HostBatch:
    """``hb`` with its large arrays moved into one shared-memory buffer (``hb.shared``) for the queue to the
    training process, each replaced by its :class:`_Slot`.

    A pickled array crosses the pipe in ~64 KiB reads on the data thread, each a hand-back of the GIL that
    the training thread, busy issuing kernels, keeps for up to the switch interval: on the lent H100 the data
    thread spent half its time receiving batches (py-spy of a fresh draw, 2026-12-06). In shared memory one
    handle crosses (torch's multiprocessing reductions: one file descriptor per batch); the copy in is the
    reader process's."""
    if min_bytes is None:
        return hb
    import torch

    found: list[np.ndarray] = []

    def scan(v):
        if isinstance(v, np.ndarray) and v.nbytes >= min_bytes and v.dtype.kind in "biuf":
            found.append(v)
        elif isinstance(v, dict):
            for x in v.values():
                scan(x)

    for f in fields(hb):
        scan(getattr(hb, f.name))
    if not found:
        return hb
    offsets, total = {}, 0
    for a in found:
        offsets[id(a)] = total
        total += (a.nbytes + 63) // 64 * 64
    if not _shm_room(total):
        return hb  # (pickled whole, as before: slower, never short of room)
    try:
        buf = torch.empty(total, dtype=torch.uint8).share_memory_()
    except (RuntimeError, OSError):  # the shared-memory filesystem refused it (full, or absent)
        return hb
    raw = buf.numpy()
    for a in found:
        o = offsets[id(a)]
        raw[o:o + a.nbytes].view(a.dtype).reshape(a.shape)[...] = a

    def conv(v):
        if isinstance(v, np.ndarray) and id(v) in offsets:
            return _Slot(offsets[id(v)], v.dtype.str, tuple(v.shape))
        if isinstance(v, dict):
            return {k: conv(x) for k, x in v.items()}
        return v

    return replace(hb, shared=buf, **{f.name: conv(getattr(hb, f.name)) for f in fields(hb) if f.name != "shared"})


def _from_shared(hb: HostBatch) -> HostBatch:
    """The batch :func:`_to_shared` sent, its arrays numpy views of the shared buffer (which they keep alive)."""
    if hb.shared is None:
        return hb
    raw = hb.shared.numpy()

    def conv(v):
        if isinstance(v, _Slot):
            dt = np.dtype(v.dtype)
            n = int(np.prod(v.shape, dtype=np.int64)) * dt.itemsize
            return raw[v.offset:v.offset + n].view(dt).reshape(v.shape)
        if isinstance(v, dict):
            return {k: conv(x) for k, x in v.items()}
        return v

    return replace(hb, shared=None, **{f.name: conv(getattr(hb, f.name)) for f in fields(hb) if f.name != "shared"})


def _reader_process(args: tuple, steps: list[int], out, stop, threads: int = 1,
                    share_min_bytes: int | None = SHARE_MIN_BYTES) -> None:
    """A reader process: reads every micro-batch of ``steps`` in order into ``out`` as
    ``(host batch, seconds it took)``; an exception is sent as its message and ends the process.
    ``threads``: Arrow's CPU pool size in this process (:func:`reader_threads`)."""
    workload, path, world_size, rank, policy, global_batch, micro_batches, group = args
    try:
        import torch.multiprocessing  # noqa: F401  (registers the reductions that send tensors as shared-memory handles)

        pa.set_cpu_count(max(1, threads))
        reader = BatchReader(workload, path, world_size=world_size, rank=rank, policy=policy,
                             global_batch=global_batch, micro_batches=micro_batches, balance_ranks=group)
        for step in steps:
            for micro in range(micro_batches):
                t0 = time.perf_counter()
                hb = _to_shared(reader.read(step, micro), share_min_bytes)
                item = (hb, time.perf_counter() - t0)
                while not stop.is_set():
                    try:
                        out.put(item, timeout=0.2)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    out.cancel_join_thread()  # stopped: exit without waiting for anyone to take what is queued
                    return
        # the batches' shared memory is handed over by this process when the consumer unpickles them: it stays
        # until the consumer closes (set ``stop``)
        stop.wait()
        out.cancel_join_thread()
    except BaseException as e:  # surfaced on the consumer side, with its type's name
        out.put(DataError(f"data reader process: {type(e).__name__}: {e}"))


MAX_READER_PROCESSES = 8
"""Reader processes per rank at most. Under CUDA graphs the small sampled draws' steps (17-26 ms on the H200)
consumed samples faster than four processes read them (headroom 0.63-0.80 in ``fresh_draws_h200.json``, commit
1c695dd): reading a batch in a process took 90-160 ms there."""


def default_reader_processes(device_type: str, local_world: int) -> int:
    """Reader processes per rank: on CUDA, enough to keep ahead of a fast step without taking the cores the
    ranks' own threads need; none on CPU runs (the thread reads)."""
    if device_type != "cuda":
        return 0
    cores = os.cpu_count() or 1
    return max(1, min(MAX_READER_PROCESSES, cores // max(1, local_world) - 2))


CLOSE_TIMEOUT_S = 10.0
"""How long closing a :class:`Prefetcher` waits for its data thread (one batch's reading and pinning)."""


class Prefetcher:
    """Reads the next host batches ahead of the step: every micro-batch of every step from ``start`` to
    ``stop``, in order.

    With ``processes`` 0 a background thread reads. Otherwise that many reader processes do (step ``i``
    by process ``i mod processes``), so that reading's Python work never holds the training process's GIL
    (a reading thread does: on a short step each hand-back of the GIL can cost the training thread up to
    the interpreter's switch interval); the thread here then only takes their batches in order and runs
    ``prepare`` (pinning). Throughput figures: ``busy_s`` is the busier stage's seconds (reading, summed
    over the processes and divided by their count, or preparing), ``samples`` what was produced."""

    def __init__(self, reader: BatchReader, start: int, stop: int, depth: int = 2,
                 prepare: Callable[[HostBatch], Any] | None = None, setup: Callable[[], None] | None = None,
                 processes: int = 0, local_world: int = 1, share_min_bytes: int | None = SHARE_MIN_BYTES) -> None:
        """``prepare``: also run on the thread, items are then ``(host batch, prepare(host batch))`` (the
        trainer pins the batch's tensors there); ``setup``: run once on the thread first (its CUDA device);
        ``share_min_bytes``: arrays this large come from reader processes in shared memory (:func:`_to_shared`;
        None: pickled)."""
        self._q: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self.samples = 0
        """Samples in the items it produced."""
        self.waited_s = 0.0
        """Seconds the consumer waited on an empty queue, after the first item."""
        self.taken = 0
        self.read_s = 0.0
        self.prepare_s = 0.0
        self.steady_read_s = 0.0
        """Reading seconds (divided by the processes) of every batch but each reader's first (which opens the
        dataset's files and warms its caches: on a 30-step run of four readers it is one batch in eight)."""
        self.steady_reads = 0
        self.steady_prepare_s = 0.0
        """Preparing seconds of every batch but the first (which allocates the pinned buffers)."""
        self.steady_prepared = 0
        self.produced = 0
        """Items produced (read and prepared), ahead of those taken."""
        self._procs: list = []
        micro = getattr(reader, "micro_batches", 1)
        steps = list(range(start, stop))
        processes = max(0, min(processes, len(steps)))
        self.processes = processes
        if processes:
            import multiprocessing as mp

            ctx = mp.get_context("spawn")  # no fork of a process that holds CUDA and NCCL threads
            self._mp_stop = ctx.Event()
            queues = [ctx.Queue(maxsize=depth) for _ in range(processes)]
            threads = reader_threads(processes, local_world)
            for k in range(processes):
                p = ctx.Process(target=_reader_process, args=(reader.args, steps[k::processes], queues[k], self._mp_stop, threads,
                                                              share_min_bytes),
                                name=f"coplan-data-{k}", daemon=True)
                p.start()
                self._procs.append(p)

        def next_read(i: int, step: int, m: int):
            first = m == 0 and i < max(1, processes)  # a reader's first batch opens its files: not the steady state
            if not processes:
                t0 = time.perf_counter()
                item = reader.read(step, m)
                self._read(time.perf_counter() - t0, first)
                return item
            q = queues[i % processes]
            while True:
                try:
                    got = q.get(timeout=0.5)
                    break
                except queue.Empty:
                    if self._stop.is_set():
                        return None
                    if not self._procs[i % processes].is_alive():
                        raise DataError(f"data reader process {i % processes} stopped (exit code "
                                        f"{self._procs[i % processes].exitcode}) before step {step}")
            if isinstance(got, BaseException):
                raise got
            item, secs = got
            self._read(secs / processes, first)
            return _from_shared(item)

        def put(item) -> bool:
            """Into the queue, unless the prefetcher is closing (a full queue then blocks no one)."""
            while not self._stop.is_set():
                try:
                    self._q.put(item, timeout=0.1)
                    return True
                except queue.Full:
                    continue
            return False

        def work() -> None:
            try:
                if setup is not None:
                    setup()
            except BaseException as e:
                put(e)
                return
            for i, step in enumerate(steps):
                for m in range(micro):
                    if self._stop.is_set():
                        return
                    try:
                        item = next_read(i, step, m)
                        if item is None:
                            return
                        n = int(getattr(item, "size", 0))
                        t0 = time.perf_counter()
                        if prepare is not None:
                            item = (item, prepare(item))
                        dt_prep = time.perf_counter() - t0
                        self.prepare_s += dt_prep
                        self.samples += n
                        self.produced += 1
                        if i or m:  # the first batch's preparing allocates the pinned buffers
                            self.steady_prepare_s += dt_prep
                            self.steady_prepared += 1
                    except BaseException as e:  # surfaced on the consumer side
                        put(e)
                        return
                    if not put(item):
                        return

        self._thread = threading.Thread(target=work, name="coplan-data", daemon=True)
        self._thread.start()

    def _read(self, secs: float, first: bool) -> None:
        self.read_s += secs
        if not first:
            self.steady_read_s += secs
            self.steady_reads += 1

    @property
    def busy_s(self) -> float:
        """Seconds of the loader's busier stage (its throughput's denominator)."""
        return max(self.read_s, self.prepare_s)

    def __iter__(self) -> Iterator[HostBatch]:
        return self

    def __next__(self) -> Any:
        try:
            item = self._q.get_nowait()
        except queue.Empty:
            t0 = time.perf_counter()
            item = self._q.get()
            if self.taken:  # (the first item waits for the loader's start: not a stall of the steady state)
                self.waited_s += time.perf_counter() - t0
        self.taken += 1
        if isinstance(item, BaseException):
            raise item
        return item

    def close(self) -> None:
        """Stop the reading and wait for it: the data thread is joined (a daemon thread still inside torch's
        pinning when the interpreter exits can abort the process at its end), then the reader processes."""
        self._stop.set()
        if self._procs:
            self._mp_stop.set()
        deadline = time.monotonic() + CLOSE_TIMEOUT_S
        while True:
            try:
                while True:
                    self._q.get_nowait()
            except queue.Empty:
                pass
            self._thread.join(timeout=0.05)
            if not self._thread.is_alive() or time.monotonic() > deadline:
                break
        for p in self._procs:
            p.join(timeout=2)
            if p.is_alive():
                p.kill()
                p.join(timeout=2)


def check_dataset(path: str | Path, workload: Workload) -> dict:
    """The dataset's metadata; refuses one written for a different workload."""
    meta_path = Path(path) / DATASET_META
    if not meta_path.is_file():
        raise DataError(f"{path}: no {DATASET_META}; not a coplan dataset")
    meta = json.loads(meta_path.read_text())
    if meta.get("generator_version") != GENERATOR_VERSION:
        raise DataError(f"{path}: written by data generator version {meta.get('generator_version')}; this coplan reads "
                        f"version {GENERATOR_VERSION} (the pooled features' columns changed): delete the folder, or pass "
                        "--data to a new one, and it is generated again")
    if meta.get("data_sha256") != data_sha256(workload):
        raise MismatchError(f"{path}: written for workload '{meta.get('workload')}', whose inputs (tables, sequences, "
                            f"dense features, tasks) differ from those of '{workload.name}'; generate data for this plan")
    return meta


__all__ = [
    "BatchReader", "DataError", "HostBatch", "ParquetSource", "Prefetcher", "check_dataset", "data_sha256", "equalize_counts",
    "generate_dataset", "sample_costs", "split_global_batch", "teacher_score", "zipf_ids",
]
