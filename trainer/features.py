"""The input features a workload implies: one spelling shared by the data files, the model and the plan.

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
from dataclasses import dataclass, replace

from coplan.errors import MismatchError
from coplan.spec import Workload
from coplan.spec.workload import (
    DenseMLPBlock,
    EmbeddingTable,
    InterFormerBlock,
    KunlunBlock,
    MoEBlock,
    TaskHeads,
)

SUPPORTED_BLOCKS = (DenseMLPBlock, InterFormerBlock, KunlunBlock, MoEBlock, TaskHeads)


@dataclass(frozen=True, slots=True)
class PooledFeature:
    """One bag-of-ids feature."""

    name: str
    """Feature (and Parquet column) name."""

    table: EmbeddingTable
    """The table it looks up."""


@dataclass(frozen=True, slots=True)
class FeatureLayout:
    """Every input of a GEM-shaped workload, in a fixed order."""

    pooled: tuple[PooledFeature, ...]
    """Pooled features, in table order."""

    sequences: tuple[str, ...]
    """Names of the sequences (histories) some table or block uses."""

    sequence_tables: dict[str, tuple[EmbeddingTable, ...]]
    """Sequence name -> its sequence tables (each one feature, named after the table)."""

    num_dense: int
    """Float features per sample (0 without a dense_mlp block)."""

    tasks: tuple[str, ...]
    """Binary tasks (label columns ``label_<task>``)."""

    sequence_max_len: dict[str, int]
    """Sequence name -> its length distribution's cap, in events (no history is longer)."""

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
    """The features of ``workload``; refuses a workload the trainer cannot build."""
    unsupported = sorted({b.type for b in workload.blocks if not isinstance(b, SUPPORTED_BLOCKS)})
    if unsupported:
        raise MismatchError(
            f"workload '{workload.name}': the trainer builds GEM-shaped models (dense_mlp, interformer, kunlun, "
            f"moe, heads); block types {unsupported} are not supported by it yet"
        )
    heads = [b for b in workload.blocks if isinstance(b, TaskHeads)]
    if len(heads) != 1:
        raise MismatchError(f"workload '{workload.name}': the trainer needs exactly one 'heads' block; found {len(heads)}")
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
    used = {b.sequence for b in workload.blocks if isinstance(b, InterFormerBlock)} | set(seq_tables)
    for s in sorted(used):
        if s not in seq_tables:
            raise MismatchError(f"workload '{workload.name}': sequence '{s}' has no sequence table to embed its events")
    dense = [b for b in workload.blocks if isinstance(b, DenseMLPBlock)]
    return FeatureLayout(
        pooled=tuple(pooled),
        sequences=tuple(s.name for s in workload.sequences if s.name in used),
        sequence_tables={k: tuple(v) for k, v in seq_tables.items()},
        num_dense=sum(b.num_dense_features for b in dense),
        tasks=tuple(heads[0].tasks),
        sequence_max_len={s.name: int(s.length.max_len) for s in workload.sequences if s.name in used},
    )


__all__ = ["FeatureLayout", "PooledFeature", "feature_layout"]
