"""PyTorch references for jagged softmax attention and GDPA: pad to dense, compute in fp32, unpad.

These define what the Triton kernels must compute, and serve CPU callers. They hold a
``[batch, heads, max_q_len, max_k_len]`` score tensor, so they are for tests and small inputs only.
Masking rules (shared with the kernels): a query sees only keys of its own sample; with
``causal``, query ``i`` of a sample with ``Lq`` queries and ``Lk`` keys sees key ``j`` iff
``j <= i + (Lk - Lq)`` (bottom-right aligned, so self-attention is the usual lower triangle and the
last query of a cross-attention sees every key). A query that sees no key gets a zero output.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .common import Activation


def activation_fn(activation: Activation, x: torch.Tensor) -> torch.Tensor:
    """The GDPA activation applied elementwise, in PyTorch."""
    if activation is Activation.IDENTITY:
        return x
    if activation is Activation.RELU:
        return F.relu(x)
    if activation is Activation.RELU_SQUARED:
        return F.relu(x).square()
    if activation is Activation.SILU:
        return F.silu(x)
    if activation is Activation.GELU_TANH:
        return F.gelu(x, approximate="tanh")
    raise AssertionError(f"unhandled activation {activation}")  # an Activation member was added without a rule


def _dest_rows(offsets: torch.Tensor, total: int, max_len: int) -> torch.Tensor:
    """For each of the ``total`` jagged rows, its row in the flattened [B * max_len] padded layout;
    rows outside every sample go to one spare row ``B * max_len`` (dropped after the copy).

    Found without a host sync (``searchsorted``), so padding adds no sync beyond the maxima.
    """
    offsets = offsets.long()
    batch = offsets.numel() - 1
    row = torch.arange(total, device=offsets.device)
    b = torch.searchsorted(offsets, row, right=True) - 1
    inside = (b >= 0) & (b < batch)
    bc = b.clamp(0, max(0, batch - 1))
    pos = row - offsets[bc]
    inside = inside & (pos < max_len)
    return torch.where(inside, bc * max_len + pos, batch * max_len)


def _pad(values: torch.Tensor, offsets: torch.Tensor, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``values`` [total, H, D] as [B, H, max_len, D] (zeros past each length) and the rows'
    destinations (:func:`_dest_rows`).

    The valid rows are copied into zeros (``index_copy``), so the backward w.r.t. ``values`` is a
    plain gather (``index_select``) of the valid rows. A gather *from* a shared zero row, as this
    once did, makes the backward scatter-add every padding position's gradient into that one row:
    atomic contention whose cost grows with the padding, not the work.
    """
    offsets = offsets.long()
    batch = offsets.numel() - 1
    dest = _dest_rows(offsets, values.shape[0], max_len)
    flat = values.new_zeros((batch * max_len + 1, *values.shape[1:])).index_copy(0, dest, values)
    return flat[: batch * max_len].view(batch, max_len, *values.shape[1:]).transpose(1, 2), dest


def _unpad(padded: torch.Tensor, dest: torch.Tensor) -> torch.Tensor:
    """[B, H, L, D] back to [total, H, D]: each jagged row gathered from its padded row (``dest``);
    rows outside every sample get zeros. Its backward is an ``index_add`` of unique rows."""
    b, h, l, d = padded.shape
    flat = padded.transpose(1, 2).reshape(b * l, h, d)
    flat = torch.cat([flat, flat.new_zeros((1, h, d))])
    return flat.index_select(0, dest)


