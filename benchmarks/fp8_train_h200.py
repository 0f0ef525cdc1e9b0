"""FP8 end to end (issue 10): ``gem-h200`` trained in bf16 and with the planner's per-layer fp8 choice,
side by side on two H200s of one host, from the same seed on the same data.

1. The planner's choice: ``coplan plan --gpus 1`` of the workload with ``precision.fp8: auto``
   (``--fp8-mode``), every table pinned table-wise as in ``benchmarks/train_h200.py`` (each table
   whole on the GPU, FBGEMM fused TBE; Triton attention): its per-layer bf16 or fp8 choice
   (:func:`coplan.planner.precision.choose_layer_precision`), with the cost model's predicted step
   times (recorded). The bf16 arm's plan is the same command with ``precision.fp8: off`` (the JSON
   says if the two plans differ in anything but precision).
2. Two real trainer runs (``python -m torch.distributed.run -m coplan.trainer.train``, one process
   each), at once, one per GPU (``CUDA_VISIBLE_DEVICES``): ``bf16`` (every layer bf16) and ``fp8``
   (the planner's layers in fp8). Same workload (but for ``precision.fp8``), seed and dataset, so the
   weights, the batches and their order are identical; only the GEMM precision differs.
3. From each run's ``metrics.jsonl``: step time (mean and p50 over the steps after ``--warmup`` and
   before the profiled ones) and local MFU (model FLOPs over the bf16 dense peak, for both arms, so
   the two are comparable); the loss curve of every step. Final loss: the mean of the last
   ``--loss-window`` steps' losses (the same batches in both arms); the check is
   ``|fp8 − bf16| / bf16 ≤ 0.5%``. From the profiled steps' Kineto trace: device time per step by
   kernel family (bf16 GEMMs, fp8 GEMMs, fp8 quantisation, attention, ...).

Budget: gem-h200 runs ~120 ms/step on one H200 after ~55 s of start-up (TorchRec, Triton
compiles); 520 steps at the workload's 64 samples/step take ~2 min of steps, both arms in
parallel, so the whole run is ~4 min; ``--timeout`` (default 470 s) bounds it, and a run that
overruns is killed and reported, never hangs the script.

    python benchmarks/fp8_train_h200.py --plan-only --plans benchmarks/results/plans   # anywhere, first (no OR-Tools on the device)
    python benchmarks/fp8_train_h200.py --plans benchmarks/results/plans  # on 2 H200s
    python benchmarks/fp8_train_h200.py --device cpu --workload gem-tiny --fp8-mode force \\
        --steps 12 --warmup 2 --trace-steps 0 --loss-window 4 --data-batches 4 --control-seed 1   # CPU smoke test

``--control-seed S`` adds a third arm, bf16 with its weights from seed S on the same batches: the
loss gap two bf16 runs show (at the end and per window along the curve) is reported beside the
fp8-vs-bf16 gap, whose criterion stays the issue's 0.5%. With two GPUs it runs at the same time
as the others on the fp8 arm's GPU (``--control-gpu``), so the contention can only slow fp8.
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
from _common import git_commit, plan_command, plan_facts, planned, table_pins  # noqa: E402  (the scripts run by path)

from coplan.spec import RunDir  # noqa: E402

NO_MULTICAST_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
LOSS_TOLERANCE = 0.005
"""Issue 10's bound: final loss within 0.5% (relative) of bf16."""
CONTROL_ARM = "bf16_control"
"""The noise-floor arm (``--control-seed``): bf16, same data, weights from another seed."""

