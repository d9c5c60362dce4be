"""JSON schemas that use a keyword xgrammar would not enforce are refused on the wire
(protocol/schema_keywords.py): the output would break them while the request ended as if it
followed them."""

from __future__ import annotations

import json
import re

import pytest
from test_tool_grammar import accepts, compiler  # noqa: F401 (a fixture)

from radixserve.protocol.wire import check_grammar

# (schema, a value that breaks it, what the refusal names)
UNENFORCED = [
    ({"type": "integer", "minimum": 10, "multipleOf": 5}, 42, "multipleOf"),
    ({"type": "number", "multipleOf": 0.5}, 0.3, "multipleOf"),
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, [1, 1], "uniqueItems"),
    ({"type": "array", "items": {"type": "integer"}, "contains": {"const": 3}}, [1], "contains"),
    ({"type": "object", "properties": {"n": {"not": {"type": "integer"}}}}, {"n": 5}, "n: not"),
    ({"allOf": [{"type": "integer"}, {"minimum": 5}]}, 1, "allOf"),
    ({"if": {"type": "integer"}, "then": {"minimum": 3}}, 1, "if"),
    ({"type": "object", "required": ["x"]}, {}, "required ['x']"),
    (
        {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["x"]},
        {"a": 1},
        "required ['x']",
    ),
    (
        {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "dependentRequired": {"a": ["b"]},
        },
        {"a": 1},
        "dependentRequired",
    ),
    ({"type": "array", "items": {"$ref": "http://example.com/n.json"}}, [1], "items: $ref"),
]


@pytest.mark.parametrize("schema, breaking, named", UNENFORCED)
def test_a_keyword_the_grammar_would_not_enforce_is_refused(compiler, schema, breaking, named):  # noqa: F811
    spec = json.dumps(schema)
    # xgrammar compiles it and lets the breaking value through (once a release enforces the
    # keyword, this fails: its refusal can go).
    assert accepts(compiler, spec, breaking)
    with pytest.raises(ValueError, match=re.escape(named)):
        check_grammar("json_schema", spec)


ENFORCED = [
    # pydantic's shapes: $defs and local $refs, a one-schema allOf, declared required fields
    {
        "$defs": {"City": {"type": "object", "properties": {"name": {"type": "string"}}}},
        "type": "object",
        "properties": {
            "home": {"allOf": [{"$ref": "#/$defs/City"}]},
            "visits": {"type": "integer", "minimum": 0},
            "every": {"type": "integer", "multipleOf": 5},
        },
        "required": ["home", "visits"],
    },
    # property names that are keywords elsewhere are names here
    {
        "type": "object",
        "properties": {"not": {"type": "string"}, "if": {"enum": [1, 2]}},
        "required": ["not", "if"],
    },
]
# as deep as the request's decoder takes (deeper is its "nested too deeply")
DEEP = '{"type": "array", "items": ' * 900 + '{"type": "integer"}' + "}" * 900


@pytest.mark.parametrize("spec", [json.dumps(schema) for schema in ENFORCED] + [DEEP])
def test_schemas_of_enforced_keywords_pass(spec) -> None:
    check_grammar("json_schema", spec)


def test_a_schema_too_deep_to_read_is_a_value_error() -> None:
    """A native generate's json_schema is a string, which the request's decoder never read:
    its RecursionError escaped as a bug (an internal error) instead of the client's error."""
    deep = '{"items":' * 5000 + "{}" + "}" * 5000  # 50 KB: within the size bound
    with pytest.raises(ValueError, match="nested too deeply"):
        check_grammar("json_schema", deep)
