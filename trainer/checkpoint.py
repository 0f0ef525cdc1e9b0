"""Checkpoints with ``torch.distributed.checkpoint``: every rank writes its shards, and a resumed run
continues bit for bit (the data position is the step number; all random state is in the weights).

One checkpoint holds, through DCP, the model (TorchRec ShardedTensors for sharded tables, FSDP
DTensors for dense weights), the dense optimizer (FQN-keyed), the data-parallel tables' optimizer and
the step; and, one file per rank of one sparse group, the fused embedding optimizer's local shards
(``fused/rank<k>.pt``).
The fused state is kept apart because TorchRec lists a table's optimizer state only on the ranks
holding a shard of it, and DCP takes keys that differ between ranks for a pre-2.4 checkpoint and
refuses to load. A resumed run has the same plan (checked), hence the same shards on each rank.

With 2-D sparse parallelism (several replicas of the tables) one copy is written: the replicas are synced
first (:class:`~coplan.trainer.distributed.replica_sync.ReplicaSync`; a no-op right after a step's own
sync), TorchRec describes each shard as a DTensor over the ``(sparse_replicate, sparse_shard)`` mesh, DCP
writes each distinct shard once, and only the first sparse group writes the fused state; rank ``k`` of
every group reads ``fused/rank<k mod S>.pt``.
Each rank's RNG states (torch, numpy, python) go in ``rng/rank<k>.pt``: the model draws no random
numbers while training today, but a resumed run must not depend on that staying true.

Atomicity: a checkpoint is written into ``step_<n>.tmp/``; once every rank has written its part
(barrier), rank 0 writes the ``COMPLETE`` marker last and renames the folder to ``step_<n>/``. A
folder that is still ``.tmp`` or has no marker was interrupted (a killed rank, a full disk) and is
never loaded: :func:`scan` lists it as incomplete and the previous complete one is used.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
from torch.distributed.tensor import DTensor, Shard

from coplan.errors import CoplanError
from coplan.spec import RunDir
from coplan.trainer.distributed.embedding import local_shards
from coplan.trainer.optim import Optimizers
from coplan.trainer.parallelize import ParallelModel

STEP_PREFIX = "step_"
TMP_SUFFIX = ".tmp"
MARKER = "COMPLETE"


def _is_expert(key: str) -> bool:
    return ".experts.w13" in key or ".experts.w2" in key


def _expert_view(t: DTensor, ep_mesh) -> DTensor:
    """This EP rank's experts (gathered over their FSDP mesh) as its Shard(0) of all experts over the EP
    mesh: the same key then means the same global tensor on every rank, as DCP needs."""
    return DTensor.from_local(t.full_tensor(), ep_mesh, [Shard(0)], run_check=False)


def _copy_expert(dst: DTensor, src_local: torch.Tensor) -> None:
    """Write this EP rank's experts ``src_local`` into the FSDP shard ``dst`` of them."""
    part = src_local
    for dim, pl in enumerate(dst.placements):
        if isinstance(pl, Shard):
            part = torch.chunk(part, dst.device_mesh.size(dim), dim=pl.dim)[dst.device_mesh.get_local_rank(dim)]
    with torch.no_grad():
        dst.to_local().copy_(part)


def _globalise(tree: Any, ep_mesh, key: str = "") -> Any:
    if isinstance(tree, dict):
        return {k: _globalise(v, ep_mesh, f"{key}.{k}" if key else str(k)) for k, v in tree.items()}
    if ep_mesh is not None and isinstance(tree, DTensor) and _is_expert(key):
        return _expert_view(tree, ep_mesh)
    return tree


def _localise(saved: Any, live: Any, ep_mesh, key: str = "") -> None:
    """Copy the loaded expert views back into the live (FSDP-sharded) expert tensors."""
    if isinstance(saved, dict):
        for k, v in saved.items():
            _localise(v, live[k], ep_mesh, f"{key}.{k}" if key else str(k))
    elif ep_mesh is not None and isinstance(live, DTensor) and _is_expert(key):
        _copy_expert(live, saved.to_local())


