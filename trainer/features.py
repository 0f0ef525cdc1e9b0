"""The input features a workload implies: one spelling shared by the data files, the model and the plan.

Every workload the spec allows has a layout: pooled and sequence tables (any number, none included),
jagged or fixed-length sequences, dense features, the tasks of every heads block, and the token ids
of the sequences a transformer with a vocabulary reads (:attr:`FeatureLayout.token_sequences`).

A pooled table with ``num_features = k`` is looked up by ``k`` features (``<table>`` when k is 1,
``<table>__<j>`` otherwise), each a bag of ids per sample. A sequence table is looked up once per
event of its sequence, so its feature is named after the table and its length per sample is the
sequence's length. Torch-free: the data generator uses it without torch.

How a sample's history is cut into bags for the sequence lookup (:attr:`FeatureLayout.seq_chunk`)
lives here too, since the batch builder and the run's summary both read it: with ``seq_chunk = 0``
each sample's whole history is one bag; with ``seq_chunk = n`` it is ``C`` bags of at most ``n`` ids
(:meth:`FeatureLayout.chunks_per_sample`). FBGEMM's sequence (no-bag) lookup gives each bag one
32-thread group, so one bag per sample runs a 1,000-id history on one warp; chunks spread it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from coplan.costmodel.flops import token_width
from coplan.errors import MismatchError
from coplan.spec import Workload
from coplan.spec.workload import (
    DenseMLPBlock,
    DotInteractionBlock,
    EmbeddingTable,
    InterFormerBlock,
    KunlunBlock,
    MoEBlock,
    TaskHeads,
    TransformerBlock,
)

SUPPORTED_BLOCKS = (DenseMLPBlock, InterFormerBlock, KunlunBlock, MoEBlock, TaskHeads, TransformerBlock, DotInteractionBlock)


@dataclass(frozen=True, slots=True)
class PooledFeature:
    """One bag-of-ids feature."""

    name: str
    """Feature (and Parquet column) name."""

    table: EmbeddingTable
    """The table it looks up."""


@dataclass(frozen=True, slots=True)
class FeatureLayout:
    """Every input of a workload, in a fixed order."""

    pooled: tuple[PooledFeature, ...]
    """Pooled features, in table order."""

    sequences: tuple[str, ...]
    """Names of the sequences (histories) some table or block uses."""

    sequence_tables: dict[str, tuple[EmbeddingTable, ...]]
    """Sequence name -> its sequence tables (each one feature, named after the table), for every
    sequence of :attr:`sequences` (empty for a token sequence without tables)."""

    num_dense: int
    """Float features per sample (0 without a dense_mlp block)."""

    tasks: tuple[str, ...]
    """Binary tasks of every heads block, in block order (label columns ``label_<task>``)."""

    sequence_max_len: dict[str, int]
    """Sequence name -> its length distribution's cap, in events (no history is longer)."""

    token_sequences: dict[str, int] = field(default_factory=dict)
    """Sequence -> vocabulary of the token ids the data holds for it (column ``tok_<sequence>``: ``L + 1``
    ids per sample of length ``L``, the inputs and their next-token targets), for the sequences a
    transformer block with ``vocab_size > 0`` reads (the smallest vocabulary when several do)."""

    seq_chunk: int = 0
    """Ids per bag of the sequence lookups' KeyedJaggedTensors: 0 = one bag per sample (its whole
    history); n > 0 = each history cut into :meth:`chunks_per_sample` bags of at most n ids (then
    empty ones). The ids, their order and so the lookup's output rows are the same either way."""

    def with_seq_chunk(self, chunk: int) -> "FeatureLayout":
        """This layout with the sequence lookups' bags of at most ``chunk`` ids (0: whole histories)."""
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 0:
            raise MismatchError(f"seq_chunk must be a non-negative integer (0: one bag per sample); got {chunk!r}")
        return replace(self, seq_chunk=chunk)

    def chunks_per_sample(self, group: str) -> int:
        """Bags per sample of every feature of sequence-table collection ``group`` (``ec_d<dim>``).

        ``ceil(cap / seq_chunk)`` with cap the longest history any of its features can have: a
        KeyedJaggedTensor has one stride for all its keys, and the same on every rank and every step
        (TorchRec's input all-to-alls split the lengths by it), so it comes from the workload, not the batch."""
        if self.seq_chunk == 0:
            return 1
        t2s = self.table_to_sequence
        cap = max(self.sequence_max_len[t2s[t.name]] for t in self.sequence_groups[group])
        return max(1, math.ceil(cap / self.seq_chunk))

    @property
    def has_tables(self) -> bool:
        """Whether the workload has any embedding table (without, the model has no TorchRec part)."""
        return bool(self.pooled) or any(self.sequence_tables.values())

    @property
    def pooled_names(self) -> list[str]:
        return [f.name for f in self.pooled]

    def sequence_feature_names(self, sequence: str) -> list[str]:
        return [t.name for t in self.sequence_tables[sequence]]

    @property
    def sequence_groups(self) -> dict[str, list[EmbeddingTable]]:
        """``ec_d<dim>`` -> its sequence tables: TorchRec's EmbeddingCollection holds one dimension only,
        so the sparse arch has one collection (and the batch one KeyedJaggedTensor) per dimension."""
        groups: dict[int, list[EmbeddingTable]] = {}
        for seq in self.sequences:
            for t in self.sequence_tables[seq]:
                groups.setdefault(t.dim, []).append(t)
        return {f"ec_d{d}": ts for d, ts in sorted(groups.items())}

    @property
    def table_to_sequence(self) -> dict[str, str]:
        return {t.name: s for s in self.sequences for t in self.sequence_tables[s]}


