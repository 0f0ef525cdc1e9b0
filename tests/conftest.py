"""Shared test setup: hypothesis profiles (CI runs the same number of examples as a developer), and
Triton's interpreter on machines without a GPU.

`triton.jit` reads TRITON_INTERPRET when a kernel is decorated, i.e. when `coplan.kernels` is first
imported, and the trainer tests import it before tests/kernels is collected: so it is set here, at
the root, before any test module is imported.
"""

import os

from hypothesis import HealthCheck, settings

try:
    import torch

    _HAS_CUDA = torch.cuda.is_available()
except ImportError:  # the planning half's tests need no torch
    _HAS_CUDA = False
if not _HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

settings.register_profile(
    "coplan",
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    derandomize=False,
    print_blob=True,
)
settings.load_profile("coplan")
