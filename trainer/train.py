"""The trainer's entry, one process per rank (``torchrun -m coplan.trainer.train plan.json ...``).

``coplan train`` launches this; it can also be run under torchrun directly. The command line becomes
one frozen :class:`~coplan.trainer.config.TrainConfig` per plan; :func:`coplan.trainer.loop.train`
runs it in named steps. Per step: read this
rank's balanced share of the global batch (prefetched on a thread), forward through the sharded
model, loss = this rank's share of the global mean BCE, backward (the fused embedding optimizer
updates in backward), dense and data-parallel-table optimizer steps. Warm-up steps are excluded
from the statistics; metrics are read back from the device only every ``--log-every`` steps.

Run directory (``runs/<id>/``): ``plan.json``, ``config.json`` (this launch's switches),
``metrics.jsonl``, ``summary.json``, ``traces/rank<k>.json``, ``checkpoints/step_<n>/``.

Reliability (docs/reliability.md): ``--resume auto`` with a fixed ``--run-id`` continues the run
directory from its newest complete checkpoint when it has one, so that ``torchrun --max-restarts``
restarts a job where it stopped; metrics lines of steps after the checkpoint are dropped, since
those steps run again. A non-finite loss or dense gradient stops the run before any later
checkpoint is written (:class:`~coplan.trainer.loop.NumericalError`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import NoReturn

from coplan.cli_args import checkpoint_every, name_part, non_negative_int, positive_int, sample_count, seed, steps_count, trace_window
from coplan.errors import CoplanError
from coplan.spec import load_plan
from coplan.trainer.config import DEFAULT_STEPS, Ranks, TrainConfig, check_launch, configs


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m coplan.trainer.train", description="Train a plan (one rank; launch with torchrun).")
    p.add_argument("plan", nargs="+", help="plan.json; several plans of one world size run in turn in these processes, "
                   "each in its own run directory (<run id>-<plan file stem>)")
    p.add_argument("--steps", type=steps_count, default=DEFAULT_STEPS, help="total steps of the run (a resumed run continues up to it)")
    p.add_argument("--warmup", type=non_negative_int, default=None, help="leading steps left out of the statistics (default: min(5, steps/4))")
    p.add_argument("--runs-root", default="runs", help="folder holding run directories")
    p.add_argument("--run-id", type=name_part, default=None, help="run directory name (default: <workload>-<ranks>r-<UTC time>)")
    p.add_argument("--resume", default=None,
                   help="a run directory: continue it from its latest complete checkpoint; 'auto': continue "
                        "<runs-root>/<run-id> when it has one, else start it (what a torchrun restart needs)")
    p.add_argument("--data", default=None, help="dataset folder (Parquet); generated there by rank 0 when missing")
    p.add_argument("--data-samples", type=sample_count, default=None, help="samples to generate (default: 32 global batches)")
    p.add_argument("--seed", type=seed, default=0, help="seed of the weights and of generated data")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto",
                   help="cuda needs GPUs matching the plan's topology; cpu is a functional run on gloo")
    p.add_argument("--attention", choices=["triton", "reference", "flex"], default=None,
                   help="override the plan's attention backend (recorded in the summary)")
    p.add_argument("--trace", type=trace_window, default="auto", help="'A:B' profiles steps A..B-1, 'none' disables, 'auto' = the 3 steps after warm-up")
    p.add_argument("--checkpoint-every", type=checkpoint_every, default=0, help="checkpoint every N steps (0: at the end only; -1: never)")
    p.add_argument("--keep-last-n", type=non_negative_int, default=2, help="complete checkpoints to keep (0: all)")
    p.add_argument("--log-every", type=positive_int, default=None,
                   help="read metrics back every N steps (default: 1 on CPU, 10 on CUDA, where reading back waits for the GPU)")
    p.add_argument("--compile", choices=["off", "layers", "layers-cpp"], default="off",
                   help="layers: torch.compile each InterFormer and Kunlun layer (static shapes but for the history's "
                        "token dimension: one graph per layer kind); layers-cpp: the same with Inductor's C++ wrapper "
                        "(less host time per graph call, slower to compile); the compilation "
                        "happens in the first steps, so keep them in --warmup")
    p.add_argument("--seq-chunk", type=non_negative_int, default=32, metavar="N",
                   help="sequence lookups: each sample's history as bags of at most N ids (ceil(max_len / N) per "
                        "sample, the same on every rank and step), so FBGEMM's no-bag lookup spreads a history over "
                        "many thread groups; 0: one bag per sample (its whole history). The output rows are the same")
    p.add_argument("--cuda-graphs", choices=["auto", "on", "off"], default="auto",
                   help="auto: the dense arch's forward and backward as CUDA graphs, one per padded history length "
                        "bucket, where they apply (one GPU, no --compile, Triton attention; the summary says why "
                        "not otherwise); on: also over layers compiled by --compile (the compiled layers' kernels "
                        "replayed as graphs; not yet measured on a GPU); off: eager")
    p.add_argument("--fp8-guard-every", type=non_negative_int, default=50, metavar="N",
                   help="the FP8 layers' numerics guard checks every N steps and the first (coplan.trainer.fp8_guard); "
                        "0: off")
    p.add_argument("--allow-device-mismatch", action="store_true", help="run a plan on GPUs other than its topology's")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p.parse_args(argv)


def run(cfg: TrainConfig) -> int:
    """One run of ``cfg.plan`` on this rank."""
    plan = load_plan(cfg.plan)
    ranks = Ranks.from_env()
    # refuse a wrong launch before the heavy imports (TorchRec alone takes seconds)
    check_launch(plan, world_size=ranks.world, local_world_size=ranks.local_world, device_type="cpu", device_name="cpu")
    from coplan.trainer.loop import train  # noqa: PLC0415 -- torch and TorchRec, only for a launch that matches

    return train(cfg, plan, ranks)


LAUNCHER_ENV = "COPLAN_LAUNCHER"
"""Set by ``coplan train``: a failing rank leaves its one-line message to the launcher (through torchrun's
error file) instead of printing it, so that the launch prints one message per failure."""


def _report(e: BaseException, rank: int) -> None:
    """One message for a failure: the launcher prints it from torchrun's error file (``coplan train``);
    under a plain torchrun, rank 0 prints a plan's error and any rank prints its own crash, in one line."""
    import time
    import traceback

    coplan_error = isinstance(e, CoplanError)
    text = (f"error: {e}" if coplan_error else
            f"error on rank {rank} (a bug in coplan, or in a library under it): {type(e).__name__}: {e}\n"
            "Set COPLAN_DEBUG=1 to see the traceback, and please report it.")
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        # a plan's error is a message, not a trainer traceback (torchrun's own report prints this file).
        # Written whole, then renamed: the agent reads it as soon as any rank fails, and a file it finds
        # opened but not yet written crashes the agent (json.JSONDecodeError) instead of restarting.
        stack = "" if coplan_error else traceback.format_exc()
        body = json.dumps({"message": {"message": text, "extraInfo": {"py_callstack": stack,
                                                                      "timestamp": str(int(time.time()))}}})
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            f.write(body)
        os.replace(tmp, path)
    if path and os.environ.get(LAUNCHER_ENV):
        return
    if rank == 0 or not coplan_error:
        print(text, file=sys.stderr, flush=True)


