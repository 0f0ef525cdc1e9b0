"""FSDP2 (``fully_shard``): one unit per stacked layer, the experts on their own mesh, the rest in the root.

HSDP is FSDP2 on a 2-D mesh ``(dp_replicate, dp_shard)``: reduce-scatter within a replica, all-reduce
across replicas. Reductions *sum* (divide factor 1): each rank's loss is already its share of the
global mean (see :mod:`coplan.trainer.distributed.embedding`). Experts live on
``(dp_replicate, dp_shard_mod_ep)``: their gradients already hold the whole EP group's tokens.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from coplan.spec.workload import Precision
from coplan.trainer.model.moe import MoELayer

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def mixed_precision(precision: Precision) -> MixedPrecisionPolicy:
    """Parameters are gathered in the compute dtype; gradients reduced in ``reduce_dtype``; master
    weights stay in ``param_dtype`` (the shards the optimizer updates)."""
    compute = DTYPES[precision.compute_dtype]
    return MixedPrecisionPolicy(
        param_dtype=None if compute == torch.float32 else compute,
        reduce_dtype=DTYPES[precision.reduce_dtype],
    )


def _unwrap(m: nn.Module) -> nn.Module:
    return getattr(m, "_checkpoint_wrapped_module", m)


def _reshard(mesh: DeviceMesh) -> bool:
    """Free the gathered parameters after forward only where a rank holds a shard of them: with a
    shard axis of 1 the "all-gather" is a local copy and cast, which resharding would redo in
    backward, layer by layer, for no memory saved (the bf16 copy of the dense weights is small)."""
    return mesh.size(mesh.ndim - 1) > 1


def one_unit(dense_mesh: DeviceMesh, expert_mesh: DeviceMesh) -> bool:
    """Whether FSDP2 gets a single unit (the dense root) instead of one per layer: where every mesh is one
    rank. Units exist to bound the gathered parameters and to overlap each unit's collectives with the
    previous unit's compute; on one rank nothing is gathered or overlapped, and each unit only adds its
    hooks (copy-in, a one-rank all-gather, copy-out, a chunk-cat and a one-rank reduce-scatter, with
    their Python): 29 ms of host time per step over 9 units in the H200 trace of v2 (BENCHMARKS.md)."""
    return dense_mesh.size() == 1 and expert_mesh.size() == 1


def apply_fsdp(dense: nn.Module, dense_mesh: DeviceMesh, expert_mesh: DeviceMesh, precision: Precision,
               *, per_layer: bool | None = None) -> bool:
    """Shard ``dense``; ``per_layer``: one FSDP unit per layer (None: unless :func:`one_unit`). Returns
    whether the layers got units of their own."""
    mp = mixed_precision(precision)
    if per_layer is None:
        per_layer = not one_unit(dense_mesh, expert_mesh)
    if not per_layer and expert_mesh.size() != dense_mesh.size():
        raise ValueError("one FSDP unit needs the experts' mesh to be the dense mesh's size")  # (guarded by one_unit)
    for _, holder, i in dense.iter_layers() if per_layer else ():
        layer = holder[i]
        inner = _unwrap(layer)
        if isinstance(inner, MoELayer):
            fully_shard(inner.experts, mesh=expert_mesh, mp_policy=mp, reshard_after_forward=_reshard(expert_mesh))
        fully_shard(layer, mesh=dense_mesh, mp_policy=mp, reshard_after_forward=_reshard(dense_mesh))
    fully_shard(dense, mesh=dense_mesh, mp_policy=mp, reshard_after_forward=_reshard(dense_mesh))
    for m in dense.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
            if hasattr(m, "set_force_sum_reduction_for_comms"):
                m.set_force_sum_reduction_for_comms(True)
    return per_layer


__all__ = ["DTYPES", "apply_fsdp", "mixed_precision", "one_unit"]
