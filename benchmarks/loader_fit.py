"""Fit the cost model's data-loader coefficients (``coplan.costmodel.loader``) on the trainer's own reader, and
check them on draws they were not fitted on.

Fit set: ``--n`` workloads drawn from the sampler's ``h200-1gpu`` family with a seed taken at run time (printed
and recorded). For each, the trainer's :class:`~coplan.trainer.data.BatchReader` reads steps as a reader
process does (one process, Arrow's pool at one thread) at balance groups of 1 and 4 ranks and 1 and 2
micro-batches; the first micro-batch of a step times the step's read plus its gather, the second the gather
alone. The four coefficients (per step, per value decoded, per micro-batch, per value gathered) are a
non-negative least-squares fit of those times (relative errors).

Held out: the fresh draws of ``benchmarks/results/fresh_plans`` (never in the fit), read one step at a time as
the trainer does on one rank, predicted with the fitted coefficients::

    python benchmarks/loader_fit.py            # ~5 minutes on a 2-core machine

Writes ``benchmarks/results/loader_fit.json``; copy the coefficients into ``DEFAULT_LOADER`` (a test keeps the
two equal).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
from scipy.optimize import nnls

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import git_commit  # noqa: E402

from coplan.costmodel.loader import LoaderCoefficients, loader_step_s, values_per_sample  # noqa: E402
from coplan.sample import sample_workload  # noqa: E402
from coplan.spec import Workload, load_workload  # noqa: E402
from coplan.trainer.data import BatchReader, generate_dataset  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
GROUPS = (1, 4)
MICRO = (1, 2)


def _median_reads(w: Workload, data: Path, group: int, micro: int, steps: int) -> tuple[float, float | None]:
    """Median seconds of a step's first micro-batch (read + gather) and of its second (gather), rank 0."""
    b = w.batch.global_(1)
    r = BatchReader(w, data, world_size=group, rank=0, policy="greedy", global_batch=b * group, micro_batches=micro)
    r.read(0, 0)  # opens the files
    first, later = [], []
    for s in range(1, steps + 1):
        t0 = time.perf_counter()
        r.read(s, 0)
        first.append(time.perf_counter() - t0)
        if micro > 1:
            t0 = time.perf_counter()
            r.read(s, 1)
            later.append(time.perf_counter() - t0)
    return statistics.median(first), (statistics.median(later) if later else None)


def measure_fit(w: Workload, tmp: Path, steps: int) -> list[dict]:
    b = w.batch.global_(1)
    data = generate_dataset(w, tmp / w.name, b * max(GROUPS) * (steps + 1), seed=0)
    v = values_per_sample(w)
    rows = []
    for g in GROUPS:
        for m in MICRO:
            if b % m:
                continue
            first, later = _median_reads(w, data, g, m, steps)
            rows.append({"workload": w.name, "group": g, "micro": m, "local_batch": b, "values_per_sample": v,
                         "first_s": first, "gather_s": later})
    return rows


def fit(rows: list[dict]) -> tuple[LoaderCoefficients, dict]:
    """NNLS on relative errors: each measured time t gives a row x·c ≈ t, weighted by 1/t."""
    A, y = [], []
    for r in rows:
        b, v, g, m = r["local_batch"], r["values_per_sample"], r["group"], r["micro"]
        A.append([1.0, g * b * v, 1.0, (b / m) * v])
        y.append(r["first_s"])
        if r["gather_s"] is not None:
            A.append([0.0, 0.0, 1.0, (b / m) * v])
            y.append(r["gather_s"])
    A_, y_ = np.array(A), np.array(y)
    wts = 1.0 / y_
    c, _ = nnls(A_ * wts[:, None], y_ * wts)
    pred = A_ @ c
    err = np.abs(pred / y_ - 1.0)
    coeff = LoaderCoefficients(step_s=float(c[0]), value_s=float(c[1]), micro_s=float(c[2]), gather_s=float(c[3]),
                               source="")
    return coeff, {"points": len(y), "median_abs_rel_error": float(np.median(err)), "max_abs_rel_error": float(err.max())}


def held_out(plans: Path, coeff: LoaderCoefficients, tmp: Path, steps: int) -> list[dict]:
    out = []
    for wp in sorted(plans.glob("*.yaml")):
        w = load_workload(wp)
        b = w.batch.global_(1)
        data = generate_dataset(w, tmp / w.name, b * (steps + 1), seed=0)
        measured, _ = _median_reads(w, data, 1, 1, steps)
        pred = loader_step_s(w, b, 1, 1, 1, coeff).process_s
        out.append({"file": wp.name, "local_batch": b, "values_per_sample": values_per_sample(w), "measured_s": measured,
                    "predicted_s": pred, "error": pred / measured - 1.0})
        print(f"  held out {wp.name}: measured {measured * 1e3:.1f} ms, predicted {pred * 1e3:.1f} ms "
              f"({100 * (pred / measured - 1):+.0f}%)", flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=8, help="fit draws")
    ap.add_argument("--seed", type=int, default=None, help="first draw's seed (default: the time now, YYYYmmddHHMMSS)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--held-out", type=Path, default=RESULTS / "fresh_plans")
    ap.add_argument("--out", type=Path, default=RESULTS / "loader_fit.json")
    a = ap.parse_args()
    seed = a.seed if a.seed is not None else int(dt.datetime.now(dt.timezone.utc).strftime("%Y%m%d%H%M%S"))
    print(f"seed {seed} (draws {seed}..{seed + a.n - 1} of family h200-1gpu)", flush=True)
    pa.set_cpu_count(1)  # as one reader process's share of the host
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        for k in range(a.n):
            w = sample_workload("h200-1gpu", seed + k)
            got = measure_fit(w, Path(tmp), a.steps)
            rows += got
            print(f"{w.name}: {got[0]['values_per_sample']:,.0f} values/sample, batch {got[0]['local_batch']}: "
                  + ", ".join(f"G{r['group']} M{r['micro']} {r['first_s'] * 1e3:.1f} ms" for r in got), flush=True)
        coeff, err = fit(rows)
        print(f"fit: {coeff}; {err}", flush=True)
        ho = held_out(a.held_out, coeff, Path(tmp), a.steps) if a.held_out.is_dir() else []
    he = [abs(r["error"]) for r in ho]
    result = {
        "benchmark": "data-loader coefficients of the cost model, fitted on the trainer's reader",
        "device": f"CPU ({platform.processor() or platform.machine()}), one process, Arrow pool of 1 thread",
        "python": platform.python_version(), "pyarrow": pa.__version__, "git_commit": git_commit(),
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "command": " ".join(sys.argv),
        "family": "h200-1gpu", "seed": seed, "draws": a.n,
        "coefficients": {"step_s": coeff.step_s, "value_s": coeff.value_s, "micro_s": coeff.micro_s, "gather_s": coeff.gather_s},
        "fit_error": err,
        "held_out": {"draws": len(ho), "median_abs_rel_error": statistics.median(he) if he else None,
                     "max_abs_rel_error": max(he) if he else None, "rows": ho},
        "fit_rows": rows,
    }
    a.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: result[k] for k in ("seed", "coefficients", "fit_error")}, indent=1))
    print(json.dumps({k: v for k, v in result["held_out"].items() if k != "rows"}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
