"""Small topologies and plans for cost-model tests (numbers chosen so results can be worked by hand)."""

from __future__ import annotations

from coplan.spec import MeshPlan, Plan, TableShard, Topology, Workload, load_topology, load_workload, parse_spec, spec_sha256

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


def gem_h200_plan(batch: int = 8, mean_len: int = 512, attention: str = "triton") -> Plan:
    """gem-h200 on one H200 with another local batch, history mean length and attention backend."""
    t = load_topology("h200-1gpu")
    doc = load_workload("gem-h200").model_dump(mode="json")
    doc["batch"] = {"local_batch_size": batch}
    doc["sequences"][0]["length"]["mean"] = mean_len
    doc["kernels"]["attention"] = attention
    w = parse_spec(Workload, doc, "gem-h200 variant")
    # every table on the one rank, as the pricer's default placement has it: a plan file lists every table
    tables = tuple(TableShard(table=tab.name, sharding_type="table_wise", ranks=(0,)) for tab in w.all_tables)
    return Plan(topology=t, workload=w, world_size=1, mesh=MeshPlan(dense_shard=1, sparse_shard=1), kernels=w.kernels,
                tables=tables, topology_sha256=spec_sha256(t), workload_sha256=spec_sha256(w))
