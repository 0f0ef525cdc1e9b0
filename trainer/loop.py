"""One run on this rank, in named steps: device, run directory, data, model and parallelisms,
resume, the train loop (:class:`Loop`), summary. :func:`train` calls them in that order.

Holds the heavy imports (torch, TorchRec): :mod:`coplan.trainer.train` imports this module only
after the launch has been checked against the plan.
"""

from __future__ import annotations

import json
import math
import os
import platform
import resource
import sys
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from coplan import __version__
from coplan.errors import CoplanError, MismatchError
from coplan.spec import LoaderThroughput, Plan, Startup, RunDir, RunOptions, RunResult, dump_spec, load_plan, spec_sha256
from coplan.trainer import checkpoint as ckpt
from coplan.trainer.config import Ranks, TrainConfig, check_launch
from coplan.trainer.data import BatchReader, Prefetcher, check_dataset, data_sha256, default_reader_processes, generate_dataset
from coplan.trainer.distributed.fp8 import fp8_notes
from coplan.trainer.distributed.fsdp import DTYPES
from coplan.trainer.distributed.mesh import ParallelDims, build_meshes
from coplan.trainer.features import FeatureLayout
from coplan.costmodel.jagged import length_pmf
from coplan.trainer.graphs import DenseGraphs, graphs_unavailable, likely_rows
from coplan.trainer.metrics import HostPhases, StepRecord, StepTimer, mfu, stats, step_flops
from coplan.trainer.model.gem import GEMModel, loss_parts
from coplan.trainer.model.layers import enable_segment_sum_gemm, resolve_backend, segment_sum_gemm_works
from coplan.trainer.model.moe import MoELayer, grouped_mm_works
from coplan.trainer.optim import Optimizers, local
from coplan.trainer.parallelize import ParallelModel, parallelize
from coplan.trainer.pipeline import SparseDistPipeline
from coplan.trainer.fp8_guard import Fp8Guard
from coplan.trainer.profiling import TraceWindow
from coplan.trainer.startup import StartupClock


class NumericalError(CoplanError):
    """The loss or a gradient became NaN or infinite; the run stops without checkpointing."""

    exit_code = 5


