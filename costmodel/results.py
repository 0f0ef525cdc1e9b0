"""Results as values: frozen, additive cost and memory breakdowns that reports can split without new code.

:class:`Perf` is a time breakdown (forward/backward × compute/communication/exposed, plus recompute
and optimizer), :class:`Memory` a per-rank byte breakdown; both add with ``+`` and scale with ``*``.
:class:`StepCost` is the full answer of :func:`coplan.costmodel.price`: the critical rank's step,
per-op and per-collective parts, per-layer breakdowns, sampled ranks, MFU and goodput, with
:meth:`StepCost.to_prediction` giving the spec's :class:`~coplan.spec.Prediction`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Mapping

import numpy as np

from coplan.costmodel.schedule import Schedule
from coplan.spec.plan import CommPrediction, OpPrediction, Prediction


@dataclass(frozen=True, slots=True)
class Perf:
    """Seconds on one rank, split by phase and kind. ``total`` is what the step pays: compute
    (recompute and optimizer included) plus the communication that compute did not hide."""

    fwd_compute_s: float = 0.0
    """Forward compute (SM-contention slowdown included)."""

    bwd_compute_s: float = 0.0
    """Backward compute."""

    recompute_s: float = 0.0
    """Forward recomputed in backward (activation checkpointing)."""

    optimizer_s: float = 0.0
    """Dense optimizer step (the sparse one is fused into the embedding backward)."""

    fwd_comm_s: float = 0.0
    """Forward-phase collectives, whole duration."""

    bwd_comm_s: float = 0.0
    """Backward-phase collectives (and the step-end tail), whole duration."""

    fwd_exposed_s: float = 0.0
    """Part of forward collectives compute waited for."""

    bwd_exposed_s: float = 0.0
    """Part of backward collectives compute waited for."""

    def __add__(self, other: "Perf") -> "Perf":
        return Perf(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(Perf)))

    def __mul__(self, k: float) -> "Perf":
        return Perf(*(getattr(self, f.name) * k for f in fields(Perf)))

    __rmul__ = __mul__

    @property
    def compute_s(self) -> float:
        return self.fwd_compute_s + self.bwd_compute_s + self.recompute_s + self.optimizer_s

    @property
    def comm_s(self) -> float:
        return self.fwd_comm_s + self.bwd_comm_s

    @property
    def exposed_s(self) -> float:
        return self.fwd_exposed_s + self.bwd_exposed_s

    @property
    def total(self) -> float:
        return self.compute_s + self.exposed_s

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class Memory:
    """Bytes on one rank by kind. ``total`` is the predicted peak (:func:`coplan.costmodel.memory.step_memory`)."""

    parameters: float = 0.0
    """Sharded dense parameters (master dtype)."""

    gradients: float = 0.0
    """Sharded dense gradients."""

    optimizer: float = 0.0
    """Sharded dense optimizer state."""

    fsdp_buffers: float = 0.0
    """Unsharded parameters of the current and prefetched layers, and one layer's unsharded gradients."""

    activations: float = 0.0
    """Saved activations of one micro-batch (layer inputs only where recomputed)."""

    recompute_peak: float = 0.0
    """Full activations of the largest recomputed layer, live while its backward runs."""

    embeddings: float = 0.0
    """Embedding shard weights on this rank."""

    embedding_optimizer: float = 0.0
    """Optimizer state of those shards (row-wise Adagrad: one fp32 per row)."""

    embedding_io: float = 0.0
    """Lookup outputs, their gradients, ids and all-to-all staging of one micro-batch."""

    comm_buffers: float = 0.0
    """NCCL communicator buffers and expert-parallel all-to-all staging."""

    graph_pool: float = 0.0
    """CUDA graphs' private pool (one-rank plans whose dense arch the trainer runs as graphs): the largest
    captured bucket's activations and working set, every bucket's history inputs and a fixed part
    (:func:`coplan.costmodel.memory.graph_pool_bytes`), held for the whole run, beside the eager step the
    profiled steps run."""

    def __add__(self, other: "Memory") -> "Memory":
        return Memory(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(Memory)))

    def __mul__(self, k: float) -> "Memory":
        return Memory(*(getattr(self, f.name) * k for f in fields(Memory)))

    __rmul__ = __mul__

    @property
    def total(self) -> float:
        return float(sum(getattr(self, f.name) for f in fields(Memory)))

    def fits_in(self, capacity_bytes: float) -> bool:
        return self.total <= capacity_bytes

    def as_dict(self) -> dict[str, float]:
        return {k: float(v) for k, v in asdict(self).items()}


