"""Decoder-only transformer layers over a jagged (or fixed-length) token sequence, as
:mod:`coplan.costmodel.flops` counts a ``transformer`` block.

A sequence travels as ``(values [T, d], offsets [B + 1])`` whether its lengths are fixed or jagged: a
fixed length is the jagged case with equal lengths, and the attention kernels take either. Each
layer is pre-norm (RMSNorm) GQA attention with rotary positions, then a SwiGLU or GELU FFN, with the
op ranges the cost model names: ``qkv``, ``attn``, ``attn_out``, ``ffn_up``, ``ffn_down`` and
``norm_act`` (norms, the rotary embedding, the FFN activation, the residual adds). With a vocabulary,
layer 0 also holds the token embedding (``embed``) and the last layer the final norm, the output
projection (``lm_head``) and the next-token cross-entropy (``loss``): the same layers the cost model
puts them in, so FSDP's units and the recompute choices hold what it priced.

Not in the FLOP formula (zero model FLOPs by its conventions): the rotary embedding (elementwise), and
the copy of each key/value head to its query heads under grouped-query attention (the kernels take
one head per query head; the formula counts the ``H`` query heads' pairs, which is what is computed).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from coplan.spec.workload import TransformerBlock
from coplan.trainer.model.layers import op_range, attention_scales, jagged_attention, segment_ids

ROPE_BASE = 10_000.0
"""Rotary embedding base (Su et al. 2021; Llama's)."""


def rope_tables(positions: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)`` ``[T, 1, head_dim // 2]`` in fp32 of each token's position (rotating pairs ``(i, i + half)``)."""
    half = head_dim // 2
    inv = ROPE_BASE ** (-torch.arange(half, device=positions.device, dtype=torch.float32) / max(1, half))
    ang = positions.float()[:, None] * inv[None, :]
    return ang.cos()[:, None, :], ang.sin()[:, None, :]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [T, heads, head_dim]``; an odd head_dim leaves its last element as it is."""
    half = cos.shape[-1]
    if half == 0:
        return x
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    x1, x2, rest = x[..., :half], x[..., half : 2 * half], x[..., 2 * half :]
    out = [x1 * cos - x2 * sin, x2 * cos + x1 * sin]
    if rest.shape[-1]:
        out.append(rest)
    return torch.cat(out, dim=-1)


def token_positions(offsets: torch.Tensor, total: int) -> torch.Tensor:
    """Each token's position within its sample (0 for the first), without a host sync."""
    seg = segment_ids(offsets, total)
    return torch.arange(total, device=offsets.device) - offsets[:-1].index_select(0, seg)


class DecoderLayer(nn.Module):
    """One decoder layer ``<block>.<index>``; layer 0 holds the token embedding and the last one the output
    projection and loss, when the block has a vocabulary."""

    def __init__(self, block: TransformerBlock, index: int, max_len: int, backend: str) -> None:
        super().__init__()
        self.name = f"{block.name}.{index}"
        d, H, kvh, dh = block.model_dim, block.num_heads, block.num_kv_heads, block.head_dim
        self.heads, self.kv_heads, self.head_dim = H, kvh, dh
        self.attn, self.max_len, self.backend = block.attention, max_len, backend
        self.scale, self.out_scale = attention_scales(block.attention, dh, max_len)
        self.gated = block.ffn_kind == "swiglu"
        f = block.ffn_hidden_dim
        V = block.vocab_size
        self.embed = nn.Embedding(V, d) if V and index == 0 else None
        if self.embed is not None:
            nn.init.normal_(self.embed.weight, std=1.0)
        self.norm1 = nn.RMSNorm(d)
        self.qkv = nn.Linear(d, (H + 2 * kvh) * dh, bias=False)
        self.out = nn.Linear(H * dh, d, bias=False)
        self.norm2 = nn.RMSNorm(d)
        self.up = nn.Linear(d, 2 * f if self.gated else f, bias=False)
        self.down = nn.Linear(f, d, bias=False)
        last = index == block.num_layers - 1
        self.final_norm = nn.RMSNorm(d) if V and last else None
        self.lm_head = nn.Linear(d, V, bias=False) if V and last else None

    def forward(self, h: torch.Tensor | None, offsets: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                tokens: torch.Tensor | None = None, targets: torch.Tensor | None = None):
        """``h [T, d]`` (None: the embedding of ``tokens`` alone) → ``h``; the last layer of a block with a
        vocabulary returns ``(h, sum of the next-token cross-entropy)`` when ``targets`` are given."""
        if self.embed is not None:
            with op_range(self, "embed"):
                e = self.embed(tokens)
                h = e if h is None else h + e
        assert h is not None
        total = h.shape[0]
        H, kvh, dh = self.heads, self.kv_heads, self.head_dim
        with op_range(self, "norm_act"):
            x = self.norm1(h)
        with op_range(self, "qkv"):
            q, k, v = self.qkv(x).split([H * dh, kvh * dh, kvh * dh], dim=-1)
        with op_range(self, "norm_act"):
            q = apply_rope(q.reshape(total, H, dh), cos, sin)
            k = apply_rope(k.reshape(total, kvh, dh), cos, sin)
            v = v.reshape(total, kvh, dh)
        with op_range(self, "attn"):
            if kvh != H:  # grouped-query attention: each key/value head serves H / kvh query heads
                k, v = k.repeat_interleave(H // kvh, dim=1), v.repeat_interleave(H // kvh, dim=1)
            a = jagged_attention(q.contiguous(), k.contiguous(), v.contiguous(), offsets, None, attn=self.attn,
                                 causal=self.attn.causal, max_len=self.max_len, scale=self.scale,
                                 out_scale=self.out_scale, backend=self.backend)
        with op_range(self, "attn_out"):
            h = h + self.out(a.reshape(total, H * dh))
        with op_range(self, "norm_act"):
            x = self.norm2(h)
        with op_range(self, "ffn_up"):
            x = self.up(x)
        with op_range(self, "norm_act"):
            if self.gated:
                gate, up = x.chunk(2, dim=-1)
                x = F.silu(gate) * up
            else:
                x = F.gelu(x, approximate="tanh")
        with op_range(self, "ffn_down"):
            x = self.down(x)
        with op_range(self, "norm_act"):
            h = h + x
        if self.lm_head is None or targets is None:
            return h
        assert self.final_norm is not None
        with op_range(self, "norm_act"):
            x = self.final_norm(h)
        with op_range(self, "lm_head"):
            logits = self.lm_head(x)
        with op_range(self, "loss"):
            loss = F.cross_entropy(logits.float(), targets, reduction="sum")
        return h, loss


class DecoderStack(nn.Module):
    """A transformer block: its layers over one sequence. Its input is the previous transformer block's
    output on the same sequence, the token embedding (a vocabulary) and the concatenated embeddings of
    the sequence's tables (whose widths must sum to ``model_dim``: the cost model prices no projection
    here), added."""

    def __init__(self, block: TransformerBlock, max_len: int, backend: str, table_features: list[str]) -> None:
        super().__init__()
        self.name, self.sequence = block.name, block.sequence
        self.head_dim = block.head_dim
        self.features = table_features
        self.vocab = block.vocab_size
        self.layers = nn.ModuleList(DecoderLayer(block, i, max_len, backend) for i in range(block.num_layers))

    def forward(self, h: torch.Tensor | None, seq: dict[str, torch.Tensor], offsets: torch.Tensor,
                tokens: torch.Tensor | None, targets: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(h [T, d], sum of the next-token loss or None)``."""
        with op_range(self.layers[0], "norm_act"):
            if self.features:
                x = torch.cat([seq[f] for f in self.features], dim=-1) if len(self.features) > 1 else seq[self.features[0]]
                h = x if h is None else h + x
            ref = h if h is not None else tokens
            assert ref is not None
            cos, sin = rope_tables(token_positions(offsets, ref.shape[0]), self.head_dim)
        loss = None
        for i, layer in enumerate(self.layers):
            kw = {}
            if i == 0 and self.vocab:
                kw["tokens"] = tokens
            if i == len(self.layers) - 1 and self.vocab and targets is not None:
                kw["targets"] = targets
            out = layer(h, offsets, cos, sin, **kw)
            if isinstance(out, tuple):
                h, loss = out
            else:
                h = out
        assert h is not None
        return h, loss


def last_tokens(h: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Each sample's last token ``[B, d]`` of a jagged ``h [T, d]`` (zeros for an empty sample), no host sync."""
    lengths = offsets[1:] - offsets[:-1]
    padded = torch.cat([h.new_zeros(1, h.shape[-1]), h])  # row 0: the empty samples' zeros
    idx = torch.where(lengths > 0, offsets[1:], torch.zeros_like(offsets[1:]))
    return padded.index_select(0, idx)


__all__ = ["DecoderLayer", "DecoderStack", "apply_rope", "last_tokens", "rope_tables", "token_positions"]
