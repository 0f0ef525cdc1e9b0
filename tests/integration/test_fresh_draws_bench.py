"""The fresh-draw benchmark's runner (benchmarks/fresh_draws_h200.py): draws run in order within the budget,
a partial result after each, and the summary over those measured."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
fresh = pytest.importorskip("fresh_draws_h200")


def test_run_all_reports_after_each_draw_and_skips_past_the_budget(tmp_path, monkeypatch):
    rows = [{"seed": s, "plan": f"draw-{s}.plan.json", "predicted_step_s": 0.010} for s in (1, 2, 3)]
    rows.append({"seed": 4, "plan": None})
    (tmp_path / "manifest.json").write_text(json.dumps({"seed": 1, "rows": rows}))
    clock = {"t": 0.0}
    monkeypatch.setattr(fresh.time, "perf_counter", lambda: clock["t"])

    def run_one(plan, runs_root, run_id, steps, timeout_s, train_args=()):
        clock["t"] += 55.0  # each draw takes 55 s of a 130 s budget: the third would start with 20 s left
        return {"exit": 0, "wall_s": 50.0, "measured_step_p50_s": 0.008, "measured_mfu": 0.3, "where": "device-bound"}

    monkeypatch.setattr(fresh, "run_one", run_one)
    seen = []
    out = fresh.run_all(tmp_path, None, 150.0, 130.0, tmp_path / "runs", after_each=lambda r: seen.append(len(r)))
    assert [r["seed"] for r in out] == [1, 2, 3, 4]
    assert "measured_step_p50_s" in out[0] and out[0]["step_error"] == pytest.approx(0.25)
    assert out[2]["skipped"] == "budget" and out[3]["skipped"] == "no plan"
    assert seen == [1, 2]  # a partial result after each draw that ran
    s = fresh.summarize(out)
    assert s["draws"] == 4 and s["ran"] == 2 and s["failed"] == 0 and s["median_local_mfu"] == pytest.approx(0.3)
