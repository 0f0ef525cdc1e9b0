"""Synthetic candidate pricings for solver tests: random, but shaped like the cost model's figures
(table-wise shards are big, column-wise split time and bytes, row-wise spreads with an overhead)."""

from __future__ import annotations

import numpy as np

from coplan.costmodel.results import StepCut
from coplan.planner.mesh import MeshCandidate
from coplan.planner.pricing import CandidatePricing, LayerOption, ShardOption

A2A_S_PER_BYTE = 1 / 40e9
"""Seconds per byte of one output all-to-all (a forward and a backward one per step)."""

DP_S_PER_BYTE = 1 / 40e9


def additive_cuts(layers) -> tuple[StepCut, ...]:
    """Two paths: the serial one (every lookup, both all-to-alls, the all-reduce and each recompute on
    it, 5 ms of dense work), and a communication-bound one (2 ms of compute, then the all-to-alls
    twice over and the id exchange); the step model is the larger."""
    rc = {l.name: l.recompute_s for l in layers}
    serial = StepCut(5e-3, {"fwd": 1.0, "bwd": 1.0, "a2a": 2 * A2A_S_PER_BYTE, "dp": DP_S_PER_BYTE}, rc)
    comm = StepCut(2e-3, {"a2a": 4 * A2A_S_PER_BYTE, "ids": 2 * A2A_S_PER_BYTE}, {})
    return serial, comm


SCALE = {"fwd": 1.0, "bwd": 1.0, "a2a": A2A_S_PER_BYTE, "ids": A2A_S_PER_BYTE, "dp": DP_S_PER_BYTE}


def synthetic_pricing(num_tables: int, group: int, node: int, num_layers: int, seed: int, *, capacity: float = 80e9,
                      base_bytes: float = 20e9) -> CandidatePricing:
    rng = np.random.default_rng(seed)
    node = min(node, group)
    opts = []
    for t in range(num_tables):
        work = float(rng.lognormal(np.log(200e-6), 1.0))
        size = float(rng.lognormal(np.log(4e9), 1.0))
        out = float(rng.lognormal(np.log(50e6), 1.0))  # bytes of pooled outputs of the group's batch
        dim = int(rng.choice([64, 128, 256]))
        recv = out / group
        ids = out / 64  # id bytes: a small fraction of the pooled outputs
        o = [ShardOption("table_wise", 1, 0.4 * work, 0.6 * work, out, size, recv, 0.0, ids, ids / group)]
        for n in (2, 4, 8):
            if n <= group and dim // n >= 32:
                o.append(ShardOption("column_wise", n, 0.4 * work / n + 6e-6, 0.6 * work / n + 9e-6, out / n, size / n, recv, 0.0, ids, ids * n / group))
        if group > 1:
            o.append(ShardOption("row_wise", group, 0.4 * work / group + 10e-6, 0.6 * work / group + 20e-6, out, size / group, recv * group,
                                 0.0, ids / group, ids / group))
        if group % node == 0 and 1 < node < group:
            o.append(ShardOption("table_row_wise", node, 0.4 * work / node + 8e-6, 0.6 * work / node + 12e-6, out / node, size / node, recv,
                                 0.0, ids / node, ids / group))
        if size < 2e9:
            o.append(ShardOption("data_parallel", group, 0.4 * work / group, 0.6 * work / group, 0.0, size, 0.0, size))
        opts.append(tuple(o))
    layers = tuple(LayerOption(f"blk.{i}", float(rng.uniform(1e-4, 6e-4)), float(rng.uniform(1e9, 6e9)), float(rng.uniform(1e9, 4e9)))
                   for i in range(num_layers))
    return CandidatePricing(
        mesh=MeshCandidate(group, group, 1, group), node_size=node, base_bytes=base_bytes,
        capacity_bytes=capacity, layers=layers, options=tuple(opts), table_names=tuple(f"t{i}" for i in range(num_tables)),
        cuts=additive_cuts(layers), scale=dict(SCALE), recv_factor=1.0, recv_mem_factor=0.5,
    )
