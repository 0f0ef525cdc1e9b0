"""Mesh candidates: every factorisation of the world into dense (HSDP × EP) and sparse (shard group ×
replica) degrees, with each mesh axis mapped onto the topology tiers its process groups cross.

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

from coplan.errors import CoplanError
from coplan.spec import MeshAxis, MeshPlan, Topology, Workload
from coplan.spec.workload import MoEBlock


def divisors(n: int) -> list[int]:
    out: list[int] = []
    for d in range(1, int(math.isqrt(n)) + 1):
        if n % d == 0:
            out.append(d)
            if d != n // d:
                out.append(n // d)
    return sorted(out)


def tiers_crossed(topology: Topology, world_size: int, size: int, stride: int) -> tuple[str, ...]:
    """Names of the tiers the traffic of one process group of ``size`` ranks, ``stride`` apart, uses.

    Tier ``i`` is used when two members meet first in a tier-``i`` group: the members occupy more
    units of the tier below ``i`` than groups of tier ``i``. A strided group with one rank per NVLink
    domain therefore uses only network tiers. Groups are laid out alike, so the first one (ranks 0,
    stride, 2·stride, ...) stands for all. A group of one is reported as the innermost tier.
    """
    if size <= 1:
        return (topology.tiers[0].name,)
    members = [j * stride for j in range(size)]
    if members[-1] >= world_size:  # pragma: no cover - callers pass divisors
        raise ValueError("group does not fit in the world")
    used = []
    below = len(members)  # distinct GPUs
    for i, tier in enumerate(topology.tiers):
        here = len({m // topology.gpus_within(i) for m in members})
        if here < below:
            used.append(tier.name)
        below = here
    return tuple(used)


def innermost_tier_span(topology: Topology, size: int, stride: int) -> str:
    """The outermost tier a group crosses (its slowest link)."""
    crossed = tiers_crossed(topology, size * stride, size, stride)
    return crossed[-1]


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

    @property
    def dense_replicate(self) -> int:
        return self.world_size // self.dense_shard

    @property
    def sparse_replicate(self) -> int:
        return self.world_size // self.sparse_shard

    @property
    def key(self) -> str:
        return f"fsdp{self.dense_shard}x{self.dense_replicate}-ep{self.expert_parallel}-sp{self.sparse_shard}x{self.sparse_replicate}"

    def axes(self, topology: Topology) -> tuple[MeshAxis, ...]:
        w = self.world_size
        spec = [
            ("dp_replicate", self.dense_replicate, self.dense_shard),
            ("dp_shard", self.dense_shard, 1),
            ("ep", self.expert_parallel, 1),
            ("sparse_replicate", self.sparse_replicate, self.sparse_shard),
            ("sparse_shard", self.sparse_shard, 1),
        ]
        return tuple(
            MeshAxis(name=name, size=size, tiers=tiers_crossed(topology, w, size, stride))  # type: ignore[arg-type]
            for name, size, stride in spec
        )

    def to_mesh_plan(self, topology: Topology) -> MeshPlan:
        return MeshPlan(
            dense_shard=self.dense_shard,
            dense_replicate=self.dense_replicate,
            expert_parallel=self.expert_parallel,
            sparse_shard=self.sparse_shard,
            sparse_replicate=self.sparse_replicate,
            axes=self.axes(topology),
        )


def check_world_size(topology: Topology, world_size: int | None) -> int:
    """The world size to plan for: all GPUs by default, or the first ``world_size`` of them."""
    n = topology.num_gpus if world_size is None else int(world_size)
    if n < 1:
        raise CoplanError(f"--gpus must be positive (got {n})")
    if n > topology.num_gpus:
        raise CoplanError(
            f"--gpus {n:,} exceeds the {topology.num_gpus:,} GPUs of topology '{topology.name}'; "
            "plan on a larger topology or ask for fewer GPUs"
        )
    node = topology.gpus_per_node
    if n > node and n % node:
        raise CoplanError(
            f"--gpus {n:,} is not a whole number of {node}-GPU nodes of '{topology.name}'; "
            f"use a multiple of {node} (e.g. {n // node * node:,} or {(n // node + 1) * node:,})"
        )
    return n


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
    """
    divs = divisors(world_size)
    experts = expert_counts(workload)
    ep_gcd = math.gcd(*experts) if experts else 1
    sparse = [world_size] if not workload.all_tables else [d for d in divs if max_sparse_shard is None or d <= max_sparse_shard]
    for ds in divs:
        eps = [e for e in divisors(ds) if ep_gcd % e == 0] if experts else [1]
        for ep in eps:
            for ss in sparse:
                yield MeshCandidate(world_size, ds, ep, ss)
