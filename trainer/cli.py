"""``coplan train plan.json [more.json ...]``: launch the trainer with torchrun (one process per rank).

Imports no torch: the launcher reads the plans and refuses, before torchrun starts a single worker,
everything it can tell from them and the command line (:func:`check_plans`: each plan's validity, its
world size against ``--nproc``, the table layouts the trainer runs, the workload's shape, the device).
Then it starts ``torchrun -m coplan.trainer.train`` through :func:`torchrun_main`, which prints one line
per failed launch instead of the elastic agent's error dump (the failing rank has printed its own message
above it). A plan for several nodes cannot be launched from one machine: the command prints the
``torchrun`` line to run on each node instead.

Several plans of one world size run in turn in the same workers (a sweep: one torchrun start, each plan
with a run directory of its own, ``<run id>-<plan file stem>``).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

from coplan.cli_args import (
    MAX_SEED,
    checkpoint_every,
    gpu_count,
    host_port,
    name_part,
    non_negative_int,
    positive_int,
    sample_count,
    seed,
    steps_count,
    trace_window,
)
from coplan.errors import CoplanError, MismatchError
from coplan.spec import Plan, load_plan
from coplan.trainer.config import DEFAULT_STEPS

LAUNCH_T = time.time()
"""When this command started (imported as ``coplan train`` dispatches to it)."""

_PASS = ("steps", "warmup", "runs_root", "run_id", "resume", "data", "data_samples", "seed", "device", "attention",
         "trace", "checkpoint_every", "keep_last_n", "log_every", "seq_chunk", "compile", "cuda_graphs",
         "fp8_guard_every")
_FLAGS = ("allow_device_mismatch", "no_progress")


def _plans_of(args: argparse.Namespace) -> list[str]:
    return [args.plan] if isinstance(args.plan, str) else list(args.plan)


def _trainer_args(args: argparse.Namespace) -> list[str]:
    out = _plans_of(args)
    for k in _PASS:
        v = getattr(args, k)
        if v is not None:
            out += [f"--{k.replace('_', '-')}", str(v)]
    for k in _FLAGS:
        if getattr(args, k):
            out.append(f"--{k.replace('_', '-')}")
    return out


def torchrun_commands(args: argparse.Namespace, world_size: int, gpus_per_node: int, nodes: int) -> list[list[str]]:
    """One command per node (a single ``--standalone`` command for one node, through :func:`torchrun_main`)."""
    tail = ["-m", "coplan.trainer.train", *_trainer_args(args)]
    if nodes == 1:
        return [[sys.executable, "-m", "coplan.trainer.cli", "--standalone", f"--nproc-per-node={world_size}", *tail]]
    return [
        ["torchrun", f"--nnodes={nodes}", f"--node-rank={i}", f"--nproc-per-node={gpus_per_node}", "--rdzv-backend=c10d",
         f"--rdzv-endpoint={args.master}", f"--rdzv-id={args.run_id or 'coplan'}", *tail]
        for i in range(nodes)
    ]


def check_plan(plan: Plan, *, where: str, nproc: int | None = None) -> None:
    """Refuse, from the plan alone, a launch the workers would refuse (torch-free; the workers check again)."""
    from coplan.spec.workload import MoEBlock
    from coplan.trainer.distributed.layout import table_problems
    from coplan.trainer.features import check_buildable

    if nproc is not None and nproc != plan.world_size:
        raise MismatchError(f"{where}: the plan is for {plan.world_size} ranks but --nproc is {nproc}; launch "
                            f"{plan.world_size} processes, or re-plan for {nproc} GPUs")
    try:
        check_buildable(plan.workload)  # the inputs and block shapes the trainer builds the workload's model from
    except CoplanError as e:
        raise MismatchError(f"{where}: {e}") from None
    problems = table_problems(plan)
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise MismatchError(f"{where}: " + "; ".join(problems[:3]) + more + "; re-plan (or pin another sharding with --pin-table)")
    ep = plan.mesh.expert_parallel
    for b in plan.workload.blocks:
        if isinstance(b, MoEBlock) and b.num_experts % ep:
            raise MismatchError(f"{where}: block '{b.name}' has {b.num_experts} experts, which do not split evenly over "
                                f"expert-parallel degree {ep}; re-plan")
    from coplan.costmodel.flops import recomputable_layers

    known = list(recomputable_layers(plan.workload))  # the layers the trainer wraps in activation checkpointing
    unknown = sorted({lp.name for lp in plan.layers if lp.recompute} - set(known))
    if unknown:
        raise MismatchError(f"{where}: the plan recomputes {unknown[:4]}, which are not layers the trainer can recompute "
                            f"(this workload's: {known[:6]}{' ...' if len(known) > 6 else ''}); re-plan")
    fp8 = sorted(lp.name for lp in plan.layers if lp.precision == "fp8")
    if fp8 and plan.precision.fp8 == "off":
        raise MismatchError(f"{where}: the plan puts {fp8[:4]} in fp8 while precision.fp8 is 'off'; re-plan")


def check_options(args: argparse.Namespace) -> None:
    """The trainer's options that the launcher can check alone (each number's range is checked by its
    ``type=``; here, what depends on several options or on the file system)."""
    trace = getattr(args, "trace", None)
    if trace not in (None, "auto", "none"):
        try:
            trace_window(trace)
        except argparse.ArgumentTypeError as e:
            raise MismatchError(f"--trace {trace}: {e}") from None
    for name in ("steps", "data_samples"):
        v = getattr(args, name, None)
        if v is not None and v < 1:
            raise MismatchError(f"--{name.replace('_', '-')} {v}: expected at least 1")
    steps = getattr(args, "steps", None) or DEFAULT_STEPS
    warmup = getattr(args, "warmup", None)
    if warmup is not None and warmup >= steps:
        raise MismatchError(f"--warmup {warmup}: must be below the {steps} steps of the run (--steps), or no step is "
                            "measured; give fewer warm-up steps or more steps")
    resume = getattr(args, "resume", None)
    if resume and len(_plans_of(args)) > 1:
        raise MismatchError("--resume continues one run: give one plan with it")
    if resume == "auto" and not getattr(args, "run_id", None):
        raise MismatchError("--resume auto needs --run-id: a restarted job must find the same run directory")
    if resume not in (None, "auto") and not Path(resume).is_dir():
        raise MismatchError(f"--resume {resume}: no such run directory; give a run directory written by `coplan train` "
                            "(runs/<id>/), or 'auto' with --run-id")
    for flag, name in (("--runs-root", "runs_root"), ("--data", "data")):
        v = getattr(args, name, None)
        if v is not None and Path(v).exists() and not Path(v).is_dir():
            raise MismatchError(f"{flag} {v}: is a file, not a folder; give a folder (created when missing)")


def _no_nvidia_gpu() -> bool:
    """Whether this machine surely has no NVIDIA GPU (no device node and no nvidia-smi), torch-free."""
    import glob
    import shutil

    return not glob.glob("/dev/nvidia[0-9]*") and shutil.which("nvidia-smi") is None


def check_device(args: argparse.Namespace, plan: Plan) -> None:
    """A GPU launch on a machine without GPUs, refused before torchrun (the workers check the GPU model)."""
    device = getattr(args, "device", "auto")
    if device in ("auto", "cuda") and not getattr(args, "dry_run", False) and plan.num_nodes == 1 and _no_nvidia_gpu():
        raise MismatchError(f"--device {device}: this machine has no NVIDIA GPU, and the plan is for "
                            f"{plan.topology.gpu.name} GPUs; pass --device cpu for a functional run on CPU processes "
                            "(gloo), whose timings say nothing about the plan")


def check_plans(args: argparse.Namespace) -> list[Plan]:
    """Every plan of the command line loaded and checked (:func:`check_plan`), and the command line with them."""
    check_options(args)
    paths = _plans_of(args)
    plans = [load_plan(p) for p in paths]
    nproc = getattr(args, "nproc", None)
    for path, plan in zip(paths, plans):
        check_plan(plan, where=path, nproc=nproc)
    if len(plans) > 1:
        sizes = {p.world_size for p in plans}
        if len(sizes) > 1:
            raise MismatchError(f"plans for different world sizes ({sorted(sizes)}) cannot share one launch: run one "
                                "`coplan train` per world size")
        if getattr(args, "data", None):
            from coplan.trainer.data import data_sha256  # (pyarrow, no torch)

            if len({data_sha256(p.workload) for p in plans}) > 1:
                raise MismatchError("--data is one dataset; these plans' workloads read different inputs (leave --data "
                                    "out: each gets its own under <runs-root>/data)")
        stems = [Path(p).stem for p in paths]
        if len(set(stems)) != len(stems):
            raise MismatchError(f"plan file names must differ (each run directory is named after its plan): {stems}")
    check_device(args, plans[0])
    return plans


def check_installed() -> None:
    """The training extra, checked before torchrun starts (each worker would fail on its import); the
    ``coplan`` command names the extra to install."""
    for module in ("torch", "torchrec"):
        if importlib.util.find_spec(module) is None:
            raise ModuleNotFoundError(f"No module named '{module}'", name=module)


def run_train(args: argparse.Namespace) -> int:
    plans = check_plans(args)
    plan = plans[0]
    nodes = plan.num_nodes if args.device != "cpu" else 1
    if nodes > 1 and len(plans) > 1:
        raise MismatchError("several plans in one launch run on one node (or --device cpu); launch multi-node plans one by one")
    cmds = torchrun_commands(args, plan.world_size, plan.topology.gpus_per_node, nodes)
    if nodes > 1 or args.dry_run:
        if nodes > 1:
            print(f"# plan for {plan.world_size} GPUs on {nodes} nodes of '{plan.topology.name}': run on node i:")
        for c in cmds:
            print(shlex.join(c))
        return 0
    check_installed()
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1" if args.device == "cpu" else env.get("OMP_NUM_THREADS", "8"))
    env["COPLAN_LAUNCH_T"] = repr(LAUNCH_T)  # summary.json's startup counts from here (trainer/startup.py)
    env["COPLAN_LAUNCHER"] = "1"  # the workers leave their error messages to torchrun_main (trainer.train.LAUNCHER_ENV)
    return subprocess.call(cmds[0], env=env)


def _error_file_message(path: str | None) -> str | None:
    """The message a worker left in torchrun's error file (``{"message": {"message": ...}}``), if any."""
    import json

    if not path or not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            m = json.load(f).get("message")
    except (OSError, ValueError):
        return None
    if isinstance(m, dict):
        m = m.get("message")
    return m if isinstance(m, str) and m else None