def init_process_group(backend: str, rank: int, world: int) -> None:
    """Under a torchrun restart, keys of the dead attempt (its ranks' gloo addresses) are still in
    the agent's store, and a new rank would try to connect to them: each attempt gets its own prefix."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        dist.init_process_group(backend)
        return
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                          timeout=timedelta(minutes=5))
    dist.init_process_group(backend, store=dist.PrefixStore(f"coplan/attempt_{attempt}", store), rank=rank, world_size=world)


def versions() -> dict[str, str]:
    out = {"coplan": __version__, "torch": torch.__version__, "python": platform.python_version()}
    for mod in ("torchrec", "fbgemm_gpu", "triton"):
        try:
            out[mod] = __import__(mod).__version__
        except Exception:
            pass
    if torch.cuda.is_available():
        out["cuda"] = str(torch.version.cuda)
    commit = git_commit()
    if commit:
        out["coplan_git_commit"] = commit
    return out


def git_commit() -> str:
    """The commit of the code that runs (``COPLAN_GIT_COMMIT`` where the copy has no history of its own), or ''."""
    env = os.environ.get("COPLAN_GIT_COMMIT", "")
    if env:
        return env
    import subprocess

    here = Path(__file__).resolve().parent
    try:  # only the checkout coplan runs from (not a repository an installed copy happens to sit in)
        r = subprocess.run(["git", "-C", str(here), "rev-parse", "--show-toplevel", "HEAD"], capture_output=True,
                           text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return ""
    lines = r.stdout.split()
    if r.returncode != 0 or len(lines) != 2 or Path(lines[0]).resolve() != here.parent:
        return ""
    return lines[1]


def trace_window(spec: str, warmup: int, steps: int) -> tuple[int, int]:
    """(first profiled step, how many) of ``--trace``."""
    if spec == "none":
        return 0, 0
    if spec == "auto":
        first = min(warmup, max(0, steps - 1))
        return first, max(0, min(3, steps - first))
    a, b = (int(x) for x in spec.split(":"))
    return a, max(0, b - a)


def select_device(cfg: TrainConfig, plan: Plan, ranks: Ranks) -> tuple[torch.device, str]:
    """This rank's device and its name, checked against the plan's topology."""
    if cfg.device == "auto":
        if not torch.cuda.is_available():
            raise MismatchError(
                f"no CUDA device here, and the plan is for {plan.topology.gpu.name} GPUs; pass --device cpu for a "
                "functional run on CPU processes (gloo), whose timings say nothing about the plan"
            )
        device_type = "cuda"
    else:
        device_type = cfg.device
    if device_type == "cuda" and not torch.cuda.is_available():
        raise MismatchError("--device cuda but no CUDA device is visible")
    device_name = "cpu"
    if device_type == "cuda":
        torch.cuda.set_device(ranks.local_rank)
        device_name = torch.cuda.get_device_name(ranks.local_rank)
    check_launch(plan, world_size=ranks.world, local_world_size=ranks.local_world, device_type=device_type,
                 device_name=device_name, allow_device_mismatch=cfg.allow_device_mismatch)
    if device_type == "cuda":
        # fp32 matmuls that remain (router softmax inputs, reference attention) may use TF32, as is usual
        torch.set_float32_matmul_precision("high")
        return torch.device("cuda", ranks.local_rank), device_name
    return torch.device("cpu"), device_name


def open_run_dir(cfg: TrainConfig, plan: Plan, ranks: Ranks) -> Path:
    """The run directory: the one resumed, or a new one that rank 0 names and every rank agrees on."""
    if cfg.resume:
        run_dir = cfg.resume
        if not (RunDir(run_dir).plan_path).is_file():
            raise CoplanError(f"--resume {run_dir}: not a run directory (no plan.json)")
        if spec_sha256(load_plan(RunDir(run_dir).plan_path)) != spec_sha256(plan):
            raise MismatchError(f"--resume {run_dir}: that run trained a different plan than {cfg.plan}")
    else:
        rid = [cfg.run_id or f"{plan.workload.name}-{ranks.world}r-{datetime.now(timezone.utc).strftime('%Y%m%d-%H%M%S')}"]
        dist.broadcast_object_list(rid, src=0)
        run_dir = cfg.runs_root / rid[0]
    if ranks.rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        if not (RunDir(run_dir).plan_path).exists():
            dump_spec(plan, RunDir(run_dir).plan_path)
    return run_dir


def prepare_data(cfg: TrainConfig, plan: Plan, global_batch: int, rank: int) -> tuple[Path, bool]:
    """The dataset folder, checked against the workload, and whether this rank generated it (rank 0
    generates it when missing)."""
    workload = plan.workload
    data_dir = cfg.data or cfg.runs_root / "data" / f"{workload.name}-{data_sha256(workload)[:8]}-seed{cfg.seed}"
    generated = rank == 0 and not (data_dir / "dataset.json").is_file()
    if generated:
        n = cfg.data_samples or global_batch * 32
        print(f"generating {n:,} samples of '{workload.name}' into {data_dir}", file=sys.stderr, flush=True)
        generate_dataset(workload, data_dir, n, seed=cfg.seed, progress=cfg.progress)
    dist.barrier()
    check_dataset(data_dir, workload)
    return data_dir, generated


def enable_grouped_experts(model: GEMModel, plan: Plan, device: torch.device) -> list[str]:
    """Turn on the MoE layers' grouped GEMMs on CUDA where torch runs them correctly (checked once on
    small tensors, forward and backward); returns notes for the summary."""
    layers = [m for m in model.dense.modules() if isinstance(m, MoELayer)]
    if not layers:
        return []
    if device.type != "cuda":  # (under expert parallelism the layers loop whatever this says)
        return ["MoE experts: per-expert loop"]
    dtype = DTYPES[plan.precision.compute_dtype]
    ok = all(grouped_mm_works(device, dtype, m.experts.w2.shape[-1], m.experts.w2.shape[1], m.num_experts)
             for m in layers)
    for m in layers:
        m.grouped_mm = ok
    if not ok:
        print("warning: torch._grouped_mm is unavailable or wrong here; MoE experts run one by one", file=sys.stderr)
    return ["MoE experts: grouped GEMM" if ok else "MoE experts: per-expert loop (grouped GEMM failed its check)"]


def enable_segment_sums(plan: Plan, device: torch.device) -> list[str]:
    """The FiLM backward's per-sample sums as one-hot GEMMs on CUDA in half precision (checked once on
    small tensors); elsewhere the fp32 segment reduction."""
    dtype = DTYPES[plan.precision.compute_dtype]
    wanted = device.type == "cuda" and dtype != torch.float32
    on = wanted and segment_sum_gemm_works(device, dtype)
    enable_segment_sum_gemm(on)
    if wanted and not on:
        print("warning: the GEMM segment sum is unavailable or wrong here; the segment reduction runs", file=sys.stderr)
    return ["segment sums (FiLM backward): " + ("one-hot GEMM" if on else "segment reduction")]


@dataclass
class Built:
    """The model, parallelised, and its optimizers."""

    model: GEMModel
    pm: ParallelModel
    optims: Optimizers
    backend: str
    """The attention backend the model runs."""
    graphs: DenseGraphs | None = None
    """Runs the dense arch (CUDA graphs where they apply; None: the model's own forward under FSDP2)."""
    notes: list[str] = field(default_factory=list)
    """How the step runs where that depends on the device (for the summary)."""
    film: str = "eager"
    """How the InterFormer layers' FiLM + first LayerNorm run: ``fused`` (one Triton kernel each way) or ``eager``."""


def build(cfg: TrainConfig, plan: Plan, device: torch.device, ranks: Ranks, clock: StartupClock | None = None) -> Built:
    """Model, parallelisms (:func:`~coplan.trainer.parallelize.parallelize`) and optimizers."""
    backend = resolve_backend(cfg.attention or plan.kernels.attention, device)
    if backend == "triton" and (issues := plan.workload.triton_attention_issues("triton")):
        raise MismatchError(f"workload '{plan.workload.name}': " + "; ".join(f"{p}: {r}" for p, r in issues)
                            + "; or pass --attention reference to this run")
    dims = ParallelDims.from_plan(plan)
    meshes = build_meshes(dims, device.type)
    model = GEMModel(plan.workload, attention_backend=backend, seed=cfg.seed, device=device)
    notes = enable_grouped_experts(model, plan, device) + enable_segment_sums(plan, device)
    if clock is not None:
        clock.mark("build")
    why_not = ("--cuda-graphs off" if cfg.cuda_graphs == "off" else
               graphs_unavailable(model, device=device, world=ranks.world, compile_mode=cfg.compile, backend=backend,
                                  fp8_layers=sum(1 for lp in plan.layers if lp.precision == "fp8"),
                                  over_compiled=cfg.cuda_graphs == "on", recomputed=sum(1 for lp in plan.layers if lp.recompute)))
    pm = parallelize(model, plan, dims, meshes, device=device, local_size=ranks.local_world, seed=cfg.seed,
                     compile_layers=cfg.compile, fsdp=why_not is not None)
    graphs = None
    if why_not is None:
        graphs = model.dense_graphs = DenseGraphs(model.dense, DTYPES[plan.precision.compute_dtype], device,
                                                  likely_rows=micro_batch_rows(plan, ranks.world))
        if cfg.compile != "off":
            notes.append(f"CUDA graphs over the --compile {cfg.compile} layers (--cuda-graphs on)")
    elif device.type == "cuda" or cfg.cuda_graphs == "on":
        notes.append(f"CUDA graphs off ({why_not})")
    notes += fp8_notes(list(pm.fp8))
    optims = Optimizers(model.dense, pm.dp_tables, pm.dmp.fused_optimizer, plan, fused_dense=device.type == "cuda",
                        graph_step=graphs is not None and graphs.use_graphs)
    if clock is not None:
        clock.mark("sharding")
    film = ("fused" if device.type == "cuda" and cfg.compile == "off"
            and any(getattr(m, "film_fused", False) for m in model.modules()) else "eager")
    if any(hasattr(m, "film_fused") for m in model.modules()):
        notes.append("FiLM LayerNorm and the layers' LayerNorms: " + ("Triton kernels, one each way" if film == "fused"
                                                                       else "PyTorch ops"))
    return Built(model=model, pm=pm, optims=optims, backend=backend, graphs=graphs, notes=notes, film=film)


def micro_batch_rows(plan: Plan, world: int) -> dict[str, list[int]]:
    """Per sequence, the padded token counts a rank's micro-batch likely has (from the spec's length
    distribution): the CUDA graphs capture them at the first step."""
    w = plan.workload
    samples = w.batch.global_(plan.world_size) // max(1, world) // max(1, plan.micro_batches)
    out = {}
    for s in w.sequences:
        values, probs = length_pmf(s.length)
        out[s.name] = likely_rows(values, probs, samples)
    return out


def resume(run_dir: Path, built: Built, rank: int) -> int:
    """Load the run's latest complete checkpoint (the one rank 0 found) and drop the metrics lines of the
    steps after it, which run again; returns the first step to run."""
    found = ckpt.scan(run_dir)
    # every rank loads what rank 0 saw (a rank must never load another step than its peers)
    choice = [str(found.latest) if found.latest else None]
    dist.broadcast_object_list(choice, src=0)
    last = Path(choice[0]) if choice[0] else None
    if rank == 0:
        for bad in found.incomplete:
            print(f"warning: skipping incomplete checkpoint {bad} (interrupted while being written); "
                  f"using {last or 'none: starting from step 0'}", file=sys.stderr, flush=True)
    start = ckpt.load(last, built.pm, built.optims) + 1 if last is not None else 0
    if rank == 0:
        print(f"resumed from {last} at step {start}" if last else f"resuming {run_dir}: no complete checkpoint, "
              "starting from step 0", file=sys.stderr, flush=True)
        mp = RunDir(run_dir).metrics_path
        if mp.is_file():
            kept = [ln for ln in mp.read_text().splitlines() if ln.strip() and json.loads(ln)["step"] < start]
            tmp = mp.with_suffix(".jsonl.tmp")
            tmp.write_text("".join(k + "\n" for k in kept))
            os.replace(tmp, mp)
    dist.barrier()
    return start


def seq_chunk_note(layout: FeatureLayout) -> str:
    """The summary note on the sequence lookups' bags (the typed value is ``RunOptions.seq_chunk``)."""
    if not layout.seq_chunk:
        return "sequence lookup bags: seq_chunk=0 (one bag per sample)"
    per = ", ".join(f"{g} {layout.chunks_per_sample(g)}" for g in layout.sequence_groups)
    return f"sequence lookup bags: seq_chunk={layout.seq_chunk} (bags of at most {layout.seq_chunk} ids; per sample: {per})"


def progress_bar(title: str, total: int, completed: int) -> Progress:
    """Rank 0's bar on stderr, with the last metrics read back as its status."""
    bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                   TimeRemainingColumn(), TextColumn("{task.fields[status]}"), console=Console(stderr=True))
    bar.add_task(title, total=total, completed=completed, status="")
    return bar


