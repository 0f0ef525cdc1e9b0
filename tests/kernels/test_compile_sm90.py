"""Every Triton kernel of coplan.kernels, as the representative calls below launch it, compiles for sm_90.

Why: without a GPU the kernel tests run the kernels in Triton's interpreter, which never runs the
compiler's front end. A kernel the interpreter accepts can still be refused on the GPU (it
happened: `_block_counts_kernel` re-assigned `q_len`, int64 in an `if SORT:` branch, as int32 in a
later loop; "Loop-carried variable q_len has initial type int64 but is re-assigned to int32").
Triton compiles for CUDA without a GPU (ptxas ships with it), so this test does that on CPU.

How: a representative set of real calls runs under the interpreter with a hook on
``InterpretedFunction.run`` (the entry point of every ``kernel[grid](...)`` launch, autotuned ones
included), which records each launch: the kernel, its arguments (tensors by dtype and 16-byte
alignment, ints and floats by value) and its constexprs and launch options (num_warps,
num_stages). The calls run twice:

- as the interpreter runs them (executed): what the CPU kernel tests check, e.g. FAST=False and
  the interpreter's small blocks;
- with the constants a GPU process would pick (``triton_attention.INTERPRETED`` and
  ``fp8_triton._INTERPRETING`` patched to False, ``COPLAN_KERNELS_AUTOTUNE=0``), recorded but not
  executed: FAST=True (inline PTX), the untuned default configs, e4m3 stores, the fp8 kernels'
  GPU tiles. A launch of a kernel that an autotuner wraps (``_fwd_tuned``, ``_block_scaled_mm_kernel``,
  ...) is compiled with the first candidate config the GPU autotuner would try for it (its own
  ``prune_configs``: what an untuned GPU call runs), and with every candidate for the calls
  marked ``all_configs`` (or for all of them with COPLAN_SM90_ALL_CONFIGS=1).

Each distinct launch is then compiled for GPUTarget("cuda", 90, 32) in a subprocess that imports
coplan.kernels without TRITON_INTERPRET (so the kernels are real ``JITFunction``s), with
specialisation computed by Triton's own binder (ints equal to 1 as constexprs, ints divisible by
16 and 16-byte-aligned pointers with the divisibility attribute, as a GPU launch does), in
parallel processes. A kernel that fails to compile, or that needs more shared memory than an
sm_90 block may have (227 KiB: the launch would raise OutOfResources), fails the test with the
kernel, its constexprs and options, the call that launched it and the compiler's message.

What is compiled, chosen to stay fast (2 CPU cores, Triton 3.7.1: 124 distinct compiles of the 11
kernels, ~15 s with a warm Triton cache, a few minutes with an empty one): the interpreter pass at
the CPU tests' sizes (fp32, d = 16); the GPU pass in bf16 at d = 64 for every activation (softmax
and SiLU causal and not, the others one each), every autotune candidate for causal softmax at d = 64
and for the fp8 GEMM (bf16 out, no bias); d = 128 and 256, fp32 (at d = 16) and fp16 (a padded d =
96) at their first config; the block-count kernel sorted at 16 and 1,024 samples and unsorted past
1,024; every fp8 quantisation path. COPLAN_SM90_ALL_CONFIGS=1 compiles every candidate of every
autotuned launch instead (a few hundred compiles, minutes). Left out for time: fp32 attention at d =
64 with the GPU tiles (20-36 s per kernel). Triton's on-disk cache applies (a kernel whose source
and options are unchanged loads instead of recompiling: the same answer); TRITON_CACHE_DIR chooses
where it is.

`test_every_kernel_is_launched` keeps the call list from going stale: every ``*_kernel`` JIT
function in coplan.kernels must be launched by some call here.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import json
import os
import pickle
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import triton.language as tl

ROOT = Path(__file__).resolve().parents[2]
TARGET = ("cuda", 90, 32)  # Hopper (H100/H200): compute capability 9.0, warp size 32
SMEM_LIMIT = 232448  # bytes of shared memory one block may use on sm_90 (227 KiB)
PROCESSES = max(1, min(os.cpu_count() or 1, 8))
# Every autotune candidate of every autotuned launch of the GPU pass, not only of the calls marked
# all_configs: about four times the compile time.
ALL_CONFIGS = os.environ.get("COPLAN_SM90_ALL_CONFIGS", "0") not in ("", "0")
WORKER_TIMEOUT_S = 1700 if ALL_CONFIGS else 540

pytestmark = pytest.mark.timeout(WORKER_TIMEOUT_S + 60)


# --------------------------------------------------------------------------------------------
# Recording launches (test process, Triton interpreter)
# --------------------------------------------------------------------------------------------


def _argument(value):
    """A picklable stand-in for one non-constexpr kernel argument."""
    import torch

    if isinstance(value, torch.Tensor):
        return ("tensor", str(value.dtype).removeprefix("torch."), value.data_ptr() % 16 == 0)
    if isinstance(value, bool):
        return ("bool", value)
    if isinstance(value, int):
        return ("int", value)
    if isinstance(value, float):
        return ("float", value)
    if value is None:
        return ("none",)
    raise TypeError(f"no stand-in for a kernel argument of type {type(value).__name__}")


def _spec_class(arg):
    """What Triton's specialisation distinguishes for an argument (the deduplication key)."""
    if arg[0] == "int":
        v = arg[1]
        return ("int", v == 1, v % 16 == 0, -(2**31) <= v < 2**31)
    if arg[0] == "float":
        return ("float",)
    return arg


