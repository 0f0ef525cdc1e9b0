"""``coplan train plan.json``: launch the trainer with torchrun (one process per rank).

Imports no torch: the launcher only reads the plan, checks the process count against it, and
starts ``torchrun -m coplan.trainer.train``. A plan for several nodes cannot be launched from one
machine: the command prints the ``torchrun`` line to run on each node instead.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys

from coplan.errors import MismatchError
from coplan.spec import load_plan

_PASS = ("steps", "warmup", "runs_root", "run_id", "resume", "data", "data_samples", "seed", "device", "attention",
         "trace", "checkpoint_every", "keep_last_n", "log_every", "seq_chunk", "compile")
_FLAGS = ("allow_device_mismatch", "no_progress")


def _trainer_args(args: argparse.Namespace) -> list[str]:
    out = [args.plan]
    for k in _PASS:
        v = getattr(args, k)
        if v is not None:
            out += [f"--{k.replace('_', '-')}", str(v)]
    for k in _FLAGS:
        if getattr(args, k):
            out.append(f"--{k.replace('_', '-')}")
    return out


def torchrun_commands(args: argparse.Namespace, world_size: int, gpus_per_node: int, nodes: int) -> list[list[str]]:
    """One command per node (a single ``--standalone`` command for one node)."""
    tail = ["-m", "coplan.trainer.train", *_trainer_args(args)]
    if nodes == 1:
        return [[sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world_size}", *tail]]
    return [
        ["torchrun", f"--nnodes={nodes}", f"--node-rank={i}", f"--nproc-per-node={gpus_per_node}", "--rdzv-backend=c10d",
         f"--rdzv-endpoint={args.master}", f"--rdzv-id={args.run_id or 'coplan'}", *tail]
        for i in range(nodes)
    ]


def run_train(args: argparse.Namespace) -> int:
    plan = load_plan(args.plan)
    nproc = args.nproc if args.nproc is not None else plan.world_size
    if nproc != plan.world_size:
        raise MismatchError(
            f"{args.plan}: the plan is for {plan.world_size} ranks but --nproc is {nproc}; launch {plan.world_size} "
            f"processes, or re-plan for {nproc} GPUs"
        )
    nodes = plan.num_nodes if args.device != "cpu" else 1
    cmds = torchrun_commands(args, plan.world_size, plan.topology.gpus_per_node, nodes)
    if nodes > 1 or args.dry_run:
        if nodes > 1:
            print(f"# plan for {plan.world_size} GPUs on {nodes} nodes of '{plan.topology.name}': run on node i:")
        for c in cmds:
            print(shlex.join(c))
        return 0
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1" if args.device == "cpu" else env.get("OMP_NUM_THREADS", "8"))
    return subprocess.call(cmds[0], env=env)


def register_train(sub: argparse._SubParsersAction, help_text: str) -> None:
    p = sub.add_parser("train", help=help_text, description=help_text + ".")
    p.add_argument("plan", help="plan.json (from coplan plan, or python -m coplan.trainer.plans)")
    p.add_argument("--steps", type=int, default=None, help="total steps (default 20)")
    p.add_argument("--nproc", type=int, default=None, help="processes to launch (must equal the plan's world size)")
    p.add_argument("--warmup", type=int, default=None, help="steps left out of the statistics")
    p.add_argument("--runs-root", default=None, help="folder of run directories (default runs/)")
    p.add_argument("--run-id", default=None, help="run directory name")
    p.add_argument("--resume", default=None,
                   help="continue this run directory from its latest complete checkpoint ('auto': <runs-root>/<run-id> if it has one)")
    p.add_argument("--data", default=None, help="Parquet dataset folder (generated when missing)")
    p.add_argument("--data-samples", type=int, default=None, help="samples to generate when the dataset is missing")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    p.add_argument("--attention", choices=["triton", "reference", "flex"], default=None, help="override the attention backend")
    p.add_argument("--trace", default=None, help="'A:B' steps to profile, 'none', or 'auto'")
    p.add_argument("--checkpoint-every", type=int, default=None)
    p.add_argument("--keep-last-n", type=int, default=None, help="complete checkpoints to keep (default 2; 0: all)")
    p.add_argument("--log-every", type=int, default=None)
    p.add_argument("--seq-chunk", type=int, default=None, metavar="N",
                   help="sequence lookups' bags of at most N ids per sample's history (default 32; 0: one bag per sample)")
    p.add_argument("--compile", choices=["off", "layers", "layers-cpp"], default=None,
                   help="torch.compile each InterFormer/Kunlun layer with Inductor ('layers'; 'layers-cpp': with "
                        "Inductor's C++ wrapper); default off")
    p.add_argument("--allow-device-mismatch", action="store_true")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--master", default="MASTER_HOST:29500", help="rendezvous host:port printed for multi-node plans")
    p.add_argument("--dry-run", action="store_true", help="print the torchrun command instead of running it")
    p.set_defaults(func=run_train)


__all__ = ["register_train", "run_train", "torchrun_commands"]
