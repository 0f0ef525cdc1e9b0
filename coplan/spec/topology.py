"""Topology: the GPU and the network tiers it sits in, innermost first.

A tier groups ``size`` units of the tier below it (the first tier groups GPUs). Bandwidths are per
GPU and per direction, so an NVLink 4 port sold as 900 GB/s bidirectional is 450e9 here.
"""

from __future__ import annotations

import math
from typing import Annotated

from pydantic import Field, field_validator, model_serializer, model_validator

from coplan.spec.base import drop_added_defaults, plausible, Bool, Float, Int, check_schema_version, COLLECTIVES, SCHEMA_VERSION, Collective, Dtype, Spec, field_error

MAX_GPUS = 1 << 20
"""Most GPUs a topology may hold (1,048,576; the largest clusters built hold ~10^5). The planner
enumerates meshes over the GPU count's divisors and prices per-rank figures; far above this it does
no useful work in useful time, so the load refuses instead."""

PositiveFloat = Annotated[Float, Field(gt=0)]
Fraction = Annotated[Float, Field(gt=0, le=1)]

# Plausibility bounds: orders of magnitude beyond any real hardware both ways (H200: 989e12 bf16 FLOP/s,
# 141e9 B of HBM at 4.8e12 B/s; links 1e9-1e12 B/s), so that no realistic figure is refused while unit slips
# (989 for 989 TFLOP/s, 141 for 141 GB) and absurd values, which would overflow the planner's integers, are.
FlopsPerS = Annotated[Float, Field(gt=0), plausible(
    1e9, 1e19, "FLOP/s", "FLOP per second", "accelerator's peak",
    slips=((1e12, "TFLOP/s"), (1e15, "PFLOP/s"), (1e9, "GFLOP/s")), typical=(1e11, 1e17))]
HbmBytes = Annotated[Float, Field(gt=0), plausible(
    1e8, 1e14, "B", "bytes", "accelerator's memory", slips=((1e9, "GB"), (1e12, "TB"), (1e6, "MB")), typical=(1e9, 1e13))]
HbmBw = Annotated[Float, Field(gt=0), plausible(
    1e9, 1e15, "B/s", "bytes per second", "accelerator memory's bandwidth",
    slips=((1e12, "TB/s"), (1e9, "GB/s")), typical=(1e10, 1e14))]
LinkBw = Annotated[Float, Field(gt=0), plausible(
    1e6, 1e20, "B/s", "bytes per second", "link", slips=((1e9, "GB/s"), (1e6, "MB/s"), (1e12, "TB/s")), typical=(1e8, 1e13))]
StorageBw = Annotated[Float, Field(gt=0), plausible(
    1e6, 1e18, "B/s", "bytes per second", "storage bandwidth", slips=((1e9, "GB/s"), (1e6, "MB/s")), typical=(1e8, 1e15))]
MtbfHours = Annotated[Float, Field(gt=0), plausible(0.1, 1e12, "h", "hours", "mean time between failures")]
CollectiveEfficiency = Annotated[Float, Field(gt=0, le=1), plausible(
    1e-3, 1.0, "", "a fraction of the bus bandwidth (0.001-1)", "collective efficiency")]


