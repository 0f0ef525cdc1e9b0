"""The training loop, one process per rank (``torchrun -m coplan.trainer.train plan.json ...``).

``coplan train`` launches this; it can also be run under torchrun directly. Per step: read this
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
checkpoint is written (:class:`NumericalError`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import resource
import sys
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from coplan import __version__
from coplan.errors import CoplanError, MismatchError
from coplan.spec import Plan, RunDir, RunOptions, RunResult, dump_spec, load_plan, spec_sha256


def _non_negative(v: str) -> int:
    n = int(v)
    if n < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {v}")
    return n


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m coplan.trainer.train", description="Train a plan (one rank; launch with torchrun).")
    p.add_argument("plan", nargs="+", help="plan.json; several plans of one world size run in turn in these processes, "
                   "each in its own run directory (<run id>-<plan file stem>)")
    p.add_argument("--steps", type=int, default=20, help="total steps of the run (a resumed run continues up to it)")
    p.add_argument("--warmup", type=int, default=None, help="leading steps left out of the statistics (default: min(5, steps/4))")
    p.add_argument("--runs-root", default="runs", help="folder holding run directories")
    p.add_argument("--run-id", default=None, help="run directory name (default: <workload>-<ranks>r-<UTC time>)")
    p.add_argument("--resume", default=None,
                   help="a run directory: continue it from its latest complete checkpoint; 'auto': continue "
                        "<runs-root>/<run-id> when it has one, else start it (what a torchrun restart needs)")
    p.add_argument("--data", default=None, help="dataset folder (Parquet); generated there by rank 0 when missing")
    p.add_argument("--data-samples", type=int, default=None, help="samples to generate (default: 32 global batches)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and of generated data")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto",
                   help="cuda needs GPUs matching the plan's topology; cpu is a functional run on gloo")
    p.add_argument("--attention", choices=["triton", "reference", "flex"], default=None,
                   help="override the plan's attention backend (recorded in the summary)")
    p.add_argument("--trace", default="auto", help="'A:B' profiles steps A..B-1, 'none' disables, 'auto' = the 3 steps after warm-up")
    p.add_argument("--checkpoint-every", type=int, default=0, help="checkpoint every N steps (0: at the end only; -1: never)")
    p.add_argument("--keep-last-n", type=int, default=2, help="complete checkpoints to keep (0: all)")
    p.add_argument("--log-every", type=int, default=None,
                   help="read metrics back every N steps (default: 1 on CPU, 10 on CUDA, where reading back waits for the GPU)")
    p.add_argument("--moe-grouped", choices=["auto", "off"], default="auto",
                   help="auto: on CUDA, experts run as grouped GEMMs with no host sync where torch supports it; "
                        "off: one GEMM pair per expert, split sizes read back to the host (the CPU path)")
    p.add_argument("--fused-optimizer", choices=["auto", "off"], default="auto",
                   help="auto: the dense optimizer's fused kernel on CUDA (foreach on CPU); off: foreach everywhere")
    p.add_argument("--local-optimizer", choices=["auto", "off"], default="auto",
                   help="auto: step the dense optimizer (and take the gradient norm) on the DTensors' local shards, "
                        "without DTensor's per-op dispatch; off: through DTensor")
    p.add_argument("--sparse-pipeline", choices=["auto", "off"], default="auto",
                   help="auto: host batches pinned on the data thread, the next batch's host-to-device copies and "
                        "TorchRec input dist one step ahead, on a side stream on CUDA; off: all three at the start "
                        "of the step, on the training thread and the compute stream")
    p.add_argument("--segment-sum", choices=["auto", "reduce"], default="auto",
                   help="auto: on CUDA in half precision, the FiLM backward's per-sample sums as one-hot GEMMs with "
                        "fp32 accumulation; reduce: fp32 segment reduction over a cast copy (the CPU path)")
    p.add_argument("--fsdp-units", choices=["auto", "layers"], default="auto",
                   help="auto: one FSDP2 unit per layer, except on one rank, where the dense root is the only unit "
                        "(bf16 mixed precision, no per-layer hooks); layers: one unit per layer everywhere")
    p.add_argument("--compile", choices=["off", "layers", "layers-cpp"], default="off",
                   help="layers: torch.compile each InterFormer and Kunlun layer (static shapes but for the history's "
                        "token dimension: one graph per layer kind); layers-cpp: the same with Inductor's C++ wrapper "
                        "(less host time per graph call, slower to compile); the compilation "
                        "happens in the first steps, so keep them in --warmup")
    p.add_argument("--seq-chunk", type=_non_negative, default=32, metavar="N",
                   help="sequence lookups: each sample's history as bags of at most N ids (ceil(max_len / N) per "
                        "sample, the same on every rank and step), so FBGEMM's no-bag lookup spreads a history over "
                        "many thread groups; 0: one bag per sample (its whole history). The output rows are the same")
    p.add_argument("--allow-device-mismatch", action="store_true", help="run a plan on GPUs other than its topology's")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p.parse_args(argv)


class NumericalError(CoplanError):
    """The loss or a gradient became NaN or infinite; the run stops without checkpointing."""

    exit_code = 5


# Test-only fault injection (tests/reliability/test_faults.py): "loss@K" or "grad@K" makes rank 0's
# loss, or one of its dense gradients, non-finite at step K. Read once; unset in any real run.
_POISON_ENV = "COPLAN_TEST_POISON"


def _poison() -> tuple[str, int] | None:
    v = os.environ.get(_POISON_ENV)
    if not v:
        return None
    what, _, at = v.partition("@")
    if what not in ("loss", "grad") or not at.isdigit():
        raise CoplanError(f"{_POISON_ENV}={v!r}: expected 'loss@<step>' or 'grad@<step>'")
    return what, int(at)


def _init_process_group(backend: str, rank: int, world: int) -> None:
    """Under a torchrun restart, keys of the dead attempt (its ranks' gloo addresses) are still in
    the agent's store, and a new rank would try to connect to them: each attempt gets its own prefix."""
    import torch.distributed as dist

    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        dist.init_process_group(backend)
        return
    from datetime import timedelta

    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                          timeout=timedelta(minutes=5))
    dist.init_process_group(backend, store=dist.PrefixStore(f"coplan/attempt_{attempt}", store), rank=rank, world_size=world)


