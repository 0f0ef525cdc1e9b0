"""Collective sweep (issue 11): nccl-tests-style all-gather, reduce-scatter, all-reduce and all-to-all
through ``torch.distributed`` over message sizes, on the GPUs of one host (or on gloo/CPU as a smoke).

Sizes and bandwidths follow nccl-tests (doc/PERFORMANCE.md), the same convention as
``coplan.costmodel.comm``: ``S`` is the whole buffer (all-gather: the gathered output; reduce-scatter:
the input; all-reduce: the buffer; all-to-all: what one rank sends in all), ``algbw = S / t`` and
``busbw = algbw × 2(n−1)/n`` for all-reduce, ``× (n−1)/n`` for the others. ``t`` is the mean time of
one out-of-place call over the timed iterations (one CUDA event pair around the loop, as nccl-tests
does), and the figure reported is the slowest rank's. Each collective's result is checked once (at
the smallest size) against the value it must hold.

The script launches itself under ``python -m torch.distributed.run --standalone`` with NVLink
multicast off (NVLS needs a fabric manager setup the lent machines do not promise, and the cost model
prices the tier without in-switch reduction). Rank 0 rewrites a partial result after every case, so a
run cut by ``--timeout`` still leaves what it measured.

    python benchmarks/collectives_h200.py                                   # 2 H200s, ~1 minute
    python benchmarks/collectives_h200.py --device cpu --nproc 2 --max-bytes 1MiB   # gloo smoke test

Output: ``benchmarks/results/collectives_h200.json`` (or ``--out``), which
``coplan calibrate --collectives`` fits (``coplan.calibration.collective_fit``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import git_commit, wait_or_kill  # noqa: E402  (the scripts run by path)

KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")

NO_MULTICAST_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
"""Set in every process this script starts (see the module docstring)."""


def parse_bytes(text: str) -> int:
    """'8KiB', '1MiB', '1GiB', '4096' → bytes (binary units; 'K'/'M'/'G' mean the same)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b)?\s*", text.lower())
    if not m:
        raise argparse.ArgumentTypeError(f"not a byte size: {text!r} (examples: 8KiB, 1MiB, 1GiB, 4096)")
    scale = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}[m.group(2)]
    return int(float(m.group(1)) * scale)


def sizes(min_bytes: int, max_bytes: int, factor: int) -> list[int]:
    out, s = [], min_bytes
    while s <= max_bytes:
        out.append(s)
        s *= factor
    return out


def bus_factor(kind: str, n: int) -> float:
    """nccl-tests' algbw → busbw factor (kept local: the worker must not need coplan installed)."""
    if n <= 1:
        return 1.0
    return 2.0 * (n - 1) / n if kind == "all_reduce" else (n - 1) / n




def stamp(msg: str) -> None:
    print(f"[{datetime.now(timezone.utc).strftime('%H:%M:%S')}] {msg}", flush=True)


# ---------------------------------------------------------------------------------------------
# Worker (one per rank, under torch.distributed.run)
# ---------------------------------------------------------------------------------------------

