"""Apply the plan's parallelisms to the GEM model, in a fixed order.

Order, and why:

1. **Embedding sharding** (TorchRec DMP; with several table replicas, TorchRec's 2-D sparse parallelism:
   DMPCollection on CUDA, the same parts on CPU) first: it replaces the meta-device embedding collections
   with sharded ones and must see the model before any wrapper, and FSDP must never own a table. The
   replicas' sync (:class:`ReplicaSync`) is built with it and runs once per optimizer step in the loop.
2. **Expert parallelism** next: it changes which expert weights a rank holds, and FSDP shards
   whatever parameters exist when it is applied.
2b. **FP8** (the plan's fp8 layers): swaps their ``nn.Linear`` modules for ``Float8Linear`` (same
   parameters), and with ``blockwise-fused`` gives InterFormer and Kunlun layers their fused FFN (same
   modules), before checkpointing and FSDP wrap or shard the modules they find.
3. **Activation checkpointing** before FSDP: the checkpoint wrapper must sit *inside* the FSDP unit,
   so that FSDP's all-gather is outside the recomputed region (recompute then runs on the
   parameters FSDP has already gathered for backward), as in torchtitan.
3b. **Compile** (optional, ``--compile layers``) after checkpointing and before FSDP, as in torchtitan:
   it compiles the layers' own ``forward`` only, so both wrappers' hooks stay outside it.
4. **FSDP2 / HSDP** last: it shards the parameters that are left, layer by layer, and registers the
   hooks that gather them around each layer's forward and backward (on one rank: one unit, the root).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torchrec.distributed.model_parallel import DistributedModelParallel

from coplan.spec import Plan
from coplan.trainer.distributed.activation_checkpoint import apply_activation_checkpointing
from coplan.trainer.distributed.compile import apply_compile
from coplan.trainer.distributed.embedding import apply_embedding_sharding, data_parallel_tables, init_sharded_tables
from coplan.trainer.distributed.expert_parallel import apply_expert_parallel
from coplan.trainer.distributed.fp8 import apply_fp8
from coplan.trainer.distributed.fsdp import apply_fsdp
from coplan.trainer.distributed.mesh import Meshes, ParallelDims
from coplan.trainer.distributed.replica_sync import ReplicaSync


@dataclass
class ParallelModel:
    """The model after parallelisation, and the handles the loop needs."""

    dmp: DistributedModelParallel
    """Call this with a Batch; its ``fused_optimizer`` holds the sharded tables' optimizer state."""

    model: nn.Module
    """The unwrapped GEM model (``.sparse`` sharded by TorchRec, ``.dense`` by FSDP)."""

    dp_tables: list[tuple[str, nn.Parameter]]
    """Replicated (data-parallel) tables, whose gradients are summed over the world."""

    recomputed: list[str]
    """Layers under activation checkpointing."""

    ep_mesh: DeviceMesh | None = None
    """The EP group's mesh when experts are split (None without expert parallelism)."""

    fsdp_per_layer: bool = True
    """Whether each layer is an FSDP unit of its own (False: one unit, the dense root; on one rank)."""

    replica_sync: ReplicaSync | None = None
    """Averages the table replicas of 2-D sparse parallelism (None: one copy of the tables)."""

    sparse_shard: int = 1
    """Ranks one copy of the tables spans (checkpoints keep one copy: the first sparse group's)."""

    fp8: tuple[str, ...] = ()
    """What :func:`~coplan.trainer.distributed.fp8.apply_fp8` swapped or fused ('<layer>:<in>x<out>',
    '<layer>:ffn fused <d>x<hidden>x<d>', '<layer>:ffn not fused (<why>)')."""


class _NoFusedOptimizer:
    """DMP's ``fused_optimizer`` where the model has no table: no state, nothing to step."""

    def state_dict(self) -> dict:
        return {"state": {}, "param_groups": []}

    def load_state_dict(self, state: dict) -> None:
        pass


def _without_tables(model: nn.Module) -> nn.Module:
    """The model stands where DMP would (``pm.dmp(batch)``, its state dict, an empty fused optimizer)."""
    model.fused_optimizer = _NoFusedOptimizer()
    return model


def parallelize(model: nn.Module, plan: Plan, dims: ParallelDims, meshes: Meshes, *, device: torch.device,
                local_size: int, seed: int, compile_layers: str | bool = False, fsdp_per_layer: bool | None = None,
                fsdp: bool = True) -> ParallelModel:
    """``fsdp=False``: leave the dense parameters unsharded (one-rank runs whose dense arch runs as CUDA
    graphs, which cast the masters to the compute dtype themselves: :mod:`coplan.trainer.graphs`)."""
    if getattr(model, "sparse", None) is None:  # no tables (a dense decoder): no TorchRec sharding at all
        dmp, sync = _without_tables(model), None
    else:
        dmp = apply_embedding_sharding(model, plan, device=device, meshes=meshes, local_size=local_size)
        init_sharded_tables(dmp, seed, {t.name: t.dim for t in plan.workload.all_tables})
        sync = (ReplicaSync(dmp, meshes.replica_group, dims.sparse_replicate, plan.workload.optimizer.sparse_sync_interval_steps)
                if dims.sparse_2d_enabled else None)
    dense = model.dense
    apply_expert_parallel(dense, meshes.ep_group, meshes.ep_rank, dims.ep)
    # FP8 swaps nn.Linear modules in place: before activation checkpointing (which wraps the layers) and FSDP2 (which shards the params it finds).
    fp8 = apply_fp8(dense, plan, device=device)
    compiled = bool(compile_layers) and compile_layers != "off"
    # without FSDP2 (one rank, CUDA graphs) the graph runner swaps the cast weights in for each forward only
    recomputed = apply_activation_checkpointing(dense, {layer.name for layer in plan.layers if layer.recompute},
                                                swapped_weights=not fsdp and not compiled)
    apply_compile(dense, compile_layers)
    per_layer = apply_fsdp(dense, meshes.dense, meshes.expert, plan.precision, per_layer=fsdp_per_layer) if fsdp else False
    return ParallelModel(dmp=dmp, model=model, dp_tables=data_parallel_tables(dmp, plan), recomputed=recomputed,
                         ep_mesh=meshes.ep_mesh if dims.ep_enabled else None, fsdp_per_layer=per_layer,
                         replica_sync=sync, sparse_shard=dims.sparse_shard, fp8=tuple(fp8))


__all__ = ["ParallelModel", "parallelize"]
