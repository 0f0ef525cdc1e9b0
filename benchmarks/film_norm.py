"""The InterFormer layer's FiLM LayerNorm, fused (``coplan.kernels.film_norm``) against the PyTorch expression the
layer ran before (per-sample ``γ, β`` gathered to the tokens, ``F.layer_norm``, ``addcmul``; the gathers'
backward as the trainer runs it on CUDA: one-hot GEMM segment sums), forward + backward, on the GPU.

Shapes: the first InterFormer block of sampler draws (family ``h200-1gpu``; tokens = local batch x the
history's mean length) and ``gem-h200``. Times by ``triton.testing.do_bench`` (median; L2 flushed between
runs); errors of both against an fp32 autograd reference on the same inputs. On a machine without CUDA it says
so and exits 0 without writing anything.

    python benchmarks/film_norm.py --seeds 0,1,2,3 --out benchmarks/results/film_norm.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import statistics
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _common import git_commit  # noqa: E402


def shapes(seeds: list[int]) -> list[dict]:
    from coplan.costmodel.jagged import length_moments
    from coplan.sample import sample_workload
    from coplan.spec import load_workload
    from coplan.spec.workload import InterFormerBlock

    out = []
    for name, w in [("gem-h200", load_workload("gem-h200"))] + [(f"draw seed {s}", sample_workload("h200-1gpu", s)) for s in seeds]:
        b = next((x for x in w.blocks if isinstance(x, InterFormerBlock)), None)
        if b is None:
            continue
        length = w.sequence(b.sequence).length
        out.append(dict(case=name, batch=w.batch.local_batch_size, mean_len=length_moments(length).mean,
                        max_len=length.max_len, d=b.model_dim, layers=b.num_layers))
    return out


def inputs(case: dict, dtype, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    B, d = case["batch"], case["d"]
    mean, cap = case["mean_len"], case["max_len"]
    lengths = torch.clamp(torch.poisson(torch.full((B,), float(mean), device="cuda"), generator=g), 0, cap).long()
    T = int(lengths.sum())
    offsets = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])
    h = torch.randn(T, d, device="cuda", generator=g).to(dtype).requires_grad_()
    ln = torch.nn.LayerNorm(d, device="cuda", dtype=dtype)
    gb = (torch.randn(B, 2 * d, device="cuda", generator=g) * 0.3).to(dtype).requires_grad_()
    dz = torch.randn(T, d, device="cuda", generator=g).to(dtype)
    return h, ln, gb, offsets, dz, T


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", default="0,1,2,3,4,5")
    ap.add_argument("--out", type=Path, default=HERE / "results" / "film_norm.json")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("film_norm: needs a CUDA GPU; nothing written")
        return 0
    import triton

    from coplan.kernels.film_norm import film_layer_norm
    from coplan.trainer.model import layers as L

    L.enable_segment_sum_gemm(L.segment_sum_gemm_works(torch.device("cuda"), torch.bfloat16))
    dtype = torch.bfloat16
    rows = []
    for case in shapes([int(s) for s in a.seeds.split(",") if s]):
        h, ln, gb, offsets, dz, T = inputs(case, dtype)
        seg = L.segment_ids(offsets, T)

        def pytorch():
            gamma, beta = gb.chunk(2, dim=-1)
            return torch.addcmul(L.expand_segments(beta, seg, offsets), ln(h), L.expand_segments(1.0 + gamma, seg, offsets))

        def fused():
            gamma, beta = gb.chunk(2, dim=-1)
            return film_layer_norm(h, ln.weight, ln.bias, gamma, beta, seg, ln.eps)

        def fwd_bwd(fn):
            out = fn()
            return torch.autograd.grad(out, (h, ln.weight, ln.bias, gb), dz)

        ref_in = [t.detach().float().requires_grad_() for t in (h, ln.weight, ln.bias, gb)]
        rg, rb = ref_in[3].chunk(2, dim=-1)
        ref_out = torch.nn.functional.layer_norm(ref_in[0], (case["d"],), ref_in[1], ref_in[2], ln.eps) * (1 + rg[seg]) + rb[seg]
        ref = (ref_out, *torch.autograd.grad(ref_out, ref_in, dz.float()))
        row = dict(case, tokens=T)
        for name, fn in (("pytorch", pytorch), ("fused", fused)):
            with torch.no_grad():
                fwd_ms = triton.testing.do_bench(fn, warmup=10, rep=60)
            both_ms = triton.testing.do_bench(lambda: fwd_bwd(fn), warmup=10, rep=60)
            got = (fn(), *fwd_bwd(fn))
            err = {k: float(((x.float() - r).abs().max() / r.abs().max().clamp_min(1e-6)))
                   for k, x, r in zip(("out", "dh", "dweight", "dbias", "dgamma_beta"), got, ref)}
            row[name] = dict(fwd_ms=fwd_ms, fwd_bwd_ms=both_ms, max_rel_error=err)
        row["speedup_fwd"] = row["pytorch"]["fwd_ms"] / row["fused"]["fwd_ms"]
        row["speedup_fwd_bwd"] = row["pytorch"]["fwd_bwd_ms"] / row["fused"]["fwd_bwd_ms"]
        bytes_fused = 2 * T * case["d"] * 2 + 3 * T * case["d"] * 2  # fwd: h, out; bwd: dz, h, dh (bf16)
        row["fused_hbm_gbps_fwd_bwd"] = bytes_fused / (row["fused"]["fwd_bwd_ms"] * 1e-3) / 1e9
        rows.append(row)
        print(f"{case['case']}: T={T} d={case['d']}: pytorch {row['pytorch']['fwd_bwd_ms']:.3f} ms, fused "
              f"{row['fused']['fwd_bwd_ms']:.3f} ms fwd+bwd ({row['speedup_fwd_bwd']:.2f}x; fwd {row['speedup_fwd']:.2f}x); "
              f"errors fused {max(row['fused']['max_rel_error'].values()):.2e}, pytorch {max(row['pytorch']['max_rel_error'].values()):.2e}",
              flush=True)
    result = dict(benchmark="fused FiLM LayerNorm vs the PyTorch expression, forward + backward (bf16)",
                  device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                  python=platform.python_version(), git_commit=git_commit(),
                  date=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), command=" ".join(sys.argv),
                  summary=dict(cases=len(rows), median_speedup_fwd_bwd=statistics.median(r["speedup_fwd_bwd"] for r in rows),
                               min_speedup_fwd_bwd=min(r["speedup_fwd_bwd"] for r in rows),
                               median_speedup_fwd=statistics.median(r["speedup_fwd"] for r in rows)),
                  rows=rows)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result["summary"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
