"""Fresh GEM-shaped draws on one H200, the user's path only: ``coplan sample-workload --family h200-1gpu``,
``coplan plan -t h200-1gpu``, ``coplan train`` at its defaults. Reports, per draw, the predicted and
measured step (p50), local MFU, and the time to the first step; and over the set, the median and worst
absolute step-time error of the prediction and the median/min MFU (issues 23 and 24).

The seed is taken at run time (UTC date and time) unless given, printed and recorded; draw i uses
``seed + i``. Never re-draw a set until it passes: the seed of every run is in the JSON.

The lent GPU machines have no OR-Tools, so the plans are made first on any machine::

    python benchmarks/fresh_draws_h200.py --plan-only --n 10 --plans benchmarks/results/fresh_plans
    # then on the H200 (TorchRec installed, coplan importable):
    python benchmarks/fresh_draws_h200.py --plans benchmarks/results/fresh_plans --out $OUT/fresh_draws_h200.json

Writes ``benchmarks/results/fresh_draws_h200.json`` (device, versions, date, commit, seed, per-draw rows).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import coplan_cmd as _coplan  # noqa: E402
from _common import git_commit, wait_or_kill  # noqa: E402
from _step_anatomy import step_anatomy, verdict  # noqa: E402

FAMILY = "h200-1gpu"
RESULTS = Path(__file__).resolve().parent / "results"


def make_plans(n: int, seed: int, plans: Path, topology: str = FAMILY) -> dict:
    """Draw ``n`` workloads (seeds ``seed .. seed+n-1``) and plan each with ``coplan plan``; a manifest."""
    plans.mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(n):
        s = seed + i
        w, p = plans / f"draw-{s}.yaml", plans / f"draw-{s}.plan.json"
        subprocess.run(_coplan("sample-workload", "--family", FAMILY, "--seed", str(s), "-o", str(w)), check=True)
        t0 = time.perf_counter()
        r = subprocess.run(_coplan("plan", "-t", topology, "-w", str(w), "-o", str(p), "--quiet"),
                           capture_output=True, text=True)
        row = {"seed": s, "workload": w.name, "plan": p.name if r.returncode == 0 else None,
               "plan_exit": r.returncode, "plan_s": round(time.perf_counter() - t0, 2)}
        if r.returncode == 0:
            pred = json.loads(p.read_text())["predicted"]
            row |= {"predicted_step_s": pred["step_time_s"], "predicted_local_mfu": pred["local_mfu"]}
        else:
            row["plan_error"] = (r.stderr or r.stdout)[-600:]
        print(f"seed {s}: plan exit {r.returncode}" + (f", predicted {row['predicted_step_s'] * 1e3:.1f} ms, "
              f"MFU {row['predicted_local_mfu']:.1%}" if r.returncode == 0 else ""), flush=True)
        rows.append(row)
    manifest = {"family": FAMILY, "topology": topology, "seed": seed, "n": n, "rows": rows, "planned_at_commit": git_commit(),
                "planned_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")}
    (plans / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return manifest


def predicted_by_class(plan: Path) -> dict[str, float]:
    """The plan's priced device seconds per step by op class (its ``predicted.ops``)."""
    out: dict[str, float] = {}
    for o in json.loads(plan.read_text()).get("predicted", {}).get("ops", []):
        out[o["op_class"]] = out.get(o["op_class"], 0.0) + o["time_s"]
    return out


def class_comparison(plan: Path, anatomy: dict | None) -> dict[str, dict[str, float | None]]:
    """Per kernel class: the plan's priced seconds per step beside the trace's (eager profiled steps, by kernel
    name, attributed or not), and measured / predicted: which class the prediction misses."""
    pred = predicted_by_class(plan)
    meas = (anatomy or {}).get("device_by_class_s") or {}
    return {c: {"predicted_s": pred.get(c), "measured_s": meas.get(c),
                "measured_over_predicted": meas[c] / pred[c] if pred.get(c) and meas.get(c) else None}
            for c in sorted(set(pred) | set(meas))}


