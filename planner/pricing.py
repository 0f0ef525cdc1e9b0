"""What the solver sees of one mesh candidate: the cost model's figures, as small frozen values, and
the one model of the step (:func:`evaluate`) that the solver minimises.

The cost model prices; the planner only adds, takes maxima and compares. A solution (an option and
ranks per table, a recompute set) adds to the step through a handful of aggregates, the same ones the
pricer's schedule reads (:class:`coplan.costmodel.pricer.SparseAggregates`):

    fwd   = the slowest rank's forward lookups (each rank's shards summed, kernel launches included)
    bwd   = the slowest rank's backward lookups and fused optimizer
    a2a   = max(busiest sender's output bytes, ρ · Σ_t bytes every rank receives)
    ids   = max(Σ_t id bytes every rank sends, busiest receiver's id bytes)
    dp    = Σ data-parallel tables' gradient all-reduce bytes
    sync  = fullest rank's shard weights and optimizer state (the replica sync, with 2-D sparse)

and the step is modelled as the largest of the candidate's **cuts** (:class:`~coplan.costmodel.results.StepCut`):
each is the length of one path of the pricer's two-stream schedule, linear in the aggregates and in
the recompute set, and exact at the plan it was priced from. So the model is a piecewise-linear
under-estimate of the pricer's step that is exact wherever it was priced; the search prices every
solution CP-SAT returns and adds its critical path as a new cut until the model and the pricer
agree (:mod:`coplan.planner.search`).

Memory on rank ``r`` is linear, as the pricer's memory is:

    base_bytes − Σ_{recomputed} saved_bytes + max_{recomputed} peak_bytes
         + mem_r + recv_mem_factor · Σ_t recv_t  ≤  capacity_bytes (HBM less the topology's reserve).

A table option puts ``num_shards`` equal shards somewhere: on ranks the solver picks (table-wise: 1,
column-wise: n), on the ranks of one node it picks (table-row-wise), or one on every rank of the
group (row-wise; data-parallel holds a full copy on every rank).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from itertools import compress
from typing import Literal

import numpy as np

from coplan.costmodel.results import StepCut
from coplan.planner.mesh import MeshCandidate

Placement = Literal["rank", "node", "all"]

PLACEMENT_OF = {"table_wise": "rank", "column_wise": "rank", "table_row_wise": "node", "row_wise": "all", "data_parallel": "all"}

VARS = ("fwd", "bwd", "a2a", "ids", "dp", "sync")
"""The aggregates a cut is linear in (see the module docstring)."""

LOADS = ("fwd", "bwd", "a2a", "ids", "sync")
"""The aggregates that are a maximum over ranks (per-rank loads); 'dp' is a sum."""


@dataclass(frozen=True, slots=True)
class ShardOption:
    """One way to shard one table for one mesh candidate, priced per shard and per step."""

    sharding_type: str
    """TorchRec sharding type."""

    num_shards: int
    """Shards (table-wise 1, column-wise n, table-row-wise a node, row-wise and data-parallel the group)."""

    fwd_s: float
    """Forward lookup time of one shard on its rank (table-row-wise: with its NVLink reduction)."""

    bwd_s: float
    """Backward and fused optimizer time of one shard."""

    send_bytes: float
    """Output all-to-all bytes the shard's rank sends."""

    mem_bytes: float
    """Weights, optimizer state and lookup buffers of one shard."""

    recv_bytes: float = 0.0
    """Output all-to-all bytes every rank receives for this table (0 for data-parallel)."""

    allreduce_bytes: float = 0.0
    """Data-parallel gradient all-reduce bytes."""

    ids_recv_bytes: float = 0.0
    """Id bytes the shard's rank receives (input all-to-all)."""

    ids_send_bytes: float = 0.0
    """Id bytes every rank sends for this table (input all-to-all; 0 for data-parallel)."""

    sync_bytes: float = 0.0
    """Weights and optimizer state of one shard that a replica sync all-reduces (0 for data-parallel:
    replicated tables are kept equal by their gradient all-reduce)."""

    placement: Placement = field(init=False, compare=False, repr=False)
    """Where the solver puts the shards ('rank', 'node' or 'all'); derived from the sharding type."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "placement", PLACEMENT_OF[self.sharding_type])

    @property
    def label(self) -> str:
        return f"column_wise/{self.num_shards}" if self.sharding_type == "column_wise" else self.sharding_type

    def load(self) -> tuple[float, float, float, float, float]:
        """Per-rank loads of one shard, in :data:`LOADS` order (raw units: seconds and bytes)."""
        return (self.fwd_s, self.bwd_s, self.send_bytes, self.ids_recv_bytes, self.sync_bytes)


@dataclass(frozen=True, slots=True)
class LayerOption:
    """Recompute of one layer: what it costs and what it frees."""

    name: str
    """'<block>.<layer index>'."""

    recompute_s: float
    """Forward time recomputed in backward (per step), with a MoE layer's dispatch and combine again."""

    saved_bytes: float
    """Activation bytes no longer kept (all but the layer input)."""

    peak_bytes: float
    """Activations rebuilt while the layer's backward runs (the recompute peak is the largest of these)."""


