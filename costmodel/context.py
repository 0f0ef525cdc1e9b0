"""The pricing context: everything about one (workload, topology, mesh candidate, calibration)
that does not depend on the rest of the plan, computed once so that pricing thousands of table
placements, recompute sets and balancing policies stays cheap.

It holds the placed process groups and their collective models, the per-op expected per-sample
work on one rank, the per-layer sums, the tables as arrays, and a cache that the pricing modules
(:mod:`.compute`, :mod:`.decomposed`, :mod:`.pricer`) fill per context.

Conventions: times are per optimizer step (all micro-batches) on one rank unless a name says
"per micro-batch"; "critical" means the rank with the expected largest jagged load.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from coplan.costmodel import flops as F
from coplan.costmodel.comm import CollectiveModel, GroupPlacement, PlacementError, collective_model, place_group
from coplan.costmodel.efficiency import Efficiencies, resolve_efficiencies
from coplan.costmodel.embedding import TableArrays, table_arrays
from coplan.costmodel.jagged import length_moments
from coplan.costmodel.loader import balance_group
from coplan.errors import BatchError
from coplan.spec.calibration import Calibration
from coplan.spec.plan import MeshPlan
from coplan.spec.topology import Topology
from coplan.spec.workload import (
    DotInteractionBlock,
    InterFormerBlock,
    KunlunBlock,
    MoEBlock,
    Workload,
    batch_split_error,
    divisors,
)

GiB = 1024.0**3
MiB = 1024.0**2

_SHARED: dict[tuple, tuple[object, object]] = {}
"""Process-wide cache of context-independent results (table arrays, option costs), keyed by the
identity of the workload they belong to (the entry keeps the workload alive, so ids cannot be reused)."""


def shared_cache(workload: Workload, key: tuple, make):
    """``make()`` once per (workload, key) in this process (see ``_SHARED``)."""
    k = (id(workload),) + key
    hit = _SHARED.get(k)
    if hit is not None and hit[0] is workload:
        return hit[1]
    if len(_SHARED) > 512:
        _SHARED.clear()
    v = make()
    _SHARED[k] = (workload, v)
    return v


@dataclass(frozen=True, slots=True)
class Options:
    """Knobs of the cost model that are not part of the specs (each default says where it comes from)."""

    reshard_after_forward: bool = True
    """FSDP2's default: free unsharded parameters after forward and gather them again in backward
    (the last layer keeps them)."""

    pipeline_input_dist: bool = True
    """TorchRec's TrainPipelineSparseDist: the id all-to-all of the next batch runs under this one's compute."""

    nccl_bytes_per_communicator: float = 256 * MiB
    """NCCL buffers per communicator (channels × protocol buffers, both ring neighbours); assumption
    of the order NCCL_BUFFSIZE (4 MiB) × 2 × 32 channels."""

    balance_seed: int = 0
    """Seed of the jagged-imbalance simulation."""

    balance_trials: int = 4
    """Batches drawn per imbalance estimate."""

    sm_contention: float | None = None
    """Override of the SM-contention slowdown (None: the efficiencies' value)."""

    fp8_quant_reads_rowwise: float = 1.0
    """HBM reads of the high-precision tensor per FP8 quantisation whose scale runs along the row the
    GEMM reduces over (activations and output gradients scaled per row, weights per output row): one
    fused amax-and-cast kernel, the row fits on chip (assumption, as torchao's compiled casts and
    FP8 part 1's Triton casts do)."""

    fp8_quant_reads_colwise: float = 2.0
    """The same for the transposed copies the weight gradient and the input gradient need (scales
    along the token dimension, or a weight's input dimension): an amax reduction pass, then a
    scale-cast-transpose pass (assumption: the reduction runs over a dimension that does not fit on chip)."""

    step_jitter_cv: float | None = None
    """Coefficient of variation of one rank's step time (stragglers and jitter in the goodput); None: the
    default, ``coplan.costmodel.goodput.DEFAULT_STEP_JITTER_CV``."""

    balance_group_ranks: int | None = None
    """Ranks that balance a slice of the global batch together, whose rows each of them decodes (the trainer's
    balance group, ``coplan.trainer.data.BatchReader``); None: one node's ranks (at most the world), as the
    trainer does. The jagged imbalance prices the spread between the groups (``expected_imbalance(group_size=)``)
    and the data loader the group's rows (``coplan.costmodel.loader``)."""

    seq_chunk: int = 32
    """Ids per bag of the sequence lookups' KeyedJaggedTensors, as the trainer feeds them (its
    ``--seq-chunk``, default 32; 0 = each sample's whole history is one bag). Sets the sequence
    lookup's latency-bound floor (:func:`seq_lookup_floor_s`); calibration prices each run at the
    value its ``config.json`` records (absent: 0, the trainer before the switch existed)."""

    lookup_warps_per_sm: int = 64
    """Resident warps per SM of FBGEMM's no-bag lookup forward (one warp per bag): Hopper's limit of
    64 warps per SM (assumption: occupancy not limited by registers)."""

    fp8_call_overhead_fwd_s: float = 3.9e-4
    """Fixed time per FP8 linear call in forward, beyond its GEMM and its quantisation bytes: the host
    side of the quantisation kernels' launches, scale buffers, padding and ``torch._scaled_mm``'s
    setup. Measured on the H200 (``benchmarks/results/fp8_h200.json``, 2026-11-29 17:12 UTC, commit
    9e19e50): median over the shapes with M ≤ 2,688 (where the GPU work is negligible) of row-wise
    forward minus the fp8 GEMM alone, 0.39 ms (range 0.33-0.65; the 14:38 run's 0.22 ms was taken
    before the split row-wise quantisation added launches), against 0.01 ms for a whole bf16
    forward; added to the per-kernel launch terms. 0 turns it off. Re-measure when the kernels
    change (``tests/costmodel/test_fp8_pricing.py`` checks it against the committed measurement)."""

    fp8_call_overhead_bwd_s: float = 9.0e-4
    """The same for the backward of one FP8 linear call: median over the same shapes of row-wise
    (forward+backward − forward) minus bf16's, 0.90 ms (range 0.20-1.10; 17:12 run). Six
    quantisations (three of them split in two passes) and two ``_scaled_mm`` per backward; at these
    sizes the step waits on the host for them."""

    fp8_blockwise_call_overhead_fwd_s: float | None = 3.8e-4
    """Fixed time per forward of a ``blockwise`` FP8 linear call (2 one-read quantisation kernels and
    one ``torch._scaled_mm``), as ``fp8_call_overhead_fwd_s`` is for ``rowwise``: the same median
    over the 9 small shapes the 17:12 H200 run measured for blockwise (0.38 ms, range 0.32-0.49).
    None: the row-wise figure."""

    fp8_blockwise_call_overhead_bwd_s: float | None = 5.1e-4
    """The same for the backward (1 quantisation kernel, 2 ``_scaled_mm``): 0.51 ms (range
    0.29-0.60) over the same 9 shapes. (That run's block-wise input gradient was numerically wrong,
    a bad Wᵀ copy, fixed since; its kernels and launches were the same, so the timing stands.)
    None: the row-wise figure."""


@dataclass(slots=True)
class Context:
    """Precomputed state for one (workload, topology, mesh, calibration). Build with :func:`build_context`."""

    workload: Workload
    topology: Topology
    mesh: MeshPlan
    calibration: Calibration | None
    eff: Efficiencies
    options: Options
    world: int
    local_batch: int
    micro_batches: int
    mb_batch: float
    """Samples per rank per micro-batch."""
    global_batch: int

    groups: dict[str, GroupPlacement]
    models: dict[tuple[str, str], CollectiveModel]

    ops: tuple[F.Op, ...]
    dense_idx: np.ndarray
    """Indices (into ops) of dense ops (not 'sparse')."""
    layer_names: tuple[str, ...]
    op_layer: np.ndarray
    """Per dense op: index of its layer."""
    layer_params: np.ndarray
    layer_expert_params: np.ndarray
    layer_input_bytes: np.ndarray
    """Per layer: bytes per sample of its input (kept when the layer is recomputed)."""
    layer_needs_embeddings: np.ndarray
    layer_is_moe: np.ndarray
    moe_blocks: dict[str, MoEBlock]

    moments: dict[str | None, tuple[float, float]]
    primary_sequence: str | None

    tables: TableArrays
    hbm_bw: float
    emb_bw: float
    """Achieved TBE bandwidth, bytes/s."""

    cache: dict = field(default_factory=dict)
    padded_moments: dict[str, tuple[float, float]] = field(default_factory=dict)
    """Measured (E[M], E[M²]) of M, a micro-batch's longest length, per sequence, for the padded
    reference (calibration against runs whose batches are known); empty: expected from the length pmf."""

    # ------------------------------------------------------------------ helpers
    def model(self, group: str, kind: str) -> CollectiveModel:
        key = (group, kind)
        m = self.models.get(key)
        if m is None:
            m = collective_model(self.topology, self.groups[group], kind, self.eff)
            self.models[key] = m
        return m

    @property
    def compute_bytes(self) -> int:
        return F.DTYPE_BYTES[self.workload.precision.compute_dtype]

    @property
    def expert_shard(self) -> int:
        ds, ep = self.mesh.dense_shard, self.mesh.expert_parallel
        return ds // ep if ds % ep == 0 else 1

    @property
    def dense_graphs(self) -> bool:
        """Whether the trainer runs this plan's dense arch as CUDA graphs (:func:`coplan.costmodel.flops.dense_graphs_apply`)."""
        return F.dense_graphs_apply(self.workload, self.world)

    @property
    def balance_group(self) -> int:
        """Ranks that balance together (:attr:`Options.balance_group_ranks`; default a node's, at most the world)."""
        return balance_group(self.world, self.topology.gpus_per_node, self.options.balance_group_ranks)

    @property
    def sm_contention(self) -> float:
        return self.eff.sm_contention if self.options.sm_contention is None else self.options.sm_contention


def primary_sequence(w: Workload) -> str | None:
    """The sequence whose quadratic work dominates (the one balancing is about)."""
    best, best_q = None, -1.0
    for s in w.sequences:
        m = length_moments(s.length)
        q = sum(op.flops.expect(m.mean, m.mean_sq) for op in F.workload_ops(w) if op.sequence == s.name)
        if q > best_q:
            best, best_q = s.name, q
    return best


def local_batch_of(workload: Workload, world: int) -> int:
    """Samples per GPU per step; a global batch that does not split over ``world`` is refused, naming the fix."""
    b = workload.batch
    if not b.splits(world):
        raise batch_split_error(int(b.global_batch_size or 0), world, workload.name)
    return b.local(world)


def micro_batches_of(workload: Workload, mesh: MeshPlan) -> int:
    """The plan's micro-batch count: the mesh's (the planner's choice), else the workload's ('auto': 1)."""
    if mesh.micro_batches is not None:
        return int(mesh.micro_batches)
    return workload.batch.fixed_micro_batches or 1


def build_context(
    workload: Workload,
    topology: Topology,
    mesh: MeshPlan,
    calibration: Calibration | None = None,
    *,
    options: Options | None = None,
    force_calibration: bool = False,
) -> Context:
    """Precompute the state of one (workload, topology, mesh candidate, calibration)."""
    options = options or Options()
    world = mesh.world_size
    if world > topology.num_gpus:
        raise PlacementError(f"the mesh covers {world:,} ranks but topology '{topology.name}' has {topology.num_gpus:,} GPUs")
    eff = resolve_efficiencies(topology, calibration, force=force_calibration)
    ds, dr, ep = mesh.dense_shard, mesh.dense_replicate, mesh.expert_parallel
    es = ds // ep if ds % ep == 0 else 1
    er = max(1, world // (ep * es))
    groups = {
        "dense_shard": place_group(topology, ds, 1),
        "dense_replicate": place_group(topology, dr, ds),
        "expert": place_group(topology, ep, 1),
        "expert_shard": place_group(topology, es, ep),
        "expert_replicate": place_group(topology, er, ep * es),
        "sparse_shard": place_group(topology, mesh.sparse_shard, 1),
        "sparse_replicate": place_group(topology, mesh.sparse_replicate, mesh.sparse_shard),
        "world": place_group(topology, world, 1),
    }
    B = local_batch_of(workload, world)
    M = micro_batches_of(workload, mesh)
    if B % M:
        raise BatchError(
            f"workload '{workload.name}': {M} micro-batches do not split the local batch of {B} per GPU at {world:,} GPUs "
            f"evenly; use one of {divisors(B)[:12]} (batch.micro_batches), or 'auto' to let the planner choose"
        )
    ops = F.workload_ops(workload)
    dense_idx = np.array([i for i, o in enumerate(ops) if o.layer != "sparse"], dtype=np.int64)
    lnames = F.layer_names(workload)
    lidx = {n: i for i, n in enumerate(lnames)}
    op_layer = np.array([lidx[ops[i].layer] for i in dense_idx], dtype=np.int64)
    nl = len(lnames)
    params = np.zeros(nl)
    eparams = np.zeros(nl)
    inp = np.zeros(nl)
    moments: dict[str | None, tuple[float, float]] = {None: (0.0, 0.0)}
    for s in workload.sequences:
        m = length_moments(s.length)
        moments[s.name] = (m.mean, m.mean_sq)
    seen: set[int] = set()
    for k, i in enumerate(dense_idx):
        o = ops[i]
        li = op_layer[k]
        params[li] += o.params
        eparams[li] += o.expert_params
        if li not in seen and not o.act_bytes.is_zero:
            m1, m2 = moments[o.sequence]
            inp[li] = o.act_bytes.expect(m1, m2)
            seen.add(li)
    needs = np.zeros(nl, dtype=bool)
    is_moe = np.zeros(nl, dtype=bool)
    moe_blocks: dict[str, MoEBlock] = {}
    for b in workload.blocks:
        if isinstance(b, (InterFormerBlock, KunlunBlock, DotInteractionBlock)) and f"{b.name}.0" in lidx:
            needs[lidx[f"{b.name}.0"]] = True
        if isinstance(b, MoEBlock):
            for i in range(b.num_layers):
                is_moe[lidx[f"{b.name}.{i}"]] = True
                moe_blocks[f"{b.name}.{i}"] = b
    if workload.all_tables and not needs.any() and nl:
        needs[0] = True
    gpu = topology.gpu
    return Context(
        workload=workload, topology=topology, mesh=mesh, calibration=calibration, eff=eff, options=options,
        world=world, local_batch=B, micro_batches=M, mb_batch=B / M, global_batch=B * world,
        groups=groups, models={}, ops=ops, dense_idx=dense_idx, layer_names=lnames, op_layer=op_layer,
        layer_params=params, layer_expert_params=eparams, layer_input_bytes=inp, layer_needs_embeddings=needs,
        layer_is_moe=is_moe, moe_blocks=moe_blocks, moments=moments, primary_sequence=primary_sequence(workload),
        tables=shared_cache(workload, ("tables",), lambda: table_arrays(workload)), hbm_bw=gpu.hbm_bw_bytes_per_s,
        emb_bw=gpu.hbm_bw_bytes_per_s * eff.memory["embedding"],
    )


__all__ = ["Context", "GiB", "MiB", "Options", "build_context", "local_batch_of", "micro_batches_of", "shared_cache"]
