"""A Kunlun layer forward + backward on the GPU, its GDPA two ways: the dense form (batched matmuls around the
activation over ``[B, H, N, d]`` copies of the projections, the q, k and v gradients gathered back) and the jagged
Triton kernel over equal-length segments read from the projections' own layout (what ``KunlunLayer`` runs with the
``triton`` backend since this benchmark; :func:`coplan.trainer.model.layers.kunlun_jagged_applies`).

Shapes: the Kunlun block of ``gem-h200`` and of sampler draws of the ``h200-1gpu`` family (``--seeds``; draws whose
Kunlun attention is GDPA), at the workload's local batch and token count, bf16. Times by ``triton.testing.do_bench``
(median, L2 flushed); the two outputs and input gradients compared (max abs difference over the dense form's max).
On a machine without CUDA it says so and exits 0 without writing anything.

    python benchmarks/kunlun_attention.py --seeds 0,1,2,3,4,5 --out benchmarks/results/kunlun_attention.json
"""

from __future__ import annotations

import argparse
import copy
import platform
import statistics
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _common import write_result  # noqa: E402


def cases(seeds: list[int]) -> list[dict]:
    from coplan.costmodel.flops import kunlun_tokens
    from coplan.sample import sample_workload
    from coplan.spec import load_workload
    from coplan.spec.workload import KunlunBlock

    out = []
    for name, w in [("gem-h200", load_workload("gem-h200"))] + [(f"draw seed {s}", sample_workload("h200-1gpu", s)) for s in seeds]:
        b = next((x for x in w.blocks if isinstance(x, KunlunBlock)), None)
        if b is None or b.attention.kind != "gdpa":
            continue
        out.append(dict(case=name, block=b, batch=w.batch.local_batch_size, tokens=kunlun_tokens(w, b)))
    return out


def run(case: dict) -> dict:
    import triton.testing

    from coplan.trainer.model.layers import KunlunLayer

    b, t, blk = case["batch"], case["tokens"], case["block"]
    torch.manual_seed(0)
    dense = KunlunLayer("kunlun.0", blk, t, backend="reference").to("cuda", torch.bfloat16)
    jagged = KunlunLayer("kunlun.0", blk, t, backend="triton").to("cuda", torch.bfloat16)
    jagged.load_state_dict(copy.deepcopy(dense.state_dict()))
    z = torch.randn(b, t, blk.model_dim, device="cuda", dtype=torch.bfloat16)
    g = torch.randn_like(z)

    def step(layer):
        x = z.detach().requires_grad_()
        out = layer(x)
        out.backward(g)
        return out, x.grad

    row = dict(case=case["case"], batch=b, tokens=t, model_dim=blk.model_dim, heads=blk.num_heads,
               head_dim=blk.head_dim, activation=blk.attention.activation, causal=blk.attention.causal)
    (o_d, g_d), (o_j, g_j) = step(dense), step(jagged)
    row["out_max_abs_diff_rel"] = float((o_d.float() - o_j.float()).abs().max() / o_d.float().abs().max())
    row["grad_max_abs_diff_rel"] = float((g_d.float() - g_j.float()).abs().max() / g_d.float().abs().max())
    for name, layer in (("dense", dense), ("jagged", jagged)):
        row[f"{name}_ms"] = triton.testing.do_bench(lambda layer=layer: step(layer), warmup=50, rep=200)
    row["speedup"] = row["dense_ms"] / row["jagged_ms"]
    print(f"{row['case']}: B={b} N={t} d={blk.model_dim} H={blk.num_heads}x{blk.head_dim}: dense {row['dense_ms']:.3f} ms, "
          f"jagged {row['jagged_ms']:.3f} ms ({row['speedup']:.2f}x)", flush=True)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", default="0,1,2,3,4,5", help="sampler draws of the h200-1gpu family")
    ap.add_argument("--out", type=Path, default=HERE / "results" / "kunlun_attention.json")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("kunlun_attention: no CUDA device; nothing measured")
        return 0
    rows = [run(c) for c in cases([int(s) for s in a.seeds.split(",") if s])]
    summary = {"cases": len(rows), "median_speedup": statistics.median(r["speedup"] for r in rows) if rows else None,
               "min_speedup": min((r["speedup"] for r in rows), default=None),
               "max_grad_diff_rel": max((r["grad_max_abs_diff_rel"] for r in rows), default=None)}
    import triton

    write_result(a.out, "Kunlun layer fwd+bwd: GDPA dense (batched matmuls) vs the jagged Triton kernel",
                 torch.cuda.get_device_name(), summary, rows,
                 versions={"torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version()})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
