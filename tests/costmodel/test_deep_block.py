"""A deep block prices in work linear in its depth: the step's cuts walk the schedule once per distinct chain
(not once per layer's recompute task), and each host sync's device position reads per-op offsets (not a walk
over every dense op per sync). Counted, not timed (timings are the benchmarks' business); and the shortcuts
give what the walks they replace gave, to the bit."""

from __future__ import annotations

import numpy as np
import pytest

from coplan.costmodel import pricer as P
from coplan.costmodel.context import build_context
from coplan.costmodel.flops import recomputable_layers
from coplan.costmodel.schedule import Schedule
from coplan.costmodel.step_schedule import build_schedule, dense_collectives, dense_work, sparse_work
from coplan.planner.recompute import RecomputePoint
from coplan.planner.solver import _IntCuts, _point_rc_sums
from coplan.spec import BalancingPlan, LayerPlan, MeshPlan, Workload, load_topology, load_workload, parse_spec

SHALLOW, DEEP = 64, 512


def _deep(layers: int) -> Workload:
    """gem-tiny (reference attention: a host sync per attention call) with ``layers`` InterFormer layers."""
    doc = load_workload("gem-tiny").model_dump(mode="json")
    for b in doc["blocks"]:
        if b["type"] == "interformer":
            b["num_layers"] = layers
    w = parse_spec(Workload, doc, f"gem-tiny with {layers} InterFormer layers")
    assert w.kernels.attention == "reference"
    return w


def _ctx(layers: int, gpus: int = 1):
    w = _deep(layers)
    if gpus == 1:
        return build_context(w, load_topology("h200-1gpu"), MeshPlan(dense_shard=1, sparse_shard=1))
    return build_context(w, load_topology("h200-superpod-4k"), MeshPlan(dense_shard=gpus, sparse_shard=gpus))


def _layers(ctx, every: int = 3) -> list[LayerPlan]:
    """Every ``every``-th layer recomputed (the others' recompute tasks are the cuts' zero-length stand-ins)."""
    return [LayerPlan(name=n, recompute=k % every == 1) for k, n in enumerate(recomputable_layers(ctx.workload))]


class _Counting(np.ndarray):
    """An array that counts the items read from it one at a time."""

    reads = 0

    def __getitem__(self, key):
        if isinstance(key, (int, np.integer)):
            _Counting.reads += 1
        return super().__getitem__(key)


def _work(monkeypatch, layers: int, gpus: int = 1) -> tuple[int, int, int]:
    """(tasks of the schedule the cuts walk in all, chain walks, ops' layers read one op at a time) of one
    pricing with cuts and segments (host syncs) of the deep workload."""
    ctx = _ctx(layers, gpus)
    ctx.op_layer = ctx.op_layer.view(_Counting)
    walked = [0, 0]
    chain_cut = P._chain_cut

    def counting_chain_cut(S, chain, factor, source):
        chain = list(chain)
        walked[0] += len(chain)
        walked[1] += 1
        return chain_cut(S, chain, factor, source)

    monkeypatch.setattr(P, "_chain_cut", counting_chain_cut)
    _Counting.reads = 0
    cost = P.price(ctx, None, _layers(ctx), BalancingPlan(), detail=False, cuts=True, segments=True)
    assert len(cost.segments) > layers  # a sync per attention call: the walk this counts is exercised
    return walked[0], walked[1], _Counting.reads


@pytest.mark.parametrize("gpus", [1, 8])
def test_pricing_work_is_linear_in_depth(monkeypatch, gpus):
    tasks_s, chains_s, reads_s = _work(monkeypatch, SHALLOW, gpus)
    tasks_d, chains_d, reads_d = _work(monkeypatch, DEEP, gpus)
    ratio = DEEP / SHALLOW  # 8: linear work grows 8x, quadratic 64x
    assert chains_d <= chains_s + 4, (chains_s, chains_d)  # a few chains, whatever the depth
    assert tasks_d <= 2 * ratio * tasks_s, (tasks_s, tasks_d)
    assert reads_d <= 2 * ratio * reads_s, (reads_s, reads_d)


def _naive_through_cuts(S: Schedule, factor: float):
    """The through cuts as they were: a chain walked per kind of task, duplicates kept."""
    nxt, firsts = P._longest_per_kind(S)
    return [P._chain_cut(S, S.path_through(i, nxt), factor, "chain") for i in firsts]


