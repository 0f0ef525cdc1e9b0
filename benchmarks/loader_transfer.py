"""How the trainer's reader processes hand batches to the training process, and what that costs the training
thread: batches pickled through the pipe (read on the data thread in 64 KiB pieces, each a hand-back of the GIL)
against batches in shared memory (one handle through the pipe; ``coplan.trainer.data._to_shared``).

The training thread is stood in for by a fixed amount of pure-Python work per batch (it holds the GIL, as the
trainer's loop does while it issues kernels); its wall time per batch, with the loader streaming beside it, is
measured for each hand-over, and the data thread's throughput with the training thread idle. CPU only (no GPU: no
pinning), on the held-out draws with the lowest loader headroom on the lent H100::

    python benchmarks/loader_transfer.py

Writes ``benchmarks/results/loader_transfer.json``.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import write_result  # noqa: E402

from coplan.spec import load_workload  # noqa: E402
from coplan.trainer.data import BatchReader, Prefetcher, generate_dataset  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
DRAWS = ("fresh_plans_h100d/draw-20261206024636.yaml", "fresh_plans_h100e/draw-20261206053524.yaml")
"""The two held-out draws whose loader kept under 2x ahead of the lent H100 (1.8x and 1.6x)."""
PICKLED = None
"""``share_min_bytes`` that sends every batch pickled (the trainer's default)."""
SHARED = 1 << 16
"""``share_min_bytes`` that sends arrays of 64 KiB and more in shared memory."""


def python_work(n: int) -> float:
    """``n`` rounds of small Python work holding the GIL (the training thread's stand-in); its wall seconds."""
    t0 = time.perf_counter()
    acc = 0
    for i in range(n):
        acc += sum((i, 1, 2, 3))
    return time.perf_counter() - t0


def run(reader: BatchReader, steps: int, processes: int, share: int, work: int) -> dict:
    pf = Prefetcher(reader, 0, steps, processes=processes, share_min_bytes=share)
    try:
        next(pf)  # the readers' start-up (spawn, imports, the files opened) is not the steady state
        busy = []
        for _ in range(steps - 1):
            next(pf)
            busy.append(python_work(work))
    finally:
        pf.close()
    pf = Prefetcher(reader, 0, steps, processes=processes, share_min_bytes=share)
    try:
        next(pf)
        t0 = time.perf_counter()
        for _ in range(steps - 1):
            next(pf)
        drain = (time.perf_counter() - t0) / (steps - 1)
    finally:
        pf.close()
    return {"work_s_per_batch_p50": statistics.median(busy), "loader_s_per_batch_idle_consumer": drain}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--processes", type=int, default=2, help="reader processes (the trainer starts up to 8 on a GPU host)")
    ap.add_argument("--work", type=int, default=60_000, help="rounds of Python work per batch (the training thread)")
    ap.add_argument("--out", type=Path, default=RESULTS / "loader_transfer.json")
    a = ap.parse_args()
    alone = statistics.median(python_work(a.work) for _ in range(9))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for rel in DRAWS:
            w = load_workload(RESULTS / rel)
            gb = w.batch.global_(1)
            data = generate_dataset(w, Path(tmp) / w.name, gb * (a.steps + 1), seed=0)
            reader = BatchReader(w, data, world_size=1, rank=0, policy="greedy", global_batch=gb)
            hb = reader.read(0)
            nbytes = sum(v.nbytes for v in (hb.pooled_values, hb.labels, *hb.seq_values.values(), *hb.seq_lengths.values()))
            row = {"draw": rel, "local_batch": gb, "batch_bytes": nbytes}
            for name, share in (("pickled", PICKLED), ("shared", SHARED)):
                row[name] = run(reader, a.steps, a.processes, share, a.work)
            row["work_slowdown_pickled"] = row["pickled"]["work_s_per_batch_p50"] / alone - 1
            row["work_slowdown_shared"] = row["shared"]["work_s_per_batch_p50"] / alone - 1
            rows.append(row)
            print(f"{rel}: {nbytes / 1e6:.1f} MB a batch; the training thread's work {alone * 1e3:.1f} ms alone, "
                  f"{row['pickled']['work_s_per_batch_p50'] * 1e3:.1f} ms beside pickled batches, "
                  f"{row['shared']['work_s_per_batch_p50'] * 1e3:.1f} ms beside shared ones; loader alone "
                  f"{row['pickled']['loader_s_per_batch_idle_consumer'] * 1e3:.1f} -> "
                  f"{row['shared']['loader_s_per_batch_idle_consumer'] * 1e3:.1f} ms a batch", flush=True)
    write_result(a.out, "reader processes' hand-over of batches: pickled vs shared memory, and the training thread",
                 f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)",
                 {"median_work_slowdown_pickled": statistics.median(r["work_slowdown_pickled"] for r in rows),
                  "median_work_slowdown_shared": statistics.median(r["work_slowdown_shared"] for r in rows)},
                 rows, python=platform.python_version(), processes=a.processes, steps=a.steps, work_rounds=a.work,
                 work_alone_s=alone)
    return 0


if __name__ == "__main__":
    sys.exit(main())
