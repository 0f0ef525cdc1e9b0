"""Trainer benchmark (issue 6): gem-h200 on one H200, once with the Triton attention kernels and once
with the PyTorch reference attention, in one invocation.

Each backend is a real ``coplan.trainer.train`` run under torchrun (one process) of the planner's plan
for the case's workload on ``h200-1gpu``, every table pinned table-wise (``coplan plan --gpus 1
--pin-table NAME=table_wise`` for each table: every table whole on the GPU, FBGEMM fused TBE; FSDP2 on
one rank for bf16 mixed precision), the attention backend the workload's ``kernels.attention``; step time from CUDA events, model FLOPs from ``coplan.costmodel.flops`` on
the real history lengths. Statistics leave out the warm-up steps and the last ``--trace-steps``
steps, which run under the profiler. The reference backend pads every sample to
the batch's longest history (up to 4,096) and holds fp32 ``[batch, heads, L, L]`` scores: at 64
samples one such tensor is 34 GB per layer, so its run uses ``--reference-batch`` samples per step
(default 8); MFU and tokens/s are per-step rates and stay comparable.

Cases (``--cases``, run in the order given, each skipped when too little of the ``--timeout`` budget is
left; a trainer launch costs ~30 s on the H200 before its first step). The default is the headline
run, ``triton-compile@b256,triton@b256,reference``: the trainer with ``--compile layers`` and eager, at
256 samples per step (at gem-h200's own 64 the step is host-bound), then the reference attention;
``--cases ab`` is the host-overhead A/B set of rounds v3-v5 (``triton`` ... ``triton-baseline``):

- ``triton``: the trainer as it runs by default (Triton attention; MoE experts as grouped GEMMs with
  no host sync; fused AdamW stepped on FSDP2's local shards; host batches pinned on the data thread and
  the next batch's copies and TorchRec input dist one step ahead on a side stream; the FiLM backward's
  per-sample sums as one-hot GEMMs; one FSDP2 unit on the one rank), 100 measured steps;
- ``triton-v3``: ``triton`` with ``local-optimizer``, ``sparse-pipeline``, ``segment-sum`` and ``fsdp-units``
  off (the trainer as v3 measured it; the A/B cases turn choices off through ``trainer_variants.py``);
- ``triton-dtensor-optim``: only ``local-optimizer`` off (AdamW, its guard norm through DTensor);
- ``triton-no-pipeline``: only ``sparse-pipeline`` off (pinning, copies, input dist at the step's start);
- ``triton-seq-whole`` (not in ``ab``): only ``--seq-chunk 0`` (each sample's history one bag of the
  sequence lookup, as before chunked bags; the default is bags of at most 32 ids);
- ``triton-segment-reduce``: only ``segment-sum`` off (fp32 segment reduction over a cast copy);
- ``triton-fsdp-layers``: only ``fsdp-units`` off (one FSDP2 unit per layer, as on many ranks);
- ``triton-baseline``: all of the above off, and ``moe-grouped`` and ``fused-optimizer`` (v2's loop);
- ``reference``: the PyTorch reference attention (at ``--reference-batch`` samples);
- ``triton-compile-cpp``: the same with ``--compile layers-cpp`` (Inductor's C++ wrapper; on the H200 with
  torch 2.11 Inductor fails compiling the backward graph: ``CudaKernelParamCache not populated``);
- ``triton-compile``: ``--compile layers``, 2 more warm-up steps, 30 measured, its own time limit
  (``--compile-case-timeout``, default 420 s: v3's 120 s ended with no step and no Inductor output) and
  ``TORCH_LOGS=recompiles,graph_breaks,dynamo,inductor``, whose timestamped compile stages the JSON keeps
  (``compile_log``), so that a slow compilation can be told from a stuck one.

Any case may be suffixed ``@b<N>`` to run it at N samples per step instead of the workload's local batch
(e.g. ``triton-compile@b128``; generated data of its own, same seed); the JSON and trace files name it
``<case>-b<N>``.

The A/B cases measure 30 steps each (the `ab` set takes ~4 min on the H200, the default run ~5 min).

Writes ``benchmarks/results/train_h200.json`` (or ``--out``): per case the measured local MFU,
tokens/s, step-time p50/p90, peak memory, where the time went in the profiled steps (the Kineto
trace attributed to the cost model's ops by ``coplan.calibration.attribution``), the per-kernel table and
the host side of the profiled steps (kernel launches, blocking syncs and the time they waited, host
busy time per thread, GPU idle share; each slow host op with its thread, the ranges around it and its
CUDA runtime calls), the measured steps' spread, and each case's trace, gzipped beside ``--out``.

The lent GPU machine has no OR-Tools: ``--plan-only --plans DIR`` makes every case's plan on any machine
and stops; ``--plans DIR`` then runs those plans (a plan made for other inputs is planned again).

    python benchmarks/train_h200.py --plan-only --plans benchmarks/results/train_plans   # anywhere, first
    python benchmarks/train_h200.py --plans benchmarks/results/train_plans               # on the H200
    python benchmarks/train_h200.py --device cpu --workload gem-tiny --steps 6 --warmup 2   # smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
try:
    from _common import git_commit, plan_command, plan_facts, planned, table_pins  # noqa: E402
except ImportError:  # the script copied alone to the device: COPLAN_GIT_COMMIT still names the commit
    def git_commit() -> str:
        return os.environ.get("COPLAN_GIT_COMMIT", "unknown")

    def planned(*a, **k):
        raise RuntimeError("benchmarks/_common.py is not beside this script: it makes (or loads) the plans")

    plan_command = plan_facts = table_pins = planned

from coplan.spec import RunDir, dump_spec, load_topology, load_workload
from coplan.spec.workload import InterFormerBlock, KunlunBlock, MoEBlock
from coplan.trainer.data import data_sha256, generate_dataset


def workload_dims(w) -> dict:
    """The dimensions to state beside the figures."""
    from coplan.costmodel.flops import dense_params
    from coplan.costmodel.jagged import length_moments

    inter = next(b for b in w.blocks if isinstance(b, InterFormerBlock))
    kun = next(b for b in w.blocks if isinstance(b, KunlunBlock))
    moe = next(b for b in w.blocks if isinstance(b, MoEBlock))
    seq = w.sequence(inter.sequence).length
    mom = length_moments(seq)
    dense, expert = dense_params(w)
    tables = w.all_tables
    return {
        "model_dim": inter.model_dim, "heads": inter.num_heads, "head_dim": inter.head_dim,
        "interformer_layers": inter.num_layers, "kunlun_layers": kun.num_layers, "kunlun_tokens": kun.num_tokens,
        "moe_experts": moe.num_experts, "moe_top_k": moe.top_k, "moe_hidden": moe.expert_hidden_dim,
        "history": seq.model_dump(mode="json"), "history_mean": mom.mean, "history_max": mom.max_len,
        "tables": len(tables), "sequence_tables": sum(t.feature_kind == "sequence" for t in tables),
        "embedding_params": w.sparse_params, "dense_params": dense, "expert_params": expert,
        "attention": inter.attention.model_dump(mode="json"),
    }


def trace_breakdown(path: Path, top: int = 20) -> dict:
    """Where the profiled steps' time went, per op class and per op (cost-model names)."""
    from coplan.calibration.attribution import attribute_file

    a = attribute_file(path)
    steps = max(1, a.steps)
    ops = sorted(a.ops, key=lambda o: -o.time_s)
    return {
        "on_device": a.on_device, "profiled_steps": a.steps,
        "total_ms_per_step": a.total_s / steps * 1e3,
        "unattributed_ms_per_step": a.unattributed_s / steps * 1e3,
        "by_class_ms_per_step": {k: v / steps * 1e3 for k, v in sorted(a.by_class_s.items(), key=lambda kv: -kv[1])},
        "top_ops_ms_per_step": [{"op": o.name, "phase": o.phase, "ms": o.time_s / steps * 1e3} for o in ops[:top]],
        "by_block_ms_per_step": _by_block(a.ops, steps),
    }