KERNEL_FAMILIES = (  # first match wins
    # Every quantisation kernel of kernels/fp8_triton.py: the 17:12 H200 run matched only two of
    # them, and the split row-wise path's partial-amax / scale / apply kernels (~7 ms per step)
    # fell into "other", outside the dense-GEMM total that the 1.23x was computed on.
    ("fp8 quantisation (Triton)", r"_quant_\w*kernel|_amax_rows_partial_kernel|_rows_scale_kernel"),
    ("fp8 GEMM (block-scaled Triton)", r"_block_scaled_mm_kernel"),
    # torchao's recipes under --compile layers: Inductor fuses each tensor's abs-amax (the scale) into a
    # neighbouring kernel (a layer norm's, an activation's): the kernels whose fused ops include abs and
    # amax hold fp8 scaling and possibly other work, counted here whole (an upper bound); the kernels that
    # apply the scale and cast to e4m3 carry no such name and fall into "other" (the step time decides).
    ("fp8 scaling fused (Inductor)", r"^triton_\w*fused\w*abs\w*amax|^triton_\w*fused\w*amax\w*abs"),
    # cuBLAS's fp8 kernels on Hopper are nvjet_sm90_qq* (both operands "q"uarter precision), not
    # named after e4m3: the 17:12 run counted them as bf16 GEMMs (the total was right, the split not).
    ("fp8 GEMM (cuBLAS scaled_mm)", r"e4m3|e5m2|f8f8|fp8|_f8_|Float8|nvjet_sm\d+_qq"),
    ("bf16 GEMM (cuBLAS)", r"nvjet|gemm|cutlass|xmma"),
    ("jagged attention (Triton)", r"^_fwd_kernel|^_bwd_dq_kernel|^_bwd_dkdv_kernel|_block_counts_kernel"),
    ("embedding (FBGEMM TBE)", r"split_embedding|embedding|linearize_index|bounds_check|radix_sort|fbgemm"),
    ("optimizer (AdamW foreach)", r"multi_tensor_apply"),
    ("collective / copy", r"nccl|Memcpy|memcpy|CatArrayBatchedCopy|chunk_cat|copy_kernel"),
)


def stamp(msg: str) -> None:
    print(f"[{datetime.now(timezone.utc).strftime('%H:%M:%S')}] {msg}", flush=True)




def versions() -> dict:
    out: dict = {"python": platform.python_version()}
    try:
        import torch

        out["torch"] = torch.__version__
        out["cuda"] = torch.version.cuda
        if torch.cuda.is_available():
            out["device_name"] = torch.cuda.get_device_name(0)
            out["gpus"] = torch.cuda.device_count()
    except Exception as e:  # recorded, not fatal
        out["torch_error"] = f"{type(e).__name__}: {e}"
    for mod in ("triton", "torchrec", "fbgemm_gpu"):
        try:
            out[mod] = __import__(mod).__version__
        except Exception:
            out[mod] = None
    return out


# ---------------------------------------------------------------------------------------------
# Plans
# ---------------------------------------------------------------------------------------------


def build_plans(args) -> tuple[dict, dict]:
    """(the two plans by arm, the planner's precision report as data).

    Both arms run ``coplan plan --gpus 1`` of the workload (attention ``--attention``) with every table
    pinned table-wise: the bf16 arm with ``precision.fp8: off``, the fp8 arm with ``--fp8-mode`` and
    ``--recipe``, whose plan carries the planner's per-layer choice. ``--fp8-layers`` replaces that
    choice (:func:`coplan.planner.given.with_layers`; no pin expresses a layer's precision)."""
    from coplan.planner.given import with_layers
    from coplan.planner.precision import precision_line
    from coplan.spec import load_topology, load_workload

    w = load_workload(args.workload)
    w = w.model_copy(update={"kernels": w.kernels.model_copy(update={"attention": args.attention})})
    topo = load_topology(args.topology)

    def with_fp8(mode: str):
        return w.model_copy(update={"precision": w.precision.model_copy(update={"fp8": mode, "fp8_recipe": args.recipe})})

    key = f"fp8train-{w.name}-{args.attention}"
    base = planned(f"{key}-bf16", with_fp8("off"), topo, 1, tables=table_pins(w), plans_dir=args.plans, log=stamp)
    fp8 = planned(f"{key}-{args.fp8_mode}-{args.recipe}", with_fp8(args.fp8_mode), topo, 1, tables=table_pins(w),
                  plans_dir=args.plans, log=stamp)
    report = fp8.precision_report
    fp8_layers = list(report.fp8_layers) if report else []
    override = [n.strip() for n in (args.fp8_layers or "").split(",") if n.strip()]
    if override:
        # Measure given layers in fp8 whatever the planner predicts (e.g. the first H200 run's
        # interformer.0-3, after a kernel change the cost model's figures do not know of yet); the
        # numerics guard still applies in the trainer.
        fp8 = with_layers(fp8, fp8=override).model_copy(update={"precision_report": report})
        fp8_layers = override
    rc = [tuple(lp.name for lp in p.layers if lp.recompute) for p in (base, fp8)]
    differ = [k for k, x, y in (("mesh", base.mesh, fp8.mesh), ("tables", base.tables, fp8.tables),
                                ("kernels", base.kernels, fp8.kernels), ("recompute", rc[0], rc[1])) if x != y]
    info = {"line": precision_line(report), **(report.model_dump(mode="json") if report else {}),
            "fp8_layers": fp8_layers, "planner_fp8_layers": list(report.fp8_layers) if report else [],
            "override": override, "predicted_gain": report.gain if report else 0.0,
            "plans": {"bf16": plan_command(w, 1, tables=table_pins(w)) + " (precision.fp8 off)",
                      "fp8": plan_command(w, 1, tables=table_pins(w)) + f" (precision.fp8 {args.fp8_mode}, {args.recipe})"
                             + (" + --fp8-layers" if override else ""),
                      "choices_that_differ_beyond_precision": differ}}
    return {"bf16": base, "fp8": fp8}, info


