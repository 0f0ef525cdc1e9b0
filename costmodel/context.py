"""The pricing context: everything about one (workload, topology, mesh candidate, calibration)
that does not depend on the rest of the plan, computed once so that pricing thousands of table
placements, recompute sets and balancing policies stays cheap.

It holds the placed process groups and their collective models, the per-op expected per-sample
work on one rank, the per-layer sums, the tables as arrays, and caches of the jagged imbalance per
balancing policy. The decomposed costs the planner's CP-SAT model needs are read from it:
:func:`table_option_cost` / :func:`table_option_costs`, :func:`layer_costs`, :func:`dense_fixed_costs`.

Conventions: times are per optimizer step (all micro-batches) on one rank unless a name says
"per micro-batch"; "critical" means the rank with the expected largest jagged load.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from coplan.costmodel import flops as F
from coplan.costmodel.comm import CollectiveModel, GroupPlacement, PlacementError, collective_model, place_group
from coplan.costmodel.efficiency import UNFUSED_CLASS, Efficiencies, resolve_efficiencies
from coplan.costmodel.embedding import SHARDING_CODES, TableArrays, TableOptionCosts, option_costs, table_arrays
from coplan.errors import CoplanError
from coplan.spec.calibration import Calibration
from coplan.spec.plan import MeshPlan
from coplan.spec.topology import Topology
from coplan.spec.workload import (
    DotInteractionBlock,
    InterFormerBlock,
    Kernels,
    KunlunBlock,
    LognormalLength,
    MoEBlock,
    TaskHeads,
    Workload,
)

GiB = 1024.0**3
MiB = 1024.0**2

_SHARED: dict[tuple, tuple[object, object]] = {}
"""Process-wide cache of context-independent results (table arrays, option costs), keyed by the
identity of the workload they belong to (the entry keeps the workload alive, so ids cannot be reused)."""


def _shared(workload: Workload, key: tuple, make):
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
    def sm_contention(self) -> float:
        return self.eff.sm_contention if self.options.sm_contention is None else self.options.sm_contention


def _primary_sequence(w: Workload) -> str | None:
    """The sequence whose quadratic work dominates (the one balancing is about)."""
    best, best_q = None, -1.0
    from coplan.costmodel.jagged import length_moments

    for s in w.sequences:
        m = length_moments(s.length)
        q = sum(op.flops.expect(m.mean, m.mean_sq) for op in F.workload_ops(w) if op.sequence == s.name)
        if q > best_q:
            best, best_q = s.name, q
    return best


def local_batch_of(workload: Workload, world: int) -> int:
    """Samples per GPU per step; a global batch that does not split over ``world`` is refused, naming the fix."""
    from coplan.spec.workload import batch_split_error

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
    from coplan.costmodel.jagged import length_moments

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
        from coplan.errors import BatchError
        from coplan.spec.workload import divisors

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
        layer_is_moe=is_moe, moe_blocks=moe_blocks, moments=moments, primary_sequence=_primary_sequence(workload),
        tables=_shared(workload, ("tables",), lambda: table_arrays(workload)), hbm_bw=gpu.hbm_bw_bytes_per_s,
        emb_bw=gpu.hbm_bw_bytes_per_s * eff.memory["embedding"],
    )


# ---------------------------------------------------------------------------------------------
# Dense compute
# ---------------------------------------------------------------------------------------------


def _expected_max_length(dist, n: float) -> float:
    """E[max of n lengths] ≈ the (n/(n+1)) quantile (padded reference kernels pad to it)."""
    from coplan.costmodel.jagged import length_pmf

    q = n / (n + 1.0)
    if isinstance(dist, LognormalLength):
        from scipy.special import ndtri

        x = math.exp(dist.mu + dist.sigma * float(ndtri(q)))
        return float(min(dist.max_len, max(dist.min_len, x)))
    vals, probs = length_pmf(dist)
    c = np.cumsum(probs)
    return float(vals[min(len(vals) - 1, int(np.searchsorted(c, q)))])


def seq_lookup_floor_s(ctx: "Context", samples_per_micro_batch: float, shards=1.0) -> np.ndarray:
    """Per table, seconds per step: the latency-bound floor of FBGEMM's no-bag (sequence) lookup forward,
    0 for pooled tables. The lookup of a table is priced at max(its bytes / TBE bandwidth, this floor).

    The kernel gives each bag one warp, which walks the bag's ids one after another (each id: load
    the index, then the row: dependent loads, ``lookup_id_s`` apart at low occupancy). One kernel runs
    the bags of all sequence tables of one dim (TorchRec groups them so: the trainer's ``ec_d<dim>``);
    its warps run in ``ceil(non-empty bags / resident warps)`` waves, each as long as its longest bag:

        floor_group = micro-batches × waves × (ids in the longest bag) × lookup_id_s

    With whole histories as bags (``seq_chunk = 0``) there are as many bags as samples × tables, far
    fewer than the 8,448 resident warps of an H200, in one wave as long as the batch's longest history
    (E[max L], the same for every table of a sequence): latency-bound (the round-2 H200 runs: 64-320
    warps, ~1.3-3 ms per call). With bags of at most ``c`` ids the longest bag is ``c`` and the waves
    are ``samples × tables × E[ceil(L / c)] / resident warps``: a few waves of ``c`` ids, under the
    bytes' time (bandwidth-bound). The group's floor is split among its tables by their bytes (exact
    when the group's tables sit on one rank, as on one GPU; with table-wise sharding across ranks it
    under-prices a rank holding part of a group). ``shards`` (scalar or per table): a row-wise shard
    walks 1/k of each bag's ids.
    """
    from coplan.costmodel.jagged import length_pmf

    ta = ctx.tables
    out = np.zeros(ta.num)
    t_id = ctx.eff.lookup_id_s
    if not ta.num or t_id <= 0 or not ta.is_seq.any():
        return out
    chunk = int(ctx.options.seq_chunk)
    resident = float(ctx.topology.gpu.num_sms * ctx.options.lookup_warps_per_sm)
    S = float(samples_per_micro_batch)
    k = np.broadcast_to(np.asarray(shards, dtype=float), ta.rows.shape)
    seq_bytes = ta.features * ta.dim * ta.wbytes  # split of a group's floor: bytes per id of each table
    seqs = {sq for sq, is_s in zip(ta.sequence, ta.is_seq) if is_s and sq is not None}
    for sq in seqs:
        dist = ctx.workload.sequence(sq).length
        e_max = (ctx.padded_moments.get(sq) or _expected_max_moments(dist, max(1.0, S)))[0]
        if chunk > 0:
            try:
                vals, probs = length_pmf(dist)
                bags_per_sample = float((probs * np.ceil(vals.astype(np.float64) / chunk)).sum())
            except ValueError:
                bags_per_sample = ctx.moments.get(sq, (e_max, 0.0))[0] / chunk + 0.5
            longest = min(float(chunk), e_max)
        else:
            bags_per_sample, longest = 1.0, e_max
        for dim in sorted({float(d) for d, sq2, is_s in zip(ta.dim, ta.sequence, ta.is_seq) if is_s and sq2 == sq}):
            idx = np.flatnonzero(ta.is_seq & (ta.dim == dim) & np.array([x == sq for x in ta.sequence]))
            bags = S * float(ta.features[idx].sum()) * bags_per_sample
            waves = math.ceil(bags / resident) if bags > 0 else 0
            floor = ctx.micro_batches * waves * longest * t_id
            share = seq_bytes[idx] / seq_bytes[idx].sum()
            out[idx] = floor * share / k[idx]
    return out


HOST_KERNELS_PER_PRICED_LAUNCH = 4.1
"""Kernels the trainer's host really issues per launch the pricer charges (``h``, the calibrated
``host_launch_s``, is per priced launch): measured on the H200 round-4 traces of the five Triton fit
runs (``traces.host_profile``: forward + backward + post launches per profiled step over the pricer's
priced launches; base 4.20, b32-h512 4.14, d512-L6 4.06, rc-nomoe 3.78, nomoe-b32-L2 4.30; mean 4.10),
no reference run and no step time used. The host time of these runs grows with their real launches at
about the same rate per launch as the padded reference's (its forward's extra 668 launches took
47 ms of host, 71 µs each, against 70 µs per launch over base's forward), so an op priced by its
real kernels costs ``kernels / 4.1`` priced launches on the host."""


def host_work_s(ctx: "Context") -> float:
    """Host seconds per step that grow with the rank's local batch (``host_sample_s`` per sample): added
    to the priced launches' host time before the step takes the longer of host and device."""
    return float(ctx.eff.host_sample_s * ctx.local_batch)


