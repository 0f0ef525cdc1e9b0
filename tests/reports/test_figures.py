"""Every figure function on real plans (the planner's, else the cost model's heuristic plan priced by
the full pricer): it draws, its numbers are the cost model's, its hover text carries units, and its
colours are the palette's."""

from __future__ import annotations

import json
import re

import numpy as np
import plotly.graph_objects as go
import pytest

from coplan.planner.simulate import simulate_point
from coplan.reports import balance, ranks, scaling, sharding, timeline, waterfall
from coplan.reports.inputs import price_plan
from coplan.reports.ledger import build_ledger, launch_by_class
from coplan.reports.palette import COLLECTIVE_COLOURS, OP_CLASS_COLOURS, SHARDING_COLOURS

UNIT = re.compile(r"(µs|ms|\bs\b|GiB|MiB|KiB|TiB|\bB\b|%|FLOP|pts|points)")


def _hover_texts(fig: go.Figure) -> list[str]:
    out = []
    for tr in fig.data:
        for attr in ("hovertemplate", "hovertext"):
            v = getattr(tr, attr, None)
            if v is None:
                continue
            out += [x for x in (v if isinstance(v, (list, tuple, np.ndarray)) else [v]) if isinstance(x, str)]
    return out


def _check_common(fig: go.Figure, *, min_traces: int = 1) -> None:
    assert isinstance(fig, go.Figure)
    assert len(fig.data) >= min_traces
    lay = fig.layout
    assert lay.title.text, "every figure carries its own title (readable on its own)"
    assert lay.autosize is True and lay.width is None, "figures size to their container (narrow windows)"
    assert lay.legend.yref == "container", "the legend sits below everything, never over the axis title"
    hov = _hover_texts(fig)
    assert hov, "hover text is set"
    with_units = [h for h in hov if UNIT.search(h)]
    assert len(with_units) >= 0.8 * len(hov), f"hover texts without units: {[h for h in hov if not UNIT.search(h)][:3]}"
    json.loads(fig.to_json())  # serialisable as the page embeds it


def test_waterfall_adds_up_exactly(plan_case):
    _, plan = plan_case
    pred = plan.predicted
    led = build_ledger(plan, pred)
    assert led.checks == ()
    assert abs(led.residual_points) < 1e-9
    assert led.final_points == pytest.approx(100 * pred.goodput_mfu, rel=1e-9, abs=1e-12)
    assert led.useful_s / led.step_time_s == pytest.approx(pred.e2e_mfu, rel=1e-9)
    keys = [x.key for x in led.losses]
    assert len(keys) == len(set(keys))
    assert "other" in keys, "the unattributed remainder is always shown"
    # the items the cost model itemises explain the step: what is left is small
    other = next(x for x in led.losses if x.key == "other")
    assert abs(led.points(other.seconds)) < 2.0
    fig = waterfall.mfu_waterfall(led)
    _check_common(fig)
    tr = fig.data[0]
    bars = list(zip(tr.y, tr.base, tr.x))
    assert len(bars) >= len([x for x in led.losses if abs(led.points(x.seconds)) >= waterfall.MIN_POINTS]) + 2
    assert bars[0][2] == 100.0 and bars[-1][2] == pytest.approx(led.final_points)
    # each loss bar starts where the previous one ended
    level = 100.0
    for name, base, width in bars[1:-1]:
        assert base + width == pytest.approx(level, abs=1e-9)
        level = base
    assert level == pytest.approx(led.final_points, abs=1e-9)