@dataclass(frozen=True, slots=True)
class StepCut:
    """The step along one path of the pricer's schedule, as a linear function of what the planner
    decides: ``const_s + Σ coef[v] · x[v] + Σ_{recomputed layers l} rc_s[l]``.

    ``x`` are the :class:`SparseAggregates` variables ('fwd', 'bwd': slowest
    rank's lookup seconds; 'a2a', 'ids', 'dp', 'sync': bytes). A path's length never exceeds the
    schedule's makespan, and every task duration on it is affine in these variables, so any one cut is
    a lower bound of the device step wherever the other tasks keep their durations; the pricer's
    critical path gives the cut that is exact at the plan priced. The SM-contention slowdown of the
    path's compute tasks (and a calibrated device-step factor) is held at its value in that plan. The
    planner's CP-SAT model minimises the largest of its cuts: a piecewise-linear model of the pricer's
    step, refined with the cut of every plan it prices."""

    const_s: float
    coef: Mapping[str, float]
    rc_s: Mapping[str, float] = field(default_factory=dict)
    source: str = "device"
    """'device' (a critical path of the schedule) or 'host' (the host's launches, when calibrated host-bound)."""
    on_s: Mapping[str, float] = field(default_factory=dict)
    """Constants charged only when their variable is positive: a collective's latency is paid only when
    it moves bytes (no data-parallel table: no all-reduce at all)."""
    slack_s: float = 0.0
    """The part of ``const_s`` that is not a lower bound elsewhere: the SM-contention slowdown of the
    path's compute tasks, held at its value in the plan priced (it moves with the overlap). The cut
    less this is a lower bound of the step at any aggregates; the planner subtracts the largest slack
    of a candidate's cuts from the bound it proves."""
    def value(self, x: Mapping[str, float], recomputed=()) -> float:
        return float(self.const_s + sum(c * x.get(k, 0.0) for k, c in self.coef.items())
                     + sum(c for k, c in self.on_s.items() if x.get(k, 0.0) > 0)
                     + sum(self.rc_s.get(n, 0.0) for n in recomputed))


@dataclass(frozen=True, slots=True)
class EmbeddingRanks:
    """Per rank of the sparse shard group, what its embedding shards cost per step."""

    fwd_s: np.ndarray
    """Forward lookups (the rank's kernel launches and table-row-wise NVLink reduction included)."""
    bwd_s: np.ndarray
    """Backward lookups and fused optimizer (likewise)."""
    memory_bytes: np.ndarray
    """Shard weights, their optimizer state and lookup buffers."""
    weight_bytes: np.ndarray | None = None
    """``memory_bytes`` split by kind (None where only the total is known: the planner's aggregates)."""
    optimizer_bytes: np.ndarray | None = None
    io_bytes: np.ndarray | None = None

    @property
    def time_s(self) -> np.ndarray:
        return self.fwd_s + self.bwd_s


