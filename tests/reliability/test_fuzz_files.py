"""Every file a user can hand coplan, edited the ways people edit files (issue 25): each leaf of a topology,
workload, calibration and plan replaced by a boolean, NaN, infinity, a negative, zero, a huge number, a
quoted number, a fraction, null, a list or a mapping; each field removed, each list and mapping emptied,
values swapped between sibling fields; keys given twice in YAML and JSON; binary garbage and truncated
text through every loader. Each case ends in the typed SpecError naming the file and field, or in a
load that kept every value exactly as written (never rounded, never dropped); nothing else.

The cases are enumerated, not drawn: the same few thousand run everywhere, in a few seconds.
"""

from __future__ import annotations

import copy
import json
import math
import random
from typing import Any

import pytest

from coplan.errors import CoplanError, SpecError
from coplan.spec import Calibration, Plan, Topology, Workload, load_any, load_calibration, load_plan, load_topology, load_workload, parse_spec
from coplan.spec.loader import load_document, preset_path, yaml_dump, yaml_load
from tests.reliability.test_fuzz_specs import BASE_PLAN
from tests.spec.mutations import _get, _paths, _required_paths, must_fail

CALIBRATION = {
    "device": "NVIDIA H200",
    "created_utc": "2026-11-29T00:00:00Z",
    "versions": {"torch": "2.13", "triton": "3.6"},
    "source_runs": ["runs/a", "runs/b"],
    "op_classes": {
        "gemm": {"compute_efficiency": {"bf16": 0.7, "fp8": 0.6}, "memory_efficiency": 0.8, "launch_overhead_s": 4e-6},
        "embedding": {"memory_efficiency": 0.5, "launch_overhead_s": 6e-6},
    },
    "collective_efficiency": {"nvlink": {"all_reduce": 0.8, "all_to_all": 0.6}},
    "host_launch_s": 2e-5, "host_sample_s": 1e-6, "device_step_factor": 1.1, "host_op_median_us": {"aten::mm": 12.5},
    "lookup_id_latency_s": 1e-9, "unfused_memory_efficiency": 0.4, "unfused_kernel_s": 5e-6,
    "fit_error": {"median_abs_rel_error": 0.05, "max_abs_rel_error": 0.2, "per_op_class": {"gemm": 0.03}, "num_samples": 40},
}


def _preset(kind, name) -> dict:
    return yaml_load(preset_path(kind, name).read_text())


# (model, document, subtrees left out: the plan's embedded topology and workload are hash-checked and
# fuzzed as files of their own)
BASES: dict[str, tuple[type, dict, tuple[str, ...]]] = {
    "topology": (Topology, _preset(Topology, "h200-superpod-1k"), ()),
    "workload": (Workload, _preset(Workload, "gem-tiny"), ()),
    "generated": (Workload, _preset(Workload, "gem-h200"), ()),
    "calibration": (Calibration, CALIBRATION, ()),
    "plan": (Plan, BASE_PLAN, ("topology", "workload")),
}

LEAF_EDITS: dict[str, Any] = {
    "true": True, "false": False, "nan": math.nan, "inf": math.inf, "-inf": -math.inf, "negative": None, "zero": 0,
    "huge_float": 1e300, "huge_int": 10**30, "quoted": None, "fraction": None, "null": None, "list": [1], "map": {"a": 1},
}
CERTAIN = {"nan", "inf", "-inf", "list", "map"}
"""Edits that make any leaf invalid."""
CERTAIN_FOR_NUMBERS = {"true", "false", "quoted"}
"""Edits that make a numeric leaf invalid (a boolean or a string is never a number)."""


def _own_paths(name: str) -> list[tuple]:
    _, doc, skip = BASES[name]
    return [p for p in _paths(doc) if not (p and p[0] in skip)]


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _edited(value: Any, edit: str) -> Any:
    if edit == "negative":
        return -abs(value) - 1 if _is_number(value) else -1
    if edit == "quoted":
        return str(value)
    if edit == "fraction":
        return value + 0.5 if _is_number(value) else 0.5
    return copy.deepcopy(LEAF_EDITS[edit])