def test_waterfall_launch_overhead_bar(plan_case):
    """With the cost model's launch times, launch overhead is its own bar, taken out of the class bars: the sum holds."""
    _, plan = plan_case
    pp = price_plan(plan)
    launch = launch_by_class(pp.cost)
    plain = build_ledger(plan, plan.predicted)
    split = build_ledger(plan, plan.predicted, launch_s=launch)
    assert abs(split.residual_points) < 1e-9
    bar = next(x for x in split.losses if x.key == "launch")
    assert bar.seconds == pytest.approx(sum(launch.values())) and bar.seconds > 0
    for c in ("gemm", "attention", "elementwise"):
        a = next((x for x in plain.losses if x.key == f"kernel.{c}"), None)
        b = next((x for x in split.losses if x.key == f"kernel.{c}"), None)
        if a is not None:
            assert a.seconds - b.seconds == pytest.approx(launch.get(c, 0.0))
    # launches are part of the ops' time: never more than the dense compute itself
    assert bar.seconds < sum(o.time_s for o in plan.predicted.ops if o.phase in ("fwd", "bwd") and not o.name.startswith("sparse."))


def test_waterfall_biggest_loss_is_marked(h200_plan):
    led = build_ledger(h200_plan, h200_plan.predicted)
    big = led.biggest()
    fig = waterfall.mfu_waterfall(led)
    labels = [str(y).replace("<br>", " ") for y in fig.data[0].y]
    assert sum("biggest loss" in y for y in labels) == 1
    assert any(big.label in y and "biggest" in y for y in labels)


def test_timeline_is_the_pricers_schedule(plan_case):
    _, plan = plan_case
    pp = price_plan(plan)
    assert pp.schedule is not None
    assert pp.schedule.makespan == pytest.approx(pp.cost.step_time_s, rel=1e-12)
    fig = timeline.step_timeline(pp.schedule, pp.cost)
    _check_common(fig, min_traces=3)
    # every task with a duration is drawn; compute segments of a task add up to the task
    drawn = sum(len(tr.x) for tr in fig.data if tr.name != "compute waits (exposed comm)")
    assert drawn >= sum(1 for t in pp.schedule.tasks if t.duration > 0)
    compute_total = sum(sum(tr.x) for tr in fig.data if tr.y is not None and tr.y[0] == "compute" and "waits" not in tr.name)
    unit = 1e-3 if "(ms)" in fig.layout.xaxis.title.text else (1e-6 if "(µs)" in fig.layout.xaxis.title.text else 1.0)
    assert compute_total * unit == pytest.approx(pp.cost.perf.compute_s, rel=1e-6)
    waits = sum(sum(tr.x) for tr in fig.data if tr.name == "compute waits (exposed comm)") * unit
    assert waits == pytest.approx(pp.cost.perf.exposed_s, rel=1e-6, abs=1e-12)
    for tr in fig.data:
        if tr.name in OP_CLASS_COLOURS:
            assert tr.marker.color == OP_CLASS_COLOURS[tr.name]


def test_rank_time_breakdown(plan_case):
    _, plan = plan_case
    pp = price_plan(plan)
    rows, notes = ranks.rank_times(pp.cost)
    assert rows[0].label.startswith("critical")
    assert sum(rows[0].parts.values()) == pytest.approx(pp.cost.step_time_s, rel=1e-9)
    for r in rows[1:]:
        # busy + idle = the step on every sampled rank
        assert sum(r.parts.values()) == pytest.approx(pp.cost.step_time_s, rel=1e-9)
    assert len(rows) == 1 + len(pp.cost.rank_ids)
    _check_common(ranks.rank_time_breakdown(pp.cost))


def test_rank_time_every_rank_of_the_sparse_group():
    """With a sparse shard group, every rank's time comes from the cost model's per-rank loads, and it
    reproduces the busy time of each rank the cost model sampled."""
    from tests.reports.plans import real_plan

    plan = real_plan("dlrm-856", "h200-superpod-1k", 64)
    pp = price_plan(plan)
    G = plan.mesh.sparse_shard
    if G < 2:
        pytest.skip(f"the planner chose a sparse shard group of {G} rank(s) for this case")
    emb = ranks.all_rank_embedding_s(pp.cost)
    assert emb is not None and emb.size == G
    rows, notes = ranks.rank_times(pp.cost, emb)
    assert len(rows) == 1 + min(G, ranks.MAX_TIME_RANKS)
    busy = {r.label: sum(v for k, v in r.parts.items() if k != "idle") for r in rows[1:]}
    for rid, t in zip(pp.cost.rank_ids, pp.cost.rank_time_s):
        assert busy[f"rank {rid}"] == pytest.approx(t, rel=1e-9)
    for r in rows[1:]:
        assert sum(r.parts.values()) == pytest.approx(pp.cost.step_time_s, rel=1e-9)
    _check_common(ranks.rank_time_breakdown(pp.cost, every_rank=True))


