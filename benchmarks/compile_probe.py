"""What ``--compile layers`` costs and whether it settles: compile time per layer kind, graphs, graph
breaks and recompiles over steps whose jagged lengths change (issue 6).

The trainer's compiled regions are each InterFormer and Kunlun layer's ``forward``
(:func:`coplan.trainer.distributed.compile.compile_layer`). This script compiles exactly those, outside
the trainer (no TorchRec, no FSDP, no torchrun), so that a slow or stuck compilation shows by itself:

- ``interformer`` / ``kunlun``: one layer of the workload, ``--steps`` forward + backward steps, the
  history lengths of every step drawn afresh from the workload's length distribution (capped at
  ``--max-tokens`` tokens a step so that a CPU run stays small; Kunlun's token count is fixed by the
  model, as in the trainer);
- ``interformer-stack`` / ``kunlun-stack``: every layer of the block in sequence, each compiled
  separately as the trainer does: one compilation must serve all layers of a kind.

Each case runs in a child process with its own time limit (a stuck compilation is killed and
reported, the other cases still run) under ``TORCH_LOGS=recompiles,graph_breaks`` plus Dynamo's and
Inductor's INFO progress lines (``--progress-logs``), which carry timestamps: the JSON keeps the log
tail, so a timed-out case shows the last compile stage it reached. Per case: compile seconds of the
first forward and of the first backward (first call minus the steady median), Dynamo's own
per-phase compile times, unique graphs, frames, graph-break reasons, recompile reasons, per-step
times, and the largest difference against the eager layer (outputs and gradients) on the last step.

    python benchmarks/compile_probe.py --device cpu --workload gem-tiny          # CPU (Inductor's C++ backend)
    python benchmarks/compile_probe.py --device cpu --workload gem-h200 --max-tokens 512 --batch 4
    python benchmarks/compile_probe.py --device cuda --workload gem-h200 --timeout 420   # on the H200
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
try:
    from _common import git_commit  # noqa: E402
except ImportError:  # the script copied alone to the device
    def git_commit() -> str:
        return os.environ.get("COPLAN_GIT_COMMIT", "unknown")

CASES = ("interformer", "kunlun", "interformer-stack", "kunlun-stack")
MIN_CASE_S = 20  # below this a case cannot even import torch and build its layer: skip it
# Dynamo/Inductor INFO lines that mark compile stages (the rest of their INFO output is dropped from
# the JSON's stage list; the full tail is kept)
_STAGE = re.compile(r"(Step \d|torchdynamo|torchinductor|Recompiling|Graph break|recompil|Compiling|compiled)", re.I)


def _log(msg: str) -> None:
    print(f"[{datetime.now(timezone.utc).strftime('%H:%M:%S')}] {msg}", flush=True)


# ---------------------------------------------------------------------------------------------
# child: one case
# ---------------------------------------------------------------------------------------------


def _lengths(workload, seq: str, batch: int, max_tokens: int, rng) -> list[int]:
    """One step's history lengths from the workload's distribution, scaled down to ``max_tokens``."""
    from coplan.spec.workload import sample_lengths

    dist = workload.sequence(seq).length
    ln = sample_lengths(dist, batch, seed=int(rng.integers(2**31)))
    total = int(ln.sum())
    if max_tokens and total > max_tokens:
        ln = (ln * (max_tokens / total)).astype(int).clip(1, None)
    return [int(x) for x in ln]


def _child(args) -> dict:
    import copy
    import logging

    import numpy as np
    import torch

    from coplan.spec import load_workload
    from coplan.spec.workload import InterFormerBlock, KunlunBlock
    from coplan.trainer.distributed.compile import compile_layer
    from coplan.trainer.features import feature_layout
    from coplan.trainer.model.gem import DenseArch, token_layout
    from coplan.trainer.model.layers import InterFormerLayer, KunlunLayer, segment_sum_gemm_enabled

    # graph breaks and recompiles as Dynamo reports them, collected from its loggers
    records: list[str] = []

    class _Keep(logging.Handler):
        def emit(self, record):  # noqa: D401
            try:
                msg = record.getMessage()
            except Exception:
                return
            if "recompil" in record.name or "graph_breaks" in record.name or "Graph break" in msg or "Recompiling" in msg:
                records.append(msg[:2000])

    logging.getLogger("torch").addHandler(_Keep())

    device = torch.device(args.device)
    w = load_workload(args.workload)
    backend = args.backend
    if backend == "auto":
        backend = "triton" if device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1" else "reference"
    dtype = {"auto": torch.bfloat16 if device.type == "cuda" else torch.float32, "bf16": torch.bfloat16,
             "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    torch.manual_seed(0)
    kind, stack = args.case.split("-")[0], args.case.endswith("-stack")
    dense = DenseArch(w, feature_layout(w), backend)
    cls = {"interformer": InterFormerLayer, "kunlun": KunlunLayer}[kind]
    layers = [holder[i] for _, holder, i in dense.iter_layers() if isinstance(holder[i], cls)]
    if not stack:
        layers = layers[:1]
    layers = [m.to(device=device, dtype=dtype) for m in layers]
    if device.type == "cuda" and dtype != torch.float32:
        # the FiLM backward's sums as the trainer runs them on CUDA (one-hot GEMMs), checked as it checks them
        from coplan.trainer.model.layers import enable_segment_sum_gemm, segment_sum_gemm_works

        enable_segment_sum_gemm(segment_sum_gemm_works(device, dtype))
    eager = [copy.deepcopy(m) for m in layers]  # eager twins with the same weights, for the comparison
    for m in layers:
        if args.dynamic_all:  # the trainer's regions before 2026-11-29 18:00 UTC, for the before/after
            m.forward = torch.compile(m.forward, dynamic=True)
        else:
            compile_layer(m)
    batch = args.batch or w.batch.global_(1)  # one rank's batch, as in the single-GPU trainer
    rng = np.random.default_rng(args.seed)
    tok = token_layout(w)
    inter = next(b for b in w.blocks if isinstance(b, InterFormerBlock))
    kun = next(b for b in w.blocks if isinstance(b, KunlunBlock))

    def inputs(step: int):
        g = torch.Generator().manual_seed(1000 + step)
        if kind == "interformer":
            ln = _lengths(w, inter.sequence, batch, args.max_tokens, rng)
            offsets = torch.tensor([0, *np.cumsum(ln)], dtype=torch.int64, device=device)
            t = int(sum(ln))
            h = torch.randn(t, inter.model_dim, generator=g).to(device, dtype)
            summary = torch.randn(batch, inter.num_summary_tokens, inter.model_dim, generator=g).to(device, dtype)
            ctx = torch.randn(batch, tok.width, generator=g).to(device, dtype)
            # FiLM starts at zero in the model: random weights here make its path carry gradient
            return (h, offsets, summary, ctx), {"tokens": t, "max_len": max(ln), "lengths_head": ln[:8]}
        z = torch.randn(batch, tok.total, kun.model_dim, generator=g).to(device, dtype)
        return (z,), {"tokens": batch * tok.total}

    for m in layers + eager:
        if hasattr(m, "film"):
            torch.nn.init.normal_(m.film.weight, std=0.02)
    for e, m in zip(eager, layers):
        e.load_state_dict(m.state_dict())

    def run(mods, xs):
        xs = [x.detach().requires_grad_(x.is_floating_point()) for x in xs]
        t0 = time.perf_counter()
        if kind == "interformer":
            h, off, summary, ctx = xs
            for m in mods:
                h, summary = m(h, off, summary, ctx)
            loss = h.float().square().mean() + summary.float().square().mean()
            outs = [h, summary]
        else:
            z = xs[0]
            for m in mods:
                z = m(z)
            loss = z.float().square().mean()
            outs = [z]
        if device.type == "cuda":
            torch.cuda.synchronize()
        t1 = time.perf_counter()
        loss.backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        t2 = time.perf_counter()
        grads = [x.grad for x in xs if x.grad is not None] + [p.grad for m in mods for p in m.parameters()]
        return outs, grads, t1 - t0, t2 - t1

    from torch._dynamo.utils import counters

    steps = []
    last = None
    t_start = time.monotonic()
    for step in range(args.steps):
        if time.monotonic() - t_start > args.budget:
            _log(f"{args.case}: budget spent after {step} steps")
            break
        xs, info = inputs(step)
        graphs_before = counters["stats"]["unique_graphs"]
        n_rec = len(records)
        for m in layers:
            m.zero_grad(set_to_none=True)
        _log(f"{args.case}: step {step} start ({info['tokens']} tokens)")
        outs, grads, fwd_s, bwd_s = run(layers, xs)
        steps.append({"step": step, **info, "fwd_s": fwd_s, "bwd_s": bwd_s,
                      "new_graphs": counters["stats"]["unique_graphs"] - graphs_before,
                      "new_log_records": len(records) - n_rec})
        _log(f"{args.case}: step {step} fwd {fwd_s:.2f} s bwd {bwd_s:.2f} s, new graphs {steps[-1]['new_graphs']}")
        last = (xs, outs, grads)
    out: dict = {"case": args.case, "layers": len(layers), "compile": "dynamic=True" if args.dynamic_all else "compile_layer", "attention_backend": backend, "dtype": str(dtype),
                 "batch": batch, "steps": steps,
                 "segment_sum_gemm": segment_sum_gemm_enabled()}
    if steps:
        rest_f = sorted(s["fwd_s"] for s in steps[1:]) or [0.0]
        rest_b = sorted(s["bwd_s"] for s in steps[1:]) or [0.0]
        out["compile_fwd_s"] = steps[0]["fwd_s"] - rest_f[len(rest_f) // 2]
        out["compile_bwd_s"] = steps[0]["bwd_s"] - rest_b[len(rest_b) // 2]
        out["steady_fwd_s"] = rest_f[len(rest_f) // 2]
        out["steady_bwd_s"] = rest_b[len(rest_b) // 2]
        out["graphs_after_first_step"] = sum(s["new_graphs"] for s in steps[1:])
    out["unique_graphs"] = counters["stats"]["unique_graphs"]
    out["counters"] = {k: dict(v) for k, v in counters.items() if k in ("stats", "frames", "graph_break", "recompiles",
                                                                         "inductor", "aot_autograd")}
    out["graph_breaks"] = dict(counters["graph_break"])
    out["log_records"] = records[:50]
    out["recompile_records"] = [r for r in records if "ecompil" in r][:20]
    try:
        from torch._dynamo.utils import compile_times

        out["dynamo_compile_times"] = compile_times(repr="str", aggregate=True)
    except Exception as e:
        out["dynamo_compile_times"] = f"unavailable: {e}"
    if last is not None:  # the compiled layers against their eager twins on the last step's inputs
        xs, outs, grads = last
        for m in eager:
            m.zero_grad(set_to_none=True)
        e_outs, e_grads, _, _ = run(eager, xs)

        def diff(a, b):
            return max((float((x.float() - y.float()).abs().max()) / max(1e-12, float(y.float().abs().max()))
                        for x, y in zip(a, b) if x.numel()), default=0.0)

        out["max_rel_diff_outputs"] = diff(outs, e_outs)
        out["max_rel_diff_grads"] = diff(grads, e_grads)
    return out


# ---------------------------------------------------------------------------------------------
# parent: cases under a time budget
# ---------------------------------------------------------------------------------------------


_TS = re.compile(r"^\[?(?:rank\d+\]:)?[IVWE](\d{4}) (\d\d):(\d\d):(\d\d\.\d+) .*?\[(\d+/\d+)(?:_\d+)?\] (.*)$")


def compile_stage_times(log: str) -> dict:
    """Seconds per compile stage from Dynamo's and Inductor's INFO lines (their timestamps): per frame
    (``[frame/recompile]``), from Dynamo's first start of tracing to its compiler call's end, and
    each Inductor graph's forward and backward compilation. AOTAutograd compiles the backward graph
    during the first forward call, so the first step's forward time holds both."""
    frames: dict[str, dict] = {}
    graphs: list[dict] = []
    open_graph: dict[tuple[str, str], float] = {}
    for ln in log.splitlines():
        m = _TS.match(ln)
        if not m:
            continue
        t = int(m.group(2)) * 3600 + int(m.group(3)) * 60 + float(m.group(4))
        fid, msg = m.group(5), m.group(6)
        f = frames.setdefault(fid, {})
        if "torchdynamo start tracing" in msg:
            f.setdefault("start", t)
            f["code"] = msg.rsplit("tracing ", 1)[-1][:120]
        elif "done compiler function" in msg:
            f["end"] = t
        elif (g := re.search(r"torchinductor (done )?compiling (FORWARDS|BACKWARDS) graph (\d+)", msg)):
            key = (g.group(2), g.group(3))
            if g.group(1):
                if key in open_graph:
                    graphs.append({"frame": fid, "graph": int(key[1]), "pass": key[0].lower(),
                                   "s": round(t - open_graph.pop(key), 3)})
            else:
                open_graph[key] = t
    per_frame = {k: {"code": v.get("code"), "s": round(v["end"] - v["start"], 3)} for k, v in frames.items()
                 if "start" in v and "end" in v}
    return {"frames": per_frame, "inductor_graphs": graphs, "total_s": round(sum(v["s"] for v in per_frame.values()), 3),
            "unfinished_frames": sorted(k for k, v in frames.items() if "start" in v and "end" not in v)}


