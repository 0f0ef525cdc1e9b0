"""When nothing fits: which memory falls short, on which ranks, by how much, and what would fix it.

The shortfall is read on the candidate that comes closest (the least memory floor: every layer
recomputed, tables spread as thinly as their options allow), so every figure is a best case: if it
does not fit there, it fits nowhere.

Every fix offered is **verified** with the planner itself before it is printed: the changed problem
(more GPUs, more micro-batches, bf16 master weights, a lighter optimizer, int8 tables, a smaller
batch, no pin) is priced again, and the fix is offered only when one of its mesh candidates has a
memory floor within the usable HBM *and* the planner's own heuristic places every table there within
it (priced by the full pricer). A fix that would not fit is not suggested; when none does, the message
says so.
"""

from __future__ import annotations

import math
import time

from coplan.costmodel.context import local_batch_of
from coplan.errors import CoplanError, InfeasibleError
from coplan.planner.bounds import memory_floor, most_freed
from coplan.planner.costs import Pricer
from coplan.planner.mesh import check_world_size, enumerate_candidates
from coplan.planner.pricing import evaluate
from coplan.planner.solver import heuristic_any
from coplan.spec import list_presets, load_topology
from coplan.spec.topology import Topology
from coplan.spec.workload import divisors
from coplan.units import human_bytes

GB = 1e9


def _fmt(b: float) -> str:
    return f"{b / GB:,.1f} GB"


_PART_NAMES = {"fsdp_buffers": "FSDP gather buffers", "comm_buffers": "NCCL communicator buffers",
               "graph_pool": "CUDA graph pool", "embedding_io": "embedding lookup buffers",
               "recompute_peak": "recompute peak", "embeddings": "embedding shards",
               "embedding_optimizer": "embedding optimizer state"}
"""Readable names of the memory parts (:class:`coplan.costmodel.results.Memory`'s fields)."""


def _largest_shard(p, floor_mem: float) -> tuple[str, str, float, float] | None:
    """When one table's least shard sets the candidate's table memory floor (above the average every rank
    carries): ``(table, sharding, its shard's bytes, the average bytes of the other tables' shards on a rank)``;
    else None."""
    if not p.options or p.group_size <= 1:
        return None
    s = p.group_size
    best, shares = None, []
    for t, (name, opts) in enumerate(zip(p.table_names, p.options)):
        least = min(opts, key=lambda o: o.mem_bytes)
        shares.append(min(o.mem_bytes * (1.0 if o.placement == "all" else o.num_shards / s) for o in opts))
        if best is None or least.mem_bytes > best[2]:
            best = (name, least.sharding_type, least.mem_bytes, t)
    if best is None or best[2] <= sum(shares) or best[2] < floor_mem:
        return None
    return best[0], best[1], best[2], sum(shares) - shares[best[3]]


def fits(workload, topology, world: int, calibration=None, cfg=None, *, tries: int = 3, deadline: float | None = None) -> str | None:
    """A mesh candidate key on which some plan of ``workload`` fits ``world`` GPUs of ``topology``
    (verified by placing it), or None. Tries the ``tries`` candidates of least memory floor; None too once
    ``deadline`` (``time.perf_counter()`` seconds) has passed."""
    if _late(deadline):
        return None
    try:
        check_world_size(topology, world)
        local_batch_of(workload, world)
    except CoplanError:
        return None
    pins = dict(cfg.pins) if cfg is not None else {}
    table_pins = dict(cfg.table_pins) if cfg is not None else {}
    pricer = Pricer(workload, topology, world, calibration, table_pins=table_pins)
    cands = [c for c in enumerate_candidates(topology, workload, world) if all(c.axis(k) == v for k, v in pins.items())]
    # the memory-friendliest first: widest FSDP and sparse groups, most micro-batches
    cands.sort(key=lambda c: (-c.dense_shard, -c.sparse_shard, -c.micro_batches, -c.expert_parallel))
    scored = []
    for c in cands[: 4 * tries]:
        if _late(deadline):
            return None
        p = pricer.candidate(c, with_cut=False)
        if not all(p.options):
            continue
        floor = memory_floor(pricer, p)
        scored.append((floor, c, p))
    scored.sort(key=lambda x: (x[0], x[1].key))
    for floor, c, p in scored[:tries]:
        if floor > p.capacity_bytes or _late(deadline):
            return None
        p = p.with_cut(pricer.floor_cost(p).cuts[0])
        a = heuristic_any(p)
        if a is None or evaluate(p, a).peak_bytes > p.capacity_bytes:
            continue
        if pricer.price(p, a).fits:
            return c.key
    return None


