"""Tool calls enforced by constrained decoding: `tool_choice: "required"` or a named function in
/v1/chat/completions becomes a JSON schema built from the tools' parameter schemas (SGLang's
mapping), so the call is valid JSON even from a small model; and the constrained output read back
as calls.

- a named function: the output is that function's arguments, an object of its `parameters`;
- "required": the output is a non-empty array of {"name": <a tool>, "parameters": <its
  arguments>}, each item one of the tools' shapes.
"""

from __future__ import annotations

import json
from typing import Any

# A function without `parameters` (or with `{}`) takes none: OpenAI reads it as "an empty
# parameter list", and vLLM forces `{}`. Any object let the model invent arguments.
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}


def tool_call_schema(
    functions: dict[str, dict[str, Any] | None], choice: str | None, parallel: bool = True
) -> str:
    """The JSON schema (text) of the output for the tools' functions (name -> parameters schema,
    in order) when `choice` names one of them, or for "required" when it is None: one call
    unless `parallel` (OpenAI's parallel_tool_calls). ValueError names the field when the named
    function is not among the tools."""
    if not functions:
        raise ValueError("tool_choice: 'required' and a named function need tools")
    if choice is not None:
        if choice not in functions:
            raise ValueError(f"tool_choice: the function {choice!r} is not among the tools")
        return json.dumps(functions[choice] or NO_PARAMETERS)
    items = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [name]},
                "parameters": parameters or NO_PARAMETERS,
            },
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for name, parameters in functions.items()
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    return json.dumps(schema)


def constrained_tool_calls(text: str, choice: str | None) -> list[tuple[str, str]]:
    """(name, arguments as JSON text) of each call in a complete output constrained by
    tool_call_schema(..., choice). ValueError when it is not such an output (it was cut short by
    max_tokens or a stop string)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"the tool call output is incomplete JSON: {e}") from None
    if choice is not None:
        return [(choice, json.dumps(value))]
    if not isinstance(value, list):
        raise ValueError("the tool call output is not a list of calls")
    return [(call["name"], json.dumps(call["parameters"])) for call in value]
