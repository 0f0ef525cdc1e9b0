"""Mutations that turn a valid spec document into a malformed one (shared by the fuzz tests)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from hypothesis import strategies as st
from pydantic import BaseModel

from coplan.errors import SpecError
from coplan.spec import parse_spec

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


def _is_model_node(kind: type[BaseModel], doc: dict, path: tuple) -> bool:
    """Whether the mapping at ``path`` is a model (fixed keys), not a free-form ``dict[str, ...]``."""
    import typing

    if not path:
        return True
    if isinstance(path[-1], int):
        return True
    owner = _owner(kind, doc, path)
    if owner is None:
        return False
    field = owner.model_fields.get(path[-1])
    if field is None:
        return False
    ann = field.annotation
    while typing.get_origin(ann) is typing.Annotated:
        ann = typing.get_args(ann)[0]
    args = [a for a in typing.get_args(ann) if a is not type(None)] if typing.get_origin(ann) is not dict else []
    return typing.get_origin(ann) is not dict and not any(typing.get_origin(a) is dict for a in args)


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


def must_fail(kind: type[BaseModel], doc: Any) -> None:
    with pytest.raises(SpecError) as e:
        parse_spec(kind, doc, "fuzz.yaml")
    assert e.value.issues and "fuzz.yaml" in str(e.value)
    for path, reason in e.value.issues:
        assert isinstance(path, str) and reason


def may_fail(kind: type[BaseModel], doc: Any) -> None:
    try:
        parse_spec(kind, doc, "fuzz.yaml")
    except SpecError as e:
        assert e.issues and "fuzz.yaml" in str(e)


def mutate_certain(data, doc: dict, kind: type[BaseModel]) -> dict:
    doc = copy.deepcopy(doc)
    how = data.draw(st.sampled_from(["delete_required", "unknown_key", "scalar_to_mapping"]))
    if how == "delete_required":
        path = data.draw(st.sampled_from(_required_paths(doc, kind)))
        del _get(doc, path[:-1])[path[-1]]
    elif how == "unknown_key":
        dict_paths = [p for p in [()] + _paths(doc) if isinstance(_get(doc, p), dict) and _is_model_node(kind, doc, p)]
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


def mutate_junk(data, doc: dict) -> dict:
    doc = copy.deepcopy(doc)
    for _ in range(data.draw(st.integers(1, 3))):
        path = data.draw(st.sampled_from(_paths(doc)))
        parent = _get(doc, path[:-1])
        parent[path[-1]] = data.draw(JUNK)
    return doc
