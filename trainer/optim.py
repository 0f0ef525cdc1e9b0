"""Optimizers: the dense one over FSDP's sharded parameters, FBGEMM's fused one inside the sharded
tables (it updates in backward), and the sparse optimizer's dense twin for data-parallel tables.

The twin follows FBGEMM's update rule exactly (``EXACT_ROWWISE_ADAGRAD``: one accumulator per row,
``acc += mean(g²)``, ``w -= lr·g / (√acc + eps)``), so a table's optimizer means the same thing
whichever sharding type the plan gives it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from coplan.spec import Plan
from coplan.trainer.distributed.embedding import SPARSE_EPS


class RowWiseAdagrad(torch.optim.Optimizer):
    """Dense-gradient form of FBGEMM's exact row-wise Adagrad (rows without gradient do not move)."""

    def __init__(self, params, lr: float, eps: float = SPARSE_EPS) -> None:
        super().__init__(params, {"lr": lr, "eps": eps})
        for group in self.param_groups:  # eager state: a checkpoint can be loaded before the first step
            for p in group["params"]:
                self.state[p]["sum"] = torch.zeros(p.shape[0], dtype=torch.float32, device=p.device)

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                g = p.grad
                if g is None:
                    continue
                acc = self.state[p]["sum"]
                acc.add_(g.float().square().mean(dim=1))
                p.sub_((g.float() * (group["lr"] / (acc.sqrt() + group["eps"])).unsqueeze(1)).to(p.dtype))
        return None


def _dense_optimizer(params: list[nn.Parameter], plan: Plan, fused: bool = False) -> torch.optim.Optimizer:
    """``fused``: PyTorch's single-kernel Adam/AdamW/Adagrad/SGD (one launch per dtype and device instead
    of the foreach path's ~5 per 24 tensors, and its step count stays on the device: no read-back)."""
    o = plan.workload.optimizer
    kw = {"fused": True} if fused else {}
    if o.dense == "adamw":
        return torch.optim.AdamW(params, lr=o.dense_lr, weight_decay=o.weight_decay, **kw)
    if o.dense == "adam":
        return torch.optim.Adam(params, lr=o.dense_lr, weight_decay=o.weight_decay, **kw)
    if o.dense == "adagrad":
        return torch.optim.Adagrad(params, lr=o.dense_lr, weight_decay=o.weight_decay, eps=1e-10, **kw)
    return torch.optim.SGD(params, lr=o.dense_lr, weight_decay=o.weight_decay, **kw)


def _table_optimizer(params: list[nn.Parameter], plan: Plan) -> torch.optim.Optimizer | None:
    if not params:
        return None
    o = plan.workload.optimizer
    if o.sparse == "rowwise_adagrad":
        return RowWiseAdagrad(params, lr=o.sparse_lr)
    if o.sparse == "adagrad":
        return torch.optim.Adagrad(params, lr=o.sparse_lr, eps=SPARSE_EPS)
    if o.sparse == "adam":
        opt = torch.optim.Adam(params, lr=o.sparse_lr)
        for p in params:  # eager state, as above
            opt.state[p].update(step=torch.tensor(0.0), exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
        return opt
    return torch.optim.SGD(params, lr=o.sparse_lr)


class Optimizers:
    """Steps and zeroes every optimizer of the model together."""

    def __init__(self, dense: nn.Module, dp_tables: list[tuple[str, nn.Parameter]], fused: Any, plan: Plan,
                 *, fused_dense: bool = False) -> None:
        """``fused_dense``: the dense optimizer's fused kernel (CUDA runs; the CPU tests keep the foreach
        path that the reference run uses). Where it turns out unsupported at the first step, the
        foreach path is used instead and :attr:`fused_dense` says so."""
        self._params = [p for p in dense.parameters() if p.requires_grad]
        self._plan = plan
        self.fused_dense = fused_dense
        self.fused_error: str | None = None
        self.dense = _dense_optimizer(self._params, plan, fused=fused_dense)
        self.dp_names = [n for n, _ in dp_tables]
        self.tables = _table_optimizer([p for _, p in dp_tables], plan)
        self.fused = fused

    def step(self) -> None:
        fresh = not any(self.dense.state.values())  # (a failed first step may leave initialised state behind)
        try:
            self.dense.step()
        except (RuntimeError, NotImplementedError) as e:
            # the fused kernels' coverage (DTensor shards, dtypes, devices) varies by torch build; before
            # the first update the foreach path can take over exactly, afterwards it is a real error
            if not self.fused_dense or not fresh:
                raise
            self.fused_dense, self.fused_error = False, f"{type(e).__name__}: {e}"[:300]
            self.dense = _dense_optimizer(self._params, self._plan, fused=False)
            self.dense.step()
        if self.tables is not None:
            self.tables.step()
        # the fused optimizer already ran inside the embedding backward

    def zero_grad(self) -> None:
        self.dense.zero_grad(set_to_none=True)
        if self.tables is not None:
            self.tables.zero_grad(set_to_none=True)


__all__ = ["Optimizers", "RowWiseAdagrad"]
