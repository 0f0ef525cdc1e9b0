"""coplan's predictions against published end-to-end training measurements of public systems on H100/H200-class
GPUs (issue 23): each published run expressed as a topology + workload + the parallel layout it used (pinned),
planned with ``coplan plan`` at its defaults otherwise, and its predicted throughput compared with the published
one. Misses are reported as they come; nothing is fitted to these figures.

Published runs (sources in ``benchmarks/published/README.md``):

- torchtitan, Llama 3.1 8B, FSDP over 8 and over 128 H100 SXM 96 GB (Grand Teton, 500 W), local batch 2,
  8,192 tokens, selective activation checkpointing, bf16, no torch.compile: 5,762 and 5,605 tokens/s per GPU.
- NVIDIA NeMo 24.07 performance summary, Llama 2 7B on 8 DGX H100 GPUs (80 GB), FP8, global batch 128,
  micro-batch 1, 4,096 tokens, TP 1 PP 1 (data parallel; expressed as FSDP over 8, see the case): 16,634 tokens/s per GPU.

    python benchmarks/published_checks.py

Writes ``benchmarks/results/published_checks.json``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import git_commit  # noqa: E402

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
PUB = HERE / "published"
ROOT = HERE.parent

CASES = [
    {"id": "torchtitan-llama31-8b-fsdp8", "source": "torchtitan benchmarks/llama3_h100_202412_torchtitan.md, Table 1 (FSDP row)",
     "topology": PUB / "h100-grandteton-128.yaml", "gpus": 8, "workload": ROOT / "workloads/dense-decoder-8b.yaml",
     "seq": 8192, "global_batch": 16, "pins": ["dp_shard=8", "dp_replicate=1", "micro_batches=1"],
     "published_tokens_per_s_per_gpu": 5762.0,
     "layout": "FSDP2 over 8 GPUs, local batch 2, selective AC, bf16, eager"},
    {"id": "torchtitan-llama31-8b-fsdp128", "source": "torchtitan benchmarks/llama3_h100_202412_torchtitan.md, Table 3 (FSDP row)",
     "topology": PUB / "h100-grandteton-128.yaml", "gpus": 128, "workload": ROOT / "workloads/dense-decoder-8b.yaml",
     "seq": 8192, "global_batch": 256, "pins": ["dp_shard=128", "dp_replicate=1", "micro_batches=1"],
     "published_tokens_per_s_per_gpu": 5605.0,
     "layout": "FSDP2 over 128 GPUs, local batch 2, selective AC, bf16, eager"},
    {"id": "nemo-llama2-7b-dp8-fp8", "source": "NVIDIA NeMo docs/source/performance/performance_summary.md (24.07), LLAMA2-7B row",
     "topology": PUB / "dgx-h100-8.yaml", "gpus": 8, "workload": PUB / "llama2-7b.yaml",
     "seq": 4096, "global_batch": 128, "pins": ["dp_shard=8", "dp_replicate=1", "micro_batches=16"],
     "published_tokens_per_s_per_gpu": 16634.0,
     "layout": "data parallel over 8 GPUs (Megatron's distributed optimizer), micro-batch 1 x 16, FP8 (Transformer Engine), "
               "TP 1 PP 1; expressed as FSDP over 8 (coplan has no ZeRO-1 layout: replicated fp32 weights with the "
               "optimizer state replicated too do not fit 80 GB)"},
]


def run_case(c: dict, tmp: Path) -> dict:
    w = yaml.safe_load(Path(c["workload"]).read_text())
    w["name"] = c["id"]
    w["batch"] = {"global_batch_size": c["global_batch"], "micro_batches": "auto"}
    wp, pp = tmp / f"{c['id']}.yaml", tmp / f"{c['id']}.plan.json"
    wp.write_text(yaml.safe_dump(w))
    cmd = [sys.executable, "-m", "coplan.cli", "plan", "-t", str(c["topology"]), "-w", str(wp), "--gpus", str(c["gpus"]),
           "-o", str(pp), "--quiet"]
    for pin in c["pins"]:
        cmd += ["--pin", pin]
    r = subprocess.run(cmd, capture_output=True, text=True)
    row = {k: (str(v.relative_to(ROOT)) if isinstance(v, Path) else v) for k, v in c.items()}
    row["command"] = " ".join(["coplan", *cmd[3:]]).replace(str(tmp), "<tmp>")
    if r.returncode != 0:
        row["error"] = (r.stderr or r.stdout)[-800:]
        return row
    p = json.loads(pp.read_text())
    pred = p["predicted"]
    step = pred["step_time_s"]
    tps = c["global_batch"] * c["seq"] / step / c["gpus"]
    row |= {"predicted_step_s": step, "predicted_tokens_per_s_per_gpu": tps, "predicted_local_mfu": pred["local_mfu"],
            "predicted_e2e_mfu": pred.get("e2e_mfu"),
            "ratio_predicted_over_published": tps / c["published_tokens_per_s_per_gpu"],
            "within_20pct": abs(tps / c["published_tokens_per_s_per_gpu"] - 1) <= 0.20,
            "recomputed_layers": sum(1 for lp in p["layers"] if lp.get("recompute")),
            "fp8_layers": sum(1 for lp in p["layers"] if lp.get("precision") == "fp8"),
            "calibration": ((p.get("calibration") or {}).get("notes") or "none: default efficiencies (uncalibrated)")[-240:]}
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=RESULTS / "published_checks.json")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as t:
        rows = [run_case(c, Path(t)) for c in CASES]
    for r in rows:
        if "error" in r:
            print(f"{r['id']}: plan failed: {r['error'][-300:]}")
        else:
            print(f"{r['id']}: predicted {r['predicted_tokens_per_s_per_gpu']:,.0f} tokens/s/GPU, published "
                  f"{r['published_tokens_per_s_per_gpu']:,.0f} ({r['ratio_predicted_over_published']:.2f}x), "
                  f"local MFU {r['predicted_local_mfu']:.1%}")
    ok = [r for r in rows if "error" not in r]
    result = {"benchmark": "predictions against published training throughputs (H100-class GPUs)",
              "device": f"prediction (CPU, {platform.processor() or 'x86_64'})", "python": platform.python_version(),
              "git_commit": git_commit(), "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
              "command": " ".join(sys.argv),
              "summary": {"cases": len(rows), "planned": len(ok), "within_20pct": sum(1 for r in ok if r["within_20pct"]),
                          "worst_ratio": max((max(r["ratio_predicted_over_published"], 1 / r["ratio_predicted_over_published"])
                                              for r in ok), default=None)},
              "rows": rows}
    args_out = a.out
    args_out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result["summary"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
