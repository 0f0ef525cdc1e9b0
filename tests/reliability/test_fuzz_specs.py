"""Bad input everywhere (issue 9): plan, calibration and run files, malformed by hypothesis, are
either accepted or rejected with the typed SpecError naming file, field and reason; plans whose
hashes or schema version do not match are refused. (Topology and workload fuzzing lives in
tests/spec/test_fuzz.py; CLI-argument fuzzing in test_fuzz_cli.py.)
"""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coplan.errors import SpecError
from coplan.spec import Calibration, Plan, RunResult, load_topology, load_workload, parse_spec, spec_sha256
from tests.spec.mutations import may_fail, must_fail, mutate_certain, mutate_junk

COLLS = ["all_gather", "reduce_scatter", "all_reduce", "all_to_all", "p2p"]
frac = st.floats(min_value=0.01, max_value=1.0)


def _base_plan() -> dict:
    topo = load_topology("h200-superpod-1k")
    work = load_workload("gem-tiny")
    tables = []
    kinds = ["table_wise", "row_wise", "column_wise", "table_row_wise", "data_parallel"]
    for i, t in enumerate(work.all_tables):
        kind = kinds[i % len(kinds)]
        ranks = [] if kind == "data_parallel" else ([i % 8] if kind == "table_wise" else [0, 1, 2, 3])
        tables.append({"table": t.name, "sharding_type": kind, "ranks": ranks})
    return {
        "topology": topo.model_dump(mode="json"),
        "workload": work.model_dump(mode="json"),
        "topology_sha256": spec_sha256(topo),
        "workload_sha256": spec_sha256(work),
        "world_size": 8,
        "mesh": {"dense_shard": 4, "dense_replicate": 2, "expert_parallel": 2, "sparse_shard": 8, "sparse_replicate": 1,
                 "axes": [{"name": "dp_shard", "size": 4, "tiers": ["nvlink"]}, {"name": "dp_replicate", "size": 2, "tiers": ["nvlink"]}]},
        "tables": tables,
        "layers": [{"name": "interformer.0", "recompute": True}, {"name": "kunlun.1", "precision": "bf16"}],
        "balancing": {"policy": "karmarkar_karp", "expected_imbalance": 1.03},
        "predicted": {"step_time_s": 0.1, "compute_s": 0.08, "exposed_comm_s": 0.02, "model_flops_per_step": 1e12,
                      "local_mfu": 0.4, "scaling_ratio": 0.8, "e2e_mfu": 0.32,
                      "ops": [{"name": "interformer.0.gdpa", "op_class": "attention", "phase": "fwd", "time_s": 0.01}],
                      "comms": [{"name": "fsdp.all_gather", "collective": "all_gather", "group_size": 4, "bytes": 1e6, "time_s": 1e-3, "exposed_s": 0.0}],
                      "memory_bytes": {"parameters": 1e9}, "peak_memory_bytes": 1e9},
        "solver": {"status": "OPTIMAL", "objective_us": 100000, "best_bound_us": 99000, "gap": 0.01},
    }


BASE_PLAN = _base_plan()


@st.composite
def calibration_docs(draw) -> dict:
    return {
        "device": draw(st.sampled_from(["NVIDIA H200", "NVIDIA H100", "cpu"])),
        "created_utc": "2026-11-29T00:00:00Z",
        "versions": draw(st.dictionaries(st.sampled_from(["torch", "triton", "cuda"]), st.text(min_size=1, max_size=6), max_size=3)),
        "source_runs": draw(st.lists(st.text(min_size=1, max_size=8), max_size=3)),
        "op_classes": {
            oc: {"compute_efficiency": {"bf16": draw(frac)}, "memory_efficiency": draw(frac), "launch_overhead_s": draw(st.floats(0, 1e-3))}
            for oc in draw(st.lists(st.sampled_from(["gemm", "attention", "embedding", "elementwise"]), unique=True, min_size=1))
        },
        "collective_efficiency": {"nvlink": draw(st.dictionaries(st.sampled_from(COLLS), frac, min_size=1))},
        "fit_error": {"median_abs_rel_error": draw(st.floats(0, 1)), "max_abs_rel_error": draw(st.floats(0, 2)), "num_samples": draw(st.integers(0, 100))},
    }


@st.composite
def run_docs(draw) -> dict:
    p50 = draw(st.floats(1e-4, 10))
    return {
        "run_id": draw(st.from_regex(r"[a-z0-9\-]{1,12}", fullmatch=True)),
        "world_size": draw(st.integers(1, 64)),
        "steps": draw(st.integers(0, 1000)),
        "warmup_steps": draw(st.integers(0, 10)),
        "step_time": {"mean_s": p50, "p50_s": p50, "p90_s": p50, "p99_s": p50, "min_s": p50, "max_s": p50},
        "measured_mfu": draw(st.floats(0, 1)),
        "peak_memory_bytes": draw(st.lists(st.floats(0, 1e11), max_size=4)),
    }


def test_base_plan_is_valid():
    plan = parse_spec(Plan, BASE_PLAN, "plan.json")
    assert plan.world_size == 8 and len(plan.tables) == 6


@settings(max_examples=300)
@given(data=st.data())
def test_malformed_plans_rejected(data):
    must_fail(Plan, mutate_certain(data, BASE_PLAN, Plan))


@settings(max_examples=200)
@given(data=st.data())
def test_junk_plans_never_escape(data):
    may_fail(Plan, mutate_junk(data, BASE_PLAN))


@settings(max_examples=200)
@given(doc=calibration_docs(), data=st.data())
def test_malformed_calibrations_rejected(doc, data):
    parse_spec(Calibration, doc, "c.json")
    must_fail(Calibration, mutate_certain(data, doc, Calibration))


@settings(max_examples=100)
@given(doc=calibration_docs(), data=st.data())
def test_junk_calibrations_never_escape(doc, data):
    may_fail(Calibration, mutate_junk(data, doc))


@settings(max_examples=150)
@given(doc=run_docs(), data=st.data())
def test_malformed_runs_rejected(doc, data):
    parse_spec(RunResult, doc, "summary.json")
    must_fail(RunResult, mutate_certain(data, doc, RunResult))
    may_fail(RunResult, mutate_junk(data, doc))


@pytest.mark.parametrize(
    "edit, field",
    [
        (lambda d: d.update(schema_version=2), "schema_version"),
        (lambda d: d["topology"].update(name="other"), "topology_sha256"),
        (lambda d: d["workload"]["batch"].update(global_batch_size=65), "workload_sha256"),
        (lambda d: d.update(world_size=16), "mesh"),
        (lambda d: d.update(world_size=2048, mesh={"dense_shard": 2048, "sparse_shard": 2048}), "world_size"),
    ],
)
def test_mismatched_plans_refused(edit, field):
    doc = json.loads(json.dumps(BASE_PLAN))
    edit(doc)
    with pytest.raises(SpecError) as e:
        parse_spec(Plan, doc, "plan.json")
    assert e.value.issues[0][0] == field, e.value.issues
