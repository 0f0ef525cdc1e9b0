"""The device's idle time per kernel when the host runs ahead: the source of the uncalibrated device gap
(``coplan.costmodel.efficiency.DEFAULT_DEVICE_GAP_S``, issue 23).

Reads profiler traces of device-bound ``coplan train`` steps (by default the trainer benchmark's two
gem-h200 traces on one H200, ``benchmarks/train_h200.py``: 256 samples a step, eager and ``--compile
layers``, where the host issues kernels well ahead of the device) and, per trace, divides the device's
idle time inside the profiled steps' windows by the device work units (kernels, memcpys, memsets) those
steps ran (``coplan.calibration.attribution``: the same windows and units ``coplan calibrate`` uses).
No step time is fitted: the figure is a count and a sum over the trace.

Host-bound traces (the fresh draws', whose profiled steps wait on the profiler's own host overhead) do
not measure this: their idle time is the host's. The script reports each trace's busy share so that a
trace whose device waited on its host stands out (``--min-busy``, default 0.95, marks those and leaves
them out of the summary).

    python benchmarks/device_gap.py                       # -> benchmarks/results/device_gap.json
    python benchmarks/device_gap.py --traces run/traces/rank0.json.gz --out /tmp/gap.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import write_result  # noqa: E402  (the scripts run by path)

RESULTS = Path(__file__).resolve().parent / "results"
DEFAULT_TRACES = (RESULTS / "train_h200_trace_triton-b256.json.gz", RESULTS / "train_h200_trace_triton-compile-b256.json.gz")


def measure(path: Path) -> dict:
    from coplan.calibration.attribution import attribute_file

    a = attribute_file(path)
    if not a.on_device or not a.window_s or not a.device_units:
        return {"trace": str(path), "error": "no device kernels in profiled step windows"}
    busy = a.window_s - a.idle_s
    return {"trace": path.name, "steps": a.steps, "window_ms_per_step": a.window_s / a.steps * 1e3,
            "idle_ms_per_step": a.idle_s / a.steps * 1e3, "device_units_per_step": a.device_units / a.steps,
            "busy_share": busy / a.window_s, "idle_us_per_unit": a.idle_s / a.device_units * 1e6}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--traces", type=Path, nargs="+", default=list(DEFAULT_TRACES))
    ap.add_argument("--min-busy", type=float, default=0.95,
                    help="a trace whose device was busy for less of its step windows waited on its host: left out")
    ap.add_argument("--out", type=Path, default=RESULTS / "device_gap.json")
    a = ap.parse_args(argv)
    rows = [measure(p) for p in a.traces]
    kept = [r for r in rows if "error" not in r and r["busy_share"] >= a.min_busy]
    for r in rows:
        if "error" not in r:
            r["device_bound"] = r["busy_share"] >= a.min_busy
    if not kept:
        print("no device-bound trace among the inputs", file=sys.stderr)
        return 1
    summary = {"traces_kept": len(kept), "traces_read": len(rows),
               "idle_us_per_unit_mean": statistics.fmean(r["idle_us_per_unit"] for r in kept),
               "idle_us_per_unit_min": min(r["idle_us_per_unit"] for r in kept),
               "idle_us_per_unit_max": max(r["idle_us_per_unit"] for r in kept)}
    write_result(a.out, "device idle per kernel in device-bound trainer steps (uncalibrated device gap, issue 23)",
                 "NVIDIA H200 (the traces' device; read on any machine)", summary, rows,
                 source="benchmarks/train_h200.py traces (gem-h200, 256 samples a step, 2026-11-29, commit 6fe23fc)"
                 if a.traces == list(DEFAULT_TRACES) else "the traces given", min_busy=a.min_busy)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