# ---------------------------------------------------------------------------------------------
# Runs
# ---------------------------------------------------------------------------------------------


def launch(plan_path: Path, arm: str, gpu: str | None, args, data: Path, seed: int | None = None,
           extra_env: dict | None = None, traced: bool = True) -> subprocess.Popen:
    trace = f"{args.steps - args.trace_steps}:{args.steps}" if args.trace_steps > 0 and traced else "none"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1", "-m", "coplan.trainer.train",
           str(plan_path), "--device", args.device, "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--runs-root", str(args.runs_root), "--run-id", arm, "--data", str(data), "--no-progress", "--seed", str(args.seed if seed is None else seed),
           "--trace", trace, "--checkpoint-every", "-1", "--log-every", str(args.log_every)]
    if args.compile != "off":  # every arm alike: the comparison is fp8 vs bf16 under the same compilation
        cmd += ["--compile", args.compile]
    env = dict(os.environ, **NO_MULTICAST_ENV, PYTHONUNBUFFERED="1", **(extra_env or {}))
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpu
    if args.device == "cpu":
        env.setdefault("OMP_NUM_THREADS", "1")
    log = open(args.runs_root / f"{arm}.log", "w")
    stamp(f"launch {arm}" + (f" on GPU {gpu}" if gpu is not None else "") + ": " + " ".join(cmd[3:]))
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)