KERNEL_FAMILIES = (  # first match wins
    ("indexing backward (scatter-add)", r"indexing_backward_kernel"),
    ("GEMM (cuBLAS)", r"nvjet|gemm|cutlass|xmma"),
    ("jagged attention (Triton)", r"^_fwd_kernel|^_bwd_dq_kernel|^_bwd_dkdv_kernel|_block_counts_kernel"),
    ("embedding (FBGEMM TBE)", r"split_embedding|embedding|linearize_index|bounds_check|radix_sort|fbgemm"),
    ("optimizer (AdamW foreach)", r"multi_tensor_apply"),
    ("layer norm", r"layer_norm|GammaBeta"),
    ("collective / copy", r"nccl|Memcpy|memcpy|CatArrayBatchedCopy|chunk_cat|copy_kernel"),
)


def kernel_table(path: Path, top: int = 25) -> dict:
    """Device time per kernel name over the profiled steps, and the GPU's idle share of them."""
    import gzip

    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    steps = [e for e in events if e["name"].startswith("ProfilerStep#")]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    n = max(1, len({e["name"] for e in steps}))
    per: dict[str, list[float]] = {}
    for e in kernels:
        acc = per.setdefault(e["name"][:100], [0.0, 0])
        acc[0] += e["dur"]
        acc[1] += 1
    # Host step ranges only: the GPU timeline can carry more than one `ProfilerStep#N` annotation per
    # step (work on a side stream, e.g. the next batch's input dist, gets its own), and averaging those
    # fragments with the host ranges gave a meaningless window (and a negative idle share).
    host_steps = [e for e in steps if e.get("cat") == "user_annotation"] or steps
    step_us = sum(e["dur"] for e in host_steps) / len(host_steps) if host_steps else 0.0
    busy_us = sum(e["dur"] for e in kernels) / n
    # The device window: first kernel start to last kernel end over the profiled steps, per step.
    window_us = ((max(e["ts"] + e["dur"] for e in kernels) - min(e["ts"] for e in kernels)) / n) if kernels else 0.0
    rows = sorted(per.items(), key=lambda kv: -kv[1][0])[:top]
    families: dict[str, float] = {}
    for name, (us, _) in per.items():
        fam = next((f for f, pat in KERNEL_FAMILIES if re.search(pat, name)), "other elementwise")
        families[fam] = families.get(fam, 0.0) + us / n / 1e3
    return {
        "by_family_ms_per_step": dict(sorted(families.items(), key=lambda kv: -kv[1])),
        "profiled_steps": n, "step_ms_under_profiler": step_us / 1e3, "kernel_busy_ms_per_step": busy_us / 1e3,
        "device_window_ms_per_step": window_us / 1e3,
        "gpu_idle_share": 1.0 - busy_us / window_us if window_us else None,
        "top_kernels": [{"kernel": k, "ms_per_step": v[0] / n / 1e3, "calls_per_step": v[1] / n} for k, v in rows],
    }