@dataclass(frozen=True, slots=True)
class CandidatePricing:
    """Everything the solver needs for one mesh candidate."""

    mesh: MeshCandidate
    """The candidate."""

    node_size: int
    """Ranks of one node within the shard group (table-row-wise spans one)."""

    base_bytes: float
    """Memory identical on every rank, without recompute and embeddings."""

    capacity_bytes: float
    """HBM a rank may fill: capacity less the topology's reserve."""

    layers: tuple[LayerOption, ...]
    """Layers that may be recomputed."""

    options: tuple[tuple[ShardOption, ...], ...]
    """Options per table, in the workload's table order."""

    table_names: tuple[str, ...]
    """Table names, in the same order."""

    cuts: tuple[StepCut, ...] = ()
    """The step model: its largest cut (see the module docstring). Grows as solutions are priced."""

    scale: dict[str, float] = field(default_factory=dict)
    """Per aggregate, seconds of one schedule task per raw unit (1/M for lookups; the all-to-all's
    seconds per byte over M...): converts a cut's coefficients into counts of tasks on its path, which
    is how the CP-SAT model states them in integers. A missing or zero entry: the aggregate costs nothing."""

    launch_s: tuple[float, float] = (0.0, 0.0)
    """Kernel launches a rank holding any shard adds to its forward and backward lookups (per step)."""

    recv_factor: float = 1.0
    """Multiplier of the received bytes (the jagged imbalance of sequence lengths)."""

    recv_mem_factor: float = 0.0
    """Bytes of receive buffers per received byte of the step."""

    memory_parts: dict[str, float] = field(default_factory=dict)
    """``base_bytes`` split by kind, for explanations."""

    dp_comm_bytes: float = 0.0
    """NCCL buffers of the world communicator that the data-parallel tables' all-reduce opens, held
    on every rank once any table is data-parallel."""

    cache: dict = field(default_factory=dict, compare=False, repr=False)
    """Flat arrays of the options (built on first use; see :func:`option_arrays`)."""

    @property
    def group_size(self) -> int:
        return self.mesh.sparse_shard

    @property
    def num_nodes(self) -> int:
        return self.group_size // self.node_size if self.node_size else 0

    def with_cut(self, cut: StepCut) -> "CandidatePricing":
        """The same candidate with one more cut (a cut already there, up to rounding, is not repeated)."""
        for c in self.cuts:
            if _same_cut(c, cut):
                return self
        return replace(self, cuts=self.cuts + (cut,), cache=self.cache)