def wait_all(procs: dict[str, subprocess.Popen], deadline: float, args) -> dict[str, dict]:
    """Wait for every arm, printing progress; past the deadline, kill what is left (its process group)."""
    status = {arm: {"returncode": None, "timed_out": False} for arm in procs}
    last = 0.0
    while True:
        alive = [a for a, p in procs.items() if p.poll() is None]
        if not alive:
            break
        now = time.monotonic()
        if now > deadline:
            for a in alive:
                try:
                    os.killpg(procs[a].pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                status[a]["timed_out"] = True
            stamp(f"time budget spent: killed {alive}")
            break
        if now - last > args.progress_every:
            last = now
            done = {a: _lines(RunDir(args.runs_root / a).metrics_path) for a in procs}
            stamp("steps logged: " + ", ".join(f"{a} {n}" for a, n in done.items()) + f"; {deadline - now:.0f} s of budget left")
        time.sleep(1.0)
    for a, p in procs.items():
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        status[a]["returncode"] = p.returncode
    return status


def _lines(path: Path) -> int:
    try:
        return sum(1 for ln in path.read_text().splitlines() if ln.strip())
    except OSError:
        return 0


def kernel_families(trace: Path) -> dict:
    """Device time per step by kernel family over the profiled steps."""
    import gzip

    opener = gzip.open if str(trace).endswith(".gz") else open
    with opener(trace, "rt") as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    steps = {e["name"] for e in events if e["name"].startswith("ProfilerStep#")}
    n = max(1, len(steps))
    fam: dict[str, float] = {}
    top: dict[str, float] = {}
    for e in events:
        if e.get("cat") != "kernel":
            continue
        name = e["name"]
        f = next((k for k, pat in KERNEL_FAMILIES if re.search(pat, name)), "other")
        fam[f] = fam.get(f, 0.0) + e["dur"] / n / 1e3
        top[name[:100]] = top.get(name[:100], 0.0) + e["dur"] / n / 1e3
    return {"profiled_steps": n, "by_family_ms_per_step": dict(sorted(fam.items(), key=lambda kv: -kv[1])),
            "kernel_busy_ms_per_step": sum(fam.values()),
            "top_kernels_ms_per_step": dict(sorted(top.items(), key=lambda kv: -kv[1])[:15])}


def analyse(arm: str, args, st: dict) -> dict:
    rd = RunDir(args.runs_root / arm)
    run_dir = rd.path
    out: dict = {"ok": st["returncode"] == 0 and not st["timed_out"], **st, "run_dir": str(run_dir)}
    lines = rd.metrics()
    if not out["ok"]:
        log = args.runs_root / f"{arm}.log"
        out["log_tail"] = log.read_text()[-5000:] if log.is_file() else ""
    if not lines:
        return out
    end = args.steps - args.trace_steps
    meas = [x for x in lines if args.warmup <= x["step"] < end]
    times = sorted(x["step_time_s"] for x in meas)
    out["steps_logged"] = len(lines)
    out["loss"] = [x["loss"] for x in lines]
    if times:
        out["step_time_ms"] = {"mean": sum(times) / len(times) * 1e3, "p50": times[len(times) // 2] * 1e3,
                               "p90": times[min(len(times) - 1, int(0.9 * len(times)))] * 1e3, "steps": len(times)}
        mfu = [x["mfu"] for x in meas if x.get("mfu") is not None]
        out["local_mfu_mean"] = sum(mfu) / len(mfu) if mfu else None
        out["samples_per_step"] = sum(x.get("samples", 0) for x in meas) / len(meas)
        out["tokens_per_step"] = sum(x.get("tokens", 0) for x in meas) / len(meas)
    sp = rd.summary_path
    if sp.is_file():
        s = json.loads(sp.read_text())
        out["summary"] = {k: s.get(k) for k in ("measured_mfu", "peak_memory_bytes", "device", "versions", "notes", "step_time")}
    trace = rd.rank_trace(0)
    if trace is not None:
        try:
            out["kernels"] = kernel_families(trace)
        except Exception as e:  # the figures stand without the breakdown
            out["kernels"] = {"error": f"{type(e).__name__}: {e}"}
    return out


def loss_gap(la: list[float], lb: list[float], window: int) -> dict:
    """Relative gap of run b's loss to run a's over their common steps: the mean of the last
    ``window`` steps (|b - a| / a, and signed), and the same per consecutive window along the curve."""
    n = min(len(la), len(lb))
    k = max(1, min(window, n))
    ma, mb = sum(la[n - k:n]) / k, sum(lb[n - k:n]) / k
    windows = [abs(sum(lb[i:i + k]) - sum(la[i:i + k])) / abs(sum(la[i:i + k])) if sum(la[i:i + k]) else None
               for i in range(0, n - k + 1, k)]
    return {"steps": n, "window": k, "a_final": ma, "b_final": mb,
            "relative_diff": abs(mb - ma) / abs(ma) if ma else float("inf"),
            "signed_relative_diff": (mb - ma) / abs(ma) if ma else float("inf"), "window_relative_diff": windows}


def compare(arms: dict, args) -> dict:
    b, f = arms.get("bf16", {}), arms.get("fp8", {})
    out: dict = {}
    if b.get("step_time_ms") and f.get("step_time_ms"):
        out["step_time_change"] = {k: f["step_time_ms"][k] / b["step_time_ms"][k] - 1.0 for k in ("mean", "p50")}
        out["speedup_mean"] = b["step_time_ms"]["mean"] / f["step_time_ms"]["mean"]
        out["local_mfu"] = {"bf16": b.get("local_mfu_mean"), "fp8": f.get("local_mfu_mean")}
    lb, lf = b.get("loss") or [], f.get("loss") or []
    n = min(len(lb), len(lf))
    if n:
        gap = loss_gap(lb, lf, args.loss_window)
        k = gap["window"]
        diffs = [abs(x - y) for x, y in zip(lb[:n], lf[:n])]
        out["loss"] = {"steps_compared": n, "window": k, "bf16_final": gap["a_final"], "fp8_final": gap["b_final"],
                       "relative_diff": gap["relative_diff"], "tolerance": LOSS_TOLERANCE,
                       "within_tolerance": gap["relative_diff"] <= LOSS_TOLERANCE,
                       "bf16_first": lb[0], "fp8_first": lf[0], "max_abs_step_diff": max(diffs),
                       "mean_abs_step_diff": sum(diffs) / n, "both_fall": gap["a_final"] < lb[0] and gap["b_final"] < lf[0],
                       "steps_at_least_500": n >= 500,
                       # the whole curve, not only its end: relative gap of the two arms' mean loss
                       # per window of `window` steps (a gap that opens up at the end alone is noise
                       # or memorisation; one from the start is the numerics)
                       "window_relative_diff": gap["window_relative_diff"],
                       "data_epochs": n / max(1, args.data_batches)}
    c = arms.get(CONTROL_ARM, {})
    lc = c.get("loss") or []
    if lb and lc:
        # The noise floor: two bf16 runs on the same batches, the weights initialised from another
        # seed. The issue's criterion stays the 0.5% bound above; this says how much of the fp8 gap
        # two bf16 runs show too, at the end and along the curve (same windows as the fp8 gap).
        ctrl = loss_gap(lb, lc, args.loss_window)
        out["control"] = {"seed": args.control_seed if args.control_perturb == "seed" else args.seed,
                          "perturbation": args.control_perturb, "bf16_final": ctrl["a_final"], "control_final": ctrl["b_final"],
                          "relative_diff": ctrl["relative_diff"], "signed_relative_diff": ctrl["signed_relative_diff"],
                          "window_relative_diff": ctrl["window_relative_diff"], "steps_compared": ctrl["steps"],
                          "shares_gpu_with": c.get("shares_gpu_with")}
        if "loss" in out:
            fp8_gap = loss_gap(lb, lf, args.loss_window)
            out["loss"]["signed_relative_diff"] = fp8_gap["signed_relative_diff"]
            floor = ctrl["relative_diff"]
            out["loss"]["vs_noise_floor"] = {
                "fp8_gap": fp8_gap["relative_diff"], "bf16_vs_bf16_gap": floor,
                "ratio": fp8_gap["relative_diff"] / floor if floor else None,
                "windows_fp8_gap_above_floor": sum(1 for a, z in zip(fp8_gap["window_relative_diff"], ctrl["window_relative_diff"])
                                                   if a is not None and z is not None and a > z),
                "windows": min(len(fp8_gap["window_relative_diff"]), len(ctrl["window_relative_diff"]))}
    kb, kf = (b.get("kernels") or {}).get("by_family_ms_per_step"), (f.get("kernels") or {}).get("by_family_ms_per_step")
    if kb and kf:
        g = lambda d, keys: sum(d.get(x, 0.0) for x in keys)  # noqa: E731
        gemm_keys = ("bf16 GEMM (cuBLAS)", "fp8 GEMM (cuBLAS scaled_mm)", "fp8 GEMM (block-scaled Triton)", "fp8 quantisation (Triton)",
                     "fp8 scaling fused (Inductor)")
        out["dense_gemm_ms_per_step"] = {"bf16": g(kb, gemm_keys), "fp8_with_quantisation": g(kf, gemm_keys)}
        if g(kf, gemm_keys) > 0:
            out["dense_gemm_speedup"] = g(kb, gemm_keys) / g(kf, gemm_keys)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", default="gem-h200")
    p.add_argument("--topology", default="h200-1gpu")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--gpus", default=os.environ.get("GPUS", "0,1"),
                   help="GPU of the bf16 arm, GPU of the fp8 arm (the same twice runs them one after the other); default $GPUS or 0,1")
    env_seed = os.environ.get("FP8_CONTROL_SEED", "").strip()
    p.add_argument("--control-seed", type=int, default=int(env_seed) if env_seed else None,
                   help="also train a third arm, bf16 with its weights from this seed on the same data: the bf16-vs-bf16 "
                        "noise floor of the loss (default $FP8_CONTROL_SEED, else none)")
    p.add_argument("--control-perturb", choices=["seed", "tf32-off"], default=None,
                   help="what differs in the control arm: 'seed' (weights from --control-seed) or 'tf32-off' (the same "
                        "weights, NVIDIA_TF32_OVERRIDE=0: fp32 matmuls without TF32, a small deterministic perturbation "
                        "of the numerics like fp8's; zero if the model has no TF32 matmul)")
    p.add_argument("--control-gpu", default=None,
                   help="GPU of the control arm, run at the same time as the others (default: the fp8 arm's GPU, so that sharing a GPU "
                        "can only make fp8's step time look worse, never better; the control's own timing is not used)")
    p.add_argument("--fp8-mode", choices=["auto", "force"], default="auto", help="precision.fp8 of the fp8 arm's plan")
    p.add_argument("--fp8-layers", default="",
                   help="comma-separated layers the fp8 arm runs in fp8 instead of the planner's choice (default: the planner's)")
    p.add_argument("--recipe", choices=["rowwise", "blockwise", "torchao-tensorwise", "torchao-rowwise"], default="rowwise",
                   help="fp8 recipe of the fp8 arm; the torchao ones need torchao==0.18.0 and are meant for --compile layers")
    p.add_argument("--compile", choices=["off", "layers", "layers-cpp"], default="off",
                   help="the trainer's --compile for every arm (layers: torch.compile each InterFormer and Kunlun layer; "
                        "layers-cpp: with Inductor's C++ wrapper)")
    p.add_argument("--attention", choices=["triton", "reference", "flex"], default="triton")
    p.add_argument("--steps", type=int, default=520)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--trace-steps", type=int, default=2, help="last steps profiled (kernel families); 0: none")
    p.add_argument("--loss-window", type=int, default=50, help="final loss = mean of the last N steps' losses")
    p.add_argument("--log-every", type=int, default=20)
    # Default: one distinct global batch per step (no epoch repeats). The first H200 run cycled 510
    # steps over 64 batches (~8 epochs): both arms memorised them, with loss spikes at different
    # steps, and the last-50-step means (bf16 0.177, fp8 0.070) measured which arm happened to be
    # between spikes, not FP8's numerics (over the first epoch, steps 0-63, the arms' mean losses agree to 0.05%).
    p.add_argument("--data-batches", type=int, default=0,
                   help="distinct global batches generated (steps cycle over them); 0: one per step (--steps)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--runs-root", type=Path, default=Path("runs/fp8"))
    p.add_argument("--timeout", type=float, default=470.0, help="wall-clock budget of the whole script, seconds")
    p.add_argument("--progress-every", type=float, default=20.0)
    p.add_argument("--plans", type=Path, default=None, metavar="DIR",
                   help="run the plans in DIR made beforehand (plan-fp8train-*.json); a missing one is planned here (OR-Tools) "
                        "and written there")
    p.add_argument("--plan-only", action="store_true", help="make (or check) both arms' plans, print them, and stop")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/fp8_train_h200.json"))
    args = p.parse_args(argv)
    if args.plan_only:
        plans, info = build_plans(args)
        stamp(info["line"] or "no fp8 report")
        for arm, plan in plans.items():
            stamp(f"{arm}: {info['plans'][arm]}: {json.dumps(plan_facts(plan))}")
        return 1 if info["plans"]["choices_that_differ_beyond_precision"] else 0
    if args.data_batches <= 0:
        args.data_batches = max(1, args.steps)
    t0 = time.monotonic()
    deadline = t0 + args.timeout - 15.0  # leave time to analyse and write
    errors: dict[str, str] = {}
    result: dict = {
        "benchmark": "FP8 end to end (issue 10)",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": "python benchmarks/fp8_train_h200.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "git_commit": git_commit(),
        "host": {"hostname": platform.node(), "machine": platform.machine(), "cpus": os.cpu_count()},
        "versions": versions(), "device": args.device, "workload": args.workload, "topology": args.topology,
        "fp8_mode": args.fp8_mode, "recipe": args.recipe, "compile": args.compile, "steps": args.steps, "warmup": args.warmup,
        "loss_window": args.loss_window, "seed": args.seed, "env": NO_MULTICAST_ENV,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.runs_root.mkdir(parents=True, exist_ok=True)

    def write() -> None:
        result["errors"] = errors
        result["wall_s"] = time.monotonic() - t0
        args.out.write_text(json.dumps(result, indent=1, default=str) + "\n")

    try:
        stamp(f"planning the per-layer precision of {args.workload} (fp8 {args.fp8_mode}, {args.recipe})")
        plans, info = build_plans(args)
        result["planner"] = info
        stamp(info["line"] or "no fp8 report")
        if info["plans"]["choices_that_differ_beyond_precision"]:
            errors["plans"] = f"the arms' plans differ in {info['plans']['choices_that_differ_beyond_precision']}, not only in precision"
        if not info["fp8_layers"]:
            errors["planner"] = "the planner put no layer in fp8: the fp8 arm runs the bf16 plan"
        from coplan.spec import dump_spec
        from coplan.trainer.data import data_sha256, generate_dataset

        w = plans["bf16"].workload
        data = args.runs_root / "data" / f"{w.name}-{data_sha256(w)[:8]}-{args.data_batches}"
        ts = time.monotonic()
        if not (data / "dataset.json").is_file():
            gb = w.batch.global_(1)
            generate_dataset(w, data, gb * args.data_batches, seed=args.seed, rows_per_file=gb * args.data_batches)
        result["data"] = {"path": str(data), "global_batches": args.data_batches, "generation_s": time.monotonic() - ts}
        stamp(f"data ready ({args.data_batches} global batches) in {result['data']['generation_s']:.1f} s")
        paths = {arm: dump_spec(plan, args.runs_root / f"plan-{arm}.json") for arm, plan in plans.items()}
    except Exception as e:
        errors["setup"] = f"{type(e).__name__}: {e}"
        stamp(f"setup failed: {errors['setup']}")
        write()
        return 1
    write()

    gpus = [g.strip() for g in args.gpus.split(",")] if args.device == "cuda" else [None, None]
    if len(gpus) == 1:
        gpus = gpus * 2
    names = ["bf16", "fp8"]
    seeds = {"bf16": None, "fp8": None}
    where = {"bf16": gpus[0], "fp8": gpus[1]}
    if args.control_perturb is None and args.control_seed is not None:
        args.control_perturb = "seed"
    if args.control_perturb == "seed" and args.control_seed is None:
        errors["control"] = "--control-perturb seed needs --control-seed: no control arm"
        args.control_perturb = None
    if args.control_perturb is not None:
        names.append(CONTROL_ARM)
        paths[CONTROL_ARM] = paths["bf16"]
        seeds[CONTROL_ARM] = args.control_seed if args.control_perturb == "seed" else None
        where[CONTROL_ARM] = (args.control_gpu if args.control_gpu is not None else gpus[1]) if args.device == "cuda" else None
        result["control_seed"] = args.control_seed
    envs = {a: ({"NVIDIA_TF32_OVERRIDE": "0"} if a == CONTROL_ARM and args.control_perturb == "tf32-off" else None) for a in names}
    result["control_perturb"] = args.control_perturb
    shares = {a: [b for b in names if b != a and where[b] is not None and where[b] == where[a]] for a in names}
    result["arm_gpus"] = where
    for arm in names:  # a stale run directory would be resumed or mixed in
        d = args.runs_root / arm
        if d.exists():
            import shutil

            shutil.rmtree(d)
    statuses: dict[str, dict] = {}
    if gpus[0] != gpus[1] or args.device == "cpu":
        # Every arm at once (the control arm shares a GPU; its step times are not compared).
        procs = {arm: launch(paths[arm], arm, where[arm], args, data, seeds[arm], envs[arm], arm != CONTROL_ARM) for arm in names}
        statuses = wait_all(procs, deadline, args)
    else:  # one GPU: one arm after the other, each with an equal share of the remaining budget
        for i, arm in enumerate(names):
            share = (deadline - time.monotonic()) / (len(names) - i)
            statuses |= wait_all({arm: launch(paths[arm], arm, gpus[0], args, data, seeds[arm], envs[arm], arm != CONTROL_ARM)},
                                 time.monotonic() + share, args)
        shares = {a: [] for a in names}
    arms = {}
    for arm in names:
        try:
            arms[arm] = analyse(arm, args, statuses[arm])
        except Exception as e:
            errors[f"analyse_{arm}"] = f"{type(e).__name__}: {e}"
            arms[arm] = {"ok": False, **statuses.get(arm, {})}
        a = arms[arm]
        a["gpu"], a["shares_gpu_with"] = where[arm], shares[arm]
        a["seed"] = args.seed if seeds[arm] is None else seeds[arm]
        stamp(f"{arm}: ok={a.get('ok')} steps={a.get('steps_logged')} step_ms={a.get('step_time_ms')} mfu={a.get('local_mfu_mean')}"
              + (f" (shared its GPU with {shares[arm]}: step times include that contention)" if shares[arm] else ""))
    result["arms"] = arms
    try:
        result["comparison"] = compare(arms, args)
        pl = result.get("planner") or {}
        if pl.get("bf16_step_time_s"):
            # the cost model's step (device work, no host overhead) against the measured end-to-end step
            result["comparison"]["predicted_step_time_change"] = pl["step_time_s"] / pl["bf16_step_time_s"] - 1.0
    except Exception as e:
        errors["compare"] = f"{type(e).__name__}: {e}"
    c = result.get("comparison", {})
    if "loss" in c:
        lc = c["loss"]
        stamp(f"final loss (mean of last {lc['window']}): bf16 {lc['bf16_final']:.5f}, fp8 {lc['fp8_final']:.5f}, "
              f"relative diff {lc['relative_diff']:.3%} (bound {LOSS_TOLERANCE:.1%}) -> {'OK' if lc['within_tolerance'] else 'OVER'}")
    if "control" in c:
        cc = c["control"]
        nf = c.get("loss", {}).get("vs_noise_floor", {})
        what = f"seed {args.control_seed}" if args.control_perturb == "seed" else "TF32 off"
        stamp(f"noise floor (bf16 vs bf16 with {what}, last {args.loss_window}): "
              f"{cc['relative_diff']:.3%}; fp8 gap {nf.get('fp8_gap', float('nan')):.3%}; fp8 gap above the floor in "
              f"{nf.get('windows_fp8_gap_above_floor')}/{nf.get('windows')} windows")
    if "step_time_change" in c:
        stamp(f"step time change (fp8 vs bf16): mean {c['step_time_change']['mean']:+.1%}, p50 {c['step_time_change']['p50']:+.1%}; "
              f"local MFU bf16 {c['local_mfu']['bf16']}, fp8 {c['local_mfu']['fp8']}")
    if "dense_gemm_speedup" in c:
        stamp(f"dense GEMM device time (quantisation included): {c['dense_gemm_ms_per_step']}, speed-up {c['dense_gemm_speedup']:.2f}x")
    write()
    stamp(f"wrote {args.out}")
    return 0 if all(a.get("ok") for a in arms.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
