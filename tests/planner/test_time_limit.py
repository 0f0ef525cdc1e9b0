"""--time-limit is a wall-clock budget of the whole search: no phase (bounding, pricing at the floor point,
solves, end refinement) starts another candidate's work once it has passed, yet a plan (at least one
candidate solved) is returned and says where the search stopped."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import yaml

from coplan.planner import search
from coplan.planner.search import PlannerConfig, make_plan
from coplan.spec import Workload, load_plan, load_topology, load_workload

from .test_plan import TINY6


class _Clock:
    """A fake clock for the search: stands still until told to jump."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _setup(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(search, "_now", clock)
    events: list[tuple[str, float]] = []
    return clock, events


def _spy(monkeypatch, events, clock, name, after=None):
    orig = getattr(search, name)

    def wrapped(*a, **k):
        events.append((name, clock.t))
        out = orig(*a, **k)
        if after is not None:
            after()
        return out

    monkeypatch.setattr(search, name, wrapped)


def _cfg(**kw) -> PlannerConfig:
    return PlannerConfig(world_size=8, time_limit_s=10.0, num_workers=1, baseline=False, **kw)


def test_deadline_during_solves_stops_after_first_plan(monkeypatch):
    topo = load_topology("h200-superpod-1k")
    w = Workload.model_validate(TINY6)
    clock, events = _setup(monkeypatch)

    def jump():
        clock.t += 1e6  # the first solve took "forever": the deadline has passed

    _spy(monkeypatch, events, clock, "solve_priced", after=jump)
    _spy(monkeypatch, events, clock, "_refine")
    plan, result = make_plan(w, topo, None, _cfg())
    deadline = 1000.0 + 10.0
    solves = [t for n, t in events if n == "solve_priced"]
    assert len(solves) == 1  # the rest of the batch (4) was not started
    assert all(t <= deadline for n, t in events)  # no refinement (end or otherwise) after the deadline
    assert plan.solver.candidates_solved == 1
    assert result.stopped is not None and plan.solver.notes == (result.stopped,)
    assert "stopped at the time limit (10 s) after 1 of" in plan.solver.notes[0]
    assert plan.tables and plan.predicted is not None


def test_deadline_during_bounding_still_gives_a_plan(monkeypatch):
    topo = load_topology("h200-superpod-1k")
    w = Workload.model_validate(TINY6)
    clock, events = _setup(monkeypatch)

    def jump():
        clock.t += 1e6

    _spy(monkeypatch, events, clock, "memory_floor", after=jump)  # the first candidate bounded took "forever"
    _spy(monkeypatch, events, clock, "solve_priced")
    _spy(monkeypatch, events, clock, "_refine")
    plan, result = make_plan(w, topo, None, _cfg())
    floors = [n for n, _ in events if n == "memory_floor"]
    assert len(floors) == 1  # bounding stopped once a candidate that may fit was bounded
    assert len([n for n, _ in events if n == "solve_priced"]) == 1
    assert plan.solver.candidates_solved == 1
    assert result.candidates_total > len(result.records) == 1
    assert "bounded 1 of them" in plan.solver.notes[0]


def test_default_limit_leaves_no_note():
    topo = load_topology("h200-superpod-1k")
    w = Workload.model_validate(TINY6)
    plan, result = make_plan(w, topo, None, PlannerConfig(world_size=8, num_workers=1))
    assert result.stopped is None and plan.solver.notes == ()
    assert "notes" not in json.loads(plan.model_dump_json())["solver"]


def test_cli_deep_64_gpus_honours_the_limit(tmp_path):
    """500 InterFormer layers on 64 GPUs: with --time-limit 2 the search stops after its first solved candidate and says so."""
    w = load_workload("gem-h200").model_dump(mode="json", exclude_defaults=False)
    for b in w["blocks"]:
        if b["type"] == "interformer":
            b["num_layers"] = 500
    wf = tmp_path / "deep.yaml"
    wf.write_text(yaml.safe_dump(w))
    out = tmp_path / "plan.json"
    t = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "coplan.cli", "plan", "-t", "h200-superpod-4k", "--gpus", "64", "-w", str(wf),
                           "--time-limit", "2", "-o", str(out), "--quiet"], capture_output=True, text=True, timeout=300)
    wall = time.perf_counter() - t
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert wall < 120, wall  # generous for a slow shared 2-core machine (about 30 s here under load)
    plan = load_plan(out)
    assert plan.solver.candidates_solved >= 1
    assert plan.solver.notes and "stopped at the time limit" in plan.solver.notes[0]
    assert "solver note: stopped at the time limit" in proc.stdout
