"""RunDir: the run directory's paths, and its loaders on summaries with and without recorded options."""

from __future__ import annotations

import json

import pytest

from coplan.spec import RunDir, RunDirError, RunOptions, RunResult, dump_spec, load_run_result


def _summary(**kw) -> RunResult:
    return RunResult(run_id="r1", world_size=2, steps=8, warmup_steps=2, **kw)


def test_paths_follow_the_layout(tmp_path):
    rd = RunDir(tmp_path / "r1")
    assert rd.name == "r1"
    assert rd.plan_path == tmp_path / "r1" / "plan.json"
    assert rd.config_path == tmp_path / "r1" / "config.json"
    assert rd.metrics_path == tmp_path / "r1" / "metrics.jsonl"
    assert rd.summary_path == tmp_path / "r1" / "summary.json"
    assert rd.traces_dir == tmp_path / "r1" / "traces"
    assert rd.trace_path(3) == tmp_path / "r1" / "traces" / "rank3.json"
    assert rd.profiled_steps_path == tmp_path / "r1" / "traces" / "steps.json"
    assert rd.checkpoints_dir == tmp_path / "r1" / "checkpoints"


def test_an_empty_directory_has_nothing_to_load(tmp_path):
    rd = RunDir(tmp_path)
    assert rd.result() is None and rd.options() is None
    assert rd.metrics() == [] and rd.trace_paths() == () and rd.rank_trace(0) is None
    assert rd.profiled_steps() is None


def test_summary_with_options_round_trips(tmp_path):
    rd = RunDir(tmp_path)
    opts = RunOptions(seq_chunk=32, compile="layers", attention_backend="triton")
    dump_spec(_summary(options=opts), rd.summary_path)
    assert rd.result().options == opts
    assert rd.options().seq_chunk == 32 and rd.options().compile == "layers"


def test_summary_without_options_loads_with_none(tmp_path):
    rd = RunDir(tmp_path)
    data = _summary().model_dump(mode="json")
    del data["options"]  # a summary written before the trainer recorded its options
    rd.summary_path.write_text(json.dumps(data))
    assert load_run_result(rd.summary_path).options is None
    assert rd.options() is None


def test_traces_in_rank_order_and_gzipped(tmp_path):
    rd = RunDir(tmp_path)
    rd.traces_dir.mkdir()
    for name in ("rank10.json", "rank2.json", "rank0.json.gz", "steps.json", "other.json"):
        (rd.traces_dir / name).write_text("{}")
    assert [p.name for p in rd.trace_paths()] == ["rank0.json.gz", "rank2.json", "rank10.json"]
    assert rd.rank_trace(0).name == "rank0.json.gz"
    assert rd.rank_trace(1) is None


def test_metrics_and_profiled_steps(tmp_path):
    rd = RunDir(tmp_path)
    rd.metrics_path.write_text('{"step": 0, "step_time_s": 0.1}\n\n{"step": 1, "step_time_s": 0.2}\n')
    assert [m["step"] for m in rd.metrics()] == [0, 1]
    rd.traces_dir.mkdir()
    rd.profiled_steps_path.write_text("[5, 6]")
    assert rd.profiled_steps() == [5, 6]
    rd.profiled_steps_path.write_text("not json")
    assert rd.profiled_steps() is None
    rd.metrics_path.write_text('{"step": 0}\n{broken\n')
    with pytest.raises(RunDirError, match=r"metrics.jsonl:2"):
        rd.metrics()
