"""Embedding tables: the lookup time, memory and communication of each table under each sharding
option, vectorised over all tables, and the per-rank loads of a concrete assignment.

A sparse shard group of ``G`` ranks serves the lookups of its ``G·B`` samples (``B`` the local
batch). Table ``t`` needs ``n_t = G·B·λ_t`` lookups per step, ``λ_t = pooling·features`` for pooled
tables and ``E[L]·features`` for sequence tables. With ``k`` shards:

=============== ============= =========== ============ ==================================================
type            lookups/shard rows/shard  dim/shard    output each shard sends (all-to-all, forward)
=============== ============= =========== ============ ==================================================
table_wise      n             R           d            pooled vectors of all G·B samples
row_wise        n / k         R / k       d            partial sums of all G·B samples (pooled) / its rows (sequence)
column_wise     n             R           d / k        its columns of all G·B samples
table_row_wise  n / k         R / k       d            row-wise inside one node: partial sums reduced over NVLink first
data_parallel   B·λ (own)     R           d            none; gradients all-reduced over the world
=============== ============= =========== ============ ==================================================

Ids are assumed hashed, so a row-wise shard gets ``1/k`` of the lookups whatever the Zipf skew.

Lookup time is bandwidth-bound (the fused TBE kernel), slower on shards narrower than a full block
(:data:`NARROW_ROW_FACTORS`): forward reads ``dim·bytes`` per lookup plus
the id and writes the output vectors; backward reads the output gradients, sorts the ids, gathers a
gradient row per lookup and, for every *unique* row touched, reads and writes the weights and the
optimizer state (fused optimizer). Unique rows of ``n`` Zipf(α) draws over ``R`` rows:
``E[U] = Σ_i 1 − exp(−n·p_i)``, ``p_i ∝ i^−α``, evaluated by a log-spaced quadrature. A
data-parallel table (TorchRec's dense kernel) instead makes a dense gradient of the whole table each
step and its optimizer steps every row: its backward moves the table's bytes several times over
(:data:`DP_GRAD_PASSES`), and the gradient is held beside the weights until the optimizer step.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from coplan.costmodel.flops import DTYPE_BYTES, INDEX_BYTES
from coplan.costmodel.jagged import length_moments
from coplan.errors import CoplanError
from coplan.spec.workload import EmbeddingTable, Workload

SHARDING_CODES: dict[str, int] = {"table_wise": 0, "row_wise": 1, "column_wise": 2, "table_row_wise": 3, "data_parallel": 4}
TW, RW, CW, TWRW, DP = range(5)

GRAD_BYTES = 4
"""Embedding gradients are fp32 inside the TBE backward."""

DP_GRAD_PASSES = 3.0
"""Passes over a data-parallel table's dense gradient per step: the backward's zero fill, then the
optimizer's reads (row-wise Adagrad reads it twice: the row's mean square, then the update)."""

NARROW_ROW_FACTORS: tuple[tuple[float, float], ...] = ((64.0, 1.75), (128.0, 1.15))
"""(dim below which, time factor) of a lookup kernel on rows narrower than a full block: FBGEMM's TBE
gives each bag a warp whose lanes hold ``dim`` elements, so a shard of fewer than 128 columns leaves
lanes idle and moves its bytes at a lower achieved bandwidth. The factors are TorchRec's planner's
empirical ones (``HALF_BLOCK_PENALTY`` 1.15 for 64-127 columns, ``QUARTER_BLOCK_PENALTY`` 1.75 below
64; torchrec/distributed/planner/constants.py); ``coplan calibrate`` fits the bandwidth they scale.
They apply to every shard at its own width, so splitting a table column-wise pays for its narrower
shards."""


def narrow_row_factor(dim: np.ndarray) -> np.ndarray:
    """Per-shard time factor of :data:`NARROW_ROW_FACTORS` for shards ``dim`` columns wide."""
    d = np.asarray(dim, dtype=float)
    out = np.ones_like(d)
    for below, f in reversed(NARROW_ROW_FACTORS):
        out = np.where(d < below, f, out)
    return out


def sparse_state_bytes_per_row(optimizer: str, dim) -> np.ndarray:
    """Optimizer state bytes per row (fp32): row-wise Adagrad one value per row, Adagrad one per
    element, Adam two per element, SGD none (FBGEMM's fused optimizers)."""
    d = np.asarray(dim, dtype=float)
    if optimizer == "rowwise_adagrad":
        return np.full_like(d, 4.0)
    if optimizer == "adagrad":
        return 4.0 * d
    if optimizer == "adam":
        return 8.0 * d
    return np.zeros_like(d)


def expected_unique(n: np.ndarray, rows: np.ndarray, alpha: np.ndarray, quad_points: int = 32) -> np.ndarray:
    """E[distinct rows] among ``n`` Zipf(``alpha``) draws over ``rows`` rows (vectorised, Poissonised).

    The sum over rows is split into ``quad_points`` log-spaced bins ``[e_k, e_{k+1})`` of
    ``[1, R+1)``; each holds ``e_{k+1} − e_k`` rows at the bin's geometric centre. Relative error
    about 1% for the tables here (a test checks the limits).
    """
    n = np.asarray(n, dtype=float)
    R = np.asarray(rows, dtype=float)
    a = np.asarray(alpha, dtype=float)
    lr = np.log1p(R)[:, None] / quad_points
    k = np.arange(quad_points, dtype=float)[None, :]
    w = np.exp(lr * k) * np.expm1(lr)
    px = np.exp(-a[:, None] * lr * (k + 0.5))
    H = (w * px).sum(axis=1)
    u = (w * -np.expm1(-(n / H)[:, None] * px)).sum(axis=1)
    return np.minimum(np.minimum(u, n), R)


@dataclass(frozen=True, slots=True)
class TableArrays:
    """The workload's tables as arrays (one entry per table, in ``workload.all_tables`` order)."""

    names: tuple[str, ...]
    index: dict[str, int]
    rows: np.ndarray
    dim: np.ndarray
    wbytes: np.ndarray
    """Bytes per weight element."""
    features: np.ndarray
    lookups_per_sample: np.ndarray
    """λ: expected ids per sample (pooled: pooling·features; sequence: E[L]·features)."""
    is_seq: np.ndarray
    alpha: np.ndarray
    state_row_fixed: np.ndarray
    """Optimizer state bytes per row independent of the dim (row-wise Adagrad: 4)."""
    state_per_elem: np.ndarray
    """Optimizer state bytes per row element (Adagrad: 4, Adam: 8)."""
    sequence: tuple[str | None, ...]
    collection: np.ndarray
    """The TorchRec collection each table's lookups run in (:func:`table_collections`)."""

    @property
    def num(self) -> int:
        return len(self.names)


COLLECTION_KERNELS = (10.0, 25.0)
"""Kernels the trainer's host issues per TorchRec collection (one sharded EmbeddingBagCollection or
EmbeddingCollection, fused TBE) per micro-batch: (forward, backward). Counted on the H100 traces of the
fresh draws fresh_plans_h100h (launches inside TorchRec's ranges, per profiled step, runs with one to
five collections): the input distribution ahead 1, lookup and output distribution 8 (pooled) or 9-10
(sequence), and the backward's TBE with its fused row-wise Adagrad 25, per collection and independent
of the collection's tables (a collection with 16 sequence tables issues as many as one with one). A
count of the library's launches, not a time: what each costs is the calibration's per launch."""


def table_collections(tables: Sequence[EmbeddingTable]) -> np.ndarray:
    """Per table, the TorchRec collection whose lookups hold it in the trainer (``coplan.trainer.model.sparse``):
    0 for the pooled tables (one EmbeddingBagCollection), then one EmbeddingCollection per distinct dimension
    of the sequence tables (an EmbeddingCollection holds one dimension), numbered in increasing dimension."""
    seq_dims = sorted({t.dim for t in tables if t.feature_kind == "sequence"})
    index = {d: 1 + i for i, d in enumerate(seq_dims)}
    return np.fromiter((index[t.dim] if t.feature_kind == "sequence" else 0 for t in tables), int, len(tables))


def table_arrays(workload: Workload) -> TableArrays:
    tabs: tuple[EmbeddingTable, ...] = workload.all_tables
    means = {s.name: length_moments(s.length).mean for s in workload.sequences}
    n = len(tabs)
    rows = np.fromiter((t.num_rows for t in tabs), float, n)
    dim = np.fromiter((t.dim for t in tabs), float, n)
    wb = np.fromiter((DTYPE_BYTES[t.dtype] for t in tabs), float, n)
    feat = np.fromiter((t.num_features for t in tabs), float, n)
    is_seq = np.fromiter((t.feature_kind == "sequence" for t in tabs), bool, n)
    lam = np.fromiter(
        ((means[t.sequence] if t.feature_kind == "sequence" else t.pooling_factor) * t.num_features for t in tabs), float, n
    )
    alpha = np.fromiter((t.zipf_alpha for t in tabs), float, n)
    fixed = sparse_state_bytes_per_row(workload.optimizer.sparse, np.zeros(1))[0]
    per_elem = sparse_state_bytes_per_row(workload.optimizer.sparse, np.ones(1))[0] - fixed
    names = tuple(t.name for t in tabs)
    return TableArrays(names, {nm: i for i, nm in enumerate(names)}, rows, dim, wb, feat, lam, is_seq, alpha,
                       np.full(n, float(fixed)), np.full(n, float(per_elem)), tuple(t.sequence for t in tabs),
                       table_collections(tabs))


@dataclass(frozen=True, slots=True)
class TableOptionCosts:
    """Costs of every table under one (sharding type, shard count), per shard and per step
    (all micro-batches). Arrays are indexed like :class:`TableArrays`."""

    sharding_type: str
    num_shards: np.ndarray
    fwd_s: np.ndarray
    """Forward lookup time of one shard on its rank (bandwidth roof only; launch overhead is per rank)."""
    bwd_s: np.ndarray
    """Backward (gradient + fused optimizer) time of one shard."""
    weight_bytes: np.ndarray
    """Weights of one shard."""
    optimizer_bytes: np.ndarray
    """Optimizer state of one shard (data_parallel: with the table's dense gradient, which lives from the
    backward to the optimizer step)."""
    send_bytes: np.ndarray
    """Output all-to-all bytes one shard's rank sends forward (and receives backward)."""
    recv_bytes: np.ndarray
    """Output all-to-all bytes every rank of the group receives for this table forward."""
    ids_send_bytes: np.ndarray
    """Id bytes every rank sends forward (input distribution) for this table."""
    ids_recv_bytes: np.ndarray
    """Id bytes one shard's rank receives forward."""
    intra_node_bytes: np.ndarray
    """table_row_wise: partial-sum bytes one shard reduces over NVLink before the all-to-all."""
    allreduce_bytes: np.ndarray
    """data_parallel: gradient all-reduce bytes per rank (nccl-tests size)."""
    io_bytes: np.ndarray
    """Transient bytes on a shard's rank: its outputs, their gradients and its ids for one micro-batch."""

    @property
    def memory_bytes(self) -> np.ndarray:
        return self.weight_bytes + self.optimizer_bytes


def option_costs(
    ta: TableArrays, sharding_type: str, num_shards, group_size: int, local_batch: float, num_micro_batches: int,
    out_bytes: float, hbm_bytes_per_s: float, *, kernel: str = "fused", fwd_floor_s: np.ndarray | None = None,
) -> TableOptionCosts:
    """Vectorised :class:`TableOptionCosts` of all tables under ``sharding_type`` with ``num_shards``
    (scalar or per table). ``hbm_bytes_per_s`` is the achieved TBE bandwidth (peak × efficiency);
    ``kernel='dense'`` (one module per table) halves it, a stated guess for unfused lookups.
    ``fwd_floor_s``: per table, a latency-bound floor of the forward lookup (seconds per step): the
    forward costs max(bytes / bandwidth, floor) (the sequence lookups' serial bag walk:
    :func:`coplan.costmodel.decomposed.seq_lookup_floor_s`)."""
    code = SHARDING_CODES[sharding_type]
    k = np.broadcast_to(np.asarray(num_shards, dtype=float), ta.rows.shape).copy()
    if code in (TW, DP):
        k[:] = 1.0
    G, B = float(group_size), float(local_batch)
    bw = hbm_bytes_per_s * (0.5 if kernel == "dense" else 1.0)
    lam = ta.lookups_per_sample
    if code == DP:
        look = B * lam
        rows_s, dim_s = ta.rows, ta.dim
        out_vec = np.where(ta.is_seq, look, B * ta.features)
    else:
        n = G * B * lam
        look = n / k if code in (RW, TWRW) else n
        rows_s = ta.rows / k if code in (RW, TWRW) else ta.rows
        dim_s = ta.dim / k if code == CW else ta.dim
        pooled_out = G * B * ta.features
        out_vec = np.where(ta.is_seq, look, pooled_out)
    fwd_bytes = look * (dim_s * ta.wbytes + INDEX_BYTES) + out_vec * dim_s * out_bytes
    uniq = expected_unique(look / num_micro_batches, rows_s, ta.alpha) * num_micro_batches
    state_row = ta.state_row_fixed + ta.state_per_elem * dim_s
    weight = rows_s * dim_s * ta.wbytes
    opt = rows_s * state_row
    if code == DP:
        # the dense kernel's gradient is a whole table in the weights' dtype, zero-filled each backward,
        # and the optimizer steps every row (:data:`DP_GRAD_PASSES` passes over it; weights and state read
        # and written): no fused update of the rows touched. The gradient stays until the optimizer step.
        grad = weight.copy()
        bwd_bytes = (out_vec * dim_s * out_bytes + look * (2 * INDEX_BYTES + dim_s * GRAD_BYTES)
                     + DP_GRAD_PASSES * grad + 2.0 * weight + 2.0 * opt)
        opt = opt + grad
    else:
        bwd_bytes = (out_vec * dim_s * out_bytes + look * (2 * INDEX_BYTES + dim_s * GRAD_BYTES)
                     + uniq * (2.0 * dim_s * ta.wbytes + 2.0 * state_row))
    zero = np.zeros_like(ta.rows)
    if code == DP:
        send = recv = ids_s = ids_r = intra = zero
        allred = ta.rows * ta.dim * GRAD_BYTES
    else:
        vec_bytes = dim_s * out_bytes
        send = out_vec * vec_bytes
        per_rank_vectors = np.where(ta.is_seq, B * lam, B * ta.features)
        recv = per_rank_vectors * ta.dim * out_bytes * np.where((code == RW) & ~ta.is_seq, k, 1.0)
        ids_s = B * lam * INDEX_BYTES * (k if code == CW else 1.0)
        ids_r = look * INDEX_BYTES
        intra = zero
        if code == TWRW:
            # partial sums reduced over NVLink inside the node, then 1/k of the result per shard leaves it
            intra = np.where(ta.is_seq, 0.0, send)
            send = np.where(ta.is_seq, send, send / k)
        allred = zero
    io = (send + recv + ids_r) / num_micro_batches
    narrow = narrow_row_factor(dim_s)
    fwd = fwd_bytes * narrow / bw
    return TableOptionCosts(
        sharding_type, k, fwd if fwd_floor_s is None else np.maximum(fwd, fwd_floor_s), bwd_bytes * narrow / bw, weight, opt, send, recv, ids_s, ids_r, intra, allred, io,
    )


@dataclass(frozen=True, slots=True)
class TableAssignment:
    """A concrete sharding of every table within the sparse group, as flat arrays (fast to price).

    ``shard_table[i]`` and ``shard_rank[i]`` say that shard ``i`` of table ``shard_table[i]`` lives on
    group rank ``shard_rank[i]``; data-parallel tables have no shards here (``dp_tables`` lists them).
    """

    sharding: np.ndarray
    """Per table: sharding code (see ``SHARDING_CODES``)."""
    num_shards: np.ndarray
    """Per table: shard count (1 for table-wise and data-parallel)."""
    shard_table: np.ndarray
    shard_rank: np.ndarray
    dp_tables: np.ndarray
    """Indices of data-parallel tables."""

    @classmethod
    def from_shards(cls, ta: TableArrays, shards) -> "TableAssignment":
        """From a sequence of :class:`~coplan.spec.TableShard` (every table must appear once)."""
        n = ta.num
        code = np.full(n, -1, dtype=np.int64)
        ks = np.ones(n, dtype=np.int64)
        st: list[int] = []
        sr: list[int] = []
        for s in shards:
            i = ta.index.get(s.table)
            if i is None:
                raise CoplanError(f"table '{s.table}' in the plan is not a table of the workload")
            c = SHARDING_CODES[s.sharding_type]
            code[i] = c
            if c != DP:
                ks[i] = len(s.ranks)
                st.extend([i] * len(s.ranks))
                sr.extend(s.ranks)
        missing = np.flatnonzero(code < 0)
        if missing.size:
            raise CoplanError(f"{missing.size} tables have no sharding in the plan, e.g. {[ta.names[i] for i in missing[:5]]}")
        return cls(code, ks, np.asarray(st, dtype=np.int64), np.asarray(sr, dtype=np.int64), np.flatnonzero(code == DP))


def greedy_table_wise(ctx, *, memory_share: float = 0.4) -> TableAssignment:
    """The pricer's default placement, for pricing before (or without) a plan: every table table-wise
    (row-wise for tables too big for a quarter of a rank's share), placed by longest processing time
    first on ``max(share of lookup time, share of memory)``."""
    ta = ctx.tables
    G = ctx.mesh.sparse_shard
    hbm = ctx.topology.gpu.hbm_bytes
    tw = option_costs(ta, "table_wise", 1, G, ctx.local_batch, ctx.micro_batches, ctx.compute_bytes, ctx.emb_bw)
    mem = tw.memory_bytes
    budget = memory_share * hbm
    k = np.ones(ta.num, dtype=np.int64)
    big = mem > 0.25 * budget
    if big.any():
        need = np.ceil(mem[big] / (0.25 * budget)).astype(np.int64)
        k[big] = np.minimum(G, 1 << np.ceil(np.log2(np.maximum(need, 1))).astype(np.int64))
    code = np.where(k > 1, SHARDING_CODES["row_wise"], SHARDING_CODES["table_wise"]).astype(np.int64)
    rw = option_costs(ta, "row_wise", k, G, ctx.local_batch, ctx.micro_batches, ctx.compute_bytes, ctx.emb_bw)
    cost = np.where(k > 1, rw.fwd_s + rw.bwd_s, tw.fwd_s + tw.bwd_s)
    smem = np.where(k > 1, rw.memory_bytes, mem)
    # multi-shard tables first, each on its k least-loaded distinct ranks; then LPT for the rest
    w_cost = cost / max((cost * 1.0).sum() / G, 1e-300)
    w_mem = smem * k / max((smem * k).sum() / G, 1e-300)
    weight = np.maximum(w_cost, w_mem)
    loads = np.zeros(G)
    tables_out: list[np.ndarray] = []
    ranks_out: list[np.ndarray] = []
    for i in np.flatnonzero(k > 1)[np.argsort(-weight[k > 1], kind="stable")]:
        r = np.argsort(loads, kind="stable")[: k[i]]
        loads[r] += weight[i] / k[i]
        tables_out.append(np.full(k[i], i))
        ranks_out.append(r)
    single = np.flatnonzero(k == 1)
    heap = [(float(loads[r]), int(r)) for r in range(G)]
    heapq.heapify(heap)
    order = single[np.argsort(-weight[single], kind="stable")]
    placed = np.empty(order.size, dtype=np.int64)
    for j, i in enumerate(order.tolist()):
        ld, r = heapq.heappop(heap)
        placed[j] = r
        heapq.heappush(heap, (ld + float(weight[i]), r))
    tables_out.append(order)
    ranks_out.append(placed)
    shard_table = np.concatenate(tables_out).astype(np.int64)
    ranks = np.concatenate(ranks_out).astype(np.int64)
    return TableAssignment(code, k, shard_table, ranks, np.zeros(0, dtype=np.int64))


__all__ = [
    "COLLECTION_KERNELS", "greedy_table_wise",
    "SHARDING_CODES", "TableArrays", "TableAssignment", "TableOptionCosts", "expected_unique", "option_costs",
    "sparse_state_bytes_per_row", "table_arrays", "table_collections",
]
