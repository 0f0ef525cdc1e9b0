"""The dense arch of a plan's workload, forward + backward, as the one-GPU trainer runs it (fp32 masters cast
to bf16, CUDA graphs per bucket: :class:`coplan.trainer.graphs.DenseGraphs`), with its layers eager
(``--compile off``, the default) against compiled (``--compile layers --cuda-graphs on``).

Why: on one H200 the sampler's draws spend 45-50% of their GPU time in elementwise kernels (casts, residual
adds, norms, activations: ``fresh_draws_h200`` traces), which Inductor fuses. This measures what that buys on
the dense arch alone, with no TorchRec (the lookups are the same in both arms) and no torchrun, so that it runs
on a bare lent GPU.

Per mode, in a child process with its own time limit: ``--warmup`` steps (graph captures, compilation), then
``--steps`` timed steps (CUDA events around the dense forward + backward), each step's history lengths drawn
from the workload's length distribution (the same draws in both arms) at the plan's micro-batch size. Reported:
median step time, first-steps wall time (capture + compile), graph statistics, and the ratio against ``off``.

    python benchmarks/dense_graphs_ab.py --plans benchmarks/results/fresh_plans_c_ab --out $OUT/dense_graphs_ab.json
    python benchmarks/dense_graphs_ab.py --plans ... --device cpu --steps 2 --warmup 1 --max-batch 4   # smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import git_commit, wait_or_kill  # noqa: E402

MODES = {"off": "off", "layers": "layers"}


def _inputs(workload, lengths, seed, device):
    import numpy as np
    import torch

    from coplan.trainer.features import feature_layout

    g = torch.Generator().manual_seed(seed)
    lay = feature_layout(workload)
    b = len(lengths)
    widths = [f.table.dim for f in lay.pooled]
    pooled = torch.randn(b, sum(widths), generator=g).to(device).requires_grad_(True) if widths else None
    total = int(sum(lengths))
    seq = {t.name: torch.randn(total, t.dim, generator=g).to(device).requires_grad_(True)
           for s in lay.sequences for t in lay.sequence_tables[s]}
    offsets = {s: torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int64, device=device)
               for s in lay.sequences}
    dense = torch.randn(b, lay.num_dense, generator=g).to(device) if lay.num_dense else None
    return pooled, tuple(lay.pooled_names), widths, seq, offsets, dense


def worker(plan_path: Path, mode: str, steps: int, warmup: int, max_batch: int, device: str) -> dict:
    import numpy as np
    import torch

    from coplan.costmodel.jagged import length_pmf
    from coplan.spec import load_plan
    from coplan.trainer.distributed.compile import apply_compile
    from coplan.trainer.features import feature_layout
    from coplan.trainer.graphs import DenseGraphs
    from coplan.trainer.model.gem import DenseArch
    from coplan.trainer.model.moe import MoELayer

    plan = load_plan(plan_path)
    w = plan.workload
    dev = torch.device(device)
    batch = max(1, w.batch.local_batch_size // max(plan.mesh.micro_batches, 1))
    if max_batch:
        batch = min(batch, max_batch)
    torch.manual_seed(0)
    arch = DenseArch(w, feature_layout(w), "triton" if dev.type == "cuda" else "reference").to(dev)
    for m in arch.modules():
        if isinstance(m, MoELayer):
            m.grouped_mm = dev.type == "cuda"
    apply_compile(arch, mode)
    runner = DenseGraphs(arch, torch.bfloat16 if dev.type == "cuda" else torch.float32, dev)
    rng = np.random.default_rng(1234)
    pmfs = [length_pmf(s.length) for s in w.sequences]
    times, first = [], None
    t0 = time.perf_counter()
    for step in range(warmup + steps):
        lengths = (rng.choice(pmfs[0][0], size=batch, p=pmfs[0][1] / pmfs[0][1].sum()).tolist() if pmfs else [0] * batch)
        inp = _inputs(w, lengths, step, dev)
        if dev.type == "cuda":
            torch.cuda.synchronize()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
        s0 = time.perf_counter()
        runner.begin_step()
        out = runner(*inp, batch)
        out.float().sum().backward()
        if dev.type == "cuda":
            b.record()
            torch.cuda.synchronize()
            dt = a.elapsed_time(b) / 1e3
        else:
            dt = time.perf_counter() - s0
        if step == warmup - 1:
            first = time.perf_counter() - t0
        if step >= warmup:
            times.append(dt)
    st = runner.stats
    return {"mode": mode, "batch": batch, "step_s_median": statistics.median(times), "step_s_min": min(times),
            "steps": len(times), "warmup_wall_s": first, "captured": st.captured, "replayed": st.replayed,
            "eager": st.eager, "graphs_disabled": st.disabled,
            "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if dev.type == "cuda" else None}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--plans", type=Path, required=True, help="a plan set (manifest.json + plans), e.g. fresh_plans_c_ab")
    ap.add_argument("--modes", default="off,layers")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--max-batch", type=int, default=0, help="cap on samples per step (0: the plan's micro-batch)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--case-timeout", type=float, default=150.0)
    ap.add_argument("--budget-s", type=float, default=400.0)
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "dense_graphs_ab.json")
    ap.add_argument("--worker", nargs=2, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        print("RESULT " + json.dumps(worker(Path(a.worker[0]), a.worker[1], a.steps, a.warmup, a.max_batch, a.device)), flush=True)
        return 0
    import torch

    manifest = json.loads((a.plans / "manifest.json").read_text())
    t_end = time.perf_counter() + a.budget_s
    rows = []
    result = {"benchmark": "dense arch forward+backward under CUDA graphs, layers eager vs compiled (no TorchRec)",
              "plans": str(a.plans), "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else platform.processor(),
              "torch": torch.__version__, "python": platform.python_version(), "git_commit": git_commit(),
              "command": " ".join(sys.argv), "rows": rows}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    for m in manifest["rows"]:
        if not m.get("plan"):
            continue
        row = {"seed": m["seed"], "plan": m["plan"], "modes": {}}
        rows.append(row)
        for mode in a.modes.split(","):
            left = t_end - time.perf_counter()
            if left < 20:
                row["modes"][mode] = {"skipped": "budget"}
                continue
            cmd = [sys.executable, __file__, "--plans", str(a.plans), "--worker", str(a.plans / m["plan"]), mode,
                   "--steps", str(a.steps), "--warmup", str(a.warmup), "--max-batch", str(a.max_batch), "--device", a.device]
            t0 = time.perf_counter()
            p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                                 env=os.environ.copy())
            rc = wait_or_kill(p, min(a.case_timeout, left))
            text = p.stdout.read() if p.stdout else ""
            res = next((json.loads(line[7:]) for line in text.splitlines() if line.startswith("RESULT ")), None)
            row["modes"][mode] = res if res is not None else {"exit": rc, "tail": text[-1500:]}
            row["modes"][mode]["wall_s"] = round(time.perf_counter() - t0, 1)
        base = row["modes"].get("off", {}).get("step_s_median")
        for mode, r in row["modes"].items():
            if base and r.get("step_s_median"):
                r["speedup_vs_off"] = base / r["step_s_median"]
        print(f"seed {m['seed']}: " + "; ".join(
            f"{k} {v['step_s_median'] * 1e3:.2f} ms" + (f" ({v['speedup_vs_off']:.2f}x)" if "speedup_vs_off" in v else "")
            + f" [captured {v['captured']}, eager {v['eager']}, first {v['warmup_wall_s']:.0f} s]"
            if "step_s_median" in v else f"{k} {v.get('exit', v.get('skipped'))}" for k, v in row["modes"].items()), flush=True)
        a.out.write_text(json.dumps(result, indent=1))  # after each draw: a lease can end before the last
    a.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