class _Recorder:
    """Collects launches seen by ``InterpretedFunction.run``, one per distinct specialisation."""

    def __init__(self):
        self.launches: dict[tuple, dict] = {}
        self.call = ""
        self.phase = ""
        self.execute = True
        self.all_configs = False

    def add(self, interpreted, args, kwargs) -> None:
        fn = interpreted.fn
        params = list(inspect.signature(fn).parameters.values())
        values = {p.name: p.default for p in params}
        values.update(zip((p.name for p in params), args))
        options = {}
        for name, value in kwargs.items():
            if name in values:
                values[name] = value
            elif value is not None:
                options[name] = value
        constexprs, arguments = {}, {}
        for p in params:
            if "constexpr" in str(p.annotation):
                constexprs[p.name] = values[p.name]
            else:
                arguments[p.name] = _argument(values[p.name])
        key = (fn.__module__, fn.__qualname__, tuple((n, _spec_class(a)) for n, a in arguments.items()),
               tuple(constexprs.items()), tuple(sorted(options.items())), self.phase)
        hit = self.launches.get(key)
        if hit is None:
            self.launches[key] = dict(module=fn.__module__, name=fn.__qualname__, arguments=arguments,
                                      constexprs=constexprs, options=options, call=f"{self.call} [{self.phase}]",
                                      gpu=not self.execute, all_configs=self.all_configs)
        elif self.all_configs and not hit["all_configs"]:
            hit.update(all_configs=True, call=f"{self.call} [{self.phase}]")

    @contextlib.contextmanager
    def calling(self, name: str, all_configs: bool = False):
        self.call, self.all_configs = name, all_configs
        try:
            yield
        finally:
            self.call, self.all_configs = "", False


def _attention(rec, op, causal, dtype, d, *, heads=2, lengths=(5, 3), all_configs=False, grad=True):
    """Forward (and backward) of softmax attention or GDPA through the public API."""
    import torch

    from coplan.kernels import gdpa, jagged_attention

    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    total = int(sum(lengths))
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(total, heads, d, generator=g).to(dtype).requires_grad_(grad) for _ in range(3))
    name = f"{'jagged_attention' if op == 'softmax' else f'gdpa {op}'} causal={causal} {dtype} d={d}"
    with rec.calling(name + (" forward+backward" if grad else " forward"), all_configs):
        if op == "softmax":
            out = jagged_attention(q, k, v, offsets, causal=causal, max_len=max(lengths), backend="triton")
        else:
            out = gdpa(q, k, v, offsets, activation=op, causal=causal, max_len=max(lengths), backend="triton")
        if grad:
            out.backward(torch.randn(out.shape, generator=g).to(dtype))


def _block_counts(rec, batch):
    import torch

    from coplan.kernels import triton_attention as ta

    offsets = torch.arange(batch + 1, dtype=torch.int32) * 3
    with rec.calling(f"block_counts batch={batch}"):
        ta.block_counts(offsets, offsets.clone())


