"""FP8 written by its producers, timed (issue 26): the InterFormer layer's producer → GEMM chains at a
workload's shapes (``gem-h200``), forward + backward, in three arms:

- ``bf16``: ``F.layer_norm`` / ``F.silu`` and ``F.linear`` (cuBLAS), bf16 throughout;
- ``fp8_unfused``: the same producers writing bf16, then :func:`coplan.kernels.fp8.fp8_linear`'s ``blockwise``
  recipe quantising their output in a pass of its own (what the trainer's fp8 layers run today);
- ``fp8_fused``: :mod:`coplan.kernels.fp8_fused`, the producers writing the fp8 operands
  (:func:`ln_linear_fp8`, :func:`act_linear_fp8`, :func:`ln_ffn_fp8`, the latter also with ``save_input_fp8``).

Chains (one InterFormer layer; M = local batch x expected history length, as ``benchmarks/fp8_h200.py``):
``norm1 → qkv`` (without the per-sample FiLM modulation the model applies between them, which the fused
LayerNorm does not apply), ``norm2 → ffn_up``, ``silu → ffn_down`` and the whole ``norm2 → ffn``.

Beside each measured figure: the HBM bytes :func:`coplan.kernels.fp8_fused.fused_bytes` counts for the
chain, fused and unfused, and the bound of ``benchmarks/fp8_bound.py`` for the chain's linear layers (their
bf16 forward + backward from an ``fp8_h200.py`` result, each GEMM at the measured fp8 GEMM speed-up): its
``fused`` bound (GEMMs alone) and ``blockwise`` bound (plus the quantisation passes at the copy bandwidth),
and a chain bound for this implementation = the ``fused`` GEMM bound + this chain's non-GEMM kernels'
bytes at the copy bandwidth (producers, the weights' and the incoming gradient's quantisation).

Times by ``triton.testing.do_bench`` (L2 flushed between runs). Errors: every output and gradient against
an fp32 autograd reference on the same inputs. Needs a CUDA GPU with FP8 (compute capability ≥ 8.9); on any
other machine it says so and exits 0 without writing anything.

    python benchmarks/fp8_fused_h200.py                      # on the H200, ~2 minutes
    python benchmarks/fp8_fused_h200.py --m-scale 0.1 --chains ln_ffn --out /tmp/fp8_fused.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _common import git_commit  # noqa: E402  (the scripts run by path)

T0 = time.perf_counter()
DEFAULT_BOUND_SOURCE = HERE.parent / "docs" / "benchmarks-log" / "results" / "fp8_h200_s4.json"


def log(msg: str) -> None:
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%H:%M:%S")
    print(f"[{now} +{time.perf_counter() - T0:6.1f}s] {msg}", flush=True)


# ---- shapes ---------------------------------------------------------------------------------


def chains_of(workload_name: str, m_scale: float) -> tuple[list[dict], dict]:
    """The producer → GEMM chains of the workload's first InterFormer block, with their (M, K, N) linears."""
    from coplan.costmodel.jagged import length_moments
    from coplan.spec import load_workload
    from coplan.spec.workload import InterFormerBlock

    w = load_workload(workload_name)
    block = next((b for b in w.blocks if isinstance(b, InterFormerBlock)), None)
    if block is None:
        raise SystemExit(f"{workload_name}: no InterFormer block, nothing to time")
    mean_len = length_moments(w.sequence(block.sequence).length).mean
    M = max(1, int(round(w.batch.local_batch_size * mean_len * m_scale)))
    d, inner = block.model_dim, block.num_heads * block.head_dim
    hidden = int(round(block.ffn_multiplier * d))
    chains = [
        dict(name="norm1→qkv (no FiLM)", chain="ln_linear", M=M, D=d, N=3 * inner, linears=[(M, d, 3 * inner)]),
        dict(name="norm2→ffn_up", chain="ln_linear", M=M, D=d, N=hidden, linears=[(M, d, hidden)]),
        dict(name="silu→ffn_down", chain="act_linear", M=M, D=hidden, N=d, linears=[(M, hidden, d)]),
        dict(name="norm2→ffn (up, silu, down)", chain="ln_ffn", M=M, D=d, N=hidden, linears=[(M, d, hidden), (M, hidden, d)]),
    ]
    meta = dict(workload=w.name, block=block.name, layers=block.num_layers, local_batch=w.batch.local_batch_size,
                mean_history_length=mean_len, m_scale=m_scale, model_dim=d, ffn_hidden=hidden, attention_inner=inner)
    return chains, meta


