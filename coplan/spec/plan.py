"""Plan: the parallel plan, self-describing (it embeds the topology and workload it was made for).

The trainer needs nothing but this file. It carries the choices (mesh and its tier mapping,
FSDP/HSDP degrees, expert parallelism, per-table embedding sharding, per-layer recompute and
precision, balancing policy, kernel backends), the cost model's prediction, the solver's report,
the inputs' hashes and the coplan version.
"""

from __future__ import annotations

import math
from typing import Annotated, Literal

from pydantic import Field, ValidationInfo, field_validator, model_serializer, model_validator

from coplan.spec.base import drop_added_defaults, FROM_FILE, Bool, Float, Int, check_schema_version, SCHEMA_VERSION, Collective, OpClass, Spec, field_error
from coplan.spec.calibration import Calibration
from coplan.spec.hashing import spec_sha256
from coplan.spec.topology import Topology
from coplan.spec.workload import MAX_LOCAL_BATCH, Kernels, Precision, Workload

NonNeg = Annotated[Float, Field(ge=0)]
_REL, _ABS_S = 1e-6, 1e-12
"""Tolerances of the prediction's own sums (the pricer's floating-point rounding, nothing more)."""
PosInt = Annotated[Int, Field(gt=0)]

MeshAxisName = Literal["dp_replicate", "dp_shard", "ep", "sparse_replicate", "sparse_shard"]
ShardingType = Literal["table_wise", "row_wise", "column_wise", "table_row_wise", "data_parallel"]
SHARDING_TYPES: tuple[str, ...] = ("table_wise", "row_wise", "column_wise", "table_row_wise", "data_parallel")


class MeshAxis(Spec):
    """One DeviceMesh axis and the topology tiers its groups span."""

    name: MeshAxisName
    """Axis name ('axis' is a DeviceMesh axis; 'dim' a tensor dimension)."""

    size: PosInt
    """Ranks along the axis."""

    tiers: tuple[str, ...] = Field(min_length=1)
    """Tier names one group of this axis crosses, innermost first (['nvlink'] = stays in the NVLink domain)."""


class MeshPlan(Spec):
    """Degrees of each kind of parallelism. Ranks are laid out innermost-axis-fastest."""

    dense_shard: PosInt
    """FSDP shard degree of dense parameters (the inner mesh axis)."""

    dense_replicate: PosInt = 1
    """HSDP replicate degree; dense_shard × dense_replicate = world size."""

    expert_parallel: PosInt = 1
    """Expert-parallel degree: experts are split over this many ranks (an inner group of dense_shard ranks)."""

    sparse_shard: PosInt
    """Ranks one copy of the embedding tables is sharded over (TorchRec 2-D sparse parallelism's group)."""

    sparse_replicate: PosInt = 1
    """Copies of the sharded tables; sparse_shard × sparse_replicate = world size."""

    micro_batches: PosInt | None = None
    """Gradient-accumulation micro-batches per step this plan runs (the planner's choice where the
    workload says 'auto'); None: the workload's ``batch.micro_batches``."""

    axes: tuple[MeshAxis, ...] = ()
    """The axes with their tier mapping (filled by the planner; informative for the trainer)."""

    @property
    def world_size(self) -> int:
        return self.dense_shard * self.dense_replicate

    @model_validator(mode="after")
    def _products(self) -> "MeshPlan":
        w = self.dense_shard * self.dense_replicate
        if self.sparse_shard * self.sparse_replicate != w:
            raise field_error(
                "sparse_shard",
                f"sparse_shard × sparse_replicate = {self.sparse_shard * self.sparse_replicate} but "
                f"dense_shard × dense_replicate = {w}; both must equal the world size"
            )
        if w % self.expert_parallel:
            raise field_error("expert_parallel", f"{self.expert_parallel} must divide the world size {w}")
        return self