def _fp8(rec, gpu: bool):
    """The quantisation passes of both recipes and the block-scaled GEMM (shapes that keep every
    GEMM autotune candidate after its prune on the GPU pass: M, N >= 256)."""
    import torch

    from coplan.kernels import fp8_triton as ft

    g = torch.Generator().manual_seed(0)
    m, k, n = (256, 256, 256) if gpu else (20, 200, 24)
    x = torch.randn(m, k, generator=g)
    xb = x.to(torch.bfloat16)
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    with rec.calling("quant_rows (rows contiguous and a transposed view)"):
        ft.quant_rows(xb, 16, rows_granule=16)
        ft.quant_rows(xb.t(), 16)
        ft.quant_rows(x, 16)
    with rec.calling("quant_rows split (two passes, rows contiguous and a transposed view)"):
        ft.quant_rows(xb, 16, split=True)
        ft.quant_rows(xb.t(), 16, split=True)
    with rec.calling("quant_tiles (1x128 tiles, 128x128 blocks; rows contiguous and transposed)"):
        for square in (False, True):
            ft.quant_tiles(xb, square)
            ft.quant_tiles(xb.t(), square)
    with rec.calling("quant_act_dual / quant_weight_dual"):
        ft.quant_act_dual(xb, with_t=True)
        ft.quant_act_dual(xb, with_t=False)
        ft.quant_weight_dual(w, with_t=True)
        ft.quant_weight_dual(w, with_t=False)
    qa = ft.quant_act_dual(xb, with_t=False)
    for b_square in (True, False):
        qb = ft.quant_weight_dual(w, with_t=False) if b_square else ft.quant_act_dual(w, with_t=False)
        for bias, out_dtype in ((None, torch.bfloat16), (torch.randn(n, generator=g).to(torch.bfloat16), torch.bfloat16),
                                (None, torch.float32)):
            name = f"block_scaled_mm b_square={b_square} bias={bias is not None} out={out_dtype}"
            with rec.calling(name, all_configs=gpu and bias is None and out_dtype == torch.bfloat16):
                ft.block_scaled_mm(qa.q, qa.s, qb.q, qb.s, n=n, b_square=b_square, bias=bias, out_dtype=out_dtype)


def _fp8_fused(rec, gpu: bool):
    """The producers that write fp8 operands (``kernels/fp8_fused.py``): LayerNorm and the activations, forward and
    backward, with and without the transposed tiles, e4m3 and e5m2."""
    import torch

    from coplan.kernels import fp8_fused as ff

    g = torch.Generator().manual_seed(1)
    m, d = (256, 256) if gpu else (40, 200)
    dt = torch.bfloat16 if gpu else torch.float32
    x = torch.randn(m, d, generator=g).to(dt)
    w, b = torch.randn(d, generator=g).to(dt), torch.randn(d, generator=g).to(dt)
    with rec.calling("layernorm_quant (with and without the transposed tiles)"):
        for with_t in (False, True):
            ln = ff.layernorm_quant(x, w, b, with_t=with_t, return_y=with_t)
    with rec.calling("layernorm_backward_quant (e4m3 and e5m2, residual gradient)"):
        for fp8_dtype, res in ((ff.E4M3, None), (torch.float8_e5m2, x)):
            ff.layernorm_backward_quant(x, x, w, ln.mean, ln.rstd, residual_grad=res, with_t=res is not None, fp8_dtype=fp8_dtype)
    for kind in ("silu", "gelu_tanh", "swiglu"):
        h = torch.randn(m, 2 * d if kind == "swiglu" else d, generator=g).to(dt)
        with rec.calling(f"act_quant / act_backward_quant {kind}"):
            ff.act_quant(h, kind, with_t=True, return_a=True)
            ff.act_backward_quant(torch.randn(m, d, generator=g).to(dt), h, kind, return_dh=True, with_t=True)


