"""How far FP8 can go on gem-h200's linear layers, from what the H200 measured (issue 10).

Reads a ``benchmarks/fp8_h200.py`` result (per linear-layer shape: the bf16 forward + backward time and, per recipe,
the FP8 forward GEMM alone on operands already quantised) and bounds the forward + backward time of each recipe:

- the three GEMMs of a linear layer (forward, input gradient, weight gradient) each at the forward GEMM's measured
  FP8 speed-up (optimistic: the two gradient GEMMs accumulate in fp32 over long K and gain less);
- plus the quantisation passes at the device's measured copy bandwidth (bytes read + written, the topology's
  ``measured_hbm_bw_bytes_per_s``), with the fewest bytes any implementation that quantises in its own kernels
  must move:

  * ``blockwise`` (1x128 activation tiles, 128x128 weight blocks; every scale local in both directions): each of x,
    dY and W read once in bf16 and written once per layout it is used in (two fp8 copies): 4 bytes per element;
  * ``rowwise`` (one scale per row along K, so the weight gradient needs x and dY scaled along the tokens): the row-wise
    copy in one pass (2 read + 1 written), the column-wise copy in two (an amax read, then read + write): 8 bytes
    per element of x, dY and W;
  * ``fused``: quantisation riding in the kernels that produce x and dY (a LayerNorm or activation writing FP8
    where it wrote bf16): no pass of its own, so the bound is the GEMMs alone.

Totals weight each shape by its number of layers. A recipe helps a layer only where its bound is under bf16: the
"best per layer" total takes the lesser of the two per shape, as the planner would.

    python benchmarks/fp8_bound.py      # from docs/benchmarks-log/results/fp8_h200_s4.json (row-wise and block-wise both ran)
    python benchmarks/fp8_bound.py --result <fp8_h200.json> --out <json>
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import git_commit  # noqa: E402  (the scripts run by path)

ROOT = Path(__file__).resolve().parent
BYTES_PER_ELEMENT = {"blockwise": 4.0, "rowwise": 8.0, "fused": 0.0}


def copy_bandwidth(topology: str) -> float:
    """The measured device copy rate of a topology preset (bytes read + written per second)."""
    from coplan.spec import load_topology

    gpu = load_topology(topology).gpu
    return float(gpu.measured_hbm_bw_bytes_per_s or gpu.hbm_bw_bytes_per_s)


def bound(result: dict, bandwidth: float) -> dict:
    rows, totals = [], {"bf16_ms": 0.0}
    for sh in result["shapes"]:
        m, k, n, layers = sh["M"], sh["K"], sh["N"], len(sh["layers"])
        bf = sh.get("bf16", {}).get("fwd_bwd", {}).get("ms")
        if not bf:
            continue
        row = {"M": m, "K": k, "N": n, "layers": layers, "bf16_fwd_bwd_ms": bf}
        totals["bf16_ms"] += layers * bf
        for recipe, measured in (("blockwise", "blockwise"), ("rowwise", "rowwise"), ("fused", "blockwise")):
            gemm = sh.get(measured, {}).get("gemm_only", {}).get("speedup")
            if not gemm:
                continue
            elements = m * k + m * n + k * n
            quant_ms = BYTES_PER_ELEMENT[recipe] * elements / bandwidth * 1e3
            ms = bf / gemm + quant_ms
            row[recipe] = {"gemm_speedup": gemm, "quant_ms": quant_ms, "bound_ms": ms, "bound_speedup": bf / ms,
                           "measured_fwd_bwd_speedup": sh.get(measured, {}).get("fwd_bwd", {}).get("speedup")
                           if recipe != "fused" else None}
            totals.setdefault(f"{recipe}_ms", 0.0)
            totals.setdefault(f"{recipe}_best_per_layer_ms", 0.0)
            totals[f"{recipe}_ms"] += layers * ms
            totals[f"{recipe}_best_per_layer_ms"] += layers * min(ms, bf)
        rows.append(row)
    for recipe in BYTES_PER_ELEMENT:
        if f"{recipe}_ms" in totals:
            totals[f"{recipe}_speedup"] = totals["bf16_ms"] / totals[f"{recipe}_ms"]
            totals[f"{recipe}_best_per_layer_speedup"] = totals["bf16_ms"] / totals[f"{recipe}_best_per_layer_ms"]
    return {"shapes": rows, "totals": totals}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--result", type=Path, default=ROOT.parent / "docs" / "benchmarks-log" / "results" / "fp8_h200_s4.json")
    p.add_argument("--topology", default="h200-1gpu", help="preset whose measured copy bandwidth prices the passes")
    p.add_argument("--out", type=Path, default=ROOT / "results" / "fp8_bound.json")
    args = p.parse_args(argv)
    result = json.loads(args.result.read_text())
    bw = copy_bandwidth(args.topology)
    out = {"benchmark": "fp8 forward+backward bound per gem-h200 linear layer (issue 10)",
           "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "python": platform.python_version(),
           "git_commit": git_commit(),
           "source": str(args.result.relative_to(ROOT.parent) if args.result.is_relative_to(ROOT.parent) else args.result),
           "source_device": result.get("device"), "source_date": result.get("date"), "source_torch": result.get("torch"),
           "source_git_commit": result.get("git_commit"),
           "copy_bandwidth_bytes_per_s": bw, "bytes_per_element": BYTES_PER_ELEMENT, **bound(result, bw)}
    args.out.write_text(json.dumps(out, indent=1))
    print(f"{'M x K x N':<20}{'layers':>7}{'bf16 ms':>9}   " + "   ".join(f"{r:>22}" for r in BYTES_PER_ELEMENT))
    for r in out["shapes"]:
        cells = [f"{r[x]['bound_ms']:.3f} ({r[x]['bound_speedup']:.2f}x)" if x in r else "-" for x in BYTES_PER_ELEMENT]
        print(f"{r['M']}x{r['K']}x{r['N']:<8}{r['layers']:>7}{r['bf16_fwd_bwd_ms']:>9.3f}   " + "   ".join(f"{c:>22}" for c in cells))
    t = out["totals"]
    print(f"all layers, bf16 {t['bf16_ms']:.2f} ms: " + ", ".join(
        f"{r} {t[f'{r}_ms']:.2f} ms ({t[f'{r}_speedup']:.2f}x; best per layer {t[f'{r}_best_per_layer_speedup']:.2f}x)"
        for r in BYTES_PER_ELEMENT if f"{r}_ms" in t))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
