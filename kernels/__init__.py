"""Jagged attention kernels (softmax and GDPA): Triton kernels, PyTorch references, dispatch.

Each op has three homes: `triton_attention.py` (kernels, autotuning, launchers) registered as
custom ops with autograd in `ops.py`; a dense reference in `reference.py`; and the dispatcher in
`api.py`, which checks inputs once and picks a backend. Imports nothing of the rest of coplan.
"""

from __future__ import annotations

from . import ops as _ops  # noqa: F401  (registers torch.ops.coplan.*)
from .api import gdpa, jagged_attention
from .common import Activation, Backend, JaggedInputError

__all__ = ["Activation", "Backend", "JaggedInputError", "attention_flops", "attention_pairs", "gdpa", "jagged_attention"]


def attention_pairs(q_len: int, k_len: int, causal: bool) -> int:
    """(query, key) pairs one head scores for one sample, under the bottom-right causal rule."""
    if not causal:
        return q_len * k_len
    n = min(q_len, k_len)  # queries that see at least one key; they see k_len - n + 1 ... k_len keys
    return n * (2 * k_len - n + 1) // 2


def attention_flops(q_lengths, k_lengths, heads: int, head_dim: int, causal: bool) -> int:
    """Forward FLOPs on real lengths: QK^T and PV, 2 * pairs * head_dim each, per head.

    The backward is 2.5x this (five matrix products against two) for softmax and GDPA alike.
    Kept here only until `coplan.costmodel.flops` provides the shared formula.
    """
    k_lengths = q_lengths if k_lengths is None else k_lengths
    pairs = sum(attention_pairs(int(a), int(b), causal) for a, b in zip(q_lengths, k_lengths, strict=True))
    return 4 * head_dim * heads * pairs
