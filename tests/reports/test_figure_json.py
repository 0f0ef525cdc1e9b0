"""The sharding map and the waterfall's ledger pinned to stored JSON, so that reshaping the code that
builds them cannot change a figure unnoticed. The plans are the heuristic's (deterministic, no solver
time limit); numbers compare to 1e-9 relative, strings and structure exactly.

After a change that is meant to change these figures: ``COPLAN_UPDATE_GOLDEN=1 pytest tests/reports/test_figure_json.py``
rewrites the stored JSON (review its diff)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path

import pytest

from coplan.reports import sharding, waterfall
from coplan.reports.ledger import build_ledger

from tests.reports.plans import heuristic_plan

GOLDEN = Path(__file__).with_name("golden") / "figures.json"

CASES = {
    "gem-tiny@8": ("gem-tiny", "h200-superpod-1k", 8),
    "gem-h200@64": ("gem-h200", "h200-superpod-1k", 64),
}

LAUNCH_S = {"gemm": 1.5e-4, "attention": 2.5e-5, "embedding": 0.0, "elementwise": 3e-5}
"""A fixed launch split, so that the ledger's launch bar is pinned without the cost model's launch term."""


def _figure(fig) -> dict:
    d = fig.to_plotly_json()
    layout = {k: v for k, v in d["layout"].items() if k != "template"}  # plotly's theme, not ours
    return json.loads(json.dumps({"data": d["data"], "layout": layout}, default=_plain))


def _plain(x):
    if hasattr(x, "tolist"):
        return x.tolist()
    raise TypeError(type(x))


def _wide(plan):
    """The plan's tables over a 64-rank sparse group, shuffled across ranks (the binned and stacked-area paths)."""
    return plan.model_copy(update={
        "mesh": plan.mesh.model_copy(update={"sparse_shard": 64, "sparse_replicate": 1}),
        "tables": tuple(t.model_copy(update={"ranks": tuple((r * 7) % 64 for r in t.ranks) or t.ranks}) for t in plan.tables),
    })


def _current(monkeypatch) -> dict:
    out = {}
    for case, args in CASES.items():
        plan = heuristic_plan(*args)
        pred = plan.predicted
        out[f"{case}/sharding"] = _figure(sharding.sharding_map(plan))
        with monkeypatch.context() as m:
            m.setattr(sharding, "MAX_MARKERS", 0)
            out[f"{case}/sharding-dashes"] = _figure(sharding.sharding_map(plan))
        if plan.tables:
            out[f"{case}/sharding-wide"] = _figure(sharding.sharding_map(_wide(plan)))
            with monkeypatch.context() as m:
                m.setattr(sharding, "MAX_RANK_BARS", 16)
                out[f"{case}/sharding-binned"] = _figure(sharding.sharding_map(_wide(plan)))
        for name, launch in (("ledger", None), ("ledger-launch", LAUNCH_S)):
            led = build_ledger(plan, pred, launch_s=launch)
            out[f"{case}/{name}"] = json.loads(json.dumps(dataclasses.asdict(led)))
            out[f"{case}/{name}/waterfall"] = _figure(waterfall.mfu_waterfall(led))
    return out


def _compare(a, b, path: str) -> list[str]:
    if isinstance(a, float) or isinstance(b, float):
        if isinstance(a, (int, float)) and isinstance(b, (int, float)) and math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-15):
            return []
        return [f"{path}: {a!r} != {b!r}"]
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return [f"{path}: keys {sorted(set(a) ^ set(b))} differ"]
        return [d for k in a for d in _compare(a[k], b[k], f"{path}.{k}")]
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return [f"{path}: length {len(a)} != {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _compare(x, y, f"{path}[{i}]")]
    return [] if a == b else [f"{path}: {str(a)[:200]!r} != {str(b)[:200]!r}"]


def test_sharding_map_and_ledger_match_the_stored_json(monkeypatch):
    now = _current(monkeypatch)
    if os.environ.get("COPLAN_UPDATE_GOLDEN"):
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(json.dumps(now, indent=None, separators=(",", ":"), sort_keys=True) + "\n", encoding="utf-8")
        pytest.skip(f"rewrote {GOLDEN}")
    stored = json.loads(GOLDEN.read_text(encoding="utf-8"))
    assert set(now) == set(stored)
    diffs = [d for k in sorted(now) for d in _compare(now[k], stored[k], k)]
    assert not diffs, "\n".join(diffs[:20])
