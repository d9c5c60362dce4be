"""A JSON body decoded as the client meant it where the typed decoder refused only its spelling:
a null for a field (OpenAI's and SGLang's fields are "... or null"), or one value where a list
is wanted. Only a body refused so is read twice; one that mending leaves as it was keeps its
refusal (an unknown field stays one, null or not)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import msgspec

T = TypeVar("T")


def decode_mended(
    decoder: msgspec.json.Decoder[T],
    body: bytes,
    mend: Callable[[dict[str, Any]], dict[str, Any]],
    refusals: Iterable[str],
) -> T:
    """`body` decoded; where `decoder` refuses it with a message holding one of `refusals`,
    decoded once more as `mend` rewrites its object."""
    try:
        return decoder.decode(body)
    except msgspec.ValidationError as refused:
        if not any(spelling in str(refused) for spelling in refusals):
            raise
        raw = msgspec.json.decode(body)
        mended = mend(raw) if isinstance(raw, dict) else raw
        if mended == raw:
            raise
    return decoder.decode(msgspec.json.encode(mended))  # JSON's own rules: keys as strings


def without_nulls(fields: dict[str, Any], kind: type[msgspec.Struct]) -> dict[str, Any]:
    """`fields` less the nulls of `kind`'s own fields: each takes its default."""
    known = set(kind.__struct_fields__)
    return {k: v for k, v in fields.items() if v is not None or k not in known}