def _late(deadline: float | None) -> bool:
    return deadline is not None and time.perf_counter() > deadline


def explain_infeasible(workload, topology, world, pricer, records, pricings, *, solved: bool = False, cfg=None,
                       deadline: float | None = None) -> InfeasibleError:
    """An :class:`InfeasibleError` naming the resource that falls short and the fixes, each verified. ``deadline``
    (``time.perf_counter()`` seconds, the planner's --time-limit): no fix is checked past it; the message then says
    which were not checked (the shortfall itself is always given)."""
    cap = topology.gpu.usable_hbm_bytes
    best = min(records, key=lambda r: (r.memory_floor_bytes, r.mesh.key))
    p = pricings[best.mesh]
    f = pricer.floor(p)
    parts = dict(p.memory_parts)
    most = most_freed(p)
    act_kept = max(0.0, parts.get("activations", 0.0) - most)
    dense_state = parts.get("parameters", 0.0) + parts.get("gradients", 0.0) + parts.get("optimizer", 0.0)
    emb = f.mem_bytes + p.recv_mem_factor * f.recv_bytes
    fixed = sum(v for k, v in parts.items() if k not in ("parameters", "gradients", "optimizer", "activations"))
    total = max(dense_state + act_kept + emb + fixed, best.memory_floor_bytes)
    short = total - cap
    m = best.mesh
    lump = _largest_shard(p, f.mem_bytes)
    if world == 1:
        where = "the one GPU"
    elif lump is not None:
        name, kind, size, others = lump
        rest = total - f.mem_bytes + others
        where = (f"the rank holding table '{name}' (its smallest shard, {kind}, takes {_fmt(size)}: {_fmt(short)} over; "
                 f"the other ranks need about {_fmt(rest)}"
                 f"{', which fits' if rest <= cap else f', {_fmt(rest - cap)} over'})")
    elif emb <= 0 or f.mem_bytes <= 0:
        where = f"all {world:,} ranks"
    else:
        where = f"every rank (the fullest holds at least {_fmt(f.mem_bytes)} of table shards)"
    others = {k: v for k, v in parts.items() if k not in ("parameters", "gradients", "optimizer", "activations") and v >= 0.05 * GB}
    detail = ", ".join(f"{_PART_NAMES.get(k, k.replace('_', ' '))} {_fmt(v)}" for k, v in sorted(others.items(), key=lambda kv: (-kv[1], kv[0])))
    shortfalls = [
        {"resource": "hbm", "ranks": where, "capacity_bytes": cap, "hbm_bytes": topology.gpu.hbm_bytes,
         "reserve_bytes": topology.gpu.hbm_bytes - cap, "needed_bytes": total, "short_bytes": short,
         "parts_bytes": {"dense_parameters_gradients_optimizer": dense_state, "activations_all_recomputed": act_kept,
                         "embeddings_and_optimizer_state": emb, "buffers": fixed},
         "mesh": m.key},
    ]
    lines = [
        f"no plan fits: '{workload.name}' on {world:,} GPUs of '{topology.name}' needs at least {_fmt(total)} {'on its fullest rank' if lump else 'per GPU'}, "
        f"{_fmt(short)} more than the {_fmt(cap)} a rank may use ({_fmt(topology.gpu.hbm_bytes)} of HBM less the topology's "
        f"{topology.gpu.hbm_reserve_fraction:.0%} reserve), on {where}, even in the best case "
        f"(FSDP over {m.dense_shard:,}, expert-parallel {m.expert_parallel}"
        f"{f', tables sharded over {m.sparse_shard:,}' if p.options else ''}"
        f"{f', {m.micro_batches} micro-batches' if m.micro_batches > 1 else ''}, every layer recomputed):",
        f"  - dense parameters + gradients + optimizer state: {_fmt(dense_state)}",
        f"  - activations with every layer recomputed:          {_fmt(act_kept)} (recompute already frees {_fmt(most)})",
        f"  - embedding shards + optimizer state + buffers:     {_fmt(emb)}",
        f"  - other buffers:                                    {_fmt(fixed)}{f' ({detail})' if detail else ''}",
        "what would fix it (each checked: the planner places a plan that fits):",
    ]
    fixes = verified_fixes(workload, topology, world, pricer.calibration, cfg, dense_state=dense_state, emb=emb,
                           deadline=deadline)
    late = _late(deadline)
    if late:
        fixes_lines = [f"  - {x}" for x in fixes] + [
            "  - (the time limit ran out before coplan had checked every fix: more GPUs, more micro-batches, bf16 master "
            "weights, a lighter optimizer, int8 tables and a smaller batch are the ones it tries; rerun with a larger "
            "--time-limit to have them checked)"]
    elif not fixes:
        fixes_lines = ["  - nothing coplan tried fits: more GPUs (up to the largest preset of this GPU), more micro-batches, "
                       "bf16 master weights, a lighter optimizer, int8 tables and a quarter of the batch were each checked; "
                       "the model needs a smaller configuration"]
    else:
        fixes_lines = [f"  - {x}" for x in fixes]
    lines += fixes_lines
    if solved:
        lines.insert(1, "  (the memory floors allowed some candidates, but the solver found no placement that fits any of them)")
    return InfeasibleError("\n".join(lines), shortfalls=shortfalls, fixes=fixes)


