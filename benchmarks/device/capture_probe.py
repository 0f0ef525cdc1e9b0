"""Which call breaks CUDA-graph capture of an attention op's forward + backward (GPU diagnostic).

Each case runs in its own process (a failed capture must not disturb the next) and captures the
forward and backward together, on a side stream, as `torch.cuda.graph` does, after warm-up calls
on another side stream. Cases, for softmax and GDPA-SiLU:

- ``side``: only side-stream calls before the capture, fixed configs (what the first test in
  tests/kernels/test_cuda_graph.py does; passed on the H200 for both ops);
- ``tuned``: autotuning on, the bucket tuned by eager calls on the default stream first, their
  outputs dropped (the benchmark's history, shape (b) in miniature);
- ``tuned_kept``: as ``tuned``, but one default-stream output is kept alive through the capture,
  as `benchmarks/attention.py` did before this commit (its graph pins the leaves' AccumulateGrad
  nodes to the default stream: expected to fail for both ops, a PyTorch rule, not the kernels').

Every launch of ours (kernel, config, stream, whether capturing) is logged; on failure the last
ones are printed with the stage (warm-up, capture, replay, compare) and any warning raised during
the capture. Prefix ``CUDA_LAUNCH_BLOCKING=1`` to make errors surface at the failing launch.

Usage on the device: ``PYTHONPATH=/tmp/pkg:/tmp/site python3 capture_probe.py [--out probe.json]``
(about 1 minute with a warm Triton cache; ``--cases softmax:tuned`` runs one). ``--smoke`` checks
the script on a CPU (no capture: the warm-up and the launch log only).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import subprocess
import sys
import time
import traceback
import warnings

T0 = time.perf_counter()
SCENARIOS = ("side", "tuned", "tuned_kept")
OPS = ("softmax", "gdpa")


def log(msg: str) -> None:
    print(f"[{datetime.datetime.now(datetime.timezone.utc):%H:%M:%S} +{time.perf_counter() - T0:6.1f}s] {msg}", flush=True)


def _lengths(n=48, mean=64, cap=256):
    from statistics import NormalDist

    mu = math.log(mean) - 0.5
    return [int(min(max(round(math.exp(mu + NormalDist().inv_cdf((i + 0.5) / n))), 1), cap)) for i in range(n)]


def one(op_name: str, scenario: str, smoke: bool) -> dict:
    """Run one case in this process; returns what happened (never raises)."""
    os.environ["COPLAN_KERNELS_AUTOTUNE"] = "0" if scenario == "side" else "1"
    if smoke:
        os.environ["TRITON_INTERPRET"] = "1"
    import torch

    from coplan.kernels import gdpa, jagged_attention
    from coplan.kernels import triton_attention as ta

    device = "cpu" if smoke else "cuda"
    capturing = (lambda: torch.cuda.is_current_stream_capturing()) if not smoke else (lambda: False)
    stream_of = (lambda: torch.cuda.current_stream().cuda_stream) if not smoke else (lambda: 0)
    launches: list[str] = []
    stage = ["setup"]

    # Log every launch of ours: the direct/JIT launcher, the block-count kernel and the autotuner.
    run, counts = ta._run, ta.block_counts

    def logged_run(kind, plain, grid0, args, consts, cfg, *rest):
        launches.append(f"{stage[0]}: {kind} cfg={cfg} grid={grid0} stream={stream_of()} capturing={capturing()}")
        return run(kind, plain, grid0, args, consts, cfg, *rest)

    def logged_counts(q_offsets, k_offsets):
        launches.append(f"{stage[0]}: block_counts stream={stream_of()} capturing={capturing()}")
        return counts(q_offsets, k_offsets)

    ta._run, ta.block_counts = logged_run, logged_counts
    import coplan.kernels.ops as ops_module

    ops_module.block_counts = logged_counts
    for kind, tuned in (("fwd", ta._fwd_tuned), ("dq", ta._dq_tuned), ("dkdv", ta._dkdv_tuned)):
        def tuned_run(*a, _run=tuned.run, _kind=kind, **kw):
            launches.append(f"{stage[0]}: AUTOTUNER {_kind} stream={stream_of()} capturing={capturing()}")
            return _run(*a, **kw)

        tuned.run = tuned_run

    res = dict(op=op_name, scenario=scenario, ok=False)
    caught: list[str] = []
    try:
        h, d, dtype = 4, 64, (torch.float32 if smoke else torch.bfloat16)
        lengths = [5, 1, 19, 0, 12] if smoke else _lengths()
        cap = 32 if smoke else 256
        g = torch.Generator().manual_seed(0)
        n = sum(lengths)
        off = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
        q, k, v = (torch.randn(n, h, d, generator=g).to(device, dtype).requires_grad_(True) for _ in range(3))
        do = torch.randn(n, h, d, generator=g).to(device, dtype)
        if op_name == "softmax":
            def op(): return jagged_attention(q, k, v, off, causal=True, max_len=cap, validate=False, backend="triton")
        else:
            def op(): return gdpa(q, k, v, off, activation="silu", causal=True, max_len=cap, validate=False,
                                  backend="triton")
        kept = None
        if scenario != "side":
            stage[0] = "eager (default stream)"
            for _ in range(3):
                with torch.no_grad():
                    op()
                out = op()
                out.backward(do)
            if scenario == "tuned_kept":
                kept = out  # noqa: F841  (held on purpose through the capture)
            del out
        res["chosen_configs"] = {f"{key[0]} mode={key[4]}": cfg for key, cfg in ta._CHOSEN.items()}
        out_buf = torch.empty_like(q)

        def step():
            out = op()
            out.backward(do)
            out_buf.copy_(out.detach())

        if smoke:
            stage[0] = "warm-up (cpu)"
            step()
            res.update(ok=True, note="smoke: no capture on CPU")
            return res
        stage[0] = "warm-up (side stream)"
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                for x in (q, k, v):
                    x.grad = None
                step()
        torch.cuda.current_stream().wait_stream(side)
        for x in (q, k, v):
            x.grad = torch.zeros_like(x)
        torch.cuda.synchronize()
        stage[0] = "capture"
        graph = torch.cuda.CUDAGraph()
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            try:
                with torch.cuda.graph(graph):
                    step()
            finally:
                caught += [str(x.message)[:300] for x in w]
        stage[0] = "replay"
        graph.replay()
        torch.cuda.synchronize()
        stage[0] = "compare"
        got = out_buf.clone()
        with torch.no_grad():
            want = op()
        err = float((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-12))
        res.update(ok=err < 1e-2, replay_rel_err=err)
    except Exception as e:  # noqa: BLE001  (reported: the point of the probe)
        res.update(error=f"{type(e).__name__}: {str(e)[:400]}", traceback=traceback.format_exc()[-2500:])
    finally:
        res.update(stage=stage[0], warnings_during_capture=caught, last_launches=launches[-8:],
                   launches=len(launches))
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cases", default=",".join(f"{o}:{s}" for s in SCENARIOS for o in OPS),
                   help="comma-separated op:scenario (ops: softmax, gdpa; scenarios: " + ", ".join(SCENARIOS) + ")")
    p.add_argument("--one", help=argparse.SUPPRESS)
    p.add_argument("--smoke", action="store_true", help="CPU: Triton interpreter, no capture (checks the script)")
    p.add_argument("--timeout", type=float, default=240.0, help="seconds for all cases")
    p.add_argument("--out", default="capture_probe.json")
    args = p.parse_args(argv)
    if args.one:
        op_name, scenario = args.one.split(":")
        print("RESULT " + json.dumps(one(op_name, scenario, args.smoke)), flush=True)
        return 0

    import torch

    deadline = time.monotonic() + args.timeout
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
    result = dict(probe="attention CUDA-graph capture", date=datetime.datetime.now(datetime.timezone.utc).isoformat(
        timespec="seconds"), torch=torch.__version__, cuda=torch.version.cuda,
        device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        launch_blocking=os.environ.get("CUDA_LAUNCH_BLOCKING", "0"), command=" ".join(sys.argv), cases=[])
    try:
        import triton

        result["triton"] = triton.__version__
    except ImportError:
        pass
    log(f"{result['device']}, torch {result['torch']}, triton {result.get('triton')}")
    for case in args.cases.split(","):
        left = deadline - time.monotonic()
        if left < 5:
            result["cases"].append(dict(case=case, error="skipped: --timeout spent"))
            continue
        cmd = [sys.executable, os.path.abspath(__file__), "--one", case] + (["--smoke"] if args.smoke else [])
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=left, env=env)
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            res = json.loads(lines[-1][7:]) if lines else dict(case=case, error=f"no result (rc {proc.returncode})",
                                                                stderr=proc.stderr[-2000:])
        except subprocess.TimeoutExpired:
            res = dict(case=case, error=f"timed out after {left:.0f} s")
        result["cases"].append(res)
        verdict = "ok" if res.get("ok") else f"FAILED at {res.get('stage')}: {res.get('error', '')[:160]}"
        log(f"{case:20s} {verdict}")
        if not res.get("ok"):
            for line in res.get("last_launches", []):
                log(f"    last launches: {line}")
            for wmsg in res.get("warnings_during_capture", [])[:3]:
                log(f"    warning during capture: {wmsg[:200]}")
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
