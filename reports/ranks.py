"""Per-rank figures: where each rank's step time goes, and what fills each rank's HBM.

Time. The cost model prices the step on the critical rank and reports the busy time of a few
sampled ranks (the extremes of the embedding load: :attr:`StepCost.rank_ids`). In the cost model a
rank's busy time is the critical rank's minus its embedding lookups plus the rank's own, so each
sampled rank's bar shows the critical rank's compute per op class with its own embedding time, the
exposed communication, and the time it idles waiting for the slowest rank. The jagged spread of the
dense work between ranks is in the jagged-balance figure.

Memory. Everything but the embedding shards is the same on every rank (dense state is sharded
evenly); the embedding weights, their optimizer state and lookup buffers per rank of the sparse
shard group are the cost model's (:attr:`StepCost.embedding <coplan.costmodel.StepCost.embedding>`)
for the plan's placement. The result is checked against the cost model's own per-rank totals for the
sampled ranks; a mismatch drops back to those ranks alone and says so.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import plotly.graph_objects as go

from coplan.costmodel import StepCost
from coplan.reports.layout import base_layout, best_time_unit, fmt_bytes, fmt_s
from coplan.reports.palette import loss_colour, memory_colour, op_class_colour
from coplan.spec import Plan

MAX_RANKS = 96
"""Most ranks drawn one bar each; beyond, the extremes and a few around the median are sampled."""

MAX_TIME_RANKS = 256
"""Most ranks in the per-rank time figure before sampling."""

MAX_MEMORY_RANKS = 256
"""Most ranks in the memory figure before sampling."""

MAX_BAR_RANKS = 48
"""Beyond this many ranks the memory figure draws a stacked step area instead of bars."""

CLASS_ORDER = ("gemm", "attention", "embedding", "elementwise")
MEMORY_ORDER = ("parameters", "gradients", "optimizer", "fsdp_buffers", "activations", "recompute_peak", "embeddings",
                "embedding_optimizer", "embedding_io", "comm_buffers", "graph_pool")
EMBEDDING_KINDS = ("embeddings", "embedding_optimizer", "embedding_io")


def sample_extremes(values: np.ndarray, k: int = MAX_RANKS) -> tuple[np.ndarray, str]:
    """Indices of all ranks (when ≤ k) or of the k/2 − 2 largest, the k/2 − 2 smallest and 4 around the
    median, in descending value order; and a phrase saying which."""
    n = values.size
    if n <= k:
        return np.arange(n), (f"all {n:,} ranks" if n > 1 else "the one rank")
    order = np.argsort(-values, kind="stable")
    h = k // 2 - 2
    mid = n // 2
    idx = np.concatenate([order[:h], order[mid - 2:mid + 2], order[-h:]])
    return idx, f"{h} highest, 4 median and {h} lowest of {n:,} ranks"


# ---------------------------------------------------------------------------------------------
# Time
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RankTime:
    """One rank's step split into parts (seconds), parts in drawing order."""

    label: str
    parts: dict[str, float]
    step_s: float


def rank_times(cost: StepCost, emb_all: np.ndarray | None = None) -> tuple[list[RankTime], list[str]]:
    """The critical rank, then each sampled rank (or, with ``emb_all`` from :func:`all_rank_embedding_s`,
    every rank of the sparse shard group, extremes sampled beyond ``MAX_TIME_RANKS``), split by op
    class / exposed comm / idle, slowest first."""
    notes: list[str] = []
    cls = {c: 0.0 for c in CLASS_ORDER}
    rec = opt = emb_crit = 0.0
    for o in cost.ops:
        if o.phase in ("fwd", "bwd"):
            cls[o.op_class if o.op_class in cls else "elementwise"] += o.time_s
            if o.name.startswith("sparse."):
                emb_crit += o.time_s
        elif o.phase == "recompute":
            rec += o.time_s
        else:
            opt += o.time_s
    perf = cost.perf
    other = perf.compute_s - (sum(cls.values()) + rec + opt)
    exposed = perf.exposed_s
    step = cost.step_time_s

    def parts(emb: float) -> dict[str, float]:
        p = {f"class:{c}": (emb if c == "embedding" else v) for c, v in cls.items()}
        p["loss:recompute"] = rec
        p["loss:optimizer"] = opt
        p["loss:other"] = other
        p["comm:exposed"] = exposed
        return p

    out = [RankTime("critical rank (the step)", parts(cls["embedding"]), step)]
    if emb_all is not None:
        base = perf.total - sum(o.time_s for o in cost.ops if o.phase in ("fwd", "bwd") and o.name.startswith("sparse."))
        busy = base + emb_all
        idx, how = sample_extremes(busy, MAX_TIME_RANKS)
        notes.append(f"ranks shown: {how} of the sparse shard group")
        for r in sorted(idx, key=lambda j: -busy[j]):
            p = parts(float(emb_all[r]))
            p["idle"] = max(0.0, step - float(busy[r]))
            out.append(RankTime(f"rank {int(r)}", p, step))
        return out, notes
    ids = list(cost.rank_ids)
    times = np.asarray(cost.rank_time_s, dtype=float)
    mems = np.asarray(cost.rank_memory_bytes, dtype=float) if len(cost.rank_memory_bytes) == len(ids) else None
    if not ids:
        return out, notes
    base = perf.total - emb_crit
    roles: dict[int, list[str]] = {i: [] for i in range(len(ids))}
    if len(ids) > 1:
        roles[int(np.argmax(times))].append("slowest")
        roles[int(np.argmin(times))].append("fastest")
        if mems is not None:
            roles[int(np.argmax(mems))].append("fullest HBM")
    idx, how = sample_extremes(times)
    if len(ids) > MAX_RANKS:
        notes.append(f"ranks shown: {how}")
    for i in sorted(idx, key=lambda j: -times[j]):
        emb = times[i] - base
        role = ", ".join(roles.get(int(i), []))
        label = f"rank {ids[i]}" + (f" ({role})" if role else "")
        if emb < -1e-9 * max(1.0, step):
            notes.append(f"rank {ids[i]}: its busy time does not split as the cost model's formula says; shown unsplit")
            p = {"busy": float(times[i])}
        else:
            p = parts(max(0.0, emb))
        p["idle"] = max(0.0, step - float(times[i]))
        out.append(RankTime(label, p, step))
    return out, notes