class TableShard(Spec):
    """How one embedding table is sharded within its sparse shard group."""

    table: str = Field(min_length=1)
    """Table name (from the workload)."""

    sharding_type: ShardingType
    """TorchRec sharding type."""

    ranks: tuple[Annotated[Int, Field(ge=0)], ...] = ()
    """Ranks within the sparse shard group holding the shards, in shard order (empty for data_parallel:
    every rank holds a copy). table_row_wise uses ranks of one node."""

    compute_kernel: Literal["fused", "dense"] = "fused"
    """FBGEMM fused TBE or a plain module."""

    @model_validator(mode="after")
    def _ranks(self) -> "TableShard":
        if self.sharding_type == "data_parallel":
            if self.ranks:
                raise field_error("ranks", "data_parallel tables are on every rank: leave 'ranks' empty")
        elif not self.ranks:
            raise field_error("ranks", f"{self.sharding_type} needs at least one rank")
        elif self.sharding_type == "table_wise" and len(self.ranks) != 1:
            raise field_error("ranks", f"table_wise puts the table on exactly one rank; got {len(self.ranks)}")
        if len(set(self.ranks)) != len(self.ranks):
            raise field_error("ranks", f"has repeats: {list(self.ranks)}")
        return self


class LayerPlan(Spec):
    """Per-layer choices."""

    name: str = Field(min_length=1)
    """Layer name '<block>.<layer index>' as in op names (e.g. 'interformer.3')."""

    recompute: Bool = False
    """Activation checkpointing: keep only the layer input, recompute the rest in backward."""

    precision: Literal["bf16", "fp8"] = "bf16"
    """GEMM precision of this layer's linear layers."""


class LayerPrecisionChoice(Spec):
    """The planner's precision decision for one layer, with the times it compared."""

    name: str = Field(min_length=1)
    """Layer name '<block>.<layer index>'."""

    precision: Literal["bf16", "fp8"]
    """What the layer runs in."""

    bf16_s: NonNeg
    """Predicted compute of the layer per step (forward + backward + recompute) with bf16 GEMMs."""

    fp8_s: NonNeg
    """The same with its allowed GEMMs in fp8, quantisation passes included."""

    reason: str
    """Why: 'pays', 'slower in fp8', 'forced', 'guard: ...' (numerics), 'no fp8 GEMM', 'fp8 off'."""


class PrecisionReport(Spec):
    """What choosing per-layer precision predicted (written by the planner when ``precision.fp8`` is not 'off')."""

    mode: Literal["off", "auto", "force"]
    """The workload's ``precision.fp8``."""

    recipe: Literal["rowwise", "blockwise", "blockwise-fused", "torchao-tensorwise", "torchao-rowwise"]
    """The FP8 scaling recipe."""

    layers: tuple[LayerPrecisionChoice, ...] = ()
    """Per layer, in execution order."""

    bf16_step_time_s: NonNeg
    """Predicted step time of the same plan with every layer in bf16."""

    step_time_s: NonNeg
    """Predicted step time with the chosen precisions."""

    @property
    def gain(self) -> float:
        """Predicted relative step-time reduction (0.05: 5% faster)."""
        return 1.0 - self.step_time_s / self.bf16_step_time_s if self.bf16_step_time_s > 0 else 0.0

    @property
    def fp8_layers(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.layers if c.precision == "fp8")


class BalancingPlan(Spec):
    """How each global batch of jagged samples is split across ranks."""

    policy: Literal["none", "greedy", "karmarkar_karp"] = "greedy"
    """'none' splits in order; 'greedy' is longest-processing-time first; 'karmarkar_karp' the
    multi-way largest differencing method."""

    expected_imbalance: Annotated[Float, Field(ge=1)] = 1.0
    """Expected max/mean per-rank cost of the jagged work under this policy (priced by the cost model)."""

    group_ranks: Annotated[Int, Field(gt=0)] | None = None
    """Ranks that balance one slice of the global batch together; each of them decodes that slice's rows
    (``coplan.trainer.data.BatchReader``). Larger groups balance better and read more: the planner prices both
    (the jagged imbalance between groups, the data loader's rows) and picks. None: the ranks of one node (at
    most the world). Written only when given (plans from before it keep their hashes)."""

    @model_serializer(mode="wrap")
    def _without_added_defaults(self, handler):
        return drop_added_defaults(handler(self), {"group_ranks": None})


