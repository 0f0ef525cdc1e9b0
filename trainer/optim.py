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


def _dense_optimizer(params: list[nn.Parameter], plan: Plan, fused: bool = False,
                     capturable: bool = False) -> torch.optim.Optimizer:
    """``fused``: PyTorch's single-kernel Adam/AdamW/Adagrad/SGD (one launch per dtype and device instead
    of the foreach path's ~5 per 24 tensors, and its step count stays on the device: no read-back).
    ``capturable``: Adam(W) that a CUDA graph can capture (its bias corrections computed on the device;
    :class:`GraphedStep`)."""
    o = plan.workload.optimizer
    kw = {"fused": True} if fused else {}
    if capturable and o.dense in ("adamw", "adam"):
        kw["capturable"] = True
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


class GraphedStep:
    """The dense optimizer's step replayed as one CUDA graph: the host issues one launch instead of running the
    optimizer's Python over every parameter (1.2-2.6 ms of host a step on the held-out H100 draws' one-GPU runs,
    ``host_phases_s.optimizer``, where steps of 10-14 ms were host-bound).

    For one-GPU runs whose dense gradients live in fixed buffers (:class:`coplan.trainer.graphs.DenseGraphs`).
    The first step runs eagerly (it creates the optimizer's state), the second is captured and replayed, and
    later ones replay it while every gradient, state tensor and hyperparameter is the one captured (checked
    each step: the gradients' addresses and the groups' hyperparameters); otherwise the step runs eagerly and
    the graph is dropped, saying why (:attr:`why_eager`). A step asked to run eagerly (the profiled steps, whose
    traces name each kernel) updates the same state in place, which the graph keeps reading."""

    def __init__(self, opt: torch.optim.Optimizer) -> None:
        self.opt = opt
        self.graph: torch.cuda.CUDAGraph | None = None
        self._key: tuple | None = None
        self.replayed = 0
        self.why_eager: str | None = None
        """Why the step stopped being replayed (None: it is, or has not been captured yet)."""

    def _now(self) -> tuple:
        groups = self.opt.param_groups
        grads = tuple(p.grad.data_ptr() if p.grad is not None else 0 for g in groups for p in g["params"])
        hyper = tuple(tuple((k, v) for k, v in sorted(g.items()) if k != "params" and isinstance(v, (int, float, bool)))
                      for g in groups)
        # the state is replaced wholesale (load_state_dict) or not at all: its first parameter's tensors stand for it
        first = self.opt.state.get(groups[0]["params"][0], {}) if groups and groups[0]["params"] else {}
        state = (id(self.opt.state), tuple(v.data_ptr() for v in first.values() if isinstance(v, torch.Tensor)))
        return grads, hyper, state

    def step(self, eager: bool = False) -> None:
        if eager or self.why_eager is not None or not any(self.opt.state.values()):
            self.opt.step()
            return
        key = self._now()
        if self.graph is not None:
            if key == self._key:
                with torch.autograd.profiler.record_function(f"Optimizer.step#{type(self.opt).__name__}.step"):
                    self.graph.replay()
                self.replayed += 1
                return
            self.graph, self.why_eager = None, "the gradients, state or hyperparameters changed since the capture"
            self.opt.step()
            return
        graph = torch.cuda.CUDAGraph()
        try:
            # thread_local: the data thread keeps issuing its own CUDA calls (pinned copies, events) meanwhile
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                self.opt.step()  # recorded, not run: the state is untouched until the replay
        except Exception as e:  # (capture errors vary by torch build) the step runs eagerly from now on
            self.why_eager = f"the capture failed: {type(e).__name__}: {e}"[:300]
            self.opt.step()
            return
        self.graph, self._key = graph, key
        graph.replay()
        self.replayed += 1


class Optimizers:
    """Steps and zeroes every optimizer of the model together."""

    def __init__(self, dense: nn.Module, dp_tables: list[tuple[str, nn.Parameter]], fused: Any, plan: Plan,
                 *, fused_dense: bool = False, local_step: bool = True, dp_group: Any = None,
                 graph_step: bool = False) -> None:
        """``fused_dense``: the dense optimizer's fused kernel (CUDA runs; the CPU tests keep the foreach
        path that the reference run uses). Where it turns out unsupported at the first step, the
        foreach path is used instead and :attr:`fused_dense` says so. ``local_step``: step the dense
        optimizer on the DTensors' local shards (:class:`LocalStepper`; off: through DTensor). ``dp_group``:
        the ranks the data-parallel tables' gradients are summed over before their step (default: the world).
        ``graph_step``: replay the dense step as a CUDA graph (:class:`GraphedStep`; one-GPU runs whose dense
        gradients are fixed buffers, Adam or AdamW on CUDA parameters)."""
        self._params = [p for p in dense.parameters() if p.requires_grad]
        self._plan = plan
        self.fused_dense = fused_dense
        self.fused_error: str | None = None
        # only worth it (and only tried) where some parameter is a DTensor
        self.dtensor_params = any(isinstance(p, DTensor) for p in self._params)
        self.graph_step = (graph_step and not self.dtensor_params and plan.workload.optimizer.dense in ("adamw", "adam")
                           and bool(self._params) and all(p.is_cuda for p in self._params))
        self.local_step = local_step and self.dtensor_params
        self._make_dense(fused_dense)
        self.dp_names = [n for n, _ in dp_tables]
        self.tables = _table_optimizer([p for _, p in dp_tables], plan)
        self.dp_group = dp_group
        self.fused = fused

    def _make_dense(self, fused: bool) -> None:
        """The dense optimizer and what steps it (:class:`LocalStepper`, :class:`GraphedStep` or itself)."""
        self.dense = _dense_optimizer(self._params, self._plan, fused=fused, capturable=self.graph_step)
        self._stepper = LocalStepper(self.dense) if self.local_step else None
        self._graphed = GraphedStep(self.dense) if self.graph_step else None

    def graph_note(self) -> str | None:
        """What became of the dense step's graph (None where it was not asked for)."""
        g = self._graphed
        if g is None:
            return None
        if g.why_eager is not None:
            return f"dense optimizer step eager after {g.replayed} graph replay(s): {g.why_eager}"
        return f"dense optimizer step as a CUDA graph ({g.replayed} replays)"

    def step(self, eager: bool = False) -> None:
        """``eager``: run the dense step as itself even where it is replayed as a graph (profiled steps)."""
        fresh = not any(self.dense.state.values())  # (a failed first step may leave initialised state behind)
        try:
            if self._stepper is not None:
                self._stepper.step()
            elif self._graphed is not None:
                self._graphed.step(eager)
            else:
                self.dense.step()
        except (RuntimeError, NotImplementedError) as e:
            # the fused kernels' coverage (DTensor shards, dtypes, devices) varies by torch build; before
            # the first update the foreach path can take over exactly, afterwards it is a real error
            if not self.fused_dense or not fresh:
                raise
            self.fused_dense, self.fused_error = False, f"{type(e).__name__}: {e}"[:300]
            self._make_dense(False)
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


__all__ = ["GraphedStep", "LocalStepper", "Optimizers", "RowWiseAdagrad", "local"]
