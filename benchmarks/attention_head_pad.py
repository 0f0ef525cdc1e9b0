"""Jagged attention at head dims that are not a power of two: the kernels' masked columns (what the trainer runs
since 2026-12-06) against the padded copies around the same kernels (what it ran before), forward + backward.

Shapes: the InterFormer blocks of one-H200 sampler draws whose head dim is not a power of two (tokens = local
batch x the history's mean length, lengths Poisson around the mean, capped; causal self-attention with the
block's activation), plus fixed cases at head dims 40, 96 and 192. q, k and v are views of one packed
``[T, 3, H, d]`` projection, as the layer passes them. ``copies`` pads q, k and v to the tiles' width with
``F.pad`` and slices the output (autograd pads the gradient and slices dq, dk, dv back): the copies the launchers
made before. Times by ``triton.testing.do_bench`` (median); errors of both against an fp32 per-call reference on
the same inputs. On a machine without CUDA it says so and exits 0 without writing anything.

    python benchmarks/attention_head_pad.py --seeds 0,1,2,3,4,5,6,7,8,9 --out benchmarks/results/attention_head_pad.json
"""

from __future__ import annotations

import argparse
import math
import platform
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _common import write_result  # noqa: E402

FIXED = [dict(case="fixed d=40", batch=128, mean_len=256.0, max_len=1024, heads=8, head_dim=40, kind="silu"),
         dict(case="fixed d=96", batch=128, mean_len=256.0, max_len=1024, heads=8, head_dim=96, kind="silu"),
         dict(case="fixed d=192 softmax", batch=64, mean_len=512.0, max_len=2048, heads=4, head_dim=192, kind="softmax")]


def shapes(seeds: list[int]) -> list[dict]:
    from coplan.costmodel.jagged import length_moments
    from coplan.sample import sample_workload
    from coplan.spec.workload import InterFormerBlock

    out = []
    for s in seeds:
        w = sample_workload("h200-1gpu", s)
        for b in w.blocks:
            if isinstance(b, InterFormerBlock) and b.head_dim & (b.head_dim - 1):
                length = w.sequence(b.sequence).length
                out.append(dict(case=f"draw seed {s} {b.name}", batch=w.batch.local_batch_size,
                                mean_len=length_moments(length).mean, max_len=length.max_len, heads=b.num_heads,
                                head_dim=b.head_dim,
                                kind="softmax" if b.attention.kind == "softmax" else b.attention.activation))
    return out + FIXED


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", default="0,1,2,3,4,5,6,7,8,9")
    ap.add_argument("--out", type=Path, default=HERE / "results" / "attention_head_pad.json")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("attention_head_pad: needs a CUDA GPU; nothing written")
        return 0
    import triton

    from coplan.kernels import gdpa, jagged_attention
    from coplan.kernels import triton_attention as ta

    rows = []
    for case in shapes([int(s) for s in a.seeds.split(",") if s]):
        g = torch.Generator(device="cuda").manual_seed(0)
        B, H, d, cap = case["batch"], case["heads"], case["head_dim"], case["max_len"]
        lengths = torch.clamp(torch.poisson(torch.full((B,), float(case["mean_len"]), device="cuda"), generator=g), 1, cap).long()
        T = int(lengths.sum())
        offsets = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)]).to(torch.int32)
        max_len = int(lengths.max())
        qkv = (torch.randn(T, 3, H, d, device="cuda", generator=g) * 0.5).to(torch.bfloat16).requires_grad_()
        do = torch.randn(T, H, d, device="cuda", generator=g).to(torch.bfloat16)
        scale = 1.0 / math.sqrt(d)
        p = ta._head_dim_padded(d)

        def attn(q, k, v):
            if case["kind"] == "softmax":
                return jagged_attention(q, k, v, offsets, causal=True, max_len=max_len, scale=scale, backend="triton")
            return gdpa(q, k, v, offsets, activation=case["kind"], causal=True, max_len=max_len, scale=scale,
                        backend="triton")

        def masked():
            q, k, v = qkv.unbind(1)
            return attn(q, k, v)

        def copies():
            q, k, v = (F.pad(x, (0, p - d)) for x in qkv.unbind(1))
            return attn(q, k, v)[..., :d]

        def fwd_bwd(fn):
            return torch.autograd.grad(fn(), (qkv,), do)[0]

        ref_in = qkv.detach().float().requires_grad_()
        rq, rk, rv = ref_in.unbind(1)
        if case["kind"] == "softmax":
            ref_out = jagged_attention(rq, rk, rv, offsets, causal=True, max_len=max_len, scale=scale, backend="reference")
        else:
            ref_out = gdpa(rq, rk, rv, offsets, activation=case["kind"], causal=True, max_len=max_len, scale=scale,
                           backend="reference")
        ref = (ref_out, torch.autograd.grad(ref_out, (ref_in,), do.float())[0])
        row = dict(case, tokens=T, tile_head_dim=p)
        for name, fn in (("copies", copies), ("masked", masked)):
            with torch.no_grad():
                fwd_ms = triton.testing.do_bench(fn, warmup=10, rep=50)
            both_ms = triton.testing.do_bench(lambda: fwd_bwd(fn), warmup=10, rep=50)
            got = (fn(), fwd_bwd(fn))
            err = {k: float((x.detach().float() - r.detach()).abs().max() / r.abs().max().clamp_min(1e-6)) for k, x, r in zip(("out", "dqkv"), got, ref)}
            row[name] = dict(fwd_ms=fwd_ms, fwd_bwd_ms=both_ms, max_rel_error=err)
        row["speedup_fwd"] = row["copies"]["fwd_ms"] / row["masked"]["fwd_ms"]
        row["speedup_fwd_bwd"] = row["copies"]["fwd_bwd_ms"] / row["masked"]["fwd_bwd_ms"]
        rows.append(row)
        _write(a.out, rows)  # after every case: a cut run keeps what it measured
        print(f"{case['case']}: T={T} H={H} d={d} ({case['kind']}): copies {row['copies']['fwd_bwd_ms']:.3f} ms, masked "
              f"{row['masked']['fwd_bwd_ms']:.3f} ms fwd+bwd ({row['speedup_fwd_bwd']:.2f}x; fwd {row['speedup_fwd']:.2f}x); "
              f"errors masked {max(row['masked']['max_rel_error'].values()):.2e}, "
              f"copies {max(row['copies']['max_rel_error'].values()):.2e}", flush=True)
    return 0


def _write(out: Path, rows: list[dict]) -> None:
    import triton

    summary = dict(cases=len(rows), median_speedup_fwd_bwd=statistics.median(r["speedup_fwd_bwd"] for r in rows),
                   min_speedup_fwd_bwd=min(r["speedup_fwd_bwd"] for r in rows),
                   max_speedup_fwd_bwd=max(r["speedup_fwd_bwd"] for r in rows),
                   median_speedup_fwd=statistics.median(r["speedup_fwd"] for r in rows))
    out.parent.mkdir(parents=True, exist_ok=True)
    write_result(out, "jagged attention at head dims not a power of two: masked columns vs padded copies (bf16, fwd+bwd)",
                 torch.cuda.get_device_name(), summary, rows, torch=torch.__version__, triton=triton.__version__,
                 python=platform.python_version())


if __name__ == "__main__":
    sys.exit(main())