_PART_LABELS = {"comm:exposed": "exposed communication", "idle": "idle (waiting for the slowest rank)",
                "loss:recompute": "recompute", "loss:optimizer": "optimizer step", "loss:other": "other compute", "busy": "busy (unsplit)"}


def _part_colour(key: str) -> str:
    fam, _, name = key.partition(":")
    if fam == "class":
        return op_class_colour(name)
    if key == "comm:exposed":
        return "#33BBEE"
    if key == "idle":
        return loss_colour("idle")
    if fam == "loss":
        return loss_colour(name)
    return "#999999"


def rank_time_breakdown(cost: StepCost, *, every_rank: bool = False, title: str = "Per-rank step time") -> go.Figure:
    """Each rank's step split into compute per op class, exposed communication and idle time: with
    ``every_rank``, every rank of the sparse shard group when the cost model's per-rank loads reproduce
    its sampled ranks (stacked bars for a few ranks, a stacked step area, slowest first, for many), else
    the sampled ranks."""
    emb_all = all_rank_embedding_s(cost) if every_rank else None
    rows, notes = rank_times(cost, emb_all)
    step = rows[0].step_s
    unit, scale = best_time_unit(step)
    keys: list[str] = []
    for r in rows:
        for k in r.parts:
            if k not in keys:
                keys.append(k)
    order = [f"class:{c}" for c in CLASS_ORDER] + ["loss:recompute", "loss:optimizer", "loss:other", "busy", "comm:exposed", "idle"]
    keys.sort(key=lambda k: order.index(k) if k in order else 50)
    fig = go.Figure()
    area = len(rows) - 1 > MAX_BAR_RANKS
    shown = rows[1:] if area else rows
    labels = [r.label for r in shown]
    n = len(shown)
    for k in keys:
        vals = np.array([r.parts.get(k, 0.0) for r in shown])
        if not np.any(vals > 0):
            continue
        name = _PART_LABELS.get(k, k.partition(":")[2])
        custom = np.stack([labels, [fmt_s(v) for v in vals], [f"{100 * v / step:.1f}" if step else "0" for v in vals]], axis=-1)
        marker_pattern = {"shape": "/", "fgcolor": "#999"} if k == "idle" else None
        if area:
            fig.add_trace(go.Scatter(
                x=np.arange(n + 1), y=np.append(vals, vals[-1]) / scale, name=name, mode="lines", stackgroup="time",
                line={"shape": "hv", "width": 0.5, "color": _part_colour(k)}, fillcolor=_part_colour(k),
                fillpattern=marker_pattern, customdata=np.vstack([custom, custom[-1:]]),
                hovertemplate=f"{name}: %{{customdata[1]}} (%{{customdata[2]}}%)<extra></extra>",
            ))
        else:
            fig.add_trace(go.Bar(
                y=labels, x=vals / scale, orientation="h", name=name, marker_color=_part_colour(k), marker_pattern=marker_pattern,
                customdata=custom, hovertemplate=f"%{{y}}<br>{name}: %{{customdata[1]}} (%{{customdata[2]}}% of the step)<extra></extra>",
            ))
    if area:
        ticks = sorted(set(np.linspace(0, n - 1, min(n, 12)).round().astype(int).tolist()))
        fig.update_xaxes(title_text="ranks, slowest first (ticks: rank ids)", range=[0, n], tickvals=[t + 0.5 for t in ticks],
                         ticktext=[labels[t].removeprefix("rank ") for t in ticks], unifiedhovertitle={"text": "%{customdata[0]}"})
        fig.update_yaxes(title_text=f"time per step ({unit})", rangemode="tozero")
        fig.update_layout(hovermode="x unified")
        fig.add_hline(y=step / scale, line={"color": "#333", "width": 1, "dash": "dot"}, annotation_text=f"step {fmt_s(step)}",
                      annotation_position="top left")
        height = 460
    else:
        fig.update_layout(barmode="stack", bargap=0.3)
        fig.update_yaxes(autorange="reversed", automargin=True)
        fig.update_xaxes(title_text=f"time per step ({unit})")
        height = max(300, 150 + (34 if len(rows) < 12 else 16) * len(rows))
    if emb_all is not None:
        sub = ("every rank carries the critical rank's dense work (the jagged spread is in the jagged-balance figure); "
               "ranks differ by their embedding lookups")
    else:
        k = len(rows) - 1
        sub = (f"{k} rank{'s' if k != 1 else ''} sampled by the cost model (extremes of the embedding load); every rank carries the "
               "critical rank's dense work")
    if notes:
        sub += "; " + "; ".join(notes)
    return base_layout(fig, title, subtitle=sub, height=height)