def _versions() -> dict[str, str]:
    import torch

    out = {"coplan": __version__, "torch": torch.__version__, "python": platform.python_version()}
    for mod in ("torchrec", "fbgemm_gpu", "triton"):
        try:
            out[mod] = __import__(mod).__version__
        except Exception:
            pass
    if torch.cuda.is_available():
        out["cuda"] = str(torch.version.cuda)
    return out


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


def _trace_window(spec: str, warmup: int, steps: int) -> tuple[int, int]:
    if spec == "none":
        return 0, 0
    if spec == "auto":
        first = min(warmup, max(0, steps - 1))
        return first, max(0, min(3, steps - first))
    a, b = (int(x) for x in spec.split(":"))
    return a, max(0, b - a)


def _enable_grouped_experts(model, plan: Plan, device, mode: str) -> list[str]:
    """Turn on the MoE layers' grouped GEMMs on CUDA where torch runs them correctly (checked once on
    small tensors, forward and backward); returns notes for the summary."""
    from coplan.trainer.distributed.fsdp import _DTYPES
    from coplan.trainer.model.moe import MoELayer, grouped_mm_works

    layers = [m for m in model.dense.modules() if isinstance(m, MoELayer)]
    if not layers:
        return []
    if mode == "off" or device.type != "cuda":  # (under expert parallelism the layers loop whatever this says)
        return ["MoE experts: per-expert loop"]
    dtype = _DTYPES[plan.precision.compute_dtype]
    ok = all(grouped_mm_works(device, dtype, m.experts.w2.shape[-1], m.experts.w2.shape[1], m.num_experts)
             for m in layers)
    for m in layers:
        m.grouped_mm = ok
    if not ok:
        print("warning: torch._grouped_mm is unavailable or wrong here; MoE experts run one by one", file=sys.stderr)
    return ["MoE experts: grouped GEMM" if ok else "MoE experts: per-expert loop (grouped GEMM failed its check)"]


