"""FP8 GEMM benchmark (issue 10): speed-up of the two FP8 recipes over bf16 at every linear layer
shape of a workload (``gem-h200``), forward and forward + backward, quantisation included.

Shapes: the workload's dense arch is built by the trainer's model builder on the meta device and
every ``nn.Linear`` is listed with its (in, out) features; M, the rows one step feeds it, comes
from the workload: the local batch, the expected history length (``coplan.costmodel.jagged``) for
the layers that run on history tokens, the summary / Kunlun / MoE token counts for the others.
Identical (M, K, N) shapes are timed once and weighted by how many layers have them. (The MoE
experts are a grouped GEMM over 3-D parameters, not ``nn.Linear``: not covered here.)

Per shape: ``F.linear`` in bf16 (cuBLAS) against ``coplan.kernels.fp8.fp8_linear`` with the
``rowwise`` recipe (Triton quantisation + ``torch._scaled_mm``) and the ``blockwise`` recipe
(Triton quantisation + block-scaled Triton GEMM): forward, forward + backward (input and weight
gradients), and the forward GEMM alone on pre-quantised operands (the GEMM's own gain, without
the quantisation passes). Times by ``triton.testing.do_bench`` (L2 flushed between runs). Totals
weight each shape by its layer count; "best per layer" takes the fastest of bf16 and the recipes
at each shape, what a planner choosing per layer can get. Plus the ceilings at 8192³: bf16
``torch.mm``, ``torch._scaled_mm`` e4m3 with tensor-wise, row-wise and (if this PyTorch has it)
1x128/128x128 block-wise scales, and the block-scaled Triton GEMM.

torchao's recipes (``torchao-tensorwise``, ``torchao-rowwise``: ``torchao.float8``'s
``Float8Linear``, :func:`coplan.kernels.fp8.convert_torchao`) are meant to run under
``torch.compile``: they are timed as a ``torch.compile``d ``Float8Linear`` (static shapes, default
mode, Dynamo reset before each case so nothing is shared or falls back to eager), forward and
forward + backward, against the same ``torch.compile`` of a bf16 ``nn.Linear`` (``bf16_compiled``;
the uncompiled bf16 figure stays the reference of every ``speedup``; ``speedup_vs_compiled`` is
against the compiled one). Per shape also a "layer norm → linear" pair, compiled, in bf16 and in
each torchao recipe (``ln_linear``): there Inductor can fuse the fp8 cast's amax and scaling into
the norm's kernel, which the device breakdown's kernel list shows. Where torchao cannot run on the
device (not installed, or this PyTorch's CPU ``_scaled_mm`` lacks the scaling), its recipes are
skipped with the reason in the JSON (``torchao``).

    python benchmarks/fp8_h200.py                                 # on the H200, < 2 minutes
    python benchmarks/fp8_h200.py --device cpu --m-scale 0.002 --max-shapes 4 --out /tmp/fp8_cpu.json   # smoke test
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

T0 = time.perf_counter()
GOAL_SPEEDUP = 1.25
RECIPES = ("rowwise", "blockwise", "torchao-tensorwise", "torchao-rowwise")
TORCHAO = ("torchao-tensorwise", "torchao-rowwise")


def log(msg: str) -> None:
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%H:%M:%S")
    print(f"[{now} +{time.perf_counter() - T0:6.1f}s] {msg}", flush=True)


def git_commit() -> str:
    try:
        here = Path(__file__).resolve().parent
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=10)
        return out.stdout.strip() or "unknown"
    except Exception:
        return "unknown"


# ---- shapes ---------------------------------------------------------------------------------


def _import_dense_arch():
    """``DenseArch`` and ``token_layout`` without TorchRec where it is not installed: the dense arch
    uses none of it, but ``gem.py`` imports the sparse arch (TorchRec, FBGEMM) at module level for
    ``GEMModel``. Where that import fails, a stand-in ``coplan.trainer.model.sparse`` module lets
    ``gem.py`` load, so the benchmark runs on a bare device (torch + triton only) and lists exactly
    the modules the trainer builds."""
    try:
        from coplan.trainer.model.gem import DenseArch, token_layout
        return DenseArch, token_layout, "torchrec"
    except ImportError as e:
        if not any(m in str(e) for m in ("torchrec", "fbgemm")):
            raise
        why = f"{type(e).__name__}: {e}"
    import types

    for name in [m for m in sys.modules if m.startswith(("torchrec", "fbgemm_gpu", "coplan.trainer.model.sparse",
                                                         "coplan.trainer.model.gem"))]:
        del sys.modules[name]  # half-imported modules of the failed attempt
    stub = types.ModuleType("coplan.trainer.model.sparse")

    class SparseArch(torch.nn.Module):  # never built here: GEMModel is not used
        def __init__(self, *a, **k):
            raise RuntimeError(f"TorchRec is not importable ({why}); only the dense arch is available")

    stub.SparseArch = SparseArch
    sys.modules["coplan.trainer.model.sparse"] = stub
    from coplan.trainer.model.gem import DenseArch, token_layout
    return DenseArch, token_layout, f"sparse arch stubbed ({why})"


def linear_shapes(workload_name: str, fp8_layers: frozenset[str] = frozenset()) -> tuple[list[dict], dict]:
    """(M, K, N) of every linear layer of the workload's dense arch, with the modules' names and,
    per module, the cost model's layer name and whether the trainer would run it in fp8 when that
    layer is in ``fp8_layers`` (the numerics guard of :func:`coplan.trainer.distributed.fp8.apply_fp8`)."""
    from coplan.costmodel.jagged import length_moments
    from coplan.spec import load_workload
    from coplan.spec.workload import InterFormerBlock, KunlunBlock, MoEBlock
    from coplan.trainer.distributed.fp8 import layer_linears
    from coplan.trainer.features import feature_layout

    DenseArch, token_layout, imported = _import_dense_arch()

    w = load_workload(workload_name)
    batch = w.batch.local_batch_size
    layout = token_layout(w)
    rows: dict[str, int] = {}
    for b in w.blocks:
        if isinstance(b, InterFormerBlock):
            mean_len = length_moments(w.sequence(b.sequence).length).mean
            rows[f"{b.name}:history"] = int(round(batch * mean_len))
            rows[f"{b.name}:summary"] = batch * b.num_summary_tokens
        elif isinstance(b, KunlunBlock):
            rows[f"{b.name}:tokens"] = batch * layout.total
        elif isinstance(b, MoEBlock):
            rows[f"{b.name}:tokens"] = batch * b.tokens_per_sample
    kinds = {b.name: b for b in w.blocks}

    def m_of(name: str) -> int:
        # names: blocks.<block>.<...>; which tokens each module sees follows the model's forward.
        parts = name.split(".")
        block = kinds[parts[1]]
        leaf = parts[-1]
        if isinstance(block, InterFormerBlock):
            if parts[2] == "input" or leaf in ("qkv", "out", "up", "down"):
                return rows[f"{block.name}:history"]
            if leaf in ("summary_q", "summary_out") or parts[2] == "to_tokens":
                return rows[f"{block.name}:summary"]
            return batch  # film, summary_ctx: one context vector per sample
        if isinstance(block, (KunlunBlock, MoEBlock)):
            return rows[f"{block.name}:tokens"]
        return batch  # dense MLP, task heads: one row per sample

    with torch.device("meta"):
        arch = DenseArch(w, feature_layout(w), "reference")
    # module -> (planner layer, runs in fp8 when the layer is in fp8_layers), as apply_fp8 decides
    prec = w.precision
    in_fp8: dict[int, tuple[str, bool]] = {}
    for layer, _parent, _attr, lin, head in layer_linears(arch):
        small = min(lin.in_features, lin.out_features) < prec.fp8_min_dim
        in_fp8[id(lin)] = (layer, layer in fp8_layers and (prec.fp8 == "force" or not (small or head)))
    shapes: dict[tuple, dict] = {}
    for name, mod in arch.named_modules():
        if isinstance(mod, torch.nn.Linear):
            key = (m_of(name), mod.in_features, mod.out_features, mod.bias is not None)
            entry = shapes.setdefault(key, dict(M=key[0], K=key[1], N=key[2], bias=key[3], layers=[], fp8_modules=[]))
            entry["layers"].append(name.removeprefix("blocks."))
            layer, fp8 = in_fp8.get(id(mod), (None, False))
            if fp8:
                entry["fp8_modules"].append(f"{layer}:{name.removeprefix('blocks.')}")
    meta = dict(workload=w.name, local_batch=batch, rows=rows, fp8_layers=sorted(fp8_layers), fp8_min_dim=prec.fp8_min_dim,
                source=f"coplan.trainer.model.gem.DenseArch (meta device; {imported})")
    return sorted(shapes.values(), key=lambda s: -2 * s["M"] * s["K"] * s["N"] * len(s["layers"])), meta


# ---- timing ---------------------------------------------------------------------------------


def timer(device: str, warmup_ms: int, rep_ms: int):
    if device == "cuda":
        import triton.testing

        def bench(fn, grad_to_none=None):
            return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, grad_to_none=grad_to_none))
    else:
        def bench(fn, grad_to_none=None):
            fn()
            n, t = 0, time.perf_counter()
            while n < 3 or (time.perf_counter() - t < rep_ms / 1e3 and n < 50):
                for g in grad_to_none or ():
                    g.grad = None
                fn()
                n += 1
            return (time.perf_counter() - t) / n * 1e3
    return bench


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def first_call_s(fn, device: str) -> float:
    t = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t


def prequantised_gemm(recipe: str, x: torch.Tensor, w: torch.Tensor, device: str):
    """The forward GEMM alone, on operands quantised beforehand (not timed)."""
    from coplan.kernels import fp8_reference as ref
    from coplan.kernels import fp8_triton as ft

    N = w.shape[0]
    if recipe == "rowwise":
        if device == "cuda":
            qa, sa = ft.quant_rows(x, 16)
            qb, sb = ft.quant_rows(w, 16, rows_granule=16)
            sbt = sb.view(1, -1)
            return lambda: torch._scaled_mm(qa, qb.t(), scale_a=sa, scale_b=sbt, out_dtype=torch.bfloat16, use_fast_accum=True)
        qa, sa = ref.quant_rows_ref(x)
        qb, sb = ref.quant_rows_ref(w)
        return lambda: ref.rowwise_mm_ref(qa, sa, qb, sb, N)
    if device == "cuda" or ft.interpreting():
        # the recipe's own GEMM: torch._scaled_mm's block-wise path where it runs, else the Triton kernel
        # (and, as the recipe does, the Triton kernel where cuBLAS would refuse or misread the scales:
        # kernels.fp8.scaled_mm_block_refusal; the 11-29 run timed K = 1216 and 256 through cuBLAS, wrong)
        from coplan.kernels.fp8 import _block_mm

        xq = ft.quant_act_dual(x, with_t=False)
        wq = ft.quant_weight_dual(w, with_t=False)
        return lambda: _block_mm(xq.q, xq.s, wq.q, wq.s, n=N, b_square=True, out_dtype=x.dtype)
    qa, sa = ref.quant_tiles_ref(x, square=False)
    qb, sb = ref.quant_tiles_ref(w, square=True)
    return lambda: ref.block_scaled_mm_ref(qa, sa, qb, sb, b_square=True, n=N)


GEMM_MARKERS = ("gemm", "nvjet", "cutlass", "xmma", "sm90_", "_block_scaled_mm", "scaled_mm", "addmm", "aten::mm", "matmul")
QUANT_MARKERS = ("quant", "_amax", "_rows_scale")


def kernel_family(name: str) -> str:
    n = name.lower()
    if any(m in n for m in QUANT_MARKERS):
        return "fp8_quant"
    if any(m in n for m in GEMM_MARKERS):
        return "gemm"
    return "other"


def device_breakdown(step, device: str, iters: int) -> dict:
    """Device time per kernel family (GEMM, fp8 quantisation, other) of one call of ``step``, from a
    torch.profiler trace of ``iters`` calls: the GPU kernels' own durations (on CPU, the ATen ops'
    self time, for the smoke test). Says where forward + backward time goes beyond the GEMMs."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CUDA] if device == "cuda" else [ProfilerActivity.CPU]
    step()
    sync(device)
    with profile(activities=acts) as prof:
        for _ in range(iters):
            step()
        sync(device)
    fam: dict[str, float] = {}
    kernels: dict[str, float] = {}
    n_kernels = 0
    for ev in prof.events():
        if device == "cuda":
            if ev.device_type.name != "CUDA":
                continue
            us = ev.device_time if hasattr(ev, "device_time") else ev.cuda_time
        else:
            if not ev.name.startswith("aten::"):
                continue
            us = ev.self_cpu_time_total
        f = kernel_family(ev.name)
        fam[f] = fam.get(f, 0.0) + us / 1e3 / iters
        kernels[ev.name[:80]] = kernels.get(ev.name[:80], 0.0) + us / 1e3 / iters
        n_kernels += 1
    top = dict(sorted(kernels.items(), key=lambda kv: -kv[1])[:8])
    return dict(ms_per_call=fam, total_ms=sum(fam.values()), kernels_per_call=n_kernels / iters, top_kernels_ms=top)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-30))


