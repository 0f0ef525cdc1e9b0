"""Activation checkpointing: the plan's recomputed layers keep only their inputs; the rest is recomputed
in backward (``torch.utils.checkpoint``, non-reentrant, through PyTorch's checkpoint wrapper).

A layer can run on tensors swapped in for its parameters (``swapped_weights``): the CUDA-graph runner
(:class:`coplan.trainer.graphs.DenseGraphs`) calls the dense arch through ``torch.func.functional_call`` with
the fp32 masters cast to the compute dtype, and that swap ends when the forward returns. The recompute in
backward would then run on the masters (fp32 weights against bf16 activations). So each wrapped layer then records,
at its forward, the swapped-in tensors (plain tensors where its parameters are ``nn.Parameter`` objects) and
swaps the same tensors in again for its recompute (:func:`_same_tensors`). Under FSDP2 the parameters at
forward are FSDP's own unsharded ``nn.Parameter`` objects, which it gathers again before the recompute: nothing
is recorded and nothing swapped."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper
from torch.nn.utils.stateless import _reparametrize_module

from coplan.errors import MismatchError


def _swapped_in(module: nn.Module) -> dict[str, torch.Tensor]:
    """The module's parameters that are swapped-in plain tensors (not ``nn.Parameter``), by dotted name."""
    return {n: p for n, p in module.named_parameters(remove_duplicate=False) if not isinstance(p, nn.Parameter)}


def _same_tensors(module: nn.Module) -> Callable[[], tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]]:
    """``context_fn`` for ``torch.utils.checkpoint``: the forward's context records the tensors swapped in for
    ``module``'s parameters; the recompute's swaps them in again where the module then holds others."""

    def context_fn():
        held: dict[str, torch.Tensor] = {}

        @contextlib.contextmanager
        def record() -> Iterator[None]:
            held.update(_swapped_in(module))
            yield

        @contextlib.contextmanager
        def replay() -> Iterator[None]:
            now = dict(module.named_parameters(remove_duplicate=False))
            if not held or all(now.get(n) is t for n, t in held.items()):
                yield
                return
            with _reparametrize_module(module, held, strict=False):
                yield

        return record(), replay()

    return context_fn


def apply_activation_checkpointing(dense: nn.Module, layers: set[str], *, swapped_weights: bool = False) -> list[str]:
    """Wrap the named layers (``<block>.<layer index>``); returns the names wrapped. ``swapped_weights``: the
    layers run on weights swapped in for their forward (the CUDA-graph runner's eager layers), which their
    recompute swaps in again (:func:`_same_tensors`). Not for compiled layers: under ``torch.compile`` a
    checkpoint's ``context_fn`` must be a selective-checkpoint one (the graph runner refuses compiled layers
    that recompute, ``coplan.trainer.graphs.graphs_unavailable``)."""
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
            layer = holder[i]
            extra = {"context_fn": _same_tensors(layer)} if swapped_weights else {}
            holder[i] = checkpoint_wrapper(layer, checkpoint_impl=CheckpointImpl.NO_REENTRANT, preserve_rng_state=False, **extra)
            done.append(name)
    return done


__all__ = ["apply_activation_checkpointing"]