def _film_norm(rec, gpu: bool):
    """The fused FiLM LayerNorm (``kernels/film_norm.py``), forward and backward: samples shorter than a row block
    and longer, a width that is not a multiple of the chunk."""
    import torch

    from coplan.kernels.film_norm import film_layer_norm

    g = torch.Generator().manual_seed(2)
    lengths = [40, 3, 0, 90] if gpu else [20, 3, 0, 9]
    d = 320 if gpu else 96
    dt = torch.bfloat16 if gpu else torch.float32
    seg = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    h = torch.randn(len(seg), d, generator=g).to(dt).requires_grad_()
    w, b = torch.randn(d, generator=g).to(dt).requires_grad_(), torch.randn(d, generator=g).to(dt).requires_grad_()
    gb = torch.randn(len(lengths), 2 * d, generator=g).to(dt).requires_grad_()
    with rec.calling("film_layer_norm forward and backward"):
        gamma, beta = gb.chunk(2, dim=-1)
        out = film_layer_norm(h, w, b, gamma, beta, seg)
        out.backward(torch.ones_like(out))


_OPS = ("softmax", "silu", "gelu_tanh", "relu", "relu_squared", "identity")


def _interpreter_calls(rec):
    """Executed by the interpreter: small, as the CPU kernel tests run them (FAST=False, 16-row blocks)."""
    import torch

    for op, causal in (("softmax", True), ("softmax", False), ("silu", True), ("gelu_tanh", False)):
        _attention(rec, op, causal, torch.float32, 16)
    _block_counts(rec, 1025)  # unsorted (over the 1,024 samples one sort handles)
    _fp8(rec, gpu=False)
    _fp8_fused(rec, gpu=False)
    _film_norm(rec, gpu=False)


def _gpu_calls(rec):
    """Recorded with the GPU's constants, not executed: the specialisations an H200 run compiles.
    Every activation at d = 64 (softmax and SiLU causal and not), every autotune candidate for causal
    softmax at d = 64 (and, in _fp8, for the GEMM); the other head-dim buckets and dtypes at their
    first config."""
    import torch

    bf16 = torch.bfloat16
    for op, causal in (("softmax", True), ("softmax", False), ("silu", True), ("silu", False), ("gelu_tanh", True),
                       ("relu", False), ("relu_squared", True), ("identity", False)):
        _attention(rec, op, causal, bf16, 64, all_configs=op == "softmax" and causal)
    _attention(rec, "silu", True, bf16, 128)
    _attention(rec, "softmax", True, bf16, 256)
    _attention(rec, "softmax", True, torch.float32, 16, heads=1)  # fp32 (ieee dots) at the GPU tests' d; heads == 1
    _attention(rec, "silu", False, torch.float16, 96)  # a padded head dim
    for batch in (3, 1024, 1025):  # sorted (one CHUNK of the next power of two), sorted at 1,024, unsorted
        _block_counts(rec, batch)
    _fp8(rec, gpu=True)
    _fp8_fused(rec, gpu=True)
    _film_norm(rec, gpu=True)


def record_launches() -> list[dict]:
    """Run the representative calls under the interpreter; the distinct launches they made."""
    import torch
    from triton.runtime.interpreter import InterpretedFunction

    from coplan.kernels import fp8_triton as ft
    from coplan.kernels import triton_attention as ta

    rec = _Recorder()
    original = InterpretedFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        if not warmup:
            rec.add(self, args, kwargs)
        if rec.execute:
            return original(self, *args, grid=grid, warmup=warmup, **kwargs)
        return None

    with pytest.MonkeyPatch.context() as mp, torch.random.fork_rng():
        mp.setattr(InterpretedFunction, "run", run)
        rec.phase, rec.execute = "interpreter", True
        _interpreter_calls(rec)
        # A GPU process's constants: FAST kernels, the untuned default configs, e4m3 stores, GPU tiles.
        rec.phase, rec.execute = "GPU constants, not executed", False
        mp.setenv("COPLAN_KERNELS_AUTOTUNE", "0")
        mp.setattr(ta, "INTERPRETED", False)
        mp.setattr(ta, "UNTUNED_CONFIGS", {})
        mp.setattr(ta, "_CONSTS", {})
        mp.setattr(ft, "_INTERPRETING", False)
        from coplan.kernels import fp8_fused as ff

        mp.setattr(ff, "_check_runnable", lambda t, name: None)  # CPU tensors stand in for the GPU's here
        _gpu_calls(rec)
    return list(rec.launches.values())