def _run_case(case: str, args, limit: float, log_path: Path) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", case, "--workload", args.workload,
           "--device", args.device, "--steps", str(args.steps), "--max-tokens", str(args.max_tokens),
           "--batch", str(args.batch), "--dtype", args.dtype, "--backend", args.backend, "--seed", str(args.seed),
           "--budget", str(max(1.0, limit - 15)), "--out", str(log_path.with_suffix(".json"))]
    if args.dynamic_all:
        cmd.append("--dynamic-all")
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
    logs = "recompiles,graph_breaks" + (",dynamo,inductor" if args.progress_logs else "")
    env["TORCH_LOGS"] = env.get("TORCH_LOGS") or logs
    if not args.warm_cache:
        import tempfile

        env["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix=f"inductor-{case}-")
    t0 = time.monotonic()
    with open(log_path, "w") as f:  # streamed to a file: a killed case keeps its log up to the kill
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            rc = proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            import signal

            os.killpg(proc.pid, signal.SIGKILL)  # the child leads its own group (Inductor's workers too)
            proc.wait()
            rc = None
    wall = time.monotonic() - t0
    log = log_path.read_text(errors="replace")
    stages = [ln[:300] for ln in log.splitlines() if _STAGE.search(ln)]
    res: dict = {}
    if rc == 0 and log_path.with_suffix(".json").is_file():
        res = json.loads(log_path.with_suffix(".json").read_text())
        res["ok"] = True
        log_path.with_suffix(".json").unlink()  # merged into --out (the device returns few files)
    else:
        res = {"ok": False, "error": f"timed out after {limit:.0f} s" if rc is None else f"exit code {rc}"}
    try:
        res["compile_stage_s"] = compile_stage_times(log)
    except Exception as e:  # the figures stand without it
        res["compile_stage_s"] = {"error": f"{type(e).__name__}: {e}"}
    res.update({"wall_s": wall, "log_stages": stages[-60:], "log_tail": log[-4000:], "command": cmd,
                "torch_logs": env["TORCH_LOGS"]})
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", default="gem-tiny")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, from {list(CASES)}")
    p.add_argument("--steps", type=int, default=5, help="forward + backward steps per case, lengths redrawn each step")
    p.add_argument("--max-tokens", type=int, default=0, help="cap on a step's history tokens (0: none; CPU runs need one)")
    p.add_argument("--batch", type=int, default=0, help="samples per step (0: the workload's local batch)")
    p.add_argument("--dtype", choices=["auto", "bf16", "fp16", "fp32"], default="auto",
                   help="auto: bf16 on CUDA (what FSDP2's mixed precision computes in), fp32 on CPU")
    p.add_argument("--backend", choices=["auto", "triton", "reference"], default="auto",
                   help="attention: auto = triton on CUDA or under TRITON_INTERPRET=1, else the reference")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dynamic-all", action="store_true",
                   help="compile with dynamic=True (every dimension and float symbolic), as the trainer did before; "
                        "default: the trainer's compile_layer (static but for the token dimension)")
    p.add_argument("--warm-cache", action="store_true",
                   help="share Inductor's on-disk cache between cases (default: each case compiles cold, in a cache "
                        "dir of its own, so that its compile time is its own)")
    p.add_argument("--progress-logs", action=argparse.BooleanOptionalAction, default=True,
                   help="add Dynamo's and Inductor's INFO lines (compile stages, timestamped) to TORCH_LOGS")
    p.add_argument("--timeout", type=int, default=420, help="seconds for all cases together")
    p.add_argument("--case-timeout", type=int, default=300, help="seconds for one case at most")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/compile_probe.json"))
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--budget", type=float, default=1e9, help=argparse.SUPPRESS)
    p.add_argument("--reparse", action="store_true",
                   help="recompute each case's compile_stage_s in --out from its kept log (<out stem>_logs/), then stop")
    args = p.parse_args(argv)

    if args.reparse:
        res = json.loads(args.out.read_text())
        for case, r in res["cases"].items():
            log = args.out.parent / f"{args.out.stem}_logs" / f"{case}.log"
            if log.is_file():
                r["compile_stage_s"] = compile_stage_times(log.read_text(errors="replace"))
        args.out.write_text(json.dumps(res, indent=1, default=str) + "\n")
        return 0

    if args.worker:
        args.case = args.worker
        try:
            res = _child(args)
        except Exception as e:
            import traceback

            traceback.print_exc()
            res = {"error": f"{type(e).__name__}: {e}"}
            args.out.write_text(json.dumps(res, indent=1, default=str) + "\n")
            return 1
        args.out.write_text(json.dumps(res, indent=1, default=str) + "\n")
        return 0

    cases = [c for c in args.cases.split(",") if c]
    bad = [c for c in cases if c not in CASES]
    if bad:
        p.error(f"unknown case(s) {bad}; choose from {list(CASES)}")
    out: dict = {
        "benchmark": "compile probe (issue 6, --compile layers)",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": "python benchmarks/compile_probe.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "git_commit": git_commit(), "workload": args.workload, "device_kind": args.device,
        "host": {"python": platform.python_version(), "machine": platform.machine(), "cpus": os.cpu_count()},
        "env": {k: os.environ.get(k) for k in ("TRITON_INTERPRET", "TORCHINDUCTOR_COMPILE_THREADS", "OMP_NUM_THREADS")},
        "cases": {},
    }
    try:
        import torch

        out["versions"] = {"torch": torch.__version__, "cuda": torch.version.cuda,
                           "device": torch.cuda.get_device_name(0) if args.device == "cuda" and torch.cuda.is_available() else "cpu"}
        import triton

        out["versions"]["triton"] = triton.__version__
    except Exception as e:
        out.setdefault("versions", {})["error"] = str(e)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    logs_dir = args.out.parent / f"{args.out.stem}_logs"
    logs_dir.mkdir(exist_ok=True)
    t0 = time.monotonic()
    for case in cases:
        left = args.timeout - (time.monotonic() - t0)
        if left < MIN_CASE_S:
            out["cases"][case] = {"ok": False, "skipped": f"{left:.0f} s left of --timeout {args.timeout}"}
            _log(f"{case}: skipped")
            continue
        limit = min(left, args.case_timeout)
        _log(f"{case}: start ({limit:.0f} s allowed)")
        try:
            out["cases"][case] = r = _run_case(case, args, limit, logs_dir / f"{case}.log")
        except Exception as e:  # one failing case must not lose the others
            out["cases"][case] = r = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        _log(f"{case}: " + json.dumps({k: r.get(k) for k in ("ok", "error", "wall_s", "compile_fwd_s", "compile_bwd_s",
                                                             "unique_graphs", "graphs_after_first_step", "graph_breaks",
                                                             "max_rel_diff_outputs", "max_rel_diff_grads")}, default=str))
        args.out.write_text(json.dumps(out, indent=1, default=str) + "\n")
    args.out.write_text(json.dumps(out, indent=1, default=str) + "\n")
    _log(f"wrote {args.out}")
    return 0 if all(r.get("ok") for r in out["cases"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
