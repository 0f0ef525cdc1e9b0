"""Hypothesis: malformed topology and workload documents always fail with the typed error, never
another exception; valid documents round-trip through YAML and JSON unchanged.

Malformed documents come from mutating valid generated ones: a required key removed, an unknown
key added, a scalar replaced by a mapping (all certainly invalid), or arbitrary junk written into
a leaf or the text itself (then: accepted or rejected with SpecError, nothing else).
"""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from coplan.errors import SpecError
from coplan.spec import Topology, Workload, parse_spec
from coplan.spec.loader import _parse_text, yaml_dump, yaml_load
from tests.spec.strategies import topology_docs, workload_docs

JUNK = st.one_of(
    st.none(), st.booleans(), st.integers(-(10**30), 10**30), st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12), st.lists(st.integers(), max_size=3), st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
)


def _paths(doc: Any, prefix: tuple = ()) -> list[tuple]:
    """Every path to a dict entry or list item in a document."""
    out = []
    if isinstance(doc, dict):
        for k, v in doc.items():
            out.append(prefix + (k,))
            out.extend(_paths(v, prefix + (k,)))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            out.append(prefix + (i,))
            out.extend(_paths(v, prefix + (i,)))
    return out


def _get(doc: Any, path: tuple) -> Any:
    for p in path:
        doc = doc[p]
    return doc


def _required_paths(doc: dict, kind: type[BaseModel]) -> list[tuple]:
    """Paths of keys that the model requires (so deleting one is certainly invalid)."""
    out = []
    for path in _paths(doc):
        if not isinstance(path[-1], str):
            continue
        parent = _get(doc, path[:-1])
        if not isinstance(parent, dict):
            continue
        owner = _owner(kind, doc, path)
        if owner is None:
            continue
        field = owner.model_fields.get(path[-1])
        if field is not None and field.is_required():
            out.append(path)
    return out


def _owner(kind: type[BaseModel], doc: dict, path: tuple) -> type[BaseModel] | None:
    """The model class whose field the last key of ``path`` is (following discriminators)."""
    from coplan.spec.loader import _unwrap

    model: type[BaseModel] | None = kind
    node: Any = doc
    for p in path[:-1]:
        node = node[p]
        if isinstance(p, int):
            continue
        if model is None:
            return None
        field = model.model_fields.get(p)
        if field is None:
            return None
        cands = _unwrap(field.annotation)
        if not cands:
            return None
        model = cands[0]
        if len(cands) > 1 and isinstance(node, (dict, list)):
            sample = node if isinstance(node, dict) else None
            if sample is None:
                # a list of unions: pick by the item on the path
                return _owner_in_list(cands, doc, path)
            model = _pick(cands, sample)
    return model


def _owner_in_list(cands, doc, path):
    # path = (..., list_key, index, key): pick by the item's tag
    node = doc
    for p in path[:-1]:
        node = node[p]
    return _pick(cands, node) if isinstance(node, dict) else None


def _pick(cands, item: dict):
    for c in cands:
        for tag in ("type", "kind"):
            f = c.model_fields.get(tag)
            if f is not None and item.get(tag) == f.default:
                return c
    return cands[0] if len(cands) == 1 else None


def _must_fail(kind: type[BaseModel], doc: Any) -> None:
    with pytest.raises(SpecError) as e:
        parse_spec(kind, doc, "fuzz.yaml")
    assert e.value.issues and "fuzz.yaml" in str(e.value)
    for path, reason in e.value.issues:
        assert isinstance(path, str) and reason


def _may_fail(kind: type[BaseModel], doc: Any) -> None:
    try:
        parse_spec(kind, doc, "fuzz.yaml")
    except SpecError as e:
        assert e.issues and "fuzz.yaml" in str(e)


def _mutate_certain(data, doc: dict, kind: type[BaseModel]) -> dict:
    doc = copy.deepcopy(doc)
    how = data.draw(st.sampled_from(["delete_required", "unknown_key", "scalar_to_mapping"]))
    if how == "delete_required":
        path = data.draw(st.sampled_from(_required_paths(doc, kind)))
        del _get(doc, path[:-1])[path[-1]]
    elif how == "unknown_key":
        dict_paths = [p for p in [()] + _paths(doc) if isinstance(_get(doc, p), dict)]
        path = data.draw(st.sampled_from(dict_paths))
        parent = _get(doc, path)
        base = data.draw(st.sampled_from(sorted(parent) or ["key"]))
        key = base + data.draw(st.sampled_from(["_x", "s", "2", "_bytes"]))
        parent[key] = 1
    else:
        scalar_paths = [p for p in _paths(doc) if not isinstance(_get(doc, p), (dict, list))]
        path = data.draw(st.sampled_from(scalar_paths))
        _get(doc, path[:-1])[path[-1]] = {"unexpected": [1, 2]}
    return doc


def _mutate_junk(data, doc: dict) -> dict:
    doc = copy.deepcopy(doc)
    for _ in range(data.draw(st.integers(1, 3))):
        path = data.draw(st.sampled_from(_paths(doc)))
        parent = _get(doc, path[:-1])
        parent[path[-1]] = data.draw(JUNK)
    return doc


@settings(max_examples=200)
@given(doc=topology_docs(), data=st.data())
def test_malformed_topology_rejected_with_typed_error(doc, data):
    _must_fail(Topology, _mutate_certain(data, doc, Topology))


@settings(max_examples=200)
@given(doc=workload_docs(), data=st.data())
def test_malformed_workload_rejected_with_typed_error(doc, data):
    _must_fail(Workload, _mutate_certain(data, doc, Workload))


@settings(max_examples=100)
@given(doc=st.one_of(topology_docs(), workload_docs()), data=st.data())
def test_junk_in_leaves_never_escapes(doc, data):
    kind = Topology if "tiers" in doc else Workload
    _may_fail(kind, _mutate_junk(data, doc))


@settings(max_examples=100)
@given(doc=st.one_of(topology_docs(), workload_docs()), data=st.data())
def test_corrupted_text_never_escapes(doc, data):
    kind = Topology if "tiers" in doc else Workload
    text = yaml_dump(doc)
    cut = data.draw(st.integers(0, len(text)))
    junk = data.draw(st.text(alphabet=":-[]{}\n \t#&*!|>'\"%@`,?0a", max_size=6))
    corrupted = text[:cut] + junk + text[cut + data.draw(st.integers(0, 5)) :]
    try:
        parsed = _parse_text(corrupted, "fuzz.yaml")
    except SpecError:
        return
    _may_fail(kind, parsed)


@settings(max_examples=60)
@given(doc=st.one_of(topology_docs(), workload_docs()))
def test_valid_documents_round_trip(doc):
    kind = Topology if "tiers" in doc else Workload
    model = parse_spec(kind, doc, "gen.yaml")
    dumped = model.model_dump(mode="json")
    via_json = parse_spec(kind, json.loads(json.dumps(dumped)), "gen.json")
    via_yaml = parse_spec(kind, yaml_load(yaml_dump(dumped)), "gen.yaml")
    assert via_json == model
    assert via_yaml == model
    assert via_yaml.model_dump(mode="json") == dumped