def torchrun_main(argv: list[str]) -> int:
    """torchrun, minus the elastic agent's error dump: the first failing rank's one-line message (which
    ``coplan.trainer.train.main`` leaves in torchrun's error file), or one line naming the rank and how it
    stopped (``COPLAN_DEBUG=1``: torchrun's own report, and every rank's traceback)."""
    if os.environ.get("COPLAN_DEBUG"):
        from torch.distributed.run import main

        main(argv)
        return 0
    import logging

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    try:
        run(parse_args(argv))
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        code = failure.exitcode
        message = _error_file_message(failure.error_file)
        if message:
            print(message, file=sys.stderr, flush=True)  # the rank's own message
        else:
            how = f"signal {-code}" if code < 0 else f"exit code {code}"
            print(f"error: the trainer's rank {rank} stopped ({how}) before it could say why; its output is above "
                  "(COPLAN_DEBUG=1 for torchrun's report)", file=sys.stderr, flush=True)
        return code if code > 0 else 1
    return 0


def register_train(sub: argparse._SubParsersAction, help_text: str) -> None:
    p = sub.add_parser("train", help=help_text, description=help_text + ".")
    p.add_argument("plan", nargs="+", help="plan.json (from coplan plan, or python -m coplan.planner.given); several "
                   "plans of one world size run in turn in the same workers, each in <run id>-<plan file stem>")
    p.add_argument("--steps", type=steps_count, default=None, help=f"total steps (default {DEFAULT_STEPS})")
    p.add_argument("--nproc", type=gpu_count, default=None, help="processes to launch (must equal the plan's world size)")
    p.add_argument("--warmup", type=non_negative_int, default=None, help="steps left out of the statistics (fewer than --steps)")
    p.add_argument("--runs-root", default=None, help="folder of run directories (default runs/)")
    p.add_argument("--run-id", type=name_part, default=None, help="run directory name")
    p.add_argument("--resume", default=None,
                   help="continue this run directory from its latest complete checkpoint ('auto': <runs-root>/<run-id> if it has one)")
    p.add_argument("--data", default=None, help="Parquet dataset folder (generated when missing)")
    p.add_argument("--data-samples", type=sample_count, default=None, help="samples to generate when the dataset is missing")
    p.add_argument("--seed", type=seed, default=None, help=f"seed of the weights and of generated data (0 to {MAX_SEED:,})")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    p.add_argument("--attention", choices=["triton", "reference", "flex"], default=None, help="override the attention backend")
    p.add_argument("--trace", default=None, help="'A:B' steps to profile, 'none', or 'auto' (checked with the other options)")
    p.add_argument("--checkpoint-every", type=checkpoint_every, default=None,
                   help="checkpoint every N steps (0: at the end only; -1: never)")
    p.add_argument("--keep-last-n", type=non_negative_int, default=None, help="complete checkpoints to keep (default 2; 0: all)")
    p.add_argument("--log-every", type=positive_int, default=None, help="read metrics back every N steps")
    p.add_argument("--seq-chunk", type=non_negative_int, default=None, metavar="N",
                   help="sequence lookups' bags of at most N ids per sample's history (default 32; 0: one bag per sample)")
    p.add_argument("--compile", choices=["off", "layers", "layers-cpp"], default=None,
                   help="torch.compile each InterFormer/Kunlun layer with Inductor ('layers'; 'layers-cpp': with "
                        "Inductor's C++ wrapper); default off")
    p.add_argument("--cuda-graphs", choices=["auto", "on", "off"], default=None,
                   help="the dense forward+backward as CUDA graphs per padded history length where they apply "
                        "(auto: one GPU, no --compile; on: also over --compile'd layers, not yet measured on a GPU; "
                        "default auto)")
    p.add_argument("--fp8-guard-every", type=non_negative_int, default=None, metavar="N",
                   help="the FP8 layers' numerics guard checks every N steps and the first; a layer whose FP8 output "
                        "overflows or strays from the compute dtype's falls back to it (default 50; 0: off)")
    p.add_argument("--allow-device-mismatch", action="store_true")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--master", type=host_port, default="MASTER_HOST:29500", help="rendezvous host:port printed for multi-node plans")
    p.add_argument("--dry-run", action="store_true", help="check the plans and print the torchrun command instead of running it")
    p.set_defaults(func=run_train)


__all__ = ["check_device", "check_installed", "check_options", "check_plan", "check_plans", "register_train", "run_train", "torchrun_commands", "torchrun_main"]


if __name__ == "__main__":  # the launcher's torchrun (see torchrun_main)
    sys.exit(torchrun_main(sys.argv[1:]))
