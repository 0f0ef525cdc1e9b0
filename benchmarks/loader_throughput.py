"""The trainer's data loader, read alone: samples per second one reader process gets from a dataset of each
fresh draw (``coplan.trainer.data``: Parquet row groups -> the rank's balanced share -> the batch's arrays), against
what the trainer consumed of that draw on the H200 (``fresh_draws_h200.json``'s ``loader.consumed_samples_per_s``).

The reading is host work: it is measured here on this machine's CPU with one process (the trainer runs several on
CUDA hosts, ``trainer.data.default_reader_processes``), so the headroom it gives is a floor::

    python benchmarks/loader_throughput.py

Writes ``benchmarks/results/loader_throughput.json``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import plans_of, write_result  # noqa: E402

from coplan.spec import load_workload  # noqa: E402
from coplan.trainer.data import BatchReader, generate_dataset  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def measure(workload_path: Path, steps: int, tmp: Path) -> dict:
    w = load_workload(workload_path)
    gb = w.batch.global_(1)
    t0 = time.perf_counter()
    data = generate_dataset(w, tmp / w.name, gb * (steps + 1), seed=0)
    gen_s = time.perf_counter() - t0
    reader = BatchReader(w, data, world_size=1, rank=0, policy="greedy", global_batch=gb)
    reader.read(0)  # opens the files
    times = []
    for step in range(1, steps + 1):
        t0 = time.perf_counter()
        reader.read(step)
        times.append(time.perf_counter() - t0)
    per_batch = statistics.median(times)
    return {"workload": w.name, "tables": len(w.all_tables), "local_batch": gb, "generate_s": gen_s,
            "read_s_per_batch_p50": per_batch, "samples_per_s": gb / per_batch}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--plans", type=Path, default=None,
                    help="the draws' plan set (default: the one the --measured result ran)")
    ap.add_argument("--measured", type=Path, default=RESULTS / "fresh_draws_h200.json")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--out", type=Path, default=RESULTS / "loader_throughput.json")
    a = ap.parse_args()
    if a.plans is None:
        a.plans = plans_of(a.measured, RESULTS / "fresh_plans")
    measured = {r["workload"]: r for r in json.loads(a.measured.read_text())["rows"]} if a.measured.is_file() else {}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for wp in sorted(a.plans.glob("*.yaml")):
            row = {"file": wp.name, **measure(wp, a.steps, Path(tmp))}
            m = measured.get(wp.name, {}).get("loader")
            if m:
                row["h200_consumed_samples_per_s"] = m["consumed_samples_per_s"]
                row["headroom_one_process"] = row["samples_per_s"] / m["consumed_samples_per_s"]
            print(f"{wp.name}: {row['tables']} tables, batch {row['local_batch']}: {row['samples_per_s']:,.0f} samples/s "
                  f"({row['read_s_per_batch_p50'] * 1e3:.1f} ms a batch)"
                  + (f", {row['headroom_one_process']:.1f}x the H200 run's consumption" if m else ""), flush=True)
            rows.append(row)
    sps = [r["samples_per_s"] for r in rows]
    write_result(a.out, "trainer data loader alone, one reader process", f"CPU ({platform.processor() or 'x86_64'}), one process",
                 {"draws": len(rows), "median_samples_per_s": statistics.median(sps) if sps else None,
                  "min_samples_per_s": min(sps) if sps else None,
                  "min_headroom_one_process": min((r["headroom_one_process"] for r in rows if "headroom_one_process" in r),
                                                  default=None)},
                 rows, python=platform.python_version())
    return 0


if __name__ == "__main__":
    sys.exit(main())
