"""The replicas' sync of 2-D sparse parallelism: every ``sparse_sync_interval_steps`` optimizer steps, the
copies of each table shard (one per sparse group) are averaged, weights and optimizer state alike.

On CUDA with TorchRec's ``DMPCollection`` this is its own ``sync()`` (an all-reduce with ``ReduceOp.AVG``
over the replica group); elsewhere the same tensors (each fused TBE's weights and optimizer state) are
summed over the replica group and divided by the number of replicas (gloo has no ``AVG``), small ones
together in flat buffers of bounded size. Either way the range is ``sparse.replica_sync``, the cost model's name for it.

Why averaging reproduces one copy: each replica's fused optimizer steps with ``R`` times the learning rate
(:func:`~coplan.trainer.distributed.embedding.fused_params`), and its gradient holds only its own group's
samples (every rank's loss is its share of the global mean). With SGD and a sync every step, the average of
``w - R·lr·g_r`` over the ``R`` replicas is ``w - lr·Σ g_r``, the 1-D update (up to fp32 rounding). With a
longer interval the replicas step from weights that drift apart between syncs, so the result approximates
it. For Adagrad (and row-wise Adagrad) the weight update of a row that only one replica's samples touched
between two syncs is again the 1-D one, but the averaged accumulator grows by ``g²/R`` instead of ``g²``, so
later steps of that row are up to ``√R`` times larger than one copy's; rows several replicas touch take the
mean of per-replica normalised steps. That is TorchRec's semantics for 2-D parallelism, not one copy's.
Data-parallel tables are not synced: their gradients are summed over the whole world, every replica steps
them identically.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd.profiler import record_function

SYNC_RANGE = "sparse.replica_sync"
"""The ``record_function`` name of the sync: the cost model's op name (``costmodel/pricer.py``)."""


BUCKET_ELEMENTS = 1 << 24
"""Small tensors are averaged together in flat buffers of up to this many elements (64 MiB of fp32), so
that thousands of tables cost a few collectives and no full copy of the shards is ever made."""


def _buckets(tensors: list[torch.Tensor], cap: int) -> list[list[torch.Tensor]]:
    """Tensors grouped by dtype into runs of at most ``cap`` elements (a larger tensor alone)."""
    out: list[list[torch.Tensor]] = []
    open_: dict[torch.dtype, tuple[list[torch.Tensor], int]] = {}
    for t in tensors:
        if t.numel() >= cap:
            out.append([t])
            continue
        cur, n = open_.get(t.dtype, ([], 0))
        if n + t.numel() > cap and cur:
            out.append(cur)
            cur, n = [], 0
        open_[t.dtype] = (cur + [t], n + t.numel())
    out += [cur for cur, _ in open_.values() if cur]
    return out


def sync_tensors(dmp: nn.Module) -> list[torch.Tensor]:
    """Every fused TBE's weights and optimizer-state tensors under ``dmp`` (what DMPCollection syncs, with
    every state of the optimizer rather than only ``sum``), each once."""
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import SplitTableBatchedEmbeddingBagsCodegen

    out: list[torch.Tensor] = []
    seen: set[int] = set()
    mods: list[nn.Module] = []
    for m in dmp.modules():
        mods.append(m)
        for lookup in getattr(m, "_lookups", []):  # TorchRec keeps the lookups in a plain list
            mods.extend(lookup.modules())
    for m in mods:
        if not isinstance(m, SplitTableBatchedEmbeddingBagsCodegen) or id(m) in seen:
            continue
        seen.add(id(m))
        out += list(m.split_embedding_weights())
        for state in m.get_optimizer_state():
            out += [v for v in state.values() if isinstance(v, torch.Tensor) and v.is_floating_point()]
    return [t for t in out if t.numel() > 0]


class ReplicaSync:
    """Averages the table replicas every ``interval`` optimizer steps (see the module docstring)."""

    def __init__(self, dmp: nn.Module, replica_group: dist.ProcessGroup | None, replicas: int, interval: int = 1) -> None:
        self.dmp = dmp
        self.group = replica_group
        self.replicas = replicas
        self.interval = max(1, interval)
        from torchrec.distributed.model_parallel import DMPCollection

        self.use_collection = isinstance(dmp, DMPCollection)
        self.tensors = [] if self.use_collection or replicas == 1 else sync_tensors(dmp)
        self.synced_step: int | None = None
        """The last optimizer step after which the replicas were averaged."""

    @property
    def enabled(self) -> bool:
        return self.replicas > 1

    def due(self, step: int) -> bool:
        """Whether the replicas are averaged after optimizer step ``step`` (0-based)."""
        return self.enabled and (step + 1) % self.interval == 0

    def after_step(self, step: int) -> None:
        """Call once per optimizer step (after every micro-batch's backward and the optimizers)."""
        if self.due(step):
            self.sync(step)

    @torch.no_grad()
    def sync(self, step: int | None = None) -> None:
        """Average now (also before a checkpoint that falls between two syncs, so that it holds one copy)."""
        if not self.enabled or (step is not None and self.synced_step == step):
            return
        with record_function(SYNC_RANGE):
            if self.use_collection:
                self.dmp.sync(include_optimizer_state=True)
            else:
                for bucket in _buckets(self.tensors, BUCKET_ELEMENTS):
                    if len(bucket) == 1:  # a large tensor: in place, no copy
                        dist.all_reduce(bucket[0], group=self.group)
                        bucket[0].div_(self.replicas)
                        continue
                    flat = torch.cat([t.reshape(-1) for t in bucket])
                    dist.all_reduce(flat, group=self.group)
                    flat.div_(self.replicas)
                    off = 0
                    for t in bucket:
                        n = t.numel()
                        t.copy_(flat[off : off + n].view_as(t))
                        off += n
        self.synced_step = step


__all__ = ["BUCKET_ELEMENTS", "SYNC_RANGE", "ReplicaSync", "sync_tensors"]
