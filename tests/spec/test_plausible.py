"""Fuzzing found absurd and unit-slipped numbers accepted, then crashing the planner or printing nonsense, and
workloads `coplan plan` accepted that `coplan train` refuses. The spec refuses both at load, naming the field,
the value, the unit and the fix; every shipped file and sampler draw still loads."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from coplan.errors import MismatchError, SpecError
from coplan.sample import FAMILIES, sample_workload
from coplan.spec import Calibration, Topology, Workload, list_presets, load_calibration, load_topology, load_workload, parse_spec
from coplan.spec.loader import preset_path, yaml_load
from coplan.trainer.features import check_buildable


def _preset(kind, name):
    return yaml_load(preset_path(kind, name).read_text())


def _issues(kind, doc):
    with pytest.raises(SpecError) as e:
        parse_spec(kind, doc, "f.yaml")
    return e.value.issues


def _set(doc, path, value):
    doc = copy.deepcopy(doc)
    node = doc
    keys = path.split(".")
    for k in keys[:-1]:
        node = node[int(k)] if isinstance(node, list) else node[k]
    if value is _DROP:
        del node[int(keys[-1])]
    else:
        node[int(keys[-1]) if isinstance(node, list) else keys[-1]] = value
    return doc


_DROP = object()


@pytest.mark.parametrize("path, value, field, words", [
    ("gpu.peak_flops_per_s.bf16", 989, "gpu.peak_flops_per_s.bf16", "write 989e12 for 989 TFLOP/s"),
    ("gpu.hbm_bytes", 141, "gpu.hbm_bytes", "implausibly small for bytes"),
    ("gpu.hbm_bytes", 141, "gpu.hbm_bytes", "write 141e9 for 141 GB"),
    ("gpu.hbm_bw_bytes_per_s", 4.8, "gpu.hbm_bw_bytes_per_s", "write 4.8e12 for 4.8 TB/s"),
    ("tiers.0.bw_bytes_per_s", 1e-6, "tiers[0].bw_bytes_per_s", "1e-06 B/s is below any real link (expect >= 1e6; values are bytes per second)"),
    ("gpu.peak_flops_per_s.fp32", 1e-3, "gpu.peak_flops_per_s.fp32", "below any real"),
    ("gpu.peak_flops_per_s.fp32", 1e-300, "gpu.peak_flops_per_s.fp32", "below any real"),
    ("gpu.peak_flops_per_s.bf16", 1e-300, "gpu.peak_flops_per_s.bf16", "below any real"),
    ("gpu.hbm_bw_bytes_per_s", 1e-300, "gpu.hbm_bw_bytes_per_s", "below any real"),
    ("gpu.hbm_bytes", 1e30, "gpu.hbm_bytes", "above any real accelerator's memory (expect <= 1e14"),
    ("tiers.0.collective_efficiency", {"all_reduce": 1e-300}, "tiers[0].collective_efficiency.all_reduce", "expect >= 0.001"),
])
def test_absurd_and_unit_slipped_topology_numbers_are_refused_naming_the_unit(path, value, field, words):
    issues = _issues(Topology, _set(_preset(Topology, "h200-hgx-2gpu"), path, value))
    assert len(issues) == 1 and issues[0][0] == field and words in issues[0][1], issues


def test_a_calibration_efficiency_below_the_fitters_floor_is_refused():
    doc = load_calibration(Path(__file__).parents[2] / "calibration" / "data" / "nvidia-h200.json").model_dump(mode="json")
    doc["op_classes"]["gemm"]["memory_efficiency"] = 1e-300
    issues = _issues(Calibration, doc)
    assert issues[0][0] == "op_classes.gemm.memory_efficiency" and "expect >= 1e-6" in issues[0][1]
    doc["op_classes"]["gemm"]["memory_efficiency"] = 1e-6  # the fitters' own floor still loads
    parse_spec(Calibration, doc, "f.json")


@pytest.mark.parametrize("path, value, field, words", [
    ("tables.2.pooling_factor", 1e18, "tables[2].pooling_factor", "above any real pooling factor"),
    ("tables.2.num_rows", 10**13, "tables[2].num_rows", "expect <= 1e12"),
    ("blocks.2.num_layers", 10000, "blocks[2].num_layers", "expect <= 512"),
    ("blocks.2.ffn_multiplier", 1e30, "blocks[2].ffn_multiplier", "above any real FFN width multiplier"),
])
def test_absurd_workload_numbers_are_refused(path, value, field, words):
    issues = _issues(Workload, _set(_preset(Workload, "gem-tiny"), path, value))
    assert issues[0][0] == field and words in issues[0][1], issues


@pytest.mark.parametrize("path, value, field, words", [
    ("blocks.4.tasks", [], "blocks[4].tasks", "nothing to train against"),
    ("blocks.4", _DROP, "blocks", "nothing to train against"),
    ("blocks.3.model_dim", 48, "blocks[3].model_dim", "must share one width (set model_dim: 32)"),
    ("blocks.4.input_dim", 7, "blocks[4].input_dim", "set input_dim: 32"),
    ("blocks.4.tasks", ["ctr", "ctr"], "blocks[4].tasks", "task names ['ctr']"),
])
def test_a_workload_the_trainer_refuses_is_refused_at_load(path, value, field, words):
    doc = _set(_preset(Workload, "gem-tiny"), path, value)
    issues = _issues(Workload, doc)
    assert issues[0][0] == field and words in issues[0][1], issues
    with pytest.raises(MismatchError):  # the trainer's own check agrees (built in Python: not held to it)
        check_buildable(Workload.model_validate(doc))


def test_every_shipped_spec_and_sampler_draw_still_loads():
    for name in list_presets(Topology):
        load_topology(name)
    for name in list_presets(Workload):
        check_buildable(load_workload(name))
    for family in FAMILIES:
        for seed in range(12):
            w = sample_workload(family, seed)
            parse_spec(Workload, w.model_dump(mode="json"), f"{family}-{seed}.yaml")