def test_memory_per_rank_reproduces_the_cost_model(plan_case):
    _, plan = plan_case
    pp = price_plan(plan)
    rm = ranks.rank_memory(plan, pp.cost)
    assert rm.exact, "per-rank memory must reproduce the cost model's sampled ranks"
    tot = sum(rm.kinds.values())
    assert float(tot.max()) == pytest.approx(pp.cost.memory.total, rel=1e-9)
    assert rm.capacity_bytes == plan.topology.gpu.usable_hbm_bytes
    fig = ranks.memory_per_rank(plan, pp.cost)
    _check_common(fig, min_traces=3)
    assert any(sh.type == "line" for sh in fig.layout.shapes), "the HBM capacity line is drawn"


def test_sharding_map(plan_case):
    _, plan = plan_case
    rows = sharding.shard_rows(plan)
    assert len(rows) == len(plan.tables)
    assert {r.table for r in rows} == {t.table for t in plan.tables}
    G = plan.mesh.sparse_shard
    per = sharding.rank_bytes(rows, G)
    assert sum(v.sum() for v in per.values()) == pytest.approx(sum(r.shard_bytes * len(r.ranks) for r in rows))
    fig = sharding.sharding_map(plan)
    _check_common(fig, min_traces=2)
    for tr in fig.data:
        if tr.name in SHARDING_COLOURS and tr.type == "bar":
            assert tr.marker.color == SHARDING_COLOURS[tr.name]


def test_sharding_map_bins_large_groups():
    """A sparse group wider than the bar budget is binned and says so."""
    from tests.reports.plans import real_plan

    plan = real_plan("gem-h200", "h200-superpod-1k", 64)
    wide = plan.model_copy(update={"mesh": plan.mesh.model_copy(update={"sparse_shard": 64, "sparse_replicate": 1}),
                                   "tables": tuple(t.model_copy(update={"ranks": tuple((r * 7) % 64 for r in t.ranks) or t.ranks})
                                                   for t in plan.tables)})
    sharding.MAX_RANK_BARS, old = 16, sharding.MAX_RANK_BARS
    try:
        fig = sharding.sharding_map(wide)
    finally:
        sharding.MAX_RANK_BARS = old
    assert "binned" in fig.layout.title.text
    assert any(tr.name == "fullest rank of the bin" for tr in fig.data)


def test_sharding_map_dashes_for_many_shards(h200_plan, monkeypatch):
    """Past MAX_MARKERS single-rank shards, every shard is still drawn (as a dash), none as a marker."""
    monkeypatch.setattr(sharding, "MAX_MARKERS", 0)
    fig = sharding.sharding_map(h200_plan)
    rows = sharding.shard_rows(h200_plan)
    n_runs = sum(len(sharding._runs(r.ranks)) for r in rows)
    segs = sum(sum(1 for v in tr.x if v is None) for tr in fig.data if tr.type == "scatter" and tr.mode == "lines" and tr.yaxis == "y2")
    assert segs == n_runs
    assert not [tr for tr in fig.data if tr.type == "scatter" and tr.mode == "markers" and tr.yaxis == "y2"]


