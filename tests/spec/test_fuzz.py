"""Hypothesis: malformed topology and workload documents always fail with the typed error, never
another exception; valid documents round-trip through YAML and JSON unchanged.

Malformed documents come from mutating valid generated ones: a required key removed, an unknown
key added, a scalar replaced by a mapping (all certainly invalid), or arbitrary junk written into
a leaf or the text itself (then: accepted or rejected with SpecError, nothing else).
"""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from coplan.errors import SpecError
from coplan.spec import Topology, Workload, parse_spec
from coplan.spec.loader import _parse_text, yaml_dump, yaml_load
from tests.spec.mutations import may_fail, must_fail, mutate_certain, mutate_junk
from tests.spec.strategies import topology_docs, workload_docs

@settings(max_examples=200)
@given(doc=topology_docs(), data=st.data())
def test_malformed_topology_rejected_with_typed_error(doc, data):
    must_fail(Topology, mutate_certain(data, doc, Topology))


@settings(max_examples=200)
@given(doc=workload_docs(), data=st.data())
def test_malformed_workload_rejected_with_typed_error(doc, data):
    must_fail(Workload, mutate_certain(data, doc, Workload))


@settings(max_examples=100)
@given(doc=st.one_of(topology_docs(), workload_docs()), data=st.data())
def test_junk_in_leaves_never_escapes(doc, data):
    kind = Topology if "tiers" in doc else Workload
    may_fail(kind, mutate_junk(data, doc))


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
    may_fail(kind, parsed)


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