class GpuSpec(Spec):
    """One accelerator."""

    name: str = Field(min_length=1)
    """Marketing name, e.g. 'NVIDIA H200 SXM'; calibrations are matched against it."""

    peak_flops_per_s: dict[Dtype, FlopsPerS]
    """Datasheet dense (no sparsity) peak FLOP/s per dtype. MFU is quoted against ``bf16``."""

    measured_flops_per_s: dict[Dtype, FlopsPerS] = Field(default_factory=dict)
    """Large-GEMM FLOP/s measured on this GPU per dtype, when known; informs default efficiencies."""

    hbm_bytes: HbmBytes
    """HBM capacity in bytes (datasheet)."""

    hbm_bw_bytes_per_s: HbmBw
    """HBM bandwidth in bytes/s (datasheet)."""

    measured_hbm_bw_bytes_per_s: HbmBw | None = None
    """Device-to-device copy bandwidth measured (read + write bytes over time), when known."""

    hbm_reserve_fraction: Annotated[Float, Field(ge=0, lt=0.5)] = 0.08
    """Share of HBM no plan may use, held back for what the cost model does not itemise: the caching
    allocator's fragmentation (PyTorch's reserved-minus-allocated runs at 3-10% of the pool in steady
    training: PyTorch "CUDA semantics: memory management" docs and ``torch.cuda.memory_stats``
    readings), the CUDA context with cuBLAS/cuDNN workspaces and loaded kernels (0.5-1.5 GiB) and NCCL's
    internal state beyond the per-communicator buffers the cost model prices. Default 8% (~11 GB of an
    H200): 5% fragmentation + ~1 GiB context + ~2 GiB NCCL and workspaces. Plans keep every rank at or
    under ``hbm_bytes × (1 − hbm_reserve_fraction)``."""

    num_sms: Int = Field(default=132, gt=0)
    """Streaming multiprocessors; collectives that run on SMs take some of them from compute."""

    @property
    def usable_hbm_bytes(self) -> float:
        """HBM a plan may fill: capacity less the reserve."""
        return self.hbm_bytes * (1.0 - self.hbm_reserve_fraction)

    @field_validator("peak_flops_per_s")
    @classmethod
    def _needs_bf16(cls, v: dict[str, float]) -> dict[str, float]:
        if "bf16" not in v:
            raise ValueError("must give a 'bf16' peak: MFU is quoted against the dense bf16 peak")
        return v


class Tier(Spec):
    """One level of the network: NVLink domain, rack/leaf switch, spine, core..."""

    name: str = Field(min_length=1, pattern=r"^[a-z][a-z0-9_]*$")
    """Short identifier used in plans and reports, e.g. 'nvlink', 'leaf', 'spine'."""

    size: Int = Field(gt=0, le=MAX_GPUS)
    """How many units of the tier below this one groups (GPUs for the first tier)."""

    bw_bytes_per_s: LinkBw
    """Bandwidth one GPU can drive across this tier, per direction, in bytes/s (before sharing)."""

    latency_s: Annotated[Float, Field(ge=0, le=1)]
    """One-way latency of a message crossing this tier, in seconds (the alpha term; networks run at µs, so
    over 1 s is a unit slip, e.g. microseconds written as seconds)."""

    oversubscription: Annotated[Float, Field(ge=1), plausible(1, 1e3, "", "a ratio (7 means 1:7)", "switch's oversubscription")] = 1.0
    """Ratio of downlink to uplink capacity of this tier's switches (1 = non-blocking; 7 = 1:7)."""

    gpus_per_nic: Int = Field(default=1, gt=0)
    """GPUs sharing one NIC or uplink port to this tier; their traffic splits its bandwidth."""

    collective_efficiency: dict[Collective, CollectiveEfficiency] = Field(default_factory=dict)
    """Fraction of the alpha-beta bus bandwidth a collective reaches on this tier (missing = 1.0 × the
    cost model's default)."""

    in_switch_reduction: Bool = False
    """The switches reduce in-network (NVLink SHARP / InfiniBand SHARP): all-reduce moves ~half the bytes."""

    sm_free_comm: Bool = False
    """Communication on this tier runs on copy engines or the NIC without taking SMs from compute."""

    mtbf_hours: MtbfHours | None = None
    """Mean time between failures of one switch of this tier, in hours, when it is worth modelling."""

    def efficiency(self, collective: Collective) -> float:
        return self.collective_efficiency.get(collective, 1.0)


class Reliability(Spec):
    """Failure and checkpoint figures for the goodput model."""

    gpu_mtbf_hours: MtbfHours
    """Mean time between failures of one GPU (with its host share), in hours."""

    restart_s: Annotated[Float, Field(ge=0, le=1e7)] = 600.0
    """Time to detect a failure, restart the job and reload the checkpoint, in seconds."""

    checkpoint_bw_bytes_per_s_per_node: StorageBw
    """Bandwidth one node writes checkpoints to storage at, in bytes/s."""

    checkpoint_aggregate_bw_bytes_per_s: StorageBw | None = None
    """Ceiling of the storage system as a whole, in bytes/s; writes from all nodes share it."""


