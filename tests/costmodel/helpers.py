"""Small topologies and plans for cost-model tests (numbers chosen so results can be worked by hand)."""

from __future__ import annotations

from coplan.spec import Topology

GB = 1e9


def topo(*tiers: dict, gpus_per_node: int | None = None, name: str = "test") -> Topology:
    """A topology from tier dicts (defaults: latency 0, efficiency 1, non-blocking, a NIC per GPU)."""
    ts = []
    for i, t in enumerate(tiers):
        d = {"name": f"t{i}", "latency_s": 0.0}
        d.update(t)
        ts.append(d)
    return Topology.model_validate({
        "name": name,
        "gpu": {"name": "Test GPU", "peak_flops_per_s": {"bf16": 1e15, "fp8": 2e15, "fp32": 1e14}, "hbm_bytes": 100e9,
                "hbm_bw_bytes_per_s": 4e12},
        "gpus_per_node": gpus_per_node or tiers[0]["size"],
        "tiers": ts,
        "reliability": {"gpu_mtbf_hours": 50000.0, "checkpoint_bw_bytes_per_s_per_node": 10e9},
    })