def _quiet_libraries() -> None:
    """Known, checked notices of the libraries under the trainer, kept out of a run's output
    (``COPLAN_DEBUG=1`` shows them): TorchRec's process-group, sharding and FX-tracing logs, the c10d
    collectives' and DDP's deprecation notices that FSDP2 and TorchRec trigger, and FBGEMM's CPU dense
    lookup's autograd notice (its gradient is checked in tests/trainer/test_sparse_2d.py)."""
    import logging
    import warnings

    logging.getLogger("torchrec").setLevel(logging.ERROR)
    logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)  # TorchRec's is_fx_tracing notice
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning)
    warnings.filterwarnings("ignore", message=r"fbgemm::dense_embedding_codegen_lookup_function: an autograd kernel")
    warnings.filterwarnings("ignore", message=r"`broadcast_buffers` is deprecated", category=FutureWarning)  # TorchRec's DDP


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    rank = int(os.environ.get("RANK", "0"))
    debug = bool(os.environ.get("COPLAN_DEBUG"))
    if not debug:
        _quiet_libraries()
    try:
        for cfg in configs(args):
            rc = run(cfg)
            if rc:
                return rc
        return 0
    except Exception as e:
        if debug:
            raise
        _report(e, rank)
        return e.exit_code if isinstance(e, CoplanError) else 1


def leave(code: int) -> NoReturn:
    """End a worker process whose work is done (its files written, its process group destroyed, its reader
    processes joined) without the interpreter's teardown: in CI a gloo rank now and then aborted there after a
    complete run ("terminate called without an active exception": a library's C++ thread still joinable when
    its static destructor ran), and torchrun reported the run failed. Nothing of the run's is left to it."""
    import logging

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


__all__ = ["LAUNCHER_ENV", "check_launch", "leave", "main", "run"]


if __name__ == "__main__":
    leave(main())
