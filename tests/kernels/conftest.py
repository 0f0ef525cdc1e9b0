"""Kernel tests run the Triton kernels on CPU through Triton's interpreter when there is no GPU.

`triton.jit` reads TRITON_INTERPRET when a kernel is decorated, so it is set here, before this
package's test modules import `coplan.kernels`.
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
