"""When nothing fits: which memory falls short, on which ranks, by how much, and what would fix it.

The explanation is built on the candidate that comes closest (the least memory floor: every layer
recomputed, tables spread as thinly as their options allow, the widest FSDP and sparse groups),
so every figure is a best case: if it does not fit there, it fits nowhere. Each fix is quantified
with the cost model's own numbers: how many GPUs would make the sharded state fit, what lower
precision or a lighter optimizer would free.
"""

from __future__ import annotations

import math

from coplan.errors import InfeasibleError
from coplan.units import human_bytes

GB = 1e9


def _fmt(b: float) -> str:
    return f"{b / GB:,.1f} GB"


def explain_infeasible(workload, topology, world, pricer, records, pricings, *, solved: bool = False) -> InfeasibleError:
    """An :class:`InfeasibleError` naming the resource that falls short and the fixes, with numbers."""
    from coplan.planner.search import _sparse_floor

    cap = topology.gpu.hbm_bytes
    best = min(records, key=lambda r: (r.memory_floor_bytes, r.mesh.key))
    p = pricings[best.mesh]
    f = _sparse_floor(p)
    parts = dict(p.memory_parts)
    most = max([0.0] + [sum(l.saved_bytes for l in p.layers if l.peak_bytes <= pk) - pk for pk in {l.peak_bytes for l in p.layers}])
    saved, peak = most, 0.0
    act_kept = max(0.0, parts.get("activations", 0.0) - most)
    dense_state = parts.get("parameters", 0.0) + parts.get("gradients", 0.0) + parts.get("optimizer", 0.0)
    emb = f.mem_bytes + f.recv_mem_bytes
    fixed = sum(v for k, v in parts.items() if k not in ("parameters", "gradients", "optimizer", "activations"))
    total = dense_state + act_kept + emb + fixed
    short = max(total - cap, best.memory_floor_bytes - cap)
    m = best.mesh
    shortfalls = [
        {"resource": "hbm", "ranks": f"all {world:,} ranks (identical in the best case)", "capacity_bytes": cap,
         "needed_bytes": total, "short_bytes": short,
         "parts_bytes": {"dense_parameters_gradients_optimizer": dense_state, "activations_all_recomputed": act_kept,
                         "embeddings_and_optimizer_state": emb, "buffers_context_headroom": fixed},
         "mesh": m.key},
    ]
    lines = [
        f"no plan fits: '{workload.name}' on {world:,} GPUs of '{topology.name}' needs at least {_fmt(total)} per GPU, "
        f"{_fmt(short)} more than the {_fmt(cap)} of HBM, on every rank, even in the best case "
        f"(FSDP over {m.dense_shard:,}, expert-parallel {m.expert_parallel}, tables sharded over {m.sparse_shard:,}, every layer recomputed):",
        f"  - dense parameters + gradients + optimizer state: {_fmt(dense_state)}",
        f"  - activations with every layer recomputed:          {_fmt(act_kept)} (recompute already frees {_fmt(saved - peak)})",
        f"  - embedding shards + optimizer state + buffers:     {_fmt(emb)}",
        f"  - NCCL buffers, CUDA context, allocator headroom:   {_fmt(fixed)}",
        "what would fix it:",
    ]
    fixes: list[str] = []
    sharded = dense_state + f.mem_bytes
    room = cap - (act_kept + fixed + f.recv_mem_bytes)
    if room > 0 and sharded > 0:
        need = math.ceil(world * sharded / room)
        node = topology.gpus_per_node
        need = int(math.ceil(need / node) * node)
        fixes.append(f"more GPUs: about {need:,} (sharded state {_fmt(sharded)}/GPU now, ×{world:,}/{need:,} there), "
                     f"if the topology has them ({topology.num_gpus:,} here)")
    else:
        fixes.append(f"more GPUs alone cannot fix it: what is not sharded (activations, buffers: {_fmt(act_kept + fixed)}) "
                     "already exceeds the HBM; lower the batch per GPU or the sequence lengths")
    w = workload
    if w.precision.param_dtype == "fp32":
        gain = (parts.get("parameters", 0.0) + parts.get("gradients", 0.0)) / 2
        fixes.append(f"lower precision: bf16 master parameters and gradients (precision.param_dtype: bf16) free {_fmt(gain)}/GPU")
    if w.optimizer.dense in ("adam", "adamw"):
        fixes.append(f"a lighter dense optimizer: Adagrad keeps one state instead of two, freeing {_fmt(parts.get('optimizer', 0.0) / 2)}/GPU")
    emb_w = sum(t.num_params * {"fp32": 4, "fp16": 2, "bf16": 2, "int8": 1}[t.dtype] for t in w.all_tables)
    if emb_w and any(t.dtype in ("fp32", "fp16", "bf16") for t in w.all_tables):
        frac = emb_w / max(1.0, sum(t.num_params for t in w.all_tables))
        int8_gain = f.mem_bytes * (1 - 1 / frac) * (emb_w / max(emb_w, 1)) if frac > 1 else 0.0
        if int8_gain > 0:
            fixes.append(f"lower embedding precision: int8 tables free about {_fmt(int8_gain)}/GPU")
    if m.sparse_shard < world:
        fixes.append(f"more sparse sharding: spread the tables over more ranks (up to {world:,})")
    fixes.append("fewer activations: a smaller local batch (batch.local_batch_size) or shorter histories (max_len)")
    lines += [f"  - {x}" for x in fixes]
    if solved:
        lines.insert(1, "  (the memory floors allowed some candidates, but the solver found no placement that fits any of them)")
    return InfeasibleError("\n".join(lines), shortfalls=shortfalls, fixes=fixes)


__all__ = ["explain_infeasible", "human_bytes"]