def _enable_segment_sum_gemm(plan: Plan, device, mode: str) -> list[str]:
    """The FiLM backward's per-sample sums as one-hot GEMMs on CUDA (checked once on small tensors)."""
    import torch

    from coplan.trainer.distributed.fsdp import _DTYPES
    from coplan.trainer.model.layers import enable_segment_sum_gemm, segment_sum_gemm_works

    dtype = _DTYPES[plan.precision.compute_dtype]
    wanted = mode == "auto" and device.type == "cuda" and dtype != torch.float32
    on = wanted and segment_sum_gemm_works(device, dtype)
    enable_segment_sum_gemm(on)
    if wanted and not on:
        print("warning: the GEMM segment sum is unavailable or wrong here; the segment reduction runs", file=sys.stderr)
    return ["segment sums (FiLM backward): " + ("one-hot GEMM" if on else "segment reduction")]


def _seq_chunk_note(layout) -> str:
    """The summary's record of the sequence lookups' bags (``seq_chunk=N``: what calibration parses)."""
    if not layout.seq_chunk:
        return "sequence lookup bags: seq_chunk=0 (one bag per sample)"
    per = ", ".join(f"{g} {layout.chunks_per_sample(g)}" for g in layout.sequence_groups)
    return f"sequence lookup bags: seq_chunk={layout.seq_chunk} (bags of at most {layout.seq_chunk} ids; per sample: {per})"