class OpPrediction(Spec):
    """Predicted time of one op on the critical (slowest) rank."""

    name: str
    """'<block>.<layer index>.<op>', e.g. 'interformer.3.gdpa_fwd'."""

    op_class: OpClass
    """Op class."""

    phase: Literal["fwd", "bwd", "recompute", "optimizer"]
    """Where in the step the op runs."""

    time_s: NonNeg
    """Predicted time, seconds."""

    flops: NonNeg = 0.0
    """FLOPs on that rank."""

    bytes: NonNeg = 0.0
    """HBM bytes moved on that rank."""


class CommPrediction(Spec):
    """Predicted time of one collective."""

    name: str
    """e.g. 'fsdp.all_gather', 'sparse.all_to_all_fwd', 'moe.0.all_to_all_dispatch'."""

    collective: Collective
    """Collective kind."""

    group_size: PosInt
    """Ranks in the process group."""

    tiers: tuple[str, ...] = ()
    """Tiers the group crosses."""

    bytes: NonNeg
    """Payload per rank, bytes."""

    time_s: NonNeg
    """Time of the collective alone, seconds."""

    exposed_s: NonNeg
    """Part not hidden behind compute, seconds."""

    phase: Literal["fwd", "bwd", "optimizer"] = "fwd"
    """Where in the step it runs."""

    calls: PosInt = 1
    """Calls of this collective per step (micro-batches, forward and backward gathers); ``time_s``
    and ``exposed_s`` are summed over them, ``bytes`` is the size of one call."""


