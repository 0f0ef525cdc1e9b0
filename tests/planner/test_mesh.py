"""Mesh candidates: factorisations of the world, expert-parallel degrees, tier mapping, world-size errors."""

from __future__ import annotations

import pytest

from coplan.errors import CoplanError
from coplan.planner.costs import Pricer
from coplan.planner.mesh import MeshCandidate, check_world_size, divisors, enumerate_candidates
from coplan.spec import load_topology, load_workload


def test_candidates_factor_the_world():
    t, w = load_topology("meta-roce-24k"), load_workload("gem-1t")
    cands = list(enumerate_candidates(t, w, 16384))
    assert len(cands) == len(set(cands))
    for c in cands:
        assert c.dense_shard * c.dense_replicate == 16384 == c.sparse_shard * c.sparse_replicate
        assert c.dense_shard % c.expert_parallel == 0 and 64 % c.expert_parallel == 0  # whole experts per EP rank
    assert {c.sparse_shard for c in cands} == set(divisors(16384))
    assert max(c.expert_parallel for c in cands) == 64


def test_no_tables_means_one_sparse_group_and_no_moe_means_no_ep():
    t, w = load_topology("h200-superpod-1k"), load_workload("dense-decoder-8b")
    cands = list(enumerate_candidates(t, w, 64))
    assert {c.sparse_shard for c in cands} == {64} and {c.expert_parallel for c in cands} == {1}


def test_axes_map_to_the_tiers_their_groups_cross():
    t, w = load_topology("h200-superpod-4k"), load_workload("gem-tiny")
    w = w.model_copy(update={"batch": w.batch.model_copy(update={"global_batch_size": None, "local_batch_size": 4})})
    pr = Pricer(w, t, 4096)
    mesh = pr.mesh_plan(MeshCandidate(4096, 8, 8, 512))
    axes = {a.name: a for a in mesh.axes}
    assert axes["dp_shard"].tiers == ("nvlink",)  # 8 ranks fit in an NVLink domain and stay there
    assert axes["ep"].tiers == ("nvlink",)
    assert axes["sparse_shard"].tiers == ("nvlink", "leaf", "spine")  # 512 = 64 nodes: 2 scalable units
    assert "nvlink" not in axes["dp_replicate"].tiers  # one rank per NVLink domain: network only


def test_world_size_errors():
    t = load_topology("h200-superpod-1k")
    assert check_world_size(t, None) == 1024 and check_world_size(t, 4) == 4
    with pytest.raises(CoplanError, match="exceeds"):
        check_world_size(t, 4096)
    with pytest.raises(CoplanError, match="whole number"):
        check_world_size(t, 20)