@dataclass
class Pending:
    """A step's values still on the device (read back by :meth:`Loop.flush`), and its host-side figures."""

    step: int
    loss: torch.Tensor
    bad: torch.Tensor
    """The dense gradients' squared norm, summed over ranks: NaN/Inf when any element is."""
    task_loss: torch.Tensor
    tokens: int
    samples: int
    flops: float
    imbalance: float
    seq_stats: dict
    seq_max: dict


class Loop:
    """The train loop of one run: steps ``[start, cfg.steps)``, metrics read back every ``log_every``
    steps, checkpoints every ``cfg.checkpoint_every``."""

    def __init__(self, cfg: TrainConfig, plan: Plan, ranks: Ranks, device: torch.device, run_dir: Path, built: Built,
                 data_dir: Path, start: int) -> None:
        self.cfg, self.plan, self.ranks, self.device, self.run_dir = cfg, plan, ranks, device, run_dir
        self.pm, self.optims, self.graphs = built.pm, built.optims, built.graphs
        self.start, self.steps = start, cfg.steps
        self.global_batch = plan.workload.batch.global_(plan.world_size)
        self.layout = built.model.layout.with_seq_chunk(cfg.seq_chunk)
        self.reader = BatchReader(plan.workload, data_dir, world_size=ranks.world, rank=ranks.rank,
                                  policy=plan.balancing.policy, global_batch=self.global_batch,
                                  micro_batches=plan.micro_batches,
                                  balance_ranks=plan.balancing.group_ranks or ranks.local_world)
        self.timer = StepTimer(device)
        self.phases = HostPhases()
        """Per step and phase, the host's seconds inside :meth:`step`; summed (:meth:`HostPhases.total`), from its
        start until its last launch is issued (its batch's wait included; no read-back happens there, so on a step
        whose device work outlasts it this is the host's own time, what pricing a host-bound step needs)."""
        self.peak = plan.topology.gpu.peak_flops_per_s.get("bf16", 0.0)
        # loss_parts' names, in its order
        self.tasks = list(self.layout.tasks) + [f"next_token:{s}" for s in self.layout.token_sequences]
        self.pending: list[Pending] = []
        self.records: list[StepRecord] = []
        self.grad_params = [p for g in self.optims.dense.param_groups for p in g["params"]]
        if self.optims.tables is not None:
            self.grad_params += [p for g in self.optims.tables.param_groups for p in g["params"]]
        self.pipe = SparseDistPipeline(self.pm.model.sparse, self.layout, device)
        self.bar: Progress | None = None
        self._ahead = None  # (host batch, its prepared Batch) of the next micro-batch
        self.clock: StartupClock | None = None
        self.fp8_guard = Fp8Guard(built.model.dense, every=cfg.fp8_guard_every, world=ranks.world)

    def run(self, trace_first: int, trace_count: int) -> None:
        cfg = self.cfg
        log_every = cfg.log_interval(self.device.type)
        if self.ranks.rank == 0 and cfg.progress:
            self.bar = progress_bar(f"train {self.plan.workload.name}", self.steps, self.start)
            self.bar.start()
        self.prefetch = Prefetcher(self.reader, self.start, self.steps, prepare=self.pipe.host, setup=self.pipe.thread_setup,
                                   processes=default_reader_processes(self.device.type, self.ranks.local_world),
                                   local_world=self.ranks.local_world)
        try:
            with TraceWindow(RunDir(self.run_dir), self.ranks.rank, trace_first, trace_count, self.start,
                             self.device) as tw:
                for step in range(self.start, self.steps):
                    self.timer.mark(step)  # a step runs from its start to the next step's start: data stalls count
                    if step > self.start and step % log_every == 0:
                        self.flush()
                    if self.graphs is not None:
                        # profiled steps run the dense arch eagerly, so that the trace names each op's kernels
                        # (a graph's replay carries no op ranges) and calibration can attribute them; they are
                        # left out of the step statistics, which stay those of the replayed steps
                        self.graphs.trace_eager = tw.profiles(step)
                    self.step(step)
                    if step == self.start and self.clock is not None:
                        self.clock.first_step(self.device)
                    tw.step()
                    if self.bar is not None:
                        self.bar.advance(self.bar.task_ids[0])
                    if cfg.checkpoint_every > 0 and (step + 1) % cfg.checkpoint_every == 0 and step + 1 < self.steps:
                        self.timer.mark(step + 1)
                        self.flush()
                        ckpt.save(self.run_dir, self.pm, self.optims, step, keep=cfg.keep_last_n)
                        self.timer.reset()  # the checkpoint's time is no step's
                self.timer.mark(self.steps)
                self.flush()
        finally:
            self.prefetch.close()
            if self.bar is not None:
                self.bar.stop()
        if cfg.checkpoint_every >= 0 and self.steps > self.start:
            ckpt.save(self.run_dir, self.pm, self.optims, self.steps - 1, keep=cfg.keep_last_n)

    def step(self, step: int) -> None:
        """One optimizer step. Gradient accumulation: forward and backward per micro-batch, one optimizer
        step. FSDP2 reduce-scatters each micro-batch's gradients and adds them to the shards; the fused
        embedding optimizer updates the sharded tables in every micro-batch's backward (so a later
        micro-batch reads rows an earlier one moved), as the cost model prices it (one fused TBE backward
        per micro-batch). Data-parallel tables' gradients accumulate over the micro-batches and are summed
        over the ranks once, in the optimizer step."""
        micro_batches = self.plan.micro_batches
        step_parts, hbs = None, []
        ph = self.phases
        ph.begin(step)
        if self.graphs is not None:
            self.graphs.begin_step()
        self.fp8_guard.begin_step(step)
        for micro in range(micro_batches):
            if self._ahead is None:
                hb, ht = next(self.prefetch)
                batch = self.pipe.prepare(hb, ht)
            else:
                (hb, batch), self._ahead = self._ahead, None
            hbs.append(hb)
            ph.lap("data")
            out = self.pm.dmp(self.pipe.ready(batch))
            ph.lap("forward")
            if self.pipe.enabled and (step + 1 < self.steps or micro + 1 < micro_batches):
                # the next micro-batch's copies and input dist, on the side stream behind this forward
                nhb, nht = next(self.prefetch)
                self._ahead = (nhb, self.pipe.prepare(nhb, nht))
                ph.lap("ahead")
            loss, mb_parts = self.loss(out, batch, hb)
            ph.lap("loss")
            loss.backward()
            ph.lap("backward")
            mb_parts = torch.cat([loss.detach().reshape(1), mb_parts])
            step_parts = mb_parts if step_parts is None else step_parts + mb_parts
        assert step_parts is not None
        for trip in self.fp8_guard.end_step(step):
            if self.ranks.rank == 0:
                print(f"fp8 guard: {trip.describe()}; it runs in {self.plan.precision.compute_dtype} from the next step",
                      flush=True)
        grads = self.dense_grads()
        # squared norm of the dense gradients, summed over ranks with the loss below: NaN/Inf when any
        # element is (no host sync here; checked when metrics are read back, and always before a
        # checkpoint). One foreach op: per-tensor ops would clutter the traces.
        with torch.no_grad():
            n_bad = (torch.stack(torch._foreach_norm(grads)).float().square().sum().reshape(1)
                     if grads else torch.zeros(1, device=self.device))
        self.optims.step(eager=self.graphs is not None and self.graphs.trace_eager)
        self.optims.zero_grad()
        if self.pm.replica_sync is not None:  # 2-D sparse parallelism: average the table replicas (every N steps)
            self.pm.replica_sync.after_step(step)
        with torch.no_grad():
            parts = torch.cat([step_parts[:1], n_bad.to(step_parts.dtype), step_parts[1:]])
            if self.ranks.world > 1:  # (on one rank the sum is the tensor itself: no collective to issue)
                dist.all_reduce(parts)
        ph.lap("optimizer")
        self.pending.append(self.host_figures(step, parts, hbs))
        ph.lap("bookkeeping")

    def host_figures(self, step: int, parts: torch.Tensor, hbs: list) -> Pending:
        """A step's figures known on the host (tokens, FLOPs, balance, history lengths), with its device values."""
        hb = hbs[-1]
        g_tokens = int(sum(int(v.sum()) for v in hb.global_lengths.values()))
        flops = step_flops(self.plan.workload, hb.global_lengths, self.global_batch)
        # a step costs the sum over micro-batches of the slowest rank's share
        rcs = [h.rank_costs for h in hbs if h.rank_costs is not None]
        mean = sum(float(rc.mean()) for rc in rcs)
        imb = sum(float(rc.max()) for rc in rcs) / mean if mean > 0 else 1.0
        seq_stats = {k: [float(sum(h.seq_lengths[k].size for h in hbs)), float(sum(h.seq_lengths[k].sum() for h in hbs)),
                         float(sum((h.seq_lengths[k].astype(np.float64) ** 2).sum() for h in hbs))]
                     for k in hb.seq_lengths}
        # the longest history of each of this rank's micro-batches, from the host lengths: no device read-back
        seq_max = {k: [int(h.seq_lengths[k].max()) if h.seq_lengths[k].size else 0 for h in hbs] for k in hb.seq_lengths}
        return Pending(step=step, loss=parts[0], bad=parts[1], task_loss=parts[2:], tokens=g_tokens,
                       samples=self.global_batch, flops=flops, imbalance=imb, seq_stats=seq_stats, seq_max=seq_max)

    def loss(self, out, batch, hb) -> tuple[torch.Tensor, torch.Tensor]:
        """This micro-batch's share of the global mean loss (gradients then sum over micro-batches and
        ranks; see distributed/embedding.py and gem.loss_parts), and its per-task parts."""
        g_tok = {s: int(hb.global_lengths[s].sum()) for s in self.layout.token_sequences}
        loss, parts, _ = loss_parts(out, batch.labels, self.global_batch, g_tok)
        return loss, parts

    def dense_grads(self) -> list[torch.Tensor]:
        """The local shards of the dense (and data-parallel tables') gradients."""
        # DTensor's to_local() is an autograd Function per tensor per step: the optimizer's local views skip it
        to_local = local if self.optims.local_step else (lambda g: g.to_local() if hasattr(g, "to_local") else g)
        return [to_local(g) for p in self.grad_params if (g := p.grad) is not None]

    def flush(self) -> None:
        """Read back the finished steps' values: stop on a non-finite one, else log their metrics lines."""
        durs = self.timer.resolve()
        done = [p for p in self.pending if p.step in durs]
        for p in done:
            self.pending.remove(p)
            loss = float(p.loss.item())
            bad = float(p.bad.item())
            if not math.isfinite(loss) or not math.isfinite(bad):
                # every rank sees the same all-reduced values, so all stop here together, before
                # this step's metrics line and before any checkpoint after it
                what = f"loss is {loss}" if not math.isfinite(loss) else f"the dense gradient norm is {math.sqrt(bad)} (NaN/Inf elements)"
                kept = ckpt.latest(self.run_dir)
                raise NumericalError(
                    f"step {p.step}: {what}; stopped without checkpointing. Last good checkpoint: "
                    f"{kept or 'none'} (resume from it with a lower learning rate, or check the data of step {p.step})")
            dt = durs[p.step]
            rec = StepRecord(step=p.step, loss=loss, step_time_s=dt, tokens=p.tokens, samples=p.samples,
                             model_flops=p.flops, mfu=mfu(p.flops, dt, self.ranks.world, self.peak), imbalance=p.imbalance,
                             task_loss=dict(zip(self.tasks, p.task_loss.tolist())), seq_stats=p.seq_stats,
                             seq_max=p.seq_max)
            self.records.append(rec)
            if self.ranks.rank == 0:
                with RunDir(self.run_dir).metrics_path.open("a") as f:
                    f.write(json.dumps(rec.as_json()) + "\n")
                if self.bar is not None:
                    self.bar.update(self.bar.task_ids[0], status=f"loss={loss:.4f} step_s={dt:.3g} mfu={rec.mfu:.1%}")


