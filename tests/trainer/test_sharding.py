"""The plan's table shards as a TorchRec ShardingPlan, and the mesh degrees."""

import pytest

from coplan.errors import MismatchError
from coplan.spec import load_topology, load_workload
from coplan.spec.plan import TableShard
from coplan.trainer.distributed.embedding import build_sharding_plan, parameter_sharding
from coplan.trainer.distributed.mesh import ParallelDims
from coplan.trainer.features import feature_layout
from coplan.trainer.model.sparse import SparseArch
from coplan.planner.given import given_plan


def _ps(kind, ranks=(), **kw):
    ts = TableShard(table="t", sharding_type=kind, ranks=ranks, compute_kernel="dense" if kind == "data_parallel" else "fused")
    args = dict(group_size=4, local_size=2, device_type="cpu", is_sequence=False)
    args.update(kw)
    return parameter_sharding(ts, 10, 8, **args)


def test_row_wise_blocks_follow_torchrec():
    ps = _ps("row_wise", (0, 1, 2, 3))
    sizes = [s.shard_sizes[0] for s in ps.sharding_spec.shards]
    offsets = [s.shard_offsets[0] for s in ps.sharding_spec.shards]
    assert sizes == [3, 3, 3, 1] and offsets == [0, 3, 6, 9]  # blocks of ceil(10 / 4) rows
    assert ps.ranks == [0, 1, 2, 3] and ps.compute_kernel == "fused"
    assert [s.placement.rank() for s in ps.sharding_spec.shards] == [0, 1, 2, 3]


def test_data_parallel_sequence_tables_are_accepted_on_cpu():
    dp = _ps("data_parallel", is_sequence=True)  # the trainer's CPU lookup path (embedding.cpu_sequence_lookups)
    assert dp.compute_kernel == "dense" and dp.ranks == [0, 1, 2, 3]


def test_ranks_of_a_later_sparse_group_are_global():
    """2-D sparse parallelism on CPU: the group-local plan shifted to the group's first global rank."""
    rw = _ps("row_wise", (0, 1, 2, 3), rank_offset=4)
    assert rw.ranks == [4, 5, 6, 7] and [s.placement.rank() for s in rw.sharding_spec.shards] == [4, 5, 6, 7]
    assert _ps("data_parallel", rank_offset=4).ranks == [4, 5, 6, 7]


def test_table_wise_column_wise_table_row_wise_and_dp():
    tw = _ps("table_wise", (3,))
    assert tw.ranks == [3] and tw.sharding_spec.shards[0].shard_sizes == [10, 8]
    cw = _ps("column_wise", (2, 0))
    assert [s.shard_offsets for s in cw.sharding_spec.shards] == [[0, 0], [0, 4]] and cw.ranks == [2, 0]
    twrw = _ps("table_row_wise", (2, 3))
    assert twrw.ranks == [2, 3] and [s.shard_sizes[0] for s in twrw.sharding_spec.shards] == [5, 5]
    dp = _ps("data_parallel")
    assert dp.compute_kernel == "dense" and dp.sharding_spec is None and dp.ranks == [0, 1, 2, 3]


@pytest.mark.parametrize(
    "kind, ranks, kw, match",
    [
        ("row_wise", (1, 0, 2, 3), {}, "in order"),
        ("table_row_wise", (1, 2), {}, "one node"),
        ("column_wise", (0, 1, 2), {}, "evenly"),
        ("table_row_wise", (0, 1), {"is_sequence": True}, "sequence table"),
        ("table_wise", (5,), {}, "outside the sparse group"),
    ],
)
def test_unsupported_layouts_are_refused(kind, ranks, kw, match):
    with pytest.raises(MismatchError, match=match):
        _ps(kind, ranks, **kw)


def test_sharding_plan_names_every_collection():
    w = load_workload("gem-tiny")
    plan = given_plan(w, load_topology("h200-superpod-1k"), 4, dense_replicate=2, expert_parallel=2)
    sparse = SparseArch(feature_layout(w))
    sp = build_sharding_plan(plan, sparse, device_type="cpu", local_size=4)
    assert set(sp.plan) == {"sparse.ebc", "sparse.ecs.ec_d16"}
    assert set(sp.plan["sparse.ebc"]) == {"user_id", "ad_id", "interests", "geo"}
    assert set(sp.plan["sparse.ecs.ec_d16"]) == {"hist_item", "hist_action"}


def test_parallel_dims_checks_itself():
    d = ParallelDims(dp_replicate=2, dp_shard=4, ep=2, sparse_shard=8, sparse_replicate=1, world_size=8)
    assert d.hsdp_enabled and d.fsdp_enabled and d.ep_enabled
    with pytest.raises(MismatchError, match="divide"):
        ParallelDims(dp_replicate=1, dp_shard=4, ep=3, sparse_shard=4, sparse_replicate=1, world_size=4)
    two_d = ParallelDims(dp_replicate=1, dp_shard=4, ep=1, sparse_shard=2, sparse_replicate=2, world_size=4)
    assert two_d.sparse_2d_enabled and not d.sparse_2d_enabled
    with pytest.raises(MismatchError, match="sparse_replicate × sparse_shard"):
        ParallelDims(dp_replicate=1, dp_shard=4, ep=1, sparse_shard=2, sparse_replicate=3, world_size=4)
    with pytest.raises(MismatchError, match="world"):
        ParallelDims(dp_replicate=2, dp_shard=4, ep=1, sparse_shard=8, sparse_replicate=1, world_size=4)
