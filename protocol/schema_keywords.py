"""JSON Schema keywords that the grammar compiler (xgrammar) takes without enforcing them: the
output would break the schema while the request finished as if it followed it. A schema that
uses one is refused instead (vLLM falls back to another grammar backend for such schemas; we
have one backend). The list comes from trying each keyword against xgrammar's own matcher."""

from __future__ import annotations

from typing import Any

# Keywords the compiler drops.
_IGNORED = (
    "not",
    "if",
    "then",
    "else",
    "contains",
    "minContains",
    "maxContains",
    "dependentRequired",
    "dependentSchemas",
    "dependencies",
)
_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")

# Where a schema holds other schemas: by name, in a list, or as the one value (those under the
# keywords above are never reached: their schema is refused first).
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_SCHEMA_VALUES = (
    "items",
    "additionalItems",
    "additionalProperties",
    "unevaluatedItems",
    "unevaluatedProperties",
    "propertyNames",
)


def unenforced_keyword(schema: Any) -> str | None:
    """Where `schema` uses a keyword the grammar would not enforce, and which: None if none.
    Walks every subschema without recursion (a schema may nest deeper than Python's stack)."""
    stack: list[tuple[Any, str]] = [(schema, "")]
    while stack:
        node, path = stack.pop()
        if not isinstance(node, dict):
            continue
        problem = _problem(node)
        if problem is not None:
            return f"{path or 'the schema'}: {problem}, which the grammar would not enforce"
        within = f"{path}." if path else ""
        for key in _SCHEMA_MAPS:
            if isinstance(node.get(key), dict):
                stack += [(sub, f"{within}{key}.{name}") for name, sub in node[key].items()]
        for key in _SCHEMA_LISTS:
            if isinstance(node.get(key), list):
                stack += [(sub, f"{within}{key}[{i}]") for i, sub in enumerate(node[key])]
        stack += [(node[key], f"{within}{key}") for key in _SCHEMA_VALUES if key in node]
    return None


def _problem(node: dict[str, Any]) -> str | None:
    ignored = next((key for key in _IGNORED if key in node), None)
    if ignored is not None:
        return ignored
    if node.get("uniqueItems") is True:
        return "uniqueItems"
    if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
        return "allOf with more than one schema"
    if "multipleOf" in node and (
        node.get("type") != "integer" or any(bound in node for bound in _BOUNDS)
    ):
        return "multipleOf (enforced only on an integer without bounds)"
    ref = node.get("$ref")
    if isinstance(ref, str) and not ref.startswith("#"):
        return f"$ref {ref!r} (only references inside the schema, #..., are followed)"
    required, properties = node.get("required"), node.get("properties")
    if isinstance(required, list):
        declared = properties if isinstance(properties, dict) else {}
        undeclared = [name for name in required if name not in declared]
        if undeclared:
            return f"required {undeclared!r} without a schema in properties"
    return None