def _same(a: Any, b: Any) -> bool:
    if _is_number(a) and _is_number(b):
        return a == b if isinstance(a, int) and isinstance(b, int) else math.isclose(a, b, rel_tol=1e-15)
    return a == b


def _kept(model: Any, path: tuple, value: Any) -> None:
    """A successful load kept the edited value as written (no rounding, no coercion of its kind)."""
    dumped = model.model_dump(mode="python")
    try:
        got = _get(dumped, path)
    except (KeyError, IndexError, TypeError):
        return  # e.g. a dict key that the model stores elsewhere
    if isinstance(value, (dict, list)) or value is None:
        return
    assert _same(got, value) and (type(got) is type(value) or (_is_number(got) and _is_number(value))), (path, value, got)


def _check(kind: type, doc: dict, certain: bool, path: tuple | None = None, value: Any = None) -> None:
    if certain:
        must_fail(kind, doc)
        return
    try:
        model = parse_spec(kind, doc, "fuzz.yaml")
    except SpecError as e:
        assert e.issues and "fuzz.yaml" in str(e)
        for p, reason in e.issues:
            assert isinstance(p, str) and reason
        return
    if path is not None:
        _kept(model, path, value)


def _leaf_cases() -> list:
    out = []
    for name in BASES:
        doc = BASES[name][1]
        for path in _own_paths(name):
            if isinstance(_get(doc, path), (dict, list)):
                continue
            for edit in LEAF_EDITS:
                out.append(pytest.param(name, path, edit, id=f"{name}-{_show(path)}-{edit}"))
    return out


def _show(path: tuple) -> str:
    return ".".join(str(p) for p in path)


@pytest.mark.parametrize("name, path, edit", _leaf_cases())
def test_leaf_edits(name, path, edit):
    kind, base, _ = BASES[name]
    doc = copy.deepcopy(base)
    old = _get(doc, path)
    value = _edited(old, edit)
    _get(doc, path[:-1])[path[-1]] = value
    certain = edit in CERTAIN or (edit in CERTAIN_FOR_NUMBERS and _is_number(old))
    _check(kind, doc, certain, path, value)


def _structure_cases() -> list:
    out = []
    for name in BASES:
        kind, doc, _ = BASES[name]
        required = set(_required_paths(doc, kind))
        for path in _own_paths(name):
            node = _get(doc, path)
            out.append(pytest.param(name, path, "delete", path in required, id=f"{name}-{_show(path)}-delete"))
            if isinstance(node, (dict, list)):
                out.append(pytest.param(name, path, "empty", False, id=f"{name}-{_show(path)}-empty"))
                out.append(pytest.param(name, path, "scalar", True, id=f"{name}-{_show(path)}-scalar"))
    return out


@pytest.mark.parametrize("name, path, edit, certain", _structure_cases())
def test_structure_edits(name, path, edit, certain):
    kind, base, _ = BASES[name]
    doc = copy.deepcopy(base)
    parent = _get(doc, path[:-1])
    if edit == "delete":
        if isinstance(parent, list):
            parent.pop(path[-1])
        else:
            del parent[path[-1]]
    elif edit == "empty":
        parent[path[-1]] = type(parent[path[-1]])()
    else:
        parent[path[-1]] = 7
    _check(kind, doc, certain)


def _swap_cases() -> list:
    out = []
    for name in BASES:
        doc = BASES[name][1]
        for path in [()] + _own_paths(name):
            node = _get(doc, path)
            if not isinstance(node, dict):
                continue
            keys = [k for k, v in node.items() if not isinstance(v, (dict, list)) and (path + (k,))[0] not in BASES[name][2]]
            for i, a in enumerate(keys):
                for b in keys[i + 1:]:
                    if node[a] != node[b]:
                        out.append(pytest.param(name, path, a, b, id=f"{name}-{_show(path) or 'top'}-{a}<->{b}"))
    return out


