"""ParallelDims: the plan's degrees, checked once, and the DeviceMeshes built from them.

Ranks are laid out innermost-axis-fastest (the plan's convention): dense rank ``r·S + s`` for replica
``r`` and shard ``s``; the expert-parallel group is an inner block of ``ep`` consecutive shard ranks.
The sparse side has its own layout: one copy of the tables is sharded over ``sparse_shard`` consecutive
ranks and replicated ``sparse_replicate`` times (2-D sparse parallelism), which :mod:`.embedding` builds
on. Two meshes cover the same ranks: ``dense`` (``dp_replicate × dp_shard``) for FSDP/HSDP of the dense
parameters, and ``expert`` (``dp_replicate × dp_shard_mod_ep × ep``) for the experts, which are split
over ``ep`` and FSDP-sharded over the rest. Each mesh is built directly rather than flattened out of one,
which PyTorch is deprecating.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from coplan.errors import MismatchError
from coplan.spec import Plan


@dataclass(kw_only=True, slots=True)
class ParallelDims:
    """Degrees of each parallelism; 'axis' is a DeviceMesh axis, 'dim' a tensor dimension."""

    dp_replicate: int
    """HSDP replicas of the dense parameters (outer axis)."""

    dp_shard: int
    """FSDP shard degree of the dense parameters (inner axis)."""

    ep: int
    """Expert-parallel degree: an inner group of the dp_shard ranks."""

    sparse_shard: int
    """Ranks one copy of the embedding tables spans."""

    sparse_replicate: int
    """Copies of the embedding tables."""

    world_size: int
    """Processes of the run."""

    def __post_init__(self) -> None:
        for name in ("dp_replicate", "dp_shard", "ep", "sparse_shard", "sparse_replicate", "world_size"):
            if getattr(self, name) < 1:
                raise MismatchError(f"{name} must be at least 1; got {getattr(self, name)}")
        if self.dp_replicate * self.dp_shard != self.world_size:
            raise MismatchError(f"dp_replicate × dp_shard = {self.dp_replicate * self.dp_shard} but the world has {self.world_size} ranks")
        if self.sparse_replicate * self.sparse_shard != self.world_size:
            raise MismatchError(f"sparse_replicate × sparse_shard = {self.sparse_replicate * self.sparse_shard} but the world has {self.world_size} ranks")
        if self.dp_shard % self.ep:
            raise MismatchError(f"expert-parallel degree {self.ep} must divide the FSDP shard degree {self.dp_shard}")

    @classmethod
    def from_plan(cls, plan: Plan) -> "ParallelDims":
        m = plan.mesh
        return cls(dp_replicate=m.dense_replicate, dp_shard=m.dense_shard, ep=m.expert_parallel,
                   sparse_shard=m.sparse_shard, sparse_replicate=m.sparse_replicate, world_size=plan.world_size)

    @property
    def hsdp_enabled(self) -> bool:
        return self.dp_replicate > 1

    @property
    def fsdp_enabled(self) -> bool:
        return self.dp_shard > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def sparse_2d_enabled(self) -> bool:
        """Whether the tables are sharded within groups and replicated across them (2-D sparse parallelism)."""
        return self.sparse_replicate > 1


@dataclass(slots=True)
class Meshes:
    """The meshes and groups the parallelisms use."""

    dense: DeviceMesh
    """FSDP mesh of the dense parameters: 1-D ``dp_shard``, or 2-D ``(dp_replicate, dp_shard)`` for HSDP."""

    expert: DeviceMesh
    """FSDP mesh of the experts: ``dp_shard_mod_ep``, or ``(dp_replicate, dp_shard_mod_ep)``."""

    ep_group: dist.ProcessGroup | None
    """This rank's expert-parallel group (None without EP)."""

    ep_rank: int
    """This rank's index in its EP group."""

    ep_mesh: DeviceMesh
    """The 1-D ``ep`` mesh of this rank's EP group (checkpoints describe the experts over it)."""

    sparse_group: dist.ProcessGroup
    """The group one copy of the embedding tables is sharded over (the world without 2-D sparse parallelism)."""

    sparse_mesh: DeviceMesh | None = None
    """``(sparse_replicate, sparse_shard)``: row ``g`` is sparse group ``g``, ranks ``[g·S, (g+1)·S)``; column
    ``s`` the replica group of shard ``s``, ranks ``{s, s+S, ...}`` (None without 2-D sparse parallelism)."""

    replica_group: dist.ProcessGroup | None = None
    """The ranks holding the same shards as this one, one per sparse group (None without 2-D sparse parallelism)."""


def build_meshes(dims: ParallelDims, device_type: str) -> Meshes:
    r, s, ep = dims.dp_replicate, dims.dp_shard, dims.ep
    dense = init_device_mesh(device_type, (r, s), mesh_dim_names=("dp_replicate", "dp_shard"))
    expert = init_device_mesh(device_type, (r, s // ep, ep), mesh_dim_names=("dp_replicate", "dp_shard_mod_ep", "ep"))
    dense_fsdp = dense if dims.hsdp_enabled else dense["dp_shard"]
    expert_fsdp = expert["dp_replicate", "dp_shard_mod_ep"] if dims.hsdp_enabled else expert["dp_shard_mod_ep"]
    ep_mesh = expert["ep"]
    sparse_mesh = None
    if dims.sparse_2d_enabled:
        # the plan's layout: the sparse shard group is the inner axis (contiguous ranks), the replicas the outer
        sparse_mesh = init_device_mesh(device_type, (dims.sparse_replicate, dims.sparse_shard),
                                       mesh_dim_names=("sparse_replicate", "sparse_shard"))
    return Meshes(
        dense=dense_fsdp,
        expert=expert_fsdp,
        ep_group=ep_mesh.get_group() if dims.ep_enabled else None,
        ep_rank=ep_mesh.get_local_rank(),
        ep_mesh=ep_mesh,
        sparse_group=sparse_mesh.get_group("sparse_shard") if sparse_mesh is not None else dist.group.WORLD,
        sparse_mesh=sparse_mesh,
        replica_group=sparse_mesh.get_group("sparse_replicate") if sparse_mesh is not None else None,
    )


__all__ = ["Meshes", "ParallelDims", "build_meshes"]
