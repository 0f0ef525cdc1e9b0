"""Hand-computed collectives on one and several tiers (see costmodel/comm.py for the model)."""

from __future__ import annotations

import math

import pytest

from coplan.costmodel.comm import PlacementError, bus_factor, collective_model, p2p_time, place_group
from coplan.costmodel.efficiency import COLLECTIVE_BASE_LATENCY_S as BASE, IN_SWITCH_ALLREDUCE_GAIN, P2P_PER_PEER_S

from tests.costmodel.helpers import GB, topo

S = 1e9  # bytes (nccl-tests size)


def t(topology, kind, size, stride=1, nbytes=S):
    return collective_model(topology, place_group(topology, size, stride), kind).time(nbytes)


ONE = topo({"size": 8, "bw_bytes_per_s": 100 * GB})
TWO = topo({"size": 8, "bw_bytes_per_s": 400 * GB}, {"size": 4, "bw_bytes_per_s": 50 * GB})


def test_single_tier_ring_collectives():
    # every GPU moves F·S over its 100 GB/s link: all-reduce F = 2·7/8, the others 7/8
    assert t(ONE, "all_reduce", 8) == pytest.approx(BASE + 1.75 * S / 100e9)
    assert t(ONE, "all_gather", 8) == pytest.approx(BASE + 0.875 * S / 100e9)
    assert t(ONE, "reduce_scatter", 8) == pytest.approx(BASE + 0.875 * S / 100e9)
    # all-to-all: 7 of 8 chunks leave the GPU; latency one hop plus 7 peers' issue cost
    assert t(ONE, "all_to_all", 8) == pytest.approx(BASE + 7 * P2P_PER_PEER_S + 0.875 * S / 100e9)


def test_bus_bandwidth_equals_link_rate_on_one_tier():
    m = collective_model(ONE, place_group(ONE, 8), "all_reduce")
    busbw = S / (m.time(S) - BASE) * bus_factor("all_reduce", 8)
    assert busbw == pytest.approx(100e9)


def test_two_tiers_ring_is_bound_by_the_nics_at_8x_their_rate():
    # 4 nodes x 8: the ring leaves each node once per ring: F·S/8 per GPU over its 50 GB/s NIC,
    # NVLink carries F·S·7/8 at 400 GB/s -> the NIC side binds (0.242 S/50 > 1.695 S/400)
    F = 2 * 31 / 32
    assert t(TWO, "all_reduce", 32) == pytest.approx(BASE + (F / 8) * S / 50e9)
    m = collective_model(TWO, place_group(TWO, 32), "all_reduce")
    assert m.bottleneck == "t1"
    assert m.bus_bw(1e12) == pytest.approx(8 * 50e9, rel=1e-3)  # 8 NICs' worth


def test_two_tiers_all_to_all_is_bound_by_the_bisection():
    # 24 of 32 peers are off-node: 0.75 S leaves over the NIC
    assert t(TWO, "all_to_all", 32) == pytest.approx(BASE + 31 * P2P_PER_PEER_S + 0.75 * S / 50e9)


def test_strided_group_uses_only_the_network():
    # one GPU per node (stride 8): the whole ring runs over NICs
    g = place_group(TWO, 4, 8)
    assert g.members == (1, 4) and g.tiers == ("t1",)
    assert t(TWO, "all_reduce", 4, 8) == pytest.approx(BASE + 1.5 * S / 50e9)
    assert t(TWO, "all_gather", 4, 8) == pytest.approx(BASE + 0.75 * S / 50e9)


def test_gpus_sharing_a_nic_split_it():
    shared = topo({"size": 8, "bw_bytes_per_s": 400 * GB}, {"size": 4, "bw_bytes_per_s": 50 * GB, "gpus_per_nic": 2})
    assert t(shared, "all_gather", 4, 8) == pytest.approx(BASE + 0.75 * S / 25e9)


def test_oversubscription_throttles_the_traffic_that_crosses_it():
    three = topo({"size": 8, "bw_bytes_per_s": 400 * GB}, {"size": 2, "bw_bytes_per_s": 50 * GB},
                 {"size": 4, "bw_bytes_per_s": 50 * GB, "oversubscription": 4.0})
    # all-to-all over 64: off-node 56/64 on the NIC (50 GB/s); off-pair 48/64 on the 1:4 uplink (12.5 GB/s)
    assert t(three, "all_to_all", 64) == pytest.approx(BASE + 63 * P2P_PER_PEER_S + (48 / 64) * S / 12.5e9)
    # inside one non-blocking pair of nodes nothing changes
    assert t(three, "all_to_all", 16) == pytest.approx(BASE + 15 * P2P_PER_PEER_S + (8 / 16) * S / 50e9)


def test_in_switch_reduction_speeds_up_all_reduce_only():
    nvls = topo({"size": 8, "bw_bytes_per_s": 100 * GB, "in_switch_reduction": True})
    assert t(nvls, "all_reduce", 8) == pytest.approx(BASE + 1.75 / IN_SWITCH_ALLREDUCE_GAIN * S / 100e9)
    assert t(nvls, "all_gather", 8) == pytest.approx(t(ONE, "all_gather", 8))


def test_collective_efficiency_scales_the_tier():
    slow = topo({"size": 8, "bw_bytes_per_s": 100 * GB, "collective_efficiency": {"all_gather": 0.5}})
    assert t(slow, "all_gather", 8) == pytest.approx(BASE + 0.875 * S / 50e9)
    assert t(slow, "reduce_scatter", 8) == pytest.approx(BASE + 0.875 * S / 100e9)


def test_latency_terms_ring_and_tree():
    lat = topo({"size": 8, "bw_bytes_per_s": 1e18, "latency_s": 1e-6}, {"size": 2, "bw_bytes_per_s": 1e18, "latency_s": 5e-6})
    # ring over 16 = 2 nodes: 14 NVLink edges and 2 network edges, (g-1)/g of the cycle
    ring = (14 * 1e-6 + 2 * 5e-6) * 15 / 16
    assert t(lat, "all_gather", 16, nbytes=1.0) == pytest.approx(BASE + ring)
    # all-reduce: the cheaper of two ring passes and a tree (chain of 8 in the node, log2(2) hops across)
    tree = 2 * (7 * 1e-6 + 1 * 5e-6)
    assert t(lat, "all_reduce", 16, nbytes=1.0) == pytest.approx(BASE + min(2 * ring, tree))


def test_p2p_uses_the_innermost_common_tier():
    assert p2p_time(TWO, 0, 7, S) == pytest.approx(BASE + S / 400e9)
    assert p2p_time(TWO, 7, 8, S) == pytest.approx(BASE + S / 50e9)  # neighbours across a node boundary
    assert p2p_time(TWO, 3, 3, S) == 0.0


def test_trivial_groups_and_empty_buffers_cost_nothing():
    assert t(TWO, "all_reduce", 1) == 0.0
    assert t(TWO, "all_reduce", 8, nbytes=0) == 0.0


def test_groups_bigger_than_the_topology_are_refused():
    with pytest.raises(PlacementError, match="spans 57"):
        place_group(TWO, 8, 8)
    with pytest.raises(PlacementError):
        place_group(TWO, 0)


@pytest.mark.parametrize("kind,n,f", [("all_reduce", 8, 1.75), ("all_gather", 4, 0.75), ("all_to_all", 2, 0.5), ("p2p", 2, 1.0)])
def test_bus_factors_are_nccl_tests(kind, n, f):
    assert bus_factor(kind, n) == pytest.approx(f)