@pytest.mark.parametrize("name, path, a, b", _swap_cases())
def test_values_swapped_between_fields(name, path, a, b):
    kind, base, _ = BASES[name]
    doc = copy.deepcopy(base)
    node = _get(doc, path)
    node[a], node[b] = node[b], node[a]
    _check(kind, doc, False, path + (a,), node[a])


# ---- keys given twice -------------------------------------------------------------------------------------

_MARK = "__coplan_fuzz_duplicate__"


def _dup_cases() -> list:
    out = []
    for name in BASES:
        doc = BASES[name][1]
        for path in [()] + _own_paths(name):
            node = _get(doc, path)
            if isinstance(node, dict) and node:
                for fmt in ("yaml", "json"):
                    out.append(pytest.param(name, path, fmt, id=f"{name}-{_show(path) or 'top'}-{fmt}"))
    return out


@pytest.mark.parametrize("name, path, fmt", _dup_cases())
def test_duplicate_keys_refused(name, path, fmt, tmp_path):
    kind, base, _ = BASES[name]
    doc = copy.deepcopy(base)
    node = _get(doc, path)
    key = next(iter(node))
    pairs = list(node.items()) + [(key, node[key])]  # the same key, even with the same value
    obj = "{" + ", ".join(f"{json.dumps(str(k))}: {json.dumps(v)}" for k, v in pairs) + "}"
    if path:
        _get(doc, path[:-1])[path[-1]] = _MARK
        text = (json.dumps(doc) if fmt == "json" else yaml_dump(doc)).replace(json.dumps(_MARK) if fmt == "json" else _MARK, obj, 1)
    else:
        text = obj
    p = tmp_path / f"f.{fmt}"
    p.write_text(text)
    loader = {Topology: load_topology, Workload: load_workload, Plan: load_plan, Calibration: load_calibration}[kind]
    with pytest.raises(SpecError) as e:
        loader(p)
    assert str(p) in str(e.value) and f"duplicate key '{key}'" in str(e.value)
    if fmt == "json":
        assert e.value.issues[0][0] == _show_json(path + (key,))


def _show_json(path: tuple) -> str:
    return "".join(f"[{p}]" if isinstance(p, int) else (f".{p}" if i else str(p)) for i, p in enumerate(path))


# ---- garbage through every loader ----------------------------------------------------------------------------

LOADERS = {"topology": load_topology, "workload": load_workload, "plan": load_plan, "calibration": load_calibration,
           "any": load_any, "document": load_document}


def _garbage(seed: int) -> bytes:
    rng = random.Random(seed)
    n = rng.choice([1, 7, 64, 1000])
    data = bytes(rng.randrange(256) for _ in range(n))
    if seed % 2:
        data = b"name: x\n" + data  # a text start, then garbage
    return data if any(b > 127 or b == 0 for b in data) else data + b"\xff"


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("suffix", [".yaml", ".json", ""])
@pytest.mark.parametrize("loader", list(LOADERS))
def test_binary_garbage_names_the_file(loader, suffix, seed, tmp_path):
    p = tmp_path / f"garbage{suffix}"
    p.write_bytes(_garbage(seed))
    with pytest.raises(SpecError) as e:
        LOADERS[loader](str(p))
    assert str(p) in str(e.value) and ("binary" in str(e.value) or "UTF-8" in str(e.value))


def _truncation_cases() -> list:
    out = []
    for name in ("topology", "workload", "calibration", "plan"):
        for fmt in ("yaml", "json"):
            for cut in (0.1, 0.33, 0.5, 0.77, 0.999):
                out.append(pytest.param(name, fmt, cut, id=f"{name}-{fmt}-{cut}"))
    return out


@pytest.mark.parametrize("name, fmt, cut", _truncation_cases())
def test_truncated_files_fail_typed(name, fmt, cut, tmp_path):
    kind, doc, _ = BASES[name]
    text = json.dumps(doc, indent=1) if fmt == "json" else yaml_dump(doc)
    p = tmp_path / f"cut.{fmt}"
    p.write_text(text[: int(len(text) * cut)])
    try:
        load_any(p)
    except CoplanError as e:
        assert str(p) in str(e)