@dataclass(frozen=True, slots=True)
class SparseAggregates:
    """What a table placement adds to the step, as the schedule sees it: per step, on the ranks that
    set each all-to-all's pace. :func:`sparse_aggregates` computes it from a placement; the planner
    computes the same figures from its solution's per-shard options and prices them without building
    shards (equal up to float rounding: tested)."""

    fwd_max_s: float
    """Slowest rank's forward lookups (its table-row-wise NVLink reduction and kernel launches included)."""

    bwd_max_s: float
    """Slowest rank's backward lookups and fused optimizer (likewise)."""

    a2a_bytes: float
    """Output all-to-all volume: the busiest sender's bytes, or ρ × the bytes every rank receives."""

    ids_bytes: float
    """Input (ids) all-to-all volume: the bytes every rank sends, or the busiest receiver's."""

    dp_bytes: float
    """Data-parallel tables' gradient all-reduce bytes."""

    sync_bytes: float
    """Fullest rank's shard weights and optimizer state (what a replica sync all-reduces)."""

    emb_kernels: float
    """Embedding kernel groups per micro-batch on the busiest rank: with the fused TBE the TorchRec collections
    it looks up in (one per collection), else its tables' own kernels (each priced per
    :func:`coplan.costmodel.pricer.emb_group_launches`)."""

    mean_s: float
    """Mean rank's forward + backward lookups."""

    mem_weight_bytes: float
    """Shard weights on the rank whose embeddings take the most memory."""

    mem_optimizer_bytes: float
    """Their optimizer state."""

    mem_io_bytes: float
    """Its lookup buffers (outputs, gradients, ids) of one micro-batch, receive buffers excluded."""

    recv_bytes: float
    """Output bytes every rank receives per step (sharded tables; sizes the receive buffers)."""

    ranks: EmbeddingRanks | None = field(default=None, compare=False)
    """Every rank's lookups and shard memory, when known (they become :attr:`StepCost.embedding`)."""

    @classmethod
    def at(cls, x: Mapping[str, float], *, mem_bytes: float = 0.0, recv_bytes: float = 0.0, kernels: float = 1.0) -> "SparseAggregates":
        """The aggregates of a point ``x`` of the cut variables (:meth:`time_vars`' keys), ``kernels`` kernel
        groups (:attr:`emb_kernels`), ``mem_bytes`` of shard memory on the fullest rank: a placement the planner
        prices without building one (its floor and probe points)."""
        return cls(fwd_max_s=x["fwd"], bwd_max_s=x["bwd"], a2a_bytes=x["a2a"], ids_bytes=x["ids"], dp_bytes=x["dp"],
                   sync_bytes=x["sync"], emb_kernels=kernels, mean_s=x["fwd"] + x["bwd"], mem_weight_bytes=mem_bytes,
                   mem_optimizer_bytes=0.0, mem_io_bytes=0.0, recv_bytes=recv_bytes)

    @classmethod
    def of_ranks(cls, fwd_s: np.ndarray, bwd_s: np.ndarray, loads: np.ndarray, memory_bytes: np.ndarray, *, recv_bytes: float,
                 recv_factor: float, ids_send_bytes: float, dp_bytes: float, held: bool, kernels: float = 1.0) -> "SparseAggregates":
        """The aggregates of a placement given per rank: lookup seconds (launches included), ``loads``
        (ranks × (forward, backward, bytes sent, id bytes received, sync bytes)) and shard memory (as one
        figure, in ``mem_weight_bytes``); ``recv_bytes`` every rank receives (times ``recv_factor``, the
        jagged imbalance), ``ids_send_bytes`` every rank sends; ``held``: some rank holds a shard, then with
        ``kernels`` kernel groups (:attr:`emb_kernels`)."""
        return cls(
            fwd_max_s=float(fwd_s.max()), bwd_max_s=float(bwd_s.max()), a2a_bytes=max(float(loads[:, 2].max()), recv_factor * recv_bytes),
            ids_bytes=max(ids_send_bytes, float(loads[:, 3].max())), dp_bytes=dp_bytes, sync_bytes=float(loads[:, 4].max()),
            emb_kernels=kernels if held else 0.0, mean_s=float(fwd_s.mean() + bwd_s.mean()),
            mem_weight_bytes=float(memory_bytes.max()) if memory_bytes.size else 0.0, mem_optimizer_bytes=0.0, mem_io_bytes=0.0,
            recv_bytes=recv_bytes, ranks=EmbeddingRanks(fwd_s, bwd_s, memory_bytes),
        )

    def time_vars(self) -> dict[str, float]:
        """The values of the cut variables (see :class:`StepCut`)."""
        return {"fwd": self.fwd_max_s, "bwd": self.bwd_max_s, "a2a": self.a2a_bytes, "ids": self.ids_bytes,
                "dp": self.dp_bytes, "sync": self.sync_bytes}


