"""Predicted collective bus bandwidth against published nccl-tests figures (within 15%).

Predictions use the shipped topology presets unchanged (their per-tier efficiencies were set from the
same family of public figures; see the YAML headers), at the large message sizes where nccl-tests
reports its peak. Each published number carries its source.
"""

from __future__ import annotations

import pytest

from coplan.costmodel.comm import collective_model, place_group
from coplan.spec import load_topology

GiB = 2**30
TOL = 0.15


def _nvls(name: str):
    t = load_topology(name)
    tiers = list(t.tiers)
    tiers[0] = tiers[0].model_copy(update={"in_switch_reduction": True})
    return t.model_copy(update={"tiers": tuple(tiers)})


def _a100_200g():
    """DGX A100: NVLink 3 at 300 GB/s per direction, 8× HDR 200 Gb/s (25 GB/s) NICs; otherwise the H200 SuperPOD preset."""
    t = load_topology("h200-superpod-1k")
    tiers = [t.tiers[0].model_copy(update={"bw_bytes_per_s": 300e9})] + [x.model_copy(update={"bw_bytes_per_s": 25e9}) for x in t.tiers[1:]]
    return t.model_copy(update={"tiers": tuple(tiers)})


# (case, topology, collective, ranks, stride, size in bytes, published busbw GB/s, source)
CASES = [
    ("H100 8-GPU NVLink, all-gather (ring)", lambda: load_topology("meta-roce-24k"), "all_gather", 8, 1, 8 * GiB, 370.0,
     "NVIDIA/nccl-tests#212, S. Jeaugey 2024-05-06: ~370 GB/s effective NVLink busBw on H100 for non-allreduce ops or NCCL_ALGO=RING"),
    ("H100 8-GPU NVLink, reduce-scatter (ring)", lambda: load_topology("meta-roce-24k"), "reduce_scatter", 8, 1, 8 * GiB, 370.0,
     "NVIDIA/nccl-tests#212 (same comment)"),
    ("H200 8-GPU NVLink, all-reduce ring (NVLS off)", lambda: load_topology("h200-superpod-1k"), "all_reduce", 8, 1, 8 * GiB, 370.0,
     "NVIDIA GTC25 S72583 slide via stas00/ml-engineering network/README.md §SHARP: NVLink 4 all-reduce 370 GB/s without SHARP"),
    ("H100 8-GPU NVLink, all-reduce with NVLS", lambda: _nvls("meta-roce-24k"), "all_reduce", 8, 1, 8 * GiB, 480.0,
     "NVIDIA/nccl-tests#212, S. Jeaugey: 'On 8 GPUs, you should reach a peak busBw of ~480GB/s' with NVLink SHARP"),
    ("H200 8-GPU NVLink, all-reduce with NVLS", lambda: _nvls("h200-superpod-1k"), "all_reduce", 8, 1, 16 * GiB, 480.70,
     "stas00/ml-engineering network/benchmarks/README.md: nccl-tests all_reduce 16 GiB on 8x H200, NCCL 2.30.7: 480.70 GB/s"),
    ("8x400G nodes, all-reduce across 16 nodes", lambda: load_topology("h200-superpod-1k"), "all_reduce", 128, 1, 8 * GiB, 376.0,
     "NVIDIA/nccl-tests#290, D. Addison 2025-03-03: 'For NDR @ 400Gbps you should see 46-48GB/s per NIC' -> 8 NICs x 47 GB/s"),
    ("8x400G nodes, all-gather across 16 nodes", lambda: load_topology("h200-superpod-1k"), "all_gather", 128, 1, 8 * GiB, 376.0,
     "NVIDIA/nccl-tests#290 (same comment; ring collectives are NIC-bound alike)"),
    ("8x400G nodes, all-reduce across 4 nodes (P6-B200, EFA 400G/GPU)", lambda: load_topology("h200-superpod-1k"), "all_reduce", 32, 1,
     16 * GiB, 381.80, "stas00/ml-engineering network/README.md 'Inter-node speed depends on intra-node speed': 4x 8-B200 nodes, 16 GiB"),
    ("400G, one GPU per node (8 nodes)", lambda: load_topology("h200-superpod-1k"), "all_reduce", 8, 8, 8 * GiB, 47.0,
     "NVIDIA/nccl-tests#290: 46-48 GB/s per 400G NDR NIC"),
    ("8x400G nodes, all-to-all across 6 nodes", lambda: load_topology("h200-superpod-1k"), "all_to_all", 48, 1, 8 * GiB, 48.5,
     "NVIDIA/nccl-tests#267 (6 H100 nodes, 8x400G): S. Jeaugey 'Alltoall cannot aggregate the bandwidth of multiple NICs' + "
     "D. Addison 'CX-7 NICs at NDR rate should achieve up to 48-49GB/s per NIC'"),
    ("DGX A100 8x200G, all-reduce across nodes", _a100_200g, "all_reduce", 64, 1, 8 * GiB, 192.0,
     "NVIDIA/nccl#812 (quoted in #1576), D. Addison: 'On an Nvidia DGX-A100 system we have 8x200Gbit/s IB cards and we measure 192GB/s AllReduce BusBW'"),
]


@pytest.mark.parametrize("case,make,kind,ranks,stride,nbytes,published,source", CASES, ids=[c[0] for c in CASES])
def test_bus_bandwidth_matches_published(case, make, kind, ranks, stride, nbytes, published, source):
    topo = make()
    m = collective_model(topo, place_group(topo, ranks, stride), kind)
    predicted = m.bus_bw(nbytes) / 1e9
    err = predicted / published - 1.0
    assert abs(err) <= TOL, f"{case}: predicted {predicted:.1f} GB/s vs published {published:.1f} GB/s ({err:+.1%}); source: {source}"


if __name__ == "__main__":  # print the table summarised in docs/benchmarks-log/cost-model.md
    print(f"| case | collective | ranks | predicted GB/s | published GB/s | error |")
    print("|---|---|---:|---:|---:|---:|")
    for case, make, kind, ranks, stride, nbytes, published, source in CASES:
        topo = make()
        p = collective_model(topo, place_group(topo, ranks, stride), kind).bus_bw(nbytes) / 1e9
        print(f"| {case} | {kind} | {ranks} | {p:.0f} | {published:.0f} | {p / published - 1:+.1%} |")