def loader_throughput(loop: Loop, measured: list[StepRecord]) -> LoaderThroughput | None:
    """The loader's samples per second of its busy time against what this rank's measured steps consumed."""
    pf = getattr(loop, "prefetch", None)
    if pf is None or pf.busy_s <= 0 or not measured:
        return None
    batches = max(1, pf.taken)
    # per batch in the steady state: each reader's first batch (opening the files) and the first preparing
    # (allocating pinned buffers) left out, as warm-up steps are from the step statistics
    read = pf.steady_read_s / pf.steady_reads if pf.steady_reads else pf.read_s / batches
    prep = pf.steady_prepare_s / pf.steady_prepared if pf.steady_prepared else pf.prepare_s / batches
    per_batch = pf.samples / max(1, pf.produced)
    produced = per_batch / max(read, prep) if max(read, prep) > 0 else pf.samples / pf.busy_s
    consumed = sum(r.samples for r in measured) / loop.ranks.world / sum(r.step_time_s for r in measured)
    return LoaderThroughput(samples_per_s=produced, consumed_samples_per_s=consumed,
                            headroom=produced / consumed if consumed > 0 else 0.0,
                            waited_s_per_step=pf.waited_s / max(1, loop.steps - loop.start - 1),
                            read_s_per_batch=read, prepare_s_per_batch=prep, processes=pf.processes)