def feature_layout(workload: Workload) -> FeatureLayout:
    """The features of ``workload``; refuses a workload the trainer cannot feed."""
    unsupported = sorted({b.type for b in workload.blocks if not isinstance(b, SUPPORTED_BLOCKS)})
    if unsupported:  # pragma: no cover - every block type of the spec is supported
        raise MismatchError(f"workload '{workload.name}': block types {unsupported} are not supported by the trainer yet")
    tasks = [t for b in workload.blocks if isinstance(b, TaskHeads) for t in b.tasks]
    dup = sorted({t for t in tasks if tasks.count(t) > 1})
    if dup:
        raise MismatchError(f"workload '{workload.name}': task names {dup} appear in more than one heads block (or twice "
                            "in one); each task is one label column, so give every task of every heads block its own name")
    vocab: dict[str, int] = {}
    for b in workload.blocks:
        if isinstance(b, TransformerBlock) and b.vocab_size:
            vocab[b.sequence] = min(vocab.get(b.sequence, b.vocab_size), b.vocab_size)
    if not tasks and not vocab:
        raise MismatchError(f"workload '{workload.name}': nothing to train against (no heads block with tasks and no "
                            "transformer block with vocab_size > 0); add a heads block (type: heads) or give a "
                            "transformer block a vocab_size")
    pooled: list[PooledFeature] = []
    seq_tables: dict[str, list[EmbeddingTable]] = {}
    for t in workload.all_tables:
        if t.feature_kind == "sequence":
            assert t.sequence is not None  # validated by the spec
            seq_tables.setdefault(t.sequence, []).append(t)
        elif t.num_features == 1:
            pooled.append(PooledFeature(t.name, t))
        else:
            pooled += [PooledFeature(f"{t.name}__{j}", t) for j in range(t.num_features)]
    inter = {b.sequence for b in workload.blocks if isinstance(b, InterFormerBlock)}
    for s in sorted(inter):
        if s not in seq_tables:
            raise MismatchError(f"workload '{workload.name}': sequence '{s}' has no sequence table to embed its events "
                                f"(an interformer block runs over it); add a table with feature_kind: sequence, sequence: {s}")
    used = inter | set(seq_tables) | {b.sequence for b in workload.blocks if isinstance(b, TransformerBlock)}
    dense = [b for b in workload.blocks if isinstance(b, DenseMLPBlock)]
    sequences = tuple(s.name for s in workload.sequences if s.name in used)
    return FeatureLayout(
        pooled=tuple(pooled),
        sequences=sequences,
        sequence_tables={s: tuple(seq_tables.get(s, ())) for s in sequences},
        num_dense=sum(b.num_dense_features for b in dense),
        tasks=tuple(tasks),
        sequence_max_len={s.name: int(s.length.max_len) for s in workload.sequences if s.name in used},
        token_sequences={s.name: vocab[s.name] for s in workload.sequences if s.name in vocab},
    )


