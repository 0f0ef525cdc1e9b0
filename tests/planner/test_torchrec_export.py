"""TorchRec export: the plan's tables as torchrec.distributed.types.ShardingPlan, checked against
TorchRec's own plan constructors, read back, saved and loaded (CPU only)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
torchrec = pytest.importorskip("torchrec")

from torchrec.distributed.sharding_plan import (  # noqa: E402
    column_wise,
    construct_module_sharding_plan,
    data_parallel,
    row_wise,
    table_row_wise,
    table_wise,
)
from torchrec.distributed.types import ShardingPlan  # noqa: E402
from torchrec.modules.embedding_configs import EmbeddingBagConfig  # noqa: E402
from torchrec.modules.embedding_modules import EmbeddingBagCollection  # noqa: E402

from coplan.planner.torchrec_export import as_json, from_torchrec, to_torchrec, write_torchrec  # noqa: E402
from coplan.spec import MeshPlan, Plan, TableShard, load_topology, load_workload  # noqa: E402


def _plan() -> Plan:
    w = load_workload("gem-tiny")
    t = load_topology("h200-superpod-1k")
    tables = (
        TableShard(table="user_id", sharding_type="table_wise", ranks=(3,)),
        TableShard(table="ad_id", sharding_type="column_wise", ranks=(5, 9)),
        TableShard(table="interests", sharding_type="row_wise", ranks=tuple(range(16))),
        TableShard(table="geo", sharding_type="table_row_wise", ranks=tuple(range(8, 16))),
        TableShard(table="hist_item", sharding_type="row_wise", ranks=tuple(range(16))),
        TableShard(table="hist_action", sharding_type="data_parallel", ranks=(), compute_kernel="dense"),
    )
    mesh = MeshPlan(dense_shard=16, dense_replicate=2, sparse_shard=16, sparse_replicate=2)
    return Plan(topology=t, workload=w, world_size=32, mesh=mesh, tables=tables)


def _specs(ps):
    if ps.sharding_spec is None:
        return None
    return [(list(m.shard_sizes), list(m.shard_offsets), str(m.placement)) for m in ps.sharding_spec.shards]


def test_export_matches_torchrec_constructors():
    plan = _plan()
    sp = to_torchrec(plan)
    assert isinstance(sp, ShardingPlan)
    assert set(sp.plan) == {"sparse.ebc", "sparse.ecs.ec_d16"}
    w = plan.workload
    pooled = [t for t in w.all_tables if t.feature_kind == "pooled"]
    ebc = EmbeddingBagCollection(
        tables=[EmbeddingBagConfig(name=t.name, embedding_dim=t.dim, num_embeddings=t.num_rows, feature_names=[t.name]) for t in pooled],
        device=torch.device("meta"),
    )
    ref = construct_module_sharding_plan(
        ebc,
        {"user_id": table_wise(rank=3), "ad_id": column_wise(ranks=[5, 9]), "interests": row_wise(), "geo": table_row_wise(host_index=1)},
        local_size=8, world_size=16, device_type="cuda",
    )
    ours = sp.plan["sparse.ebc"]
    for name, ps in ref.items():
        assert ours[name].sharding_type == ps.sharding_type, name
        assert list(ours[name].ranks) == list(ps.ranks), name
        assert _specs(ours[name]) == _specs(ps), name
    dp = construct_module_sharding_plan(ebc, {n: data_parallel() for n in ("user_id", "ad_id", "interests", "geo")},
                                        local_size=8, world_size=16, device_type="cuda")["interests"]
    assert sp.plan["sparse.ecs.ec_d16"]["hist_action"].sharding_type == dp.sharding_type
    assert sp.plan["sparse.ecs.ec_d16"]["hist_action"].sharding_spec is None


def test_round_trip_and_replica_offsets(tmp_path):
    plan = _plan()
    assert from_torchrec(to_torchrec(plan), plan) == plan.tables
    second = to_torchrec(plan, replica=1)
    assert list(second.plan["sparse.ebc"]["user_id"].ranks) == [3 + 16]
    assert str(second.plan["sparse.ebc"]["user_id"].sharding_spec.shards[0].placement) == "rank:19/cuda:3"
    assert from_torchrec(second, plan, replica=1) == plan.tables
    pt, js = write_torchrec(plan, tmp_path / "plan.torchrec.pt")
    loaded = torch.load(pt, weights_only=False)
    assert isinstance(loaded, ShardingPlan) and from_torchrec(loaded, plan) == plan.tables
    assert js.read_text().strip().startswith("{") and as_json(loaded)["sparse.ebc"]["ad_id"]["shards"][1]["offsets"] == [0, 8]


def test_planned_plan_exports(tmp_path):
    from coplan.planner.search import PlannerConfig, make_plan

    plan, _ = make_plan(load_workload("gem-tiny"), load_topology("h200-superpod-1k"), None, PlannerConfig(world_size=16, num_workers=1))
    sp = to_torchrec(plan)
    assert sum(len(m) for m in sp.plan.values()) == len(plan.workload.all_tables)
    assert from_torchrec(sp, plan) == plan.tables
