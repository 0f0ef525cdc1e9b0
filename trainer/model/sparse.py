"""The sparse arch: pooled features through a TorchRec EmbeddingBagCollection, history events through
EmbeddingCollections into jagged token sequences.

Built on the meta device: TorchRec's DistributedModelParallel allocates each table where the plan
puts its shards, and :func:`init_table_rows` then fills every shard from a seeded generator that
depends only on (seed, table, row block), so any sharding of a table holds the same values as the
unsharded table.
"""

from __future__ import annotations

import zlib

import torch
from torch import nn
from torch.autograd.profiler import record_function
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig, KeyedJaggedTensor
from torchrec.modules.embedding_configs import DataType, PoolingType

from coplan.spec.workload import EmbeddingTable
from coplan.trainer.features import FeatureLayout

_DATA_TYPES = {"fp32": DataType.FP32, "fp16": DataType.FP16, "bf16": DataType.BF16, "int8": DataType.INT8}

INIT_BLOCK_ROWS = 1 << 16
"""Rows generated per seeded block: shards of any size regenerate exactly their rows' blocks."""

INIT_RANGE = 0.05
"""Embedding rows start uniform in [-INIT_RANGE, INIT_RANGE]."""


class SparseArch(nn.Module):
    """``ebc`` for pooled features and one ``ec_d<dim>`` per sequence-table dimension."""

    def __init__(self, layout: FeatureLayout, *, device: torch.device | str = "meta") -> None:
        super().__init__()
        self.layout = layout
        device = torch.device(device)
        by_table: dict[str, list[str]] = {}
        tables: dict[str, EmbeddingTable] = {}
        for f in layout.pooled:
            by_table.setdefault(f.table.name, []).append(f.name)
            tables[f.table.name] = f.table
        self.ebc = (
            EmbeddingBagCollection(
                tables=[
                    EmbeddingBagConfig(
                        name=name, embedding_dim=t.dim, num_embeddings=t.num_rows, feature_names=by_table[name],
                        pooling=PoolingType.SUM, data_type=_DATA_TYPES[t.dtype],
                    )
                    for name, t in tables.items()
                ],
                device=device,
            )
            if tables
            else None
        )
        groups = layout.sequence_groups
        self.ecs = nn.ModuleDict(
            {
                name: EmbeddingCollection(
                    tables=[
                        EmbeddingConfig(name=t.name, embedding_dim=t.dim, num_embeddings=t.num_rows, feature_names=[t.name],
                                        data_type=_DATA_TYPES[t.dtype])
                        for t in ts
                    ],
                    device=device,
                )
                for name, ts in groups.items()
            }
        )
        self.ec_features = {name: [t.name for t in ts] for name, ts in groups.items()}

    def _collections(self, pooled: KeyedJaggedTensor | None, sequences: dict[str, KeyedJaggedTensor]):
        """(key, module, its input) of every collection that has input."""
        if self.ebc is not None and pooled is not None:
            yield "ebc", self.ebc, pooled
        for name, ec in self.ecs.items():
            yield f"ecs.{name}", ec, sequences[name]

    def input_dist(self, pooled: KeyedJaggedTensor | None, sequences: dict[str, KeyedJaggedTensor]) -> dict[str, tuple]:
        """TorchRec's input distribution of every sharded collection, done ahead of :meth:`forward`
        (what ``ShardedModule.forward`` does first): key -> (sharding context, distributed input).

        The trainer runs it for the next batch on a side stream (:mod:`coplan.trainer.pipeline`): its
        small host-to-device copies from pageable memory synchronise the stream they run on, and on the
        compute stream that drains the GPU's queue. Collections that are not sharded are left out (they
        run whole in forward)."""
        from torchrec.distributed.types import ShardedModule

        out = {}
        with record_function("## coplan:input_dist_ahead ##"):  # (a TorchRec-style name: sparse.dist in attribution)
            for key, m, kjt in self._collections(pooled, sequences):
                if isinstance(m, ShardedModule):
                    ctx = m.create_context()
                    out[key] = (ctx, m.input_dist(ctx, kjt).wait().wait())
        return out

    @staticmethod
    def _lookup(key: str, m: nn.Module, kjt: KeyedJaggedTensor, dist: dict[str, tuple] | None):
        if dist is not None and key in dist:
            ctx, dist_input = dist[key]
            return m.compute_and_output_dist(ctx, dist_input)
        return m(kjt)

    def forward(
        self, pooled: KeyedJaggedTensor | None, sequences: dict[str, KeyedJaggedTensor], dist: dict[str, tuple] | None = None
    ) -> tuple[torch.Tensor | None, tuple[str, ...], list[int], dict[str, torch.Tensor]]:
        """Returns (pooled values [B, Σ dims], their keys, their widths, {sequence feature: values [T, dim]}).

        ``dist``: the inputs' distribution done ahead (:meth:`input_dist`); collections not in it
        distribute their input here. The op ranges are the cost model's: ``sparse.tbe`` (pooled lookups,
        their all-to-alls included) and ``sparse.seq_tbe`` (sequence lookups).

        A sequence feature's output is its rows in input order and nothing else: its KJT may cut each
        history into several bags (``FeatureLayout.seq_chunk``), and the bag lengths of the output are
        never read; the per-sample offsets come with the batch.
        """
        pooled_values, keys, widths = None, (), []
        if self.ebc is not None and pooled is not None:
            with record_function("sparse.tbe"):
                kt = self._lookup("ebc", self.ebc, pooled, dist)
                pooled_values, keys, widths = kt.values(), tuple(kt.keys()), list(kt.length_per_key())
        seq: dict[str, torch.Tensor] = {}
        with record_function("sparse.seq_tbe"):
            for name, ec in self.ecs.items():
                out = self._lookup(f"ecs.{name}", ec, sequences[name], dist)
                for f in self.ec_features[name]:
                    seq[f] = out[f].values()
        return pooled_values, keys, widths, seq


def table_seed(seed: int, table: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(table.encode())) & 0x7FFFFFFF


@torch.no_grad()
def init_table_rows(out: torch.Tensor, seed: int, table: str, dim: int, row_start: int, col_start: int = 0) -> None:
    """Fill ``out`` (rows ``row_start...``, columns ``col_start...`` of ``table``) with the table's seeded values.

    Rows come in blocks of :data:`INIT_BLOCK_ROWS`, each drawn whole (all ``dim`` columns) from its
    own generator on ``out``'s device type; so a row-wise, column-wise or whole-table shard gets the
    same values as the same rows of the full table (on the same device type).
    """
    rows, cols = out.shape
    if rows == 0 or cols == 0:
        return
    dev = out.device
    r = row_start
    while r < row_start + rows:
        block = r // INIT_BLOCK_ROWS
        b0 = block * INIT_BLOCK_ROWS
        gen = torch.Generator(device=dev)
        gen.manual_seed(table_seed(seed, table) * 65_537 + block)
        vals = torch.rand(INIT_BLOCK_ROWS, dim, generator=gen, device=dev, dtype=torch.float32)
        lo, hi = r - b0, min(row_start + rows - b0, INIT_BLOCK_ROWS)
        chunk = vals[lo:hi, col_start : col_start + cols].mul_(2 * INIT_RANGE).sub_(INIT_RANGE)
        out[r - row_start : r - row_start + (hi - lo)].copy_(chunk)
        r = b0 + hi


__all__ = ["INIT_BLOCK_ROWS", "SparseArch", "init_table_rows", "table_seed"]