# ---------------------------------------------------------------------------------------------
# Memory
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RankMemory:
    """Bytes per kind for a set of ranks of the sparse shard group."""

    ranks: np.ndarray
    """Group rank ids."""
    kinds: dict[str, np.ndarray]
    """Kind → bytes per rank (aligned with ``ranks``)."""
    capacity_bytes: float
    how: str
    """Which ranks these are (all, or which sample)."""
    exact: bool
    """True when the per-rank totals reproduce the cost model's sampled ranks."""


def all_rank_embedding_s(cost: StepCost) -> np.ndarray | None:
    """Embedding time per step of every rank of the sparse shard group, or None when it cannot be
    reproduced. The cost model's per-rank lookup times (forward + backward, each rank's kernel launches
    and table-row-wise NVLink reduction included, as the pricer's aggregates have them) plus one
    rank-independent term fitted on the sampled ranks; used only if that one term reproduces every
    sampled rank's busy time to 1e-9 of the step."""
    ids = np.asarray(cost.rank_ids, dtype=np.int64)
    times = np.asarray(cost.rank_time_s, dtype=float)
    if cost.embedding is None or ids.size < 2 or times.size != ids.size:
        return None
    emb = np.asarray(cost.embedding.fwd_s, dtype=float) + np.asarray(cost.embedding.bwd_s, dtype=float)
    emb_crit = sum(o.time_s for o in cost.ops if o.phase in ("fwd", "bwd") and o.name.startswith("sparse."))
    base = cost.perf.total - emb_crit
    offsets = (times - base) - emb[ids]
    if np.ptp(offsets) > 1e-9 * max(cost.step_time_s, 1e-12):
        return None
    return emb + float(offsets.mean())


def rank_memory(plan: Plan, cost: StepCost) -> RankMemory:
    """Memory by kind per rank of the sparse shard group (see the module docstring)."""
    mem = cost.memory.as_dict()
    cap = float(cost.usable_hbm_bytes)
    G = plan.mesh.sparse_shard
    ids = np.asarray(cost.rank_ids, dtype=np.int64)
    totals = np.asarray(cost.rank_memory_bytes, dtype=float)
    common = {k: v for k, v in mem.items() if k not in EMBEDDING_KINDS}
    er = cost.embedding
    if er is not None and er.weight_bytes is not None:
        w = np.asarray(er.weight_bytes, dtype=float)
        o = np.asarray(er.optimizer_bytes, dtype=float)
        io = np.asarray(er.io_bytes, dtype=float)
        full = int(np.argmax(w + o + io))
        kinds_all = {k: np.full(G, v) for k, v in common.items()}
        kinds_all["embeddings"] = w
        kinds_all["embedding_optimizer"] = o
        # the lookup-buffer term the pricer adds on top of the shard's own io is the same on every rank
        kinds_all["embedding_io"] = io + (mem["embedding_io"] - io[full])
        tot = sum(kinds_all.values())
        exact = bool(ids.size == 0 or np.allclose(tot[ids], totals, rtol=1e-9, atol=1.0)) and \
            bool(np.isclose(tot[full], cost.memory.total, rtol=1e-9, atol=1.0))
        if exact:
            idx, how = sample_extremes(tot, MAX_MEMORY_RANKS)
            how = f"{how} of the sparse shard group" + (f" (the same on each of its {plan.mesh.sparse_replicate:,} replicas)" if plan.mesh.sparse_replicate > 1 else "")
            idx = idx[np.argsort(-tot[idx], kind="stable")]
            return RankMemory(idx, {k: v[idx] for k, v in kinds_all.items()}, cap, how, True)
    # fall back: the fullest rank by kind, and the sampled ranks' totals with the difference in embeddings
    ranks = ids if ids.size else np.zeros(1, dtype=np.int64)
    tot = totals if totals.size == ranks.size and totals.size else np.full(ranks.size, cost.memory.total)
    kinds = {k: np.full(ranks.size, v) for k, v in common.items()}
    emb_full = sum(mem[k] for k in EMBEDDING_KINDS)
    for k in EMBEDDING_KINDS:
        share = mem[k] / emb_full if emb_full > 0 else 0.0
        kinds[k] = np.maximum(0.0, tot - sum(common.values())) * share
    how = "the ranks the cost model sampled (per-rank embedding split not reproduced: kinds prorated)"
    return RankMemory(ranks, kinds, cap, how, False)


