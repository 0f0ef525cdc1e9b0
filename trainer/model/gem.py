"""The GEM-shaped model, built from a Workload spec: sparse arch (TorchRec) + dense arch (blocks).

It is the model :mod:`coplan.costmodel.flops` describes, op for op, so that the MFU the trainer
reports counts exactly the FLOPs it runs. Token flow of one sample:

- pooled embeddings → ``kunlun.0.input_proj``: the pooled features are cut into ``num_tokens``
  groups and each group's concatenated embeddings is projected to one token (block-diagonal);
- dense features → ``dense_mlp`` (ReLU MLP) → ``out_tokens`` tokens;
- each history → ``interformer.0.input_proj`` of its events' embeddings, then the InterFormer
  layers (:class:`~coplan.trainer.model.layers.InterFormerLayer`); the block's summary tokens join the
  non-sequence tokens, shifted by the mean of the final history tokens (elementwise, so that the
  last layer's output is used and trained);
- the ``num_tokens + out_tokens + Σ summaries`` non-sequence tokens (pooled first) → ``kunlun``
  layers → ``moe`` layers over the first ``tokens_per_sample`` tokens → mean → one tower per task.

Not in the FLOP formula (each well under 0.1% of the FLOPs at GEM sizes): the FiLM projection that
lets the non-sequence context modulate the history, the projection of that context into the initial
summary tokens, and the recency position embedding (a lookup).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.profiler import record_function

from coplan.errors import MismatchError
from coplan.spec import Workload
from coplan.spec.workload import DenseMLPBlock, InterFormerBlock, KunlunBlock, MoEBlock, TaskHeads
from coplan.trainer.features import FeatureLayout, feature_layout
from coplan.trainer.model.layers import MLP, InterFormerLayer, KunlunLayer, segment_ids, segment_sum
from coplan.trainer.model.moe import MoELayer


@dataclass(frozen=True, slots=True)
class TokenLayout:
    """How many non-sequence tokens of which kind a sample has, and their width."""

    pooled: int
    """Tokens the pooled embeddings are projected into (Kunlun's ``num_tokens``); they come first."""

    dense: int
    """Tokens from the dense MLP."""

    summaries: dict[str, int]
    """InterFormer block name -> its summary tokens."""

    width: int
    """Width of the non-sequence tokens."""

    @property
    def total(self) -> int:
        return self.pooled + self.dense + sum(self.summaries.values())


def token_layout(workload: Workload) -> TokenLayout:
    """The non-sequence tokens of a GEM-shaped workload; refuses inconsistent block shapes clearly."""
    blocks = workload.blocks
    dense = sum(b.out_tokens for b in blocks if isinstance(b, DenseMLPBlock))
    inter = [b for b in blocks if isinstance(b, InterFormerBlock)]
    summaries = {b.name: b.num_summary_tokens for b in inter}
    kunlun = [b for b in blocks if isinstance(b, KunlunBlock)]
    moe = [b for b in blocks if isinstance(b, MoEBlock)]
    heads = next(b for b in blocks if isinstance(b, TaskHeads))
    if not kunlun:
        raise MismatchError(f"workload '{workload.name}': the trainer's GEM model needs a kunlun block "
                            "(it projects the pooled embeddings into tokens)")
    width = kunlun[0].model_dim
    pooled = kunlun[0].num_tokens
    for b in kunlun[1:]:
        if b.num_tokens != pooled:
            raise MismatchError(f"workload '{workload.name}': kunlun blocks disagree on num_tokens ({b.num_tokens} vs {pooled})")
    for b in kunlun + moe:
        if b.model_dim != width:
            raise MismatchError(f"workload '{workload.name}': block '{b.name}' has model_dim {b.model_dim} but the "
                                f"non-sequence tokens are {width} wide; kunlun and moe blocks must share one width")
    if heads.input_dim != width:
        raise MismatchError(f"workload '{workload.name}': heads.input_dim is {heads.input_dim} but the tokens the "
                            f"towers read are {width} wide; set input_dim: {width}")
    first_interaction = min(i for i, b in enumerate(blocks) if isinstance(b, (KunlunBlock, MoEBlock)))
    if any(isinstance(b, InterFormerBlock) for b in blocks[first_interaction:]):
        raise MismatchError(f"workload '{workload.name}': interformer blocks must come before kunlun and moe blocks "
                            "(their summaries are non-sequence tokens the interaction blocks read)")
    layout = TokenLayout(pooled=pooled, dense=dense, summaries=summaries, width=width)
    for b in moe:
        if b.tokens_per_sample > layout.total:
            raise MismatchError(f"workload '{workload.name}': block '{b.name}' routes {b.tokens_per_sample} tokens per "
                                f"sample but a sample has {layout.total} non-sequence tokens")
    return layout


def group_features(dims: list[int], num_groups: int) -> list[list[int]]:
    """Cut features (in order) into ``num_groups`` contiguous groups of about equal total width."""
    total = sum(dims)
    groups: list[list[int]] = [[] for _ in range(num_groups)]
    pos = 0
    for i, d in enumerate(dims):
        g = min(num_groups - 1, int((pos + d / 2) * num_groups // max(total, 1)))
        groups[g].append(i)
        pos += d
    return groups


class PooledTokens(nn.Module):
    """Block-diagonal projection of the pooled embeddings: feature group ``g`` → token ``g``.

    The groups have different widths; they are gathered into one zero-padded ``[B, groups, width]``
    tensor so that one batched matmul projects them all (the padding is hardware work, not model
    FLOPs). Padded weight rows only ever see zeros, so they stay zero.
    """

    def __init__(self, features: list[tuple[str, int]], width: int, num_tokens: int, name: str) -> None:
        super().__init__()
        self.name = name
        self.features = features
        self.groups = group_features([d for _, d in features], num_tokens)
        self.group_width = max(1, max(sum(features[i][1] for i in g) for g in self.groups))
        self.weight = nn.Parameter(torch.zeros(num_tokens, self.group_width, width))
        self.bias = nn.Parameter(torch.zeros(num_tokens, width))
        for g, idx in enumerate(self.groups):
            w = sum(features[i][1] for i in idx)
            if w:
                nn.init.normal_(self.weight.data[g, :w], std=w**-0.5)
        self._index: dict[tuple, torch.Tensor] = {}

    def _gather_index(self, keys: tuple[str, ...], widths: list[int], device: torch.device) -> torch.Tensor:
        # TorchRec orders a sharded collection's output keys by sharding type, not as configured: map by name.
        key = (keys, tuple(widths), str(device))
        idx = self._index.get(key)
        if idx is None:
            start, pos = {}, 0
            for k, w in zip(keys, widths):
                start[k] = pos
                pos += w
            pad = pos  # index of the zero column appended at gather time
            rows = []
            for g in self.groups:
                cols = [start[self.features[i][0]] + j for i in g for j in range(self.features[i][1])]
                rows.append(cols + [pad] * (self.group_width - len(cols)))
            idx = torch.tensor(rows, dtype=torch.long, device=device).view(-1)
            self._index[key] = idx
        return idx

    def forward(self, values: torch.Tensor, keys: tuple[str, ...], widths: list[int]) -> torch.Tensor:
        b = values.shape[0]
        with record_function(f"{self.name}.input_proj"):
            padded = torch.cat([values, values.new_zeros(b, 1)], dim=1)
            x = padded.index_select(1, self._gather_index(keys, widths, values.device))
            x = x.view(b, len(self.groups), self.group_width)
            return torch.einsum("bgw,gwd->bgd", x, self.weight) + self.bias


class InterFormerStack(nn.Module):
    """An InterFormer block: input projection of a history's event embeddings, then the layers."""

    def __init__(self, block: InterFormerBlock, layout: FeatureLayout, token_width: int, max_len: int, backend: str) -> None:
        super().__init__()
        self.name, self.sequence = block.name, block.sequence
        d = block.model_dim
        tables = layout.sequence_tables[block.sequence]
        self.features = [t.name for t in tables]
        self.num_summary = block.num_summary_tokens
        self.max_len = max_len
        self.input = nn.Linear(sum(t.dim for t in tables), d)
        self.pos = nn.Embedding(max_len, d)
        nn.init.normal_(self.pos.weight, std=0.02)
        self.summary_init = nn.Parameter(torch.randn(self.num_summary, d) * 0.02)
        self.summary_ctx = nn.Linear(token_width, self.num_summary * d)
        self.layers = nn.ModuleList(
            InterFormerLayer(f"{block.name}.{i}", block, token_width, max_len, backend) for i in range(block.num_layers)
        )
        self.out_norm = nn.LayerNorm(d)
        self.to_tokens = nn.Linear(d, token_width) if d != token_width else nn.Identity()

    def forward(self, seq: dict[str, torch.Tensor], offsets: torch.Tensor, ctx: torch.Tensor) -> torch.Tensor:
        n = self.name
        x = torch.cat([seq[f] for f in self.features], dim=-1) if len(self.features) > 1 else seq[self.features[0]]
        total, batch = x.shape[0], offsets.numel() - 1
        with record_function(f"{n}.0.input_proj"):
            seg = segment_ids(offsets, total)
            # position counted from the most recent event (recency), bounded by the spec's max length
            pos = (offsets[1:][seg] - 1 - torch.arange(total, device=x.device)).clamp_(0, self.max_len - 1)
            h = self.input(x) + self.pos(pos)
            summary = self.summary_init + self.summary_ctx(ctx).view(batch, self.num_summary, -1)
        for layer in self.layers:
            h, summary = layer(h, offsets, summary, ctx)
        with record_function(f"{n}.{len(self.layers) - 1}.norm_act"):
            # mean of the final history tokens (an empty history gives zeros) joins every summary token
            lengths = (offsets[1:] - offsets[:-1]).clamp(min=1)
            pooled = (segment_sum(h, offsets) / lengths[:, None]).to(h.dtype)
            summary = summary + pooled[:, None, :]
            return self.to_tokens(self.out_norm(summary))


class LayerStack(nn.Module):
    """A block of stacked layers over the non-sequence tokens (Kunlun or MoE)."""

    def __init__(self, layers: list[nn.Module]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            z = layer(z)
        return z


class Heads(nn.Module):
    """Mean of the final tokens → one ReLU MLP tower and one logit per task; linear ``i`` of every
    task runs in the op range ``heads.<i>.gemm``."""

    def __init__(self, block: TaskHeads, width: int) -> None:
        super().__init__()
        self.name = block.name
        self.tasks = block.tasks
        self.norm = nn.LayerNorm(width)
        dims = [block.input_dim, *block.hidden_dims, 1]
        self.towers = nn.ModuleDict({t: nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims[:-1], dims[1:])) for t in block.tasks})
        self.depth = len(dims) - 1

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        p = self.norm(z).mean(dim=1)
        xs = [p for _ in self.tasks]
        for i in range(self.depth):
            with record_function(f"{self.name}.{i}.gemm"):
                xs = [self.towers[t][i](x) for t, x in zip(self.tasks, xs)]
                if i < self.depth - 1:
                    xs = [F.relu(x) for x in xs]
        return torch.cat(xs, dim=-1)


class DenseArch(nn.Module):
    """Everything after the embedding lookups; FSDP shards it."""

    def __init__(self, workload: Workload, layout: FeatureLayout, backend: str) -> None:
        super().__init__()
        tokens = token_layout(workload)
        self.tokens = tokens
        self.layout = layout
        w = tokens.width
        if not layout.pooled:
            raise MismatchError(f"workload '{workload.name}': the trainer needs at least one pooled feature")
        kunlun = next(b for b in workload.blocks if isinstance(b, KunlunBlock))
        self.pooled = PooledTokens([(f.name, f.table.dim) for f in layout.pooled], w, tokens.pooled, f"{kunlun.name}.0")
        self.blocks = nn.ModuleDict()
        self.order: list[str] = []
        for b in workload.blocks:
            if isinstance(b, DenseMLPBlock):
                self.blocks[b.name] = MLP([b.num_dense_features, *b.hidden_dims, b.out_tokens * w], b.name)
            elif isinstance(b, InterFormerBlock):
                max_len = workload.sequence(b.sequence).length.max_len
                self.blocks[b.name] = InterFormerStack(b, layout, w, max_len, backend)
            elif isinstance(b, KunlunBlock):
                self.blocks[b.name] = LayerStack([KunlunLayer(f"{b.name}.{i}", b, tokens.total) for i in range(b.num_layers)])
            elif isinstance(b, MoEBlock):
                self.blocks[b.name] = LayerStack([MoELayer(f"{b.name}.{i}", b) for i in range(b.num_layers)])
            elif isinstance(b, TaskHeads):
                self.blocks[b.name] = Heads(b, w)
            self.order.append(b.name)
        self.kinds = {b.name: b.type for b in workload.blocks}

    def iter_layers(self) -> Iterator[tuple[str, nn.ModuleList, int]]:
        """(``<block>.<layer index>``, the ModuleList holding it, its index) for every stacked layer."""
        for name in self.order:
            block = self.blocks[name]
            if isinstance(block, (InterFormerStack, LayerStack)):
                for i in range(len(block.layers)):
                    yield f"{name}.{i}", block.layers, i

    def forward(
        self,
        pooled: torch.Tensor,
        pooled_keys: tuple[str, ...],
        pooled_widths: list[int],
        seq: dict[str, torch.Tensor],
        offsets: dict[str, torch.Tensor],
        dense: torch.Tensor | None,
    ) -> torch.Tensor:
        batch = pooled.shape[0]
        x = [self.pooled(pooled, pooled_keys, pooled_widths)]
        for name in self.order:
            if self.kinds[name] == "dense_mlp":
                x.append(self.blocks[name](dense).view(batch, -1, self.tokens.width))
        z = torch.cat(x, dim=1) if len(x) > 1 else x[0]
        ctx = z.mean(dim=1)
        logits = None
        for name in self.order:
            kind, block = self.kinds[name], self.blocks[name]
            if kind == "interformer":
                z = torch.cat([z, block(seq, offsets[block.sequence], ctx)], dim=1)
            elif kind in ("kunlun", "moe"):
                z = block(z)
            elif kind == "heads":
                logits = block(z)
        assert logits is not None
        return logits


class GEMModel(nn.Module):
    """Sparse arch (on the meta device until TorchRec shards it) + dense arch."""

    def __init__(self, workload: Workload, *, attention_backend: str = "reference", seed: int = 0,
                 device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.workload = workload
        self.layout = feature_layout(workload)
        # imported here: the dense arch alone (benchmarks/compile_probe.py) then needs no TorchRec/FBGEMM
        from coplan.trainer.model.sparse import SparseArch

        self.sparse = SparseArch(self.layout, device="meta")
        # Dense weights are drawn on the CPU from one seed, so every rank (and the reference) starts equal.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            dense = DenseArch(workload, self.layout, attention_backend)
        self.dense = dense.to(device)

    def forward(self, batch) -> torch.Tensor:
        """Logits ``[local batch, tasks]`` in fp32 for a :class:`~coplan.trainer.data.Batch`."""
        pooled, keys, widths, seq = self.sparse(batch.pooled, batch.sequences, getattr(batch, "sparse_dist", None))
        return self.dense(pooled, keys, widths, seq, batch.offsets, batch.dense).float()


def bce_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum over samples and tasks of the binary cross-entropy (the trainer divides by the global batch)."""
    return F.binary_cross_entropy_with_logits(logits, labels, reduction="sum")


__all__ = ["DenseArch", "GEMModel", "Heads", "InterFormerStack", "LayerStack", "PooledTokens", "TokenLayout",
           "bce_loss_sum", "group_features", "token_layout"]