def with_changes(workload, **changes):
    """``workload`` with the fields at the dotted paths of ``changes`` set (validated again)."""
    data = workload.model_dump()
    for path, value in changes.items():
        node = data
        keys = path.split(".")
        for k in keys[:-1]:
            node = node[k]
        node[keys[-1]] = value
    data.pop("table_generator", None) if "tables" in changes else None
    return type(workload).model_validate(data)


def verified_fixes(workload, topology, world, calibration, cfg, *, dense_state: float = 0.0, emb: float = 0.0,
                   deadline: float | None = None) -> list[str]:
    """The fixes the planner verified (see :func:`fits`), with the numbers each changes; those checked before
    ``deadline`` (``time.perf_counter()`` seconds) only."""
    out: list[str] = []
    if _late(deadline):
        return out
    b = workload.batch
    # 1. pins the user gave: the same problem without them
    if cfg is not None and (cfg.pins or cfg.table_pins):
        key = fits(workload, topology, world, calibration, None, deadline=deadline)
        if key:
            out.append(f"drop the pins ({', '.join(cfg.pin_labels)}): the planner's own choice fits ({key})")
    # 2. more micro-batches (gradient accumulation): activations of one micro-batch
    local = b.local(world) if b.splits(world) else None
    if local is not None and b.fixed_micro_batches is not None:
        for mb in [d for d in divisors(local) if d > b.fixed_micro_batches][:6]:
            if _late(deadline):
                return out
            w2 = with_changes(workload, **{"batch.micro_batches": mb})
            key = fits(w2, topology, world, calibration, cfg, deadline=deadline)
            if key:
                out.append(f"gradient accumulation: batch.micro_batches: {mb} (or 'auto') runs the local batch of {local} in {mb} "
                           f"micro-batches of {local // mb}, one optimizer step; it fits ({key})")
                break
    # 3. more GPUs, with the same global (or local) batch
    if _late(deadline):
        return out
    more = _more_gpus(workload, topology, world, calibration, cfg, dense_state + emb, topology.gpu.usable_hbm_bytes, deadline=deadline)
    if more:
        out.append(more)
    # 4. numerics and optimizer state
    if _late(deadline):
        return out
    if workload.precision.param_dtype == "fp32":
        w2 = with_changes(workload, **{"precision.param_dtype": "bf16", "precision.reduce_dtype": "bf16"})
        key = fits(w2, topology, world, calibration, cfg, deadline=deadline)
        if key:
            out.append(f"bf16 master parameters and gradients (precision.param_dtype: bf16, reduce_dtype: bf16): it fits ({key})")
    if _late(deadline):
        return out
    if workload.optimizer.dense in ("adam", "adamw"):
        w2 = with_changes(workload, **{"optimizer.dense": "adagrad"})
        key = fits(w2, topology, world, calibration, cfg, deadline=deadline)
        if key:
            out.append(f"a lighter dense optimizer (optimizer.dense: adagrad keeps one state instead of two): it fits ({key})")
    if _late(deadline):
        return out
    if workload.all_tables and any(t.dtype in ("fp32", "fp16", "bf16") for t in workload.all_tables):
        data = workload.model_dump()
        if data.get("table_generator"):
            data["table_generator"]["dtype"] = "int8"
        data["tables"] = [dict(t, dtype="int8") for t in data.get("tables", [])]
        key = fits(type(workload).model_validate(data), topology, world, calibration, cfg, deadline=deadline)
        if key:
            out.append(f"int8 embedding tables (dtype: int8): it fits ({key})")
    # 5. a smaller batch
    if _late(deadline):
        return out
    if b.global_batch_size is not None:
        for k in (2, 4):
            gb = b.global_batch_size // k
            if gb >= world and gb % world == 0:
                key = fits(with_changes(workload, **{"batch.global_batch_size": gb}), topology, world, calibration, cfg, deadline=deadline)
                if key:
                    out.append(f"a smaller global batch: batch.global_batch_size: {gb:,} (local {gb // world:,}) fits ({key})")
                    break
    elif b.local_batch_size is not None and b.local_batch_size > 1:
        for k in (2, 4):
            lb = max(1, b.local_batch_size // k)
            key = fits(with_changes(workload, **{"batch.local_batch_size": lb, "batch.micro_batches": 1}), topology, world, calibration, cfg, deadline=deadline)
            if key:
                out.append(f"a smaller local batch: batch.local_batch_size: {lb:,} fits ({key})")
                break
    return out


def _more_gpus(workload, topology, world, calibration, cfg, sharded_bytes: float, cap: float, *,
               deadline: float | None = None) -> str | None:
    """The fewest GPUs (whole nodes, the batch still splitting evenly) on which a plan fits, on this
    topology or on the smallest preset of the same GPU that has them; verified. The search starts where
    the sharded state alone (dense state and tables, spread over every GPU) would fit in half a GPU."""
    node = topology.gpus_per_node
    family = [topology]
    for name in list_presets(Topology):
        try:
            t = load_topology(name)
        except CoplanError:
            continue
        if t.gpu.name == topology.gpu.name and t.num_gpus > topology.num_gpus:
            family.append(t)
    family.sort(key=lambda t: t.num_gpus)
    b = workload.batch
    sizes = []
    start = max(world * 2, int(math.ceil(world * sharded_bytes / max(0.5 * cap, 1.0))))
    n = max(1, 1 << (start - 1).bit_length()) if start > 1 else 2
    top = family[-1].num_gpus
    while n <= top:
        n2 = n if n <= node else int(math.ceil(n / node) * node)
        if b.splits(n2):
            sizes.append(n2)
        n *= 2
    if b.global_batch_size is not None:  # the divisors of the batch between the doublings count too
        sizes = sorted(set(sizes) | {d for d in divisors(b.global_batch_size) if max(world, start // 2) < d <= top
                                     and (d <= node or d % node == 0)})
    tried = 0
    for n in sizes:
        t = next((t for t in family if t.num_gpus >= n), None)
        if t is None:
            break
        tried += 1
        if tried > 8 or _late(deadline):
            break
        key = fits(workload, t, n, calibration, cfg, deadline=deadline)
        if key:
            where = f"of '{topology.name}'" if t is topology else f"(e.g. '{t.name}', {t.num_gpus:,} GPUs)"
            batch = (f"; the global batch of {b.global_batch_size:,} gives {b.global_batch_size // n:,} samples per GPU there"
                     if b.global_batch_size is not None else "")
            return f"more GPUs: {n:,} {where} fit ({key}){batch}"
    return None


__all__ = ["explain_infeasible", "fits", "human_bytes", "verified_fixes", "with_changes"]
