"""The model of any workload the spec allows, built from its Workload: sparse arch (TorchRec; none
without tables) + dense arch (the blocks, in order).

It is the model :mod:`coplan.costmodel.flops` describes, op for op, so that the MFU the trainer
reports counts exactly the FLOPs it runs. Token flow of one sample of a GEM-shaped workload:

- pooled embeddings → ``kunlun.0.input_proj``: the pooled features are cut into ``num_tokens``
  groups and each group's concatenated embeddings is projected to one token (block-diagonal);
- dense features → ``dense_mlp`` (ReLU MLP) → ``out_tokens`` tokens;
- each history → ``interformer.0.input_proj`` of its events' embeddings, then the InterFormer
  layers (:class:`~coplan.trainer.model.layers.InterFormerLayer`); the block's summary tokens join the
  non-sequence tokens, shifted by the mean of the final history tokens (elementwise, so that the
  last layer's output is used and trained);
- the ``num_tokens + out_tokens + Σ summaries`` non-sequence tokens (pooled first) → ``kunlun``
  layers → ``moe`` layers over the first ``tokens_per_sample`` tokens → mean → one tower per task.

Without a kunlun block, the pooled embeddings join the tokens unprojected (:class:`TokenLayout`); a
kunlun block without pooled features starts from learned tokens. A DLRM-shaped workload runs its
dense MLP and its pooled features through :mod:`~coplan.trainer.model.dlrm`'s dot interaction into the
heads; a transformer block (:mod:`~coplan.trainer.model.decoder`) runs over its sequence, with a
next-token loss when it has a vocabulary and, when a heads block follows it, each sample's last token
as the towers' input. What each heads block reads, and what is refused with the field to change,
is :func:`readouts` and :func:`check_sequences`.

Not in the FLOP formula (each well under 0.1% of the FLOPs at GEM sizes): the FiLM projection that
lets the non-sequence context modulate the history, the projection of that context into the initial
summary tokens, and the recency position embedding (a lookup).
"""

from __future__ import annotations

from typing import Iterator, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.profiler import record_function

from coplan.spec import Workload
from coplan.spec.workload import (
    DenseMLPBlock,
    DotInteractionBlock,
    InterFormerBlock,
    KunlunBlock,
    MoEBlock,
    TaskHeads,
    TransformerBlock,
)
from coplan.trainer.features import FeatureLayout, TokenLayout, check_sequences, feature_layout, readouts, token_layout
from coplan.trainer.model.decoder import DecoderStack, last_tokens
from coplan.trainer.model.dlrm import DotInteraction, column_index
from coplan.trainer.model.layers import MLP, InterFormerLayer, KunlunLayer, mask_rows, segment_ids, segment_sum
from coplan.trainer.model.moe import MoELayer


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

    def __init__(self, block: InterFormerBlock, layout: FeatureLayout, token_width: int, max_len: int, backend: str,
                 film: str = "fused") -> None:
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
            InterFormerLayer(f"{block.name}.{i}", block, token_width, max_len, backend, film) for i in range(block.num_layers)
        )
        self.out_norm = nn.LayerNorm(d)
        self.to_tokens = nn.Linear(d, token_width) if d != token_width else nn.Identity()

    def forward(self, seq: dict[str, torch.Tensor], offsets: torch.Tensor, ctx: torch.Tensor,
                valid: torch.Tensor | None = None) -> torch.Tensor:
        """``valid``: which rows of the history are tokens (``None``: all of them; padded rows are masked,
        see :func:`~coplan.trainer.model.layers.mask_rows`)."""
        n = self.name
        with record_function(f"{n}.0.input_embed"):  # the cost model's op of that name (flops._input_embed)
            x = torch.cat([seq[f] for f in self.features], dim=-1) if len(self.features) > 1 else seq[self.features[0]]
            total, batch = x.shape[0], offsets.numel() - 1
            seg = segment_ids(offsets, total, padded=valid is not None)
            # position counted from the most recent event (recency), bounded by the spec's max length
            pos = (offsets[1:][seg] - 1 - torch.arange(total, device=x.device)).clamp_(0, self.max_len - 1)
            p = self.pos(pos)
        with record_function(f"{n}.0.input_proj"):
            h = self.input(x)
            summary = self.summary_init + self.summary_ctx(ctx).view(batch, self.num_summary, -1)
        with record_function(f"{n}.0.input_embed"):
            h = h + p
        for layer in self.layers:
            h, summary = layer(h, offsets, summary, ctx) if valid is None else layer(h, offsets, summary, ctx, valid)
        with record_function(f"{n}.{len(self.layers) - 1}.norm_act"):
            # mean of the final history tokens (an empty history gives zeros) joins every summary token
            lengths = (offsets[1:] - offsets[:-1]).clamp(min=1)
            pooled = (segment_sum(mask_rows(h, valid), offsets) / lengths[:, None]).to(h.dtype)
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
    """Norm of what the block reads (the mean of the final tokens, or one vector per sample) → one ReLU MLP
    tower and one logit per task; linear ``i`` of every task runs in the op range ``heads.<i>.gemm``."""

    def __init__(self, block: TaskHeads, width: int) -> None:
        super().__init__()
        self.name = block.name
        self.tasks = block.tasks
        self.norm = nn.LayerNorm(width)
        dims = [block.input_dim, *block.hidden_dims, 1]
        self.towers = nn.ModuleDict({t: nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims[:-1], dims[1:])) for t in block.tasks})
        self.depth = len(dims) - 1

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        """``z [B, tokens, width]`` (read as the mean of the normed tokens) or ``[B, width]`` → ``[B, tasks]``."""
        if not self.tasks:
            return z.new_zeros(z.shape[0], 0)
        p = self.norm(z).mean(dim=1) if z.dim() == 3 else self.norm(z)
        xs = [p for _ in self.tasks]
        for i in range(self.depth):
            with record_function(f"{self.name}.{i}.gemm"):
                xs = [self.towers[t][i](x) for t, x in zip(self.tasks, xs)]
                if i < self.depth - 1:
                    xs = [F.relu(x) for x in xs]
        return torch.cat(xs, dim=-1)