def run_shape(shape: dict, device: str, bench, args) -> dict:
    from coplan.kernels.fp8 import fp8_linear

    M, K, N = shape["M"], shape["K"], shape["N"]
    g = torch.Generator(device="cpu").manual_seed(0)
    dt = torch.bfloat16 if device == "cuda" else torch.float32
    x = torch.randn(M, K, generator=g).to(device=device, dtype=dt)
    w = (torch.randn(N, K, generator=g) * K ** -0.5).to(device=device, dtype=dt)
    b = (torch.randn(N, generator=g) * 0.1).to(device=device, dtype=dt) if shape["bias"] else None
    gy = torch.randn(M, N, generator=g).to(device=device, dtype=dt)
    xg, wg = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    bg = b.clone().requires_grad_(True) if b is not None else None
    leaves = [t for t in (xg, wg, bg) if t is not None]
    flops = 2.0 * M * K * N
    res: dict = dict(shape, flops_fwd=flops)
    want = F.linear(x.float(), w.float(), b.float() if b is not None else None)
    want_dx, want_dw = gy.float() @ w.float(), gy.float().t() @ x.float()

    def measure(label: str, fwd, with_backward: bool, params=None, want_y=None):
        """``params``: the (x, weight, bias) leaves ``fwd`` differentiates (a module's own parameters
        for the compiled cases); ``want_y``: the fp32 output to compare with (default: the linear's)."""
        xg_, wg_, bg_ = params or (xg, wg, bg)
        leaves_ = [t for t in (xg_, wg_, bg_) if t is not None]
        entry = {}
        try:
            if with_backward:
                def step():
                    fwd(xg_, wg_, bg_).backward(gy)
                entry["first_call_s"] = first_call_s(step, device)
                ms = bench(step, grad_to_none=leaves_)
                entry.update(ms=ms, tflops=3 * flops / (ms * 1e-3) / 1e12)
                # The gradients' errors too: round 1 checked only the forward, and the block-wise
                # input gradient was wrong on the H200 while the forward was right.
                for t in leaves_:
                    t.grad = None
                step()
                if want_y is None:
                    entry["rel_err_dx_vs_fp32"] = rel_err(xg_.grad, want_dx)
                    entry["rel_err_dw_vs_fp32"] = rel_err(wg_.grad, want_dw)
                if args.profile_iters:
                    try:
                        entry["device_breakdown"] = device_breakdown(step, device, args.profile_iters)
                    except Exception as e:  # the timing stands without it
                        entry["device_breakdown"] = dict(error=f"{type(e).__name__}: {str(e)[:300]}")
            else:
                with torch.no_grad():
                    entry["first_call_s"] = first_call_s(lambda: fwd(x, w, b), device)
                    ms = bench(lambda: fwd(x, w, b))
                    entry["rel_err_vs_fp32"] = rel_err(fwd(x, w, b), want if want_y is None else want_y)
                entry.update(ms=ms, tflops=flops / (ms * 1e-3) / 1e12)
        except Exception as e:  # one failing case must not lose the others
            entry["error"] = f"{type(e).__name__}: {str(e)[:400]}"
            log(f"  {label}: FAILED {entry['error']}")
            traceback.print_exc()
        return entry

    res["bf16"] = dict(fwd=measure("bf16 fwd", F.linear, False), fwd_bwd=measure("bf16 fwd+bwd", F.linear, True))
    compiled = [r for r in args.recipes if r in TORCHAO and r not in args.torchao_skipped]
    if compiled:
        res.update(compiled_cases(compiled, x, w, b, measure, args))
    for r in args.recipes:
        if r in TORCHAO:
            if r in args.torchao_skipped:
                why = dict(skipped=args.torchao_skipped[r])
                res[r] = dict(fwd=why, fwd_bwd=why, gemm_only=why, ln_linear=dict(fwd=why, fwd_bwd=why))
            for k in ("fwd", "fwd_bwd"):
                e, c = res[r][k], res.get("bf16_compiled", {}).get(k, {})
                if "ms" in e and "ms" in res["bf16"][k]:
                    e["speedup"] = res["bf16"][k]["ms"] / e["ms"]
                if "ms" in e and "ms" in c:
                    e["speedup_vs_compiled"] = c["ms"] / e["ms"]
                e2, c2 = res[r].get("ln_linear", {}).get(k, {}), res.get("bf16_compiled", {}).get("ln_linear", {}).get(k, {})
                if "ms" in e2 and "ms" in c2:
                    e2["speedup_vs_compiled"] = c2["ms"] / e2["ms"]
            continue
        fn = (lambda rr: lambda a, ww, bb: fp8_linear(a, ww, bb, rr, backend=args.backend))(r)
        entry = dict(fwd=measure(f"{r} fwd", fn, False), fwd_bwd=measure(f"{r} fwd+bwd", fn, True))
        try:
            gemm = prequantised_gemm(r, x, w, device)
            gemm()
            ms = bench(gemm)
            entry["gemm_only"] = dict(ms=ms, tflops=flops / (ms * 1e-3) / 1e12)
        except Exception as e:
            entry["gemm_only"] = dict(error=f"{type(e).__name__}: {str(e)[:400]}")
            log(f"  {r} gemm only: FAILED {entry['gemm_only']['error']}")
        for k in ("fwd", "fwd_bwd"):
            if "ms" in entry[k] and "ms" in res["bf16"][k]:
                entry[k]["speedup"] = res["bf16"][k]["ms"] / entry[k]["ms"]
        if "ms" in entry["gemm_only"] and "ms" in res["bf16"]["fwd"]:
            entry["gemm_only"]["speedup"] = res["bf16"]["fwd"]["ms"] / entry["gemm_only"]["ms"]
        res[r] = entry
    del x, w, b, gy, xg, wg, bg, leaves
    if device == "cuda":
        torch.cuda.empty_cache()
    return res