def _state(pm: ParallelModel, optims: Optimizers, step: int) -> dict[str, Any]:
    tables: dict[str, Any] = {}
    if optims.tables is not None:
        params = [p for g in optims.tables.param_groups for p in g["params"]]
        for name, p in zip(optims.dp_names, params):
            tables[name] = dict(optims.tables.state[p])
    return {
        "model": _globalise(pm.dmp.state_dict(), pm.ep_mesh),
        "dense_optim": _globalise(get_optimizer_state_dict(pm.model.dense, optims.dense), pm.ep_mesh),
        "table_optim": tables,
        "step": torch.tensor(step, dtype=torch.int64),
    }


def _fused_local(pm: ParallelModel) -> dict[str, torch.Tensor]:
    """This rank's shards of the fused optimizer state, as views of the live buffers."""
    out: dict[str, torch.Tensor] = {}
    for pkey, st in pm.dmp.fused_optimizer.state_dict()["state"].items():
        for skey, v in st.items():
            if hasattr(v, "local_shards") or isinstance(v, DTensor):
                for i, (t, _) in enumerate(local_shards(v)):
                    out[f"{pkey}/{skey}/{i}"] = t
            elif isinstance(v, torch.Tensor):
                out[f"{pkey}/{skey}"] = v
    return out


def _fused_file(path: Path, pm: ParallelModel, rank: int) -> Path:
    """The fused-state file of this rank's shards: one per rank of the first sparse group (replicas of the
    tables hold the same shards, synced before saving, so one copy is written)."""
    return path / "fused" / f"rank{rank % pm.sparse_shard}.pt"


def _rng_state() -> dict[str, Any]:
    out: dict[str, Any] = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state()
    return out


def _set_rng_state(st: dict[str, Any]) -> None:
    torch.set_rng_state(st["torch"])
    np.random.set_state(st["numpy"])
    random.setstate(st["python"])
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state(st["cuda"])


def _step_of(path: Path) -> int | None:
    name = path.name.removesuffix(TMP_SUFFIX)
    try:
        return int(name[len(STEP_PREFIX):])
    except ValueError:
        return None


@dataclass(frozen=True)
class Scan:
    """The checkpoints of a run directory, oldest first."""

    complete: list[Path] = field(default_factory=list)
    incomplete: list[Path] = field(default_factory=list)
    """Interrupted while being written (``.tmp`` or no ``COMPLETE`` marker): never loaded."""

    @property
    def latest(self) -> Path | None:
        return self.complete[-1] if self.complete else None


def scan(run_dir: Path) -> Scan:
    complete, incomplete = [], []
    root = RunDir(run_dir).checkpoints_dir
    found = [p for p in root.glob(f"{STEP_PREFIX}*") if p.is_dir() and _step_of(p) is not None] if root.is_dir() else []
    for p in sorted(found, key=lambda q: (_step_of(q), q.name)):
        ok = not p.name.endswith(TMP_SUFFIX) and (p / MARKER).is_file() and (p / ".metadata").is_file()
        (complete if ok else incomplete).append(p)
    return Scan(complete, incomplete)