class Prediction(Spec):
    """The cost model's prediction for a plan."""

    step_time_s: NonNeg
    """Predicted step time (max over ranks)."""

    compute_s: NonNeg
    """Compute time on the critical rank (recompute included)."""

    exposed_comm_s: NonNeg
    """Communication not hidden by compute on the critical rank."""

    imbalance_s: NonNeg = 0.0
    """Extra time of the slowest rank over the mean rank from jagged load imbalance."""

    unpriced_device_s: NonNeg = 0.0
    """Step time added by the calibration's device-step factor: device work no priced op accounts for (0: none,
    or the host's time sets the step)."""

    model_flops_per_step: NonNeg
    """Model FLOPs of one step over all ranks (no recompute, real lengths)."""

    local_mfu: NonNeg
    """MFU of the critical rank's compute alone: model FLOPs / (compute time × GPUs × peak)."""

    scaling_ratio: NonNeg
    """local MFU → MFU lost to communication and imbalance: compute time / step time."""

    e2e_mfu: NonNeg
    """Model FLOPs / (step time × GPUs × dense bf16 peak) = local MFU × scaling ratio."""

    goodput: NonNeg = 1.0
    """Fraction of wall time making progress after checkpoints, failures, stragglers and jitter."""

    step_jitter: NonNeg = 0.0
    """Expected relative stretch of a step by its slowest rank (stragglers and jitter; in ``goodput``).
    Written only when not 0, so that plans from before it keep their hashes."""

    host_s: NonNeg = 0.0
    """The host's time per step when the host is priced (a calibration's host costs): the step is at least this.
    Written only when not 0 (plans from before it keep their hashes)."""

    loader_s: NonNeg = 0.0
    """The data loader's time per step on the critical rank (``coplan.costmodel.loader``): the step is at least
    this. Written only when not 0."""

    device_s: NonNeg = 0.0
    """The device's step when the host or the loader sets the step (longer than the device's); 0 when the device
    sets it. Written only when not 0."""

    goodput_mfu: NonNeg = 0.0
    """E2E MFU × goodput."""

    checkpoint_interval_s: NonNeg = 0.0
    """Young/Daly optimal checkpoint interval."""

    checkpoint_write_s: NonNeg = 0.0
    """Time to write one checkpoint."""

    ops: tuple[OpPrediction, ...] = ()
    """Per-op compute times on the critical rank."""

    comms: tuple[CommPrediction, ...] = ()
    """Per-collective times."""

    memory_bytes: dict[str, NonNeg] = Field(default_factory=dict)
    """Memory of the fullest rank by kind (parameters, gradients, optimizer, activations, embeddings...)."""

    peak_memory_bytes: NonNeg = 0.0
    """Sum of memory_bytes."""

    hbm_capacity_bytes: NonNeg = 0.0
    """HBM of one GPU."""

    rank_time_s: tuple[NonNeg, ...] = ()
    """Per-rank step time (all ranks, or a sample of extremes for large worlds: see rank_ids)."""

    rank_ids: tuple[Annotated[Int, Field(ge=0)], ...] = ()
    """The ranks rank_time_s refers to."""

    imbalance: Annotated[Float, Field(ge=1)] = 1.0
    """Expected max/mean per-rank jagged work under the plan's balancing policy."""

    breakdown_s: dict[str, NonNeg] = Field(default_factory=dict)
    """Critical rank's step split by phase and kind (fwd/bwd compute, recompute, optimizer, fwd/bwd
    communication and the exposed part of each), seconds; compute + exposed = step_time_s."""

    layer_time_s: dict[str, NonNeg] = Field(default_factory=dict)
    """Compute + exposed communication per layer ('<block>.<index>', 'sparse', 'optimizer'), seconds."""

    memory_headroom_bytes: Float = 0.0
    """usable HBM (capacity less the topology's reserve) − peak_memory_bytes (negative when the plan does not fit)."""

    hbm_reserve_bytes: NonNeg = 0.0
    """HBM the topology holds back (``gpu.hbm_reserve_fraction``): no plan fills it."""

    rank_memory_bytes: tuple[NonNeg, ...] = ()
    """Memory of the ranks in rank_ids."""

    notes: tuple[str, ...] = ()
    """What the cost model approximated for this plan."""

    @model_validator(mode="after")
    def _coherent(self) -> "Prediction":
        # the pricer writes these together; a value moved between fields by hand breaks one of them
        step = self.step_time_s
        for name in ("compute_s", "exposed_comm_s"):
            if getattr(self, name) > step * (1 + _REL) + _ABS_S:
                raise field_error(name, f"{getattr(self, name):g} s exceeds step_time_s={step:g} s (part of the step "
                                  "cannot be longer than the step); re-plan rather than edit predictions")
        if self.scaling_ratio > 1 + _REL:
            raise field_error("scaling_ratio", f"{self.scaling_ratio:g} exceeds 1 (it is compute time / step time)")
        if abs(self.local_mfu * self.scaling_ratio - self.e2e_mfu) > 1e-3 * max(self.e2e_mfu, 1e-9) + 1e-9:
            raise field_error("e2e_mfu", f"{self.e2e_mfu:g} is not local_mfu × scaling_ratio = "
                              f"{self.local_mfu * self.scaling_ratio:g}; re-plan rather than edit predictions")
        if self.memory_bytes and not math.isclose(self.peak_memory_bytes, sum(self.memory_bytes.values()), rel_tol=1e-6, abs_tol=1.0):
            raise field_error("peak_memory_bytes", f"{self.peak_memory_bytes:g} is not the sum of memory_bytes "
                              f"({sum(self.memory_bytes.values()):g})")
        if len(self.rank_time_s) != len(self.rank_ids):
            raise field_error("rank_time_s", f"has {len(self.rank_time_s)} entries but rank_ids has {len(self.rank_ids)}")
        if self.rank_memory_bytes and len(self.rank_memory_bytes) != len(self.rank_ids):
            raise field_error("rank_memory_bytes", f"has {len(self.rank_memory_bytes)} entries but rank_ids has {len(self.rank_ids)}")
        if len(set(self.rank_ids)) != len(self.rank_ids):
            raise field_error("rank_ids", "has repeats")
        return self

    @model_serializer(mode="wrap")
    def _without_added_defaults(self, handler):
        return drop_added_defaults(handler(self), {"step_jitter": 0.0, "host_s": 0.0, "loader_s": 0.0, "device_s": 0.0})