# --------------------------------------------------------------------------------------------
# Compiling them (a subprocess without TRITON_INTERPRET; this file run as a script)
# --------------------------------------------------------------------------------------------


class _Arg:
    """A tensor argument as Triton's binder sees it: a dtype and a data pointer (16-byte aligned or not)."""

    def __init__(self, dtype, aligned: bool):
        self.dtype = dtype
        self._ptr = 0 if aligned else 8

    def data_ptr(self) -> int:
        return self._ptr


def _jit_function(obj):
    from triton.runtime.jit import JITFunction

    while not isinstance(obj, JITFunction):
        obj = obj.fn
    return obj


def _values(job) -> list:
    import torch

    out = []
    for a in job["arguments"].values():
        if a[0] == "tensor":
            out.append(_Arg(getattr(torch, a[1]), a[2]))
        elif a[0] == "none":
            out.append(None)
        else:
            out.append(a[1])
    return out


_BACKEND = None


def _specialise(job):
    """(JITFunction, signature, constexprs, attrs, options) of a launch, as JITFunction.run computes
    them on a GPU (Triton 3.6/3.7's binder), for the sm_90 target."""
    global _BACKEND
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    if _BACKEND is None:
        _BACKEND = make_backend(GPUTarget(*TARGET))
    jf = _jit_function(getattr(importlib.import_module(job["module"]), job["name"]))
    kwargs = dict(job["constexprs"], **job["options"])
    # as JITFunction.run sets them
    kwargs["debug"] = kwargs.get("debug", getattr(jf, "debug", None)) or knobs.runtime.debug
    kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
    binder = create_function_from_signature(jf.signature, jf.params, _BACKEND)
    bound, specialization, options = binder(*_values(job), **kwargs)
    options, signature, constexprs, attrs = jf._pack_args(_BACKEND, kwargs, bound, specialization, options)
    return jf, signature, constexprs, attrs, options


def _variants(job) -> list[dict]:
    """What to compile for one recorded launch. Under the interpreter: the launch as recorded. With
    the GPU's constants, for a kernel that an autotuner wraps: the first candidate config the GPU
    autotuner would try for these arguments (what an untuned call runs), or every candidate
    (``all_configs``); for any other kernel, the launch as recorded."""
    from triton.runtime.autotuner import Autotuner

    module = importlib.import_module(job["module"])
    jf = _jit_function(getattr(module, job["name"]))
    tuners = [(attr, t) for attr, t in vars(module).items() if isinstance(t, Autotuner) and _jit_function(t) is jf]
    if not job["gpu"] or not tuners:
        return [dict(job, variant="as launched")]
    out = []
    for attr, tuner in tuners:
        config_keys = set(tuner.configs[0].all_kwargs()) if tuner.configs else set()
        kwargs = {k: v for k, v in dict(job["constexprs"], **job["options"]).items() if k not in config_keys}
        tuner.nargs = dict(zip(tuner.arg_names, _values(job)))
        try:
            configs = tuner.prune_configs(kwargs)
        finally:
            tuner.nargs = None
        for i, config in enumerate(configs if job["all_configs"] or ALL_CONFIGS else configs[:1]):
            every = config.all_kwargs()
            out.append(dict(job, variant=f"{attr} candidate {i} of {len(configs)}",
                            constexprs={k: every.get(k, v) for k, v in job["constexprs"].items()},
                            options={**{k: v for k, v in job["options"].items() if k not in every},
                                     **{k: v for k, v in every.items() if k not in job["constexprs"]}}))
    return out


def _compile(job) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    t0 = time.perf_counter()
    result = dict(job, ok=False, error=None, shared=None)
    try:
        jf, signature, constexprs, attrs, options = _specialise(job)
        result["signature"] = {k: v for k, v in signature.items() if v != "constexpr"}
        kernel = triton.compile(ASTSource(jf, signature, constexprs, attrs), target=GPUTarget(*TARGET),
                                options=options.__dict__)
        result["shared"] = int(kernel.metadata.shared)
        if "cubin" not in kernel.asm:
            result["error"] = f"no cubin among the compiler's outputs ({sorted(kernel.asm)})"
        elif result["shared"] > SMEM_LIMIT:
            result["error"] = (f"needs {result['shared']} bytes of shared memory, more than the {SMEM_LIMIT} an sm_90 "
                               "block may have: the launch would raise OutOfResources")
        else:
            result["ok"] = True
    except Exception as e:  # noqa: BLE001  (reported per kernel)
        result["error"] = f"{type(e).__name__}: {e}"
    result["seconds"] = round(time.perf_counter() - t0, 2)
    return result