def _same_cut(a: StepCut, b: StepCut) -> bool:
    if abs(a.const_s - b.const_s) > 1e-12 * max(1.0, abs(a.const_s)):
        return False
    keys = set(a.coef) | set(b.coef)
    if any(abs(a.coef.get(k, 0.0) - b.coef.get(k, 0.0)) > 1e-9 * max(abs(a.coef.get(k, 0.0)), 1e-300) for k in keys):
        return False
    keys = set(a.on_s) | set(b.on_s)
    if any(abs(a.on_s.get(k, 0.0) - b.on_s.get(k, 0.0)) > 1e-15 for k in keys):
        return False
    keys = set(a.rc_s) | set(b.rc_s)
    return all(abs(a.rc_s.get(k, 0.0) - b.rc_s.get(k, 0.0)) <= 1e-12 for k in keys)


@dataclass(frozen=True, slots=True)
class Assignment:
    """A solution for one candidate: an option and shard ranks per table, and the recomputed layers."""

    choice: tuple[int, ...]
    """Index into ``options[t]`` per table."""

    ranks: tuple[tuple[int, ...], ...]
    """Group ranks of the shards per table (empty for 'all' placements)."""

    recompute: tuple[bool, ...]
    """Per layer."""


@dataclass(frozen=True, slots=True)
class Loads:
    """Per-rank sums of a solution, and what every rank adds alike."""

    per_rank: np.ndarray
    """(ranks, 5): :data:`LOADS` per rank from the shards placed on ranks and nodes."""

    uniform: np.ndarray
    """(5,): :data:`LOADS` every rank adds (row-wise and data-parallel tables)."""

    mem: np.ndarray
    """(ranks,): shard memory per rank (placed shards)."""

    uniform_mem: float
    recv: float
    """Σ output bytes every rank receives."""
    ids_send: float
    """Σ id bytes every rank sends."""
    dp: float
    """Σ data-parallel all-reduce bytes."""
    holds: np.ndarray
    """(ranks,): whether the rank holds any shard (its lookup kernels launch)."""


@dataclass(frozen=True, slots=True)
class OptionArrays:
    """Every option of every table as flat arrays (option ``off[t] + i`` is table t's option i)."""

    off: np.ndarray
    vec: np.ndarray
    """(options, 5) per-rank loads of one shard."""
    mem: np.ndarray
    recv: np.ndarray
    ids_send: np.ndarray
    dp: np.ndarray
    place: np.ndarray
    """0 rank, 1 node, 2 all."""


_PLACE_CODE = {"rank": 0, "node": 1, "all": 2}


def option_arrays(p: CandidatePricing) -> OptionArrays:
    hit = p.cache.get("arrays")
    if hit is not None:
        return hit
    flat = [o for opts in p.options for o in opts]
    off = np.zeros(len(p.options) + 1, dtype=np.int64)
    off[1:] = np.cumsum([len(opts) for opts in p.options])
    arr = OptionArrays(
        off=off, vec=np.array([o.load() for o in flat], dtype=float).reshape(len(flat), len(LOADS)),
        mem=np.array([o.mem_bytes for o in flat], dtype=float), recv=np.array([o.recv_bytes for o in flat], dtype=float),
        ids_send=np.array([o.ids_send_bytes for o in flat], dtype=float), dp=np.array([o.allreduce_bytes for o in flat], dtype=float),
        place=np.array([_PLACE_CODE[o.placement] for o in flat], dtype=np.int64),
    )
    p.cache["arrays"] = arr
    return arr


def loads(p: CandidatePricing, a: Assignment) -> Loads:
    s = p.group_size
    n = len(LOADS)
    if not p.options:
        return Loads(np.zeros((s, n)), np.zeros(n), np.zeros(s), 0.0, 0.0, 0.0, 0.0, np.zeros(s, dtype=bool))
    arr = option_arrays(p)
    g = arr.off[:-1] + np.asarray(a.choice, dtype=np.int64)
    uni_mask = arr.place[g] == 2
    uni = arr.vec[g[uni_mask]].sum(axis=0)
    um = float(arr.mem[g[uni_mask]].sum())
    lens = np.fromiter((len(rr) for rr in a.ranks), dtype=np.int64, count=len(a.ranks))
    ranks = np.fromiter((r for rr in a.ranks for r in rr), dtype=np.int64, count=int(lens.sum()))
    gg = np.repeat(g, lens)
    L = np.empty((s, n))
    for j in range(n):
        L[:, j] = np.bincount(ranks, weights=arr.vec[gg, j], minlength=s)
    mem = np.bincount(ranks, weights=arr.mem[gg], minlength=s)
    holds = np.bincount(ranks, minlength=s) > 0
    if uni_mask.any():
        holds[:] = True
    return Loads(L, uni, mem, um, float(arr.recv[g].sum()), float(arr.ids_send[g].sum()), float(arr.dp[g].sum()), holds)