class SolverReport(Spec):
    """What CP-SAT said."""

    status: Literal["OPTIMAL", "FEASIBLE", "INFEASIBLE", "MODEL_INVALID", "UNKNOWN", "HEURISTIC", "GIVEN"]
    """CP-SAT status of the chosen plan ('HEURISTIC' when the simulate heuristic's plan won or no solver
    ran; 'GIVEN' for a plan whose every choice was given, e.g. a single-process plan)."""

    objective_us: NonNeg = 0.0
    """The plan's priced step time (the cost model's full pricer), microseconds."""

    best_bound_us: NonNeg = 0.0
    """Best proven lower bound on the priced step of any plan of this search (pins included), microseconds."""

    gap: NonNeg = 0.0
    """(objective − bound) / objective."""

    model_objective_us: NonNeg = 0.0
    """What CP-SAT's model (the piecewise-linear step, one cut per critical path of the pricer's
    schedule) says of the returned plan, microseconds; the priced step agrees within a few percent."""

    cut_rounds: Annotated[Int, Field(ge=0)] = 0
    """Re-solves of the chosen candidate after a priced plan added a cut (0: the first solution's price
    already agreed with the model)."""

    pins: tuple[str, ...] = ()
    """Choices the user fixed (``--pin AXIS=N``, ``--pin-table NAME=SHARDING``), as given."""

    wall_s: NonNeg = 0.0
    """Solver wall time over all candidates, seconds."""

    num_workers: PosInt = 1
    """CP-SAT search workers."""

    seed: Int = 0
    """Random seed (plans are deterministic for a seed)."""

    candidates_total: Annotated[Int, Field(ge=0)] = 0
    """Mesh candidates enumerated."""

    candidates_solved: Annotated[Int, Field(ge=0)] = 0
    """Candidates left after pruning and solved."""

    notes: tuple[str, ...] = ()
    """What the search left undone (e.g. it stopped at ``--time-limit``); left out of the file when empty."""

    @model_serializer(mode="wrap")
    def _without_empty_notes(self, handler):
        out = handler(self)
        if isinstance(out, dict) and not out.get("notes"):
            out.pop("notes", None)
        return out

    @model_validator(mode="after")
    def _coherent(self) -> "SolverReport":
        if self.gap > 1:
            raise field_error("gap", f"{self.gap:g} exceeds 1 (it is (objective − bound) / objective)")
        if self.candidates_solved > self.candidates_total:
            raise field_error("candidates_solved", f"{self.candidates_solved} exceeds candidates_total={self.candidates_total}")
        return self


class Alternative(Spec):
    """A plan the search priced and did not return, and why it lost."""

    kind: Literal["mesh", "sharding", "recompute", "micro_batches", "heuristic", "infeasible"]
    """What differs from the returned plan: another mesh candidate, a runner-up table sharding or
    recompute set of the same mesh, another micro-batch count, the simulate heuristic's plan, or a
    candidate that does not fit."""

    mesh: str
    """Mesh candidate key, e.g. 'fsdp128x32-ep64-sp512x8' (with '-mb4' for 4 micro-batches)."""

    description: str
    """What this alternative is, in a few words."""

    step_time_s: Annotated[Float, Field(ge=0)] | None = None
    """Its priced step time (None: not priced in full; see ``bound_s``)."""

    bound_s: NonNeg = 0.0
    """Proven lower bound of its step time (for candidates pruned by their bound)."""

    peak_memory_bytes: NonNeg = 0.0
    """Its fullest rank's memory (0 when unknown)."""

    why: str
    """Why it lost, with numbers: slower by x ms (which parts), or does not fit (which resource, by how much)."""