@dataclass(frozen=True, slots=True)
class DenseFixedCosts:
    """Dense costs that do not depend on tables or recompute: FSDP/HSDP and expert collectives per
    layer (per step, whole duration, before overlap), and per-rank parameter state."""

    layers: tuple[str, ...]
    all_gather_fwd_s: np.ndarray
    all_gather_bwd_s: np.ndarray
    reduce_scatter_s: np.ndarray
    replicate_all_reduce_s: np.ndarray
    ep_all_to_all_s: np.ndarray
    """Dispatch + combine, forward and backward (per MoE layer; recompute adds its forward pair)."""
    params_bytes: float
    grads_bytes: float
    optimizer_bytes: float
    fsdp_buffer_bytes: float
    optimizer_step_s: float
    fsdp_copy_fwd_s: float = 0.0
    """FSDP2's copies around its collectives, per micro-batch, forward (:func:`coplan.costmodel.memory.fsdp_copy_bytes`), at the
    elementwise class's bandwidth, launches included."""
    fsdp_copy_bwd_s: float = 0.0
    """The same, backward (gradient copy-in, the one-rank divided copy, the cast to the parameter dtype)."""

    @property
    def comm_total_s(self) -> float:
        return float(self.all_gather_fwd_s.sum() + self.all_gather_bwd_s.sum() + self.reduce_scatter_s.sum()
                     + self.replicate_all_reduce_s.sum() + self.ep_all_to_all_s.sum())


@dataclass(frozen=True, slots=True)
class OpCost:
    """One op on the critical rank, one phase, summed over the step's micro-batches."""

    name: str
    op_class: str
    phase: str
    """fwd, bwd, recompute or optimizer."""
    time_s: float
    flops: float
    bytes: float
    layer: str = ""


@dataclass(frozen=True, slots=True)
class CommCost:
    """One collective (summed over the step's micro-batches)."""

    name: str
    collective: str
    group_size: int
    tiers: tuple[str, ...]
    bytes: float
    """nccl-tests size of one call, bytes."""
    time_s: float
    """Duration of all its calls in the step."""
    exposed_s: float
    """Part of that compute waited for."""
    phase: str
    calls: int = 1


@dataclass(frozen=True, slots=True)
class Goodput:
    """Checkpointing and failures (Young/Daly)."""

    checkpoint_bytes: float
    """State written per checkpoint (dense params + optimizer, embeddings + their optimizer state)."""
    checkpoint_write_s: float
    """Seconds one checkpoint blocks training."""
    failures_per_hour: float
    """Expected job interruptions per hour (GPUs and switches)."""
    mtbf_s: float
    """Mean time between job interruptions, seconds."""
    interval_s: float
    """Optimal checkpoint interval (Daly's higher-order estimate)."""
    restart_s: float
    """Detect + restart + reload, seconds."""
    fraction: float
    """Useful fraction of wall time (checkpoints, failures, and the step's stretch by stragglers and jitter)."""
    jitter: float = 0.0
    """Expected relative stretch of a synchronous step by its slowest rank (:func:`coplan.costmodel.goodput.jitter_stretch`)."""


