"""Compile the attention kernels for a list of cases in parallel processes, ahead of their first use.

Triton compiles a kernel for every specialisation it meets (dtype, head dim, activation, causal,
heads == 1, config), one after another in the calling process: a second or more each on an H200
host. A test session or a benchmark that touches a hundred specialisations spends minutes there.
Running each case once in a pool of processes fills Triton's on-disk cache in parallel; the
caller's own first call then loads the binary instead of compiling it. Nothing here is needed
for correctness: a case left out is simply compiled where it is first used.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Case:
    """One call of an op whose kernels are to be compiled (forward, and backward when ``grad``)."""

    op: str
    """"softmax" or a GDPA activation ("silu", "gelu_tanh", "relu", "relu_squared", "identity")."""
    causal: bool
    heads: int
    head_dim: int
    dtype: str = "float32"
    """torch dtype name of q, k, v."""
    offsets_dtype: str = "int32"
    grad: bool = True
    """Also run the backward (compiles the dQ and dK/dV kernels)."""
    fwd_config: int | None = None
    """Index into the forward's candidate configs (`configs_for("fwd", d)`), as the autotuner would
    try them; None: the configuration an untuned call runs."""


def run_case(case: Case) -> Case:
    """Run ``case`` once on the current CUDA device, with autotuning off (fixed configs)."""
    os.environ["COPLAN_KERNELS_AUTOTUNE"] = "0"
    import torch

    from coplan.kernels import gdpa, jagged_attention
    from coplan.kernels import triton_attention as ta

    if case.fwd_config is not None:
        c = ta.configs_for("fwd", case.head_dim)[case.fwd_config]
        ta.UNTUNED_CONFIGS["fwd"] = (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages)
    else:
        ta.UNTUNED_CONFIGS.pop("fwd", None)
    dtype = getattr(torch, case.dtype)
    offsets = torch.tensor([0, 5, 8], dtype=getattr(torch, case.offsets_dtype), device="cuda")
    q, k, v = (torch.randn(8, case.heads, case.head_dim, device="cuda", dtype=dtype, requires_grad=case.grad)
               for _ in range(3))
    with torch.set_grad_enabled(case.grad):
        if case.op == "softmax":
            out = jagged_attention(q, k, v, offsets, causal=case.causal, max_len=8, validate=False, backend="triton")
        else:
            out = gdpa(q, k, v, offsets, activation=case.op, causal=case.causal, max_len=8, validate=False,
                       backend="triton")
        if case.grad:
            out.backward(torch.randn_like(out))
    torch.cuda.synchronize()
    return case


def compile_in_parallel(cases: list[Case], processes: int = 8, timeout_s: float = 120.0) -> dict:
    """Run every case once in ``processes`` spawned processes; returns what was done and how long it took.

    Never raises for a failing case or a pool that runs past ``timeout_s``: the figures say so and
    the caller compiles what is missing itself.
    """
    t0 = time.perf_counter()
    done, failed = 0, []
    if not cases:
        return dict(cases=0, done=0, failed=[], seconds=0.0)
    ctx = mp.get_context("spawn")
    with ctx.Pool(max(1, min(processes, len(cases)))) as pool:
        pending = [(case, pool.apply_async(run_case, (case,))) for case in cases]
        for case, result in pending:
            left = timeout_s - (time.perf_counter() - t0)
            try:
                result.get(timeout=max(left, 0.1))
                done += 1
            except mp.TimeoutError:
                failed.append(f"{case}: not done within {timeout_s:.0f} s")
                break
            except Exception as e:  # noqa: BLE001  (reported, never fatal)
                failed.append(f"{case}: {type(e).__name__}: {str(e)[:200]}")
        pool.terminate()
    return dict(cases=len(cases), done=done, failed=failed, seconds=time.perf_counter() - t0)
