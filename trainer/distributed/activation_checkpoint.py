"""Activation checkpointing: the plan's recomputed layers keep only their inputs; the rest is recomputed
in backward (``torch.utils.checkpoint``, non-reentrant, through PyTorch's checkpoint wrapper)."""

from __future__ import annotations

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

from coplan.errors import MismatchError


def apply_activation_checkpointing(dense: nn.Module, layers: set[str]) -> list[str]:
    """Wrap the named layers (``<block>.<layer index>``); returns the names wrapped."""
    if not layers:
        return []
    known = {name for name, _, _ in dense.iter_layers()}
    unknown = sorted(layers - known)
    if unknown:
        raise MismatchError(f"the plan recomputes {unknown}, which are not layers of this model ({sorted(known)})")
    done = []
    for name, holder, i in list(dense.iter_layers()):
        if name in layers:
            # RNG state need not be replayed: no layer draws random numbers (no dropout).
            holder[i] = checkpoint_wrapper(holder[i], checkpoint_impl=CheckpointImpl.NO_REENTRANT, preserve_rng_state=False)
            done.append(name)
    return done


__all__ = ["apply_activation_checkpointing"]
