"""The public entry points: check jagged inputs once, then hand them to the chosen backend.

Shape, dtype and device checks cost O(1) host work and always run (one combined test on the
common path; the checks that name the bad argument only when it fails). Checking offset values
(monotone, in range, within ``max_len``) needs one device-to-host read: it runs unless
``validate=False``, once per offsets tensor and version (the result is kept on the tensor, so the
layers of a model called on one batch read it back once), and is skipped inside
``torch.compile``, where no value can be read while tracing. With ``validate=False`` and
``max_len`` given, a call never waits for the device.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from .common import Activation, Backend, JaggedInputError, parse_activation, parse_backend
from .ops import eager_gdpa, eager_softmax_attention
from .reference import gdpa_reference, jagged_attention_reference
from .triton_attention import interpreting

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_MAX_TRITON_HEAD_DIM = 256


class _Checked(NamedTuple):
    # A NamedTuple, not a frozen dataclass: built on every call, and a tuple is cheaper to build.
    k_offsets: torch.Tensor
    max_q_len: int
    """Bound on query lengths that sizes the launch grid (the batch's own maximum when it was read)."""
    max_k_len: int
    """Bound on key lengths (same rule)."""


def _check_tensor(name: str, x, expect: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise JaggedInputError(f"{name} must be a torch.Tensor of shape {expect}; got {type(x).__name__}")
    if x.dim() != 3:
        raise JaggedInputError(f"{name} must have shape {expect}; got {tuple(x.shape)} ({x.dim()} dims). "
                               "Jagged values are [total_tokens, heads, head_dim]: flatten the batch with its offsets")


def _check_offsets_meta(name: str, offsets, device: torch.device) -> None:
    if not isinstance(offsets, torch.Tensor):
        raise JaggedInputError(f"{name} must be a 1-D integer torch.Tensor [batch + 1]; got {type(offsets).__name__}")
    if offsets.dim() != 1 or offsets.numel() < 1:
        raise JaggedInputError(f"{name} must be 1-D with batch + 1 >= 1 entries; got shape {tuple(offsets.shape)}")
    if offsets.dtype not in (torch.int32, torch.int64):
        raise JaggedInputError(f"{name} must be int32 or int64; got {offsets.dtype}. Convert with {name}.to(torch.int32)")
    if offsets.device != device:
        raise JaggedInputError(f"{name} is on {offsets.device} but q is on {device}; move it with {name}.to(q.device)")


def _check_offset_values(name: str, offsets: torch.Tensor, total: int, rows_of: str, max_len: int | None) -> tuple[int, int]:
    """Reads ``offsets`` once; returns (min length, max length) or raises naming the first bad entry."""
    lengths = offsets[1:] - offsets[:-1]
    if lengths.numel():
        stats = torch.stack([offsets[0], offsets[-1], lengths.min(), lengths.max()]).tolist()
    else:
        stats = [int(offsets[0]), int(offsets[-1]), 0, 0]
    first, last, shortest, longest = (int(s) for s in stats)
    if first != 0:
        raise JaggedInputError(f"{name}[0] is {first}; offsets must start at 0")
    if last != total:
        raise JaggedInputError(f"{name}[-1] is {last} but {rows_of} has {total} rows; "
                               f"the last offset must equal {rows_of}.shape[0] so that every row belongs to a sample")
    if shortest < 0:
        i = int(torch.nonzero(lengths < 0)[0])
        a, b = (int(x) for x in offsets[i:i + 2].tolist())
        raise JaggedInputError(f"{name} must be non-decreasing; {name}[{i}] = {a} > {name}[{i + 1}] = {b}")
    if max_len is not None and longest > max_len:
        i = int(torch.argmax(lengths))
        raise JaggedInputError(f"sample {i} has {longest} tokens in {name}, more than max_len={max_len}; "
                               "raise max_len or truncate the sequence")
    return shortest, longest


_OFFSET_DTYPES = (torch.int32, torch.int64)
_DTYPE_SET, _OFFSET_DTYPE_SET = frozenset(_DTYPES), frozenset(_OFFSET_DTYPES)


def _meta_ok(q, k, v, q_offsets, k_offsets) -> bool:
    """Whether CUDA inputs pass every shape, dtype and device check, in one expression.

    The common case costs a few attribute reads instead of the ~40 Python-level checks that
    name the first bad argument; those run only when this says no (or for CPU tensors, whose
    devices ``get_device`` does not tell apart).
    """
    T = torch.Tensor
    if not (isinstance(q, T) and isinstance(k, T) and isinstance(v, T) and isinstance(q_offsets, T)):
        return False
    qs, ks = q.shape, k.shape
    dt = q.dtype
    dev = q.get_device()
    # Sizes compared entry by entry (no sliced torch.Size objects), dtypes looked up in sets.
    if not (len(qs) == 3 and ks == v.shape and len(ks) == 3 and qs[1] == ks[1] and qs[2] == ks[2] and dt in _DTYPE_SET
            and k.dtype is dt and v.dtype is dt and dev >= 0 and k.get_device() == dev and v.get_device() == dev
            and q_offsets.dim() == 1 and q_offsets.numel() >= 1 and q_offsets.dtype in _OFFSET_DTYPE_SET
            and q_offsets.get_device() == dev):
        return False
    if k_offsets is None:
        return ks[0] == qs[0]
    return (isinstance(k_offsets, T) and k_offsets.dim() == 1 and k_offsets.numel() == q_offsets.numel()
            and k_offsets.dtype in _OFFSET_DTYPE_SET and k_offsets.get_device() == dev)


# Offsets already validated, kept on the offsets tensor like the block counts: (version, rows,
# max_len, min and max length). A model's layers on one batch then read the offsets back once.
_VALIDATED = "_coplan_validated"


def _validated_lengths(name: str, offsets: torch.Tensor, total: int, rows_of: str, max_len: int | None) -> int:
    """The longest sample in ``offsets`` after checking it, reading the device once per offsets version."""
    hit = getattr(offsets, _VALIDATED, None)
    if hit is not None and hit[0] == offsets._version and hit[1] == total and hit[2] == max_len:
        return hit[3]
    _, longest = _check_offset_values(name, offsets, total, rows_of, max_len)
    if not (offsets.is_cuda and torch.cuda.is_current_stream_capturing()):
        setattr(offsets, _VALIDATED, (offsets._version, total, max_len, longest))
    return longest


def _check(q, k, v, q_offsets, k_offsets, max_len, validate: bool) -> _Checked:
    if _meta_ok(q, k, v, q_offsets, k_offsets) and (max_len is None or (type(max_len) is int and max_len >= 0)):
        if k_offsets is None:
            k_offsets = q_offsets
        if not validate and max_len is not None:
            return _Checked(k_offsets, max_len, max_len)
    else:
        k_offsets = _check_meta(q, k, v, q_offsets, k_offsets, max_len)
    return _check_values(q, k, q_offsets, k_offsets, max_len, validate)


def _check_meta(q, k, v, q_offsets, k_offsets, max_len) -> torch.Tensor:
    """Shape, dtype and device checks that name the first bad argument; returns the key offsets."""
    _check_tensor("q", q, "[total_q, heads, head_dim]")
    _check_tensor("k", k, "[total_k, heads, head_dim]")
    _check_tensor("v", v, "[total_k, heads, head_dim]")
    if q.dtype not in _DTYPES:
        raise JaggedInputError(f"q has dtype {q.dtype}; use one of float16, bfloat16, float32")
    for name, x in (("k", k), ("v", v)):
        if x.dtype != q.dtype:
            raise JaggedInputError(f"{name} has dtype {x.dtype} but q has {q.dtype}; cast all three to one dtype")
        if x.device != q.device:
            raise JaggedInputError(f"{name} is on {x.device} but q is on {q.device}; put q, k, v and offsets on one device")
    if k.shape[1:] != q.shape[1:]:
        raise JaggedInputError(f"k has (heads, head_dim) = {tuple(k.shape[1:])} but q has {tuple(q.shape[1:])}; they must match")
    if v.shape != k.shape:
        raise JaggedInputError(f"v has shape {tuple(v.shape)} but k has {tuple(k.shape)}; one value row per key row")
    _check_offsets_meta("q_offsets", q_offsets, q.device)
    if k_offsets is None:
        if k.shape[0] != q.shape[0]:
            raise JaggedInputError(f"k has {k.shape[0]} rows and q has {q.shape[0]}: for cross attention pass k_offsets")
        k_offsets = q_offsets
    else:
        _check_offsets_meta("k_offsets", k_offsets, q.device)
        if k_offsets.numel() != q_offsets.numel():
            raise JaggedInputError(f"k_offsets has {k_offsets.numel()} entries and q_offsets {q_offsets.numel()}; "
                                   "both must describe the same batch (batch + 1 entries)")
    if max_len is not None and (not isinstance(max_len, int) or isinstance(max_len, bool) or max_len < 0):
        raise JaggedInputError(f"max_len must be a non-negative int or None; got {max_len!r}")
    return k_offsets


def _check_values(q, k, q_offsets, k_offsets, max_len, validate: bool) -> _Checked:
    """Bounds for the launch grid; with ``validate``, the offsets' values too (once per offsets version)."""
    if torch.compiler.is_compiling():
        if max_len is None:
            raise JaggedInputError("max_len is required under torch.compile: it sizes the launch grid without "
                                   "reading the offsets back to the host")
        return _Checked(k_offsets, max_len, max_len)
    if not validate:
        if max_len is not None:
            return _Checked(k_offsets, max_len, max_len)
        lengths = torch.stack([(q_offsets[1:] - q_offsets[:-1]).max(), (k_offsets[1:] - k_offsets[:-1]).max()]) \
            if q_offsets.numel() > 1 else torch.zeros(2)
        max_q, max_k = (int(x) for x in lengths.tolist())
        return _Checked(k_offsets, max_q, max_k)
    max_q = _validated_lengths("q_offsets", q_offsets, q.shape[0], "q", max_len)
    if k_offsets is q_offsets:
        max_k = max_q
    else:
        max_k = _validated_lengths("k_offsets", k_offsets, k.shape[0], "k", max_len)
    return _Checked(k_offsets, max_q, max_k)


def _eager(q: torch.Tensor) -> bool:
    """Whether the Triton kernels may be called directly instead of through the custom ops.

    The custom ops are what torch.compile, FX tracing, fake and subclass tensors and functorch
    transforms understand; a plain eager call on plain tensors needs none of their dispatch.
    """
    return (type(q) is torch.Tensor and not torch.compiler.is_compiling() and torch._C._len_torch_dispatch_stack() == 0
            and not torch._C._are_functorch_transforms_active())


def _resolve_backend(backend: Backend, q: torch.Tensor, op: str, tensors=()) -> Backend:
    if backend is Backend.AUTO:
        return Backend.TRITON if q.is_cuda else Backend.REFERENCE
    if backend is Backend.TRITON:
        if not q.is_cuda and not interpreting():
            raise JaggedInputError(f"backend='triton' needs CUDA tensors; q is on {q.device}. "
                                   "Use backend='reference' (or 'auto') on CPU")
        if q.shape[-1] > _MAX_TRITON_HEAD_DIM:
            raise JaggedInputError(f"backend='triton' supports head_dim <= {_MAX_TRITON_HEAD_DIM}; got {q.shape[-1]}. "
                                   "Use backend='reference' or split the heads")
    if backend is Backend.FLEX:
        if op == "gdpa":
            raise JaggedInputError("backend='flex' cannot run gdpa: FlexAttention always normalises with softmax. "
                                   "Use 'triton' or 'reference'")
        if not q.is_cuda and torch.is_grad_enabled() and any(x.requires_grad for x in tensors):
            raise JaggedInputError("backend='flex' has no backward on CPU (a FlexAttention limit); "
                                   "use backend='reference', or call it under torch.no_grad()")
    return backend


def jagged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_offsets: torch.Tensor,
    k_offsets: torch.Tensor | None = None,
    *,
    causal: bool,
    max_len: int | None = None,
    scale: float | None = None,
    backend: str | Backend = "auto",
    validate: bool = True,
) -> torch.Tensor:
    """Softmax attention within each sample of a jagged batch; returns [total_q, heads, head_dim].

    q: [total_q, H, D]; k, v: [total_k, H, D]; q_offsets: [B + 1], sample b's queries are rows
    ``q_offsets[b]:q_offsets[b+1]``. k_offsets: the same for keys (cross attention), or None for
    self-attention. causal: query i of a sample with Lq queries and Lk keys sees keys
    ``j <= i + Lk - Lq`` (bottom-right aligned). max_len: bound on every sample length; required under
    torch.compile. scale: defaults to 1/sqrt(D). A query that sees no key outputs zeros.
    """
    backend = parse_backend(backend)
    checked = _check(q, k, v, q_offsets, k_offsets, max_len, validate)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if not (math.isfinite(scale) and scale > 0):
        raise JaggedInputError(f"scale must be a positive finite number for softmax attention; got {scale}")
    backend = _resolve_backend(backend, q, "jagged_attention", (q, k, v))
    if backend is Backend.TRITON:
        if _eager(q):
            return eager_softmax_attention(q, k, v, q_offsets, checked.k_offsets, checked.max_q_len, checked.max_k_len,
                                           bool(causal), scale)
        out, _ = torch.ops.coplan.jagged_softmax_attention(
            q, k, v, q_offsets, checked.k_offsets, checked.max_q_len, checked.max_k_len, bool(causal), scale)
        return out
    if backend is Backend.FLEX:
        from .flex import flex_jagged_attention

        return flex_jagged_attention(q, k, v, q_offsets, checked.k_offsets, causal=bool(causal), scale=scale)
    return jagged_attention_reference(q, k, v, q_offsets, checked.k_offsets, causal=bool(causal), scale=scale)


def gdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_offsets: torch.Tensor,
    k_offsets: torch.Tensor | None = None,
    *,
    activation: str | Activation = "silu",
    causal: bool,
    max_len: int | None = None,
    scale: float | None = None,
    out_scale: float | None = None,
    backend: str | Backend = "auto",
    validate: bool = True,
) -> torch.Tensor:
    """Generalised dot-product attention: ``out_i = out_scale * sum_j act(scale * q_i.k_j) v_j``.

    Same jagged layout and masking as :func:`jagged_attention`, with the softmax replaced by an
    elementwise ``activation`` (silu, gelu_tanh, relu, relu_squared, identity) and no
    normalisation. scale (before the activation) defaults to 1/sqrt(D); out_scale (after it)
    defaults to 1/max_len when max_len is given, as in HSTU/InterFormer, else 1.
    """
    backend = parse_backend(backend)
    act = parse_activation(activation)
    checked = _check(q, k, v, q_offsets, k_offsets, max_len, validate)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if out_scale is None:
        out_scale = 1.0 / max_len if max_len else 1.0
    out_scale = float(out_scale)
    if not (math.isfinite(scale) and math.isfinite(out_scale)):
        raise JaggedInputError(f"scale and out_scale must be finite; got scale={scale}, out_scale={out_scale}")
    backend = _resolve_backend(backend, q, "gdpa")
    if backend is Backend.TRITON:
        if _eager(q):
            return eager_gdpa(q, k, v, q_offsets, checked.k_offsets, checked.max_q_len, checked.max_k_len,
                              bool(causal), scale, out_scale, act)
        return torch.ops.coplan.jagged_gdpa(q, k, v, q_offsets, checked.k_offsets, checked.max_q_len,
                                            checked.max_k_len, bool(causal), scale, out_scale, act.value)
    return gdpa_reference(q, k, v, q_offsets, checked.k_offsets, activation=act, causal=bool(causal),
                          scale=scale, out_scale=out_scale)
