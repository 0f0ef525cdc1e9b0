"""Optimizers: the dense one over FSDP's sharded parameters, FBGEMM's fused one inside the sharded
tables (it updates in backward), and the sparse optimizer's dense twin for data-parallel tables (whose
gradients it sums over the world first, once per step: ``sparse.dp_all_reduce``).

The twin follows FBGEMM's update rule exactly (``EXACT_ROWWISE_ADAGRAD``: one accumulator per row,
``acc += mean(g²)``, ``w -= lr·g / (√acc + eps)``), so a table's optimizer means the same thing
whichever sharding type the plan gives it.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from coplan.spec import Plan
from coplan.trainer.distributed.embedding import SPARSE_EPS, all_reduce_data_parallel_grads


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


def local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (the tensor itself otherwise), without DTensor's dispatch: ``to_local()``
    is an autograd Function, tens of microseconds per call, paid per parameter per step."""
    return t._local_tensor if isinstance(t, DTensor) else t


class LocalStepper:
    """Steps an elementwise optimizer over FSDP2's DTensor parameters on their local shards.

    Adam(W), Adagrad and SGD update each element from that element's parameter, gradient and state
    alone, so stepping every rank's local shard is the same update as stepping the DTensors (which is
    what DTensor's sharding propagation ends up running), without DTensor's per-op dispatch: on one
    H200 the fused AdamW over gem-h200's DTensors took 2.3-5.5 ms of host time per step, of which the
    kernel launches on the local tensors took 0.18 ms (BENCHMARKS.md, trainer v3).

    A twin optimizer of the same class and hyperparameters owns the local tensors; its state is the
    *same storage* as the DTensor optimizer's (each DTensor state's local shard, the step counters the
    same objects), relinked before every step, so the DTensor optimizer's state dict (checkpoints,
    resume) always holds the current values. The DTensor optimizer itself takes the first step, which
    creates that state.
    """

    def __init__(self, opt: torch.optim.Optimizer) -> None:
        self.opt = opt
        self._twin: torch.optim.Optimizer | None = None

    def step(self) -> None:
        groups = [[p for p in g["params"] if p.grad is not None] for g in self.opt.param_groups]
        if any(not self.opt.state.get(p) for ps in groups for p in ps):
            self.opt.step()  # the first step (or a parameter with no state yet): creates the shared state
            return
        if self._twin is None:
            # a shallow copy of every attribute (same class, defaults, hooks, flags); param_groups and state
            # are replaced below. Not copy.copy: Optimizer.__getstate__ keeps three attributes only. Not a
            # new instance: Adagrad allocates state eagerly, and constructors differ between versions.
            self._twin = object.__new__(type(self.opt))
            self._twin.__dict__.update(self.opt.__dict__)
        state: defaultdict = defaultdict(dict)
        twin_groups = []
        for g, ps in zip(self.opt.param_groups, groups):
            lps = []
            for p in ps:
                lp = local(p)
                lp.grad = local(p.grad)
                state[lp] = {k: local(v) if isinstance(v, torch.Tensor) else v for k, v in self.opt.state[p].items()}
                lps.append(lp)
            twin_groups.append({**g, "params": lps})  # hyperparameters as they are now (a schedule may change lr)
        self._twin.param_groups, self._twin.state = twin_groups, state
        try:
            self._twin.step()
        finally:
            for lg in twin_groups:
                for lp in lg["params"]:
                    lp.grad = None  # the DTensor gradient stays the owner; zero_grad drops it
        # scalar state the optimizer replaces rather than updates in place (a Python-number step
        # counter in some configurations) goes back to the DTensor optimizer's state
        for ps, lg in zip(groups, twin_groups):
            for p, lp in zip(ps, lg["params"]):
                for k, v in state[lp].items():
                    if not isinstance(v, torch.Tensor):
                        self.opt.state[p][k] = v


class Optimizers:
    """Steps and zeroes every optimizer of the model together."""

    def __init__(self, dense: nn.Module, dp_tables: list[tuple[str, nn.Parameter]], fused: Any, plan: Plan,
                 *, fused_dense: bool = False, local_step: bool = True, dp_group: Any = None) -> None:
        """``fused_dense``: the dense optimizer's fused kernel (CUDA runs; the CPU tests keep the foreach
        path that the reference run uses). Where it turns out unsupported at the first step, the
        foreach path is used instead and :attr:`fused_dense` says so. ``local_step``: step the dense
        optimizer on the DTensors' local shards (:class:`LocalStepper`; off: through DTensor). ``dp_group``:
        the ranks the data-parallel tables' gradients are summed over before their step (default: the world)."""
        self._params = [p for p in dense.parameters() if p.requires_grad]
        self._plan = plan
        self.fused_dense = fused_dense
        self.fused_error: str | None = None
        self.dense = _dense_optimizer(self._params, plan, fused=fused_dense)
        # only worth it (and only tried) where some parameter is a DTensor
        self.dtensor_params = any(isinstance(p, DTensor) for p in self._params)
        self.local_step = local_step and self.dtensor_params
        self._stepper = LocalStepper(self.dense) if self.local_step else None
        self.dp_names = [n for n, _ in dp_tables]
        self.tables = _table_optimizer([p for _, p in dp_tables], plan)
        self.dp_group = dp_group
        self.fused = fused

    def step(self) -> None:
        fresh = not any(self.dense.state.values())  # (a failed first step may leave initialised state behind)
        try:
            if self._stepper is not None:
                self._stepper.step()
            else:
                self.dense.step()
        except (RuntimeError, NotImplementedError) as e:
            # the fused kernels' coverage (DTensor shards, dtypes, devices) varies by torch build; before
            # the first update the foreach path can take over exactly, afterwards it is a real error
            if not self.fused_dense or not fresh:
                raise
            self.fused_dense, self.fused_error = False, f"{type(e).__name__}: {e}"[:300]
            self.dense = _dense_optimizer(self._params, self._plan, fused=False)
            self._stepper = LocalStepper(self.dense) if self.local_step else None
            self.dense.step()
        if self.tables is not None:
            # data-parallel tables: this rank's gradients (every micro-batch's) summed over the world, once
            all_reduce_data_parallel_grads([p for g in self.tables.param_groups for p in g["params"]], self.dp_group)
            self.tables.step()
        # the fused optimizer already ran inside the embedding backward

    def zero_grad(self) -> None:
        self.dense.zero_grad(set_to_none=True)
        if self.tables is not None:
            self.tables.zero_grad(set_to_none=True)


__all__ = ["LocalStepper", "Optimizers", "RowWiseAdagrad", "local"]