@pytest.mark.parametrize("gpus,every", [(1, 3), (8, 3), (8, 1), (64, 2)])
def test_one_cut_per_chain_drops_only_repeats(gpus, every):
    ctx = _ctx(SHALLOW, gpus)
    rec, fp8 = P.layer_sets(ctx, _layers(ctx, every))
    d = dense_work(ctx, P.op_arrays(ctx, ctx.workload.kernels, fp8), 1.0)
    sp = sparse_work(ctx, P._placement(ctx, None, None, True, 1.0, ctx.workload.kernels))
    S = build_schedule(ctx, d, sp, dense_collectives(ctx, d.moe_parts), rec, True).S
    S.run(ctx.sm_contention)
    tail, nxt = S.tail_paths()
    ids = S.chain_ids(nxt)
    paths: dict[int, list[int]] = {}
    for i in range(len(S.tasks)):  # one id, one chain; one chain, one id
        path = S.path_through(i, nxt)
        assert paths.setdefault(ids[i], path) == path
    assert len({tuple(p) for p in paths.values()}) == len(paths)
    naive = _naive_through_cuts(S, 1.25)
    got = P._through_cuts(S, 1.25)
    assert len(got) < len(naive)
    # the same cuts, bit for bit, in the same order, less repeats (each left out one equal to a cut kept before it;
    # distinct chains of equal length and terms may still give equal cuts, which the planner's with_cut merges)
    k = 0
    for c in naive:
        if k < len(got) and got[k] == c:
            k += 1
        else:
            assert c in got[:k]
    assert k == len(got)


def _naive_position(ctx, S, before, sync_task, moe_parts, f_op, m, k, phase):
    """A sync's device position as it was: the layer's ops before the syncing one summed by a walk over all ops."""
    i = int(ctx.op_layer[k])
    t = sync_task[(m, i, phase)]
    part = P._moe_part(ctx, k) if (i in moe_parts and phase == "fwd") else None
    off = 0.0
    for j in range(len(ctx.dense_idx)):
        if j == k:
            break
        if int(ctx.op_layer[j]) == i and (part is None or P._moe_part(ctx, j) == part):
            off += float(f_op[j])
    stretch = S.tasks[t].duration / before[t] if before[t] > 0 else 1.0
    return S.start[t] + off * stretch


def test_sync_positions_match_the_walk_over_the_ops():
    ctx = _ctx(16)
    rec, fp8 = P.layer_sets(ctx, _layers(ctx))
    d = dense_work(ctx, P.op_arrays(ctx, ctx.workload.kernels, fp8), 1.1)
    b = build_schedule(ctx, d, sparse_work(ctx, None), dense_collectives(ctx, d.moe_parts), rec, False)
    before = [t.duration for t in b.S.tasks]
    b.S.run(ctx.sm_contention)
    _, syncs, _ = P._walk_segments(ctx, d.arr, rec, 0.0)
    assert len(syncs) > 16
    offsets = P._layer_offsets(ctx, d.moe_parts, d.f_op)
    # every op (a MoE layer's forward too, by part), not only the syncing ones
    keys = {(m, k, ph) for m, _, ph in syncs for k in range(len(ctx.dense_idx)) if (m, int(ctx.op_layer[k]), ph) in b.sync_task}
    assert any(int(ctx.op_layer[k]) in d.moe_parts for _, k, ph in keys if ph == "fwd")
    for m, k, ph in sorted(keys):
        assert P._device_position(ctx, b.S, before, b.sync_task, d.moe_parts, offsets, m, k, ph) == \
            _naive_position(ctx, b.S, before, b.sync_task, d.moe_parts, d.f_op, m, k, ph)


def test_frontier_point_sums_match_the_per_layer_sums():
    rng = np.random.default_rng(3)
    n = 40
    rc = tuple(tuple(int(x) for x in rng.integers(0, 10**12, n)) for _ in range(5))
    ic = _IntCuts(1, (0,) * 5, ({},) * 5, rc, ())
    points = [RecomputePoint(0.0, 0.0, tuple(bool(x) for x in rng.integers(0, 2, n))) for _ in range(30)]
    points.append(RecomputePoint(0.0, 0.0, (False,) * n))
    want = [[sum(c for c, on in zip(r, pt.layers) if on) for r in rc] for pt in points]
    got = _point_rc_sums(ic, points)
    assert got == want and all(type(x) is int for row in got for x in row)
    huge = _IntCuts(1, (0,), ({},), (((1 << 62),) * n,), ())  # beyond int64 when summed: the per-layer sums
    assert _point_rc_sums(huge, points) == [[sum(c for c, on in zip(huge.rc[0], pt.layers) if on)] for pt in points]


def test_host_cut_does_not_depend_on_the_recompute_sets_order():
    """The host cut's constant subtracts the recomputed layers' launches in layer order: summed in a set's order
    (a string hash's, which changes from process to process) its last bits, and the plan's model objective, varied
    between runs of one plan."""
    from coplan.spec import Calibration

    w = _deep(DEEP)
    ctx = build_context(w, load_topology("h200-1gpu"), MeshPlan(dense_shard=1, sparse_shard=1),
                        Calibration(device="NVIDIA H200", host_launch_s=2.0730013887368376e-4))
    arr = P.op_arrays(ctx, ctx.workload.kernels)
    names = list(recomputable_layers(w))
    rng = np.random.default_rng(0)
    orders = [tuple(names)] + [tuple(rng.permutation(names)) for _ in range(20)]
    cuts = [P._host_cut(ctx, arr, order, 10.0) for order in orders]
    assert cuts[0].const_s < 10.0
    assert all(c == cuts[0] for c in cuts)
