"""Does GEMM efficiency need a shape model? Two models of a bf16 GEMM's device time, fitted to the H200 GEMMs
``benchmarks/fp8_h200.py`` measured (``benchmarks/results/fp8_h200.json``: 10 linear-layer shapes from
gem-h200, M = 512-61,000 rows; each shape's forward GEMM timed alone and its three forward+backward GEMMs
summed from the trace's device time):

- **constant** (what the cost model prices): ``max(FLOPs / (peak · e), bytes / bandwidth) + t0`` per GEMM,
  one efficiency ``e`` and one per-kernel floor ``t0``;
- **tiles and waves**: the same with ``e`` times the share of 128x128 output tiles that hold real rows and
  columns, times the last wave's occupancy of the 132 SMs, times ``K / (K + k0)`` (a K-loop's prologue and
  epilogue), the usual quantisation model of NVIDIA's GEMM performance guide.

Both are fitted by least squares on log time (relative error); the one with the smaller median error on these
shapes is the better description of them::

    python benchmarks/gemm_shape_fit.py

Writes ``benchmarks/results/gemm_shape_fit.json``.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import sys
from pathlib import Path

import numpy as np
from scipy.optimize import least_squares

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import git_commit  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
PEAK = 989e12
"""H200 dense bf16 datasheet peak, FLOP/s."""
SMS = 132
COPY_BW = 4.24e12
"""The coplan brief's measured H200 device copy rate, bytes/s."""


def points(measured: dict) -> list[tuple[str, list[tuple[int, int, int]], float]]:
    """(kind, GEMMs as (M, N, K), seconds): each shape's forward GEMM alone, and its forward + backward GEMMs
    (forward, input gradient [M, N] x [N, K], weight gradient [K, M] x [M, N]) from the device trace."""
    out = []
    for s in measured["shapes"]:
        b = s.get("bf16")
        if not b:
            continue
        M, K, N = s["M"], s["K"], s["N"]
        out.append(("forward", [(M, N, K)], b["fwd"]["ms"] * 1e-3))
        g = b["fwd_bwd"].get("device_breakdown", {}).get("ms_per_call", {}).get("gemm")
        if g:
            out.append(("forward+backward", [(M, N, K), (M, K, N), (K, N, M)], g * 1e-3))
    return out


def t_constant(M: int, N: int, K: int, e: float, t0: float) -> float:
    return max(2.0 * M * N * K / (PEAK * e), 2.0 * (M * K + K * N + M * N) / COPY_BW) + t0


def t_tiles(M: int, N: int, K: int, e: float, k0: float, t0: float, tile: int = 128) -> float:
    tm, tn = math.ceil(M / tile), math.ceil(N / tile)
    tiles = tm * tn
    waves = math.ceil(tiles / SMS)
    eff = e * (tiles / (waves * SMS)) * (M * N / (tm * tile * tn * tile)) * K / (K + k0)
    return max(2.0 * M * N * K / (PEAK * eff), 2.0 * (M * K + K * N + M * N) / COPY_BW) + t0


def fit(pts, model, x0, lo, hi) -> tuple[np.ndarray, np.ndarray]:
    def res(x):
        return [math.log(sum(model(*g, *x) for g in gs) / t) for _, gs, t in pts]

    r = least_squares(res, x0, bounds=(lo, hi))
    return r.x, np.exp(np.abs(np.asarray(r.fun))) - 1.0


def main() -> int:
    src = RESULTS / "fp8_h200.json"
    measured = json.loads(src.read_text())
    pts = points(measured)
    xc, ec = fit(pts, t_constant, [0.8, 5e-6], [0.2, 0.0], [1.0, 5e-5])
    xt, et = fit(pts, t_tiles, [0.8, 100.0, 5e-6], [0.2, 0.0, 0.0], [1.0, 4000.0, 5e-5])
    rows = [{"kind": k, "gemms": gs, "measured_s": t, "constant_s": sum(t_constant(*g, *xc) for g in gs),
             "tiles_s": sum(t_tiles(*g, *xt) for g in gs)} for k, gs, t in pts]
    out = {
        "benchmark": "GEMM shape model against a constant efficiency, on the H200's measured bf16 GEMMs",
        "device": measured.get("device"), "source": f"benchmarks/results/fp8_h200.json ({measured.get('date')}, "
        f"commit {str(measured.get('git_commit', ''))[:7]})",
        "git_commit": git_commit(), "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(sys.argv), "points": len(pts),
        "constant": {"efficiency": xc[0], "t0_s": xc[1], "median_abs_rel_error": float(np.median(ec)),
                     "max_abs_rel_error": float(ec.max())},
        "tiles_waves": {"efficiency": xt[0], "k0": xt[1], "t0_s": xt[2], "median_abs_rel_error": float(np.median(et)),
                        "max_abs_rel_error": float(et.max())},
        "better": "constant" if np.median(ec) <= np.median(et) else "tiles_waves",
        "rows": rows,
    }
    (RESULTS / "gemm_shape_fit.json").write_text(json.dumps(out, indent=1) + "\n")
    for k in ("constant", "tiles_waves"):
        print(k, {a: (round(b, 4) if isinstance(b, float) else b) for a, b in out[k].items()})
    print("better on these shapes:", out["better"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