def memory_per_rank(plan: Plan, cost: StepCost, *, title: str = "Memory per rank against HBM") -> go.Figure:
    """Bytes per kind for each rank, stacked, with the HBM capacity as a line: bars for a few ranks, a
    stacked step area (one flat step per rank, far cheaper for a browser to draw) for many."""
    rm = rank_memory(plan, cost)
    n = int(rm.ranks.size)
    fig = go.Figure()
    GiB = 1024.0**3
    total = sum(rm.kinds.values())
    area = n > MAX_BAR_RANKS
    ids = [int(r) for r in rm.ranks]
    for k in MEMORY_ORDER + tuple(k for k in rm.kinds if k not in MEMORY_ORDER):
        v = rm.kinds.get(k)
        if v is None or not np.any(v > 0):
            continue
        name = k.replace("_", " ")
        custom = np.stack([[fmt_bytes(b) for b in v], [fmt_bytes(t) for t in total], ids], axis=-1)
        if area:
            # one extra point so the last rank's step has a width
            fig.add_trace(go.Scatter(
                x=np.arange(n + 1), y=np.append(v, v[-1]) / GiB, name=name, mode="lines", stackgroup="memory",
                line={"shape": "hv", "width": 0.5, "color": memory_colour(k)}, fillcolor=memory_colour(k),
                customdata=np.vstack([custom, custom[-1:]]),
                hovertemplate=f"{name}: %{{customdata[0]}}<extra></extra>",
            ))
        else:
            fig.add_trace(go.Bar(
                x=[str(r) for r in ids], y=v / GiB, name=name, marker_color=memory_colour(k),
                customdata=custom,
                hovertemplate=f"rank %{{x}}<br>{name}: %{{customdata[0]}}<br>rank total %{{customdata[1]}}<extra></extra>",
            ))
    hbm = float(plan.topology.gpu.hbm_bytes)
    fig.add_hline(y=rm.capacity_bytes / GiB, line={"color": "#CC3311", "width": 2, "dash": "dash"},
                  annotation_text=f"usable {fmt_bytes(rm.capacity_bytes)} (HBM less the topology's "
                                  f"{plan.topology.gpu.hbm_reserve_fraction:.0%} reserve)", annotation_position="top left")
    fig.add_hline(y=hbm / GiB, line={"color": "#999999", "width": 1, "dash": "dot"},
                  annotation_text=f"HBM {fmt_bytes(hbm)}", annotation_position="top right")
    if area:
        ticks = sorted(set(np.linspace(0, n - 1, min(n, 12)).round().astype(int).tolist()))
        fig.update_xaxes(title_text="ranks, fullest first (ticks: rank ids)",
                         tickvals=[t + 0.5 for t in ticks], ticktext=[str(ids[t]) for t in ticks], range=[0, n],
                         unifiedhovertitle={"text": "rank %{customdata[2]}: %{customdata[1]} in all"})
        fig.update_layout(hovermode="x unified")
    else:
        fig.update_layout(barmode="stack", bargap=0.15)
        fig.update_xaxes(title_text="rank, fullest first", type="category")
    fig.update_yaxes(title_text="GiB", rangemode="tozero")
    peak = float(total.max()) if total.size else 0.0
    head = rm.capacity_bytes - peak
    sub = (f"{rm.how}; fullest rank {fmt_bytes(peak)}, "
           + (f"{fmt_bytes(head)} below the usable HBM" if head >= 0 else f"<b>{fmt_bytes(-head)} over the usable HBM</b>"))
    return base_layout(fig, title, subtitle=sub, height=460)


__all__ = ["RankMemory", "RankTime", "memory_per_rank", "rank_memory", "rank_time_breakdown", "rank_times", "sample_extremes"]
