"""Mesh candidates: every factorisation of the world into dense (HSDP × EP) and sparse (shard group ×
replica) degrees. Each axis's tier mapping (which tiers its process groups cross) is the cost
model's placement of the group (``coplan.costmodel.place_group``), so plans and prices agree.

Ranks are laid out innermost-axis-fastest and fill the topology innermost-tier-first, so rank ``r``
sits in NVLink domain ``r // tiers[0].size``. The shard axes are the inner ones (``dp_shard`` inside
``dp_replicate``, ``ep`` an inner group of ``dp_shard``; ``sparse_shard`` inside
``sparse_replicate``): the collectives that run every layer or every step (FSDP all-gather and
reduce-scatter, embedding all-to-all) get the contiguous, innermost ranks, and an axis that fits in
an NVLink domain stays in it. The replicate axes, which talk once per step (gradient all-reduce), take
what is left: strided groups across the outer tiers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator

from coplan.costmodel import place_group
from coplan.costmodel.context import local_batch_of
from coplan.errors import BatchError, CoplanError
from coplan.spec import MeshAxis, MeshPlan, Topology, Workload
from coplan.spec.workload import MoEBlock, batch_split_error


def divisors(n: int) -> list[int]:
    out: list[int] = []
    for d in range(1, int(math.isqrt(n)) + 1):
        if n % d == 0:
            out.append(d)
            if d != n // d:
                out.append(n // d)
    return sorted(out)


@dataclass(frozen=True, slots=True)
class MeshCandidate:
    """One factorisation of the world. ``dense_shard × dense_replicate = sparse_shard × sparse_replicate = world``."""

    world_size: int
    """Ranks."""

    dense_shard: int
    """FSDP shard degree (inner axis)."""

    expert_parallel: int
    """Expert-parallel degree: an inner group of ``dense_shard``."""

    sparse_shard: int
    """Ranks one copy of the embedding tables is sharded over (inner axis)."""

    micro_batches: int = 1
    """Gradient-accumulation micro-batches per step."""

    @property
    def dense_replicate(self) -> int:
        return self.world_size // self.dense_shard

    @property
    def sparse_replicate(self) -> int:
        return self.world_size // self.sparse_shard

    @property
    def key(self) -> str:
        mb = f"-mb{self.micro_batches}" if self.micro_batches > 1 else ""
        return f"fsdp{self.dense_shard}x{self.dense_replicate}-ep{self.expert_parallel}-sp{self.sparse_shard}x{self.sparse_replicate}{mb}"

    def axis(self, name: str) -> int:
        """The size of mesh axis ``name`` (or ``micro_batches``)."""
        return {"dp_shard": self.dense_shard, "dp_replicate": self.dense_replicate, "ep": self.expert_parallel,
                "sparse_shard": self.sparse_shard, "sparse_replicate": self.sparse_replicate,
                "micro_batches": self.micro_batches}[name]


PINNABLE = ("dp_shard", "dp_replicate", "ep", "sparse_shard", "sparse_replicate", "micro_batches")
"""What ``--pin NAME=N`` can fix: the mesh axes and the micro-batch count."""

MAX_AUTO_MICRO_BATCHES = 64
"""Most micro-batches the planner tries when the workload says 'auto'."""


def micro_batch_counts(workload: Workload, world_size: int) -> list[int]:
    """The micro-batch counts to plan with: the workload's, or with 'auto' every divisor of the local
    batch up to :data:`MAX_AUTO_MICRO_BATCHES`."""
    local = local_batch_of(workload, world_size)
    fixed = workload.batch.fixed_micro_batches
    if fixed is not None:
        return [fixed]
    return [d for d in divisors(local) if d <= MAX_AUTO_MICRO_BATCHES]


def mesh_axes(topology: Topology, mesh: MeshPlan) -> tuple[MeshAxis, ...]:
    """The mesh's axes with the tiers each spans (innermost first): the one mapping of mesh axes to
    tiers, derived from the topology by the cost model's placement of each axis's process groups
    (:func:`coplan.costmodel.comm.place_group`, ranks innermost-axis-fastest), so plans, prices and
    reports agree."""
    first = topology.tiers[0].name

    def tiers(size: int, stride: int) -> tuple[str, ...]:
        t = place_group(topology, size, stride).tiers
        return t or (first,)

    ax = [MeshAxis(name="dp_shard", size=mesh.dense_shard, tiers=tiers(mesh.dense_shard, 1)),
          MeshAxis(name="dp_replicate", size=mesh.dense_replicate, tiers=tiers(mesh.dense_replicate, mesh.dense_shard))]
    if mesh.expert_parallel > 1:
        ax.append(MeshAxis(name="ep", size=mesh.expert_parallel, tiers=tiers(mesh.expert_parallel, 1)))
    ax += [MeshAxis(name="sparse_shard", size=mesh.sparse_shard, tiers=tiers(mesh.sparse_shard, 1)),
           MeshAxis(name="sparse_replicate", size=mesh.sparse_replicate, tiers=tiers(mesh.sparse_replicate, mesh.sparse_shard))]
    return tuple(ax)


def takes_world_size(topology: Topology, n: int) -> bool:
    """Whether ``topology`` plans on ``n`` GPUs (``--gpus n``): at least one, at most its GPUs, and within one node or
    whole nodes. The one rule :func:`check_world_size` refuses by, and that GPU counts suggested as a fix keep to."""
    node = topology.gpus_per_node
    return 1 <= n <= topology.num_gpus and (n <= node or n % node == 0)


def check_world_size(topology: Topology, world_size: int | None) -> int:
    """The world size to plan for: all GPUs by default, or the first ``world_size`` of them."""
    n = topology.num_gpus if world_size is None else int(world_size)
    if takes_world_size(topology, n):
        return n
    if n < 1:
        raise CoplanError(f"--gpus must be positive (got {n})")
    if n > topology.num_gpus:
        raise CoplanError(
            f"--gpus {n:,} exceeds the {topology.num_gpus:,} GPUs of topology '{topology.name}'; "
            "plan on a larger topology or ask for fewer GPUs"
        )
    node = topology.gpus_per_node
    raise CoplanError(
        f"--gpus {n:,} is not a whole number of {node}-GPU nodes of '{topology.name}'; "
        f"use a multiple of {node} (e.g. {n // node * node:,} or {(n // node + 1) * node:,})"
    )


def batch_split_refusal(workload: Workload, topology: Topology, world: int) -> BatchError:
    """The refusal of a global batch that does not split over ``world`` GPUs of ``topology``
    (:func:`coplan.spec.workload.batch_split_error`), its ``--gpus`` suggestions kept to the counts the topology
    takes (:func:`takes_world_size`): a count that ``--gpus`` would refuse next is no fix."""
    gb = int(workload.batch.global_batch_size or 0)
    return batch_split_error(gb, world, workload.name, takes_gpus=lambda n: takes_world_size(topology, n))


def expert_counts(workload: Workload) -> list[int]:
    return [b.num_experts for b in workload.blocks if isinstance(b, MoEBlock)]


def enumerate_candidates(
    topology: Topology,
    workload: Workload,
    world_size: int,
    *,
    max_sparse_shard: int | None = None,
) -> Iterator[MeshCandidate]:
    """Every (dense_shard, expert_parallel, sparse_shard) factorisation of ``world_size``.

    - ``dense_shard``: any divisor of the world (HSDP when less than the world).
    - ``expert_parallel``: divisors of ``dense_shard`` that divide every MoE block's expert count
      (1 without MoE), so each EP rank holds whole experts.
    - ``sparse_shard``: any divisor of the world (1 = every rank holds every table, data-parallel
      embeddings); without tables only the whole world (the sparse axes are then unused).
    - ``micro_batches``: the workload's, or with 'auto' each divisor of the local batch (up to 64).
    """
    divs = divisors(world_size)
    experts = expert_counts(workload)
    ep_gcd = math.gcd(*experts) if experts else 1
    sparse = [world_size] if not workload.all_tables else [d for d in divs if max_sparse_shard is None or d <= max_sparse_shard]
    for mb in micro_batch_counts(workload, world_size):
        for ds in divs:
            eps = [e for e in divisors(ds) if ep_gcd % e == 0] if experts else [1]
            for ep in eps:
                for ss in sparse:
                    yield MeshCandidate(world_size, ds, ep, ss, mb)