def host_table(path: Path) -> dict:
    """The host side of the profiled steps: launches, blocking syncs (and how long they waited: a
    sync drains the GPU's queue, which then idles while the host refills it), host busy time."""
    import gzip

    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        raw = json.load(f)["traceEvents"]
    events = [e for e in raw if e.get("ph") == "X"]
    thread_names = {e.get("tid"): e.get("args", {}).get("name") for e in raw if e.get("ph") == "M" and e.get("name") == "thread_name"}
    del raw
    steps = [e for e in events if e["name"].startswith("ProfilerStep#") and e.get("cat") == "user_annotation"]
    if not steps:
        return {"error": "no ProfilerStep ranges on the host"}
    windows = [(e["ts"], e["ts"] + e["dur"]) for e in steps]
    n = len(steps)

    def inside(e) -> bool:
        return any(a <= e["ts"] < b for a, b in windows)

    rt = [e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver") and inside(e)]
    launches = sum(1 for e in rt if "LaunchKernel" in e["name"])
    syncs = [e for e in rt if e["name"] in ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
             or (e["name"].startswith("cudaMemcpy") and e["dur"] > 100)]
    # which op asked for each long wait (innermost host range around it)
    cpu = [e for e in events if e.get("cat") in ("cpu_op", "user_annotation")]
    waits: dict[str, list[float]] = {}
    for e in syncs:
        if e["dur"] < 100:
            continue
        around = [c for c in cpu if c["tid"] == e["tid"] and c["ts"] <= e["ts"] and c["ts"] + c["dur"] >= e["ts"] + e["dur"]
                  and not c["name"].startswith("aten::") and not c["name"].startswith("ProfilerStep")]
        who = min(around, key=lambda c: c["dur"])["name"][:80] if around else "?"
        acc = waits.setdefault(who, [0.0, 0])
        acc[0] += e["dur"] / n / 1e3
        acc[1] += 1 / n
    busy: dict[str, float] = {}
    for tid in {e["tid"] for e in cpu}:
        top, end = [], -1.0
        for c in sorted((c for c in cpu if c["tid"] == tid and inside(c) and not c["name"].startswith("ProfilerStep")),
                        key=lambda c: c["ts"]):
            if c["ts"] >= end:
                top.append(c)
                end = c["ts"] + c["dur"]
        ms = sum(c["dur"] for c in top) / n / 1e3
        if ms > 0.5:
            busy[str(tid)] = ms
    # single host ops of over a millisecond that are not waits (e.g. cuBLAS planning a GEMM of a new shape)
    slow = []
    for c in cpu:
        if c["dur"] > 1000 and c["name"].startswith("aten::") and inside(c):
            kids = [e for e in rt if e["tid"] == c["tid"] and c["ts"] <= e["ts"] and e["ts"] + e["dur"] <= c["ts"] + c["dur"]]
            waited = sum(e["dur"] for e in kids if e in syncs)
            if c["dur"] - waited > 1000 and not any(d is not c and d["name"].startswith("aten::") and d["tid"] == c["tid"]
                                                    and c["ts"] <= d["ts"] and d["ts"] + d["dur"] <= c["ts"] + c["dur"]
                                                    and d["dur"] > 1000 for d in cpu):
                slow.append(c)
    # inclusive host time of the named ranges per step, layer indices and module names folded
    # (interformer.*.gdpa, FSDP::pre_forward): which machinery the host's time goes to
    by_range: dict[str, list[float]] = {}
    for c in cpu:
        if c.get("cat") != "user_annotation" or c["name"].startswith("ProfilerStep") or not inside(c):
            continue
        key = re.sub(r"\.\d+\.", ".*.", re.sub(r" \(.*\)$", "", c["name"]))[:80]
        acc = by_range.setdefault(key, [0.0, 0])
        acc[0] += c["dur"] / n / 1e3
        acc[1] += 1 / n
    busiest = max(busy, key=busy.get) if busy else None
    return {
        "slow_host_ops_ms_per_step": sum(c["dur"] for c in slow) / n / 1e3,
        "slow_host_ops": [_describe_slow_op(c, cpu, rt, thread_names, busiest)
                          for c in sorted(slow, key=lambda c: -c["dur"])[:16]],
        "thread_names": {str(k): v for k, v in thread_names.items() if str(k) in busy},
        "host_ms_per_step_by_range": {k: {"ms": round(v[0], 3), "per_step": round(v[1], 2)}
                                      for k, v in sorted(by_range.items(), key=lambda kv: -kv[1][0])[:40]},
        "launches_per_step": launches / n,
        "blocking_syncs_per_step": len(syncs) / n,
        "sync_wait_ms_per_step": sum(e["dur"] for e in syncs) / n / 1e3,
        "long_waits_by_op": {k: {"ms_per_step": v[0], "per_step": v[1]} for k, v in sorted(waits.items(), key=lambda kv: -kv[1][0])},
        "host_busy_ms_per_step_by_thread": busy,
    }


def _describe_slow_op(c: dict, cpu: list[dict], rt: list[dict], thread_names: dict, busiest: str | None) -> dict:
    """What a slow host op was doing: its thread, the ranges around it (outermost first: which layer,
    forward or backward node, optimizer, FSDP hook), the ops right inside it, and the CUDA runtime calls
    it made with their durations (a cudaLaunchKernel over 0.1 ms means a full launch queue,
    cudaMalloc/cudaHostAlloc an allocator miss, a cudaStreamSynchronize a wait)."""
    lo, hi, tid = c["ts"], c["ts"] + c["dur"], c["tid"]
    around = sorted((e for e in cpu if e["tid"] == tid and e is not c and e["ts"] <= lo and e["ts"] + e["dur"] >= hi
                     and not e["name"].startswith("ProfilerStep")), key=lambda e: (e["ts"], -e["dur"]))
    inside = [e for e in cpu if e["tid"] == tid and e is not c and lo <= e["ts"] and e["ts"] + e["dur"] <= hi]
    direct = [e for e in inside if not any(d is not e and d["ts"] <= e["ts"] and e["ts"] + e["dur"] <= d["ts"] + d["dur"]
                                           for d in inside)]
    calls = [e for e in rt if e["tid"] == tid and lo <= e["ts"] and e["ts"] + e["dur"] <= hi]
    by_call: dict[str, list[float]] = {}
    for e in calls:
        acc = by_call.setdefault(e["name"], [0, 0.0, 0.0])
        acc[0] += 1
        acc[1] += e["dur"] / 1e3
        acc[2] = max(acc[2], e["dur"] / 1e3)
    return {
        "op": c["name"], "ms": c["dur"] / 1e3, "tid": str(tid), "thread": thread_names.get(tid),
        "busiest_thread": str(tid) == busiest,
        "ranges": [e["name"][:100] for e in around][-8:],
        "children": [{"op": e["name"][:80], "ms": e["dur"] / 1e3} for e in sorted(direct, key=lambda e: -e["dur"])[:5]],
        "runtime_calls": {k: {"n": v[0], "ms": round(v[1], 4), "max_ms": round(v[2], 4)}
                          for k, v in sorted(by_call.items(), key=lambda kv: -kv[1][1])},
        "runtime_ms": sum(e["dur"] for e in calls) / 1e3,
    }


def step_spread(times_s: list[float]) -> dict:
    """How much the measured steps vary: a p50 of a dozen steps moved by as much as the changes measured."""
    import numpy as np

    if not times_s:
        return {}
    a = np.asarray(times_s) * 1e3
    half = len(a) // 2
    return {
        "n": len(a), "mean_ms": float(a.mean()), "std_ms": float(a.std(ddof=1)) if len(a) > 1 else 0.0,
        "p10_ms": float(np.percentile(a, 10)), "p25_ms": float(np.percentile(a, 25)), "p50_ms": float(np.percentile(a, 50)),
        "p75_ms": float(np.percentile(a, 75)), "p90_ms": float(np.percentile(a, 90)), "min_ms": float(a.min()),
        "max_ms": float(a.max()),
        # drift over the run (allocator warm-up, clocks, a co-tenant): the two halves' medians
        "p50_first_half_ms": float(np.median(a[:half])) if half else None,
        "p50_second_half_ms": float(np.median(a[half:])) if half else None,
    }


def _by_block(ops, steps: int) -> dict:
    out: dict[str, float] = {}
    for o in ops:
        key = o.name.split(".")[0]
        out[key] = out.get(key, 0.0) + o.time_s / steps * 1e3
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


# name -> (attention backend, extra trainer arguments, extra warm-up steps, measured steps). The
# A/B cases turn one of the defaults' host-overhead changes off each; every one runs on the same data
# in the same invocation (compare within a run: runs on different leases differ by as much).
CASES = {
    "triton": ("triton", [], 0, 100),
    "triton-v3": ("triton", ["--off", "local-optimizer,sparse-pipeline,segment-sum,fsdp-units"], 0, 30),
    "triton-dtensor-optim": ("triton", ["--off", "local-optimizer"], 0, 30),
    "triton-no-pipeline": ("triton", ["--off", "sparse-pipeline"], 0, 30),
    "triton-seq-whole": ("triton", ["--seq-chunk", "0"], 0, 30),
    "triton-segment-reduce": ("triton", ["--off", "segment-sum"], 0, 30),
    "triton-fsdp-layers": ("triton", ["--off", "fsdp-units"], 0, 30),
    "triton-baseline": ("triton", ["--off", "moe-grouped,fused-optimizer,local-optimizer,sparse-pipeline,segment-sum,"
                                   "fsdp-units"], 0, 30),
    "reference": ("reference", [], 0, 12),
    "triton-compile": ("triton", ["--compile", "layers"], 2, 30),
    "triton-compile-cpp": ("triton", ["--compile", "layers-cpp"], 2, 30),
}
# ``<case>@b<N>`` runs a case at N samples per step instead of the workload's local batch (its own data)
_AT_BATCH = re.compile(r"^(?P<case>[a-z0-9-]+)@b(?P<batch>[1-9][0-9]*)$")
# The headline run: the compiled layers and eager, both at 256 samples per step (at the workload's 64
# the step is host-bound: docs/benchmarks-log/trainer.md, v6), then the reference attention at --reference-batch.
DEFAULT_CASES = ("triton-compile@b256", "triton@b256", "reference")
# the host-overhead A/B set of v3-v5 (--cases ab)
AB_CASES = ("triton", "triton-v3", "triton-dtensor-optim", "triton-no-pipeline", "triton-segment-reduce",
            "triton-fsdp-layers", "triton-baseline")
MIN_CASE_S = 45  # below this a launch cannot reach its measured steps: skip the case instead
# the compile case's logs: Dynamo's and Inductor's INFO lines name each compile stage with a timestamp
COMPILE_LOGS = "recompiles,graph_breaks,dynamo,inductor"
_COMPILE_STAGE = re.compile(r"(Step \d: |Graph break in user code|Recompiling function|Restarting analysis|"
                            r"TorchDynamo compilation metrics|Traceback|Error)")


def compile_log(log: str) -> dict:
    """The compile stages of a ``--compile layers`` run's log (TORCH_LOGS as :data:`COMPILE_LOGS`):
    how many graphs were compiled, broken and recompiled, and the last stages reached, with their
    timestamps (the last one of a timed-out run says where it stood)."""
    lines = log.splitlines()
    stages = [ln[:300] for ln in lines if _COMPILE_STAGE.search(ln)]
    return {
        "dynamo_frames_traced": sum("torchdynamo start tracing" in ln for ln in lines),
        "inductor_graphs_done": sum("torchinductor done compiling" in ln for ln in lines),
        "inductor_graphs_started": sum("torchinductor compiling" in ln for ln in lines),
        "graph_breaks": sum("Graph break in user code" in ln for ln in lines),
        "recompiles": sum("Recompiling function" in ln for ln in lines),
        "restarts": sum("Restarting analysis" in ln for ln in lines),
        "stages_first": stages[:40],
        "stages_last": stages[-40:],
    }


def split_case(case: str) -> tuple[str, int | None]:
    """``"triton-compile@b128"`` -> ``("triton-compile", 128)``; a plain case name -> ``(name, None)``."""
    m = _AT_BATCH.match(case)
    return (m["case"], int(m["batch"])) if m else (case, None)


def case_plan(case: str, w, topo, args):
    """(the case's workload, its samples per step or None, its plan): ``w`` with the case's attention
    backend and batch, planned by ``coplan plan --gpus 1`` with every table pinned table-wise."""
    base_case, batch = split_case(case)
    backend = CASES[base_case][0]
    if backend == "reference" and batch is None:
        batch = args.reference_batch
    wb = w.model_copy(update={"kernels": w.kernels.model_copy(update={"attention": backend})})
    if batch is not None:
        wb = wb.model_copy(update={"batch": wb.batch.model_copy(update={"local_batch_size": batch, "global_batch_size": None})})
    key = f"train-{w.name}-{backend}" + (f"-b{batch}" if batch is not None else "")  # cases that differ only in trainer options share one
    plan = planned(key, wb, topo, 1, tables=table_pins(wb), plans_dir=args.plans, log=_log)
    return wb, batch, plan


def run_backend(plan_path: Path, args, run_id: str, data: Path, extra: list[str] | None = None, *,
                warmup: int | None = None, timeout: float | None = None, measured: int = 12, case: str = "run") -> dict:
    warmup = args.warmup if warmup is None else warmup
    # --steps (total, all cases) overrides the case's own measured count (the CPU smoke test uses it)
    steps = args.steps + (warmup - args.warmup) if args.steps else warmup + measured + args.trace_steps
    extra = list(extra or [])
    # an A/B case turns trainer choices off through trainer_variants.py (the trainer itself has no switch)
    entry = ["-m", "coplan.trainer.train"]
    if extra[:1] == ["--off"]:
        entry, extra = [str(Path(__file__).resolve().parent / "trainer_variants.py"), *extra[:2]], extra[2:]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1", *entry,
           str(plan_path), "--device", args.device, "--steps", str(steps), "--warmup", str(warmup),
           "--runs-root", str(args.runs_root), "--run-id", run_id, "--data", str(data), "--no-progress",
           "--trace", f"{steps - args.trace_steps}:{steps}", "--checkpoint-every", "-1",
           "--log-every", str(steps), *extra]
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
    compiling = "--compile" in (extra or [])
    if compiling:
        env["TORCH_LOGS"] = env.get("TORCH_LOGS") or COMPILE_LOGS
    t0 = time.monotonic()
    limit = timeout or args.timeout
    # the log goes to a file as it is written: a killed run keeps all of it (a pipe read at the end
    # lost it when Inductor's compile workers held the pipe open)
    log_path = args.runs_root / f"{run_id}.log"
    with open(log_path, "w") as log_f:
        # its own session, so that a timeout kills torchrun's workers too (they would hold the GPU)
        proc = subprocess.Popen(cmd, stdout=log_f, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)
        try:
            proc.wait(timeout=limit)
            timed_out = False
        except subprocess.TimeoutExpired:
            _kill_run(proc)
            timed_out = True
    wall = time.monotonic() - t0
    log = log_path.read_text(errors="replace")
    extra_out = {"log_file": str(log_path)}
    if compiling:
        extra_out["compile_log"] = compile_log(log)
        extra_out["torch_logs"] = env["TORCH_LOGS"]
    if timed_out:
        return {"ok": False, "error": f"timed out after {limit:.0f} s", "wall_s": wall, "command": cmd,
                "log_tail": log[-5000:], **extra_out}
    run_dir = args.runs_root / run_id
    if proc.returncode != 0:
        return {"ok": False, "returncode": proc.returncode, "wall_s": wall, "command": cmd,
                "log_tail": log[-5000:], **extra_out}
    rd = RunDir(run_dir)
    s = rd.result()
    lines = rd.metrics()
    measured = [x for x in lines if warmup <= x["step"] < steps - args.trace_steps]
    out = {
        "ok": True, "wall_s": wall, "run_dir": str(run_dir), "attention_backend": s.attention_backend,
        "trainer_args": extra or [], "steps": steps, "warmup_steps": warmup,
        "local_batch": s.samples_per_s and round(sum(x["samples"] for x in measured) / max(1, len(measured))),
        "measured_local_mfu": s.measured_mfu,
        "tokens_per_s": s.tokens_per_s, "samples_per_s": s.samples_per_s,
        "step_time_ms": {k.removesuffix("_s"): v * 1e3 for k, v in s.step_time.model_dump().items()} if s.step_time else None,
        "measured_steps": [x["step"] for x in measured],
        "peak_memory_gib": [m / 2**30 for m in s.peak_memory_bytes],
        "model_tflop_per_step": s.model_flops_per_step / 1e12,
        "tokens_per_step": sum(x["tokens"] for x in measured) / max(1, len(measured)),
        "loss_first_last": [s.first_loss, s.final_loss],
        "mfu_per_step": [x["mfu"] for x in measured],
        "step_time_ms_per_step": [x["step_time_s"] * 1e3 for x in measured],
        "step_spread": step_spread([x["step_time_s"] for x in measured]),
        "versions": s.versions, "device": s.device, "notes": s.notes, **extra_out,
    }
    if compiling:  # compile time shows in the warm-up steps' times
        out["warmup_step_time_ms"] = [x["step_time_s"] * 1e3 for x in lines if x["step"] < warmup]
    trace = rd.trace_path(0)
    if trace.is_file() and args.keep_traces:
        # the evidence stays with the figures (v3's trace was lost with the device): gzipped beside --out
        import gzip
        import shutil

        kept = args.out.parent / f"{args.out.stem}_trace_{case}.json.gz"
        try:
            with open(trace, "rb") as src, gzip.open(kept, "wb", compresslevel=9) as dst:
                shutil.copyfileobj(src, dst)
            out["trace_file"] = str(kept)
            out["trace_file_bytes"] = kept.stat().st_size
        except OSError as e:
            out["trace_file"] = f"not kept: {e}"
    if trace.is_file():
        try:
            out["trace"] = trace_breakdown(trace)
        except Exception as e:  # the figures stand without the breakdown
            out["trace"] = {"error": f"{type(e).__name__}: {e}"}
        for key, fn in (("kernels", kernel_table), ("host", host_table)):
            try:
                out[key] = fn(trace)
            except Exception as e:
                out[key] = {"error": f"{type(e).__name__}: {e}"}
    return out