def _iters(nbytes: int, args) -> tuple[int, int]:
    """(warm-up, timed) iterations: nccl-tests' 5/20 by default, fewer above 64 MiB where one call
    already takes milliseconds and the mean is stable."""
    if nbytes >= args.big_bytes:
        return max(1, args.warmup // 2), max(2, args.iters // 4)
    return args.warmup, args.iters


def _buffers(kind: str, nbytes: int, n: int, dtype, device):
    import torch

    esize = torch.tensor([], dtype=dtype).element_size()
    count = max(n, nbytes // esize // n * n)  # divisible by n so every rank's chunk is whole
    if kind == "all_gather":
        return torch.empty(count // n, dtype=dtype, device=device), torch.empty(count, dtype=dtype, device=device), count * esize
    if kind == "reduce_scatter":
        return torch.empty(count, dtype=dtype, device=device), torch.empty(count // n, dtype=dtype, device=device), count * esize
    if kind == "all_reduce":
        t = torch.empty(count, dtype=dtype, device=device)
        return t, t, count * esize
    return torch.empty(count, dtype=dtype, device=device), torch.empty(count, dtype=dtype, device=device), count * esize


def _call(kind: str, inp, out):
    import torch.distributed as dist

    if kind == "all_gather":
        dist.all_gather_into_tensor(out, inp)
    elif kind == "reduce_scatter":
        dist.reduce_scatter_tensor(out, inp)
    elif kind == "all_reduce":
        dist.all_reduce(inp)
    else:
        dist.all_to_all_single(out, inp)


def _check(kind: str, n: int, rank: int, dtype, device) -> str:
    """Run ``kind`` once on values whose result is known; '' when right, else what was wrong."""
    import torch

    count = 4 * n
    if kind == "all_gather":
        inp = torch.full((count // n,), float(rank + 1), dtype=dtype, device=device)
        out = torch.empty(count, dtype=dtype, device=device)
        want = torch.arange(1, n + 1, dtype=dtype, device=device).repeat_interleave(count // n)
    elif kind == "reduce_scatter":
        inp = torch.arange(count, dtype=dtype, device=device) + rank
        out = torch.empty(count // n, dtype=dtype, device=device)
        base = torch.arange(count, dtype=dtype, device=device) * n + sum(range(n))
        want = base[rank * (count // n):(rank + 1) * (count // n)]
    elif kind == "all_reduce":
        inp = torch.full((count,), float(rank + 1), dtype=dtype, device=device)
        out = inp
        want = torch.full((count,), float(n * (n + 1) // 2), dtype=dtype, device=device)
    else:  # rank r sends chunk j filled with r*n + j; receives chunk j = j*n + r
        inp = (torch.arange(n, dtype=dtype, device=device) + rank * n).repeat_interleave(count // n)
        out = torch.empty(count, dtype=dtype, device=device)
        want = (torch.arange(n, dtype=dtype, device=device) * n + rank).repeat_interleave(count // n)
    _call(kind, inp, out)
    got = out
    if not torch.equal(got.float().cpu(), want.float().cpu()):
        return f"{kind} result wrong on rank {rank}: got {got[:8].tolist()} want {want[:8].tolist()}"
    return ""


def worker(args) -> int:
    import torch
    import torch.distributed as dist

    rank, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    dtypes = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}
    res: dict = {"world_size": n, "backend": dist.get_backend(), "cases": [], "checks": {}, "stopped_early": False}
    if cuda:
        res["device_name"] = torch.cuda.get_device_name(device)
        try:
            res["nccl_version"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:
            res["nccl_version"] = "unknown"
    deadline = args.deadline

    def write():
        if rank == 0:
            tmp = Path(args.worker_out + ".tmp")
            tmp.write_text(json.dumps(res, indent=1))
            tmp.replace(args.worker_out)

    def agree_stop() -> bool:
        # Rank 0's clock decides for everyone: ranks that disagreed would wait on each other forever.
        flag = torch.tensor([1.0 if (rank == 0 and time.time() > deadline) else 0.0], device=device)
        dist.broadcast(flag, 0)
        return bool(flag.item())

    def sync():
        if cuda:
            torch.cuda.synchronize(device)

    for dname in args.dtypes.split(","):
        dtype = dtypes[dname]
        for kind in args.kinds.split(","):
            key = f"{kind}.{dname}"
            try:
                err = _check(kind, n, rank, dtype, device)
            except Exception as e:
                err = f"{type(e).__name__}: {e}"
            res["checks"][key] = err or "ok"
            if rank == 0:
                stamp(f"check {key}: {res['checks'][key]}")
            if err and "result wrong" not in err:
                continue  # the collective itself is unavailable (e.g. on this backend); skip its sizes
            for nbytes in sizes(args.min_bytes, args.max_bytes, args.factor):
                if agree_stop():
                    res["stopped_early"] = True
                    write()
                    stamp("time budget reached; stopping the sweep")
                    dist.destroy_process_group()
                    return 0
                case = {"kind": kind, "dtype": dname, "requested_bytes": nbytes}
                try:
                    inp, out, size = _buffers(kind, nbytes, n, dtype, device)
                    warm, iters = _iters(size, args)
                    for _ in range(warm):
                        _call(kind, inp, out)
                    sync()
                    dist.barrier()
                    if cuda:
                        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                        start.record()
                        for _ in range(iters):
                            _call(kind, inp, out)
                        end.record()
                        end.synchronize()
                        t = start.elapsed_time(end) / 1e3 / iters
                    else:
                        t0 = time.perf_counter()
                        for _ in range(iters):
                            _call(kind, inp, out)
                        t = (time.perf_counter() - t0) / iters
                    times = torch.tensor([t, -t], dtype=torch.float64, device=device)
                    dist.all_reduce(times, op=dist.ReduceOp.MAX)  # slowest and fastest rank
                    t_max, t_min = float(times[0]), -float(times[1])
                    algbw = size / t_max
                    case.update({"bytes": size, "count": inp.numel() if kind != "all_gather" else out.numel(),
                                 "warmup": warm, "iters": iters, "time_s": t_max, "time_s_min_rank": t_min,
                                 "algbw_bytes_per_s": algbw, "busbw_bytes_per_s": algbw * bus_factor(kind, n)})
                    del inp, out
                except Exception as e:  # one failed size (e.g. out of memory) must not end the sweep
                    case["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                res["cases"].append(case)
                if rank == 0:
                    if "error" in case:
                        stamp(f"{key} {nbytes:>12,d} B  ERROR {case['error']}")
                    else:
                        stamp(f"{key} {case['bytes']:>12,d} B  {case['time_s'] * 1e6:10.1f} us  "
                              f"algbw {case['algbw_bytes_per_s'] / 1e9:7.2f} GB/s  busbw {case['busbw_bytes_per_s'] / 1e9:7.2f} GB/s")
                write()
    write()
    dist.barrier()
    dist.destroy_process_group()
    return 0


# ---------------------------------------------------------------------------------------------
# Launcher
# ---------------------------------------------------------------------------------------------

def versions() -> dict:
    out = {"python": platform.python_version()}
    try:
        import torch

        out["torch"] = torch.__version__
        out["cuda"] = str(torch.version.cuda)
    except Exception as e:
        out["torch"] = f"unavailable ({e})"
    try:
        import triton

        out["triton"] = triton.__version__
    except Exception:
        out["triton"] = "unavailable"
    return out


def summarize(cases: list[dict]) -> dict:
    """Peak bus bandwidth and smallest-size time per (kind, dtype): the two ends the fit pins."""
    out: dict = {}
    for c in cases:
        if "error" in c:
            continue
        k = f"{c['kind']}.{c['dtype']}"
        s = out.setdefault(k, {"peak_busbw_gb_per_s": 0.0, "min_time_us": float("inf")})
        s["peak_busbw_gb_per_s"] = max(s["peak_busbw_gb_per_s"], c["busbw_bytes_per_s"] / 1e9)
        s["min_time_us"] = min(s["min_time_us"], c["time_s"] * 1e6)
    return out


def launch(args, argv: list[str]) -> int:
    nproc = args.nproc
    if nproc is None:
        if args.device == "cuda":
            import torch

            nproc = torch.cuda.device_count()
        else:
            nproc = 2
    if nproc < 1:
        print("no GPU visible; use --device cpu for the gloo smoke test", file=sys.stderr)
        return 2
    start = time.time()
    deadline = start + max(5.0, args.timeout - args.teardown_s)
    with tempfile.TemporaryDirectory(prefix="coplan-coll-") as tmp:
        worker_out = str(Path(tmp) / "rank0.json")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               str(Path(__file__).resolve()), "--worker", "--worker-out", worker_out, "--deadline", repr(deadline),
               "--device", args.device, "--dtypes", args.dtypes, "--kinds", args.kinds,
               "--min-bytes", str(args.min_bytes), "--max-bytes", str(args.max_bytes), "--factor", str(args.factor),
               "--warmup", str(args.warmup), "--iters", str(args.iters), "--big-bytes", str(args.big_bytes)]
        env = dict(os.environ, **NO_MULTICAST_ENV)
        env.setdefault("OMP_NUM_THREADS", "1")
        stamp(f"launching {nproc} ranks on {args.device}: {' '.join(cmd[:6])} ...")
        proc = subprocess.Popen(cmd, env=env, start_new_session=True)
        # The workers stop themselves at the deadline; this is the backstop for a hung collective.
        rc = wait_or_kill(proc, args.timeout)
        res = json.loads(Path(worker_out).read_text()) if Path(worker_out).is_file() else {"cases": [], "checks": {}}
    ok_cases = [c for c in res.get("cases", []) if "error" not in c]
    out = {
        "benchmark": "collectives (issue 11)",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": "python benchmarks/collectives_h200.py " + " ".join(argv),
        "git_commit": git_commit(),
        "host": {"hostname": platform.node(), "python": platform.python_version(), "cpus": os.cpu_count()},
        "versions": versions(),
        "device": args.device,
        "device_name": res.get("device_name", "cpu" if args.device == "cpu" else "unknown"),
        "nccl_version": res.get("nccl_version"),
        "env": {k: os.environ.get(k, v) for k, v in NO_MULTICAST_ENV.items()},
        "world_size": res.get("world_size", nproc), "backend": res.get("backend"),
        "size_convention": "nccl-tests: S = gathered output (all_gather), input (reduce_scatter), buffer (all_reduce), "
                           "total sent per rank (all_to_all); busbw = algbw * 2(n-1)/n (all_reduce), (n-1)/n (others)",
        "returncode": rc, "wall_s": time.time() - start, "stopped_early": res.get("stopped_early", rc == "timeout"),
        "checks": res.get("checks", {}),
        "summary": summarize(ok_cases),
        "cases": res.get("cases", []),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    stamp(f"wrote {args.out}: {len(ok_cases)} cases ok, {len(out['cases']) - len(ok_cases)} failed, rc={rc}")
    for k, s in out["summary"].items():
        print(f"  {k:24s} peak busbw {s['peak_busbw_gb_per_s']:8.2f} GB/s   smallest {s['min_time_us']:8.1f} us")
    bad = [k for k, v in out["checks"].items() if v != "ok"]
    if bad:
        print(f"  checks not ok: {bad}")
    return 0 if ok_cases and rc == 0 else 1


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--nproc", type=int, default=None, help="ranks (default: all visible GPUs; 2 on CPU)")
    p.add_argument("--dtypes", default="bf16,fp32", help="comma list of bf16, fp32, fp16")
    p.add_argument("--kinds", default=",".join(KINDS))
    p.add_argument("--min-bytes", type=parse_bytes, default=parse_bytes("8KiB"))
    p.add_argument("--max-bytes", type=parse_bytes, default=parse_bytes("1GiB"))
    p.add_argument("--factor", type=int, default=2, help="size step (2: powers of two)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--big-bytes", type=parse_bytes, default=parse_bytes("64MiB"),
                   help="from this size on, use a quarter of the iterations")
    p.add_argument("--timeout", type=float, default=110.0, help="seconds for the whole sweep, launch included")
    p.add_argument("--teardown-s", type=float, default=20.0, help="seconds kept back from --timeout for the last case and exit")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/collectives_h200.json"))
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--worker-out", default="", help=argparse.SUPPRESS)
    p.add_argument("--deadline", type=float, default=float("inf"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.factor < 2 or args.min_bytes < 1 or args.max_bytes < args.min_bytes:
        p.error("need --factor >= 2 and 1 <= --min-bytes <= --max-bytes")
    if args.worker:
        return worker(args)
    return launch(args, argv)


if __name__ == "__main__":
    sys.exit(main())