def _probe_kernel(x_ptr, n, BLOCK: tl.constexpr):
    """A trivial kernel: can this Triton compile for sm_90 here at all?"""
    i = tl.arange(0, BLOCK)
    tl.store(x_ptr + i, tl.load(x_ptr + i, mask=i < n) * 2.0, mask=i < n)


def _probe() -> str | None:
    """None if this Triton compiles a trivial kernel for sm_90 here, else why not."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    try:
        kernel = triton.compile(ASTSource(JITFunction(_probe_kernel), {"x_ptr": "*fp32", "n": "i32", "BLOCK": "constexpr"},
                                          constexprs={"BLOCK": 128}), target=GPUTarget(*TARGET))
        if "cubin" not in kernel.asm:
            return f"Triton {triton.__version__} produced no cubin for sm_90 ({sorted(kernel.asm)})"
    except Exception as e:  # noqa: BLE001
        return f"Triton {triton.__version__} cannot compile for sm_90 on this machine: {type(e).__name__}: {e}"
    return None


def _worker(spec_path: str, out_path: str, processes: int) -> None:
    os.environ.pop("TRITON_INTERPRET", None)
    t0 = time.perf_counter()
    report = dict(unavailable=_probe(), results=[], duplicates=0)
    if report["unavailable"] is None:
        import triton.runtime.jit as jit

        missing = [n for n in ("create_function_from_signature",) if not hasattr(jit, n)]
        missing += [] if hasattr(jit.JITFunction, "_pack_args") else ["JITFunction._pack_args"]
        if missing:
            report["unavailable"] = f"this Triton lacks {missing}, which the test uses to specialise launches"
    if report["unavailable"] is None:
        with open(spec_path, "rb") as f:
            launches = pickle.load(f)
        jobs, seen = [], set()
        for launch in launches:
            try:
                variants = _variants(launch)
            except Exception as e:  # noqa: BLE001  (reported as this launch's failure)
                report["results"].append(dict(launch, variant="its autotuner's candidates", ok=False, shared=None,
                                              seconds=0.0, error=f"{type(e).__name__}: {e}"))
                continue
            for job in variants:
                try:
                    _, signature, constexprs, attrs, options = _specialise(job)
                    key = (job["module"], job["name"], repr(signature), repr(sorted(constexprs.items())),
                           repr(sorted(attrs.items())), repr(options.hash()))
                except Exception:  # noqa: BLE001  (_compile reports it)
                    key = (job["module"], job["name"], repr(job["arguments"]), repr(job["constexprs"]),
                           repr(job["options"]))
                if key in seen:
                    report["duplicates"] += 1
                    continue
                seen.add(key)
                jobs.append(job)
        # Longest first (the attention kernels with big tiles), so the pool's tail is short.
        jobs.sort(key=lambda j: (j["module"].endswith("attention"), j["options"].get("num_stages", 0),
                                 j["constexprs"].get("BLOCK_M", 0) * j["constexprs"].get("BLOCK_N", 0)), reverse=True)
        if processes > 1 and len(jobs) > 1:
            import multiprocessing as mp

            with mp.get_context("fork").Pool(processes) as pool:
                report["results"] += pool.map(_compile, jobs, chunksize=1)
        else:
            report["results"] += [_compile(j) for j in jobs]
    report["seconds"] = round(time.perf_counter() - t0, 1)
    with open(out_path, "w") as f:
        json.dump(report, f, default=repr)


def compile_launches(launches: list[dict], processes: int = PROCESSES) -> dict:
    """Compile the recorded launches for sm_90 in a subprocess; its report."""
    with tempfile.TemporaryDirectory(prefix="coplan_sm90_") as tmp:
        spec, out = Path(tmp, "launches.pkl"), Path(tmp, "report.json")
        with open(spec, "wb") as f:
            pickle.dump(launches, f)
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
        try:
            proc = subprocess.run([sys.executable, __file__, "--compile-worker", str(spec), str(out), str(processes)],
                                  cwd=ROOT, env=env, capture_output=True, text=True, timeout=WORKER_TIMEOUT_S)
        except subprocess.TimeoutExpired as e:
            pytest.fail(f"compiling {len(launches)} launches for sm_90 took over {WORKER_TIMEOUT_S} s: "
                        f"{(e.stderr or '')[-2000:]}")
        if proc.returncode != 0 or not out.exists():
            pytest.fail(f"the sm_90 compile worker failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
        return json.loads(out.read_text())


def _describe(r: dict) -> str:
    consts = ", ".join(f"{k}={v!r}" for k, v in r["constexprs"].items())
    opts = ", ".join(f"{k}={v!r}" for k, v in sorted(r["options"].items()))
    sig = ", ".join(f"{k}: {v}" for k, v in (r.get("signature") or {}).items())
    error = r["error"].strip()
    if len(error) > 3000:
        error = error[:1500] + "\n[...]\n" + error[-1500:]
    return (f"{r['module']}.{r['name']} ({r['variant']}), launched by {r['call']}\n"
            f"  constexprs: {consts}\n  options: {opts or '(defaults)'}\n  signature: {sig or '?'}\n"
            f"  error: {error}")


# --------------------------------------------------------------------------------------------
# Tests
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def launches():
    from coplan.kernels import triton_attention as ta

    if not ta.INTERPRETED:
        pytest.skip("the kernels are not run by Triton's interpreter here (a CUDA machine): the GPU kernel tests "
                    "compile them for this GPU themselves")
    return record_launches()


@pytest.fixture(scope="module")
def report(launches):
    t0 = time.perf_counter()
    rep = compile_launches(launches)
    if rep["unavailable"]:
        pytest.skip(rep["unavailable"])
    rep["wall"] = time.perf_counter() - t0
    return rep


def _kernels_in_package() -> set[tuple[str, str]]:
    """(module, name) of every ``*_kernel`` JIT function in coplan.kernels (modules that use triton.jit)."""
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    found = set()
    for path in sorted((ROOT / "kernels").glob("*.py")):
        if not re.search(r"@triton\.(jit|autotune)", path.read_text()):
            continue
        module = importlib.import_module(f"coplan.kernels.{path.stem}")
        for name, obj in vars(module).items():
            if name.endswith("_kernel") and isinstance(obj, (JITFunction, InterpretedFunction, Autotuner)):
                fn = obj
                while isinstance(fn, Autotuner):
                    fn = fn.fn
                found.add((fn.fn.__module__, fn.fn.__qualname__))
    return found


def test_every_kernel_is_launched(launches):
    launched = {(launch["module"], launch["name"]) for launch in launches}
    missing = sorted(_kernels_in_package() - launched)
    assert not missing, (f"no representative call launches {missing}: add a call that does to _interpreter_calls / "
                         "_gpu_calls in tests/kernels/test_compile_sm90.py, so that it is compiled for sm_90 here")


def test_kernels_compile_for_sm90(report):
    results = report["results"]
    assert results, "nothing was compiled"
    failed = [r for r in results if not r["ok"]]
    kernels = sorted({r["name"] for r in results})
    print(f"\nsm_90: {len(results)} distinct compiles of {len(kernels)} kernels ({report['duplicates']} duplicates "
          f"skipped), {len(failed)} failed, {report['wall']:.1f} s with {PROCESSES} processes; slowest: "
          + ", ".join(f"{r['name']} {r['seconds']:.1f} s" for r in sorted(results, key=lambda r: -r["seconds"])[:3]))
    if failed:
        pytest.fail(f"{len(failed)} of {len(results)} kernel specialisations do not compile for sm_90 (the "
                    "interpreter accepts them; a GPU would refuse them):\n\n" + "\n\n".join(map(_describe, failed)),
                    pytrace=False)


if __name__ == "__main__" and len(sys.argv) == 5 and sys.argv[1] == "--compile-worker":
    _worker(sys.argv[2], sys.argv[3], int(sys.argv[4]))
