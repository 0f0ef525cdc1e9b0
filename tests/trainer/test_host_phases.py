"""The train loop's per-phase host timer (summary.json host_phases)."""

from __future__ import annotations


def test_host_phases_charge_each_lap_to_its_phase(monkeypatch):
    import coplan.trainer.metrics as m

    clock = iter([0.0, 1.0, 3.0, 3.5, 10.0, 11.0, 11.25])
    monkeypatch.setattr(m.time, "perf_counter", lambda: next(clock))
    ph = m.HostPhases()
    ph.begin(0)
    ph.lap("data"), ph.lap("forward"), ph.lap("data")  # 1, 2, 0.5: a phase run twice in a step adds up
    ph.begin(1)
    ph.lap("data"), ph.lap("backward")  # 1, 0.25
    assert ph.per_step == {0: {"data": 1.5, "forward": 2.0}, 1: {"data": 1.0, "backward": 0.25}}
    # medians over the steps asked for; a phase a step did not run counts as 0 there
    assert ph.medians([0, 1]) == {"backward": 0.125, "data": 1.25, "forward": 1.0}
    assert ph.medians([1, 7]) == {"backward": 0.25, "data": 1.0}