def _children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def _kill_run(proc: subprocess.Popen) -> None:
    """Kill a timed-out torchrun and its workers: torchrun starts each worker in a session of its
    own, so killing torchrun's group alone would leave them running (and holding the GPU)."""
    workers = _children(proc.pid)
    for pid in [proc.pid, *workers]:
        try:
            os.killpg(pid, signal.SIGKILL)  # each is the leader of a group this script started
        except (ProcessLookupError, PermissionError):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _log(msg: str) -> None:
    print(f"[{datetime.now(timezone.utc).strftime('%H:%M:%S')}] {msg}", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", default="gem-h200")
    p.add_argument("--topology", default="h200-1gpu")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--steps", type=int, default=None,
                   help="total steps of every case (default: each case's own measured steps + warm-up + traced)")
    p.add_argument("--warmup", type=int, default=6)
    p.add_argument("--trace-steps", type=int, default=2)
    p.add_argument("--reference-batch", type=int, default=8, help="samples per step of the reference-attention run")
    p.add_argument("--data-batches", type=int, default=12, help="distinct global batches generated (steps cycle over them)")
    p.add_argument("--cases", "--backends", dest="cases", default=",".join(DEFAULT_CASES),
                   help=f"comma-separated, from {sorted(CASES)}")
    p.add_argument("--runs-root", type=Path, default=Path("runs/bench"))
    p.add_argument("--keep-traces", action=argparse.BooleanOptionalAction, default=True,
                   help="copy each case's Kineto trace, gzipped, beside --out (<out stem>_trace_<case>.json.gz)")
    p.add_argument("--timeout", type=int, default=420,
                   help=f"seconds for all cases together (a case is skipped when under {MIN_CASE_S} s are left)")
    p.add_argument("--case-timeout", type=int, default=120, help="seconds for one case at most")
    p.add_argument("--compile-case-timeout", type=int, default=420,
                   help="seconds for the triton-compile case at most (compilation happens in its first steps)")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/train_h200.json"))
    p.add_argument("--plans", type=Path, default=None, metavar="DIR",
                   help="run the plans in DIR made beforehand (plan-train-<workload>-<backend>[-b<N>].json); a missing one is "
                        "planned here and written there")
    p.add_argument("--plan-only", action="store_true", help="make (or check) every case's plan, print what each chose, and stop")
    p.add_argument("--reanalyze", nargs=2, metavar=("BACKEND", "TRACE"), default=None,
                   help="add the per-kernel and host tables of a saved trace (.json or .json.gz) to --out's BACKEND entry, then stop")
    args = p.parse_args(argv)
    if args.reanalyze:
        backend, trace = args.reanalyze
        res = json.loads(args.out.read_text())
        res["backends"][backend]["kernels"] = kernel_table(Path(trace))
        res["backends"][backend]["host"] = host_table(Path(trace))
        res["backends"][backend]["kernels_from"] = str(trace)
        args.out.write_text(json.dumps(res, indent=1, default=str) + "\n")
        print(json.dumps({k: res["backends"][backend][k] for k in ("host", "kernels")}, indent=1)[:4000])
        return 0

    w = load_workload(args.workload)
    topo = load_topology(args.topology)
    cases = [c for c in args.cases.split(",") if c]
    cases = [x for c in cases for x in (AB_CASES if c == "ab" else (c,))]
    unknown = [c for c in cases if split_case(c)[0] not in CASES]
    if unknown:
        p.error(f"unknown case(s) {unknown}; choose from {sorted(CASES)}, each optionally with @b<samples per step>")
    if args.plan_only:
        failed = 0
        for case in cases:
            try:
                wb, _, plan = case_plan(case, w, topo, args)
                _log(f"{case}: {plan_command(wb, 1, tables=table_pins(wb))}: {json.dumps(plan_facts(plan))}")
            except Exception as e:
                failed += 1
                _log(f"{case}: no plan: {type(e).__name__}: {e}")
        return 1 if failed else 0
    args.runs_root.mkdir(parents=True, exist_ok=True)
    data = args.runs_root / "data" / f"{w.name}-{data_sha256(w)[:8]}"
    t0 = time.monotonic()
    if not (data / "dataset.json").is_file():
        gb = w.batch.global_(1)
        generate_dataset(w, data, gb * args.data_batches, seed=0, rows_per_file=gb * args.data_batches)
    gen_s = time.monotonic() - t0
    _log(f"data ready in {gen_s:.1f} s")
    datasets = {None: data}
    results: dict = {}
    out = {
        "benchmark": "trainer (issue 6)",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": "python benchmarks/train_h200.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "git_commit": git_commit(),
        "host": {"python": platform.python_version(), "machine": platform.machine(), "cpus": os.cpu_count()},
        "workload": w.name, "topology": topo.name, "dims": workload_dims(w),
        "peak_bf16_flops_per_s": topo.gpu.peak_flops_per_s.get("bf16"),
        "steps": args.steps, "warmup_steps": args.warmup, "data_generation_s": gen_s,
        "backends": results,
        "plan_source": plan_command(w, 1, tables=table_pins(w)) + " (per case: its attention backend and batch)",
        "plans": {},
    }
    try:
        import torch

        out["versions"] = {"torch": torch.__version__, "cuda": torch.version.cuda,
                           "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"}
        import triton

        out["versions"]["triton"] = triton.__version__
    except Exception as e:
        out.setdefault("versions", {})["error"] = str(e)
    args.out.parent.mkdir(parents=True, exist_ok=True)

    def write() -> None:  # after every case: a later overrun keeps what was measured
        args.out.write_text(json.dumps(out, indent=1, default=str) + "\n")

    for case in cases:
        left = args.timeout - (time.monotonic() - t0)
        if left < MIN_CASE_S:
            results[case] = {"ok": False, "skipped": f"time budget spent ({left:.0f} s left of --timeout {args.timeout})"}
            _log(f"{case}: skipped, {left:.0f} s left")
            write()
            continue
        base_case, batch = split_case(case)
        backend, extra, more_warmup, measured = CASES[base_case]
        tag = case.replace("@", "-")  # file names that come back from the device: no '@'
        try:
            wb, batch, plan = case_plan(case, w, topo, args)
            out["plans"][case] = plan_facts(plan)
            if batch is not None and backend != "reference" and batch not in datasets:
                datasets[batch] = args.runs_root / "data" / f"{w.name}-b{batch}-{data_sha256(wb)[:8]}"
                if not (datasets[batch] / "dataset.json").is_file():
                    generate_dataset(wb, datasets[batch], batch * args.data_batches, seed=0, rows_per_file=batch * args.data_batches)
            case_data = data if backend == "reference" else datasets[batch]
            plan_path = dump_spec(plan, args.runs_root / f"plan-{tag}.json")
            cap = args.compile_case_timeout if "--compile" in extra else args.case_timeout
            _log(f"{case}: start ({min(left, cap):.0f} s allowed)")
            results[case] = run_backend(plan_path, args, f"{w.name}-{tag}", case_data, extra, warmup=args.warmup + more_warmup,
                                        timeout=min(left, cap), measured=measured, case=tag)
        except Exception as e:  # one failing case must not lose the others
            results[case] = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        r = results[case]
        _log(f"{case}: " + json.dumps({k: v for k, v in r.items() if k in ("ok", "measured_local_mfu", "tokens_per_s", "step_time_ms", "peak_memory_gib", "error", "skipped")}, default=str))
        if r.get("compile_log"):
            cl = r["compile_log"]
            _log(f"{case}: compile " + json.dumps({k: v for k, v in cl.items() if not k.startswith("stages")}))
            print("\n".join(cl["stages_last"][-12:]), flush=True)
        if not r.get("ok") and r.get("log_tail"):
            print(r["log_tail"][-2000:], flush=True)
        write()
    write()
    _log(f"wrote {args.out}")
    return 0 if all(r.get("ok") for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
