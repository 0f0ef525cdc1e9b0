"""Kernel tests run the Triton kernels on CPU through Triton's interpreter when there is no GPU.

`triton.jit` reads TRITON_INTERPRET when a kernel is decorated, so it is set here, before this
package's test modules import `coplan.kernels`.

On a GPU the tests run the kernels compiled, without autotuning (COPLAN_KERNELS_AUTOTUNE=0: each
kernel runs its first candidate config; the autotuning test turns it back on), and before the
first test the specialisations they use are compiled in parallel processes
(`tests/kernels/precompile.py`), which fills Triton's on-disk cache: a hundred compiles one after
another would take minutes. COPLAN_KERNEL_TESTS_PRECOMPILE=0 skips that step.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"

_already = sys.modules.get("coplan.kernels.triton_attention")
if _already is not None and not HAS_CUDA and type(_already._fwd_kernel).__name__ != "InterpretedFunction":
    # Another test package imported the kernels first, without the interpreter: every Triton test
    # here would fail on a CPU tensor. Say why instead.
    raise pytest.UsageError("coplan.kernels was imported before tests/kernels/conftest.py could set TRITON_INTERPRET=1; "
                            "set TRITON_INTERPRET=1 in the environment or run tests/kernels on its own")

DEVICE = "cuda" if HAS_CUDA else "cpu"
gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")

if HAS_CUDA:
    os.environ.setdefault("COPLAN_KERNELS_AUTOTUNE", "0")

_OPS = ("softmax", "silu", "gelu_tanh", "relu", "relu_squared", "identity")


def _gpu_cases():
    """The specialisations the kernel tests meet on a GPU (what a miss costs: one compile in the test)."""
    from .precompile import Case

    cases = [Case(op, causal, heads, 16) for op in _OPS for causal in (True, False) for heads in (1, 2)]
    cases += [Case(op, causal, 2, 16, "bfloat16") for op in _OPS for causal in (True, False)]
    cases += [Case(op, True, 2, d) for op in ("softmax", "silu") for d in (32, 64)]
    cases += [Case(op, True, 2, 16, offsets_dtype="int64") for op in ("softmax", "silu")]
    cases += [Case(op, True, 4, 64, "bfloat16") for op in ("softmax", "silu")]
    # The autotuning test's candidates (forward only, GDPA-SiLU, d = 64).
    from coplan.kernels.triton_attention import configs_for

    cases += [Case("silu", True, 2, 64, "bfloat16", grad=False, fwd_config=i) for i in range(len(configs_for("fwd", 64)))]
    return cases


@pytest.fixture(scope="session", autouse=True)
def _kernels_compiled_ahead():
    if HAS_CUDA and os.environ.get("COPLAN_KERNEL_TESTS_PRECOMPILE", "1") != "0":
        from .precompile import compile_in_parallel

        cases = _gpu_cases()
        report = compile_in_parallel(cases, processes=min(16, os.cpu_count() or 1), timeout_s=150)
        print(f"\nkernel tests: compiled {report['done']}/{report['cases']} cases ahead in {report['seconds']:.1f} s"
              + (f"; not done: {report['failed'][:3]}" if report["failed"] else ""), file=sys.stderr)
    yield