# ---- the arms ---------------------------------------------------------------------------------


def inputs(c: dict, device: str) -> dict:
    g = torch.Generator(device="cpu").manual_seed(0)
    M, D, N = c["M"], c["D"], c["N"]
    bf = torch.bfloat16

    def rnd(*shape, scale=1.0, shift=0.0):
        return (torch.randn(*shape, generator=g) * scale + shift).to(device=device, dtype=bf)

    t = dict(x=rnd(M, D, scale=2.0), gy=rnd(M, D if c["chain"] == "ln_ffn" else N))
    if c["chain"] in ("ln_linear", "ln_ffn"):
        t.update(lw=rnd(D, scale=0.1, shift=1.0), lb=rnd(D, scale=0.1))
    t["w"] = rnd(N, D, scale=D**-0.5)
    if c["chain"] == "ln_ffn":
        t["w2"] = rnd(D, N, scale=N**-0.5)
    return t


def arms(c: dict) -> dict:
    """name -> fn(tensors) giving the chain's output, for each arm; the tensors' leaves get gradients."""
    from coplan.kernels import fp8_fused as ff
    from coplan.kernels.fp8 import fp8_linear

    D = c["D"]

    def lin8(a, w):
        return fp8_linear(a, w, None, "blockwise", backend="kernels")

    if c["chain"] == "ln_linear":
        return {
            "bf16": lambda t: F.linear(F.layer_norm(t["x"], (D,), t["lw"], t["lb"]), t["w"]),
            "fp8_unfused": lambda t: lin8(F.layer_norm(t["x"], (D,), t["lw"], t["lb"]), t["w"]),
            "fp8_fused": lambda t: ff.ln_linear_fp8(t["x"], t["lw"], t["lb"], t["w"]),
        }
    if c["chain"] == "act_linear":
        return {
            "bf16": lambda t: F.linear(F.silu(t["x"]), t["w"]),
            "fp8_unfused": lambda t: lin8(F.silu(t["x"]), t["w"]),
            "fp8_fused": lambda t: ff.act_linear_fp8(t["x"], t["w"], kind="silu"),
        }
    return {
        "bf16": lambda t: F.linear(F.silu(F.linear(F.layer_norm(t["x"], (D,), t["lw"], t["lb"]), t["w"])), t["w2"]),
        "fp8_unfused": lambda t: lin8(F.silu(lin8(F.layer_norm(t["x"], (D,), t["lw"], t["lb"]), t["w"])), t["w2"]),
        "fp8_fused": lambda t: ff.ln_ffn_fp8(t["x"], t["lw"], t["lb"], t["w"], t["w2"], kind="silu"),
        "fp8_fused_fp8_input": lambda t: ff.ln_ffn_fp8(t["x"], t["lw"], t["lb"], t["w"], t["w2"], kind="silu",
                                                       save_input_fp8=True),
    }


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-30))


