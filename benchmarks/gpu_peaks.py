"""A GPU's measured ceilings, the figures a topology file's ``measured_flops_per_s`` and
``measured_hbm_bw_bytes_per_s`` hold: a square bf16 GEMM, the same in FP8 (``torch._scaled_mm``, one scale
per tensor, bf16 output), and a device-to-device copy (bytes read + written). Each is the median of timed
repetitions (CUDA events) after a warm-up::

    python benchmarks/gpu_peaks.py --out benchmarks/results/gpu_peaks_h100.json

Writes the device's name, versions, date and commit with the figures.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import git_commit  # noqa: E402


def timed(fn, reps: int, warmup: int = 5) -> float:
    """Median seconds of ``fn`` over ``reps`` CUDA-event timed calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) / 1e3)
    return statistics.median(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", type=int, default=8192, help="square GEMM size")
    ap.add_argument("--copy-gib", type=float, default=2.0, help="bytes copied per timed copy, GiB")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("gpu_peaks: no CUDA device", file=sys.stderr)
        return 2
    n, dev = a.size, torch.device("cuda")
    x = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    w = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    flops = 2.0 * n ** 3
    bf16_s = timed(lambda: x @ w, a.reps)
    res: dict = {"bf16_matmul_flops_per_s": flops / bf16_s, "bf16_matmul_s": bf16_s}
    try:
        xf = x.to(torch.float8_e4m3fn)
        wf = w.to(torch.float8_e4m3fn).t().contiguous().t()  # column-major second operand, as cuBLASLt needs
        one = torch.ones((), device=dev)
        fp8_s = timed(lambda: torch._scaled_mm(xf, wf, scale_a=one, scale_b=one, out_dtype=torch.bfloat16), a.reps)
        res |= {"fp8_matmul_flops_per_s": flops / fp8_s, "fp8_matmul_s": fp8_s}
    except Exception as e:  # an older GPU or build without FP8 GEMMs
        res["fp8_error"] = str(e)[:300]
    nbytes = int(a.copy_gib * 2**30)
    src = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    copy_s = timed(lambda: dst.copy_(src), a.reps)
    res |= {"copy_bytes_per_s": 2.0 * nbytes / copy_s, "copy_s": copy_s}
    out = {"benchmark": "GPU ceilings: square bf16 and FP8 GEMMs, device copy", "device": torch.cuda.get_device_name(0),
           "torch": torch.__version__, "python": platform.python_version(), "git_commit": git_commit(),
           "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "command": " ".join(sys.argv),
           "size": n, "copy_gib": a.copy_gib, "reps": a.reps, **res}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(out, indent=1))
    print(json.dumps({k: (f"{v / 1e12:.1f} T" if k.endswith("per_s") else v) for k, v in res.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
