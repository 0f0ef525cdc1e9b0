"""Bad files give one readable, typed error naming the file, the field path and the reason."""

from __future__ import annotations

import json

import pytest
import yaml

from coplan.errors import PresetNotFoundError, SpecError
from coplan.spec import Plan, Topology, Workload, load_topology, load_workload, parse_spec, spec_sha256
from coplan.spec.loader import load_any, preset_path, yaml_load


def _write(tmp_path, name, doc):
    p = tmp_path / name
    p.write_text(yaml.safe_dump(doc) if name.endswith(".yaml") else json.dumps(doc))
    return p


def _preset_doc(kind, name):
    return yaml_load(preset_path(kind, name).read_text())


def _topo():
    return _preset_doc(Topology, "h200-superpod-1k")


def test_unknown_key_suggests_nearest(tmp_path):
    doc = _topo()
    doc["tiers"][0]["bandwidth_bytes_per_s"] = doc["tiers"][0].pop("bw_bytes_per_s")
    p = _write(tmp_path, "t.yaml", doc)
    with pytest.raises(SpecError) as e:
        load_topology(p)
    msg = str(e.value)
    assert str(p) in msg
    assert "tiers[0].bandwidth_bytes_per_s" in msg and "did you mean 'bw_bytes_per_s'" in msg
    assert "tiers[0].bw_bytes_per_s: required field is missing" in msg


def test_negative_bandwidth(tmp_path):
    doc = _topo()
    doc["tiers"][1]["bw_bytes_per_s"] = -5
    with pytest.raises(SpecError) as e:
        load_topology(_write(tmp_path, "t.json", doc))
    assert e.value.issues == [("tiers[1].bw_bytes_per_s", "Input should be greater than 0 (got -5)")]


def test_wrong_type(tmp_path):
    doc = _topo()
    doc["tiers"][0]["size"] = "eight"
    with pytest.raises(SpecError) as e:
        load_topology(_write(tmp_path, "t.yaml", doc))
    assert e.value.issues[0][0] == "tiers[0].size"
    assert "integer" in e.value.issues[0][1]


def test_tier_size_that_does_not_divide(tmp_path):
    doc = _topo()
    doc["tiers"][1]["gpus_per_nic"] = 3
    with pytest.raises(SpecError) as e:
        load_topology(_write(tmp_path, "t.yaml", doc))
    assert e.value.issues[0][0] == "tiers[1].gpus_per_nic"
    assert "does not divide" in e.value.issues[0][1]
    doc = _topo()
    doc["gpus_per_node"] = 3
    with pytest.raises(SpecError) as e:
        load_topology(_write(tmp_path, "t.yaml", doc))
    assert e.value.issues[0][0] == "gpus_per_node"


def test_nan_and_inf_rejected(tmp_path):
    doc = _topo()
    p = tmp_path / "t.yaml"
    doc["tiers"][0]["latency_s"] = float("nan")
    doc["tiers"][0]["bw_bytes_per_s"] = float("inf")
    p.write_text(yaml.safe_dump(doc))
    with pytest.raises(SpecError) as e:
        load_topology(p)
    paths = [i[0] for i in e.value.issues]
    assert "tiers[0].latency_s" in paths and "tiers[0].bw_bytes_per_s" in paths


def test_workload_reference_errors(tmp_path):
    doc = _preset_doc(Workload, "gem-tiny")
    doc["blocks"][1]["sequence"] = "histroy"
    with pytest.raises(SpecError) as e:
        load_workload(_write(tmp_path, "w.yaml", doc))
    assert e.value.issues == [("blocks[1].sequence", "'histroy' is not one of the sequences ['history']")]
    doc["blocks"][1]["sequence"] = "history"
    doc["blocks"][3]["top_k"] = 9
    with pytest.raises(SpecError) as e:
        load_workload(_write(tmp_path, "w.yaml", doc))
    assert e.value.issues == [("blocks[3].top_k", "9 exceeds num_experts=4")]


def test_discriminator_errors_are_readable(tmp_path):
    doc = _preset_doc(Workload, "gem-tiny")
    doc["blocks"][0]["type"] = "dense_mlpp"
    with pytest.raises(SpecError) as e:
        load_workload(_write(tmp_path, "w.yaml", doc))
    path, reason = e.value.issues[0]
    assert path == "blocks[0]" or path.startswith("blocks[0]")
    assert "dense_mlp" in reason