def run_chain(c: dict, args, bw: float, bounds: dict) -> dict:
    import triton.testing

    from coplan.kernels import fp8_fused as ff

    t = inputs(c, "cuda")
    gy = t.pop("gy")
    res: dict = dict(name=c["name"], chain=c["chain"], M=c["M"], D=c["D"], N=c["N"], linears=c["linears"])

    # fp32 reference, once
    ref_leaves = {k: v.float().requires_grad_(True) for k, v in t.items()}
    fns = arms(c)
    out = fns["bf16"](ref_leaves)
    out.backward(gy.float())
    want = {"out": out.detach()} | {f"d{k}": v.grad for k, v in ref_leaves.items()}
    del ref_leaves, out

    for arm, fn in fns.items():
        entry: dict = {}
        leaves = {k: v.clone().requires_grad_(True) for k, v in t.items()}
        try:
            def step():
                fn(leaves).backward(gy)

            t1 = time.perf_counter()
            step()
            torch.cuda.synchronize()
            entry["first_call_s"] = time.perf_counter() - t1
            for v in leaves.values():
                v.grad = None
            step()
            entry["rel_err_vs_fp32"] = {"out": rel_err(fn(leaves).detach(), want["out"])} | {
                f"d{k}": rel_err(v.grad, want[f"d{k}"]) for k, v in leaves.items()}
            entry["fwd_bwd_ms"] = float(triton.testing.do_bench(step, warmup=args.warmup_ms, rep=args.rep_ms,
                                                                 grad_to_none=list(leaves.values())))
            with torch.no_grad():
                entry["fwd_ms"] = float(triton.testing.do_bench(lambda: fn(leaves), warmup=args.warmup_ms, rep=args.rep_ms))
        except Exception as e:  # one failing arm must not lose the others
            entry["error"] = f"{type(e).__name__}: {str(e)[:400]}"
            log(f"  {c['name']} {arm}: FAILED {entry['error']}")
            traceback.print_exc()
        res[arm] = entry
        leaves = None  # the arm's copies, freed before the next arm's
    for arm in fns:
        for k in ("fwd_ms", "fwd_bwd_ms"):
            if k in res[arm] and k in res["bf16"]:
                res[arm][k.replace("_ms", "_speedup")] = res["bf16"][k] / res[arm][k]

    fb = ff.fused_bytes(c["M"], c["D"], c["N"], chain=c["chain"])
    non_gemm = sum(b for k, b in fb.fused.parts if not k.startswith("gemm_"))
    res["bytes"] = dict(fused=fb.fused.by_kernel(), unfused=fb.unfused.by_kernel(), fused_total=fb.fused.hbm_bytes,
                        unfused_total=fb.unfused.hbm_bytes, saved=fb.saved_bytes, fused_non_gemm=non_gemm,
                        saved_ms_at_copy_bw=fb.saved_bytes / bw * 1e3)
    rows = [bounds.get(tuple(lin)) for lin in c["linears"]]
    if all(r is not None and "fused" in r and "blockwise" in r for r in rows):
        bf16_lin = sum(r["bf16_fwd_bwd_ms"] for r in rows)
        fused_gemm = sum(r["fused"]["bound_ms"] for r in rows)
        res["bound"] = dict(
            source="benchmarks/fp8_bound.py over the chain's linear layers",
            bf16_linears_fwd_bwd_ms=bf16_lin, fp8_bound_fused_ms=fused_gemm,
            fp8_bound_blockwise_ms=sum(r["blockwise"]["bound_ms"] for r in rows),
            chain_fused_ms=fused_gemm + non_gemm / bw * 1e3,
            note="chain_fused_ms = fp8_bound's fused GEMM bound + this chain's non-GEMM kernels' fused bytes at the "
                 "copy bandwidth")
    else:
        res["bound"] = dict(missing=f"the bound's source has no row for {[tuple(x) for x in c['linears']]} (another M?)")
    torch.cuda.empty_cache()
    return res


# ---- output -----------------------------------------------------------------------------------


def _cell(e: dict, key: str = "fwd_bwd") -> str:
    if f"{key}_ms" not in e:
        return "failed" if "error" in e else "-"
    sp = e.get(f"{key}_speedup")
    return f"{e[f'{key}_ms']:.3f}" + (f" ({sp:.2f}x)" if sp else "")


