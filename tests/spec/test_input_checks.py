"""Issue 25, file and spec side: every odd input a user can write is refused with one typed error naming
the file, the field path and the fix, or loaded as written (never rounded, never silently dropped)."""

from __future__ import annotations

import copy
import json
import time

import pytest
import yaml

from coplan.errors import AmbiguousNameError, BatchError, MismatchError, PresetNotFoundError, SpecError
from coplan.spec import Calibration, Plan, Topology, Workload, load_any, load_calibration, load_plan, load_topology, load_workload, parse_spec
from coplan.spec.loader import load_document, preset_path, yaml_load
from coplan.spec.topology import MAX_GPUS
from coplan.spec.workload import MAX_LOCAL_BATCH, MAX_TABLES, Batch
from tests.reliability.test_fuzz_specs import BASE_PLAN


def _preset(kind, name):
    return yaml_load(preset_path(kind, name).read_text())


def _issues(kind, doc, source="f.yaml"):
    with pytest.raises(SpecError) as e:
        parse_spec(kind, doc, source)
    return e.value.issues


def _write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text) if isinstance(text, str) else p.write_bytes(text)
    return p


# ---- numbers --------------------------------------------------------------------------------------------


def test_a_boolean_bandwidth_is_refused_not_read_as_one_byte_per_second(tmp_path):
    text = preset_path(Topology, "h200-superpod-1k").read_text()
    doc = yaml_load(text)
    doc["tiers"][0]["bw_bytes_per_s"] = True
    with pytest.raises(SpecError) as e:
        load_topology(_write(tmp_path, "t.yaml", yaml.safe_dump(doc)))
    assert e.value.issues == [("tiers[0].bw_bytes_per_s", "must be a number, not a boolean (true/false) (got True)")]
    assert "t.yaml" in str(e.value)


@pytest.mark.parametrize("value, why", [(True, "boolean"), (8.5, "will not round"), ("8", "without quotes"), (float("nan"), "whole")])
def test_counts_are_whole_numbers(value, why):
    doc = _preset(Topology, "h200-superpod-1k")
    doc["tiers"][0]["size"] = value
    [(path, reason)] = _issues(Topology, doc)
    assert path == "tiers[0].size" and why in reason


def test_a_whole_float_count_is_taken_exactly():
    doc = _preset(Workload, "gem-tiny")
    doc["tables"][0]["num_rows"] = 1e6  # YAML 1.2 reads 1e6 as a float
    w = parse_spec(Workload, doc, "w.yaml")
    assert w.tables[0].num_rows == 1_000_000 and isinstance(w.tables[0].num_rows, int)


def test_a_quoted_number_is_refused_with_the_fix():
    doc = _preset(Topology, "h200-superpod-1k")
    doc["gpu"]["hbm_bytes"] = "141e9"
    [(path, reason)] = _issues(Topology, doc)
    assert path == "gpu.hbm_bytes" and "without quotes" in reason


@pytest.mark.parametrize("field, value", [("bw_bytes_per_s", 0), ("bw_bytes_per_s", -1e9), ("latency_s", -1e-6),
                                          ("latency_s", 5.0), ("oversubscription", 0.5), ("latency_s", float("inf"))])
def test_meaningless_tier_figures_are_refused(field, value):
    doc = _preset(Topology, "h200-superpod-1k")
    doc["tiers"][1][field] = value
    assert _issues(Topology, doc)[0][0] == f"tiers[1].{field}"


def test_a_boolean_flag_is_not_a_number():
    doc = _preset(Topology, "h200-superpod-1k")
    doc["tiers"][0]["in_switch_reduction"] = 1
    assert _issues(Topology, doc)[0][0] == "tiers[0].in_switch_reduction"


# ---- physical plausibility --------------------------------------------------------------------------------


def test_an_embedding_dim_torchrec_cannot_run_is_refused():
    doc = _preset(Workload, "gem-tiny")
    doc["tables"][0]["dim"] = 3
    [(path, reason)] = _issues(Workload, doc)
    assert path == "tables[0].dim" and "multiple of 4" in reason and "TorchRec" in reason and "use 4" in reason
    doc = _preset(Workload, "gem-h200")
    doc["table_generator"]["dims"] = [64, 130]
    [(path, reason)] = _issues(Workload, doc)
    assert path == "table_generator.dims[1]" and "128 or 132" in reason


def test_a_history_cap_below_its_mean_is_refused():
    doc = _preset(Workload, "gem-tiny")
    doc["sequences"][0]["length"] = {"kind": "lognormal", "mean": 500, "sigma": 1.0, "max_len": 100}
    [(path, reason)] = _issues(Workload, doc)
    assert path == "sequences[0].length.max_len" and "below the mean 500" in reason
    doc["sequences"][0]["length"] = {"kind": "lognormal", "mean": 5, "sigma": 1.0, "min_len": 10, "max_len": 100}
    [(path, reason)] = _issues(Workload, doc)
    assert path == "sequences[0].length.min_len" and "above the mean 5" in reason


