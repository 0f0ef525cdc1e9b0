"""What the solver sees of one mesh candidate: the cost model's figures, as small frozen values, and
the one formula (:func:`evaluate`) that combines them into the step time the solver minimises.

The cost model prices; the planner only adds and compares. For one candidate the step is modelled as
(the same decomposition as the cost model's pricer, ``coplan.costmodel.pricer``):

    step = base_time_s                      dense compute (jagged imbalance included), exposed dense
                                            communication, optimizer, per-call latencies of the sparse
                                            all-to-alls and kernel launches: identical on every rank
         + Σ_{recomputed layers} recompute_s
         + max_r fwd_r + max_r bwd_r          embedding lookups: every all-to-all waits for the slowest rank
         + a2a_s_per_byte · max(max_r send_r, recv_factor · Σ_t recv_t)
                                            output all-to-all forward and backward: the busiest sender, or
                                            what every rank receives
         + dp_s_per_byte · Σ_{data-parallel t} allreduce_t

and memory on rank ``r``

    base_bytes − Σ_{recomputed} saved_bytes + max_{recomputed} peak_bytes
         + mem_r + recv_mem_factor · Σ_t recv_t  ≤  capacity_bytes.

A table option puts ``num_shards`` equal shards somewhere: on ranks the solver picks (table-wise: 1,
column-wise: n), on the ranks of one node it picks (table-row-wise), or one on every rank of the
group (row-wise; data-parallel holds a full copy on every rank).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from coplan.planner.mesh import MeshCandidate

Placement = Literal["rank", "node", "all"]

PLACEMENT_OF = {"table_wise": "rank", "column_wise": "rank", "table_row_wise": "node", "row_wise": "all", "data_parallel": "all"}


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

    placement: Placement = field(init=False, compare=False, repr=False)
    """Where the solver puts the shards ('rank', 'node' or 'all'); derived from the sharding type, and
    stored because the solver's inner loops read it millions of times."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "placement", PLACEMENT_OF[self.sharding_type])

    @property
    def label(self) -> str:
        return f"column_wise/{self.num_shards}" if self.sharding_type == "column_wise" else self.sharding_type


@dataclass(frozen=True, slots=True)
class LayerOption:
    """Recompute of one layer: what it costs and what it frees."""

    name: str
    """'<block>.<layer index>'."""

    recompute_s: float
    """Forward time recomputed in backward (per step)."""

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

    base_time_s: float
    """Step time identical on every rank, without recompute and embedding work."""

    base_bytes: float
    """Memory identical on every rank, without recompute and embeddings (headroom included)."""

    capacity_bytes: float
    """HBM of one GPU."""

    layers: tuple[LayerOption, ...]
    """Layers that may be recomputed."""

    options: tuple[tuple[ShardOption, ...], ...]
    """Options per table, in the workload's table order."""

    table_names: tuple[str, ...]
    """Table names, in the same order."""

    a2a_s_per_byte: float = 0.0
    """Seconds per byte of the step's output all-to-all volume (forward + backward, exposed)."""

    recv_factor: float = 1.0
    """Multiplier of the received bytes (the jagged imbalance of sequence lengths)."""

    recv_mem_factor: float = 0.0
    """Bytes of receive buffers per received byte of the step."""

    dp_s_per_byte: float = 0.0
    """Seconds per byte of the data-parallel tables' gradient all-reduce."""

    memory_parts: dict[str, float] = field(default_factory=dict)
    """``base_bytes`` split by kind, for explanations."""

    @property
    def group_size(self) -> int:
        return self.mesh.sparse_shard

    @property
    def num_nodes(self) -> int:
        return self.group_size // self.node_size if self.node_size else 0


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
class Evaluation:
    """The surrogate's figures for one assignment."""

    step_time_s: float
    peak_bytes: float
    fwd_max_s: float
    bwd_max_s: float
    a2a_bytes: float
    recompute_s: float
    dp_bytes: float
    rank_time_s: tuple[float, ...]
    rank_bytes: tuple[float, ...]
    dense_bytes: float
    """Memory of the dense part (base with recompute applied)."""


def evaluate(p: CandidatePricing, a: Assignment) -> Evaluation:
    """Step time and memory of a solution under the candidate's surrogate (floats, see the module docstring)."""
    s = p.group_size
    fwd = [0.0] * s
    bwd = [0.0] * s
    send = [0.0] * s
    mem = [0.0] * s
    uf = ub = us = um = recv = dp = 0.0
    for t, (oi, ranks) in enumerate(zip(a.choice, a.ranks)):
        o = p.options[t][oi]
        recv += o.recv_bytes
        dp += o.allreduce_bytes
        if o.placement == "all":
            uf += o.fwd_s
            ub += o.bwd_s
            us += o.send_bytes
            um += o.mem_bytes
        else:
            for r in ranks:
                fwd[r] += o.fwd_s
                bwd[r] += o.bwd_s
                send[r] += o.send_bytes
                mem[r] += o.mem_bytes
    f_max = uf + max(fwd)
    b_max = ub + max(bwd)
    a2a = max(us + max(send), p.recv_factor * recv)
    rc_t = sum(l.recompute_s for l, on in zip(p.layers, a.recompute) if on)
    saved = sum(l.saved_bytes for l, on in zip(p.layers, a.recompute) if on)
    peak_rc = max((l.peak_bytes for l, on in zip(p.layers, a.recompute) if on), default=0.0)
    dense = p.base_bytes - saved + peak_rc + p.recv_mem_factor * recv
    step = p.base_time_s + rc_t + f_max + b_max + p.a2a_s_per_byte * a2a + p.dp_s_per_byte * dp
    rank_bytes = tuple(dense + um + m for m in mem)
    rank_time = tuple(p.base_time_s + rc_t + uf + ub + f + b for f, b in zip(fwd, bwd))
    return Evaluation(step, max(rank_bytes), f_max, b_max, a2a, rc_t, dp, rank_time, rank_bytes, dense)


def shard_weight(o: ShardOption, a2a_s_per_byte: float) -> float:
    """A scalar size of one shard for list scheduling: its time plus the all-to-all time it sends."""
    return o.fwd_s + o.bwd_s + a2a_s_per_byte * o.send_bytes


def copies(o: ShardOption) -> int:
    """Shards the solver places (0 for options on every rank)."""
    return 0 if o.placement == "all" else o.num_shards