def aggregate_values(p: CandidatePricing, ld: Loads) -> dict[str, float]:
    """The cut variables of a solution from its loads (raw units)."""
    if not p.options:
        return {k: 0.0 for k in VARS}
    tot = ld.per_rank + ld.uniform
    lf, lb = p.launch_s
    f = tot[:, 0] + lf * ld.holds
    b = tot[:, 1] + lb * ld.holds
    return {
        "fwd": float(f.max()), "bwd": float(b.max()),
        "a2a": max(float(tot[:, 2].max()), p.recv_factor * ld.recv),
        "ids": max(ld.ids_send, float(tot[:, 3].max())),
        "dp": ld.dp, "sync": float(tot[:, 4].max()),
    }


def model_step(p: CandidatePricing, x: dict[str, float], recompute: tuple[bool, ...]) -> float:
    """The step the model gives for aggregates ``x`` and a recompute set: the largest cut."""
    m = step_model(p)
    return m.step(np.array([x[v] for v in VARS]), recompute)


@dataclass(frozen=True, slots=True)
class StepModel:
    """The cuts as arrays: ``step = max_k (const[k] + coef[k] · x + rc[k] · recompute)``, ``x`` in
    :data:`VARS` order (raw units)."""

    const: np.ndarray
    coef: np.ndarray
    """(cuts, 6)."""
    rc: np.ndarray
    """(cuts, layers)."""
    on: np.ndarray
    """(cuts, 6): constants charged when the variable is positive."""

    def step(self, x: np.ndarray, recompute) -> float:
        if not self.const.size:
            return 0.0
        rc = np.asarray(recompute, dtype=float) if len(recompute) else np.zeros(self.rc.shape[1])
        return float((self.const + self.coef @ x + self.on @ (x > 0) + self.rc @ rc).max())

    def steps(self, X: np.ndarray, recompute) -> np.ndarray:
        """Steps of many aggregate vectors at once (``X``: (..., 6))."""
        if not self.const.size:
            return np.zeros(X.shape[:-1])
        rc = np.asarray(recompute, dtype=float) if len(recompute) else np.zeros(self.rc.shape[1])
        return (X @ self.coef.T + (X > 0) @ self.on.T + (self.const + self.rc @ rc)).max(axis=-1)


def step_model(p: CandidatePricing) -> StepModel:
    key = ("model", len(p.cuts))
    hit = p.cache.get(key)
    if hit is not None:
        return hit
    names = [l.name for l in p.layers]
    m = StepModel(np.array([c.const_s for c in p.cuts], dtype=float),
                  np.array([[c.coef.get(v, 0.0) for v in VARS] for c in p.cuts], dtype=float).reshape(len(p.cuts), len(VARS)),
                  np.array([[c.rc_s.get(n, 0.0) for n in names] for c in p.cuts], dtype=float).reshape(len(p.cuts), len(names)),
                  np.array([[c.on_s.get(v, 0.0) for v in VARS] for c in p.cuts], dtype=float).reshape(len(p.cuts), len(VARS)))
    p.cache[key] = m
    return m


def x_vector(p: CandidatePricing, colmax: np.ndarray, recv: float, ids_send: float, dp: float, any_held: bool = True) -> np.ndarray:
    """The aggregates (:data:`VARS` order) from each per-rank load's maximum over ranks (uniform parts
    included); ``colmax`` may carry leading batch dimensions."""
    lf, lb = p.launch_s if any_held else (0.0, 0.0)
    out = np.empty(colmax.shape[:-1] + (len(VARS),))
    out[..., 0] = colmax[..., 0] + lf
    out[..., 1] = colmax[..., 1] + lb
    out[..., 2] = np.maximum(colmax[..., 2], p.recv_factor * recv)
    out[..., 3] = np.maximum(colmax[..., 3], ids_send)
    out[..., 4] = dp
    out[..., 5] = colmax[..., 4]
    return out