class Topology(Spec):
    """A cluster: one GPU type and the tiers of network it sits in."""

    schema_version: Int = SCHEMA_VERSION
    """Version of the topology schema this file follows."""

    name: str = Field(min_length=1)
    """Preset or cluster name."""

    description: str = ""
    """One line on what this cluster is."""

    gpu: GpuSpec
    """The accelerator on every rank."""

    gpus_per_node: Int = Field(gt=0, le=MAX_GPUS)
    """GPUs in one host; must divide or be a multiple of the first tier's size."""

    cpu_cores_per_node: Annotated[Int, Field(gt=0, le=4096)] | None = None
    """CPU cores of one host (as ``os.cpu_count()`` counts them), when known: they set how many data-reader
    processes each rank runs (``coplan.costmodel.loader.reader_processes``). None: the trainer's most, 8.
    Written only when given (topologies from before it keep their hashes)."""

    tiers: tuple[Tier, ...] = Field(min_length=1)
    """Network tiers from the innermost (NVLink) out. Their sizes multiply to the GPU count."""

    reliability: Reliability
    """Failure rates and checkpoint bandwidth."""

    @model_serializer(mode="wrap")
    def _without_added_defaults(self, handler):
        return drop_added_defaults(handler(self), {"cpu_cores_per_node": None})

    @field_validator("schema_version")
    @classmethod
    def _schema(cls, v: int) -> int:
        return check_schema_version(v)

    @model_validator(mode="after")
    def _tiers_consistent(self) -> "Topology":
        names = [t.name for t in self.tiers]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise field_error("tiers", f"tier names must be unique; repeated: {dupes}")
        if self.num_gpus > MAX_GPUS:
            sizes = " × ".join(str(t.size) for t in self.tiers)
            raise field_error("tiers", f"the tier sizes {sizes} make {self.num_gpus:,} GPUs, over coplan's limit of "
                              f"{MAX_GPUS:,} (MAX_GPUS); model a smaller cluster (plans use at most the GPUs asked for)")
        first = self.tiers[0].size
        if first % self.gpus_per_node and self.gpus_per_node % first:
            raise field_error(
                "gpus_per_node",
                f"gpus_per_node={self.gpus_per_node} and tiers[0].size={first} must divide one another "
                "(a node cannot be split across NVLink domains unevenly)"
            )
        for i, tier in enumerate(self.tiers):
            below = self.gpus_below(i)
            if tier.gpus_per_nic > below * tier.size:
                raise field_error(f"tiers[{i}].gpus_per_nic", f"{tier.gpus_per_nic} exceeds the {below * tier.size} GPUs in one '{tier.name}' group")
            if (below * tier.size) % tier.gpus_per_nic:
                raise field_error(
                    f"tiers[{i}].gpus_per_nic",
                    f"{tier.gpus_per_nic} does not divide the {below * tier.size} GPUs of one '{tier.name}' group "
                    "(tier sizes must be whole multiples of the GPUs sharing a NIC)",
                )
        return self

    @property
    def num_gpus(self) -> int:
        return math.prod(t.size for t in self.tiers)

    def gpus_below(self, tier_index: int) -> int:
        """GPUs in one unit of the tier below ``tier_index`` (1 for the first tier)."""
        return math.prod(t.size for t in self.tiers[:tier_index])

    def gpus_within(self, tier_index: int) -> int:
        """GPUs in one group of tier ``tier_index``."""
        return math.prod(t.size for t in self.tiers[: tier_index + 1])

    def tier_index(self, name: str) -> int:
        for i, t in enumerate(self.tiers):
            if t.name == name:
                return i
        raise KeyError(name)

    @property
    def dense_peak_flops_per_s(self) -> float:
        return self.gpu.peak_flops_per_s["bf16"]


__all__ = ["COLLECTIVES", "MAX_GPUS", "GpuSpec", "Reliability", "Tier", "Topology"]