# ---------------------------------------------------------------------------------------------
# The dense arch's token flow: what the model builds from the blocks, checked without torch
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TokenLayout:
    """How many non-sequence tokens of which kind a sample has, and their width."""

    pooled: int
    """Tokens of the pooled embeddings; they come first (see :attr:`pooled_source`)."""

    dense: int
    """Tokens from the dense MLP."""

    summaries: dict[str, int]
    """InterFormer block name -> its summary tokens."""

    width: int
    """Width of the non-sequence tokens (the cost model's token width, ``flops.token_width``)."""

    pooled_source: str = "kunlun"
    """'kunlun': the pooled embeddings projected into Kunlun's ``num_tokens`` tokens; 'learned': Kunlun's
    tokens without pooled features (learned constants); 'chunks': no Kunlun or DotInteraction block reads
    the pooled embeddings, so their concatenation joins the tokens as it is, cut into width-wide tokens
    (zero-padded; no projection, no FLOPs, as the cost model counts none); 'none': no pooled tokens
    (none exist, or a DotInteraction block takes them)."""

    @property
    def total(self) -> int:
        return self.pooled + self.dense + sum(self.summaries.values())


def token_layout(workload: Workload) -> TokenLayout:
    """The non-sequence tokens of a workload; refuses inconsistent block shapes clearly."""
    blocks = workload.blocks
    dense = sum(b.out_tokens for b in blocks if isinstance(b, DenseMLPBlock))
    inter = [b for b in blocks if isinstance(b, InterFormerBlock)]
    summaries = {b.name: b.num_summary_tokens for b in inter}
    kunlun = [b for b in blocks if isinstance(b, KunlunBlock)]
    moe = [b for b in blocks if isinstance(b, MoEBlock)]
    dots = [b for b in blocks if isinstance(b, DotInteractionBlock)]
    width = token_width(workload)
    pooled_dim = sum(t.dim * t.num_features for t in workload.all_tables if t.feature_kind == "pooled")
    if kunlun:
        pooled, source = kunlun[0].num_tokens, "kunlun" if pooled_dim else "learned"
    elif dots or not pooled_dim:
        pooled, source = 0, "none"
    else:
        pooled, source = -(-pooled_dim // width), "chunks"
    for b in kunlun[1:]:
        if b.num_tokens != kunlun[0].num_tokens:
            raise MismatchError(f"workload '{workload.name}': kunlun blocks disagree on num_tokens ({b.num_tokens} vs "
                                f"{kunlun[0].num_tokens})")
    for b in kunlun + moe + dots:
        have = b.dim if isinstance(b, DotInteractionBlock) else b.model_dim
        if have != width:
            field_ = "dim" if isinstance(b, DotInteractionBlock) else "model_dim"
            raise MismatchError(f"workload '{workload.name}': block '{b.name}' has {field_} {have} but the "
                                f"non-sequence tokens are {width} wide; kunlun, moe and dot_interaction blocks must "
                                f"share one width (set {field_}: {width})")
    interaction = [i for i, b in enumerate(blocks) if isinstance(b, (KunlunBlock, MoEBlock))]
    if interaction and any(isinstance(b, InterFormerBlock) for b in blocks[min(interaction):]):
        raise MismatchError(f"workload '{workload.name}': interformer blocks must come before kunlun and moe blocks "
                            "(their summaries are non-sequence tokens the interaction blocks read)")
    layout = TokenLayout(pooled=pooled, dense=dense, summaries=summaries, width=width, pooled_source=source)
    for b in moe:
        if b.tokens_per_sample > layout.total:
            raise MismatchError(f"workload '{workload.name}': block '{b.name}' routes {b.tokens_per_sample} tokens per "
                                f"sample but a sample has {layout.total} non-sequence tokens (set tokens_per_sample "
                                f"to at most {layout.total})")
    return layout


def readouts(workload: Workload, tokens: TokenLayout) -> dict[str, tuple[str, str | None, int]]:
    """What each heads block reads: the output of the nearest block before it, ``(kind, source block, width)``:
    ``('vector', dot block)`` after a dot_interaction (its top MLP's output), ``('last', transformer block)``
    after a transformer (each sample's last token), ``('tokens', None)`` after any other block (the mean of
    the non-sequence tokens). Refuses a heads block whose ``input_dim`` is not that width, and a
    transformer whose output nothing reads."""
    out: dict[str, tuple[str, str | None, int]] = {}
    blocks = workload.blocks
    for i, b in enumerate(blocks):
        if isinstance(b, TransformerBlock) and not b.vocab_size:
            nxt = blocks[i + 1] if i + 1 < len(blocks) else None
            chained = any(isinstance(c, TransformerBlock) and c.sequence == b.sequence for c in blocks[i + 1:])
            if not isinstance(nxt, TaskHeads) and not chained:
                raise MismatchError(f"workload '{workload.name}': nothing reads the output of transformer block "
                                    f"'{b.name}' (blocks[{i}]: vocab_size 0 and no heads block right after it); "
                                    "give it a vocab_size (next-token loss) or put a heads block after it")
        if not isinstance(b, TaskHeads):
            continue
        prev = next((c for c in reversed(blocks[:i]) if not isinstance(c, TaskHeads)), None)
        if prev is None:
            raise MismatchError(f"workload '{workload.name}': heads block '{b.name}' (blocks[{i}]) has no block before "
                                "it to read; put it after the blocks whose output it classifies")
        if isinstance(prev, DotInteractionBlock):
            n = prev.num_tokens
            src = ("vector", prev.name, ([n * (n - 1) // 2 + prev.dim, *prev.top_hidden_dims])[-1])
        elif isinstance(prev, TransformerBlock):
            src = ("last", prev.name, prev.model_dim)
        else:
            src = ("tokens", None, tokens.width)
        if b.input_dim != src[2]:
            what = {"vector": f"the output of dot_interaction block '{src[1]}'",
                    "last": f"the last token of transformer block '{src[1]}'",
                    "tokens": "the mean of the non-sequence tokens"}[src[0]]
            raise MismatchError(f"workload '{workload.name}': heads.input_dim is {b.input_dim} (block '{b.name}', "
                                f"blocks[{i}]) but its towers read {what}, which is {src[2]} wide; set input_dim: {src[2]}")
        out[b.name] = src
    return out


def check_sequences(workload: Workload, layout: FeatureLayout) -> None:
    """Refuse transformer blocks the trainer cannot feed: no input at all, or sequence tables whose widths
    do not add up to the block's width (the cost model prices no input projection for a transformer)."""
    seen: set[str] = set()
    for i, b in enumerate(workload.blocks):
        if not isinstance(b, TransformerBlock):
            continue
        tables = layout.sequence_tables.get(b.sequence, ())
        width = sum(t.dim for t in tables)
        if tables and width != b.model_dim:
            raise MismatchError(f"workload '{workload.name}': the sequence tables of '{b.sequence}' "
                                f"({', '.join(t.name for t in tables)}) are {width} wide together but transformer block "
                                f"'{b.name}' (blocks[{i}]) has model_dim {b.model_dim}; the cost model prices no input "
                                f"projection for a transformer: give the tables dims that sum to {b.model_dim}")
        if not b.vocab_size and not tables and b.sequence not in seen:
            raise MismatchError(f"workload '{workload.name}': transformer block '{b.name}' (blocks[{i}]) has no input: "
                                f"vocab_size is 0 and sequence '{b.sequence}' has no sequence table; set vocab_size "
                                f"(token ids) or add a table with feature_kind: sequence, sequence: {b.sequence}")
        seen.add(b.sequence)
    for i, b in enumerate(workload.blocks):
        if isinstance(b, DotInteractionBlock):
            n = len(layout.pooled) + sum(c.out_tokens for c in workload.blocks if isinstance(c, DenseMLPBlock))
            if b.num_tokens != n:
                raise MismatchError(f"workload '{workload.name}': dot_interaction block '{b.name}' (blocks[{i}]) has "
                                    f"num_tokens {b.num_tokens} but it interacts {n} vectors ({len(layout.pooled)} pooled "
                                    f"features and the dense MLP's tokens); set num_tokens: {n}")


def check_buildable(workload: Workload) -> FeatureLayout:
    """Every check the model's construction makes (inputs, token widths and counts, what each heads block
    reads, the transformers' inputs), torch-free: what ``coplan train`` refuses before launching."""
    layout = feature_layout(workload)
    readouts(workload, token_layout(workload))
    check_sequences(workload, layout)
    return layout


__all__ = ["FeatureLayout", "PooledFeature", "TokenLayout", "check_buildable", "check_sequences", "feature_layout",
           "readouts", "token_layout"]
