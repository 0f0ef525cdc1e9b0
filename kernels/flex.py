"""Jagged softmax attention through PyTorch's FlexAttention, as an alternative backend.

The jagged batch is one packed sequence per head, and a document mask keeps each query inside its
sample (plus the bottom-right causal rule). FlexAttention always normalises with softmax, so it
cannot run GDPA. On CUDA it runs compiled; the block mask is rebuilt on every call, which a
training step that reuses one batch layout across layers would rather hoist out.
"""

from __future__ import annotations

import functools

import torch


@functools.cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def document_mask_mod(q_offsets: torch.Tensor, k_offsets: torch.Tensor, total_q: int, total_k: int, causal: bool):
    """The FlexAttention `mask_mod` of a jagged batch: same sample, and bottom-right causal if asked."""
    batch = q_offsets.numel() - 1
    q_len = (q_offsets[1:] - q_offsets[:-1]).long()
    k_len = (k_offsets[1:] - k_offsets[:-1]).long()
    samples = torch.arange(batch, device=q_offsets.device)
    q_seq = torch.repeat_interleave(samples, q_len, output_size=total_q)
    k_seq = torch.repeat_interleave(samples, k_len, output_size=total_k)
    q_pos = torch.arange(total_q, device=q_offsets.device) - q_offsets.long()[q_seq]
    k_pos = torch.arange(total_k, device=k_offsets.device) - k_offsets.long()[k_seq]
    # Shift each query so that its last one lines up with the sample's last key.
    q_reach = q_pos + (k_len - q_len)[q_seq]

    def mask_mod(b, h, qi, kj):
        same = q_seq[qi] == k_seq[kj]
        if causal:
            return same & (k_pos[kj] <= q_reach[qi])
        return same

    return mask_mod


def flex_jagged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_offsets: torch.Tensor, k_offsets: torch.Tensor,
    *, causal: bool, scale: float,
) -> torch.Tensor:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    total_q, total_k = q.shape[0], k.shape[0]
    if total_q == 0 or total_k == 0:
        return q * 0 + (k.sum() + v.sum()).to(q.dtype) * 0
    mask_mod = document_mask_mod(q_offsets, k_offsets, total_q, total_k, causal)
    on_cuda = q.is_cuda
    block_mask = create_block_mask(mask_mod, None, None, total_q, total_k, device=q.device, _compile=on_cuda)
    fn = _compiled_flex() if on_cuda else flex_attention
    # [total, H, D] -> [1, H, total, D]: one packed sequence per head.
    out = fn(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], block_mask=block_mask, scale=scale)
    return out[0].transpose(0, 1)