def _mask(q_offsets, k_offsets, max_q: int, max_k: int, causal: bool, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q_len = (q_offsets[1:] - q_offsets[:-1]).long()
    k_len = (k_offsets[1:] - k_offsets[:-1]).long()
    i = torch.arange(max_q, device=device)
    j = torch.arange(max_k, device=device)
    valid_q = i[None, :] < q_len[:, None]
    valid_k = j[None, :] < k_len[:, None]
    mask = valid_q[:, :, None] & valid_k[:, None, :]
    if causal:
        shift = (k_len - q_len)[:, None, None]
        mask = mask & (j[None, None, :] <= i[None, :, None] + shift)
    return mask[:, None], valid_q, valid_k  # mask broadcast over heads: [B, 1, Lq, Lk]


def _empty_output(q, k, v) -> torch.Tensor:
    # Zero output that still depends on every input, so autograd returns zero gradients, not None.
    return q * 0 + (k.sum() + v.sum()).to(q.dtype) * 0


PAD_MULTIPLE = 16
"""The padded length is the longest length rounded up to this multiple. The padded fp32 matmuls then
have 16-byte-aligned rows, which cuBLAS's TF32 tensor-core kernels need. On the H200, steps with an
unaligned longest length (2 x odd, or odd) cost ~30% more per padded score element than aligned
ones: 1.1-1.2 against 0.86-0.87 ms per 10^6 (batch x longest^2) elements above the step's fixed part
(calibration rounds 6-7, ``ref-*`` runs, per-step times against per-step longest lengths). The cost
model prices the rounding (``coplan.costmodel.compute.padded_length_moments``). On a CPU the pad is the longest
length itself (:func:`_pad_multiple`): alignment buys nothing there, and the padded fp32 sums, equal in value, are not
bit-identical, which moves CPU runs that amplify last bits (fp8 loss curves: ``tests/trainer/test_fp8.py``)."""


def padded_length(longest: int, multiple: int = PAD_MULTIPLE) -> int:
    """The length the reference pads a batch whose longest sample has ``longest`` rows to."""
    return -(-int(longest) // multiple) * multiple


def _pad_multiple(device: torch.device) -> int:
    return PAD_MULTIPLE if device.type == "cuda" else 1


def _dense_inputs(q, k, v, q_offsets, k_offsets):
    q_len = q_offsets[1:] - q_offsets[:-1]
    k_len = k_offsets[1:] - k_offsets[:-1]
    # One host read for both maxima; a reference is allowed to sync.
    mult = _pad_multiple(q.device)
    max_q, max_k = (padded_length(x, mult) for x in torch.stack([q_len.max(), k_len.max()]).tolist()) if q_len.numel() else (0, 0)
    qp, dest_q = _pad(q.float(), q_offsets, max_q)
    kp, _ = _pad(k.float(), k_offsets, max_k)
    vp, _ = _pad(v.float(), k_offsets, max_k)
    return qp, kp, vp, dest_q, max_q, max_k


def jagged_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_offsets: torch.Tensor,
    k_offsets: torch.Tensor,
    *,
    causal: bool,
    scale: float,
) -> torch.Tensor:
    """Softmax attention over jagged samples, dense in fp32; returns [total_q, H, D] in ``q``'s dtype."""
    if q.shape[0] == 0 or q_offsets.numel() <= 1:
        return _empty_output(q, k, v)
    qp, kp, vp, dest_q, max_q, max_k = _dense_inputs(q, k, v, q_offsets, k_offsets)
    mask, _, _ = _mask(q_offsets, k_offsets, max_q, max_k, causal, q.device)
    scores = torch.einsum("bhqd,bhkd->bhqk", qp, kp) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    # Rows that see no key would be softmax over nothing (NaN); give them finite scores, then zero.
    seen = mask.any(dim=-1, keepdim=True)
    probs = torch.softmax(scores.masked_fill(~seen, 0.0), dim=-1) * seen
    out = torch.einsum("bhqk,bhkd->bhqd", probs, vp)
    return _unpad(out, dest_q).to(q.dtype)


def gdpa_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_offsets: torch.Tensor,
    k_offsets: torch.Tensor,
    *,
    activation: Activation,
    causal: bool,
    scale: float,
    out_scale: float,
) -> torch.Tensor:
    """``out_scale * sum_j act(scale * q.k_j) v_j`` over the keys each query sees, dense in fp32."""
    if q.shape[0] == 0 or q_offsets.numel() <= 1:
        return _empty_output(q, k, v)
    qp, kp, vp, dest_q, max_q, max_k = _dense_inputs(q, k, v, q_offsets, k_offsets)
    mask, _, _ = _mask(q_offsets, k_offsets, max_q, max_k, causal, q.device)
    scores = torch.einsum("bhqd,bhkd->bhqk", qp, kp) * scale
    weights = activation_fn(activation, scores) * mask
    out = torch.einsum("bhqk,bhkd->bhqd", weights, vp) * out_scale
    return _unpad(out, dest_q).to(q.dtype)