def write_summary(loop: Loop, built: Built, device_name: str, started: str, warmup: int, traced: set[int],
                  startup: Startup | None = None) -> None:
    """``summary.json`` (rank 0), over the measured steps: warm-up steps and profiled steps (the profiler
    slows the host) are left out. Every rank gives its peak memory."""
    plan, ranks, device, steps, start = loop.plan, loop.ranks, loop.device, loop.steps, loop.start
    records = loop.records
    measured = [r for r in records if r.step >= max(warmup, start) and r.step not in traced]
    if not measured:
        measured = [r for r in records if r.step >= max(warmup, start)]
    times = [r.step_time_s for r in measured]
    if device.type == "cuda":
        mem = float(torch.cuda.max_memory_allocated(device))
    else:
        mem = float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    mems: list = [None] * ranks.world
    dist.all_gather_object(mems, mem)
    if ranks.rank != 0:
        return
    optims, pm, pipe = built.optims, built.pm, loop.pipe
    total_t = sum(times)
    flops_mean = float(np.mean([r.model_flops for r in measured])) if measured else 0.0
    notes = [f"attention backend '{built.backend}'", f"balancing '{plan.balancing.policy}' with equal per-rank counts"
             + (f", within groups of {loop.reader.group_ranks} ranks (a node; the imbalance metric is the group's)"
                if loop.reader.group_ranks < ranks.world else ""),
             f"statistics over {len(measured)} steps (warm-up and profiled steps left out)", *built.notes,
             f"dense optimizer {'fused' if optims.fused_dense else 'foreach'}"
             + (f" (fused refused: {optims.fused_error})" if optims.fused_error else ""),
             f"dense optimizer stepped {'on local shards' if optims.local_step else 'through DTensor' if optims.dtensor_params else 'on plain tensors (no DTensor parameter)'}",
             f"data: {loop.prefetch.processes or 'no'} reader process(es) and a pinning thread",
             f"sparse input dist {'one batch ahead' + (' on a side stream' if pipe.stream is not None else '') if pipe.enabled else 'in forward'}",
             ("FSDP2: none (one rank; the CUDA graphs cast the fp32 masters)" if built.graphs is not None else
              f"FSDP2 units: {'one per layer' if pm.fsdp_per_layer else 'the dense root only'}"),
             *([built.graphs.stats.note()] if built.graphs is not None else []),
             *([optims.graph_note()] if optims.graph_note() else []),
             f"compile {loop.cfg.compile}",
             seq_chunk_note(loop.layout),
             *([loop.fp8_guard.note()] if loop.fp8_guard.modules else [])]
    if device.type == "cpu":
        notes.append("CPU functional run on gloo: step times, MFU and memory (host RSS) say nothing about GPUs")
    result = RunResult(
        run_id=loop.run_dir.name, plan_sha256=spec_sha256(plan), workload=plan.workload.name, world_size=ranks.world,
        device=device_name, versions=versions(), started_utc=started,
        ended_utc=datetime.now(timezone.utc).isoformat(timespec="seconds"), steps=steps,
        warmup_steps=min(warmup, steps), step_time=stats(times), model_flops_per_step=flops_mean,
        host_step=stats([t for r in measured if (t := loop.phases.total(r.step)) is not None]),
        host_phases=loop.phases.medians([r.step for r in measured]),
        measured_mfu=mfu(flops_mean, float(np.mean(times)), ranks.world, loop.peak) if times else 0.0,
        tokens_per_s=sum(r.tokens for r in measured) / total_t if total_t else 0.0,
        samples_per_s=sum(r.samples for r in measured) / total_t if total_t else 0.0,
        peak_memory_bytes=tuple(float(m) for m in mems), first_loss=records[0].loss if records else None,
        final_loss=records[-1].loss if records else None, attention_backend=built.backend, notes="; ".join(notes),
        startup=startup, loader=loader_throughput(loop, measured),
        options=RunOptions(seq_chunk=int(loop.layout.seq_chunk or 0), compile=loop.cfg.compile, attention_backend=built.backend,
                           cuda_graphs=built.graphs is not None and built.graphs.stats.replayed > 0
                           and built.graphs.stats.eager == 0 and built.graphs.stats.disabled is None, film=built.film,
                           head_pad="masked"),
    )
    dump_spec(result, RunDir(loop.run_dir).summary_path)
    st = result.step_time
    print(
        f"run {loop.run_dir}: {steps - start} steps, loss {result.first_loss:.4f} -> {result.final_loss:.4f}"
        + (f", step p50 {st.p50_s * 1e3:.1f} ms p90 {st.p90_s * 1e3:.1f} ms, MFU {result.measured_mfu:.2%}, "
           f"{result.tokens_per_s:,.0f} tokens/s" if st else ""),
        flush=True,
    )