@dataclass(frozen=True, slots=True)
class StepCost:
    """The cost model's full answer for one plan."""

    step_time_s: float
    """Predicted step time: the critical (slowest) rank's schedule."""

    perf: Perf
    """Breakdown of the critical rank's step."""

    compute_mean_s: float
    """Dense + embedding compute of a mean rank (no jagged imbalance)."""

    imbalance: float
    """Expected max/mean per-rank jagged work under the balancing policy."""

    imbalance_s: float
    """Extra compute of the slowest rank over the mean rank from jagged imbalance."""

    model_flops: float
    """Model FLOPs of one step over all ranks (no recompute, no padding)."""

    world_size: int
    peak_flops_per_s: float
    """Dense bf16 peak of one GPU."""

    memory: Memory
    """Fullest rank's memory."""

    hbm_capacity_bytes: float
    """HBM of one GPU (datasheet)."""

    hbm_reserve_bytes: float = 0.0
    """What the topology holds back (``gpu.hbm_reserve_fraction``: allocator fragmentation, CUDA context,
    NCCL internals); a plan fits when ``memory.total`` stays within capacity less this."""

    ops: tuple[OpCost, ...] = ()
    comms: tuple[CommCost, ...] = ()
    layers: Mapping[str, Perf] = field(default_factory=dict)
    """Per layer ('<block>.<index>', plus 'sparse' and 'optimizer')."""

    rank_ids: tuple[int, ...] = ()
    rank_time_s: tuple[float, ...] = ()
    """Busy time (compute + exposed comm) of sampled ranks: the extremes of the embedding load."""

    rank_memory_bytes: tuple[float, ...] = ()
    """Memory of the sampled ranks."""

    goodput: Goodput | None = None
    notes: tuple[str, ...] = ()
    """What was approximated for this plan (e.g. an attention backend priced padded)."""

    unpriced_device_s: float = 0.0
    """Step time added by a calibration's device-step factor (device work no priced op accounts for) when the
    step is the device's; 0 without one, or when the host's time sets the step."""

    host_s: float = 0.0
    """The host's time per step (0 unless a calibration prices the host); the step is at least this."""

    loader_s: float = 0.0
    """The data loader's time per step (``coplan.costmodel.loader``); the step is at least this."""

    device_s: float = 0.0
    """The device's step (the schedule's makespan times a calibrated factor)."""

    cuts: tuple[StepCut, ...] = ()
    """Filled with ``price(..., cuts=True)``: linear pieces of the step (see :class:`StepCut`); the
    largest of them at the priced plan equals ``step_time_s`` (the device's, or the host's)."""

    segments: tuple[tuple[float, float, float], ...] = ()
    """The step cut at the host's syncs with the device, per segment (host launches, of them those the
    device waits through at the segment's start, device seconds): the launches are
    :func:`coplan.costmodel.pricer.host_segments`' and :func:`~coplan.costmodel.pricer.sync_exposed`'
    (priced units), the device time is the priced device step's share between two syncs, the
    device-step factor applied. One segment, (all launches, 0, the device step), when nothing syncs.
    Filled when the pricer is asked for it (``price(..., segments=True)``) or prices a host cost; the
    step is then Σ exposed host + max(the rest of the host, device), the host's time being
    ``host_launch_s`` × launches plus the segment's share of the per-sample host work
    (:func:`~coplan.costmodel.pricer.synced_step`)."""

    schedule: Schedule | None = field(default=None, compare=False, repr=False)
    """The critical rank's two-stream schedule the step was read from (with ``detail``)."""

    embedding: EmbeddingRanks | None = field(default=None, compare=False, repr=False)
    """Every rank's embedding lookups and shard memory (None without tables, or when a placement was
    priced by its aggregates alone)."""

    launches: Mapping[str, float] = field(default_factory=dict)
    """Per op class, the kernel launches the dense ops' forward and backward charge per step (recompute
    excluded; with ``detail``)."""

    launch_s: Mapping[str, float] = field(default_factory=dict)
    """Per op class, their launch overhead in seconds per step (part of the ops' times; with ``detail``)."""

    @property
    def compute_s(self) -> float:
        return self.perf.compute_s

    @property
    def exposed_comm_s(self) -> float:
        return self.perf.exposed_s

    @property
    def local_mfu(self) -> float:
        d = self.perf.compute_s * self.world_size * self.peak_flops_per_s
        return self.model_flops / d if d > 0 else 0.0

    @property
    def scaling_ratio(self) -> float:
        return self.perf.compute_s / self.step_time_s if self.step_time_s > 0 else 0.0

    @property
    def e2e_mfu(self) -> float:
        d = self.step_time_s * self.world_size * self.peak_flops_per_s
        return self.model_flops / d if d > 0 else 0.0

    @property
    def goodput_mfu(self) -> float:
        return self.e2e_mfu * (self.goodput.fraction if self.goodput else 1.0)

    @property
    def usable_hbm_bytes(self) -> float:
        """HBM a plan may fill: capacity less the reserve."""
        return self.hbm_capacity_bytes - self.hbm_reserve_bytes

    @property
    def memory_headroom_bytes(self) -> float:
        return self.usable_hbm_bytes - self.memory.total

    @property
    def fits(self) -> bool:
        return self.memory.total <= self.usable_hbm_bytes

    def to_prediction(self, *, detail: bool = True) -> Prediction:
        """The spec's :class:`~coplan.spec.Prediction` (``detail=False`` leaves out per-op and per-collective rows)."""
        gp = self.goodput
        ops = tuple(
            OpPrediction(name=o.name, op_class=o.op_class, phase=o.phase, time_s=o.time_s, flops=o.flops, bytes=o.bytes)
            for o in self.ops
        ) if detail else ()
        comms = tuple(
            CommPrediction(name=c.name, collective=c.collective, group_size=c.group_size, tiers=c.tiers, bytes=c.bytes,
                           time_s=c.time_s, exposed_s=min(c.exposed_s, c.time_s), phase=c.phase if c.phase in ("fwd", "bwd", "optimizer") else "bwd",
                           calls=c.calls)
            for c in self.comms
        ) if detail else ()
        return Prediction(
            step_time_s=self.step_time_s,
            compute_s=self.perf.compute_s,
            exposed_comm_s=self.perf.exposed_s,
            imbalance_s=self.imbalance_s,
            unpriced_device_s=self.unpriced_device_s,
            host_s=self.host_s,
            loader_s=self.loader_s,
            device_s=self.device_s if self.step_time_s > self.device_s * (1.0 + 1e-12) else 0.0,
            model_flops_per_step=self.model_flops,
            local_mfu=self.local_mfu,
            scaling_ratio=self.scaling_ratio,
            e2e_mfu=self.e2e_mfu,
            goodput=gp.fraction if gp else 1.0,
            step_jitter=gp.jitter if gp else 0.0,
            goodput_mfu=self.goodput_mfu,
            checkpoint_interval_s=gp.interval_s if gp else 0.0,
            checkpoint_write_s=gp.checkpoint_write_s if gp else 0.0,
            ops=ops,
            comms=comms,
            memory_bytes=self.memory.as_dict(),
            peak_memory_bytes=self.memory.total,
            hbm_capacity_bytes=self.hbm_capacity_bytes,
            rank_time_s=self.rank_time_s,
            rank_ids=self.rank_ids,
            imbalance=self.imbalance,
            breakdown_s=self.perf.as_dict(),
            layer_time_s={k: v.total for k, v in self.layers.items()},
            memory_headroom_bytes=self.memory_headroom_bytes,
            hbm_reserve_bytes=self.hbm_reserve_bytes,
            rank_memory_bytes=self.rank_memory_bytes,
            notes=self.notes,
        )


__all__ = ["CommCost", "DenseFixedCosts", "EmbeddingRanks", "Goodput", "Memory", "OpCost", "Perf", "SparseAggregates", "StepCost", "StepCut"]