def test_syntax_errors(tmp_path):
    p = tmp_path / "t.yaml"
    p.write_text("name: [unclosed\n")
    with pytest.raises(SpecError) as e:
        load_topology(p)
    assert "not valid YAML" in str(e.value) and "line" in str(e.value)
    p = tmp_path / "t.json"
    p.write_text("{bad json")
    with pytest.raises(SpecError, match="not valid JSON"):
        load_topology(p)
    p = tmp_path / "empty.yaml"
    p.write_text("")
    with pytest.raises(SpecError, match="empty file"):
        load_topology(p)
    p = tmp_path / "list.yaml"
    p.write_text("- 1\n- 2\n")
    with pytest.raises(SpecError, match="expected a mapping"):
        load_topology(p)


def test_unknown_preset_suggests():
    with pytest.raises(PresetNotFoundError, match="Did you mean 'gem-tiny'"):
        load_workload("gem-tinny")
    with pytest.raises(PresetNotFoundError):
        load_any("/no/such/file.yaml")


def test_plan_refuses_edited_topology_and_bad_mesh():
    topo = load_topology("h200-superpod-1k")
    work = load_workload("gem-tiny")
    base = {
        "topology": topo.model_dump(mode="json"),
        "workload": work.model_dump(mode="json"),
        "topology_sha256": spec_sha256(topo),
        "workload_sha256": spec_sha256(work),
        "world_size": 8,
        "mesh": {"dense_shard": 8, "sparse_shard": 8},
        "tables": [{"table": t.name, "sharding_type": "data_parallel"} for t in work.all_tables],
    }
    plan = parse_spec(Plan, base, "plan.json")
    assert plan.num_nodes == 1
    edited = json.loads(json.dumps(base))
    edited["topology"]["tiers"][0]["bw_bytes_per_s"] = 1e9
    with pytest.raises(SpecError) as e:
        parse_spec(Plan, edited, "plan.json")
    assert e.value.issues[0][0] == "topology_sha256"
    bad = dict(base, mesh={"dense_shard": 4, "dense_replicate": 2, "sparse_shard": 3})
    with pytest.raises(SpecError) as e:
        parse_spec(Plan, bad, "plan.json")
    assert e.value.issues[0][0] == "mesh.sparse_shard"
    big = dict(base, world_size=4096, mesh={"dense_shard": 4096, "sparse_shard": 4096})
    with pytest.raises(SpecError, match="exceeds the 1024 GPUs"):
        parse_spec(Plan, big, "plan.json")
    wrong_table = dict(base, tables=[{"table": "nope", "sharding_type": "table_wise", "ranks": [0]}])
    with pytest.raises(SpecError, match="not a table of workload"):
        parse_spec(Plan, wrong_table, "plan.json")


def test_every_field_has_a_docstring():
    from coplan.spec import SPEC_KINDS
    from pydantic import BaseModel

    seen: set[type] = set()
    missing: list[str] = []

    def visit(model: type[BaseModel]) -> None:
        if model in seen:
            return
        seen.add(model)
        for name, field in model.model_fields.items():
            if not field.description:
                missing.append(f"{model.__name__}.{name}")
            from coplan.spec.loader import _unwrap

            for sub in _unwrap(field.annotation):
                visit(sub)

    for kind in SPEC_KINDS.values():
        visit(kind)
    assert not missing, missing
    assert len(seen) > 20


def test_specs_are_frozen():
    t = load_topology("h200-1gpu")
    with pytest.raises(Exception):
        t.name = "x"  # type: ignore[misc]


@pytest.mark.parametrize("text", ["0\x850", "a\u2028b", "x\u2029", " \x85", "a\rb", "1e5"])
def test_yaml_round_trips_strings_with_yaml_line_breaks(text):
    # Found by the spec fuzzer: NEL in a single-quoted scalar was folded to a space on reading.
    from coplan.spec.loader import yaml_dump, yaml_load

    assert yaml_load(yaml_dump({"description": text})) == {"description": text}