class DenseOutput(NamedTuple):
    """What the dense arch computes for a loss: the task logits and, per token sequence, the summed
    next-token cross-entropy of the transformer blocks with a vocabulary."""

    logits: torch.Tensor
    """``[B, tasks]`` (every heads block's tasks, in block order)."""

    token_loss: dict[str, torch.Tensor]
    """Sequence -> sum over its tokens (on this rank) of the next-token cross-entropy (empty: no vocabulary)."""


class DenseArch(nn.Module):
    """Everything after the embedding lookups; FSDP shards it.

    The blocks run in the workload's order over three kinds of state: the non-sequence tokens ``z``
    (pooled tokens and the dense MLP's tokens, then the InterFormer summaries; Kunlun and MoE layers
    transform them), each sequence's hidden states (transformer blocks; the next transformer on the same
    sequence continues from them) and the DotInteraction output. A heads block reads the output of the
    block right before it (:func:`readouts`)."""

    def __init__(self, workload: Workload, layout: FeatureLayout, backend: str) -> None:
        super().__init__()
        tokens = token_layout(workload)
        self.tokens = tokens
        self.layout = layout
        self.readouts = readouts(workload, tokens)
        check_sequences(workload, layout)
        w = tokens.width
        self.pooled = None
        self.pooled_const = None
        kunlun = next((b for b in workload.blocks if isinstance(b, KunlunBlock)), None)
        if tokens.pooled_source == "kunlun":
            assert kunlun is not None
            self.pooled = PooledTokens([(f.name, f.table.dim) for f in layout.pooled], w, tokens.pooled, f"{kunlun.name}.0")
        elif tokens.pooled_source == "learned":
            self.pooled_const = nn.Parameter(torch.randn(tokens.pooled, w) * 0.02)
        self.pooled_features = [(f.name, f.table.dim) for f in layout.pooled]
        self._chunk_cols: dict[tuple, torch.Tensor] = {}
        self.blocks = nn.ModuleDict()
        self.order: list[str] = []
        for b in workload.blocks:
            if isinstance(b, DenseMLPBlock):
                self.blocks[b.name] = MLP([b.num_dense_features, *b.hidden_dims, b.out_tokens * w], b.name)
            elif isinstance(b, InterFormerBlock):
                max_len = workload.sequence(b.sequence).length.max_len
                self.blocks[b.name] = InterFormerStack(b, layout, w, max_len, backend, workload.kernels.film)
            elif isinstance(b, KunlunBlock):
                fused = workload.kernels.film == "fused" and backend == "triton"
                self.blocks[b.name] = LayerStack([KunlunLayer(f"{b.name}.{i}", b, tokens.total, fused, backend)
                                                  for i in range(b.num_layers)])
            elif isinstance(b, MoEBlock):
                self.blocks[b.name] = LayerStack([MoELayer(f"{b.name}.{i}", b) for i in range(b.num_layers)])
            elif isinstance(b, TransformerBlock):
                max_len = workload.sequence(b.sequence).length.max_len
                feats = [t.name for t in layout.sequence_tables.get(b.sequence, ())]
                self.blocks[b.name] = DecoderStack(b, max_len, backend, feats)
            elif isinstance(b, DotInteractionBlock):
                self.blocks[b.name] = DotInteraction(b, self.pooled_features, tokens.dense)
            elif isinstance(b, TaskHeads):
                self.blocks[b.name] = Heads(b, b.input_dim)
            self.order.append(b.name)
        self.kinds = {b.name: b.type for b in workload.blocks}

    def iter_layers(self) -> Iterator[tuple[str, nn.ModuleList, int]]:
        """(``<block>.<layer index>``, the ModuleList holding it, its index) for every stacked layer."""
        for name in self.order:
            block = self.blocks[name]
            if isinstance(block, (InterFormerStack, LayerStack, DecoderStack)):
                for i in range(len(block.layers)):
                    yield f"{name}.{i}", block.layers, i

    def _pooled_chunks(self, pooled: torch.Tensor, keys: tuple[str, ...], widths: list[int], batch: int) -> torch.Tensor:
        """The pooled embeddings (in layout order) as ``[B, ⌈Σ dims / width⌉, width]``, zero-padded."""
        w = self.tokens.width
        ck = (keys, tuple(widths), str(pooled.device))
        cols = self._chunk_cols.get(ck)
        if cols is None:  # built once per layout (no host-to-device copy per step, none inside a CUDA graph)
            cols = self._chunk_cols[ck] = torch.tensor(column_index(self.pooled_features, keys, widths), dtype=torch.long,
                                                       device=pooled.device)
        x = pooled.index_select(1, cols)
        pad = self.tokens.pooled * w - x.shape[1]
        if pad:
            x = torch.cat([x, x.new_zeros(batch, pad)], dim=1)
        return x.view(batch, self.tokens.pooled, w)

    def forward(
        self,
        pooled: torch.Tensor | None,
        pooled_keys: tuple[str, ...],
        pooled_widths: list[int],
        seq: dict[str, torch.Tensor],
        offsets: dict[str, torch.Tensor],
        dense: torch.Tensor | None,
        *,
        token_ids: dict[str, torch.Tensor] | None = None,
        targets: dict[str, torch.Tensor] | None = None,
        batch_size: int | None = None,
        valid: dict[str, torch.Tensor] | None = None,
    ):
        """Task logits ``[B, tasks]``; with ``targets`` (token sequence -> next-token ids; ``{}`` when there
        are none), a :class:`DenseOutput` with the token losses too. ``valid``: per sequence, which rows of
        its padded features are tokens (:mod:`coplan.trainer.graphs`; InterFormer blocks only)."""
        if batch_size is None:
            sources = [t.shape[0] for t in (pooled, dense) if t is not None] + [o.numel() - 1 for o in offsets.values()]
            if not sources:
                raise ValueError("pass batch_size: this workload's inputs do not say how many samples there are")
            batch_size = sources[0]
        batch = batch_size
        w = self.tokens.width
        x = []
        if self.pooled is not None:
            assert pooled is not None
            x.append(self.pooled(pooled, pooled_keys, pooled_widths))
        elif self.pooled_const is not None:
            x.append(self.pooled_const.unsqueeze(0).expand(batch, -1, -1))
        elif self.tokens.pooled_source == "chunks":
            assert pooled is not None
            x.append(self._pooled_chunks(pooled, pooled_keys, pooled_widths, batch))
        dense_tokens = []
        for name in self.order:
            if self.kinds[name] == "dense_mlp":
                dense_tokens.append(self.blocks[name](dense).view(batch, -1, w))
        x += dense_tokens
        z = torch.cat(x, dim=1) if len(x) > 1 else x[0] if x else None
        ctx = z.mean(dim=1) if z is not None else None
        hidden: dict[str, torch.Tensor] = {}
        vectors: dict[str, torch.Tensor] = {}
        token_loss: dict[str, torch.Tensor] = {}
        logits = []
        for name in self.order:
            kind, block = self.kinds[name], self.blocks[name]
            if kind == "interformer":
                if ctx is None:
                    ctx = torch.zeros(batch, w, device=offsets[block.sequence].device)
                mask = valid.get(block.sequence) if valid else None
                s = block(seq, offsets[block.sequence], ctx) if mask is None else block(seq, offsets[block.sequence], ctx, mask)
                z = s if z is None else torch.cat([z, s], dim=1)
            elif kind in ("kunlun", "moe"):
                z = block(z)
            elif kind == "transformer":
                s = block.sequence
                tg = targets.get(s) if targets is not None else None
                h, loss = block(hidden.get(s), seq, offsets[s], (token_ids or {}).get(s), tg)
                hidden[s] = h
                vectors[name] = h
                if loss is not None:
                    token_loss[s] = token_loss[s] + loss if s in token_loss else loss
            elif kind == "dot_interaction":
                d = torch.cat(dense_tokens, dim=1) if len(dense_tokens) > 1 else dense_tokens[0] if dense_tokens else None
                vectors[name] = block(pooled, pooled_keys, pooled_widths, d, batch)
            elif kind == "heads":
                what, src, _ = self.readouts[name]
                if what == "tokens":
                    assert z is not None
                    logits.append(block(z))
                elif what == "vector":
                    logits.append(block(vectors[src]))
                else:
                    b = self.blocks[src]
                    logits.append(block(last_tokens(vectors[src], offsets[b.sequence])))
        if logits:
            out = torch.cat(logits, dim=-1) if len(logits) > 1 else logits[0]
        else:
            ref = next(iter(token_loss.values()), None)
            out = torch.zeros(batch, 0, device=ref.device if ref is not None else None)
        if targets is None:
            return out
        return DenseOutput(out, token_loss)