def run(args: argparse.Namespace) -> int:
    plan = load_plan(args.plan)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    # refuse a wrong launch before the heavy imports (TorchRec alone takes seconds)
    check_launch(plan, world_size=world, local_world_size=local_world, device_type="cpu", device_name="cpu")

    import torch
    import torch.distributed as dist

    from coplan.trainer import checkpoint as ckpt
    from coplan.trainer.data import BatchReader, Prefetcher, check_dataset, data_sha256, generate_dataset
    from coplan.trainer.distributed.mesh import ParallelDims, build_meshes
    from coplan.trainer.metrics import StepRecord, StepTimer, mfu, stats, step_flops
    from coplan.trainer.model.gem import GEMModel, loss_parts
    from coplan.trainer.model.layers import resolve_backend
    from coplan.trainer.optim import Optimizers
    from coplan.trainer.optim import local as _local
    from coplan.trainer.parallelize import parallelize
    from coplan.trainer.pipeline import SparseDistPipeline
    from coplan.trainer.profiling import TraceWindow

    if args.device == "auto":
        if not torch.cuda.is_available():
            raise MismatchError(
                f"no CUDA device here, and the plan is for {plan.topology.gpu.name} GPUs; pass --device cpu for a "
                "functional run on CPU processes (gloo), whose timings say nothing about the plan"
            )
        device_type = "cuda"
    else:
        device_type = args.device
    if device_type == "cuda" and not torch.cuda.is_available():
        raise MismatchError("--device cuda but no CUDA device is visible")
    device_name = "cpu"
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
        device_name = torch.cuda.get_device_name(local_rank)
    check_launch(plan, world_size=world, local_world_size=local_world, device_type=device_type,
                 device_name=device_name, allow_device_mismatch=args.allow_device_mismatch)
    device = torch.device(device_type, local_rank) if device_type == "cuda" else torch.device("cpu")
    if device_type == "cuda":
        # fp32 matmuls that remain (router softmax inputs, reference attention) may use TF32, as is usual
        torch.set_float32_matmul_precision("high")
    if not dist.is_initialized():
        _init_process_group("nccl" if device_type == "cuda" else "gloo", rank, world)
    workload = plan.workload
    global_batch = workload.batch.global_(plan.world_size)
    if global_batch % world:
        raise MismatchError(f"global batch {global_batch} does not split evenly over {world} ranks")
    backend = resolve_backend(args.attention or plan.kernels.attention, device)

    # run directory: rank 0 names it, everyone agrees
    if args.resume == "auto":
        if not args.run_id:
            raise CoplanError("--resume auto needs --run-id: a restarted job must find the same run directory")
        args.resume = str(Path(args.runs_root) / args.run_id)
        if not (Path(args.resume) / "plan.json").is_file():
            args.resume = None  # first start: a new run of that name
    if args.resume:
        run_dir = Path(args.resume)
        if not (run_dir / "plan.json").is_file():
            raise CoplanError(f"--resume {run_dir}: not a run directory (no plan.json)")
        if spec_sha256(load_plan(run_dir / "plan.json")) != spec_sha256(plan):
            raise MismatchError(f"--resume {run_dir}: that run trained a different plan than {args.plan}")
    else:
        rid = [args.run_id or f"{workload.name}-{world}r-{datetime.now(timezone.utc).strftime('%Y%m%d-%H%M%S')}"]
        dist.broadcast_object_list(rid, src=0)
        run_dir = Path(args.runs_root) / rid[0]
    if rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        if not (run_dir / "plan.json").exists():
            dump_spec(plan, run_dir / "plan.json")

    # data: rank 0 generates it when missing
    data_dir = Path(args.data) if args.data else Path(args.runs_root) / "data" / f"{workload.name}-{data_sha256(workload)[:8]}-seed{args.seed}"
    if rank == 0 and not (data_dir / "dataset.json").is_file():
        n = args.data_samples or global_batch * 32
        print(f"generating {n:,} samples of '{workload.name}' into {data_dir}", file=sys.stderr, flush=True)
        generate_dataset(workload, data_dir, n, seed=args.seed, progress=not args.no_progress)
    dist.barrier()
    check_dataset(data_dir, workload)

    # model, parallelisms, optimizers
    dims = ParallelDims.from_plan(plan)
    meshes = build_meshes(dims, device_type)
    model = GEMModel(workload, attention_backend=backend, seed=args.seed, device=device)
    step_notes = _enable_grouped_experts(model, plan, device, args.moe_grouped)
    step_notes += _enable_segment_sum_gemm(plan, device, args.segment_sum)
    pm = parallelize(model, plan, dims, meshes, device=device, local_size=local_world, seed=args.seed,
                     compile_layers=args.compile, fsdp_per_layer=True if args.fsdp_units == "layers" else None)
    optims = Optimizers(model.dense, pm.dp_tables, pm.dmp.fused_optimizer, plan,
                        fused_dense=device_type == "cuda" and args.fused_optimizer == "auto",
                        local_step=args.local_optimizer == "auto")

    start = 0
    if args.resume:
        found = ckpt.scan(run_dir)
        # every rank loads what rank 0 saw (a rank must never load another step than its peers)
        choice = [str(found.latest) if found.latest else None]
        dist.broadcast_object_list(choice, src=0)
        last = Path(choice[0]) if choice[0] else None
        if rank == 0:
            for bad in found.incomplete:
                print(f"warning: skipping incomplete checkpoint {bad} (interrupted while being written); "
                      f"using {last or 'none: starting from step 0'}", file=sys.stderr, flush=True)
        if last is not None:
            start = ckpt.load(last, pm, optims) + 1
        if rank == 0:
            print(f"resumed from {last} at step {start}" if last else f"resuming {run_dir}: no complete checkpoint, "
                  "starting from step 0", file=sys.stderr, flush=True)
            mp = run_dir / "metrics.jsonl"
            if mp.is_file():  # steps after the checkpoint will run again: drop their old lines
                kept = [ln for ln in mp.read_text().splitlines() if ln.strip() and json.loads(ln)["step"] < start]
                tmp = mp.with_suffix(".jsonl.tmp")
                tmp.write_text("".join(k + "\n" for k in kept))
                os.replace(tmp, mp)
        dist.barrier()
    steps = args.steps
    log_every = max(1, args.log_every or (10 if device_type == "cuda" else 1))
    warmup = args.warmup if args.warmup is not None else min(5, steps // 4)
    micro_batches = plan.micro_batches
    reader = BatchReader(workload, data_dir, world_size=world, rank=rank, policy=plan.balancing.policy, global_batch=global_batch,
                         micro_batches=micro_batches)
    layout = model.layout.with_seq_chunk(args.seq_chunk)
    if rank == 0:  # this launch's switches, machine-readable (calibration reads seq_chunk from here)
        cfg = {k: v for k, v in vars(args).items()}
        cfg["seq_chunks_per_sample"] = {g: layout.chunks_per_sample(g) for g in layout.sequence_groups}
        (run_dir / "config.json").write_text(json.dumps(cfg, indent=1, sort_keys=True) + "\n")
    timer = StepTimer(device)
    peak = plan.topology.gpu.peak_flops_per_s.get("bf16", 0.0)
    tasks = list(layout.tasks) + [f"next_token:{s}" for s in layout.token_sequences]  # loss_parts' names, in its order
    metrics_path = run_dir / "metrics.jsonl"
    pending: list[tuple] = []
    poison = _poison()
    grad_params = [p for g in optims.dense.param_groups for p in g["params"]]
    # the gradient norm's local shards: DTensor's to_local() is an autograd Function per tensor per step
    to_local = _local if optims.local_step else (lambda g: g.to_local() if hasattr(g, "to_local") else g)
    if optims.tables is not None:
        grad_params += [p for g in optims.tables.param_groups for p in g["params"]]
    records: list[StepRecord] = []
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    trace_first, trace_count = _trace_window(args.trace, warmup, steps)
    if device_type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    bar = None
    if rank == 0 and not args.no_progress:
        from tqdm import tqdm

        bar = tqdm(total=steps, initial=start, desc=f"train {workload.name}", unit="step", dynamic_ncols=True)

    def flush() -> None:
        durs = timer.resolve()
        done = [p for p in pending if p[0] in durs]
        for item in done:
            pending.remove(item)
            step, loss_t, bad_t, task_t, tokens, samples, flops, imb, seq_stats, seq_max = item
            loss = float(loss_t.item())  # type: ignore[union-attr]
            bad = float(bad_t.item())  # type: ignore[union-attr]
            if not math.isfinite(loss) or not math.isfinite(bad):
                # every rank sees the same all-reduced values, so all stop here together, before
                # this step's metrics line and before any checkpoint after it
                what = f"loss is {loss}" if not math.isfinite(loss) else f"the dense gradient norm is {math.sqrt(bad)} (NaN/Inf elements)"
                kept = ckpt.latest(run_dir)
                raise NumericalError(
                    f"step {step}: {what}; stopped without checkpointing. Last good checkpoint: "
                    f"{kept or 'none'} (resume from it with a lower learning rate, or check the data of step {step})")
            tl = task_t.tolist()  # type: ignore[union-attr]
            dt = durs[step]
            rec = StepRecord(step=step, loss=loss, step_time_s=dt, tokens=tokens, samples=samples, model_flops=flops,
                             mfu=mfu(flops, dt, world, peak), imbalance=imb, task_loss=dict(zip(tasks, tl)),
                             seq_stats=seq_stats, seq_max=seq_max)
            records.append(rec)
            if rank == 0:
                with metrics_path.open("a") as f:
                    f.write(json.dumps(rec.as_json()) + "\n")
                if bar is not None:
                    bar.set_postfix(loss=f"{loss:.4f}", step_s=f"{dt:.3g}", mfu=f"{rec.mfu:.1%}", refresh=False)

    pipe = SparseDistPipeline(pm.model.sparse, layout, device, enabled=args.sparse_pipeline == "auto")
    prefetch = Prefetcher(reader, start, steps, prepare=pipe.host, setup=pipe.thread_setup)
    ahead = None  # (host batch, its prepared Batch) of the next step
    try:
        with TraceWindow(RunDir(run_dir), rank, trace_first, trace_count, start, device) as tw:
            for step in range(start, steps):
                timer.mark(step)  # a step runs from its start to the next step's start: data stalls count
                if step > start and step % log_every == 0:
                    flush()
                # Gradient accumulation: forward and backward per micro-batch, one optimizer step. FSDP2
                # reduce-scatters each micro-batch's gradients and adds them to the shards; the fused
                # embedding optimizer updates the sharded tables in every micro-batch's backward (so a
                # later micro-batch reads rows an earlier one moved), as the cost model prices it (one
                # fused TBE backward per micro-batch). Data-parallel tables' gradients accumulate over the
                # micro-batches and are summed over the ranks once, in the optimizer step.
                step_parts, hbs = None, []
                for micro in range(micro_batches):
                    if ahead is None:
                        hb, ht = next(prefetch)
                        batch = pipe.prepare(hb, ht)
                    else:
                        (hb, batch), ahead = ahead, None
                    hbs.append(hb)
                    out = pm.dmp(pipe.ready(batch))
                    if pipe.enabled and (step + 1 < steps or micro + 1 < micro_batches):
                        # the next micro-batch's copies and input dist, on the side stream behind this forward
                        nhb, nht = next(prefetch)
                        ahead = (nhb, pipe.prepare(nhb, nht))
                    # this micro-batch's share of the global mean: gradients then sum over micro-batches
                    # and ranks (see distributed/embedding.py and gem.loss_parts)
                    g_tok = {s: int(hb.global_lengths[s].sum()) for s in layout.token_sequences}
                    loss, mb_parts, _ = loss_parts(out, batch.labels, global_batch, g_tok)
                    if poison == ("loss", step) and rank == 0:
                        loss = loss * float("nan")
                    loss.backward()
                    mb_parts = torch.cat([loss.detach().reshape(1), mb_parts])
                    step_parts = mb_parts if step_parts is None else step_parts + mb_parts
                assert step_parts is not None
                grads = [to_local(g) for p in grad_params if (g := p.grad) is not None]
                if poison == ("grad", step) and rank == 0 and grads:
                    grads[0].fill_(float("inf"))
                # squared norm of the dense gradients, summed over ranks with the loss below: NaN/Inf
                # when any element is (no host sync here; checked when metrics are read back, and
                # always before a checkpoint). One foreach op: per-tensor ops would clutter the traces.
                with torch.no_grad():
                    n_bad = (torch.stack(torch._foreach_norm(grads)).float().square().sum().reshape(1)
                             if grads else torch.zeros(1, device=device))
                optims.step()
                optims.zero_grad()
                if pm.replica_sync is not None:  # 2-D sparse parallelism: average the table replicas (every N steps)
                    pm.replica_sync.after_step(step)
                with torch.no_grad():
                    parts = torch.cat([step_parts[:1], n_bad.to(step_parts.dtype), step_parts[1:]])
                    if world > 1:  # (on one rank the sum is the tensor itself: no collective to issue)
                        dist.all_reduce(parts)
                g_tokens = int(sum(int(v.sum()) for v in hb.global_lengths.values()))
                flops = step_flops(workload, hb.global_lengths, global_batch)
                # a step costs the sum over micro-batches of the slowest rank's share
                rcs = [h.rank_costs for h in hbs if h.rank_costs is not None]
                mean = sum(float(rc.mean()) for rc in rcs)
                imb = sum(float(rc.max()) for rc in rcs) / mean if mean > 0 else 1.0
                seq_stats = {k: [float(sum(h.seq_lengths[k].size for h in hbs)), float(sum(h.seq_lengths[k].sum() for h in hbs)),
                                 float(sum((h.seq_lengths[k].astype(np.float64) ** 2).sum() for h in hbs))]
                             for k in hb.seq_lengths}
                # the longest history of each of this rank's micro-batches, from the host lengths: no
                # device read-back
                seq_max = {k: [int(h.seq_lengths[k].max()) if h.seq_lengths[k].size else 0 for h in hbs] for k in hb.seq_lengths}
                pending.append((step, parts[0], parts[1], parts[2:], g_tokens, global_batch, flops, imb, seq_stats, seq_max))
                tw.step()
                if bar is not None:
                    bar.update(1)
                if args.checkpoint_every > 0 and (step + 1) % args.checkpoint_every == 0 and step + 1 < steps:
                    timer.mark(step + 1)
                    flush()
                    ckpt.save(run_dir, pm, optims, step, keep=args.keep_last_n)
                    timer.reset()  # the checkpoint's time is no step's
            timer.mark(steps)
            flush()
    finally:
        prefetch.close()
        if bar is not None:
            bar.close()
    if args.checkpoint_every >= 0 and steps > start:
        ckpt.save(run_dir, pm, optims, steps - 1, keep=args.keep_last_n)

    # summary: warm-up steps and profiled steps (the profiler slows the host) are left out
    traced = set(range(trace_first, trace_first + trace_count))
    measured = [r for r in records if r.step >= max(warmup, start) and r.step not in traced]
    if not measured:
        measured = [r for r in records if r.step >= max(warmup, start)]
    times = [r.step_time_s for r in measured]
    if device_type == "cuda":
        mem = float(torch.cuda.max_memory_allocated(device))
    else:
        mem = float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    mems: list = [None] * world
    dist.all_gather_object(mems, mem)
    if rank == 0:
        total_t = sum(times)
        flops_mean = float(np.mean([r.model_flops for r in measured])) if measured else 0.0
        notes = [f"attention backend '{backend}'", f"balancing '{plan.balancing.policy}' with equal per-rank counts",
                 f"statistics over {len(measured)} steps (warm-up and profiled steps left out)", *step_notes,
                 f"dense optimizer {'fused' if optims.fused_dense else 'foreach'}"
                 + (f" (fused refused: {optims.fused_error})" if optims.fused_error else ""),
                 f"dense optimizer stepped {'on local shards' if optims.local_step else 'through DTensor'}",
                 f"sparse input dist {'one batch ahead' + (' on a side stream' if pipe.stream is not None else '') if pipe.enabled else 'in forward'}",
                 f"FSDP2 units: {'one per layer' if pm.fsdp_per_layer else 'the dense root only'}",
                 f"compile {args.compile}",
                 _seq_chunk_note(layout)]
        if device_type == "cpu":
            notes.append("CPU functional run on gloo: step times, MFU and memory (host RSS) say nothing about GPUs")
        result = RunResult(
            run_id=run_dir.name, plan_sha256=spec_sha256(plan), workload=workload.name, world_size=world,
            device=device_name, versions=_versions(), started_utc=started,
            ended_utc=datetime.now(timezone.utc).isoformat(timespec="seconds"), steps=steps,
            warmup_steps=min(warmup, steps), step_time=stats(times), model_flops_per_step=flops_mean,
            measured_mfu=mfu(flops_mean, float(np.mean(times)), world, peak) if times else 0.0,
            tokens_per_s=sum(r.tokens for r in measured) / total_t if total_t else 0.0,
            samples_per_s=sum(r.samples for r in measured) / total_t if total_t else 0.0,
            peak_memory_bytes=tuple(float(m) for m in mems), first_loss=records[0].loss if records else None,
            final_loss=records[-1].loss if records else None, attention_backend=backend, notes="; ".join(notes),
            options=RunOptions(seq_chunk=int(layout.seq_chunk or 0), compile=args.compile, attention_backend=backend),
        )
        dump_spec(result, run_dir / "summary.json")
        st = result.step_time
        print(
            f"run {run_dir}: {steps - start} steps, loss {result.first_loss:.4f} -> {result.final_loss:.4f}"
            + (f", step p50 {st.p50_s * 1e3:.1f} ms p90 {st.p90_s * 1e3:.1f} ms, MFU {result.measured_mfu:.2%}, "
               f"{result.tokens_per_s:,.0f} tokens/s" if st else ""),
            flush=True,
        )
    dist.barrier()
    if getattr(args, "last_plan", True):
        dist.destroy_process_group()
    return 0


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
    plans = list(args.plan)
    try:
        if len(plans) > 1 and args.resume:
            raise CoplanError("--resume continues one run: give one plan with it")
        for i, path in enumerate(plans):
            one = argparse.Namespace(**vars(args))
            one.plan, one.last_plan = path, i == len(plans) - 1
            if len(plans) > 1:  # a sweep: a run directory per plan, named after the plan file
                one.run_id = f"{args.run_id}-{Path(path).stem}" if args.run_id else \
                    f"{Path(path).stem}-{datetime.now(timezone.utc).strftime('%Y%m%d-%H%M%S')}"
            rc = run(one)
            if rc:
                return rc
        return 0
    except Exception as e:
        if debug:
            raise
        _report(e, rank)
        return e.exit_code if isinstance(e, CoplanError) else 1


if __name__ == "__main__":
    sys.exit(main())