def run_one(plan: Path, runs_root: Path, run_id: str, steps: int | None, timeout_s: float,
            train_args: tuple[str, ...] = ()) -> dict:
    """``coplan train PLAN`` at its defaults (only where the run goes, and its length when given); ``train_args``:
    a development variant's extra switches (its result is not the user's path and says so)."""
    t0 = time.perf_counter()
    length = ["--steps", str(steps)] if steps else []
    proc = subprocess.Popen(_coplan("train", str(plan), *length, "--runs-root", str(runs_root), "--run-id", run_id,
                                    "--no-progress", *train_args),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    code = wait_or_kill(proc, timeout_s)
    out = proc.stdout.read() if proc.stdout else ""
    row: dict = {"exit": code, "wall_s": round(time.perf_counter() - t0, 1)}
    summary = runs_root / run_id / "summary.json"
    if code == 0 and summary.is_file():
        s = json.loads(summary.read_text())
        row |= {"measured_step_p50_s": s["step_time"]["p50_s"], "measured_mfu": s["measured_mfu"],
                "host_step_p50_s": (s.get("host_step") or {}).get("p50_s"),
                "host_phases_s": s.get("host_phases") or {},
                "startup": s.get("startup"), "loader": s.get("loader"), "options": s.get("options"),
                "notes": s.get("notes", "")}
        try:
            anatomy = step_anatomy(runs_root / run_id)
        except Exception as e:  # the figures stand without it
            anatomy = {"error": str(e)[:300]}
        row |= {"anatomy": anatomy, "where": verdict(anatomy, row["measured_step_p50_s"], row.get("host_phases_s"))}
        row["device_by_class"] = class_comparison(plan, anatomy)
    else:
        row["tail"] = out[-1500:]
    # the lent machine's disk (64 GiB) holds a few draws' tables: each run's checkpoint and dataset go once read
    shutil.rmtree(runs_root / run_id / "checkpoints", ignore_errors=True)
    shutil.rmtree(runs_root / "data", ignore_errors=True)
    return row


def run_all(plans: Path, steps: int | None, timeout_s: float, budget_s: float, runs_root: Path,
            done: dict[int, dict] | None = None, after_each=None, train_args: tuple[str, ...] = ()) -> list[dict]:
    """Run the plans' draws in order within ``budget_s``; ``after_each(rows)`` is called after each draw that
    ran (the caller writes a partial result: a lease can end before the last draw)."""
    manifest = json.loads((plans / "manifest.json").read_text())
    t_end = time.perf_counter() + budget_s
    rows = []
    for m in manifest["rows"]:
        if done and m["seed"] in done:  # measured by an earlier call (one lease runs out): carried over as it was
            rows.append(done[m["seed"]])
            continue
        row = dict(m)
        if not m.get("plan"):
            rows.append(row | {"skipped": "no plan"})
            continue
        if time.perf_counter() + 30 > t_end:
            rows.append(row | {"skipped": "budget"})
            continue
        limit = min(timeout_s, t_end - time.perf_counter())
        row |= run_one(plans / m["plan"], runs_root, f"draw-{m['seed']}", steps, limit, train_args)
        if row.get("exit") == "timeout" and limit < timeout_s:  # stopped by the lease's budget, not by its own timeout
            row["exit"] = "budget"
        if "measured_step_p50_s" in row:
            row["step_error"] = row["predicted_step_s"] / row["measured_step_p50_s"] - 1
        print(f"seed {m['seed']}: exit {row['exit']} in {row['wall_s']} s" + (
            f", measured {row['measured_step_p50_s'] * 1e3:.1f} ms (predicted {row['predicted_step_s'] * 1e3:.1f}), "
            f"MFU {row['measured_mfu']:.1%}; {row['where']}" if "measured_step_p50_s" in row else ""), flush=True)
        rows.append(row)
        if after_each is not None:
            after_each(rows)
    return rows


def summarize(rows: list[dict]) -> dict:
    ok = [r for r in rows if "measured_step_p50_s" in r]
    errs = [abs(r["step_error"]) for r in ok]
    mfus = [r["measured_mfu"] for r in ok]
    return {"draws": len(rows), "ran": len(ok), "failed": sum(1 for r in rows if r.get("exit") not in (None, 0, "budget")),
            "cut_by_budget": sum(1 for r in rows if r.get("exit") == "budget" or r.get("skipped") == "budget"),
            "median_abs_step_error": statistics.median(errs) if errs else None, "max_abs_step_error": max(errs) if errs else None,
            "median_local_mfu": statistics.median(mfus) if mfus else None, "min_local_mfu": min(mfus) if mfus else None,
            "median_measured_over_predicted_by_class": _class_medians(ok)}


def _class_medians(rows: list[dict]) -> dict[str, float]:
    ratios: dict[str, list[float]] = {}
    for r in rows:
        for c, v in (r.get("device_by_class") or {}).items():
            if v.get("measured_over_predicted"):
                ratios.setdefault(c, []).append(v["measured_over_predicted"])
    return {c: statistics.median(v) for c, v in sorted(ratios.items())}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=10, help="draws (default 10)")
    ap.add_argument("--seed", type=int, default=None, help="first seed (default: the UTC date and time, YYYYMMDDHHMMSS)")
    ap.add_argument("--plans", type=Path, default=RESULTS / "fresh_plans")
    ap.add_argument("--plan-only", action="store_true", help="draw and plan, then stop (no GPU needed)")
    ap.add_argument("--topology", default=FAMILY,
                    help="topology the draws are planned for (default h200-1gpu; h100-1gpu where the GPU lent is an H100)")
    ap.add_argument("--steps", type=int, default=None, help="steps per run (default: coplan train's)")
    ap.add_argument("--run-timeout-s", type=float, default=240.0)
    ap.add_argument("--budget-s", type=float, default=540.0, help="wall-clock budget of the runs")
    ap.add_argument("--runs-root", type=Path, default=Path("runs/fresh"))
    ap.add_argument("--out", type=Path, default=RESULTS / "fresh_draws_h200.json")
    ap.add_argument("--train-args", default="",
                    help="extra coplan train switches, for a development variant (e.g. --train-args='--compile layers --cuda-graphs "
                         "on'): the result records them and is not the benchmark's figure, which is at defaults")
    ap.add_argument("--continue-from", type=Path, default=None,
                    help="an earlier result of the same plans: its measured draws are kept, the others run")
    a = ap.parse_args()
    if a.plan_only:
        seed = a.seed if a.seed is not None else int(dt.datetime.now(dt.timezone.utc).strftime("%Y%m%d%H%M%S"))
        print(f"seed {seed} (taken at run time)" if a.seed is None else f"seed {seed}", flush=True)
        make_plans(a.n, seed, a.plans, a.topology)
        return 0
    done, failed_before = None, {}
    if a.continue_from is not None:
        prev = json.loads(a.continue_from.read_text())
        # measured draws are kept; a draw that failed runs again (and its earlier failure is kept beside it)
        done = {r["seed"]: r for r in prev["rows"] if r.get("exit") == 0}
        failed_before = {r["seed"]: {"exit": r["exit"], "tail": r.get("tail", "")[-300:]} for r in prev["rows"]
                         if r.get("exit") not in (None, 0)}
    import torch  # the device's versions, recorded

    manifest = json.loads((a.plans / "manifest.json").read_text())

    def write(rows: list[dict], partial: bool) -> dict:
        for r in rows:
            if a.continue_from is not None and r["seed"] in failed_before:
                r["earlier_failure"] = failed_before[r["seed"]]
        result = {"benchmark": "fresh GEM-shaped draws on one H200: coplan plan -> coplan train at defaults",
                  "family": FAMILY, "topology": manifest.get("topology", FAMILY), "seed": manifest["seed"], "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                  "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else platform.processor(),
                  "torch": torch.__version__, "python": platform.python_version(), "git_commit": git_commit(),
                  "command": " ".join(sys.argv), "steps": a.steps, "summary": summarize(rows), "rows": rows}
        if train_args:
            result["train_args"] = list(train_args)
            result["variant"] = "not coplan train's defaults: a development variant, not the user's path"
        if partial:  # the draws not reached yet are listed by the final write only
            result["partial"] = f"{len(rows)} of {len(manifest['rows'])} draws so far"
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(result, indent=1))
        return result

    train_args = tuple(a.train_args.split())
    rows = run_all(a.plans, a.steps, a.run_timeout_s, a.budget_s, a.runs_root, done, after_each=lambda r: write(r, True),
                   train_args=train_args)
    print(json.dumps(write(rows, False)["summary"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
