"""Jagged attention kernels (softmax and GDPA): Triton kernels, PyTorch references, dispatch.

Each op has three homes: `triton_attention.py` (kernels, autotuning, launchers) registered as
custom ops with autograd in `ops.py`; a dense reference in `reference.py`; and the dispatcher in
`api.py`, which checks inputs once and picks a backend. Imports nothing of the rest of coplan.
"""

from __future__ import annotations

from . import ops as _ops  # noqa: F401  (registers torch.ops.coplan.*)
from .api import gdpa, jagged_attention
from .common import Activation, Backend, JaggedInputError, autotune_seconds

__all__ = ["Activation", "Backend", "JaggedInputError", "autotune_seconds", "gdpa", "jagged_attention"]

# FLOPs of these ops: `coplan.costmodel.flops.attention_flops`, the project's one formula (not
# imported here: kernels import nothing of coplan).
