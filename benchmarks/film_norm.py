"""The InterFormer layer's FiLM LayerNorm, fused (``coplan.kernels.film_norm``) against the PyTorch expression the
layer ran before (per-sample ``γ, β`` gathered to the tokens, ``F.layer_norm``, ``addcmul``; the gathers'
backward as the trainer runs it on CUDA: one-hot GEMM segment sums), forward + backward, on the GPU; and the same
kernels without FiLM (``layer_norm``) against ``torch.nn.functional.layer_norm``.

Shapes: the first InterFormer block of sampler draws (family ``h200-1gpu``; tokens = local batch x the
history's mean length) and ``gem-h200``. Times by ``triton.testing.do_bench`` (median; L2 flushed between
runs); errors of both against an fp32 autograd reference on the same inputs. The backward kernel alone is timed
from the CUDA profiler's kernel records (mean over calls) and reported as achieved bandwidth: the bytes it must
move (read ``dz``, ``h``, ``mean``, ``rstd``, ``seg``; write ``dh`` and the ``[programs, D]`` fp32 partials of
``dw, db``) over its time. On a machine without CUDA it says so and exits 0 without writing anything.

    python benchmarks/film_norm.py --seeds 0,1,2,3 --out benchmarks/results/film_norm.json

``--bwd-sweep`` also times the FiLM backward kernel at other step sizes (``BWD_ELEMENTS_PER_THREAD``) and
programs per SM (``BWD_PROGRAMS_PER_SM``; 0: as many as fit at once); ``--baseline-module M`` times ``M.film_layer_norm`` too (an earlier version of the
kernels, importable as ``M``) as ``fused_baseline``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib
import json
import platform
import statistics
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _common import git_commit  # noqa: E402

BWD_KERNEL = "_film_ln_bwd_kernel"
FWD_KERNEL = "_film_ln_fwd_kernel"


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


def kernel_ms(fn, names: tuple[str, ...], calls: int = 20) -> dict[str, float]:
    """Mean device time per call of ``fn`` spent in kernels whose name contains each of ``names``, and under
    ``"all"`` in every kernel, memset and copy it ran (CUDA profiler): the GPU's busy time, which the host's
    launch overhead (that ``do_bench``'s wall times include when the GPU waits for it) does not enter."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    total = dict.fromkeys((*names, "all"), 0.0)
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None)
        if t is None:
            t = getattr(e, "cuda_time_total", 0.0)
        if getattr(e, "device_type", None) == DeviceType.CUDA:
            total["all"] += t
        for n in names:
            if n in e.key:
                total[n] += t
    return {n: us / calls / 1e3 for n, us in total.items()}


def ratio(a, b):
    """a / b, or None where either is missing or zero (a measurement that did not come out)."""
    return a / b if a and b else None


