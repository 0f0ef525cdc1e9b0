"""Hand-built plans: valid Plan specs with the requested choices."""

import pytest

from coplan.errors import MismatchError
from coplan.spec import Plan, load_topology, load_workload
from coplan.trainer.plans import as_single_process, layer_names, make_plan, single_process_plan


@pytest.fixture(scope="module")
def tiny():
    return load_workload("gem-tiny")


@pytest.fixture(scope="module")
def pod():
    return load_topology("h200-superpod-1k")


def test_mixed_plan_covers_every_kind(tiny, pod):
    plan = make_plan(tiny, pod, 4, dense_replicate=2, expert_parallel=2, recompute=["interformer.1"])
    assert isinstance(plan, Plan)
    kinds = {t.sharding_type for t in plan.tables}
    assert kinds == {"table_wise", "row_wise", "data_parallel"}
    assert (plan.mesh.dense_replicate, plan.mesh.dense_shard, plan.mesh.expert_parallel) == (2, 2, 2)
    assert [lp.name for lp in plan.layers if lp.recompute] == ["interformer.1"]
    for t in plan.tables:
        if t.sharding_type == "row_wise":
            assert t.ranks == (0, 1, 2, 3)
        if t.sharding_type == "data_parallel":
            assert t.ranks == () and t.compute_kernel == "dense"


def test_layer_names_match_costmodel(tiny):
    from coplan.costmodel.flops import layer_names as cm_layers

    assert set(layer_names(tiny)) <= set(cm_layers(tiny))


def test_axes_follow_tiers(tiny, pod):
    plan = make_plan(tiny, pod, 16, dense_replicate=2)
    axes = {a.name: a for a in plan.mesh.axes}
    assert axes["dp_shard"].tiers == ("nvlink",)  # 8 consecutive ranks stay in one DGX
    assert axes["dp_replicate"].tiers == ("leaf",)


def test_single_process_reference_keeps_choices(tiny, pod):
    plan = make_plan(tiny, pod, 4, dense_replicate=2, expert_parallel=2, recompute=["moe.0"])
    ref = as_single_process(plan)
    assert ref.world_size == 1
    assert {t.table: t.sharding_type for t in ref.tables} == {
        t.table: ("data_parallel" if t.sharding_type == "data_parallel" else "table_wise") for t in plan.tables
    }
    assert [lp.name for lp in ref.layers if lp.recompute] == ["moe.0"]
    assert single_process_plan(tiny, load_topology("h200-1gpu")).world_size == 1


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(dense_replicate=3), "must divide"),
        (dict(expert_parallel=8), "must divide"),
        (dict(recompute=["interformer.9"]), "not layers"),
        (dict(tables={"nope": "table_wise"}), "not tables"),
    ],
)
def test_bad_choices_are_refused(tiny, pod, kw, match):
    with pytest.raises(MismatchError, match=match):
        make_plan(tiny, pod, 4, **kw)