def test_a_global_batch_that_does_not_divide_is_refused_never_truncated():
    b = Batch(global_batch_size=100)
    with pytest.raises(BatchError, match="does not split evenly over 8 GPUs"):
        b.local(8)
    assert b.local(4) == 25 and not b.splits(8)


def test_batches_beyond_the_limit_are_refused():
    doc = _preset(Workload, "gem-h200")
    doc["batch"] = {"local_batch_size": 10**12}
    assert _issues(Workload, doc)[0][0] == "batch.local_batch_size"
    with pytest.raises(BatchError, match="over coplan's limit"):
        Batch(global_batch_size=MAX_LOCAL_BATCH * 4).local(2)


def test_table_and_gpu_limits_refused_at_load():
    doc = _preset(Workload, "gem-h200")
    doc["table_generator"]["num_tables"] = 1_000_000
    t0 = time.perf_counter()
    [(path, reason)] = _issues(Workload, doc)
    assert path == "table_generator.num_tables" and f"{MAX_TABLES}" in reason.replace(",", "")
    assert time.perf_counter() - t0 < 2
    doc["table_generator"]["num_tables"] = MAX_TABLES
    doc["tables"] = [{"name": "extra", "num_rows": 10, "dim": 4}]
    [(path, reason)] = _issues(Workload, doc)
    assert path == "table_generator.num_tables" and "exceed coplan's limit" in reason
    topo = _preset(Topology, "h200-superpod-1k")
    topo["tiers"][-1]["size"] = 10**6
    [(path, reason)] = _issues(Topology, topo)
    assert path == "tiers" and f"{MAX_GPUS:,}" in reason


def test_a_negative_generator_seed_is_refused():
    doc = _preset(Workload, "gem-h200")
    doc["table_generator"]["seed"] = -1
    assert _issues(Workload, doc)[0][0] == "table_generator.seed"


# ---- duplicate keys, binary and non-UTF-8 files -------------------------------------------------------------


def test_duplicate_yaml_keys_are_refused_with_line(tmp_path):
    text = preset_path(Topology, "h200-1gpu").read_text()
    text = text.replace("gpus_per_node:", "gpus_per_node: 8\ngpus_per_node:", 1)
    with pytest.raises(SpecError) as e:
        load_topology(_write(tmp_path, "t.yaml", text))
    msg = str(e.value)
    assert "t.yaml" in msg and "duplicate key 'gpus_per_node' at line" in msg and "first given at line" in msg


def test_duplicate_json_keys_are_refused_with_path(tmp_path):
    text = json.dumps(BASE_PLAN).replace('"world_size": 8', '"world_size": 8, "world_size": 16', 1)
    with pytest.raises(SpecError) as e:
        load_plan(_write(tmp_path, "plan.json", text))
    assert e.value.issues[0][0] == "world_size" and "duplicate key" in e.value.issues[0][1]


def test_yaml_merge_keys_may_be_overridden():
    assert yaml_load("a: &x {k: 1}\nb:\n  <<: *x\n  k: 2\n") == {"a": {"k": 1}, "b": {"k": 2}}