def _compile(mod: torch.nn.Module, backend: str):
    """A fresh ``torch.compile`` of ``mod``: Dynamo reset first, so that a case neither reuses another
    shape's graph (automatic dynamic shapes would make M symbolic) nor hits the recompile limit and
    silently runs eager."""
    torch._dynamo.reset()
    return torch.compile(mod, backend=backend)


def compiled_cases(recipes, x, w, b, measure, args) -> dict:
    """bf16 ``nn.Linear`` and torchao ``Float8Linear`` (per recipe), each ``torch.compile``d the same
    way, forward and forward + backward; and the same for a "layer norm → linear" pair."""
    from torch import nn

    from coplan.kernels.fp8 import convert_torchao

    K, N = x.shape[1], w.shape[0]
    dev, dt = x.device, x.dtype
    g = torch.Generator(device="cpu").manual_seed(2)
    ln_w = (1.0 + 0.1 * torch.randn(K, generator=g)).to(device=dev, dtype=dt)
    ln_b = (0.1 * torch.randn(K, generator=g)).to(device=dev, dtype=dt)
    want_ln = F.linear(F.layer_norm(x.float(), (K,), ln_w.float(), ln_b.float()), w.float(), b.float() if b is not None else None)

    def linear():
        lin = nn.Linear(K, N, bias=b is not None, device=dev, dtype=dt)
        with torch.no_grad():
            lin.weight.copy_(w)
            if b is not None:
                lin.bias.copy_(b)
        return lin

    def pair(lin):
        ln = nn.LayerNorm(K, device=dev, dtype=dt)
        with torch.no_grad():
            ln.weight.copy_(ln_w)
            ln.bias.copy_(ln_b)
        return nn.Sequential(ln, lin)

    out: dict = {}
    for name in ["bf16_compiled", *recipes]:
        entry: dict = {}
        for what in ("linear", "ln_linear"):
            lin = linear()
            mod = nn.Sequential(lin) if what == "linear" else pair(lin)
            if name != "bf16_compiled":
                try:
                    convert_torchao(mod, name, [lin])
                except Exception as e:
                    err = dict(error=f"{type(e).__name__}: {str(e)[:400]}")
                    entry.update({"fwd": err, "fwd_bwd": err} if what == "linear" else {"ln_linear": dict(fwd=err, fwd_bwd=err)})
                    continue
            target = mod[-1]
            params = lambda: (x.clone().requires_grad_(True), target.weight, target.bias)  # noqa: E731
            want_y = None if what == "linear" else want_ln
            cases = {}
            for k, bwd in (("fwd", False), ("fwd_bwd", True)):
                fn = _compile(mod, args.compile_backend)
                cases[k] = measure(f"{name} {what} {k}", lambda a, ww, bb, fn=fn: fn(a), bwd, params=params(), want_y=want_y)
            if what == "linear":
                entry.update(cases)
            else:
                entry["ln_linear"] = cases
        entry["gemm_only"] = dict(note="not measured for compiled modules")
        out[name] = entry
    return out


