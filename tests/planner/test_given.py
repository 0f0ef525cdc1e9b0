"""Given plans: valid Plan specs with the requested choices, made through the planner's one assembly."""

import pytest

from coplan.costmodel.flops import recomputable_layers
from coplan.errors import MismatchError
from coplan.spec import Plan, load_topology, load_workload
from coplan.planner.given import as_single_process, given_plan, main, single_process_plan, with_layers


@pytest.fixture(scope="module")
def tiny():
    return load_workload("gem-tiny")


@pytest.fixture(scope="module")
def pod():
    return load_topology("h200-superpod-1k")


def test_mixed_plan_covers_every_kind(tiny, pod):
    plan = given_plan(tiny, pod, 4, dense_replicate=2, expert_parallel=2, recompute=["interformer.1"])
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


def test_given_plans_are_priced_by_the_one_assembly(tiny, pod):
    """A given plan carries the full pricer's prediction of its choices, as the planner's plans do."""
    from coplan.planner.assemble import assemble

    plan = given_plan(tiny, pod, 4, dense_replicate=2, expert_parallel=2, recompute=["moe.0"])
    assert plan.solver is not None and plan.solver.status == "GIVEN"
    assert plan.predicted is not None and plan.predicted.step_time_s > 0 and plan.predicted.ops
    again = assemble(tiny, pod, mesh=plan.mesh, tables=plan.tables, layers=plan.layers, balancing=plan.balancing.model_copy(
        update={"expected_imbalance": 1.0}), kernels=plan.kernels)
    assert again.predicted.step_time_s == pytest.approx(plan.predicted.step_time_s)


def test_two_d_sparse_and_explicit_placements(tiny, pod):
    """Copies of the tables and placements given rank by rank: the mesh axes and the price follow them."""
    tables = {t.name: ("table_wise", (1,)) for t in tiny.all_tables} | {"user_id": ("column_wise", (0, 1))}
    plan = given_plan(tiny, pod, 4, sparse_replicate=2, tables=tables)
    assert (plan.mesh.sparse_shard, plan.mesh.sparse_replicate) == (2, 2)
    assert {a.name: a.size for a in plan.mesh.axes}["sparse_replicate"] == 2
    assert {t.table: t.ranks for t in plan.tables}["user_id"] == (0, 1) and {t.table: t.ranks for t in plan.tables}["geo"] == (1,)
    one_copy = given_plan(tiny, pod, 4, tables={k: (v[0], (0, 1, 2, 3) if v[0] == "column_wise" else v[1]) for k, v in tables.items()})
    assert plan.predicted.peak_memory_bytes != one_copy.predicted.peak_memory_bytes
    with pytest.raises(MismatchError, match="sparse_replicate=3 must divide"):
        given_plan(tiny, pod, 4, sparse_replicate=3)


def test_layers_are_the_ones_the_trainer_can_recompute(tiny, pod):
    plan = given_plan(tiny, pod, 2)
    assert [lp.name for lp in plan.layers] == list(recomputable_layers(tiny))


def test_axes_follow_tiers_from_the_one_mapping(tiny, pod):
    from coplan.planner.mesh import mesh_axes

    plan = given_plan(tiny, pod, 16, dense_replicate=2)
    axes = {a.name: a for a in plan.mesh.axes}
    assert axes["dp_shard"].tiers == ("nvlink",)  # 8 consecutive ranks stay in one DGX
    assert axes["dp_replicate"].tiers == ("leaf",)
    assert plan.mesh.axes == mesh_axes(pod, plan.mesh.model_copy(update={"axes": ()}))


def test_single_process_reference_keeps_choices(tiny, pod):
    plan = given_plan(tiny, pod, 4, dense_replicate=2, expert_parallel=2, recompute=["moe.0"], attention_backend="reference")
    ref = as_single_process(plan)
    assert ref.world_size == 1 and ref.solver.status == "GIVEN"
    assert {t.table: t.sharding_type for t in ref.tables} == {
        t.table: ("data_parallel" if t.sharding_type == "data_parallel" else "table_wise") for t in plan.tables
    }
    assert [lp.name for lp in ref.layers if lp.recompute] == ["moe.0"]
    assert ref.kernels.attention == "reference" and ref.balancing.policy == plan.balancing.policy
    assert single_process_plan(tiny, load_topology("h200-1gpu")).world_size == 1


def test_with_layers_keeps_every_other_choice(tiny, pod):
    plan = given_plan(tiny, pod, 4, dense_replicate=2)
    rc = with_layers(plan, recompute=["interformer.0", "interformer.1"])
    assert (rc.mesh, rc.tables, rc.balancing.policy, rc.kernels) == (plan.mesh, plan.tables, plan.balancing.policy, plan.kernels)
    assert [lp.name for lp in rc.layers if lp.recompute] == ["interformer.0", "interformer.1"]
    assert rc.solver.status == "GIVEN" and any("recompute interformer.0, interformer.1" in n for n in rc.predicted.notes)
    assert with_layers(rc).layers == rc.layers
    with pytest.raises(MismatchError, match="precision.fp8 'off'"):
        with_layers(plan, fp8=["interformer.0"])
    auto = tiny.model_copy(update={"precision": tiny.precision.model_copy(update={"fp8": "force"})})
    f8 = with_layers(given_plan(auto, pod, 4), fp8=["interformer.0"])
    assert [lp.name for lp in f8.layers if lp.precision == "fp8"] == ["interformer.0"]


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(dense_replicate=3), "must divide"),
        (dict(expert_parallel=8), "must divide"),
        (dict(recompute=["interformer.9"]), "not layers"),
        (dict(recompute=["dense_mlp.0"]), "the trainer can recompute"),
        (dict(tables={"nope": "table_wise"}), "not tables"),
    ],
)
def test_bad_choices_are_refused(tiny, pod, kw, match):
    with pytest.raises(MismatchError, match=match):
        given_plan(tiny, pod, 4, **kw)


def test_cli_writes_a_priced_plan_and_refuses_bad_input(tmp_path, capsys):
    from coplan.spec import load_plan

    out = tmp_path / "plan.json"
    assert main(["--workload", "gem-tiny", "--topology", "h200-superpod-1k", "--world-size", "4", "--dense-replicate", "2",
                 "--expert-parallel", "2", "-o", str(out)]) == 0
    plan = load_plan(out)
    assert plan.world_size == 4 and plan.solver.status == "GIVEN" and plan.predicted.step_time_s > 0
    assert main(["--workload", "gem-tiny", "--topology", "h200-1gpu", "--recompute", "nope.0", "-o", str(out)]) == 2
    assert "error: recompute names ['nope.0']" in capsys.readouterr().err
