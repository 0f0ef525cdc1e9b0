"""The input features a workload implies: one spelling shared by the data files, the model and the plan.

A pooled table with ``num_features = k`` is looked up by ``k`` features (``<table>`` when k is 1,
``<table>__<j>`` otherwise), each a bag of ids per sample. A sequence table is looked up once per
event of its sequence, so its feature is named after the table and its length per sample is the
sequence's length. Torch-free: the data generator uses it without torch.
"""

from __future__ import annotations

from dataclasses import dataclass

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
    )


__all__ = ["FeatureLayout", "PooledFeature", "feature_layout"]
