"""Every preset loads, from any directory, and holds the figures its issue promises."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from coplan.spec import Topology, Workload, list_presets, load_topology, load_workload
from coplan.units import GB

TOPOLOGIES = ["h200-1gpu", "h100-1gpu", "h200-superpod-1k", "h200-superpod-4k", "meta-roce-24k", "gb200-nvl72-16k"]
WORKLOADS = ["gem-tiny", "gem-h200", "gem-1t", "dlrm-856", "dense-decoder-8b"]


def test_preset_lists_are_complete():
    assert set(TOPOLOGIES) <= set(list_presets(Topology))
    assert set(WORKLOADS) <= set(list_presets(Workload))


@pytest.mark.parametrize("name", TOPOLOGIES)
def test_topology_preset_loads(name):
    t = load_topology(name)
    assert t.name == name
    assert t.num_gpus >= 1
    assert t.dense_peak_flops_per_s > 0


def test_topology_figures():
    h = load_topology("h200-1gpu")
    assert h.gpu.peak_flops_per_s["bf16"] == pytest.approx(989e12)
    assert h.gpu.peak_flops_per_s["fp8"] == pytest.approx(1979e12)
    assert h.gpu.measured_flops_per_s["bf16"] == pytest.approx(806e12)
    assert h.gpu.measured_flops_per_s["fp8"] == pytest.approx(1309e12)
    assert h.gpu.hbm_bytes == pytest.approx(141 * GB)
    assert h.gpu.measured_hbm_bw_bytes_per_s == pytest.approx(4.24e12)
    assert load_topology("h200-superpod-1k").num_gpus == 1024
    pod = load_topology("h200-superpod-4k")
    assert pod.num_gpus == 4096
    assert pod.tiers[0].size == 8 and pod.tiers[0].bw_bytes_per_s == pytest.approx(450e9)  # 900 GB/s bidirectional
    assert pod.tiers[1].size == 32 and pod.tiers[1].bw_bytes_per_s == pytest.approx(50e9)  # 400 Gb/s
    meta = load_topology("meta-roce-24k")
    assert meta.num_gpus == 24576
    assert meta.gpus_within(1) == 16  # GPUs per rack switch
    assert meta.gpus_within(2) == 3072  # AI zone
    assert meta.tiers[3].oversubscription == 7
    gb = load_topology("gb200-nvl72-16k")
    assert gb.tiers[0].size == 72 and gb.tiers[0].bw_bytes_per_s == pytest.approx(900e9)
    assert gb.num_gpus >= 16384
    for t in (pod, meta, gb):
        assert t.reliability.gpu_mtbf_hours > 0 and t.reliability.checkpoint_bw_bytes_per_s_per_node > 0


@pytest.mark.parametrize("name", WORKLOADS)
def test_workload_preset_loads(name):
    w = load_workload(name)
    assert w.name == name
    assert len(w.blocks) >= 1


def test_workload_proportions():
    g = load_workload("gem-1t")
    assert g.sparse_params > 1e12
    assert len(g.all_tables) >= 1000
    assert g.sequence("history").length.max_len == 8192
    rows = sorted(t.num_rows for t in g.all_tables)
    assert rows[-1] / rows[len(rows) // 2] > 10  # skewed sizes
    pools = sorted(t.pooling_factor for t in g.all_tables if t.feature_kind == "pooled")
    assert pools[-1] / pools[len(pools) // 2] > 5  # skewed pooling factors
    h = load_workload("gem-h200")
    assert len(h.all_tables) >= 100
    ib = h.block("interformer")
    assert 512 <= ib.model_dim <= 1024 and 4 <= ib.num_heads <= 8
    assert any(b.type == "moe" for b in h.blocks)
    assert len(load_workload("dlrm-856").all_tables) == 856
    d = load_workload("dense-decoder-8b")
    assert not d.all_tables and d.blocks[0].type == "transformer"
    assert d.blocks[0].attention.kind == "softmax"


def test_generated_tables_are_reproducible():
    a = load_workload("gem-1t").all_tables
    b = load_workload("gem-1t").all_tables
    assert a == b


def test_presets_ship_as_package_data(tmp_path):
    """`coplan validate` finds presets by name from a directory far from the checkout."""
    env = dict(os.environ)
    out = subprocess.run(
        [sys.executable, "-m", "coplan.cli", "validate", "gem-tiny", "h200-superpod-4k"],
        cwd=tmp_path, capture_output=True, text=True, env=env, timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "2 valid, 0 invalid" in out.stdout
