"""Expert parallelism: each rank of an EP group keeps a contiguous slice of every MoE layer's experts.

The full model is built (and seeded) on every rank first, so slicing keeps exactly the experts the
unsharded model has at those indices; the layer's forward then dispatches tokens to their experts'
ranks with all-to-alls over the EP group (:class:`~coplan.trainer.model.moe.MoELayer`).
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

from coplan.errors import MismatchError
from coplan.trainer.model.moe import MoELayer


def apply_expert_parallel(dense: nn.Module, group: dist.ProcessGroup | None, ep_rank: int, ep_size: int) -> None:
    if ep_size == 1:
        return
    for module in dense.modules():
        if not isinstance(module, MoELayer):
            continue
        if module.num_experts % ep_size:
            raise MismatchError(f"{module.name}: {module.num_experts} experts do not split evenly over "
                                f"expert-parallel degree {ep_size}")
        local = module.num_experts // ep_size
        start = ep_rank * local
        ex = module.experts
        ex.w13 = nn.Parameter(ex.w13.detach()[start : start + local].clone())
        ex.w2 = nn.Parameter(ex.w2.detach()[start : start + local].clone())
        module.ep_group, module.ep_size, module.expert_start = group, ep_size, start


__all__ = ["apply_expert_parallel"]