@pytest.mark.parametrize("load", [load_topology, load_workload, load_plan, load_calibration, load_any, load_document])
@pytest.mark.parametrize("name, data, why", [
    ("x.json", bytes(range(256)), "binary"),
    ("x.yaml", b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR", "binary"),
    ("x.yaml", "name: caf\u00e9\n".encode("latin-1"), "not UTF-8"),
    ("x.json", '{"a": 1}'.encode("utf-16"), "binary"),
])
def test_binary_and_non_utf8_files_are_named(tmp_path, load, name, data, why):
    p = _write(tmp_path, name, data)
    with pytest.raises(SpecError) as e:
        load(p)
    assert str(p) in str(e.value) and why in str(e.value)


def test_a_directory_is_named(tmp_path):
    with pytest.raises(SpecError, match="is a directory"):
        load_topology(tmp_path)


def test_an_alias_bomb_is_refused_quickly(tmp_path):
    lines = ["a0: &a0 [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 9)]
    t0 = time.perf_counter()
    with pytest.raises(SpecError, match="more than"):
        load_workload(_write(tmp_path, "bomb.yaml", "\n".join(lines) + "\n"))
    assert time.perf_counter() - t0 < 30


def test_a_utf8_bom_is_accepted(tmp_path):
    text = "\ufeff" + preset_path(Topology, "h200-1gpu").read_text()
    assert load_topology(_write(tmp_path, "bom.yaml", text)).name == "h200-1gpu"


# ---- presets and files -------------------------------------------------------------------------------------


def test_a_bare_name_that_is_both_a_preset_and_a_file_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "gem-tiny").write_text(preset_path(Workload, "gem-tiny").read_text().replace("global_batch_size: 64", "global_batch_size: 32"))
    with pytest.raises(AmbiguousNameError) as e:
        load_workload("gem-tiny")
    assert "./gem-tiny" in str(e.value) and str(preset_path(Workload, "gem-tiny")) in str(e.value)
    assert load_workload("./gem-tiny").batch.global_batch_size == 32
    assert load_workload(preset_path(Workload, "gem-tiny")).batch.global_batch_size == 64
    with pytest.raises(AmbiguousNameError):
        load_any("gem-tiny")


def test_a_path_is_only_a_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(PresetNotFoundError) as e:
        load_workload("configs/gem-tiny.yaml")
    assert "no such file" in str(e.value) and "give the bare name 'gem-tiny'" in str(e.value)
    (tmp_path / "gem-tiny.yaml").write_text(preset_path(Workload, "gem-tiny").read_text().replace("global_batch_size: 64", "global_batch_size: 32"))
    assert load_workload("gem-tiny.yaml").batch.global_batch_size == 32  # the file, named with its suffix
    assert load_workload("gem-tiny").batch.global_batch_size == 64  # the preset, by its bare name
    with pytest.raises(PresetNotFoundError, match=r"The file \./mine\.yaml exists"):
        (tmp_path / "mine.yaml").write_text("x: 1\n")
        load_workload("mine")


# ---- hand-edited plans -------------------------------------------------------------------------------------


def _plan_issue(edit):
    doc = copy.deepcopy(BASE_PLAN)
    edit(doc)
    return _issues(Plan, doc, "plan.json")[0]


@pytest.mark.parametrize("edit, path, words", [
    (lambda d: d.pop("tables"), "tables", "is empty, but workload"),
    (lambda d: d.update(tables=[]), "tables", "is empty, but workload"),
    (lambda d: d["tables"].pop(2), "tables", "have no sharding"),
    (lambda d: d["tables"][0].update(table="nope"), "tables[0].table", "not a table of workload"),
    (lambda d: d["tables"].append(dict(d["tables"][0])), "tables[6].table", "sharded twice"),
    (lambda d: d["predicted"].update(ops=[]), "predicted.ops", "is empty"),
    (lambda d: d["predicted"].update(step_time_s=0.08, compute_s=0.1), "predicted.compute_s", "exceeds step_time_s"),
    (lambda d: d["predicted"].update(local_mfu=0.9, scaling_ratio=0.4), "predicted.e2e_mfu", "local_mfu × scaling_ratio"),
    (lambda d: d["predicted"].update(peak_memory_bytes=5), "predicted.peak_memory_bytes", "not the sum"),
    (lambda d: d["predicted"].update(hbm_capacity_bytes=1e9), "predicted.hbm_capacity_bytes", "gpu.hbm_bytes"),
    (lambda d: d["predicted"].update(rank_ids=[9], rank_time_s=[0.1]), "predicted.rank_ids", "not ranks"),
    (lambda d: d["solver"].update(gap=3.0), "solver.gap", "exceeds 1"),
    (lambda d: d.update(world_size=4), "mesh", "covers 8 ranks"),
    (lambda d: d["mesh"]["axes"][0].update(size=8), "mesh.axes[0].size", "mesh.dense_shard is 4"),
    (lambda d: d["mesh"]["axes"][0].update(tiers=["ib"]), "mesh.axes[0].tiers", "not tiers of topology"),
    (lambda d: d["predicted"]["comms"][0].update(tiers=["ib"]), "predicted.comms[0].tiers", "not tiers"),
    (lambda d: d.update(calibration={"device": "NVIDIA H200", "collective_efficiency": {"ib": {"all_reduce": 0.9}}}),
     "calibration.collective_efficiency", "'ib'"),
    (lambda d: d["layers"].append(dict(d["layers"][0])), "layers", "more than once"),
])
def test_hand_edited_plans_are_refused(edit, path, words):
    got_path, reason = _plan_issue(edit)
    assert got_path == path and words in reason, (got_path, reason)


# ---- calibration against topology ---------------------------------------------------------------------------


def test_a_calibration_naming_a_tier_the_topology_lacks_is_refused():
    topo = load_topology("h200-superpod-1k")
    cal = Calibration(device="NVIDIA H200", collective_efficiency={"nvlink": {"all_reduce": 0.9}, "rail": {"all_to_all": 0.5}})
    assert cal.unknown_tiers(topo) == ["rail"]
    with pytest.raises(MismatchError, match=r"\['rail'\].*its tiers: \['nvlink', 'leaf', 'spine'\]"):
        cal.check_against(topo)
    with pytest.raises(MismatchError, match="rail"):
        cal.check_against(topo, force=True)  # forcing the device does not make an unknown tier mean something
    Calibration(device="NVIDIA H200", collective_efficiency={"leaf": {"all_reduce": 0.9}}).check_against(topo)
    with pytest.raises(MismatchError, match="fitted on 'NVIDIA H100'"):
        Calibration(device="NVIDIA H100").check_against(topo)
    Calibration(device="NVIDIA H100").check_against(topo, force=True)
    # one GPU prices no collective: a node's calibration (its compute and host terms) applies to it
    cal.check_against(load_topology("h200-1gpu"))


def test_a_plan_built_in_python_may_leave_tables_to_the_pricer_but_a_file_may_not(tmp_path):
    doc = copy.deepcopy(BASE_PLAN)
    doc["tables"] = []
    assert Plan.model_validate(doc).tables == ()  # the cost model prices its default placement
    p = tmp_path / "plan.json"
    p.write_text(json.dumps(doc))
    with pytest.raises(SpecError, match="tables: is empty"):
        load_plan(p)
