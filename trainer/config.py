"""The trainer's options for one run, typed and frozen, built once from the command line
(:func:`configs`), the launch this process belongs to (:class:`Ranks`, from torchrun's environment)
and its check against the plan (:func:`check_launch`). Torch-free: the entry checks a launch before
the heavy imports.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Literal

from coplan.errors import CoplanError, MismatchError
from coplan.spec import Plan, RunDir


DEFAULT_STEPS = 20
"""Steps of a run when ``--steps`` is not given."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainConfig:
    """One run's options (a sweep of several plans has one per plan)."""

    plan: Path
    """plan.json of this run."""
    steps: int = DEFAULT_STEPS
    """Total steps of the run (a resumed run continues up to it)."""
    warmup: int | None = None
    """Leading steps left out of the statistics (None: min(5, steps / 4))."""
    runs_root: Path = Path("runs")
    """Folder holding run directories (and generated datasets, under ``data/``)."""
    run_id: str | None = None
    """Run directory name (None: ``<workload>-<ranks>r-<UTC time>``, chosen by rank 0)."""
    resume: Path | None = None
    """Run directory to continue from its latest complete checkpoint (``--resume auto`` resolved)."""
    data: Path | None = None
    """Dataset folder (None: one per workload and seed under ``<runs_root>/data``)."""
    data_samples: int | None = None
    """Samples to generate when the dataset is missing (None: 32 global batches)."""
    seed: int = 0
    """Seed of the weights and of generated data."""
    device: Literal["auto", "cuda", "cpu"] = "auto"
    """``cpu`` is a functional run on gloo; ``auto`` needs CUDA."""
    attention: str | None = None
    """Attention backend overriding the plan's (None: the plan's)."""
    trace: str = "auto"
    """Profiled steps: ``A:B``, ``none`` or ``auto`` (the 3 steps after warm-up)."""
    checkpoint_every: int = 0
    """Checkpoint every N steps (0: at the end only; -1: never)."""
    keep_last_n: int = 2
    """Complete checkpoints to keep (0: all)."""
    log_every: int | None = None
    """Read metrics back every N steps (None: 1 on CPU, 10 on CUDA)."""
    compile: Literal["off", "layers", "layers-cpp"] = "off"
    """torch.compile of the InterFormer and Kunlun layers."""
    cuda_graphs: Literal["auto", "on", "off"] = "auto"
    """The dense arch's forward and backward as CUDA graphs per padded history length where they apply
    (:mod:`coplan.trainer.graphs`); ``on``: also over layers compiled by ``compile`` (Inductor's fused kernels
    replayed as graphs; not yet measured on a GPU, so not what ``auto`` does); ``off``: eager."""
    seq_chunk: int = 32
    """Sequence lookups' bags of at most N ids per sample's history (0: one bag per sample)."""
    fp8_guard_every: int = 50
    """The FP8 numerics guard checks every N steps and the first (:mod:`coplan.trainer.fp8_guard`; 0: off)."""
    allow_device_mismatch: bool = False
    """Run a plan on GPUs other than its topology's."""
    progress: bool = True
    """Rank 0 shows a progress bar."""
    last_plan: bool = True
    """This run closes the process group (the last plan of a sweep)."""

    def warmup_steps(self) -> int:
        return self.warmup if self.warmup is not None else min(5, self.steps // 4)

    def log_interval(self, device_type: str) -> int:
        """Metrics are read back from the device every this many steps (reading back waits for the GPU)."""
        return max(1, self.log_every or (10 if device_type == "cuda" else 1))

    def as_json(self) -> dict:
        """This launch's switches, as ``config.json`` records them (calibration reads ``seq_chunk``)."""
        return {k: str(v) if isinstance(v, Path) else v for k, v in asdict(self).items()}


@dataclass(frozen=True, slots=True)
class Ranks:
    """This process's place in the launch (torchrun's environment; one process without it)."""

    world: int
    rank: int
    local_rank: int
    local_world: int

    @classmethod
    def from_env(cls) -> "Ranks":
        world = int(os.environ.get("WORLD_SIZE", "1"))
        return cls(world=world, rank=int(os.environ.get("RANK", "0")), local_rank=int(os.environ.get("LOCAL_RANK", "0")),
                   local_world=int(os.environ.get("LOCAL_WORLD_SIZE", str(world))))


def check_launch(plan: Plan, *, world_size: int, local_world_size: int, device_type: str, device_name: str,
                 allow_device_mismatch: bool = False) -> None:
    """Refuse a launch that does not match the plan (world size, GPU model, GPUs per node)."""
    if world_size != plan.world_size:
        raise MismatchError(
            f"the plan is for {plan.world_size} ranks ({plan.num_nodes} node(s) of topology '{plan.topology.name}') but "
            f"{world_size} processes were launched; launch with --nproc {plan.world_size}, or re-plan for {world_size} GPUs"
        )
    if device_type != "cuda":
        return
    want = plan.topology.gpu.name.lower()
    have = device_name.lower()
    if want not in have and have not in want and not allow_device_mismatch:
        raise MismatchError(
            f"the plan's topology '{plan.topology.name}' has {plan.topology.gpu.name} GPUs but this machine has "
            f"'{device_name}'; re-plan for this machine's topology, or pass --allow-device-mismatch"
        )
    if plan.num_nodes > 1 and local_world_size != plan.topology.gpus_per_node:
        raise MismatchError(
            f"the plan puts {plan.topology.gpus_per_node} ranks on each node but {local_world_size} were launched on "
            "this node; launch one process per GPU of every node"
        )


def resolve_resume(resume: str | None, runs_root: Path, run_id: str | None) -> Path | None:
    """``auto``: ``<runs_root>/<run_id>`` when it holds a run (what a torchrun restart needs), else a new run."""
    if resume != "auto":
        return Path(resume) if resume else None
    if not run_id:
        raise CoplanError("--resume auto needs --run-id: a restarted job must find the same run directory")
    found = runs_root / run_id
    return found if RunDir(found).plan_path.is_file() else None


def configs(args: argparse.Namespace) -> list[TrainConfig]:
    """One config per plan of the command line; several plans run in turn, each in a run directory of its
    own (``<run id>-<plan file stem>``)."""
    plans = list(args.plan)
    if len(plans) > 1 and args.resume:
        raise CoplanError("--resume continues one run: give one plan with it")
    runs_root = Path(args.runs_root)
    out = []
    for i, path in enumerate(plans):
        run_id = args.run_id
        if len(plans) > 1:
            stem = Path(path).stem
            run_id = f"{run_id}-{stem}" if run_id else f"{stem}-{datetime.now(timezone.utc).strftime('%Y%m%d-%H%M%S')}"
        out.append(TrainConfig(
            plan=Path(path), steps=args.steps, warmup=args.warmup, runs_root=runs_root, run_id=run_id,
            resume=resolve_resume(args.resume, runs_root, run_id), data=Path(args.data) if args.data else None,
            data_samples=args.data_samples, seed=args.seed, device=args.device, attention=args.attention,
            trace=args.trace, checkpoint_every=args.checkpoint_every, keep_last_n=args.keep_last_n,
            log_every=args.log_every, compile=args.compile, seq_chunk=args.seq_chunk,
            cuda_graphs=getattr(args, "cuda_graphs", None) or "auto",
            fp8_guard_every=50 if getattr(args, "fp8_guard_every", None) is None else args.fp8_guard_every,
            allow_device_mismatch=args.allow_device_mismatch, progress=not args.no_progress,
            last_plan=i == len(plans) - 1))
    return out


__all__ = ["DEFAULT_STEPS", "Ranks", "TrainConfig", "check_launch", "configs", "resolve_resume"]