def save(run_dir: Path, pm: ParallelModel, optims: Optimizers, step: int, keep: int = 2) -> Path:
    """Write ``checkpoints/step_<step>`` (after ``step`` has run), atomically; keeps the ``keep``
    newest complete ones (0: all). Every rank calls it."""
    root = RunDir(run_dir).checkpoints_dir
    path = root / f"{STEP_PREFIX}{step:08d}"
    tmp = path.with_name(path.name + TMP_SUFFIX)
    rank = dist.get_rank()
    if pm.replica_sync is not None:
        # one copy of the tables is written (DCP keeps one of identical shards): the replicas must be
        # identical, which they are only after a sync when the plan syncs less often than every step
        pm.replica_sync.sync(step)
    if rank == 0:  # a leftover of an interrupted save of the same step
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    dcp.save(_state(pm, optims, step), checkpoint_id=str(tmp))
    (tmp / "fused").mkdir(parents=True, exist_ok=True)
    (tmp / "rng").mkdir(parents=True, exist_ok=True)
    if rank < pm.sparse_shard:
        torch.save({k: v.detach().cpu() for k, v in _fused_local(pm).items()}, _fused_file(tmp, pm, rank))
    torch.save(_rng_state(), tmp / "rng" / f"rank{rank}.pt")
    dist.barrier()  # every rank's part is on disk before the marker says so
    if rank == 0:
        (tmp / MARKER).write_text(json.dumps({"step": step, "world_size": dist.get_world_size()}) + "\n")
        if path.exists():  # an older incomplete folder of this step (no marker): replaced
            shutil.rmtree(path)
        os.replace(tmp, path)
        if keep > 0:
            for old in scan(run_dir).complete[:-keep]:
                shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return path


def latest(run_dir: Path) -> Path | None:
    """The newest complete checkpoint (incomplete ones are skipped; see :func:`scan`)."""
    return scan(run_dir).latest


def load(path: Path, pm: ParallelModel, optims: Optimizers) -> int:
    """Restore everything from ``path``; returns the step it was taken after."""
    if not (path / ".metadata").is_file():
        raise CoplanError(f"{path}: not a torch.distributed.checkpoint directory (no .metadata)")
    if not (path / MARKER).is_file():
        raise CoplanError(f"{path}: incomplete checkpoint (no {MARKER} marker: interrupted while being written)")
    state = _state(pm, optims, -1)
    # ShardedTensors of tables with no shard on this rank must stay in the state: flattening drops
    # them, and DCP then mistakes the checkpoint for a pre-2.4 one.
    dcp.load(state, checkpoint_id=str(path), planner=DefaultLoadPlanner(flatten_sharded_tensors=False))
    model_sd = pm.dmp.state_dict()
    _localise(state["model"], model_sd, pm.ep_mesh)
    state["model"] = {k: (model_sd[k] if pm.ep_mesh is not None and _is_expert(k) else v) for k, v in state["model"].items()}
    pm.dmp.load_state_dict(state["model"])
    optim_sd = get_optimizer_state_dict(pm.model.dense, optims.dense)
    _localise(state["dense_optim"], optim_sd, pm.ep_mesh)
    if pm.ep_mesh is not None:
        for fqn, st in state["dense_optim"]["state"].items():
            if _is_expert(fqn):
                st.update({k: optim_sd["state"][fqn][k] for k, v in st.items() if isinstance(v, DTensor)})
    set_optimizer_state_dict(pm.model.dense, optims.dense, state["dense_optim"])
    fused_file = _fused_file(path, pm, dist.get_rank())
    saved = torch.load(fused_file, map_location="cpu") if fused_file.is_file() else {}
    live = _fused_local(pm)
    if set(saved) != set(live):
        raise CoplanError(f"{fused_file}: the fused optimizer state does not match this rank's table shards "
                          "(was the checkpoint written by another plan or world size?)")
    with torch.no_grad():
        for k, v in live.items():
            v.copy_(saved[k])
    if optims.tables is not None:
        params = [p for g in optims.tables.param_groups for p in g["params"]]
        for name, p in zip(optims.dp_names, params):
            for k, v in state["table_optim"].get(name, {}).items():
                if isinstance(v, torch.Tensor) and isinstance(optims.tables.state[p].get(k), torch.Tensor):
                    optims.tables.state[p][k].copy_(v)
    rng_file = path / "rng" / f"rank{dist.get_rank()}.pt"
    if rng_file.is_file():
        _set_rng_state(torch.load(rng_file, map_location="cpu", weights_only=False))
    return int(state["step"])


__all__ = ["MARKER", "Scan", "latest", "load", "save", "scan"]