class GEMModel(nn.Module):
    """Sparse arch (TorchRec, on the meta device until it shards it; None for a workload without tables)
    + dense arch. Any workload the spec allows, despite the name: GEM-shaped, DLRM-shaped, a dense
    decoder, or a mix."""

    def __init__(self, workload: Workload, *, attention_backend: str = "reference", seed: int = 0,
                 device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.workload = workload
        self.layout = feature_layout(workload)
        self.sparse = None
        if self.layout.has_tables:
            # imported here: the dense arch alone (benchmarks/compile_probe.py, dense-only workloads) needs no TorchRec/FBGEMM
            from coplan.trainer.model.sparse import SparseArch

            self.sparse = SparseArch(self.layout, device="meta")
        self.dense_graphs = None
        """A :class:`~coplan.trainer.graphs.DenseGraphs` that runs the dense arch (set by the trainer where it applies)."""
        # Dense weights are drawn on the CPU from one seed, so every rank (and the reference) starts equal.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            dense = DenseArch(workload, self.layout, attention_backend)
        self.dense = dense.to(device)

    def forward(self, batch) -> DenseOutput:
        """Task logits ``[local batch, tasks]`` in fp32 and the token losses of a :class:`~coplan.trainer.batch.Batch`."""
        if self.sparse is not None:
            pooled, keys, widths, seq = self.sparse(batch.pooled, batch.sequences, getattr(batch, "sparse_dist", None))
        else:
            pooled, keys, widths, seq = None, (), [], {}
        if self.dense_graphs is not None:
            logits = self.dense_graphs(pooled, keys, widths, seq, batch.offsets, batch.dense, batch.size)
            return DenseOutput(logits.float(), {})
        out = self.dense(pooled, keys, widths, seq, batch.offsets, batch.dense, token_ids=getattr(batch, "token_ids", {}),
                         targets=getattr(batch, "targets", {}), batch_size=batch.size)
        return DenseOutput(out.logits.float(), {s: v.float() for s, v in out.token_loss.items()})


def bce_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum over samples and tasks of the binary cross-entropy (the trainer divides by the global batch)."""
    return F.binary_cross_entropy_with_logits(logits, labels, reduction="sum")


def loss_parts(out: DenseOutput, labels: torch.Tensor, global_batch: int, global_tokens: dict[str, int]) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """This micro-batch's share of the step's global mean loss, its parts (no gradient) and their names.

    The loss is the tasks' BCE summed over this micro-batch's samples over the global batch, plus, per
    token sequence, the next-token cross-entropy summed over its tokens over the global batch's tokens of
    that sequence: summed over micro-batches and ranks, each is the global mean, so the gradients sum
    (FSDP's reduce-scatter, the embedding all-to-alls) to the gradient of one pass over the whole batch.
    Parts: each task's BCE share, then ``next_token:<sequence>`` shares."""
    loss = bce_loss_sum(out.logits, labels) / global_batch
    names = []
    with torch.no_grad():
        parts = [F.binary_cross_entropy_with_logits(out.logits.detach(), labels, reduction="none").sum(0) / global_batch]
    for s, v in out.token_loss.items():
        term = v / max(1, int(global_tokens.get(s, 0)))
        loss = loss + term
        parts.append(term.detach().reshape(1))
        names.append(f"next_token:{s}")
    return loss, torch.cat(parts), names


__all__ = ["DenseArch", "DenseOutput", "GEMModel", "Heads", "InterFormerStack", "LayerStack", "PooledTokens", "TokenLayout",
           "bce_loss_sum", "check_sequences", "group_features", "loss_parts", "readouts", "token_layout"]