def test_jagged_balance(h200_plan):
    pp = price_plan(h200_plan)
    bs = balance.sample_balance(h200_plan, pp.context, seed=0)
    assert bs is not None
    assert bs.loads_none.sum() == pytest.approx(bs.loads_policy.sum(), rel=1e-9), "balancing moves work, never creates it"
    assert bs.ratio_policy <= bs.ratio_none + 1e-12
    assert bs.loads_none.size == h200_plan.world_size
    fig = balance.jagged_balance(h200_plan, pp.context)
    _check_common(fig)


def test_jagged_balance_profile_for_many_ranks(h200_plan, monkeypatch):
    pp = price_plan(h200_plan)
    monkeypatch.setattr(balance, "MAX_BARS", 8)
    fig = balance.jagged_balance(h200_plan, pp.context)
    assert "sorted" in fig.layout.title.text
    assert all(tr.type == "scatter" for tr in fig.data)


def test_scaling_curve_from_simulate(h200_plan):
    rows = scaling.simulate_sweep(h200_plan, simulate_point, [8, 16, 64])
    assert [r["gpus"] for r in rows] == [8, 16, 64]
    assert all("e2e_mfu" in r for r in rows)
    here = next(r for r in rows if r["gpus"] == 64)
    assert 0 < here["e2e_mfu"] <= 1
    fig = scaling.scaling_curve(rows, h200_plan)
    _check_common(fig, min_traces=5)
    star = [tr for tr in fig.data if tr.marker.symbol == "star"]
    assert star and star[0].x[0] == 64
    assert star[0].y[0] == pytest.approx(100 * h200_plan.predicted.e2e_mfu)


def test_scaling_sweep_file(tmp_path, h200_plan):
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "coplan.cli", "simulate", "-w", "gem-h200", "-t", "h200-superpod-1k", "--gpus", "8,64",
                          "--json"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    p = tmp_path / "sweep.json"
    p.write_text(out.stdout)
    rows = scaling.load_sweep(p)
    assert [r["gpus"] for r in rows] == [8, 64]
    _check_common(scaling.scaling_curve(rows, h200_plan))
    (tmp_path / "bad.json").write_text('{"points": 3}')
    with pytest.raises(scaling.SweepFileError, match="points"):
        scaling.load_sweep(tmp_path / "bad.json")


def test_colours_are_consistent_across_figures(h200_plan):
    """The same op class has the same colour in the waterfall, the timeline and the per-rank bars."""
    pp = price_plan(h200_plan)
    seen: dict[str, set[str]] = {}
    led = build_ledger(h200_plan, h200_plan.predicted)
    wf = waterfall.mfu_waterfall(led).data[0]
    for y, colour in zip(wf.y, wf.marker.color):
        for c in OP_CLASS_COLOURS:
            if str(y).startswith(f"{c} kernels"):
                seen.setdefault(c, set()).add(colour)
    for tr in timeline.step_timeline(pp.schedule, pp.cost).data:
        if tr.name in OP_CLASS_COLOURS:
            seen.setdefault(tr.name, set()).add(tr.marker.color)
        if tr.name.replace("-", "_") in COLLECTIVE_COLOURS:
            assert tr.marker.color == COLLECTIVE_COLOURS[tr.name.replace("-", "_")]
    for tr in ranks.rank_time_breakdown(pp.cost).data:
        if tr.name in OP_CLASS_COLOURS:
            seen.setdefault(tr.name, set()).add(tr.marker.color)
    assert seen
    for c, colours in seen.items():
        assert colours == {OP_CLASS_COLOURS[c]}, f"{c} drawn in {colours}"


def test_every_collective_has_a_lever(h200_plan):
    """The summary's advice for an exposed collective is specific to it (not the generic fallback)."""
    from coplan.reports.ledger import COMM_LABELS, Loss
    from coplan.reports.summary import lever

    generic = "more overlap of this collective with compute"
    for base in COMM_LABELS:
        loss = Loss(f"comm.{base}.nvlink+rack", base, "collective", "all_to_all", 1.0)
        assert lever(loss, h200_plan, h200_plan.predicted) != generic, base