class Plan(Spec):
    """A parallel plan for one workload on one topology at one world size."""

    schema_version: Int = SCHEMA_VERSION
    """Version of the plan schema."""

    coplan_version: str = ""
    """coplan version that wrote the plan."""

    created_utc: str = ""
    """ISO-8601 time of planning."""

    topology: Topology
    """The topology planned for (embedded: a plan is self-describing)."""

    workload: Workload
    """The workload planned (embedded)."""

    calibration: Calibration | None = None
    """Calibration used by the cost model, if any."""

    topology_sha256: str = ""
    """Hash of ``topology``; a mismatch means the file was edited by hand."""

    workload_sha256: str = ""
    """Hash of ``workload``."""

    world_size: PosInt
    """GPUs (ranks) of the run."""

    mesh: MeshPlan
    """Parallelism degrees and tier mapping."""

    tables: tuple[TableShard, ...] = ()
    """Sharding of every embedding table."""

    layers: tuple[LayerPlan, ...] = ()
    """Per-layer recompute and precision."""

    balancing: BalancingPlan = BalancingPlan()
    """Jagged-batch balancing."""

    kernels: Kernels = Kernels()
    """Kernel backends."""

    precision: Precision = Precision()
    """Numerics (from the workload, possibly refined by the planner)."""

    predicted: Prediction | None = None
    """The cost model's prediction."""

    precision_report: PrecisionReport | None = None
    """The planner's per-layer bf16/fp8 choice and its predicted gain (None when fp8 is off)."""

    solver: SolverReport | None = None
    """The solver's report."""

    alternatives: tuple[Alternative, ...] = ()
    """The best few plans the search priced and did not return (other mesh candidates, runner-up
    sharding and recompute choices, the heuristic's plan), best first, with why each lost."""

    @property
    def micro_batches(self) -> int:
        """Gradient-accumulation micro-batches per step this plan runs."""
        if self.mesh.micro_batches is not None:
            return self.mesh.micro_batches
        return self.workload.batch.fixed_micro_batches or 1

    @field_validator("schema_version")
    @classmethod
    def _schema(cls, v: int) -> int:
        return check_schema_version(v, '; re-plan')

    @model_validator(mode="after")
    def _consistent(self, info: ValidationInfo) -> "Plan":
        if self.world_size > self.topology.num_gpus:
            raise field_error("world_size", f"{self.world_size} exceeds the {self.topology.num_gpus} GPUs of topology '{self.topology.name}'")
        if self.mesh.world_size != self.world_size:
            raise field_error("mesh", f"covers {self.mesh.world_size} ranks but world_size is {self.world_size}")
        if self.topology_sha256 and self.topology_sha256 != spec_sha256(self.topology):
            raise field_error("topology_sha256", "does not match the embedded topology (edited by hand?); re-plan")
        if self.workload_sha256 and self.workload_sha256 != spec_sha256(self.workload):
            raise field_error("workload_sha256", "does not match the embedded workload (edited by hand?); re-plan")
        b = self.workload.batch
        if not b.splits(self.world_size):
            raise field_error("world_size", f"global batch {b.global_batch_size:,} does not split evenly over {self.world_size:,} ranks; re-plan")
        fixed = b.fixed_micro_batches
        if self.mesh.micro_batches is not None and fixed is not None and self.mesh.micro_batches != fixed:
            raise field_error("mesh.micro_batches", f"{self.mesh.micro_batches} but the workload asks for {fixed}; re-plan")
        local = b.local_batch_size or b.global_(self.world_size) // self.world_size
        if local > MAX_LOCAL_BATCH:
            raise field_error("world_size", f"{self.world_size:,} ranks give {local:,} samples per GPU, over coplan's limit "
                              f"of {MAX_LOCAL_BATCH:,}; re-plan on more GPUs")
        if local % self.micro_batches:
            raise field_error("mesh.micro_batches", f"{self.micro_batches} micro-batches do not split the local batch of {local} evenly")
        g = self.balancing.group_ranks
        if g is not None and (g > self.world_size or self.world_size % g):
            raise field_error("balancing.group_ranks", f"{g} does not divide the {self.world_size:,} ranks into balance groups; "
                              "give a divisor of world_size (or leave it out: a node's ranks)")
        _check_tables(self, from_file=bool(info.context and info.context.get(FROM_FILE)))
        _check_mesh_axes(self)
        _check_prediction(self)
        if self.calibration is not None:
            unknown = self.calibration.unknown_tiers(self.topology)
            if unknown:
                raise field_error("calibration.collective_efficiency", f"names tiers {unknown} that the embedded topology "
                                  f"does not have (its tiers: {[t.name for t in self.topology.tiers]}); re-plan")
        return self

    @property
    def num_nodes(self) -> int:
        return max(1, math.ceil(self.world_size / self.topology.gpus_per_node))


