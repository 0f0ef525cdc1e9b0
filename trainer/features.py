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


__all__ = ["FeatureLayout", "PooledFeature", "feature_layout"]