def torchao_probe(recipes, device: str) -> tuple[dict, dict]:
    """(skipped recipe → why, facts): whether torchao's float8 converts and runs a small layer here."""
    facts: dict = {}
    skipped: dict = {}
    try:
        import torchao

        facts["version"] = torchao.__version__
    except Exception as e:
        facts["version"] = None
        facts["import_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    from torch import nn

    from coplan.kernels.fp8 import convert_torchao

    dt = torch.bfloat16 if device == "cuda" else torch.float32
    for r in recipes:
        try:
            m = nn.Sequential(nn.Linear(32, 16, device=device, dtype=dt))
            convert_torchao(m, r, [m[0]])
            m(torch.randn(8, 32, device=device, dtype=dt, requires_grad=True)).sum().backward()
        except Exception as e:
            skipped[r] = f"torchao cannot run {r} on {device} here: {type(e).__name__}: {str(e)[:300]}"
            log(f"{r}: skipped ({skipped[r]})")
    facts["skipped"] = skipped
    return skipped, facts


def ceilings(device: str, size: int, bench) -> dict:
    from coplan.kernels import fp8_triton as ft

    out: dict = {"size": size}
    g = torch.Generator(device="cpu").manual_seed(1)
    dt = torch.bfloat16 if device == "cuda" else torch.float32
    a = torch.randn(size, size, generator=g).to(device=device, dtype=dt)
    b = torch.randn(size, size, generator=g).to(device=device, dtype=dt)
    flops = 2.0 * size**3
    cases = {"bf16_mm": lambda: (lambda: torch.mm(a, b.t()))}
    if device == "cuda":
        qa, sa = ft.quant_rows(a, 16)
        qb, sb = ft.quant_rows(b, 16)
        one = torch.ones((), device=device)
        cases["scaled_mm_tensorwise_fast_accum"] = lambda: (lambda: torch._scaled_mm(
            qa, qb.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16, use_fast_accum=True))
        cases["scaled_mm_rowwise_fast_accum"] = lambda: (lambda: torch._scaled_mm(
            qa, qb.t(), scale_a=sa, scale_b=sb.view(1, -1), out_dtype=torch.bfloat16, use_fast_accum=True))
        cases["scaled_mm_rowwise"] = lambda: (lambda: torch._scaled_mm(
            qa, qb.t(), scale_a=sa, scale_b=sb.view(1, -1), out_dtype=torch.bfloat16, use_fast_accum=False))
        ta, tsa = ft.quant_tiles(a, square=False)
        tb, tsb = ft.quant_tiles(b, square=True)

        def torch_blockwise():
            # torch's own block-wise path (cuBLAS, where this build has it): scale_a [M, K/128] with M
            # contiguous ("outer-dim-major"), scale_b [K/128, N/128]; the layout it accepts varies by
            # version, so the first that runs is kept, and the error is recorded if none does.
            sa_t = tsa.t().contiguous().t()
            errors = []
            for sb_try in (tsb.t().contiguous(), tsb.t(), tsb.t().contiguous().t().contiguous()):
                try:
                    fn = lambda sb_try=sb_try: torch._scaled_mm(ta, tb.t(), scale_a=sa_t, scale_b=sb_try, out_dtype=torch.bfloat16)  # noqa: E731
                    fn()
                    return fn
                except Exception as e:  # noqa: PERF203
                    errors.append(f"{type(e).__name__}: {str(e)[:200]}")
            raise RuntimeError(" | ".join(errors))

        cases["scaled_mm_blockwise_1x128_128x128"] = torch_blockwise
        cases["triton_block_scaled_mm"] = lambda: (lambda: ft.block_scaled_mm(ta, tsa, tb, tsb, b_square=True))
        da, db = ft.quant_act_dual(a, with_t=False), ft.quant_weight_dual(b, with_t=False)
        # what the blockwise recipe calls (torch._scaled_mm with this module's scale layout, or the fallback)
        cases["coplan_block_mm"] = lambda: (lambda: ft.block_mm(da.q, da.s, db.q, db.s, n=size, b_square=True,
                                                                out_dtype=torch.bfloat16))
    for name, make in cases.items():
        try:
            fn = make()
            fn()
            sync(device)
            ms = bench(fn)
            out[name] = dict(ms=ms, tflops=flops / (ms * 1e-3) / 1e12)
            log(f"ceiling {name:36s} {out[name]['tflops']:8.1f} TFLOP/s ({ms:.3f} ms)")
        except Exception as e:
            out[name] = dict(error=f"{type(e).__name__}: {str(e)[:400]}")
            log(f"ceiling {name}: FAILED {out[name]['error']}")
    return out


def totals(shapes: list[dict], recipes) -> dict:
    """Σ over layers (shape time × layers with that shape) per method, forward and forward+backward."""
    out: dict = {}
    all_recipes = recipes
    for k in ("fwd", "fwd_bwd"):
        recipes = [r for r in all_recipes if any("ms" in s.get(r, {}).get(k, {}) for s in shapes)]  # skipped ones out
        ok = [s for s in shapes if "ms" in s.get("bf16", {}).get(k, {})
              and all("ms" in s.get(r, {}).get(k, {}) for r in recipes)]
        if not ok:
            continue
        n = lambda s: len(s["layers"])  # noqa: E731
        bf16 = sum(s["bf16"][k]["ms"] * n(s) for s in ok)
        entry = dict(shapes=len(ok), of_shapes=len(shapes), bf16_ms=bf16)
        for r in recipes:
            t = sum(s[r][k]["ms"] * n(s) for s in ok)
            entry[f"{r}_ms"], entry[f"{r}_speedup"] = t, bf16 / t
        if all("ms" in s.get("bf16_compiled", {}).get(k, {}) for s in ok):
            entry["bf16_compiled_ms"] = sum(s["bf16_compiled"][k]["ms"] * n(s) for s in ok)
            for r in recipes:
                if r in TORCHAO:
                    entry[f"{r}_speedup_vs_compiled"] = entry["bf16_compiled_ms"] / entry[f"{r}_ms"]
        best = sum(min([s["bf16"][k]["ms"]] + [s[r][k]["ms"] for r in recipes]) * n(s) for s in ok)
        entry["best_per_layer_ms"], entry["best_per_layer_speedup"] = best, bf16 / best
        entry["best_per_layer_choice"] = {
            f"{s['M']}x{s['K']}x{s['N']}": min(["bf16", *recipes], key=lambda m: s[m][k]["ms"]) for s in ok}
        out[k] = entry
    return out


def dense_gemm_goal(shapes: list[dict], recipes) -> dict:
    """The issue's goal read off directly: Σ forward + backward time (quantisation included) over the
    linear modules the trainer runs in fp8 for the given fp8 layers, bf16 against each recipe, and
    the device-time split of the same sum (GEMM vs quantisation kernels, from the profiler)."""
    sel = [s for s in shapes if s.get("fp8_modules") and "ms" in s.get("bf16", {}).get("fwd_bwd", {})]
    out: dict = dict(goal_speedup=GOAL_SPEEDUP, modules=sum(len(s["fp8_modules"]) for s in sel),
                     shapes=[f"{s['M']}x{s['K']}x{s['N']} x{len(s['fp8_modules'])}" for s in sel])
    if not sel:
        return out
    out["bf16_ms"] = sum(s["bf16"]["fwd_bwd"]["ms"] * len(s["fp8_modules"]) for s in sel)
    for r in recipes:
        if not all("ms" in s.get(r, {}).get("fwd_bwd", {}) for s in sel):
            continue
        t = sum(s[r]["fwd_bwd"]["ms"] * len(s["fp8_modules"]) for s in sel)
        e = dict(ms=t, speedup=out["bf16_ms"] / t, goal_met=out["bf16_ms"] / t >= GOAL_SPEEDUP)
        if all("ms" in s.get("bf16_compiled", {}).get("fwd_bwd", {}) for s in sel):
            tc = sum(s["bf16_compiled"]["fwd_bwd"]["ms"] * len(s["fp8_modules"]) for s in sel)
            e.update(bf16_compiled_ms=tc, speedup_vs_compiled=tc / t)
        fam: dict[str, float] = {}
        for s in sel:
            for f, v in s[r]["fwd_bwd"].get("device_breakdown", {}).get("ms_per_call", {}).items():
                fam[f] = fam.get(f, 0.0) + v * len(s["fp8_modules"])
        e["device_ms_by_family"] = fam
        out[r] = e
    fam_b: dict[str, float] = {}
    for s in sel:
        for f, v in s["bf16"]["fwd_bwd"].get("device_breakdown", {}).get("ms_per_call", {}).items():
            fam_b[f] = fam_b.get(f, 0.0) + v * len(s["fp8_modules"])
    out["bf16_device_ms_by_family"] = fam_b
    return out


def table(result: dict) -> str:
    rs = result["recipes"]
    lines = [f"{result['device']}, torch {result['torch']}, triton {result['triton']}, CUDA {result['cuda']}, {result['date']}",
             "| M x K x N | layers | bf16 fwd ms | bf16 fwd+bwd ms | " + " | ".join(
                 f"{r} fwd ms (x) | {r} fwd+bwd ms (x) | {r} GEMM only (x)" for r in rs) + " |",
             "|---|---:|---:|---:|" + "---:|---:|---:|" * len(rs)]

    def cell(e, x=True):
        if "error" in e:
            return "failed"
        if "ms" not in e:
            return "-"
        return f"{e['ms']:.3f}" + (f" ({e['speedup']:.2f})" if x and "speedup" in e else "")

    for s in result["shapes"]:
        if "bf16" not in s:
            why = s.get("skipped", s.get("error", "-"))
            lines.append(f"| {s['M']}x{s['K']}x{s['N']} | {len(s['layers'])} | {why} |" + " |" * (2 + 3 * len(rs)))
            continue
        row = [f"{s['M']}x{s['K']}x{s['N']}", str(len(s["layers"])), cell(s["bf16"]["fwd"]), cell(s["bf16"]["fwd_bwd"])]
        for r in rs:
            row += [cell(s[r]["fwd"]), cell(s[r]["fwd_bwd"]), cell(s[r]["gemm_only"])]
        lines.append("| " + " | ".join(row) + " |")
    g = result.get("dense_gemm_goal", {})
    if "bf16_ms" in g:
        lines.append(f"dense GEMM time (fwd+bwd, quantisation included) over the {g['modules']} fp8 modules of "
                     f"{', '.join(result.get('shapes_from', {}).get('fp8_layers', []))}: bf16 {g['bf16_ms']:.3f} ms; " + "; ".join(
                         f"{r} {g[r]['ms']:.3f} ms ({g[r]['speedup']:.2f}x, goal {GOAL_SPEEDUP}x "
                         f"{'met' if g[r]['goal_met'] else 'not met'}; device "
                         + ", ".join(f"{f} {v:.2f}" for f, v in sorted(g[r]['device_ms_by_family'].items())) + ")"
                         for r in rs if r in g))
    comp = [s for s in result["shapes"] if "bf16_compiled" in s]
    if comp:
        lines += ["", "compiled (torch.compile of the module; x vs compiled bf16): linear | layer norm → linear",
                  "| M x K x N | bf16 compiled fwd / fwd+bwd ms | " + " | ".join(
                      f"{r} fwd / fwd+bwd ms (x) | {r} LN→linear fwd+bwd ms (x)" for r in rs if r in TORCHAO)
                  + " | bf16 compiled LN→linear fwd+bwd ms |", "|---|---:|" + "---:|---:|" * sum(r in TORCHAO for r in rs) + "---:|"]

        def cc(e):
            if "ms" not in e:
                return "failed" if "error" in e else "-"
            return f"{e['ms']:.3f}" + (f" ({e['speedup_vs_compiled']:.2f})" if "speedup_vs_compiled" in e else "")

        for s in comp:
            c = s["bf16_compiled"]
            row = [f"{s['M']}x{s['K']}x{s['N']}", f"{cc(c['fwd'])} / {cc(c['fwd_bwd'])}"]
            for r in rs:
                if r in TORCHAO:
                    row += [f"{cc(s[r]['fwd'])} / {cc(s[r]['fwd_bwd'])}", cc(s[r].get("ln_linear", {}).get("fwd_bwd", {}))]
            row.append(cc(c.get("ln_linear", {}).get("fwd_bwd", {})))
            lines.append("| " + " | ".join(row) + " |")
    for k, t in result.get("totals", {}).items():
        lines.append(f"total {k} over {t['shapes']}/{t['of_shapes']} shapes: bf16 {t['bf16_ms']:.3f} ms; "
                     + (f"bf16 compiled {t['bf16_compiled_ms']:.3f} ms; " if "bf16_compiled_ms" in t else "") + "; ".join(
            f"{r} {t[f'{r}_ms']:.3f} ms ({t[f'{r}_speedup']:.2f}x"
            + (f", {t[f'{r}_speedup_vs_compiled']:.2f}x vs compiled" if f"{r}_speedup_vs_compiled" in t else "") + ")"
            for r in rs if f"{r}_ms" in t)
            + f"; best per layer {t['best_per_layer_ms']:.3f} ms ({t['best_per_layer_speedup']:.2f}x)")
    return "\n".join(lines)


def main(argv=None) -> bool:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workload", default="gem-h200")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--recipes", default=",".join(RECIPES))
    p.add_argument("--backend", default="auto", choices=["auto", "kernels", "emulate"],
                   help="fp8_linear's backend; 'kernels' on CPU needs TRITON_INTERPRET=1")
    p.add_argument("--m-scale", type=float, default=1.0, help="scale every M (smoke tests on CPU)")
    p.add_argument("--max-shapes", type=int, default=0, help="time only the first N shapes (largest total FLOPs first); 0: all")
    p.add_argument("--ceiling-size", type=int, default=0, help="square size of the ceiling GEMMs (default 8192 on GPU, 256 on CPU)")
    p.add_argument("--warmup-ms", type=int, default=10)
    p.add_argument("--rep-ms", type=int, default=40)
    p.add_argument("--fp8-layers", default="interformer.0,interformer.1,interformer.2,interformer.3",
                   help="planner layers taken as fp8 for the dense-GEMM goal total (the planner's choice for gem-h200)")
    p.add_argument("--profile-iters", type=int, default=3, help="fwd+bwd calls per torch.profiler breakdown; 0: none")
    p.add_argument("--timeout", type=float, default=110.0, help="seconds; shapes not started by then are skipped")
    p.add_argument("--compile-backend", default="inductor",
                   help="torch.compile backend of the compiled cases (torchao recipes, bf16_compiled); 'aot_eager' for a fast CPU smoke test")
    p.add_argument("--commit", default=None, help="git commit to record (default: git rev-parse in the script's folder)")
    p.add_argument("--out", default="benchmarks/results/fp8_h200.json")
    p.add_argument("--table-from", help="print the Markdown table of an earlier JSON result and exit")
    args = p.parse_args(argv)
    if args.table_from:
        with open(args.table_from) as f:
            print(table(json.load(f)))
        return True
    args.recipes = [r for r in args.recipes.split(",") if r]
    bad = [r for r in args.recipes if r not in RECIPES]
    if bad:
        p.error(f"--recipes: unknown {bad}; choose from {', '.join(RECIPES)}")
    device = args.device
    import triton

    from coplan.kernels.fp8 import fp8_supported

    result = dict(
        benchmark="fp8 GEMMs (issue 10)",
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        device=torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu",
        torch=torch.__version__, triton=triton.__version__, cuda=torch.version.cuda, python=platform.python_version(),
        git_commit=args.commit or git_commit(), command=" ".join([sys.executable, *sys.argv]),
        fp8_native=fp8_supported(device), recipes=args.recipes, goal_speedup=GOAL_SPEEDUP,
        timing=f"triton.testing.do_bench warmup={args.warmup_ms} ms rep={args.rep_ms} ms" if device == "cuda" else "perf_counter",
        m_scale=args.m_scale, backend=args.backend, compile_backend=args.compile_backend,
    )
    args.torchao_skipped = {}
    tao = [r for r in args.recipes if r in TORCHAO]
    if tao:
        args.torchao_skipped, result["torchao"] = torchao_probe(tao, device)
    if device == "cuda":
        result["capability"] = list(torch.cuda.get_device_capability())
    log(f"device {result['device']} torch {result['torch']} triton {result['triton']} fp8 native {result['fp8_native']}")

    def save():
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)

    try:
        shapes, meta = linear_shapes(args.workload, frozenset(x for x in args.fp8_layers.split(",") if x))
    except Exception as e:
        result["error"] = f"shapes: {type(e).__name__}: {e}"
        log(result["error"])
        traceback.print_exc()
        save()
        return False
    result["shapes_from"] = meta
    for s in shapes:
        s["M"] = max(1, int(round(s["M"] * args.m_scale)))
    if args.max_shapes:
        shapes = shapes[: args.max_shapes]
    result["shapes"] = shapes
    log(f"{len(shapes)} shapes: " + ", ".join(f"{s['M']}x{s['K']}x{s['N']}(x{len(s['layers'])})" for s in shapes))
    bench = timer(device, args.warmup_ms, args.rep_ms)

    # Ceilings first: short, and they say what the shapes can at best reach.
    result["ceilings"] = ceilings(device, args.ceiling_size or (8192 if device == "cuda" else 256), bench)
    save()
    for i, s in enumerate(shapes):
        if time.perf_counter() - T0 > args.timeout:
            s["skipped"] = f"time budget ({args.timeout:.0f} s) spent"
            log(f"shape {s['M']}x{s['K']}x{s['N']}: skipped, time budget spent")
            continue
        try:
            s.update(run_shape(s, device, bench, args))
            msg = f"[{i + 1}/{len(shapes)}] {s['M']}x{s['K']}x{s['N']} x{len(s['layers'])}: bf16 " \
                  f"{s['bf16']['fwd'].get('ms', float('nan')):.3f}/{s['bf16']['fwd_bwd'].get('ms', float('nan')):.3f} ms"
            for r in args.recipes:
                e = s[r]
                msg += f" | {r} {e['fwd'].get('ms', float('nan')):.3f}/{e['fwd_bwd'].get('ms', float('nan')):.3f} ms " \
                       f"x{e['fwd'].get('speedup', float('nan')):.2f}/x{e['fwd_bwd'].get('speedup', float('nan')):.2f} " \
                       f"gemm x{e['gemm_only'].get('speedup', float('nan')):.2f} err {e['fwd'].get('rel_err_vs_fp32', float('nan')):.1e}" \
                       f" dx {e['fwd_bwd'].get('rel_err_dx_vs_fp32', float('nan')):.1e} dw {e['fwd_bwd'].get('rel_err_dw_vs_fp32', float('nan')):.1e}"
            log(msg)
        except Exception as e:
            s["error"] = f"{type(e).__name__}: {str(e)[:400]}"
            log(f"shape {s['M']}x{s['K']}x{s['N']}: FAILED {s['error']}")
            traceback.print_exc()
        result["totals"] = totals([t for t in shapes if "bf16" in t], args.recipes)
        result["dense_gemm_goal"] = dense_gemm_goal(shapes, args.recipes)
        save()
    result["totals"] = totals([t for t in shapes if "bf16" in t], args.recipes)
    result["dense_gemm_goal"] = dense_gemm_goal(shapes, args.recipes)
    from coplan.kernels import fp8_triton as ft

    result["blockwise_gemm_backend"] = {
        f"{ft.scaled_mm_block_kind(sq)}/{str(dt).removeprefix('torch.')}": ft.block_mm_backend(sq, dt)
        for sq in (True, False) for dt in (torch.bfloat16, torch.float32)}
    result["scaled_mm_block_errors"] = {f"{k[0]}/{k[1]}": v for k, v in ft.SCALED_MM_BLOCK_ERRORS.items()}
    # host-side paths taken: quantisation kernels launched directly vs through Triton's JIT
    # dispatch, and whether the row-wise _scaled_mm took the bias in its epilogue
    from coplan.kernels import fp8 as f8

    result["launches"] = dict(ft.DIRECT_STATS, direct_enabled=ft.DIRECT_LAUNCH)
    result["rowwise_bias_in_scaled_mm"] = dict(used=f8._ROWWISE_BIAS[0], error=f8._ROWWISE_BIAS_ERROR[0])
    result["elapsed_s"] = time.perf_counter() - T0
    save()
    print(table(result), flush=True)
    log(f"wrote {args.out}")
    return True


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
