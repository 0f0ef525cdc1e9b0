"""The balance group: the planner prices a node's ranks and larger groups (imbalance between groups against the
data loader's rows) and writes its pick; one node writes none; the plan's figures are the pricer's at that group;
a group that does not divide the world is refused naming the field."""

from __future__ import annotations

import pytest

from coplan.costmodel.compute import imbalance
from coplan.costmodel.context import build_context
from coplan.costmodel.pricer import loader_time, with_balance_group
from coplan.planner.costs import Pricer
from coplan.planner.search import PlannerConfig, make_plan
from coplan.reports.inputs import price_plan
from coplan.spec import BalancingPlan, MeshPlan, Plan, load_topology, load_workload

SUPERPOD = load_topology("h200-superpod-1k")
TINY = load_workload("gem-tiny")


@pytest.fixture(scope="module")
def plan32() -> Plan:
    return make_plan(TINY, SUPERPOD, None, PlannerConfig(world_size=32, time_limit_s=30, num_workers=1, max_solves=2))[0]


def test_the_planner_picks_a_group_of_whole_nodes_and_prices_the_plan_at_it(plan32):
    g = plan32.balancing.group_ranks
    assert g in (8, 16, 32)
    again = price_plan(plan32).cost
    assert again.step_time_s == pytest.approx(plan32.predicted.step_time_s, rel=1e-9)
    assert plan32.balancing.expected_imbalance == pytest.approx(again.imbalance, rel=1e-9)
    ctx = with_balance_group(build_context(TINY, SUPERPOD, plan32.mesh), g)
    assert ctx.balance_group == g
    assert plan32.predicted.loader_s == pytest.approx(loader_time(ctx).step_s, rel=1e-9)


def test_the_pick_is_the_cheapest_of_the_priced_candidates():
    p = Pricer(TINY, SUPERPOD, 32)
    ctx = build_context(TINY, SUPERPOD, MeshPlan(dense_shard=32, sparse_shard=32))
    world = with_balance_group(ctx, 32)
    from coplan.costmodel.planner_view import CostModel
    from coplan.planner.costs import LOADER_MARGIN

    m = CostModel()
    compute = m.dense_base(world, BalancingPlan(policy=p.policy, group_ranks=32)).compute_s
    rho_w = imbalance(world, p.policy)
    est = {g: max(LOADER_MARGIN * loader_time(with_balance_group(ctx, g)).step_s,
                  compute * imbalance(with_balance_group(ctx, g), p.policy) / rho_w) for g in (8, 16, 32)}
    assert p.group == min(est, key=lambda g: (est[g], g))
    assert p.balancing.group_ranks == p.group


def test_one_node_writes_no_group_and_keeps_its_hash():
    plan = make_plan(TINY, SUPERPOD, None, PlannerConfig(world_size=8, time_limit_s=30, num_workers=1, max_solves=2))[0]
    assert plan.balancing.group_ranks is None
    assert "group_ranks" not in plan.balancing.model_dump()


def test_a_group_that_does_not_divide_the_world_is_refused(plan32):
    bad = plan32.model_dump()
    bad["balancing"]["group_ranks"] = 12
    with pytest.raises(ValueError, match="balancing.group_ranks"):
        Plan.model_validate(bad)