def table(result: dict) -> str:
    lines = [f"{'chain':<28}{'M x D x N':<20}{'bf16':>9}{'fp8 unfused':>18}{'fp8 fused':>18}{'fused, fp8 h':>18}"
             f"{'bound fused':>13}{'fp8_bound fused|blockwise':>28}{'saved MB':>10}"]
    for r in result["chains"]:
        b = r.get("bound", {})
        bound = f"{b['chain_fused_ms']:.3f}" if "chain_fused_ms" in b else "-"
        fb = (f"{b['fp8_bound_fused_ms']:.3f} | {b['fp8_bound_blockwise_ms']:.3f}" if "fp8_bound_fused_ms" in b else "-")
        lines.append(f"{r['name']:<28}{r['M']}x{r['D']}x{r['N']:<8}{_cell(r.get('bf16', {})):>9}"
                     f"{_cell(r.get('fp8_unfused', {})):>18}{_cell(r.get('fp8_fused', {})):>18}"
                     f"{_cell(r.get('fp8_fused_fp8_input', {})):>18}{bound:>13}{fb:>28}{r['bytes']['saved'] / 1e6:>10.1f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workload", default="gem-h200")
    p.add_argument("--chains", default="ln_linear,act_linear,ln_ffn", help="which chain kinds to time")
    p.add_argument("--m-scale", type=float, default=1.0, help="scale M (a quicker run; the bound then has no row)")
    p.add_argument("--warmup-ms", type=int, default=10)
    p.add_argument("--rep-ms", type=int, default=40)
    p.add_argument("--bound-source", type=Path, default=DEFAULT_BOUND_SOURCE,
                   help="an fp8_h200.py result for benchmarks/fp8_bound.py's bound")
    p.add_argument("--topology", default="h200-1gpu", help="preset whose measured copy bandwidth prices the bytes")
    p.add_argument("--commit", default=None, help="git commit to record (default: COPLAN_GIT_COMMIT or git rev-parse)")
    p.add_argument("--out", default=str(HERE / "results" / "fp8_fused_h200.json"))
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("fp8_fused_h200: needs a CUDA GPU with FP8 (compute capability >= 8.9); none here, nothing measured.")
        return 0
    cap = torch.cuda.get_device_capability()
    if cap < (8, 9):
        print(f"fp8_fused_h200: {torch.cuda.get_device_name()} (sm_{cap[0]}{cap[1]}) has no FP8 tensor cores; nothing measured.")
        return 0
    import triton

    import fp8_bound

    kinds = [k for k in args.chains.split(",") if k]
    chains, meta = chains_of(args.workload, args.m_scale)
    chains = [c for c in chains if c["chain"] in kinds]
    try:
        bw = fp8_bound.copy_bandwidth(args.topology)
    except Exception as e:  # a bare device without the spec's data: the H200's measured copy rate
        bw = 4.24e12
        log(f"copy bandwidth of {args.topology} not loaded ({type(e).__name__}: {e}); using {bw:.3g} B/s")
    bounds, bound_meta = {}, dict(source=str(args.bound_source))
    if args.bound_source.is_file():
        src = json.loads(args.bound_source.read_text())
        bounds = {(r["M"], r["K"], r["N"]): r for r in fp8_bound.bound(src, bw)["shapes"]}
        bound_meta.update(device=src.get("device"), date=src.get("date"), torch=src.get("torch"),
                          git_commit=src.get("git_commit"))
    else:
        bound_meta["missing"] = "file not found: no bound printed"
    result = dict(
        benchmark="fp8 written by the producers: InterFormer chains, forward + backward (issue 26)",
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        device=torch.cuda.get_device_name(), capability=list(cap), torch=torch.__version__, triton=triton.__version__,
        cuda=torch.version.cuda, python=platform.python_version(), git_commit=args.commit or git_commit(),
        command=" ".join([sys.executable, *sys.argv]),
        timing=f"triton.testing.do_bench warmup={args.warmup_ms} ms rep={args.rep_ms} ms",
        copy_bandwidth_bytes_per_s=bw, bound_source=bound_meta, **meta, chains=[])
    log(f"device {result['device']} torch {result['torch']} triton {result['triton']}; M = {meta['local_batch']} x "
        f"{meta['mean_history_length']:.0f} x {args.m_scale} rows")
    for c in chains:
        log(f"{c['name']}: M={c['M']} D={c['D']} N={c['N']}")
        result["chains"].append(run_chain(c, args, bw, bounds))
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    print("forward + backward ms (speed-up over bf16); bound = fp8_bound's fused GEMM bound + non-GEMM bytes at "
          f"{bw / 1e12:.2f} TB/s; fp8_bound per its own recipe; saved = unfused - fused HBM bytes")
    print(table(result))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