def _check_tables(plan: Plan, from_file: bool) -> None:
    """Every table of the workload sharded exactly once, on ranks of the sparse shard group.

    A plan built in Python may leave ``tables`` empty: the cost model then prices its default sharding.
    A plan file may not: the trainer would run it with no table sharded."""
    tables = [t.name for t in plan.workload.all_tables]
    known = set(tables)
    if not plan.tables and not from_file:
        return
    if tables and not plan.tables:
        raise field_error("tables", f"is empty, but workload '{plan.workload.name}' has {len(tables):,} tables (e.g. "
                          f"{tables[:3]}) and each needs a sharding; re-plan (`coplan plan`) rather than delete them")
    seen: set[str] = set()
    for i, ts in enumerate(plan.tables):
        if ts.table not in known:
            raise field_error(f"tables[{i}].table", f"'{ts.table}' is not a table of workload '{plan.workload.name}'")
        if ts.table in seen:
            raise field_error(f"tables[{i}].table", f"'{ts.table}' is sharded twice")
        seen.add(ts.table)
        bad = [r for r in ts.ranks if r >= plan.mesh.sparse_shard]
        if bad:
            raise field_error(f"tables[{i}].ranks", f"{bad} are outside the sparse shard group of {plan.mesh.sparse_shard} ranks")
    if len(seen) != len(known):
        missing = [t for t in tables if t not in seen][:5]
        raise field_error("tables", f"{len(known) - len(seen):,} tables of workload '{plan.workload.name}' have no "
                          f"sharding, e.g. {missing}; re-plan")
    layer_names = [lp.name for lp in plan.layers]
    dup = sorted({n for n in layer_names if layer_names.count(n) > 1})
    if dup:
        raise field_error("layers", f"names layers more than once: {dup[:5]}")


_AXIS_DEGREE = {"dp_shard": "dense_shard", "dp_replicate": "dense_replicate", "ep": "expert_parallel",
                "sparse_shard": "sparse_shard", "sparse_replicate": "sparse_replicate"}
"""The MeshPlan degree each mesh axis stands for."""


def _check_mesh_axes(plan: Plan) -> None:
    tiers = {t.name for t in plan.topology.tiers}
    names = [a.name for a in plan.mesh.axes]
    for i, axis in enumerate(plan.mesh.axes):
        if names.count(axis.name) > 1:
            raise field_error(f"mesh.axes[{i}].name", f"'{axis.name}' appears more than once")
        degree = getattr(plan.mesh, _AXIS_DEGREE[axis.name])
        if axis.size != degree:
            raise field_error(f"mesh.axes[{i}].size", f"{axis.size} but mesh.{_AXIS_DEGREE[axis.name]} is {degree}")
        unknown = [t for t in axis.tiers if t not in tiers]
        if unknown:
            raise field_error(f"mesh.axes[{i}].tiers", f"{unknown} are not tiers of topology '{plan.topology.name}' "
                              f"(its tiers: {[t.name for t in plan.topology.tiers]})")


def _check_prediction(plan: Plan) -> None:
    """The prediction belongs to this plan: per-op detail present, ranks and groups within the world."""
    pred = plan.predicted
    if pred is None:
        return
    if not pred.ops:
        raise field_error("predicted.ops", "is empty: a plan's prediction lists the ops it priced (the trainer's "
                          "checks and the reports read them); re-plan rather than edit predictions")
    bad = [r for r in pred.rank_ids if r >= plan.world_size]
    if bad:
        raise field_error("predicted.rank_ids", f"{bad[:5]} are not ranks of a {plan.world_size}-rank world")
    tiers = {t.name for t in plan.topology.tiers}
    for i, c in enumerate(pred.comms):
        if c.group_size > plan.world_size:
            raise field_error(f"predicted.comms[{i}].group_size", f"{c.group_size} exceeds world_size={plan.world_size}")
        unknown = [t for t in c.tiers if t not in tiers]
        if unknown:
            raise field_error(f"predicted.comms[{i}].tiers", f"{unknown} are not tiers of topology '{plan.topology.name}'")
    hbm = plan.topology.gpu.hbm_bytes
    if pred.hbm_capacity_bytes and not math.isclose(pred.hbm_capacity_bytes, hbm, rel_tol=1e-9):
        raise field_error("predicted.hbm_capacity_bytes", f"{pred.hbm_capacity_bytes:g} is not the topology's "
                          f"gpu.hbm_bytes={hbm:g}")