def train(cfg: TrainConfig, plan: Plan, ranks: Ranks) -> int:
    """One run of ``plan`` on this rank (the process group is set up on the first)."""
    clock = StartupClock.begin()
    device, device_name = select_device(cfg, plan, ranks)
    if not dist.is_initialized():
        init_process_group("nccl" if device.type == "cuda" else "gloo", ranks.rank, ranks.world)
    global_batch = plan.workload.batch.global_(plan.world_size)
    if global_batch % ranks.world:
        raise MismatchError(f"global batch {global_batch} does not split evenly over {ranks.world} ranks")
    run_dir = open_run_dir(cfg, plan, ranks)
    clock.mark("launch")
    data_dir, generated = prepare_data(cfg, plan, global_batch, ranks.rank)
    clock.mark("data")
    built = build(cfg, plan, device, ranks, clock)
    start = resume(run_dir, built, ranks.rank) if cfg.resume else 0
    loop = Loop(cfg, plan, ranks, device, run_dir, built, data_dir, start)
    loop.clock = clock
    if ranks.rank == 0:  # this launch's switches, machine-readable (calibration reads seq_chunk from here)
        config = cfg.as_json()
        config["seq_chunks_per_sample"] = {g: loop.layout.chunks_per_sample(g) for g in loop.layout.sequence_groups}
        RunDir(run_dir).config_path.write_text(json.dumps(config, indent=1, sort_keys=True) + "\n")
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    warmup = cfg.warmup_steps()
    trace_first, trace_count = trace_window(cfg.trace, warmup, cfg.steps)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    loop.run(trace_first, trace_count)
    write_summary(loop, built, device_name, started, warmup, set(range(trace_first, trace_first + trace_count)),
                  clock.result(data_generated=generated))
    dist.barrier()
    if cfg.last_plan:
        dist.destroy_process_group()
    return 0


__all__ = ["Built", "Loop", "NumericalError", "build", "train", "trace_window"]