def median_of(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def last_bwd_launch(FN, fn) -> dict:
    """The backward kernel's launch in ``fn()`` (grid, warps, constexprs), as ``launch_kernel`` saw it."""
    seen = []
    real = FN.launch_kernel

    def spy(kernel, grid, args, consts, num_warps):
        if kernel is FN._film_ln_bwd_kernel:
            seen.append(dict(programs=grid[0], rows_per_program=args[15], num_warps=num_warps, **consts))
        return real(kernel, grid, args, consts, num_warps)

    FN.launch_kernel = spy
    try:
        fn()
    finally:
        FN.launch_kernel = real
    return seen[-1] if seen else {}


def bwd_bytes(T: int, d: int, elt: int, programs: int, seg_bytes: int = 8) -> int:
    """What the backward kernel must move: dz, h read and dh written ([T, d] at elt bytes), mean and rstd (fp32) and
    seg per row read, the fp32 partials of dw, db ([programs, d] each) written."""
    return 3 * T * d * elt + T * (8 + seg_bytes) + 2 * programs * d * 4


def compiled_resources(jit_fn) -> list[dict]:
    """Registers and spills of each compiled specialisation of a Triton kernel (what Triton's cache exposes)."""
    out = []
    for cache in getattr(jit_fn, "device_caches", {}).values():
        kernels = cache[0] if isinstance(cache, tuple) else cache
        for ck in getattr(kernels, "values", lambda: [])():
            try:
                ck._init_handles()
                consts = {k: v for k, v in getattr(ck.src, "constants", {}).items() if not isinstance(k, tuple)}
                out.append(dict(n_regs=ck.n_regs, n_spills=ck.n_spills, num_warps=ck.metadata.num_warps,
                                shared=ck.metadata.shared, constants=str(consts or getattr(ck.src, "constants", ""))))
            except Exception as e:  # noqa: BLE001  (the attributes moved between Triton versions: say so, carry on)
                out.append(dict(error=repr(e)))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", default="0,1,2,3,4,5")
    ap.add_argument("--out", type=Path, default=HERE / "results" / "film_norm.json")
    ap.add_argument("--bwd-sweep", action="store_true", help="also time the FiLM backward kernel at other "
                    "BWD_ELEMENTS_PER_THREAD and BWD_PROGRAMS_PER_SM settings")
    ap.add_argument("--baseline-module", default=None, help="a module with film_layer_norm to time as fused_baseline")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("film_norm: needs a CUDA GPU; nothing written")
        return 0
    import triton

    from coplan.kernels import film_norm as FN
    from coplan.kernels.film_norm import film_layer_norm, layer_norm
    from coplan.trainer.model import layers as L

    baseline = importlib.import_module(a.baseline_module) if a.baseline_module else None
    L.enable_segment_sum_gemm(L.segment_sum_gemm_works(torch.device("cuda"), torch.bfloat16))
    dtype = torch.bfloat16
    elt = torch.finfo(dtype).bits // 8
    rows = []
    for case in shapes([int(s) for s in a.seeds.split(",") if s]):
        h, ln, gb, offsets, dz, T = inputs(case, dtype)
        d = case["d"]
        seg = L.segment_ids(offsets, T)

        def pytorch():
            gamma, beta = gb.chunk(2, dim=-1)
            return torch.addcmul(L.expand_segments(beta, seg, offsets), ln(h), L.expand_segments(1.0 + gamma, seg, offsets))

        def fused():
            gamma, beta = gb.chunk(2, dim=-1)
            return film_layer_norm(h, ln.weight, ln.bias, gamma, beta, seg, ln.eps, validate=False)  # as the trainer calls it

        def fused_baseline():
            gamma, beta = gb.chunk(2, dim=-1)
            return baseline.film_layer_norm(h, ln.weight, ln.bias, gamma, beta, seg, ln.eps)

        def fwd_bwd(fn, inputs=(h, ln.weight, ln.bias, gb)):
            out = fn()
            return torch.autograd.grad(out, inputs, dz)

        ref_in = [t.detach().float().requires_grad_() for t in (h, ln.weight, ln.bias, gb)]
        rg, rb = ref_in[3].chunk(2, dim=-1)
        ref_out = torch.nn.functional.layer_norm(ref_in[0], (d,), ref_in[1], ref_in[2], ln.eps) * (1 + rg[seg]) + rb[seg]
        ref = (ref_out.detach(), *torch.autograd.grad(ref_out, ref_in, dz.float()))
        row = dict(case, tokens=T)
        methods = [("pytorch", pytorch), ("fused", fused)] + ([("fused_baseline", fused_baseline)] if baseline else [])
        for name, fn in methods:
            with torch.no_grad():
                fwd_ms = triton.testing.do_bench(fn, warmup=10, rep=60)
            both_ms = triton.testing.do_bench(lambda: fwd_bwd(fn), warmup=10, rep=60)
            out = fn()
            bwd_ms = triton.testing.do_bench(lambda: torch.autograd.grad(out, (h, ln.weight, ln.bias, gb), dz,
                                                                         retain_graph=True), warmup=10, rep=60)
            got = (fn(), *fwd_bwd(fn))
            err = {k: float(((x.detach().float() - r).abs().max() / r.abs().max().clamp_min(1e-6)))
                   for k, x, r in zip(("out", "dh", "dweight", "dbias", "dgamma_beta"), got, ref)}
            row[name] = dict(fwd_ms=fwd_ms, fwd_bwd_ms=both_ms, bwd_ms=bwd_ms, max_rel_error=err)
            k = kernel_ms(lambda: fwd_bwd(fn), (FWD_KERNEL, BWD_KERNEL))
            row[name]["fwd_bwd_device_ms"] = k["all"] or None
            if name != "pytorch":
                row[name].update(fwd_kernel_ms=k[FWD_KERNEL], bwd_kernel_ms=k[BWD_KERNEL])
        row["speedup_fwd"] = row["pytorch"]["fwd_ms"] / row["fused"]["fwd_ms"]
        row["speedup_fwd_bwd"] = row["pytorch"]["fwd_bwd_ms"] / row["fused"]["fwd_bwd_ms"]
        bytes_fused = 2 * T * d * 2 + 3 * T * d * 2  # fwd: h, out; bwd: dz, h, dh (bf16)
        row["fused_hbm_gbps_fwd_bwd"] = bytes_fused / (row["fused"]["fwd_bwd_ms"] * 1e-3) / 1e9
        row["speedup_fwd_bwd_device"] = ratio(row["pytorch"]["fwd_bwd_device_ms"], row["fused"]["fwd_bwd_device_ms"])
        plan = last_bwd_launch(FN, lambda: fwd_bwd(fused))
        row["fused_bwd_plan"] = plan
        programs = plan.get("programs", 0)
        nbytes = bwd_bytes(T, d, elt, programs, seg.element_size())
        row["fused_bwd_kernel_bytes"] = nbytes
        row["fused_bwd_kernel_gbps"] = nbytes / (row["fused"]["bwd_kernel_ms"] * 1e-3) / 1e9
        row["fused_fwd_kernel_gbps"] = (2 * T * d * elt + 8 * T) / (row["fused"]["fwd_kernel_ms"] * 1e-3) / 1e9
        if baseline:
            row["speedup_bwd_kernel_vs_baseline"] = row["fused_baseline"]["bwd_kernel_ms"] / row["fused"]["bwd_kernel_ms"]

        # the same kernels without FiLM against torch.nn.functional.layer_norm
        ln_ref_out = torch.nn.functional.layer_norm(ref_in[0], (d,), ref_in[1], ref_in[2], ln.eps)
        ln_ref = (ln_ref_out.detach(), *torch.autograd.grad(ln_ref_out, ref_in[:3], dz.float()))
        row["layer_norm"] = {}
        for name, fn in (("torch", lambda: torch.nn.functional.layer_norm(h, (d,), ln.weight, ln.bias, ln.eps)),
                         ("ours", lambda: layer_norm(h, ln.weight, ln.bias, ln.eps))):
            with torch.no_grad():
                fwd_ms = triton.testing.do_bench(fn, warmup=10, rep=60)
            both_ms = triton.testing.do_bench(lambda: fwd_bwd(fn, (h, ln.weight, ln.bias)), warmup=10, rep=60)
            out = fn()
            bwd_ms = triton.testing.do_bench(lambda: torch.autograd.grad(out, (h, ln.weight, ln.bias), dz,
                                                                         retain_graph=True), warmup=10, rep=60)
            got = (fn(), *fwd_bwd(fn, (h, ln.weight, ln.bias)))
            err = {k: float(((x.detach().float() - r).abs().max() / r.abs().max().clamp_min(1e-6)))
                   for k, x, r in zip(("out", "dh", "dweight", "dbias"), got, ln_ref)}
            row["layer_norm"][name] = dict(fwd_ms=fwd_ms, fwd_bwd_ms=both_ms, bwd_ms=bwd_ms, max_rel_error=err)
        for name, fn in (("torch", lambda: torch.nn.functional.layer_norm(h, (d,), ln.weight, ln.bias, ln.eps)),
                         ("ours", lambda: layer_norm(h, ln.weight, ln.bias, ln.eps))):
            k = kernel_ms(lambda: fwd_bwd(fn, (h, ln.weight, ln.bias)), (FWD_KERNEL, BWD_KERNEL))
            row["layer_norm"][name]["fwd_bwd_device_ms"] = k["all"] or None
        lno = row["layer_norm"]["ours"]
        ln_plan = last_bwd_launch(FN, lambda: fwd_bwd(lambda: layer_norm(h, ln.weight, ln.bias, ln.eps), (h, ln.weight, ln.bias)))
        lno.update(fwd_kernel_ms=k[FWD_KERNEL], bwd_kernel_ms=k[BWD_KERNEL], bwd_plan=ln_plan,
                   bwd_kernel_gbps=bwd_bytes(T, d, elt, ln_plan.get("programs", 0), 0) / (k[BWD_KERNEL] * 1e-3) / 1e9)
        row["layer_norm"]["speedup_fwd_bwd_device"] = ratio(row["layer_norm"]["torch"]["fwd_bwd_device_ms"],
                                                            lno["fwd_bwd_device_ms"])
        row["layer_norm"]["speedup_fwd"] = row["layer_norm"]["torch"]["fwd_ms"] / lno["fwd_ms"]
        row["layer_norm"]["speedup_bwd"] = row["layer_norm"]["torch"]["bwd_ms"] / lno["bwd_ms"]
        row["layer_norm"]["speedup_fwd_bwd"] = row["layer_norm"]["torch"]["fwd_bwd_ms"] / lno["fwd_bwd_ms"]

        if a.bwd_sweep:
            saved = dict(FN.BWD_ELEMENTS_PER_THREAD), FN.BWD_PROGRAMS_PER_SM
            sweep = []
            try:
                for ept in (16, 32, 64):
                    for pps in (0, 2, 4, 8):
                        FN.BWD_ELEMENTS_PER_THREAD[True], FN.BWD_PROGRAMS_PER_SM = ept, pps
                        ms = kernel_ms(lambda: fwd_bwd(fused), (BWD_KERNEL,))[BWD_KERNEL]
                        progs = last_bwd_launch(FN, lambda: fwd_bwd(fused)).get("programs", 0)
                        sweep.append(dict(elements_per_thread=ept, programs_per_sm=pps or "resident", programs=progs,
                                          bwd_kernel_ms=ms,
                                          gbps=bwd_bytes(T, d, elt, progs, seg.element_size()) / (ms * 1e-3) / 1e9))
            finally:
                FN.BWD_ELEMENTS_PER_THREAD.update(saved[0])
                FN.BWD_PROGRAMS_PER_SM = saved[1]
            row["bwd_sweep"] = sweep
            best = min(sweep, key=lambda s: s["bwd_kernel_ms"])
            print(f"  sweep (FiLM): best {best['elements_per_thread']} elements/thread x {best['programs_per_sm']}/SM "
                  f"{best['bwd_kernel_ms']:.3f} ms; " + ", ".join(
                      f"{s['elements_per_thread']}/{s['programs_per_sm']}:{s['bwd_kernel_ms']:.3f}" for s in sweep), flush=True)
        rows.append(row)
        lnr = row["layer_norm"]
        print(f"{case['case']}: T={T} d={d}: pytorch {row['pytorch']['fwd_bwd_ms']:.3f} ms, fused "
              f"{row['fused']['fwd_bwd_ms']:.3f} ms fwd+bwd ({row['speedup_fwd_bwd']:.2f}x; fwd {row['speedup_fwd']:.2f}x); "
              f"bwd kernel {row['fused']['bwd_kernel_ms']:.3f} ms ({row['fused_bwd_kernel_gbps']:.0f} GB/s), fwd kernel "
              f"{row['fused']['fwd_kernel_ms']:.3f} ms"
              + (f", baseline bwd kernel {row['fused_baseline']['bwd_kernel_ms']:.3f} ms" if baseline else "")
              + f"; GPU busy fwd+bwd pytorch {row['pytorch']['fwd_bwd_device_ms'] or 0:.3f} ms, fused "
              f"{row['fused']['fwd_bwd_device_ms'] or 0:.3f} ms; errors fused {max(row['fused']['max_rel_error'].values()):.2e}, pytorch "
              f"{max(row['pytorch']['max_rel_error'].values()):.2e}; layer_norm ours {lnr['ours']['fwd_bwd_ms']:.3f} vs "
              f"torch {lnr['torch']['fwd_bwd_ms']:.3f} ms fwd+bwd ({lnr['speedup_fwd_bwd']:.2f}x; fwd {lnr['speedup_fwd']:.2f}x, "
              f"bwd {lnr['speedup_bwd']:.2f}x; GPU busy {lnr['ours']['fwd_bwd_device_ms'] or 0:.3f} vs "
              f"{lnr['torch']['fwd_bwd_device_ms'] or 0:.3f} ms, bwd kernel {lnr['ours']['bwd_kernel_gbps']:.0f} GB/s), "
              f"errors {max(lnr['ours']['max_rel_error'].values()):.2e} vs "
              f"{max(lnr['torch']['max_rel_error'].values()):.2e}", flush=True)
    summary = dict(cases=len(rows), median_speedup_fwd_bwd=statistics.median(r["speedup_fwd_bwd"] for r in rows),
                   min_speedup_fwd_bwd=min(r["speedup_fwd_bwd"] for r in rows),
                   median_speedup_fwd=statistics.median(r["speedup_fwd"] for r in rows),
                   median_bwd_kernel_gbps=statistics.median(r["fused_bwd_kernel_gbps"] for r in rows),
                   median_speedup_fwd_bwd_device=median_of(r["speedup_fwd_bwd_device"] for r in rows),
                   median_layer_norm_speedup_fwd_bwd=statistics.median(r["layer_norm"]["speedup_fwd_bwd"] for r in rows),
                   median_layer_norm_speedup_fwd_bwd_device=median_of(r["layer_norm"]["speedup_fwd_bwd_device"] for r in rows),
                   median_layer_norm_bwd_kernel_gbps=statistics.median(r["layer_norm"]["ours"]["bwd_kernel_gbps"] for r in rows),
                   min_layer_norm_speedup_fwd_bwd=min(r["layer_norm"]["speedup_fwd_bwd"] for r in rows))
    if baseline:
        summary["median_speedup_bwd_kernel_vs_baseline"] = statistics.median(r["speedup_bwd_kernel_vs_baseline"] for r in rows)
    result = dict(benchmark="fused FiLM LayerNorm vs the PyTorch expression, forward + backward (bf16); the same "
                  "kernels without FiLM vs torch.nn.functional.layer_norm",
                  device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                  python=platform.python_version(), git_commit=git_commit(),
                  date=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), command=" ".join(sys.argv),
                  summary=summary, rows=rows,
                  kernel_resources={FWD_KERNEL: compiled_resources(FN._film_ln_fwd_kernel),
                                    BWD_KERNEL: compiled_resources(FN._film_ln_bwd_kernel)})
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result["summary"]))
    print(json.dumps(result["kernel_resources"])[:3000])
    return 0


if __name__ == "__main__":
    sys.exit(main())