@dataclass(frozen=True, slots=True)
class Evaluation:
    """The model's figures for one assignment."""

    step_time_s: float
    """The largest cut at this solution."""

    peak_bytes: float
    """Memory of the fullest rank."""

    x: dict[str, float]
    """The cut variables."""

    recompute_s: float
    """Forward time recomputed."""

    rank_bytes: tuple[float, ...]
    dense_bytes: float
    """Memory of the dense part (base with recompute applied, receive buffers included)."""


def _layer_columns(p: CandidatePricing) -> tuple[list[float], list[float], list[float]]:
    """The layers' (saved bytes, peak bytes, recompute seconds), each a list in layer order (built on first
    use: the sums over a recompute set below then run without a Python loop per layer)."""
    hit = p.cache.get("layer_columns")
    if hit is None or hit[0] is not p.layers:
        hit = (p.layers, [l.saved_bytes for l in p.layers], [l.peak_bytes for l in p.layers], [l.recompute_s for l in p.layers])
        p.cache["layer_columns"] = hit
    return hit[1], hit[2], hit[3]


def recompute_memory(p: CandidatePricing, recompute) -> tuple[float, float]:
    """(bytes freed by the recompute set, its peak)."""
    saved_b, peak_b, _ = _layer_columns(p)
    return sum(compress(saved_b, recompute)), max(compress(peak_b, recompute), default=0.0)


def evaluate(p: CandidatePricing, a: Assignment, ld: Loads | None = None) -> Evaluation:
    """Step (the model) and memory of a solution (``ld``: its loads, when already known)."""
    ld = ld if ld is not None else loads(p, a)
    x = aggregate_values(p, ld)
    saved, peak = recompute_memory(p, a.recompute)
    dense = p.base_bytes - saved + peak + p.recv_mem_factor * ld.recv + (p.dp_comm_bytes if ld.dp > 0 else 0.0)
    rank_bytes = dense + ld.uniform_mem + ld.mem
    rc_t = sum(compress(_layer_columns(p)[2], a.recompute))
    step = step_model(p).step(np.array([x[v] for v in VARS]), a.recompute) if p.cuts else 0.0
    return Evaluation(step, float(rank_bytes.max()) if rank_bytes.size else dense + ld.uniform_mem,
                      x, rc_t, tuple(float(v) for v in rank_bytes), dense)


def weights(p: CandidatePricing) -> np.ndarray:
    """Seconds of step per raw unit of each per-rank load (:data:`LOADS` order), for scalar list
    scheduling: the largest coefficient any cut gives it, and at least half a task's worth, so that
    every load is kept even (a load off the critical path today can be on it after placement)."""
    out = np.zeros(len(LOADS))
    for j, v in enumerate(LOADS):
        sc = p.scale.get(v, 0.0)
        best = max((c.coef.get(v, 0.0) for c in p.cuts), default=0.0)
        out[j] = max(best, 0.5 * sc)
    return out


def shard_weight(o: ShardOption, w: np.ndarray) -> float:
    """A scalar size of one shard for list scheduling: its loads weighted by :func:`weights`."""
    return float(np.dot(o.load(), w))


def copies(o: ShardOption) -> int:
    """Shards the solver places (0 for options on every rank)."""
    return 0 if o.placement == "all" else o.num_shards


__all__ = [
    "Assignment", "CandidatePricing", "Evaluation", "LOADS", "LayerOption", "Loads", "PLACEMENT_OF", "ShardOption", "StepModel", "VARS",
    "aggregate_values", "copies", "evaluate", "loads", "model_step", "option_arrays", "recompute_memory", "shard_weight", "step_model",
    "weights", "x_vector",
]
