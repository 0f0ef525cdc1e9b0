"""Checkpoints with ``torch.distributed.checkpoint``: every rank writes its shards, and a resumed run
continues bit for bit (the data position is the step number; all random state is in the weights).

One checkpoint holds the model (TorchRec ShardedTensors for sharded tables, FSDP DTensors for dense
weights), the dense optimizer (FQN-keyed), the fused embedding optimizer's sharded state, the state
of the data-parallel tables' optimizer, and the step.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

from coplan.errors import CoplanError
from coplan.trainer.optim import Optimizers
from coplan.trainer.parallelize import ParallelModel

STEP_PREFIX = "step_"


def _state(pm: ParallelModel, optims: Optimizers, step: int) -> dict[str, Any]:
    tables: dict[str, Any] = {}
    if optims.tables is not None:
        params = [p for g in optims.tables.param_groups for p in g["params"]]
        for name, p in zip(optims.dp_names, params):
            tables[name] = dict(optims.tables.state[p])
    return {
        "model": pm.dmp.state_dict(),
        "dense_optim": get_optimizer_state_dict(pm.model.dense, optims.dense),
        "fused_optim": pm.dmp.fused_optimizer.state_dict(),
        "table_optim": tables,
        "step": torch.tensor(step, dtype=torch.int64),
    }


def save(run_dir: Path, pm: ParallelModel, optims: Optimizers, step: int, keep: int = 2) -> Path:
    """Write ``checkpoints/step_<step>`` (after ``step`` has run); keeps the ``keep`` newest."""
    root = run_dir / "checkpoints"
    path = root / f"{STEP_PREFIX}{step:08d}"
    dcp.save(_state(pm, optims, step), checkpoint_id=str(path))
    if dist.get_rank() == 0:
        olds = sorted(root.glob(f"{STEP_PREFIX}*"))[:-keep] if keep > 0 else []
        for old in olds:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return path


def latest(run_dir: Path) -> Path | None:
    found = sorted((run_dir / "checkpoints").glob(f"{STEP_PREFIX}*"))
    return found[-1] if found else None


def load(path: Path, pm: ParallelModel, optims: Optimizers) -> int:
    """Restore everything from ``path``; returns the step it was taken after."""
    if not (path / ".metadata").is_file():
        raise CoplanError(f"{path}: not a torch.distributed.checkpoint directory (no .metadata)")
    state = _state(pm, optims, -1)
    dcp.load(state, checkpoint_id=str(path))
    pm.dmp.load_state_dict(state["model"])
    set_optimizer_state_dict(pm.model.dense, optims.dense, state["dense_optim"])
    pm.dmp.fused_optimizer.load_state_dict(state["fused_optim"])
    if optims.tables is not None:
        params = [p for g in optims.tables.param_groups for p in g["params"]]
        for name, p in zip(optims.dp_names, params):
            for k, v in state["table_optim"].get(name, {}).items():
                if isinstance(v, torch.Tensor) and isinstance(optims.tables.state[p].get(k), torch.Tensor):
                    optims.tables.state[p][k].copy_(v)
    return int(state["step"])


__all__ = ["latest", "load", "save"]