REFERENCE_PAD_MULTIPLE = 16
"""The padded reference rounds each batch's longest length up to this multiple
(``coplan.kernels.reference.PAD_MULTIPLE``, which says why; a test keeps the two equal)."""


def padded_length_moments(m1: float, m2: float, multiple: int = REFERENCE_PAD_MULTIPLE) -> tuple[float, float]:
    """(E[P], E[P²]) of P, the longest length M rounded up to ``multiple``, from (E[M], E[M²]). One
    length (E[M²] = E[M]²) is rounded exactly; a spread of them takes the rounding as independent of M
    and uniform over 0..multiple-1 (the exact pmf path rounds each value: :func:`_expected_max_moments`)."""
    if multiple <= 1 or m1 <= 0:
        return m1, m2
    if abs(m2 - m1 * m1) <= 1e-9 * max(1.0, m2):
        p = -(-math.ceil(m1 - 1e-6) // multiple) * multiple
        return float(p), float(p * p)
    u1 = (multiple - 1) / 2.0
    u2 = (multiple - 1) * (2 * multiple - 1) / 6.0
    return m1 + u1, m2 + 2.0 * m1 * u1 + u2


def _expected_max_moments(dist, n: float, multiple: int = 1) -> tuple[float, float]:
    """(E[M], E[M²]) of M, the longest of n independent lengths: exact from the length's pmf
    (P(M ≤ l) = P(L ≤ l)ⁿ); the quantile of :func:`_expected_max_length` squared when it has none."""
    from coplan.costmodel.jagged import length_pmf

    try:
        vals, probs = length_pmf(dist)
    except ValueError:  # a log-normal too wide for an explicit pmf
        x = _expected_max_length(dist, n)
        return padded_length_moments(x, x * x, multiple)
    cdf = np.minimum(1.0, np.cumsum(probs)) ** max(1.0, float(n))
    pm = np.diff(np.concatenate(([0.0], cdf)))
    v = vals.astype(np.float64)
    if multiple > 1:
        v = np.ceil(v / multiple) * multiple
    return float((pm * v).sum()), float((pm * v * v).sum())


@dataclass(frozen=True, slots=True)
class OpArrays:
    """Per dense op, one micro-batch on a mean rank, for one (attention backend, per-layer precision)."""

    fwd_flops: np.ndarray
    bwd_flops: np.ndarray
    """Hardware FLOPs of backward (model + recompute of scores)."""
    model_bwd_flops: np.ndarray
    fwd_var_s: np.ndarray
    """Forward time of the per-sample part: max(compute, memory) roof before adding fixed bytes."""
    fwd_flop_s: np.ndarray
    fwd_mem_s: np.ndarray
    fwd_fixed_mem_s: np.ndarray
    bwd_flop_s: np.ndarray
    bwd_mem_s: np.ndarray
    bwd_fixed_mem_s: np.ndarray
    fwd_launch_s: np.ndarray
    bwd_launch_s: np.ndarray
    fwd_bytes: np.ndarray
    bwd_bytes: np.ndarray
    act_bytes: np.ndarray
    """Saved activations per micro-batch."""
    fp8: np.ndarray
    """1 where the op runs as an FP8 GEMM, else 0."""
    fwd_quant_s: np.ndarray
    """FP8 quantisation passes of the forward's activations (memory-bound kernels beside the GEMM,
    added to it, not overlapped): the per-sample part."""
    fwd_quant_fixed_s: np.ndarray
    """The forward's weight quantisation (once per call)."""
    bwd_quant_s: np.ndarray
    bwd_quant_fixed_s: np.ndarray
    fwd_launches: np.ndarray
    """Kernels per call of each op as priced for this backend (the padded reference launches more)."""
    bwd_launches: np.ndarray
    fwd_serial_s: np.ndarray
    """Separate memory-bound kernels of an unfused op (:attr:`coplan.costmodel.flops.Op.fwd_serial_bytes`),
    at the elementwise class's bandwidth: they run after the op's main kernels, so they add to its
    roofline instead of hiding under it (an op of several kernels costs the sum of theirs)."""
    bwd_serial_s: np.ndarray
    fwd_host_launches: np.ndarray
    """Host cost of each op's forward call in priced launches: ``fwd_launches``, or for an op whose
    host issues other kernels than priced (:attr:`coplan.costmodel.flops.Op.fwd_host_kernels`, the
    padded reference) those kernels / :data:`HOST_KERNELS_PER_PRICED_LAUNCH`."""
    bwd_host_launches: np.ndarray
    fwd_syncs: np.ndarray
    """Host syncs per forward call (1 where the op reads a device value back before its kernels)."""
    fwd_extra_kernels: np.ndarray
    """Kernels an unfused op runs on the device beyond its priced launches (the padded reference's small ATen
    kernels), each costing the ``unfused`` launch overhead (in ``fwd_launch_s``)."""
    bwd_extra_kernels: np.ndarray

    def times(self, rho: float | np.ndarray = 1.0) -> tuple[np.ndarray, np.ndarray]:
        """(fwd, bwd) seconds per op per micro-batch when the per-sample work is scaled by ``rho``."""
        f = np.maximum(rho * self.fwd_flop_s, rho * self.fwd_mem_s + self.fwd_fixed_mem_s) + self.fwd_launch_s
        b = np.maximum(rho * self.bwd_flop_s, rho * self.bwd_mem_s + self.bwd_fixed_mem_s) + self.bwd_launch_s
        f = f + rho * (self.fwd_quant_s + self.fwd_serial_s) + self.fwd_quant_fixed_s
        b = b + rho * (self.bwd_quant_s + self.bwd_serial_s) + self.bwd_quant_fixed_s
        return f, b


def fp8_capable(op: F.Op, workload: Workload) -> bool:
    """Whether the FP8 recipe can run the op: a GEMM against its own dense weight (a linear layer).

    GEMMs between activations (DLRM's dot interaction), the routed experts' grouped matmuls and
    Kunlun's block-diagonal input projection (batched einsums, not linear layers) stay in the
    compute dtype: the trainer's recipe swaps ``nn.Linear`` modules and nothing else.
    """
    if op.op_class != "gemm" or op.params <= 0:
        return False
    try:
        block = workload.block(op.block)
    except KeyError:
        return False
    return not (isinstance(block, KunlunBlock) and op.name.endswith(".input_proj"))


def fp8_guard(op: F.Op, workload: Workload) -> str | None:
    """Why the numerics guard keeps a capable op in the compute dtype unless fp8 is forced, or None."""
    try:
        block = workload.block(op.block)
    except KeyError:
        block = None
    if isinstance(block, TaskHeads):
        return "guard: task head"
    if op.min_dim < workload.precision.fp8_min_dim:
        return f"guard: GEMM dim {op.min_dim} < fp8_min_dim {workload.precision.fp8_min_dim}"
    return None


def fp8_allowed(op: F.Op, workload: Workload) -> bool:
    """Capable, and past the numerics guard (or fp8 forced): the op runs in fp8 when its layer does."""
    if not fp8_capable(op, workload):
        return False
    return workload.precision.fp8 == "force" or fp8_guard(op, workload) is None


def op_arrays(ctx: Context, kernels: Kernels | None = None, fp8_layers: frozenset[str] = frozenset()) -> OpArrays:
    """Per-op work of one micro-batch on a mean rank (cached per attention backend and fp8 layer set)."""
    kernels = kernels or ctx.workload.kernels
    key = ("ops", kernels.attention, fp8_layers)
    hit = ctx.cache.get(key)
    if hit is not None:
        return hit
    w = ctx.workload
    gpu = ctx.topology.gpu
    eff = ctx.eff
    n = ctx.mb_batch
    ops = [ctx.ops[i] for i in ctx.dense_idx]
    k = len(ops)
    out = {name: np.zeros(k) for name in OpArrays.__slots__}
    ep = ctx.mesh.expert_parallel
    pad_len: dict[str, float] = {}
    for i, o in enumerate(ops):
        m1, m2 = ctx.moments[o.sequence]
        model_op, model_m1, model_m2 = o, m1, m2  # model FLOPs: the real lengths, never the padding
        flops_eff = 1.0
        if o.op_class == "attention" and o.sequence is not None:
            if kernels.attention == "reference":
                if o.sequence not in pad_len:
                    measured = ctx.padded_moments.get(o.sequence)
                    pad_len[o.sequence] = (padded_length_moments(*measured) if measured else
                                           _expected_max_moments(w.sequence(o.sequence).length, n, REFERENCE_PAD_MULTIPLE))
                # padded to the batch's longest: the quadratic terms cost E[max²], which a heavy-tailed
                # length distribution puts well above E[max]² (or the quantile's square)
                real_m1 = m1
                m1, m2 = pad_len[o.sequence]
                # what the reference really runs: full padded score blocks in fp32/TF32, its copies, its kernels
                o = F.padded_reference_attention(o, w, min(1.0, real_m1 / m1) if m1 > 0 else 1.0)
            elif kernels.attention == "flex":
                # block-sparse masks compute whole 128-token tiles: L rounds up by ~64 on average
                m2 = m2 + 128.0 * m1 + 64.0**2
                m1 = m1 + 64.0
                flops_eff = 0.8
        dt = o.dtype
        if o.layer in fp8_layers and fp8_allowed(o, w):
            dt = "fp8"
        peak = gpu.peak_flops_per_s.get(dt) or gpu.peak_flops_per_s["bf16"]
        ce = eff.compute_eff(o.op_class, dt) * flops_eff
        # an unfused op (the padded reference): its matmuls' bytes and its separate kernels' are streamed
        # at one class's memory efficiency (UNFUSED_CLASS says why)
        unfused = not (o.fwd_serial_bytes.is_zero and o.bwd_serial_bytes.is_zero)
        bw = gpu.hbm_bw_bytes_per_s * eff.memory.get(UNFUSED_CLASS if unfused else o.op_class, 0.85)
        bw_serial = gpu.hbm_bw_bytes_per_s * eff.memory.get(UNFUSED_CLASS, 0.85)
        launch = eff.launch_s.get(o.op_class, 3e-6)
        load = 1.0
        fixed_f, fixed_b = o.fixed_fwd_bytes, o.fixed_bwd_bytes
        if o.expert_params:
            b = ctx.moe_blocks.get(o.layer)
            if ep > 1 and b is not None:
                # the busiest EP rank gets up to capacity_factor × the balanced routed load
                load = b.capacity_factor
            fixed_f, fixed_b = fixed_f / ep, fixed_b / ep
        ff = n * load * o.fwd_flops.expect(m1, m2)
        bf = n * load * (o.bwd_flops.expect(m1, m2) + o.bwd_extra_flops.expect(m1, m2))
        fb = n * load * o.fwd_bytes.expect(m1, m2)
        bb = n * load * o.bwd_bytes.expect(m1, m2)
        out["fwd_flops"][i] = ff
        out["bwd_flops"][i] = bf
        out["model_bwd_flops"][i] = n * model_op.bwd_flops.expect(model_m1, model_m2)
        out["fwd_flop_s"][i] = ff / (peak * ce)
        out["fwd_mem_s"][i] = fb / bw
        out["fwd_fixed_mem_s"][i] = fixed_f / bw
        out["bwd_flop_s"][i] = bf / (peak * ce)
        out["bwd_mem_s"][i] = bb / bw
        out["bwd_fixed_mem_s"][i] = fixed_b / bw
        out["fwd_launch_s"][i] = o.fwd_launches * launch
        out["bwd_launch_s"][i] = o.bwd_launches * launch
        if unfused:
            # the unfused op's other kernels: small ATen ones, each a device floor of its own
            xf, xb = max(0.0, o.fwd_host_kernels - o.fwd_launches), max(0.0, o.bwd_host_kernels - o.bwd_launches)
            out["fwd_extra_kernels"][i], out["bwd_extra_kernels"][i] = xf, xb
            out["fwd_launch_s"][i] += xf * eff.launch_s.get(UNFUSED_CLASS, 2e-6)
            out["bwd_launch_s"][i] += xb * eff.launch_s.get(UNFUSED_CLASS, 2e-6)
        out["fwd_launches"][i] = o.fwd_launches
        out["bwd_launches"][i] = o.bwd_launches
        out["fwd_host_launches"][i] = o.fwd_host_kernels / HOST_KERNELS_PER_PRICED_LAUNCH if o.fwd_host_kernels else o.fwd_launches
        out["bwd_host_launches"][i] = o.bwd_host_kernels / HOST_KERNELS_PER_PRICED_LAUNCH if o.bwd_host_kernels else o.bwd_launches
        out["fwd_syncs"][i] = 1.0 if o.host_sync else 0.0
        sf = n * load * o.fwd_serial_bytes.expect(m1, m2)
        sb = n * load * o.bwd_serial_bytes.expect(m1, m2)
        out["fwd_serial_s"][i] = sf / bw_serial
        out["bwd_serial_s"][i] = sb / bw_serial
        out["fwd_bytes"][i] = fb + fixed_f + sf
        out["bwd_bytes"][i] = bb + fixed_b + sb
        out["act_bytes"][i] = n * o.act_bytes.expect(m1, m2)
        if dt == "fp8":
            _price_fp8_quantisation(out, i, o, n * load * o.fwd_bytes.expect(m1, m2), fixed_f, ctx)
    out["fwd_var_s"] = np.maximum(out["fwd_flop_s"], out["fwd_mem_s"])
    arr = OpArrays(**out)
    ctx.cache[key] = arr
    return arr


def _price_fp8_quantisation(out: dict[str, np.ndarray], i: int, o: F.Op, act_bytes: float, weight_bytes: float, ctx: Context) -> None:
    """Add the quantisation passes of one FP8 GEMM op (row ``i`` of ``out``).

    A rowwise-scaled FP8 linear layer quantises, in forward, its input ``x`` and its weight ``W``
    (scales along the reduced dimension); in backward, the output gradient ``dY`` for ``dX = dY·W``
    (rowwise), and for ``dW = dYᵀ·x`` the transposed ``dYᵀ`` and ``xᵀ`` (scales along the tokens), and
    ``W`` again along its other dimension. Each pass reads the high-precision tensor ``reads`` times
    (:class:`Options`) and writes one byte per element, at the elementwise HBM bandwidth, one kernel
    per read. ``act_bytes`` (the op's forward bytes) holds ``x`` and ``Y``; they are taken as half each
    (the op does not record ``k`` and ``n`` apart), which is exact in total over forward + backward
    (``x`` is quantised twice, ``dY`` twice) and moves a little time between the two phases.
    The GEMM's own bytes stay those of the compute dtype (it is compute-bound at the sizes that gain).
    """
    b = F.DTYPE_BYTES[o.dtype]
    if ctx.workload.precision.fp8_recipe == "blockwise":
        _price_fp8_quantisation_blockwise(out, i, o, act_bytes / b / 2.0, weight_bytes / b, b, ctx)
        return
    r_row, r_col = ctx.options.fp8_quant_reads_rowwise, ctx.options.fp8_quant_reads_colwise
    per_row, per_col = r_row * b + 1.0, r_col * b + 1.0
    half = act_bytes / b / 2.0
    w_elems = weight_bytes / b
    bw = ctx.topology.gpu.hbm_bw_bytes_per_s * ctx.eff.memory.get("elementwise", 0.85)
    launch = ctx.eff.launch_s.get("elementwise", 2e-6)
    k_row, k_col = math.ceil(r_row), math.ceil(r_col)
    fq, fw = half * per_row, w_elems * per_row
    bq, bwq = half * per_row + 2.0 * half * per_col, w_elems * per_col
    out["fp8"][i] = 1.0
    out["fwd_quant_s"][i] = fq / bw
    out["fwd_quant_fixed_s"][i] = fw / bw
    out["bwd_quant_s"][i] = bq / bw
    out["bwd_quant_fixed_s"][i] = bwq / bw
    # Per call: the kernels' launches (so the step's slope in the launch cost stays the pricer's launch
    # count) plus the measured fixed overhead (which holds them too: a few µs of 0.2-0.8 ms).
    ovh_f, ovh_b = ctx.options.fp8_call_overhead_fwd_s, ctx.options.fp8_call_overhead_bwd_s
    out["fwd_launch_s"][i] += o.fwd_launches * (2 * k_row * launch + ovh_f)
    out["bwd_launch_s"][i] += o.fwd_launches * ((k_row + 3 * k_col) * launch + ovh_b)
    out["fwd_bytes"][i] += fq + fw
    out["bwd_bytes"][i] += bq + bwq


def _price_fp8_quantisation_blockwise(out: dict[str, np.ndarray], i: int, o: F.Op, half: float, w_elems: float, b: float,
                                      ctx: Context) -> None:
    """The ``blockwise`` recipe's passes (``kernels/fp8.py``): its scales are local (1x128 tiles,
    128x128 weight blocks) in both directions, so each tensor is read once and written as both fp8
    copies the layer needs: forward ``x`` (``x`` and ``xᵀ``) and ``W`` (``W`` and ``Wᵀ``), backward
    ``dY`` (``dY`` and ``dYᵀ``); the backward re-reads neither ``x`` nor ``W`` (it saves their fp8
    copies). So ``b + 2`` bytes per element, one kernel per tensor. Memory is left as priced for
    the compute dtype (the saved fp8 ``xᵀ`` is smaller than ``x``: an over-estimate)."""
    bw = ctx.topology.gpu.hbm_bw_bytes_per_s * ctx.eff.memory.get("elementwise", 0.85)
    launch = ctx.eff.launch_s.get("elementwise", 2e-6)
    per = b + 2.0
    fq, fw, bq = half * per, w_elems * per, half * per
    out["fp8"][i] = 1.0
    out["fwd_quant_s"][i] = fq / bw
    out["fwd_quant_fixed_s"][i] = fw / bw
    out["bwd_quant_s"][i] = bq / bw
    out["bwd_quant_fixed_s"][i] = 0.0
    opts = ctx.options
    ovh_f = opts.fp8_blockwise_call_overhead_fwd_s if opts.fp8_blockwise_call_overhead_fwd_s is not None else opts.fp8_call_overhead_fwd_s
    ovh_b = opts.fp8_blockwise_call_overhead_bwd_s if opts.fp8_blockwise_call_overhead_bwd_s is not None else opts.fp8_call_overhead_bwd_s
    out["fwd_launch_s"][i] += o.fwd_launches * (2 * launch + ovh_f)
    out["bwd_launch_s"][i] += o.fwd_launches * (1 * launch + ovh_b)
    out["fwd_bytes"][i] += fq + fw
    out["bwd_bytes"][i] += bq


def seq_cost(ctx: Context, kernels: Kernels | None = None):
    """Per-sample seconds (forward + backward) as ``SeqCost(const, lin, quad)`` in the primary
    sequence's length, each op priced in the roof (compute or memory) it is in at batch level."""
    from coplan.costmodel.jagged import SeqCost

    key = ("seqcost", (kernels or ctx.workload.kernels).attention)
    hit = ctx.cache.get(key)
    if hit is not None:
        return hit
    arr = op_arrays(ctx, kernels)
    gpu = ctx.topology.gpu
    c = l = q = 0.0
    prim = ctx.primary_sequence
    for i, oi in enumerate(ctx.dense_idx):
        o = ctx.ops[oi]
        for flops_c, bytes_c, comp_s, mem_s, serial_s in (
            (o.fwd_flops, o.fwd_bytes, arr.fwd_flop_s[i], arr.fwd_mem_s[i], arr.fwd_serial_s[i]),
            (o.bwd_flops + o.bwd_extra_flops, o.bwd_bytes, arr.bwd_flop_s[i], arr.bwd_mem_s[i], arr.bwd_serial_s[i]),
        ):
            m1, m2 = ctx.moments[o.sequence]
            # an unfused op's separate kernels scale with the same length terms as its main roof
            if comp_s >= mem_s:
                scale = (comp_s + serial_s) / max(flops_c.expect(m1, m2), 1e-300)
                co = flops_c
            else:
                scale = (mem_s + serial_s) / max(bytes_c.expect(m1, m2), 1e-300)
                co = bytes_c
            scale /= ctx.mb_batch
            if o.sequence is not None and o.sequence == prim:
                c, l, q = c + co.const * scale, l + co.lin * scale, q + co.quad * scale
            else:
                c += co.expect(m1, m2) * scale
    out = SeqCost(c, l, q)
    ctx.cache[key] = out
    return out


def _normalised(sc, moments: tuple[float, float]):
    """The per-sample cost scaled to mean 1 and rounded to 3 significant digits: the max/mean ratio is
    scale-free, and rounding lets mesh candidates whose costs differ in the 4th digit share one
    simulation (``expected_imbalance`` memoises on the coefficients)."""
    from coplan.costmodel.jagged import SeqCost

    mean = sc.const_s + sc.lin_s * moments[0] + sc.quad_s * moments[1]
    if mean <= 0:
        return sc
    r = lambda x: float(f"{x / mean:.3g}")  # noqa: E731
    return SeqCost(r(sc.const_s), r(sc.lin_s), r(sc.quad_s))


def imbalance(ctx: Context, policy: str, kernels: Kernels | None = None) -> float:
    """Expected max/mean per-rank jagged work under ``policy`` (1 when no sequence varies in length)."""
    from coplan.costmodel.jagged import expected_imbalance

    key = ("imb", policy, (kernels or ctx.workload.kernels).attention)
    hit = ctx.cache.get(key)
    if hit is not None:
        return hit
    prim = ctx.primary_sequence
    if prim is None:
        rho = 1.0
    else:
        dist = ctx.workload.sequence(prim).length
        rho = expected_imbalance(
            dist, _normalised(seq_cost(ctx, kernels), ctx.moments[prim]), ctx.local_batch, ctx.world, policy,
            seed=ctx.options.balance_seed, trials=ctx.options.balance_trials, num_micro_batches=ctx.micro_batches,
        )
    ctx.cache[key] = rho
    return rho


# ---------------------------------------------------------------------------------------------
# Decomposed costs for the planner
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LayerCost:
    """One dense layer on the critical rank, per step (all micro-batches)."""

    name: str
    fwd_s: float
    bwd_s: float
    """Backward compute (without recompute)."""
    recompute_s: float
    """Extra time when the layer is recomputed (its forward again)."""
    activation_bytes: float
    """Saved activations of one micro-batch when not recomputed."""
    recomputed_activation_bytes: float
    """Kept when recomputed: the layer input of one micro-batch."""
    params: float
    expert_params: float
    fp8_fwd_s: float
    """Forward time with the layer's eligible GEMMs in fp8."""
    fp8_bwd_s: float


def layer_costs(ctx: Context, *, policy: str = "greedy", kernels: Kernels | None = None) -> tuple[LayerCost, ...]:
    """Per-layer compute and activation figures (critical rank, jagged imbalance of ``policy`` applied)."""
    rho = imbalance(ctx, policy, kernels)
    arr = op_arrays(ctx, kernels)
    f, b = arr.times(rho)
    all_fp8 = frozenset(ctx.layer_names)
    arr8 = op_arrays(ctx, kernels, all_fp8)
    f8, b8 = arr8.times(rho)
    nl = len(ctx.layer_names)
    M = ctx.micro_batches
    fl = np.bincount(ctx.op_layer, weights=f, minlength=nl) * M
    bl = np.bincount(ctx.op_layer, weights=b, minlength=nl) * M
    fl8 = np.bincount(ctx.op_layer, weights=f8, minlength=nl) * M
    bl8 = np.bincount(ctx.op_layer, weights=b8, minlength=nl) * M
    act = np.bincount(ctx.op_layer, weights=arr.act_bytes, minlength=nl) * rho
    inp = ctx.layer_input_bytes * ctx.mb_batch * rho
    return tuple(
        LayerCost(n, float(fl[i]), float(bl[i]), float(fl[i]), float(act[i]), float(min(inp[i], act[i])),
                  float(ctx.layer_params[i]), float(ctx.layer_expert_params[i]), float(fl8[i]), float(bl8[i]))
        for i, n in enumerate(ctx.layer_names)
    )


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
    """FSDP2's copies around its collectives, per micro-batch, forward (:func:`fsdp_copy_bytes`), at the
    elementwise class's bandwidth, launches included."""
    fsdp_copy_bwd_s: float = 0.0
    """The same, backward (gradient copy-in, the one-rank divided copy, the cast to the parameter dtype)."""

    @property
    def comm_total_s(self) -> float:
        return float(self.all_gather_fwd_s.sum() + self.all_gather_bwd_s.sum() + self.reduce_scatter_s.sum()
                     + self.replicate_all_reduce_s.sum() + self.ep_all_to_all_s.sum())


def dense_fixed_costs(ctx: Context) -> DenseFixedCosts:
    hit = ctx.cache.get("dense_fixed")
    if hit is not None:
        return hit
    w = ctx.workload
    cb = ctx.compute_bytes
    pb = F.DTYPE_BYTES[w.precision.param_dtype]
    rb = F.DTYPE_BYTES[w.precision.reduce_dtype]
    ds, dr, ep = ctx.mesh.dense_shard, ctx.mesh.dense_replicate, ctx.mesh.expert_parallel
    es = ctx.expert_shard
    M = ctx.micro_batches
    P = ctx.layer_params
    E = ctx.layer_expert_params
    nl = len(P)
    ag = ctx.model("dense_shard", "all_gather")
    rs = ctx.model("dense_shard", "reduce_scatter")
    ar = ctx.model("dense_replicate", "all_reduce")
    eag = ctx.model("expert_shard", "all_gather")
    ers = ctx.model("expert_shard", "reduce_scatter")
    ear = ctx.model("expert_replicate", "all_reduce")
    a2a = ctx.model("expert", "all_to_all")
    ag_f = (ag.time(P * cb) + eag.time(E / ep * cb)) * M
    re = np.ones(nl)
    if nl:
        re[-1] = 0.0  # the last layer keeps its parameters for backward
    ag_b = ag_f * re if ctx.options.reshard_after_forward else np.zeros(nl)
    rs_s = (rs.time(P * rb) + ers.time(E / ep * rb)) * M
    if ds > 1:
        rep = ar.time(P / ds * rb) + ear.time(E / ep / es * rb)
    else:
        rep = ar.time(P * rb) + ear.time(E / ep / es * rb)
    rep = rep * M
    ep_s = np.zeros(nl)
    for i, name in enumerate(ctx.layer_names):
        b = ctx.moe_blocks.get(name)
        if b is not None and ep > 1:
            S = ctx.mb_batch * b.tokens_per_sample * b.top_k * b.model_dim * cb * b.capacity_factor
            ep_s[i] = 4 * a2a.time(S) * M
    n_local = P.sum() / ds + E.sum() / (ep * es)
    params_b = n_local * pb
    grads_b = n_local * pb  # FSDP2 keeps sharded gradients in the parameter dtype
    opt_b = n_local * w.optimizer.dense_state_bytes_per_param
    if (ds > 1 or ep > 1) and not ctx.options.reshard_after_forward:
        # unsharded compute-dtype weights of every layer stay from forward to backward
        mx = float((P + E / ep).max()) if nl else 0.0
        fsdp_buf = float((P + E / ep).sum()) * cb + mx * rb
    elif ds > 1 or ep > 1:
        # the current and the prefetched layer's unsharded weights, one layer's unsharded gradients
        mx = float((P + E / ep).max()) if nl else 0.0
        fsdp_buf = 2.0 * mx * cb + mx * rb
    else:
        fsdp_buf = float((P + E).sum()) * cb  # compute-dtype copies of all weights kept for backward
    # optimizer: read/write params and state, read grads (fused multi-tensor kernels); plus the trainer's
    # per-step gradient norm (its non-finite check, one foreach norm: the gradients read once, as
    # gradient clipping would), which runs just before the optimizer
    st = w.optimizer.dense_state_bytes_per_param
    opt_bytes = n_local * (2 * pb + rb + 2 * st) + n_local * rb
    bw = ctx.topology.gpu.hbm_bw_bytes_per_s * ctx.eff.memory.get("elementwise", 0.85)
    launch = ctx.eff.launch_s.get("elementwise", 2e-6)
    opt_s = opt_bytes / bw + OPTIMIZER_LAUNCHES * launch if n_local else 0.0
    cf, cbk = fsdp_copy_bytes(ctx)
    cp_f = cf / bw + FSDP_COPY_LAUNCHES[0] * launch if cf > 0 else 0.0
    cp_b = cbk / bw + FSDP_COPY_LAUNCHES[1] * launch if cbk > 0 else 0.0
    out = DenseFixedCosts(ctx.layer_names, ag_f, ag_b, rs_s, rep, ep_s, params_b, grads_b, opt_b, fsdp_buf, opt_s, cp_f, cp_b)
    ctx.cache["dense_fixed"] = out
    return out


OPTIMIZER_LAUNCHES = 20.0
"""Launches the pricer charges the dense optimizer step (fused multi-tensor kernels and the gradient norm)."""

FSDP_COPY_LAUNCHES = (2.0, 3.0)
"""Launches the pricer charges FSDP2's copies per micro-batch (forward: the parameter cast and the
copy into the gathered buffer; backward: the gradient copy-in, the divided copy, the cast), as if each
pass were one multi-tensor kernel. (On one rank FSDP2 launches the forward passes per parameter
tensor, ~2 per tensor; the cost model does not know tensor counts, and ``h`` is per *priced* launch.)"""

EMBEDDING_OUTPUT_BYTES = 4
"""Bytes per element of the sparse arch's outputs as the dense module receives them: TorchRec's fused
TBE writes fp32 unless ``output_dtype`` is set (the trainer does not set it)."""


def fsdp_copy_bytes(ctx: Context) -> tuple[float, float]:
    """HBM bytes of FSDP2's own copies per micro-batch on one rank: (forward, backward).

    What FSDP2 (``torch.distributed.fsdp._fully_shard``) runs around its collectives, with the
    trainer's mixed precision (parameters kept in ``param_dtype``, gathered in ``compute_dtype``,
    gradients reduced in ``reduce_dtype``; divide factor 1), for ``N`` dense parameters on the rank
    (routed experts: their ``1/ep`` share) sharded ``ds`` ways:

    - forward: the cast of the local shard to the compute dtype, ``N/ds·(pb+cb)`` (when the dtypes
      differ); on one rank the cast shard is copied into the unsharded parameters, ``N·2cb``; with
      ``ds > 1`` the copy into the all-gather input, ``N/ds·2cb``, and the copy-out of the gathered
      buffer, ``N·2cb``; again in backward for every layer but the last when parameters are resharded
      after forward;
    - backward: the copy of the unsharded gradients into the reduce-scatter input in the reduce dtype
      (``chunk_cat``), ``N·(cb+rb)``; on one rank the reduce-scatter is a divided copy (a division
      pass and a copy, ``2·N·2rb``); the cast of the reduced shard to the parameter dtype,
      ``N/ds·(rb+pb)``, when they differ;
    - the cast of the dense module's floating inputs to the compute dtype (``cast_forward_inputs``:
      the embedding outputs, :data:`EMBEDDING_OUTPUT_BYTES` each, at the workload's expected lengths)
      and of their gradients back.

    Nothing here is fitted: it is bytes, priced like every other memory-bound pass. Without FSDP
    (no dense parameters) both are 0."""
    w = ctx.workload
    cb = ctx.compute_bytes
    pb = F.DTYPE_BYTES[w.precision.param_dtype]
    rb = F.DTYPE_BYTES[w.precision.reduce_dtype]
    ds, ep = ctx.mesh.dense_shard, ctx.mesh.expert_parallel
    P, E = ctx.layer_params, ctx.layer_expert_params
    N = float(P.sum() + E.sum() / ep)
    if N <= 0:
        return 0.0, 0.0
    cast = (pb + cb) if pb != cb else 0.0
    if ds > 1:
        gather = N / ds * cast + N / ds * 2 * cb + N * 2 * cb
    else:
        gather = N * cast + N * 2 * cb
    fwd = gather
    bwd = N * (cb + rb) + (2 * N * 2 * rb if ds == 1 else 0.0) + (N / ds * (rb + pb) if rb != pb else 0.0)
    if ds > 1 and ctx.options.reshard_after_forward and len(P):
        last = float(P[-1] + E[-1] / ep)
        bwd += gather * (1.0 - last / N)
    ta = ctx.tables
    if ta.num and cb != EMBEDDING_OUTPUT_BYTES:
        vec = np.where(ta.is_seq, ctx.mb_batch * ta.lookups_per_sample, ctx.mb_batch * ta.features)
        elems = float((vec * ta.dim).sum())
        fwd += elems * (EMBEDDING_OUTPUT_BYTES + cb)
        bwd += elems * (cb + EMBEDDING_OUTPUT_BYTES)
    return fwd, bwd


def table_option_costs(ctx: Context, sharding_type: str, num_shards=1, *, kernel: str | None = None) -> TableOptionCosts:
    """All tables under one option, vectorised (see :mod:`coplan.costmodel.embedding`)."""
    kernel = kernel or ctx.workload.kernels.embedding
    if sharding_type not in SHARDING_CODES:
        raise CoplanError(f"unknown sharding type '{sharding_type}'; expected one of {sorted(SHARDING_CODES)}")
    key = ("topt", sharding_type, kernel, np.asarray(num_shards).tobytes() if np.ndim(num_shards) else num_shards)
    hit = ctx.cache.get(key)
    if hit is not None:
        return hit
    # the sequence lookups' latency floor: a table-wise (or sharded) table sees the sparse group's samples
    dp = sharding_type == "data_parallel"
    S = ctx.local_batch * (1 if dp else ctx.mesh.sparse_shard) / ctx.micro_batches
    k = num_shards if sharding_type in ("row_wise", "table_row_wise") else 1.0
    floor = seq_lookup_floor_s(ctx, S, k)
    out = _shared(ctx.workload, key + (ctx.mesh.sparse_shard, ctx.local_batch, ctx.micro_batches, ctx.emb_bw, floor.tobytes()),
                  lambda: option_costs(ctx.tables, sharding_type, num_shards, ctx.mesh.sparse_shard, ctx.local_batch,
                                       ctx.micro_batches, ctx.compute_bytes, ctx.emb_bw, kernel=kernel, fwd_floor_s=floor))
    if len(ctx.cache) < 4096:
        ctx.cache[key] = out
    return out


@dataclass(frozen=True, slots=True)
class TableOptionCost:
    """One table under one sharding option: per shard and per step (all micro-batches)."""

    table: str
    sharding_type: str
    num_shards: int
    fwd_s: float
    """Forward lookup time of one shard on its rank."""
    bwd_s: float
    """Backward + fused optimizer time of one shard."""
    memory_bytes: float
    """Weights + optimizer state of one shard."""
    weight_bytes: float
    optimizer_bytes: float
    a2a_send_bytes: float
    """Output all-to-all bytes the shard's rank sends forward (the same come back backward)."""
    a2a_recv_bytes_per_rank: float
    """Output all-to-all bytes every rank of the sparse group receives for this table."""
    ids_bytes_per_rank: float
    """Id bytes every rank sends forward."""
    ids_recv_bytes: float
    """Id bytes the shard's rank receives."""
    allreduce_bytes: float
    """data_parallel: gradient all-reduce bytes per rank (world group)."""


def table_option_cost(ctx: Context, table: str, sharding_type: str, num_shards: int = 1, *, kernel: str | None = None) -> TableOptionCost:
    """The cost of one table under one option (see :func:`table_option_costs` for all tables at once)."""
    i = ctx.tables.index.get(table)
    if i is None:
        raise CoplanError(f"'{table}' is not a table of workload '{ctx.workload.name}'")
    c = table_option_costs(ctx, sharding_type, num_shards, kernel=kernel)
    return TableOptionCost(
        table, sharding_type, int(c.num_shards[i]), float(c.fwd_s[i]), float(c.bwd_s[i]), float(c.memory_bytes[i]),
        float(c.weight_bytes[i]), float(c.optimizer_bytes[i]), float(c.send_bytes[i]), float(c.recv_bytes[i]),
        float(c.ids_send_bytes[i]), float(c.ids_recv_bytes[i]), float(c.allreduce_bytes[i]),
    )


__all__ = [
    "Context", "DenseFixedCosts", "LayerCost", "OpArrays", "Options", "TableOptionCost", "build_context",
    "dense_fixed_costs", "fp8_allowed", "fsdp_copy_bytes", "fp8_capable", "fp8_guard", "imbalance", "layer_costs", "op_arrays", "seq_cost", "table_option_cost", "table_option_costs",
]
